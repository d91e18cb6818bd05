"""Distribution shift and out-of-distribution inputs for the digits benchmarks, built offline.

Experiment constructions, not data that ships with the library (`pyro_subspace.datasets`):

- `rotated_digits` (with `rotate_images`): the test digits rotated by an angle, the rotated-MNIST
  shift of Subnetwork Inference (Fig. 4) and MoLA (Fig. 2) at 8x8 scale;
- `ood_digits`: uniform noise images, pixel-permuted digits, scaled ``δ·x`` (MoLA Table 1, B.1);
- `digits_split_classes`: some classes in distribution, the others as OOD inputs.

Used by ``benchmarks/ood_digits.py``, ``benchmarks/patches_digits.py`` and tutorials 03-04;
tested in ``tests/test_benchmarks_ood.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from sklearn.datasets import load_digits

from pyro_subspace.datasets import Dataset, from_arrays

__all__ = ["OOD_KINDS", "digits_split_classes", "ood_digits", "rotate_images", "rotated_digits"]


def rotate_images(images: torch.Tensor, angle: float, side: int = 8) -> torch.Tensor:
    """Rotate flattened square images counter-clockwise by ``angle`` degrees about their centre.

    Bilinear interpolation (``torch.nn.functional.grid_sample``, ``align_corners=False``);
    pixels rotated in from outside the image are 0 (blank, in raw pixel units).

    Args:
        images: shape ``(N, side·side)`` (raw pixel values, not standardised).
        angle: degrees; 0 returns a copy.
        side: the image side length (8 for scikit-learn's digits).

    Returns:
        Shape ``(N, side·side)``, same dtype.
    """
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        raise TypeError(f"images: expected a floating tensor (N, {side}*{side}), got {images!r}")
    if images.dim() != 2 or images.shape[1] != side * side:
        raise ValueError(f"images: expected shape (N, {side * side}), got {tuple(images.shape)}")
    if isinstance(angle, bool) or not isinstance(angle, (int, float)) or not math.isfinite(angle):
        raise ValueError(f"angle: expected a finite number of degrees, got {angle!r}")
    if angle == 0:
        return images.clone()
    rad = math.radians(angle)
    c, s = math.cos(rad), math.sin(rad)
    # grid_sample maps output (x right, y down) coordinates to input ones: the inverse
    # rotation, written for a y axis that points down, turns the picture counter-clockwise.
    theta = images.new_tensor([[c, -s, 0.0], [s, c, 0.0]]).expand(images.shape[0], 2, 3)
    img = images.reshape(-1, 1, side, side)
    grid = torch.nn.functional.affine_grid(theta, list(img.shape), align_corners=False)
    out = torch.nn.functional.grid_sample(img, grid, align_corners=False, padding_mode="zeros")
    return out.reshape(images.shape)


def rotated_digits(data: Dataset, angle: float) -> torch.Tensor:
    """The test inputs of a `digits` dataset rotated by ``angle`` degrees (distribution shift).

    The standardised test pixels are mapped back to raw values, rotated with `rotate_images`
    and standardised again with the training statistics, as in the rotated-MNIST shift
    benchmarks of Subnetwork Inference (Fig. 4) and MoLA (Fig. 2), at 8x8 scale.

    Returns:
        Shape ``(N_test, 64)``, float32, comparable with ``data.x_test``.
    """
    if not isinstance(data, Dataset) or data.name != "digits":
        raise ValueError("data: expected a Dataset returned by datasets.digits()")
    if data.x_mean is None:
        return rotate_images(data.x_test, angle)
    raw = data.x_test * data.x_std + data.x_mean
    return (rotate_images(raw, angle) - data.x_mean) / data.x_std


OOD_KINDS = ("noise", "permuted", "scaled")


def _standardize_like(data: Dataset, raw: torch.Tensor) -> torch.Tensor:
    return raw if data.x_mean is None else (raw - data.x_mean) / data.x_std


def ood_digits(data: Dataset, kind: str, seed: int = 0, delta: float | None = None) -> torch.Tensor:
    """Out-of-distribution inputs for a `digits` dataset, built offline (MoLA, Table 1 at 8x8).

    - ``"noise"``: ``N_test`` images of i.i.d. uniform pixels in the raw range ``[0, 16]``.
    - ``"permuted"``: the test digits with their 64 pixels shuffled by one seeded permutation
      (the same for every image): the pixel statistics stay, the shapes are gone.
    - ``"scaled"``: the standardised test inputs times ``delta`` (MoLA B.1: ``δ·x`` "far away"
      from the data as ``δ → ∞``; the benchmarks use ``δ = 10, 100, 1000``).

    Raw images are standardised with the training statistics, like ``data.x_test``.

    Args:
        data: a Dataset from `digits` or `digits_split_classes`.
        kind: one of `OOD_KINDS`.
        seed: seeds the noise and the permutation.
        delta: the scale factor ``δ > 0`` (``"scaled"`` only).

    Returns:
        Shape ``(N_test, 64)``, float32.
    """
    if not isinstance(data, Dataset) or data.name != "digits":
        raise ValueError("data: expected a Dataset returned by datasets.digits()")
    if kind not in OOD_KINDS:
        raise ValueError(f"kind: expected one of {OOD_KINDS}, got {kind!r}")
    if kind == "scaled":
        bad = isinstance(delta, bool) or not isinstance(delta, (int, float))
        if bad or not (0 < delta < math.inf):
            raise ValueError(f"delta: expected a finite number > 0 for 'scaled', got {delta!r}")
        return data.x_test * float(delta)
    if delta is not None:
        raise ValueError(f"delta: only used by kind='scaled', got {delta!r} for {kind!r}")
    gen = torch.Generator().manual_seed(int(seed))
    if kind == "noise":
        raw = 16.0 * torch.rand(data.x_test.shape, generator=gen)
    else:
        raw = data.x_test if data.x_mean is None else data.x_test * data.x_std + data.x_mean
        raw = raw[:, torch.randperm(raw.shape[1], generator=gen)]
    return _standardize_like(data, raw).to(torch.float32)


def ood_sets(data: Dataset, seed: int = 0) -> dict[str, torch.Tensor]:
    """The far-from-data sets of the OOD protocol: Gaussian noise, permuted pixels and the test
    digits scaled by δ ∈ {10, 100, 1000} (MoLA section 5's "far away" inputs)."""
    return {
        "noise": ood_digits(data, "noise", seed=seed),
        "permuted": ood_digits(data, "permuted", seed=seed),
        **{f"δ={d}": ood_digits(data, "scaled", delta=d) for d in (10, 100, 1000)},
    }


def digits_split_classes(
    seed: int = 0,
    in_classes: Sequence[int] = (0, 1, 2, 3, 4),
    test_fraction: float = 0.2,
    standardize: bool = True,
) -> tuple[Dataset, torch.Tensor]:
    """Digits of ``in_classes`` as the in-distribution task, all other digits as OOD inputs.

    The in-distribution images are split like `digits` (seeded, stratified) and relabelled
    ``in_classes[j] → j``; the held-out-class images (e.g. 5–9) are standardised with the same
    training statistics.

    Returns:
        ``(data, x_ood)``: a `Dataset` named ``"digits"`` with ``len(in_classes)`` classes, and
        the OOD inputs ``(M, 64)``, float32.
    """
    classes = [int(c) for c in in_classes]
    if len(set(classes)) != len(classes) or not 2 <= len(classes) < 10:
        raise ValueError(f"in_classes: expected 2 to 9 distinct digits, got {in_classes!r}")
    if any(not 0 <= c <= 9 for c in classes):
        raise ValueError(f"in_classes: digits must lie in 0..9, got {in_classes!r}")
    raw = load_digits()
    inside = np.isin(raw.target, classes)
    relabel = np.vectorize({c: j for j, c in enumerate(classes)}.get)
    data = from_arrays(
        raw.data[inside], relabel(raw.target[inside]), "classification", "digits", seed,
        test_fraction, standardize,
    )  # fmt: skip
    x_ood = torch.as_tensor(raw.data[~inside], dtype=torch.float32)
    return data, _standardize_like(data, x_ood).to(torch.float32)
