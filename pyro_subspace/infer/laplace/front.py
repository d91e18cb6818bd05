"""laplace-torch-shaped entry points: `Laplace(net, likelihood, subset_of_weights=...,
hessian_structure=...)` and the mean-field `DiagonalLaplace`.

Both return an `AutoSubspaceLaplace` (a Pyro autoguide) on a `SubspaceNet` built from the
network at its MAP with the weight prior ``w ~ N(0, λ⁻¹ I)`` (``prior_mean="zero"``, what
weight decay trains), so ``fit`` finds ``t* = 0`` when the net is that MAP, and
``Predictive(la.model, guide=la)`` works as in plain Pyro.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import _checks as ck
from ...flat import FlatNet
from ...likelihoods import Likelihood, check_likelihood, check_temperature
from ...nn import SubspaceNet
from ...subspaces import IndexSubspace, LastLayerSubspace, Subspace, subnetwork
from .guide import AutoSubspaceLaplace, _all_or_nothing
from .predictive import linearized_moments
from .structures import check_structure
from .tuning import optimize_prior_precision

SUBSETS = ("all", "last_layer", "subnetwork")
#: `subspaces.subnetwork` keywords that `Laplace` passes on (it sets ``likelihood`` and
#: ``prior_precision`` itself)
SELECTION_KEYWORDS = ("x", "collector", "names", "indices", "seed")


def all_weights(net: nn.Module) -> IndexSubspace:
    """The subspace of every weight that requires grad: ``P = I_D`` as indices ``0 … D−1``
    (without the positions of frozen parameters), shift the current weights (never a dense
    ``(D, D)`` matrix)."""
    w = FlatNet(net).vector()
    trainable = torch.cat(
        [torch.full((p.numel(),), p.requires_grad, device=w.device) for p in net.parameters()]
    )
    if not bool(trainable.any()):
        raise ValueError("net: every parameter has requires_grad=False: no weights to infer")
    return IndexSubspace(w, torch.nonzero(trainable)[:, 0])


def Laplace(
    net: nn.Module,
    likelihood: Likelihood,
    subset_of_weights: str | torch.Tensor | Subspace = "last_layer",
    hessian_structure: str = "full",
    prior_precision: float = 1.0,
    temperature: float = 1.0,
    n_params: int | None = None,
    strategy: str | None = None,
    chunk_size: int = 1024,
    rank: int | None = None,
    rescale_prior: bool | None = None,
    **strategy_kwargs: object,
) -> NetLaplace:
    """A linearised Laplace approximation of ``net`` at its current weights (the MAP).

    Args:
        net: the trained network.
        likelihood: `Gaussian`, `Categorical`, `Bernoulli` (or your own `Likelihood`).
        subset_of_weights: ``"last_layer"`` (`LastLayerSubspace` for a final ``nn.Linear``),
            ``"all"`` (every weight that requires grad: frozen parameters keep their values,
            as in laplace-torch), ``"subnetwork"`` (``n_params`` weights chosen by
            `subspaces.subnetwork` with ``strategy`` and ``strategy_kwargs``), a 1-D tensor of
            flat indices, or any `Subspace`.
        hessian_structure: ``"full"``, ``"diag"`` or ``"lowrank"`` (the top-``rank`` GGN
            eigenpairs by Lanczos plus the prior ``λ I`` as the isotropic remainder).
        n_params: ``K``, how many weights ``"subnetwork"`` selects (required there; an error
            with any other ``subset_of_weights``).
        strategy: `subspaces.subnetwork`'s selection, only with ``"subnetwork"``:
            ``"magnitude"`` (default: needs no data), ``"diag_laplace"`` (Subnetwork Inference eq. 23: the
            largest marginal variances ``1 / (diag(G) + λ)`` under a diagonal Laplace with
            this ``likelihood`` and ``prior_precision``; pass the training inputs ``x=``),
            ``"random"``, ... (`subspaces.subnetwork`).
        strategy_kwargs: `subspaces.subnetwork`'s other keywords (`SELECTION_KEYWORDS`), only
            with ``"subnetwork"``; any other keyword is a ``TypeError`` (laplace-torch's
            ``sigma_noise``, ``subnetwork_indices``, ``backend`` say what to do instead).
        chunk_size: rows per Jacobian block of the fit.
        rank: ``k`` of ``"lowrank"``, ``1 <= k <= K`` (default ``min(K, 10)``); an error with
            another structure.
        prior_precision: ``λ`` of the weight prior ``N(0, λ⁻¹ I)``.
        rescale_prior: give the ``K`` weights the precision ``λ_S = λ·K/D`` (Subnetwork
            Inference, section 4 after eq. 15 and appendix C: the prior of a ``K``-weight
            subnetwork); default ``True`` for ``"subnetwork"`` (the paper's method) and
            ``False`` otherwise (laplace-torch's convention, also for flat indices). A later
            ``optimize_prior_precision`` tunes the precision in use.
        temperature: ``T`` of the likelihood.

    Returns:
        An unfitted `NetLaplace` (an `AutoSubspaceLaplace` whose ``fit`` takes the network's
        weights as the MAP, as laplace-torch does): call ``.fit(x, y)`` (or a Dataset / DataLoader),
        then ``.optimize_prior_precision("marglik" | "grid", ...)`` and
        ``.predict(x, link_approx="probit" | "mc")``.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    check_likelihood(likelihood)
    prior_precision = _check_lambda(prior_precision)
    check_temperature(temperature)
    check_structure(hessian_structure, rank), ck.positive_int(chunk_size, "chunk_size")
    selected = isinstance(subset_of_weights, str) and subset_of_weights == "subnetwork"
    if rescale_prior is not None:
        ck.choice(rescale_prior, "rescale_prior", (True, False))
    for name, value in (("n_params", n_params), ("strategy", strategy)):
        if value is not None and not selected:  # nothing is accepted and then ignored
            raise TypeError(
                f"{name}: only used with subset_of_weights='subnetwork' (got "
                f"subset_of_weights={_describe(subset_of_weights)}); leave it out, or select a "
                "subnetwork"
            )
    strategy = "magnitude" if strategy is None else strategy
    for name in strategy_kwargs:  # nothing is accepted and then ignored
        if name in _LT_KEYWORDS:
            raise TypeError(f"{name}: not an argument of Laplace here: {_LT_KEYWORDS[name]}")
        if not selected or name not in SELECTION_KEYWORDS:
            raise TypeError(
                f"{name}: unexpected keyword; besides its own arguments Laplace takes only "
                f"subspaces.subnetwork's {SELECTION_KEYWORDS}, with subset_of_weights='subnetwork'"
            )
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
    model = SubspaceNet(
        net, sub, likelihood, prior_scale=1.0,
        temperature=check_temperature(temperature), prior_mean="zero",
    )  # fmt: skip
    if selected if rescale_prior is None else rescale_prior:  # λ_S = λ·K/D
        prior_precision = prior_precision * sub.rank / sub.dim
    model.set_prior_precision(prior_precision)
    return NetLaplace(model, hessian_structure=hessian_structure, chunk_size=chunk_size, rank=rank)


class NetLaplace(AutoSubspaceLaplace):
    """The guide `Laplace` returns: an `AutoSubspaceLaplace` with laplace-torch's habits.

    - `fit` takes the network's weights as the MAP, as laplace-torch does
      (``fit(x, y, find_map=True)`` searches the MAP of the posterior with this prior in the
      subset instead: it moves ``t*`` away from ``0`` when the net was not trained with weight
      decay ``λ/N``);
    - ``predict(x, pred_type="glm", link_approx=..., n_samples=...)``, ``sample(n, generator)``,
      ``optimize_prior_precision(method="gridsearch", val_loader=...)``, a settable
      ``prior_precision``, and ``posterior_precision``, ``posterior_covariance``,
      ``posterior_variance``, ``n_params``: laplace-torch's names;
    - calling it as ``la(x, pred_type=..., link_approx=...)`` is a ``TypeError`` naming
      `predict`: a Pyro guide, called, draws ``t ~ q(t)``.
    """

    def fit(self, x: object, y: torch.Tensor | None = None, **kwargs: object):
        """`AutoSubspaceLaplace.fit` at the network's weights *now* (as laplace-torch reads
        them at ``fit``): weights loaded or trained after `Laplace` was built become the shift
        ``ŵ`` (the subset's indices, chosen at construction, are kept). All or nothing: an
        interrupted or failed fit leaves the guide and its model as they were."""
        kwargs.setdefault("find_map", False)
        return self._fit_at_current_weights(x, y, **kwargs)

    @_all_or_nothing
    def _fit_at_current_weights(self, x: object, y: torch.Tensor | None, **kwargs: object):
        model = self.model
        w = FlatNet(model.net).vector().detach()
        shift = model.subspace.shift
        if w.shape != shift.shape:
            raise ValueError(
                f"net: has {w.numel()} weights now but {shift.numel()} when Laplace was built: "
                "build Laplace again for the new architecture"
            )
        if not torch.equal(w.to(shift), shift):
            model.subspace.shift.copy_(w)
            model.set_prior(model.prior_mean)  # t₀ = Pᵀ(0 − ŵ) follows the new shift
        return super().fit(x, y, **kwargs)

    def forward(self, *args: object, **kwargs: object):
        asked = sorted(set(kwargs) & {"pred_type", "link_approx", "n_samples", "joint"})
        if asked:
            raise TypeError(
                f"{asked[0]}: calling the guide draws t ~ q(t), as Pyro's autoguides do; for "
                "laplace-torch's la(x, pred_type=..., link_approx=...) call "
                "la.predict(x, link_approx=...)"
            )
        return super().forward(*args, **kwargs)

    def predict(
        self,
        x: torch.Tensor,
        link_approx: str = "auto",
        pred_type: str = "glm",
        n_samples: int | None = None,
        **kwargs: object,
    ):
        """`AutoSubspaceLaplace.predict`; ``pred_type`` only ``"glm"`` (the linearised
        predictive); ``n_samples``: laplace-torch's name of ``num_samples``."""
        if pred_type != "glm":
            raise ValueError(
                f"pred_type: only 'glm' (the linearised predictive), got {pred_type!r}; for "
                "laplace-torch's 'nn' (weights drawn, the network run) use "
                "Predictive(la.model, guide=la, num_samples=S)(x)"
            )
        if n_samples is not None:
            if "num_samples" in kwargs:
                raise TypeError("n_samples: give num_samples or n_samples, not both")
            kwargs["num_samples"] = n_samples
        return super().predict(x, link_approx, **kwargs)

    def optimize_prior_precision(self, method: str = "marglik", **kwargs: object):
        """`AutoSubspaceLaplace.optimize_prior_precision`; also laplace-torch's
        ``method="gridsearch"`` and ``val_loader=`` (a DataLoader of ``(x, y)``)."""
        if "val_loader" in kwargs:
            if "x_val" in kwargs:
                raise TypeError("val_loader: give x_val (and y_val) or val_loader, not both")
            kwargs["x_val"] = kwargs.pop("val_loader")
        return super().optimize_prior_precision(
            "grid" if method == "gridsearch" else method, **kwargs
        )

    @property
    def prior_precision(self) -> torch.Tensor:
        """The model's ``λ`` (`AutoSubspaceLaplace.prior_precision`); setting it updates ``Σ``
        (`set_prior_precision`)."""
        return AutoSubspaceLaplace.prior_precision.fget(self)

    @prior_precision.setter
    def prior_precision(self, value: float | torch.Tensor) -> None:
        self.set_prior_precision(value)

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None):
        """laplace-torch's ``sample``: draws of all ``D`` weights ``(S, D)``, the subset drawn
        from ``N(ŵ_S, Σ)`` and the rest at the MAP (`AutoSubspaceLaplace.sample_weights`);
        ``generator`` seeds them (``None``: torch's global generator)."""
        seed = None
        if generator is not None:
            if not isinstance(generator, torch.Generator):
                raise TypeError(f"generator: expected a torch.Generator, got {generator!r}")
            seed = int(torch.randint(2**62, (), generator=generator))
        return self.sample_weights(n_samples, seed=seed)

    @property
    def n_params(self) -> int:
        """``K``, the number of weights with a posterior."""
        return self.model.rank

    def _unpacked(self, name: str, buffer: str) -> torch.Tensor:
        self._check_fitted()
        if self.structure.name == "lowrank":
            raise ValueError(f"{name}: the lowrank structure keeps it packed: la.{buffer}")
        return getattr(self, buffer)

    @property
    def posterior_precision(self) -> torch.Tensor:
        """``Σ⁻¹``: ``(K, K)`` (full) or ``(K,)`` (diag); the ``precision`` buffer."""
        return self._unpacked("posterior_precision", "precision")

    @property
    def posterior_covariance(self) -> torch.Tensor:
        """``Σ`` ``(K, K)`` (the diag structure's as a diagonal matrix)."""
        cov = self._unpacked("posterior_covariance", "covariance")
        return torch.diag(cov) if self.structure.name == "diag" else cov

    @property
    def posterior_variance(self) -> torch.Tensor:
        """The marginal variances ``diag(Σ)`` ``(K,)``, any structure."""
        self._check_fitted()
        return self.structure.marginal_std(self.scale_tril).square()


class DiagonalLaplace(NetLaplace):
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
        prior_precision = _check_lambda(prior_precision)
        model = SubspaceNet(
            net, all_weights(net), likelihood, prior_scale=1.0,
            temperature=check_temperature(temperature), prior_mean="zero",
        )  # fmt: skip
        model.set_prior_precision(prior_precision)
        super().__init__(model, hessian_structure="diag", chunk_size=chunk_size or 1024)

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


def _describe(subset: object) -> str:
    if isinstance(subset, str):
        return repr(subset)
    return f"a {type(subset).__name__}"


def _check_lambda(prior_precision: object) -> float:
    """``λ`` as a float: a positive number, a one-element floating tensor (e.g. a tuned
    ``la.prior_precision``) or a NumPy scalar."""
    return ck.positive_float(prior_precision, "prior_precision")


#: laplace-torch keywords with no counterpart here, and what to do instead
_LT_KEYWORDS = {
    "sigma_noise": "give the noise to the likelihood: likelihoods.Gaussian(sigma=...)",
    "subnetwork_indices": "pass the flat indices as subset_of_weights",
    "backend": "there are no curvature backends: the GGN is exact (Jacobian products)",
    "prior_mean": "the prior is N(0, 1/prior_precision I) on the weights (what weight "
    "decay trains); for another prior build AutoSubspaceLaplace(SubspaceNet(...), prior_mean=)",
    "temperature_scaling": "pass temperature=T",
}


__all__ = [
    "SUBSETS",
    "DiagonalLaplace",
    "Laplace",
    "LastLayerSubspace",
    "NetLaplace",
    "all_weights",
]
