"""laplace-torch-shaped entry points: `Laplace(net, likelihood, subset_of_weights=...,
hessian_structure=...)` and the mean-field `DiagonalLaplace`.

Both return an `AutoSubspaceLaplace` (a Pyro autoguide) on a `SubspaceNet` built from the
network at its MAP with the weight prior ``w ~ N(0, λ⁻¹ I)`` (``prior_mean="zero"``, what
weight decay trains), so ``fit`` finds ``t* = 0`` when the net is that MAP, and
``Predictive(la.model, guide=la)`` works as in plain Pyro.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ... import _checks as ck
from ...flat import FlatNet
from ...likelihoods import Likelihood, check_likelihood, check_temperature
from ...nn import SubspaceNet
from ...subspaces import IndexSubspace, LastLayerSubspace, Subspace, subnetwork
from .guide import AutoSubspaceLaplace
from .predictive import linearized_moments
from .structures import check_structure
from .tuning import optimize_prior_precision

SUBSETS = ("all", "last_layer", "subnetwork")


def all_weights(net: nn.Module) -> IndexSubspace:
    """The subspace of every weight: ``P = I_D`` as indices ``0 … D−1``, shift the current
    weights (never a dense ``(D, D)`` matrix)."""
    w = FlatNet(net).vector()
    return IndexSubspace(w, torch.arange(w.numel(), device=w.device))


def Laplace(
    net: nn.Module,
    likelihood: Likelihood,
    subset_of_weights: str | torch.Tensor | Subspace = "last_layer",
    hessian_structure: str = "full",
    prior_precision: float = 1.0,
    temperature: float = 1.0,
    n_params: int | None = None,
    strategy: str = "magnitude",
    chunk_size: int = 1024,
    rank: int | None = None,
    **strategy_kwargs: object,
) -> AutoSubspaceLaplace:
    """A linearised Laplace approximation of ``net`` at its current weights (the MAP).

    Args:
        net: the trained network.
        likelihood: `Gaussian`, `Categorical`, `Bernoulli` (or your own `Likelihood`).
        subset_of_weights: ``"last_layer"`` (`LastLayerSubspace` for a final ``nn.Linear``),
            ``"all"`` (every weight), ``"subnetwork"`` (``n_params`` weights chosen by
            `subspaces.subnetwork` with ``strategy`` and ``strategy_kwargs``), a 1-D tensor of
            flat indices, or any `Subspace`.
        hessian_structure: ``"full"``, ``"diag"`` or ``"lowrank"`` (the top-``rank`` GGN
            eigenpairs by Lanczos plus the prior ``λ I`` as the isotropic remainder).
        n_params: ``K``, how many weights ``"subnetwork"`` selects (required there).
        strategy: `subspaces.subnetwork`'s selection for ``"subnetwork"``: ``"magnitude"``
            (default: needs no data), ``"diag_laplace"`` (Subnetwork Inference eq. 23: the
            largest marginal variances ``1 / (diag(G) + λ)`` under a diagonal Laplace with
            this ``likelihood`` and ``prior_precision``; pass the training inputs ``x=``),
            ``"random"``, ... (`subspaces.subnetwork`; its other keywords go in
            ``strategy_kwargs``).
        chunk_size: rows per Jacobian block of the fit.
        rank: ``k`` of ``"lowrank"``, ``1 <= k <= K`` (default ``min(K, 10)``); an error with
            another structure.
        prior_precision: ``λ`` of the weight prior ``N(0, λ⁻¹ I)``.
        temperature: ``T`` of the likelihood.

    Returns:
        An unfitted `AutoSubspaceLaplace`: call ``.fit(x, y)`` (or a Dataset / DataLoader),
        then ``.optimize_prior_precision("marglik" | "grid", ...)`` and
        ``.predict(x, link_approx="probit" | "mc")``.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    check_likelihood(likelihood)
    _check_lambda(prior_precision), check_temperature(temperature)
    check_structure(hessian_structure, rank), ck.positive_int(chunk_size, "chunk_size")
    if isinstance(subset_of_weights, Subspace):
        sub = subset_of_weights
    elif isinstance(subset_of_weights, torch.Tensor):
        w = FlatNet(net).vector()
        sub = Subspace(w, subset_of_weights.to(w.device))
    elif subset_of_weights == "all":
        sub = all_weights(net)
    elif subset_of_weights == "last_layer":
        sub = subnetwork(net, strategy="last_layer")
    elif subset_of_weights == "subnetwork":
        if n_params is None:
            raise ValueError(
                "n_params: subset_of_weights='subnetwork' needs n_params=K, how many weights "
                "to select (e.g. n_params=1000), or pass their flat indices as subset_of_weights"
            )
        kwargs = dict(strategy_kwargs)
        if strategy == "diag_laplace":  # the fit's own likelihood and λ score the weights
            if kwargs.get("x") is None:
                raise ValueError(
                    "x: strategy='diag_laplace' scores weights by the GGN diagonal on the "
                    "training inputs: pass them, Laplace(..., strategy='diag_laplace', x=x_train)"
                )
            kwargs.update(likelihood=likelihood, prior_precision=float(prior_precision))
        sub = subnetwork(net, n_params, strategy=strategy, **kwargs)
    else:
        raise ValueError(
            f"subset_of_weights: expected one of {SUBSETS}, flat indices or a Subspace, "
            f"got {subset_of_weights!r}"
        )
    _check_lambda(prior_precision)
    model = SubspaceNet(
        net, sub, likelihood, prior_scale=1.0,
        temperature=check_temperature(temperature), prior_mean="zero",
    )  # fmt: skip
    model.set_prior_precision(float(prior_precision))
    return AutoSubspaceLaplace(
        model, hessian_structure=hessian_structure, chunk_size=chunk_size, rank=rank
    )


