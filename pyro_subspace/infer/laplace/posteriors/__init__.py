"""Posteriors of a Laplace guide: one contract (`Posterior`), one implementation per structure.

As laplace-torch separates the subset of weights from the Hessian structure, a Laplace guide
combines a `Subspace` kind (which weights) with one `Posterior` (which covariance over them):

- `FullPosterior` (``"full"``): dense ``Σ⁻¹ = PᵀGP/T + Λ₀`` (Subnetwork Inference eq. 15);
- `DiagonalPosterior` (``"diag"``): its diagonal only (the mean-field baseline);
- `LowRankPosterior` (``"lowrank"``): the top-``k`` GGN eigenpairs plus the prior as an
  isotropic remainder (laplace-torch's ``LowRankLaplace``);
- `KronPosterior` (``"kron"``): K-FAC, one Kronecker-factored block per layer (laplace-torch's
  ``KronLaplace``, Ritter et al. 2018), over a subspace of whole parameter tensors;
- `FunctionalPosterior` (``"gp"``): the GP (function-space) view on a subset of the data
  (laplace-torch's ``FunctionalLaplace``, Immer et al. 2021).

`make_posterior` builds one by its laplace-torch name.
"""

from __future__ import annotations

import torch

from .base import Posterior, PriorPrecision
from .diagonal import DiagonalPosterior
from .full import HELD, FullPosterior
from .functional import FunctionalPosterior
from .kron import KronPosterior
from .lowrank import LowRankFactorNormal, LowRankPosterior

#: the posterior of each ``hessian_structure`` name
POSTERIORS: dict[str, type[Posterior]] = {
    cls.name: cls
    for cls in (FullPosterior, DiagonalPosterior, LowRankPosterior, KronPosterior, FunctionalPosterior)
}
#: the structures that take a ``rank``
RANKED = ("lowrank",)
#: ``hessian_structure="auto"`` picks ``"full"`` while the ``(K, K)`` float64 matrices it holds
#: (`full.HELD`: the GGN and the Cholesky factor) take at most this many bytes (128 MiB:
#: ``K ≤ 2896``), else ``"kron"``: a rule of ``K`` alone, the same on every machine
AUTO_BUDGET_BYTES = 128 * 2**20
#: the options each structure takes (`structure_options` of the guide)
OPTIONS = {
    "kron": ("fisher", "conv", "bias", "damping", "mc_samples", "seed"),
    "gp": ("n_subset", "independent_outputs", "seed"),
}


def resolve_structure(name: str, dim: int) -> tuple[str, str]:
    """``name`` with ``"auto"`` resolved for ``K = dim`` coordinates, and the reason (what
    ``hessian_structure="auto"`` picked and why, for the user to read)."""
    if name != "auto":
        return name, f"{name!r}: asked for"
    need = len(HELD) * 8 * dim * dim
    mib = f"{need / 2**20:.1f} MiB"
    budget = f"{AUTO_BUDGET_BYTES / 2**20:.0f} MiB"
    if need <= AUTO_BUDGET_BYTES:
        return "full", f"'full': its {len(HELD)} ({dim}, {dim}) float64 matrices take {mib} <= {budget}"
    return "kron", f"'kron': the full structure's {len(HELD)} ({dim}, {dim}) float64 matrices would take {mib} > {budget}"


def check_structure(name: object, rank: object, options: dict | None = None) -> None:
    """The checks of `make_posterior` that need no ``K`` (for entry points, before any work);
    ``"auto"`` is accepted (`resolve_structure`)."""
    if name == "auto":
        if rank is not None:
            raise ValueError("rank: only used with hessian_structure='lowrank', got 'auto'")
        for key in options or {}:
            if key not in OPTIONS["kron"]:
                raise TypeError(f"structure_options: {key!r} is not an option of 'auto' ('kron')")
        return
    if not isinstance(name, str) or name not in POSTERIORS:
        raise ValueError(
            f"hessian_structure: expected one of {tuple(POSTERIORS) + ('auto',)}, got {name!r}"
        )
    if rank is not None and name not in RANKED:
        raise ValueError(f"rank: only used with hessian_structure='lowrank', got {name!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank: expected a positive int, got {rank!r}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"structure_options: expected a dict, got {type(options).__name__}")
    for key in options or {}:
        if key not in OPTIONS.get(name, ()):
            allowed = {k: v for k, v in OPTIONS.items()}
            raise TypeError(
                f"structure_options: {key!r} is not an option of hessian_structure={name!r} "
                f"(options by structure: {allowed})"
            )


def make_posterior(
    name: str,
    dim: int,
    rank: int | None = None,
    dtype: torch.dtype = torch.float64,
    device=None,
    options: dict | None = None,
) -> Posterior:
    """The posterior called ``name`` over ``dim`` coordinates; ``rank`` only for ``"lowrank"``,
    ``options`` only for the structures that take them (`OPTIONS`); ``dtype`` of the buffers
    where the structure keeps the network's (``"full"``)."""
    check_structure(name, rank, options)
    name, _ = resolve_structure(name, dim)
    if name != "kron":
        options = None if name == "full" else options  # auto: the kron options, if picked
    if name in RANKED:
        return POSTERIORS[name](dim, rank=rank, device=device)
    return POSTERIORS[name](dim, dtype=dtype, device=device, **(options or {}))


__all__ = [
    "POSTERIORS",
    "DiagonalPosterior",
    "FullPosterior",
    "FunctionalPosterior",
    "KronPosterior",
    "LowRankFactorNormal",
    "LowRankPosterior",
    "Posterior",
    "PriorPrecision",
    "check_structure",
    "make_posterior",
    "resolve_structure",
]
