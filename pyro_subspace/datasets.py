"""Data that ships offline: the papers' toy regressions, scikit-learn's bundled sets, user CSVs.

Nothing here downloads anything. Every loader returns a frozen :class:`Dataset` with float32
inputs ``x_* (N, d)`` and targets ``y_* (N,)`` (float32 for regression, int64 class indices for
classification), split with a seed and, optionally, standardised with training-split statistics.

Loaders: :func:`toy_regression` (Subspace Inference, section 3.1), :func:`in_between` (the
two-cluster task of Subnetwork Inference, section 6.1), :func:`diabetes` and :func:`digits`
(scikit-learn's bundled sets), :func:`from_csv` (a user's file), :func:`from_arrays` (a user's
arrays); :func:`load` picks one by name. Distribution-shift and OOD constructions (rotated
digits, noise images, held-out classes) are experiment protocols: they live in the source
checkout's ``benchmarks/ood.py``, not in the installed package.

Example:
    >>> data = load("toy", n=40, n_test=10, n_grid=50)
    >>> data.x_train.shape, data.grid.shape, data.n_features
    (torch.Size([40, 2]), torch.Size([50, 2]), 2)
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import rng
from .validation import check_finite, check_labels

__all__ = ["IN_BETWEEN_CLUSTERS", "TASKS", "TOY_INTERVALS", "Dataset", "diabetes", "digits"]
__all__ += ["from_arrays", "from_csv", "in_between", "load", "toy_features", "toy_regression"]

TASKS = ("regression", "classification")
TOY_INTERVALS = ((-7.2, -4.8), (-1.2, 1.2), (4.8, 7.2))  # Subspace Inference, section 3.1
IN_BETWEEN_CLUSTERS = ((-1.0, -0.3), (0.3, 1.0))  # our choice; see in_between()


@dataclass(frozen=True)
class Dataset:
    """A train/test split with the bookkeeping needed to undo standardisation and to plot.

    Attributes:
        name, task: dataset name; ``"regression"`` or ``"classification"``.
        x_train, x_test: inputs, float32, shapes ``(N, d)`` and ``(M, d)``.
        y_train, y_test: targets, shape ``(N,)`` / ``(M,)``; float32 (regression) or int64 class
            indices in ``0..n_classes-1`` (classification).
        n_classes: number of classes, ``None`` for regression.
        x_mean, x_std: ``(d,)`` training statistics used as ``(x - x_mean) / x_std``, or ``None``.
        y_mean, y_std: the same for regression targets (floats), or ``None``.
        grid: ``(G, d)`` inputs for plotting a 1-D problem; ``grid_x``: its raw 1-D x, ``(G,)``.
        x_train_raw: raw 1-D x of the training points, ``(N,)`` (1-D problems only).
        f_train, f_test, f_grid: the noiseless function at the train/test/grid points, for the
            synthetic problems only, else ``None``.
    """

    name: str
    task: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_classes: int | None = None
    x_mean: torch.Tensor | None = None
    x_std: torch.Tensor | None = None
    y_mean: float | None = None
    y_std: float | None = None
    grid: torch.Tensor | None = None
    grid_x: torch.Tensor | None = None
    x_train_raw: torch.Tensor | None = None
    f_train: torch.Tensor | None = None
    f_test: torch.Tensor | None = None
    f_grid: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task: expected one of {TASKS}, got {self.task!r}")
        for xn, yn in (("x_train", "y_train"), ("x_test", "y_test")):
            x, y = getattr(self, xn), getattr(self, yn)
            if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"{xn}, {yn}: expected shapes (N, d) and (N,), got {tuple(x.shape)} "
                    f"and {tuple(y.shape)}"
                )

    @property
    def n_train(self) -> int:
        """Number of training points ``N``."""
        return self.x_train.shape[0]

    @property
    def n_features(self) -> int:
        """Number of input features ``d``."""
        return self.x_train.shape[1]


def _check_int(value: int, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_noise(noise_std: float) -> float:
    if not (isinstance(noise_std, (int, float)) and 0 <= noise_std < math.inf):
        raise ValueError(f"noise_std: expected a finite number >= 0, got {noise_std!r}")
    return float(noise_std)


def _check_fraction(test_fraction: float) -> float:
    if not (isinstance(test_fraction, (int, float)) and 0.0 < test_fraction < 1.0):
        raise ValueError(f"test_fraction: expected a number in (0, 1), got {test_fraction!r}")
    return float(test_fraction)


def toy_features(x: torch.Tensor) -> torch.Tensor:
    """The features ``(x, x^2)`` of Subspace Inference, section 3.1: ``(N,)`` -> ``(N, 2)``."""
    if x.ndim != 1:
        raise ValueError(f"x: expected shape (N,), got {tuple(x.shape)}")
    return torch.stack([x, x * x], dim=-1)


def _sample_intervals(
    n: int, intervals: Sequence[tuple[float, float]], gen: torch.Generator
) -> torch.Tensor:
    """``n`` points: pick an interval uniformly, then a point uniformly inside it. ``(n,)``."""
    bounds = torch.tensor(intervals, dtype=torch.float32)  # (K, 2)
    k = torch.randint(len(intervals), (n,), generator=gen)
    lo, hi = bounds[k, 0], bounds[k, 1]
    return lo + torch.rand(n, generator=gen) * (hi - lo)


def _synthetic(
    name: str, f: Callable, features: Callable, xs: tuple, noise_std: float, gen: torch.Generator
) -> Dataset:
    """``y = f(x) + noise_std * eps`` at raw ``xs = (x_train (N,), x_test (M,), grid_x (G,))``."""
    x_train, x_test, grid_x = xs
    f_train, f_test = f(x_train), f(x_test)
    y_train = f_train + noise_std * torch.randn(f_train.shape, generator=gen)
    y_test = f_test + noise_std * torch.randn(f_test.shape, generator=gen)
    plot = {"grid": features(grid_x), "grid_x": grid_x, "x_train_raw": x_train, "f_grid": f(grid_x)}
    train, test = (features(x_train), y_train), (features(x_test), y_test)
    return Dataset(name, "regression", *train, *test, f_train=f_train, f_test=f_test, **plot)


def toy_regression(
    n: int = 400, noise_std: float = 0.1, seed: int = 0, n_test: int = 200, n_grid: int = 400
) -> Dataset:
    """The toy regression of Subspace Inference (Izmailov et al., UAI 2019), section 3.1.

    ``f`` is a randomly initialised ReLU net with hidden layers 200, 50, 50, 50 on the features
    ``(x, x^2)``; weights ``W ~ N(0, 1/fan_in)`` and biases ``b ~ N(0, 1)`` are drawn from a
    ``torch.Generator`` seeded with ``seed`` (torch's global RNG is untouched). The paper does
    not give the scale of ``f``: we divide it by its (population, ``ddof=0``) standard deviation
    over the training inputs, so ``f_train.std(unbiased=False) == 1``. Inputs: pick one of
    ``TOY_INTERVALS`` = [-7.2,-4.8], [-1.2,1.2], [4.8,7.2] uniformly, then x uniformly in it;
    ``y = f(x) + noise_std * eps``, ``eps ~ N(0, 1)``. The test set is ``n_test`` fresh points
    from the same input distribution.

    Args:
        n, n_test: numbers of training and test points. noise_std: noise standard deviation.
        seed: seed of the generator. n_grid: number of grid points on ``linspace(-10, 10)``.

    Returns:
        A :class:`Dataset` with ``x_* (N, 2) = toy_features(x)``, ``grid (G, 2)``, ``grid_x (G,)``,
        ``x_train_raw (N,)`` and the noiseless ``f_train``, ``f_test``, ``f_grid``; unstandardised.
    """
    n, n_test = _check_int(n, "n", 1), _check_int(n_test, "n_test", 1)
    n_grid, noise_std = _check_int(n_grid, "n_grid", 2), _check_noise(noise_std)
    gen = torch.Generator().manual_seed(int(seed))
    widths = (2, 200, 50, 50, 50, 1)
    layers = [
        (torch.randn(o, i, generator=gen) / math.sqrt(i), torch.randn(o, generator=gen))
        for i, o in itertools.pairwise(widths)
    ]

    def net(x: torch.Tensor) -> torch.Tensor:  # (N,) -> (N,)
        h = toy_features(x)
        for j, (w, b) in enumerate(layers):
            h = h @ w.T + b
            h = torch.relu(h) if j < len(layers) - 1 else h
        return h[:, 0]

    x_train = _sample_intervals(n, TOY_INTERVALS, gen)
    scale = net(x_train).std(unbiased=False).clamp_min(1e-12) if n > 1 else torch.tensor(1.0)
    xs = (x_train, _sample_intervals(n_test, TOY_INTERVALS, gen), torch.linspace(-10, 10, n_grid))
    return _synthetic("toy", lambda x: net(x) / scale, toy_features, xs, noise_std, gen)


def _in_between_f(x: torch.Tensor) -> torch.Tensor:
    """The smooth function of :func:`in_between`: ``sin(3 x) + 0.5 x``, shape preserved."""
    return torch.sin(3.0 * x) + 0.5 * x


def in_between(
    n: int = 100, noise_std: float = 0.1, seed: int = 0, n_test: int = 200, n_grid: int = 400
) -> Dataset:
    """A 1-D regression with two separated input clusters, to probe 'in-between' uncertainty.

    Subnetwork Inference (Daxberger et al., ICML 2021), section 6.1 and Fig. 2, uses the
    two-cluster task of Antorán et al. (2020) (cf. Foong et al., 2019). Its data file is not
    shipped, so this is **our generator** of the same character, not the original data: the
    first ``n // 2`` training x are uniform on [-1, -0.3], the rest uniform on [0.3, 1]
    (``IN_BETWEEN_CLUSTERS``); ``y = sin(3 x) + 0.5 x + noise_std * eps``. Test x are uniform on
    [-1, 1], so they include the gap (-0.3, 0.3); the plotting grid is ``linspace(-2, 2)``.

    Args:
        n, n_test: numbers of training and test points. noise_std: noise standard deviation.
        seed: seed of the ``torch.Generator``. n_grid: number of grid points.

    Returns:
        A :class:`Dataset` with ``x_* (N, 1)``, ``grid (G, 1)``, ``grid_x (G,)``,
        ``x_train_raw (N,)`` and the noiseless ``f_train``, ``f_test``, ``f_grid``; unstandardised.
    """
    n, n_test = _check_int(n, "n", 1), _check_int(n_test, "n_test", 1)
    n_grid, noise_std = _check_int(n_grid, "n_grid", 2), _check_noise(noise_std)
    gen = torch.Generator().manual_seed(int(seed))
    (a0, b0), (a1, b1) = IN_BETWEEN_CLUSTERS
    first = torch.arange(n) < n // 2
    lo, hi = torch.where(first, a0, a1), torch.where(first, b0, b1)
    x_train = lo + torch.rand(n, generator=gen) * (hi - lo)
    xs = (x_train, 2 * torch.rand(n_test, generator=gen) - 1, torch.linspace(-2, 2, n_grid))
    return _synthetic("in_between", _in_between_f, lambda x: x[:, None], xs, noise_std, gen)


def _split(
    name: str,
    task: str,
    x: np.ndarray,
    y: np.ndarray,
    seed: int,
    test_fraction: float,
    standardize: bool,
) -> Dataset:
    """Seeded ``train_test_split`` (stratified for classification), then standardise.

    Statistics come from the training split only (population std, ``ddof=0``); features with
    zero training std get std 1, so they are centred but not divided.
    """
    test_fraction = _check_fraction(test_fraction)
    classify = task == "classification"
    # scikit-learn on first use, without its import touching the global generators
    train_test_split = rng.import_keeping_state("sklearn.model_selection").train_test_split

    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=int(seed), stratify=y if classify else None
    )
    stats: dict = {}
    if standardize:
        mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
        std = np.where(std > 0, std, 1.0)
        x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
        stats.update(x_mean=torch.as_tensor(mean, dtype=torch.float32))
        stats.update(x_std=torch.as_tensor(std, dtype=torch.float32))
        if not classify:
            y_mean, y_std = float(y_tr.mean()), float(y_tr.std()) or 1.0
            y_tr, y_te = (y_tr - y_mean) / y_std, (y_te - y_mean) / y_std
            stats.update(y_mean=y_mean, y_std=y_std)
    y_dtype = torch.int64 if classify else torch.float32
    arrays = zip((x_tr, y_tr, x_te, y_te), (torch.float32, y_dtype) * 2)
    data = [torch.as_tensor(a, dtype=dtype) for a, dtype in arrays]
    return Dataset(name, task, *data, int(y.max()) + 1 if classify else None, **stats)


def diabetes(seed: int = 0, test_fraction: float = 0.1, standardize: bool = True) -> Dataset:
    """scikit-learn's bundled diabetes regression (442 x 10), ``load_diabetes(scaled=False)``.

    Split with ``train_test_split(test_size=test_fraction, random_state=seed)``; if
    ``standardize``, features and targets are standardised with training statistics
    (``x_mean (10,)``, ``x_std (10,)``, ``y_mean``, ``y_std`` are stored on the result).
    """
    load_diabetes = rng.import_keeping_state("sklearn.datasets").load_diabetes

    raw = load_diabetes(scaled=False)
    return _split("diabetes", "regression", raw.data, raw.target, seed, test_fraction, standardize)


def digits(seed: int = 0, test_fraction: float = 0.2, standardize: bool = True) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 x 64, 10 classes), ``load_digits()``.

    Split with ``train_test_split(..., stratify=y)``; if ``standardize``, pixels are standardised
    with training statistics (always-blank pixels get std 1). Targets are int64 in 0..9.
    """
    load_digits = rng.import_keeping_state("sklearn.datasets").load_digits

    raw = load_digits()
    return _split(
        "digits", "classification", raw.data, raw.target, seed, test_fraction, standardize
    )


def from_arrays(
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    task: str = "regression",
    name: str = "arrays",
    seed: int = 0,
    test_fraction: float = 0.1,
    standardize: bool = True,
) -> Dataset:
    """A seeded train/test `Dataset` from a user's arrays, split like :func:`diabetes`.

    Args:
        x: inputs ``(N, d)``. y: targets ``(N,)``: real numbers for regression, integer class
            indices ``0..C-1`` for classification (the split is then stratified).
        task: ``"regression"`` or ``"classification"``. name: the dataset's name.
        seed, test_fraction, standardize: as in :func:`diabetes`.

    Raises:
        ValueError: a NaN or inf in ``x`` or ``y`` (the first bad row and column are named, as
            :func:`from_csv` names the cell; standardisation would spread it over a whole
            column or every target), or a class label that is not an integer ``>= 0``
            (``0.5``, ``-1``: never truncated; whole-number floats such as ``1.0`` pass).
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x, y: expected shapes (N, d) and (N,), got {x.shape} and {y.shape}")
    if y.dtype.kind not in "biuf":
        raise TypeError(
            f"y: expected numeric targets, got dtype {y.dtype}; map class names to 0..C-1 "
            "first (from_csv does this for a file)"
        )
    check_finite(x, "x", "remove or impute that row before from_arrays")
    if task == "classification":
        y = check_labels(torch.as_tensor(y), "y").numpy()
    else:
        y = y.astype(np.float64)
        check_finite(y, "y", "remove or impute that row before from_arrays")
    return _split(name, task, x, y, seed, test_fraction, standardize)


def from_csv(
    path: str | Path,
    target: str,
    features: Sequence[str] | None = None,
    task: str = "regression",
    seed: int = 0,
    test_fraction: float = 0.1,
    standardize: bool = True,
    delimiter: str = ",",
) -> Dataset:
    """Load a user's CSV file with a header row, parsed with the ``csv`` module.

    Args:
        path: the file. target: name of the target column. features: names of the feature
            columns (default: all other columns, in file order). task: ``"regression"`` or
            ``"classification"``; classification labels (any strings) are mapped to
            ``0..C-1`` in sorted order (numeric order when all labels are numbers) and the split
            is stratified. seed, test_fraction, standardize: as in :func:`diabetes`.

    Raises:
        ValueError: unknown ``target``/``features`` names, a non-numeric or non-finite cell
            (the column and line are named), a ragged row, or an empty file.
    """
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    _check_fraction(test_fraction)
    with open(path, newline="", encoding="utf-8-sig") as fh:  # utf-8-sig: Excel's BOM
        reader = csv.reader(fh, delimiter=delimiter)
        (_, header), *records = [(reader.line_num, r) for r in reader if r] or [(0, [])]
    header, rows = [h.strip() for h in header], [r for _, r in records]
    if not rows:
        raise ValueError(f"path: {str(path)!r} needs a header row and at least one data row")
    dupes = sorted({h for h in header if header.count(h) > 1})
    if dupes:
        raise ValueError(
            f"path: {str(path)!r} has duplicated column names {dupes} in its header {header}; "
            "rename the columns so each name appears once"
        )
    if target not in header:
        raise ValueError(f"target: column {target!r} not in header {header}")
    names = [features] if isinstance(features, str) else features
    names = [h for h in header if h != target] if names is None else list(names)
    bad = [f for f in names if f not in header or f == target]
    if bad or not names:
        raise ValueError(f"features: {bad or names} are not feature columns of {header}")
    if len(set(names)) != len(names):
        raise ValueError(f"features: {names} names a column more than once")
    for line, row in records:
        if len(row) != len(header):
            raise ValueError(f"path: line {line} has {len(row)} cells, header has {len(header)}")
    cols = [header.index(f) for f in names]
    x = np.array([[_cell(row, j, header, line) for j in cols] for line, row in records])
    j = header.index(target)
    if task == "regression":
        y = np.array([_cell(row, j, header, line) for line, row in records])
    else:
        labels = [row[j].strip() for row in rows]
        for line, row in records:
            if not row[j].strip():
                raise ValueError(f"target: empty label on line {line}")
        try:
            keys: list = [float(c) for c in labels]
        except ValueError:
            keys = labels
        index = {k: i for i, k in enumerate(sorted(set(keys)))}
        y = np.array([index[k] for k in keys], dtype=np.int64)
    return _split(Path(path).stem, task, x, y, seed, test_fraction, standardize)


def _cell(row: list[str], j: int, header: list[str], line: int) -> float:
    """Cell ``j`` of a CSV row as a finite float, or a ValueError naming the column and line."""
    try:
        value = float(row[j])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(
            f"path: column {header[j]!r}: non-numeric or non-finite cell {row[j]!r} on line {line}"
        )
    return value


_REGISTRY: dict[str, Callable[..., Dataset]] = {
    "toy": toy_regression,
    "in_between": in_between,
    "diabetes": diabetes,
    "digits": digits,
}


def load(name: str, **kwargs: object) -> Dataset:
    """Load a dataset by name (``"toy"``, ``"in_between"``, ``"diabetes"``, ``"digits"``)."""
    if name not in _REGISTRY:
        raise ValueError(f"name: expected one of {sorted(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name](**kwargs)