class DiagonalLaplace(AutoSubspaceLaplace):
    """The diagonal (mean-field) linearised Laplace over all ``D`` weights: a baseline.

    ``q(w) = N(ŵ, diag(1 / (g/T + λ)))`` with ``g = diag(G)`` the exact GGN diagonal and the
    prior ``N(0, λ⁻¹ I)`` (Subnetwork Inference sections 6.1–6.2; its selection strategy uses
    the same variances, eq. 23): the diagonal structure on the all-weights subspace.

    Args:
        net: the network at its MAP ``ŵ``.
        likelihood: a `Likelihood`.
        prior_precision: ``λ > 0``.
        temperature: ``T > 0``.
        chunk_size: rows per Jacobian block (``None``: by the memory budget).
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        prior_precision: float = 1.0,
        temperature: float = 1.0,
        chunk_size: int | None = None,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        check_likelihood(likelihood)
        _check_lambda(prior_precision)
        model = SubspaceNet(
            net, all_weights(net), likelihood, prior_scale=1.0,
            temperature=check_temperature(temperature), prior_mean="zero",
        )  # fmt: skip
        model.set_prior_precision(float(prior_precision))
        super().__init__(model, hessian_structure="diag", chunk_size=chunk_size or 1024)

    def fit(self, x: object, y: torch.Tensor | None = None, **kwargs: object) -> DiagonalLaplace:
        """The GGN diagonal at the current weights (no MAP search; ``y`` only for the evidence)."""
        kwargs.setdefault("find_map", False)
        super().fit(x, y, **kwargs)
        return self

    def optimize_prior_precision(self, *args: object, **kwargs: object) -> DiagonalLaplace:
        """``optimize_prior_precision(x_val, y_val, grid=None)``: the grid method (validation
        log-likelihood); or the keyword form of `AutoSubspaceLaplace.optimize_prior_precision`."""
        if args and isinstance(args[0], torch.Tensor):
            x_val, y_val, *rest = args
            kwargs.update(x_val=x_val, y_val=y_val, grid=rest[0] if rest else kwargs.get("grid"))
            args = ("grid",)
        optimize_prior_precision(self, *args, **kwargs)
        return self

    @property
    def variance(self) -> torch.Tensor:
        """Marginal variances ``1 / (g/T + λ)`` ``(D,)``."""
        self._check_fitted()
        return self.covariance

    @property
    def ggn_diagonal(self) -> torch.Tensor:
        return self.ggn

    @property
    def weights(self) -> torch.Tensor:
        return self.model.subspace.shift

    def moments(self, x: torch.Tensor, chunk_size: int | None = None):
        """``f(x, ŵ)`` ``(N, O)`` and ``J diag(v) Jᵀ`` ``(N, O, O)``, float64."""
        return linearized_moments(self, x, chunk_size=chunk_size)


def _check_lambda(prior_precision: object) -> None:
    bad = isinstance(prior_precision, bool) or not isinstance(prior_precision, (int, float))
    if bad or not 0 < prior_precision < math.inf:
        raise ValueError(f"prior_precision: expected a positive number, got {prior_precision!r}")


__all__ = ["SUBSETS", "DiagonalLaplace", "Laplace", "LastLayerSubspace", "all_weights"]
