"""Feature reductions: a last layer that sees a sequence of features per data point.

A transformer's classification head is an ``nn.Linear`` applied to every position,
``(n, T, P) → (n, T, C)``, after which the network keeps one position's logits (GPT-2: the last
non-padding token) or their mean. The closed-form last-layer Jacobian ``J = I_C ⊗ φ̃ᵀ``
(`LastLayerSubspace`) needs one feature row ``φ`` ``(n, P)`` per data point: a reduction says
which. laplace-torch 0.3 (``laplace.utils.feature_extractor.FeatureReduction``) defines three,
applied to every middle dimension of features with more than two dimensions and blind to the
attention mask:

- ``"pick_first"``: ``φ_n = h[n, 0, …, 0, :]``;
- ``"pick_last"``: ``φ_n = h[n, −1, …, −1, :]`` (with right padding: a padding token);
- ``"average"``: the mean over every middle dimension (padding included).

With the attention mask (``x["attention_mask"]`` ``(n, T)``, a mapping's entry), two more read
only the tokens the network attends to, so that padding never changes a row's features:

- ``"pick_last_token"``: ``φ_n = h[n, t_n, :]``, ``t_n`` the last position whose mask is
  nonzero (GPT-2's pooled token under right padding; the last position under left padding);
- ``"masked_average"``: ``φ_n = Σ_t m_nt h_nt / Σ_t m_nt``.

A reduction is *faithful* on some inputs when it maps the layer's outputs to the network's
outputs (`faithful`): then ``f = W φ + b`` holds and the closed form is the exact Jacobian.
"""

from __future__ import annotations

import enum

import torch

from .. import batch as batching

#: laplace-torch's reductions (mask-blind), then the mask-aware ones
REDUCTIONS = ("pick_first", "pick_last", "average", "pick_last_token", "masked_average")
#: the reductions that read ``x[MASK_KEY]``
MASKED = ("pick_last_token", "masked_average")
#: the mapping entry holding the attention mask ``(n, T)``, Hugging Face's name
MASK_KEY = "attention_mask"


def check_reduction(value: object) -> str | None:
    """``value`` as one of `REDUCTIONS` (laplace-torch's ``FeatureReduction`` members taken by
    value), or ``None``; anything else a ``ValueError`` naming ``feature_reduction``."""
    if isinstance(value, enum.Enum) and isinstance(value.value, str):
        value = value.value
    if value is None:
        return None
    if not isinstance(value, str) or value not in REDUCTIONS:
        raise ValueError(
            f"feature_reduction: expected None or one of {REDUCTIONS} (the last three read "
            f"x['{MASK_KEY}']), got {value!r}"
        )
    return value


def attention_mask(x: object, reduction: str | None) -> torch.Tensor | None:
    """The mask ``(n, T)`` a reduction reads (``None`` for the mask-blind ones); a ``ValueError``
    naming ``feature_reduction`` when ``x`` is not a mapping holding `MASK_KEY`."""
    if reduction not in MASKED:
        return None
    if not batching.is_mapping(x) or MASK_KEY not in x:
        raise ValueError(
            f"feature_reduction: {reduction!r} reads the attention mask x['{MASK_KEY}'] (n, T); "
            f"these inputs are {'a mapping without it' if batching.is_mapping(x) else 'a tensor'}"
            ": pass dict inputs with the mask, or a mask-blind reduction ('pick_last', ...)"
        )
    return x[MASK_KEY]


def reduce_features(
    h: torch.Tensor, reduction: str | None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``h`` ``(n, …, P)`` reduced to ``(n, P)`` (module docstring); ``h`` with two dimensions
    or fewer, or ``reduction=None``, is returned as it is (laplace-torch's rule). Unlike
    laplace-torch, a single row keeps its batch dimension (its ``squeeze()`` drops it).

    Args:
        h: the last layer's inputs (or, for `faithful`, its outputs).
        reduction: one of `REDUCTIONS` or ``None``.
        mask: ``(n, T)`` for `MASKED` reductions, which need ``h`` ``(n, T, P)``.
    """
    if reduction is None or h.dim() <= 2:
        return h
    middle = h.dim() - 2
    if reduction == "pick_first":
        return h[(slice(None), *([0] * middle), slice(None))]
    if reduction == "pick_last":
        return h[(slice(None), *([-1] * middle), slice(None))]
    if reduction == "average":
        return h.mean(dim=tuple(range(1, h.dim() - 1)))
    if h.dim() != 3 or mask is None or tuple(mask.shape) != tuple(h.shape[:2]):
        raise ValueError(
            f"feature_reduction: {reduction!r} needs features (n, T, P) and an attention mask "
            f"(n, T); got features {tuple(h.shape)} and mask "
            f"{None if mask is None else tuple(mask.shape)}"
        )
    keep = (mask != 0).to(h.device)
    if not bool(keep.any(1).all()):
        raise ValueError(
            f"feature_reduction: a row of x['{MASK_KEY}'] is all zeros: {reduction!r} has no "
            "token to read there"
        )
    if reduction == "pick_last_token":
        positions = torch.arange(h.shape[1], device=h.device)
        last = (positions * keep).argmax(1)  # the last attended position of each row
        return h[torch.arange(h.shape[0], device=h.device), last]
    m = keep.to(h.dtype)[..., None]
    return (h * m).sum(1) / m.sum(1)


def faithful(layer_out: torch.Tensor, out: torch.Tensor, reduction: str | None, mask=None) -> bool:
    """Whether the reduced layer outputs ``(n, C)`` are the network's outputs ``out`` ``(n, C)``
    to rounding (``64·eps`` of the outputs' scale): then ``f = W φ + b`` with the reduced
    features ``φ`` holds exactly on these rows (the reductions are linear, so they commute with
    the affine layer)."""
    red = reduce_features(layer_out, reduction, mask)
    if red.shape != out.shape:
        return False
    eps = torch.finfo(out.dtype).eps if out.is_floating_point() else 0.0
    tol = 64 * eps * max(1.0, float(out.detach().abs().max()) if out.numel() else 1.0)
    return bool(((red.detach() - out.detach()).abs() <= tol).all())


__all__ = ["MASKED", "MASK_KEY", "REDUCTIONS", "attention_mask", "check_reduction", "faithful", "reduce_features"]
