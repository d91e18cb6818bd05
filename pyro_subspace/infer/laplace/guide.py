"""`AutoSubspaceLaplace`: the linearised Laplace guide of a `SubspaceNet`, a Pyro autoguide.

Subnetwork Inference (Daxberger et al., 2021), eqs. (9)–(15): around the MAP, the posterior over
the subspace coordinates ``t`` of ``w = ŵ + P t`` is approximated by

    q(t) = N(t*, Σ),   Σ⁻¹ = Pᵀ G P / T + Λ₀                                    (eq. 15)

with the generalised Gauss–Newton ``G = Σ_n J_nᵀ H_n J_n`` (eq. 9), the likelihood temperature
``T`` of the model and its prior precision ``Λ₀`` (the model's prior: model and guide share it).
With an index basis this is the paper's full-covariance subnetwork Laplace; with
`subspaces.ggn_eigen` a low-rank Laplace; ``hessian_structure="diag"`` keeps the diagonal only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pyro
import torch
from pyro.infer.autoguide import AutoContinuous, AutoGuide

from ... import validation as ck
from ...data import DataSource
from ...flat import per_coordinate, writable_buffers_
from ...nn import SubspaceNet
from ...nn.evaluator import Evaluator
from ...transaction import transactional
from .map_search import _find_map, _newton, _warn_unconverged, has_kinks, posterior_offset
from .posteriors import Posterior, PriorPrecision, make_posterior, resolve_structure
from .predictive import linearized_predictive
from .tuning import optimize_prior_precision

PRIOR_MEANS = ("shift", "zero")
#: The guide's own buffers of the posterior before it held a `Posterior` (states saved then
#: load through `Posterior.legacy_state`).
LEGACY_BUFFERS = ("ggn", "precision", "covariance", "scale_tril")
#: a fit, refit or tuning either completes or leaves the guide and its model as they were
_all_or_nothing = transactional(lambda g: (g, g.model), lambda g: g._mark_unfitted())


class FitStatistics(NamedTuple):
    """What a fit records besides the posterior (the ``fit_statistics`` buffer, in order)."""

    temperature: float  #: ``T`` of the likelihood (0: not fitted)
    num_data: float  #: ``N``, the data points fitted
    residual_sum_of_squares: float  #: ``Σ (y − f(x, ŵ))²`` (Gaussian likelihoods; else 0)
    num_observations: float  #: the observations it sums (``N·O``)


class AutoSubspaceLaplace(AutoContinuous):
    """A Laplace guide ``q(t) = N(t*, Σ)`` for the latent sites of a `SubspaceNet` (eq. 15).

    Follows Pyro's ``AutoLaplaceApproximation``: find the MAP, take the curvature there, give a
    Gaussian guide. Sites come from the model's prototype trace (`SubspaceNet.latent_model`), so
    it works unchanged in ``SVI``, ``Predictive`` and ``AutoGuideList``; `median`, `quantiles`,
    `get_posterior` as for Pyro's autoguides. All fitted state lives in buffers: a
    ``state_dict`` loaded into a guide built the same way gives the same predictions.

    The prior is the model's (`SubspaceNet.prior`): ``prior_mean="shift"``: ``N(0, λ⁻¹)``;
    ``"zero"``: the weight prior ``N(0, λ⁻¹ I_D)`` restricted to the subspace,
    ``Λ₀ = λ PᵀP``, ``m₀ = −(PᵀP)⁻¹ Pᵀ ŵ`` (when ``ŵ`` is the MAP of a network trained with that
    prior, ``t* = 0``). Giving ``prior_precision``/``prior_mean`` here sets the model's prior.

    Args:
        model: the `SubspaceNet`.
        prior_precision: ``λ > 0`` (float or ``(K,)``); ``None`` keeps the model's.
        prior_mean: ``"shift"`` or ``"zero"``; ``None`` keeps the model's.
        rescale_prior: use ``λ_S = λ·K/D`` (Subnetwork Inference, section 4 after eq. 15
            and appendix C).
        hessian_structure: ``"full"``, ``"diag"``, ``"lowrank"``, ``"kron"`` (K-FAC, for a
            subspace of whole parameter tensors) or ``"auto"`` (``"full"`` while its ``(K, K)``
            buffers fit `posteriors.AUTO_BUDGET_BYTES`, else ``"kron"``; ``structure_choice``
            says which and why): the `Posterior` the guide holds (`posteriors`); ``"gp"``:
            laplace-torch's GP view on a subset of the data (`posteriors.FunctionalPosterior`,
            its options ``n_subset``, ``independent_outputs``, ``seed``), with its own evidence.
        chunk_size: rows of data per Jacobian block.
        rank: ``k`` of ``"lowrank"`` (top-``k`` GGN eigenpairs plus the prior as an isotropic
            remainder, `posteriors.LowRankPosterior`), ``1 <= k <= K``; default ``min(K, 10)``.
        dtype: of the ``(K, K)`` buffers of the full structure (``ggn``, ``precision``,
            ``covariance``, ``scale_tril``): ``None`` the network's, so a float32 network gets
            float32 Jacobian products summed in float64 and a float32 factorisation (as fast and
            half as large as float64; relative rounding about ``1e-7`` times the precision's
            condition number), a float64 network float64 throughout; ``torch.float64`` forces
            float64. A precision that is not positive definite in float32 is factorised in
            float64. The other structures are float64.
        structure_options: options of the structure (`posteriors.OPTIONS`), e.g. for
            ``"kron"`` ``fisher`` (``"type-2"``/``"mc"``), ``conv``, ``bias`` and ``damping``
            (``"exact"``/``"ritter"``), `posteriors.KronPosterior`.

    After `fit`: ``loc`` ``(K,) = t*`` (float64) and ``posterior``, the `Posterior` of the
    structure, which owns ``Σ`` and the curvature in its buffers (in ``dtype``, above). Every
    draw (`forward`, `sample_weights`, ``Predictive``) and the linearised predictive use this
    one ``Σ``. ``covariance``, ``precision``, ``scale_tril`` and ``ggn`` read it as dense
    ``(K, K)`` matrices (`Posterior.covariance`, ...). Before `fit` the full structure's
    buffers are zeros that take no memory. With at most ``2K/3`` GGN rows (``N·O``;
    ``N·(C−1)`` for ``C`` classes) the full structure takes ``Σ`` from the rows by Woodbury's
    identity (``K²·rows`` instead of ``K³``) and forms the GGN, the precision and the factor
    when first read (`posteriors.full`): the linearised predictive needs none of them; a draw,
    the evidence or a ``state_dict`` forms them.

    Example:
        >>> x, y = torch.randn(30, 2), torch.randn(30)
        >>> net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> model = SubspaceNet(net, subspaces.LastLayerSubspace(net), likelihoods.Gaussian(0.5))
        >>> guide = AutoSubspaceLaplace(model, prior_precision=1.0, prior_mean="zero")
        >>> guide = guide.fit(x, y)
        >>> guide.covariance.shape                                     # K = 8 + 1 weights
        torch.Size([9, 9])
        >>> f = Predictive(model, guide=guide, num_samples=10)(x[:4])["f"]  # (10, 4, 1)
    """

    def __init__(
        self,
        model: SubspaceNet,
        prior_precision: float | torch.Tensor | None = None,
        prior_mean: str | None = None,
        rescale_prior: bool = False,
        hessian_structure: str = "full",
        chunk_size: int = 1024,
        rank: int | None = None,
        dtype: torch.dtype | None = None,
        structure_options: dict | None = None,
    ) -> None:
        if not isinstance(model, SubspaceNet):
            raise TypeError(f"model: expected a SubspaceNet, got {type(model).__name__}")
        if dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"dtype: expected None, torch.float32 or torch.float64, got {dtype!r}")
        if prior_mean is not None and prior_mean not in PRIOR_MEANS:
            raise ValueError(f"prior_mean: expected one of {PRIOR_MEANS}, got {prior_mean!r}")
        sub, k = model.subspace, model.rank
        if dtype is None:
            net_dtype = sub.shift.dtype
            dtype = net_dtype if net_dtype in (torch.float32, torch.float64) else torch.float32
        posterior = make_posterior(
            hessian_structure, k, rank, dtype, sub.shift.device, structure_options
        )
        ck.positive_int(chunk_size, "chunk_size")
        lam = None
        if prior_precision is not None:
            lam = ck.prior_precision(prior_precision, k)
            if rescale_prior:
                lam = lam * k / sub.dim
        elif rescale_prior:
            lam = model.prior_precision * k / sub.dim
        if (prior_mean is not None and prior_mean != model.prior_mean) or lam is not None:
            model.set_prior(prior_mean or model.prior_mean, lam)
        AutoGuide.__init__(self, model)  # the model itself: no init messenger, no params
        self.posterior: Posterior = posterior
        #: the structure held (``"auto"`` resolved) and why (`posteriors.resolve_structure`)
        self.hessian_structure, self.structure_choice = resolve_structure(hessian_structure, k)
        self.chunk_size = chunk_size
        self.rescale_prior = bool(rescale_prior)
        f64 = {"dtype": torch.float64, "device": sub.shift.device}
        self.register_buffer("loc", torch.zeros(k, **f64))
        self.register_buffer("map_log_likelihood", torch.zeros((), **f64))
        # `FitStatistics` in order (temperature 0 = unfitted); read it through `statistics`
        self.register_buffer("fit_statistics", torch.zeros(len(FitStatistics._fields), **f64))
        #: the model's ``λ`` ``(K,)`` and noise ``σ`` (NaN: none) that ``Σ`` was formed with: a
        #: guide whose model has another prior or noise (a guide's state loaded without its
        #: model's) is refused at use instead of predicting with a Σ its evidence does not match
        self.register_buffer("posterior_prior_precision", per_coordinate(torch.zeros((), **f64), k))
        self.register_buffer("posterior_sigma", torch.full((), math.nan, **f64))
        self._setup_prototype()

    # ------------------------------------------------------------------ Pyro's autoguide API

    def _setup_prototype(self, *args: object, **kwargs: object) -> None:
        """The prototype trace is the model's latent sites (no data needed)."""
        model = self.model
        saved, self._model = self._model, (model.latent_model,)
        try:
            super()._setup_prototype()
        finally:
            self._model = saved

    def get_posterior(self, *args: object, **kwargs: object):
        """``N(t*, Σ)`` over the packed latent ``t``, event shape ``(K,)``, float64."""
        self._check_fitted()
        return self.posterior.distribution(self.loc)

    def sample_latent(self, *args: object, **kwargs: object) -> torch.Tensor:
        self._check_fitted()
        dtype = self.model.subspace.shift.dtype
        dist = self.posterior.distribution(self.loc.to(dtype))
        return pyro.sample(f"_{self._pyro_name}_latent", dist, infer={"is_auxiliary": True})

    def _loc_scale(self, *args: object, **kwargs: object):
        self._check_fitted()
        dtype = self.model.subspace.shift.dtype
        return self.loc.to(dtype), self.posterior.marginal_variance().sqrt().to(dtype)

    # ------------------------------------------------------------------ state

    @property
    def laplace_guide(self) -> AutoSubspaceLaplace:
        """Itself (`infer.Laplace`'s object answers with its guide): what the functions that
        take a Laplace guide read."""
        return self

    @property
    def statistics(self) -> FitStatistics:
        """The fit's statistics by name (the ``fit_statistics`` buffer, kept for persistence)."""
        return FitStatistics(*(float(v) for v in self.fit_statistics))

    @property
    def fitted(self) -> bool:
        return self.statistics.temperature > 0

    @property
    def temperature(self) -> float:
        return self.statistics.temperature

    @property
    def num_data(self) -> int:
        return int(self.statistics.num_data)

    @property
    def likelihood(self):
        return self.model.likelihood

    @property
    def prior_precision(self) -> torch.Tensor:
        """The model's ``λ``: a 0-d tensor when shared by all coordinates, else ``(K,)``."""
        lam = self.model.prior_precision
        return lam[0].clone() if bool((lam == lam[0]).all()) else lam

    @property
    def prior_loc(self) -> torch.Tensor:
        return self.model.prior_loc

    def prior(self, prior_precision: float | torch.Tensor | None = None) -> PriorPrecision:
        """The model's exact prior precision ``Λ₀`` of the coordinates (`PriorPrecision`), with
        ``prior_precision`` for ``λ`` if given (a tensor that requires grad stays in the graph)."""
        lam = self.prior_precision if prior_precision is None else prior_precision
        lam = torch.as_tensor(lam, dtype=torch.float64, device=self.loc.device)
        gram = None if self.model.prior_gram.numel() == 0 else self.model.prior_gram
        return PriorPrecision(lam, gram if lam.dim() == 0 else None, self.model.rank)

    def prior_precision_matrix(self, prior_precision: torch.Tensor | None = None) -> torch.Tensor:
        """``Λ₀`` ``(K, K)`` as the posterior represents it (`Posterior.effective_prior`:
        ``λ·PᵀP`` / ``diag(λ)`` for the full structure, the diagonal of it for the others)."""
        return self.posterior.effective_prior(self.prior(prior_precision)).matrix()

    @property
    def covariance(self) -> torch.Tensor:
        """``Σ`` ``(K, K)`` (`Posterior.covariance`)."""
        return self.posterior.covariance()

    @property
    def precision(self) -> torch.Tensor:
        """``Σ⁻¹`` ``(K, K)`` (`Posterior.precision`)."""
        return self.posterior.precision()

    @property
    def scale_tril(self) -> torch.Tensor:
        """``L`` ``(K, K)`` lower-triangular with ``L Lᵀ = Σ`` (`Posterior.cholesky`)."""
        return self.posterior.cholesky()

    @property
    def ggn(self) -> torch.Tensor:
        """The curvature ``PᵀGP`` ``(K, K)`` the posterior keeps, untempered
        (`Posterior.curvature`)."""
        return self.posterior.curvature()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        old = {n: state_dict.pop(prefix + n) for n in LEGACY_BUFFERS if prefix + n in state_dict}
        if old:  # saved before the guide held a posterior: its buffers under their new names
            stats = state_dict.get(prefix + "fit_statistics")
            for name, value in self.posterior.legacy_state(old).items():
                state_dict[prefix + "posterior." + name] = value
            if stats is not None:
                state_dict[prefix + "posterior.temperature"] = stats[0].clone()
        if prefix + "loc" in state_dict and prefix + "posterior_prior_precision" not in state_dict:
            # a state saved before the guide recorded the λ and σ its Σ was formed with: NaN
            # marks them unknown, and the guide refuses to predict until set_prior_precision
            # forms Σ for its model's prior (never silently with a mismatched prior)
            k = self._buffers["loc"].shape[0]
            state_dict[prefix + "posterior_prior_precision"] = torch.full((k,), math.nan).double()
            state_dict[prefix + "posterior_sigma"] = torch.tensor(math.nan).double()
        writable_buffers_(self, ("posterior_prior_precision",))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _check_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError(f"{type(self).__name__}: call fit(x, y) first")
        lam, sigma = self.model.prior_precision, self._model_sigma()
        formed, formed_sigma = self.posterior_prior_precision, float(self.posterior_sigma)
        same_sigma = math.isnan(sigma) and math.isnan(formed_sigma) or sigma == formed_sigma
        if bool(formed.isnan().any()):
            raise RuntimeError(
                f"{type(self).__name__}: its state was saved before guides recorded the prior "
                "their posterior was formed with: load the model's state_dict, then call "
                "guide.set_prior_precision(guide.model.prior_precision) to form Σ for it"
            )
        if not torch.equal(lam, formed.to(lam)) or not same_sigma:
            raise RuntimeError(
                f"{type(self).__name__}: its posterior was formed with the prior precision "
                f"{_short(formed)} and noise sigma {formed_sigma:.6g}, but its model now has "
                f"{_short(lam)} and {sigma:.6g} (a guide's state loaded without its model's?): "
                "load the model's state_dict too, or call guide.set_prior_precision(...) to "
                "form the posterior for the model's prior"
            )

    def _model_sigma(self) -> float:
        """The likelihood's one noise scale ``σ`` (NaN for a likelihood without one)."""
        if not self.likelihood.noise_scale_tunable:
            return math.nan
        return float(self.likelihood.sigma.detach())

    def _record_posterior_hyperparameters(self) -> None:
        self.posterior_prior_precision = per_coordinate(self.model.prior_precision, self.model.rank)
        self.posterior_sigma.fill_(self._model_sigma())

    def _mark_unfitted(self) -> None:
        """What an interrupted fit leaves when its state was too large to copy aside
        (`transaction.BUDGET_BYTES`): an unfitted guide, never a half-fitted one."""
        self.fit_statistics.zero_()
        self.posterior.clear_pending()

    # ------------------------------------------------------------------ fitting

    @_all_or_nothing
    def fit(
        self,
        x: object,
        y: torch.Tensor | None = None,
        find_map: bool = True,
        max_iter: int = 500,
        tol: float = 1e-9,
        newton_steps: int | None = None,
    ):
        """Find ``t*`` and set ``Σ⁻¹ = Pᵀ G(t*) P / T + Λ₀``; returns ``self``.

        The MAP of ``−log p(y | t)/T − log p(t)`` is found by full-batch L-BFGS with a
        strong-Wolfe line search over the model's `Evaluator` (data in chunks), finished by one
        Gauss–Newton step kept if it lowers the loss (exact for a linear-Gaussian model) and,
        while a gradient entry is still above ``tol``, by Newton steps with the exact Hessian
        (`Evaluator.hessian`), each kept only if the loss does not rise beyond rounding and the
        largest gradient entry falls (quadratic convergence on a smooth network, where L-BFGS
        and Gauss–Newton crawl; on a ReLU kink the first step is refused and the search stops).
        ``find_map=False`` keeps ``t* = 0`` (the shift).

        Args:
            x: training inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)``.
            y: targets ``(N,)`` (or ``(N, O)``); ``None`` with a Dataset/DataLoader. With
                ``find_map=False`` they may be omitted: the curvature needs inputs only (the
                evidence then is unavailable).
            find_map: run the MAP search.
            max_iter: at most this many L-BFGS iterations.
            tol: stop when every entry of the gradient is below ``tol`` in absolute value.
            newton_steps: at most this many exact-Newton steps after L-BFGS (each costs about
                ``K`` backward passes over the data); ``None``: 5 for ``K ≤ 512``, else 0.

        Warns:
            ConvergenceWarning: the MAP search ended with a gradient entry above ``tol`` and
                a Newton decrement ``√(∇ᵀΣ∇)`` above ``1e-3`` (`map_search.NEGLIGIBLE_OFFSET`:
                below it ``t*`` is within a thousandth of a posterior standard deviation of the
                MAP, as a float32 search stopped by rounding often is; the message gives both).
                ``t*`` is then not the MAP and the
                posterior is centred and curved at the wrong point. To converge: raise
                ``max_iter`` or ``newton_steps``, and fit in float64 (``net.double()`` with float64 data): float32
                gradients have a rounding floor far above the default ``tol=1e-9``. Even in
                float64 the search can stall where the loss no longer resolves a decrease, or
                at a minimum on a ReLU kink whose gradient does not vanish; a last-layer
                subspace (linear in ``t``: the Gauss–Newton step is exact for a Gaussian
                likelihood) converges, in float32 up to rounding. Filter the warning by its class.
        """
        ck.positive_int(max_iter, "max_iter"), ck.positive_float(tol, "tol")
        ck.nonneg_int(newton_steps, "newton_steps", allow_none=True)
        self.model.check_data(x, y)  # width, dtype, device, NaN, targets: before any work
        data = DataSource(x, y, self.chunk_size)
        has_targets = data.loader is not None or data.y is not None
        if find_map and not has_targets:
            raise ValueError("y: the MAP search needs targets (or find_map=False)")
        ev = Evaluator(self.model, data)
        t = torch.zeros(self.model.rank, dtype=torch.float64, device=self.loc.device)
        if has_targets:
            next(ev.chunks())  # validates the targets before any work
        if find_map:
            prior = FullPrior(self)
            objective = lambda tt: prior.add(*ev.nll_and_grad(tt), tt)
            t, iterations, used_up = _find_map(objective, t, max_iter, tol)
            t, grad = self._polish(objective, t, ev, prior)
            steps = (5 if self.model.rank <= 512 else 0) if newton_steps is None else newton_steps
            t, grad = _newton(objective, t, grad, ev, prior, steps, tol)
            dtype, kinked = self.model.subspace.shift.dtype, has_kinks(self.model.flat.net)
            unconverged = (grad, tol, iterations, max_iter if used_up else None, dtype, kinked)
        self.loc.copy_(t.detach())
        stats = self.posterior.fit_curvature(ev, t)  # its pass's statistics, or None
        if stats is None:
            stats = ev.map_statistics(t) if has_targets else (math.nan, 0.0, 0)
        loglik, sse, count = stats
        self.map_log_likelihood.fill_(loglik)
        stats = FitStatistics(ev.temperature, ev.num_data, sse, count)
        self.fit_statistics.copy_(torch.tensor(stats, dtype=torch.float64))
        self._set_posterior()
        if find_map and float(unconverged[0].abs().max()) > tol:  # Σ∇ only when it can matter
            _warn_unconverged(*unconverged, offset=posterior_offset(self, unconverged[0]))
        return self

    def _polish(self, objective: Callable, t: torch.Tensor, ev, prior):
        """One Gauss–Newton step ``t − (PᵀGP/T + Λ₀)⁻¹ ∇``, kept unless it raises the loss
        (the posterior's `newton_step`: the dense ``PᵀGP`` except for the low-rank one);
        returns the point kept and the gradient there."""
        loss, grad = objective(t)
        t_new = t - self.posterior.newton_step(ev, t, grad, prior.prior)
        loss_new, grad_new = objective(t_new)
        if loss_new <= loss + 1e-12 * (1 + abs(loss)):  # up to rounding
            return t_new, grad_new
        return t, grad

    def _set_posterior(self) -> None:
        """Form ``Σ`` for the model's prior (and record the ``λ`` and ``σ`` it was formed with)."""
        self._record_posterior_hyperparameters()
        self.posterior.set_prior(self.prior())

    # ------------------------------------------------------------------ draws and predictives

    def sample_weights(self, num_samples: int, seed: int | None = None) -> torch.Tensor:
        """Draws of all ``D`` weights, ``(S, D)``: ``ŵ + P t`` with ``t ~ N(t*, Σ)``. Without a
        ``seed`` the draws come from torch's global generator (never re-seeded)."""
        self._check_fitted()
        ck.positive_int(num_samples, "num_samples"), ck.check_int(seed, "seed", 0, allow_none=True)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.loc.device).manual_seed(seed)
        return self.model.subspace.weights(self.draw_latent(num_samples, gen))

    def draw_latent(self, num_samples: int, generator: torch.Generator | None = None):
        """Draws ``t ~ N(t*, Σ)`` ``(S, K)``, float64, from ``generator`` (``None``: torch's
        global generator, never re-seeded)."""
        self._check_fitted()
        ck.positive_int(num_samples, "num_samples")
        eps = torch.randn(
            num_samples, self.model.rank, generator=generator, dtype=torch.float64,
            device=self.loc.device,
        )  # fmt: skip
        return self.loc + self.posterior.draw(eps).double()

    def predict(self, x: torch.Tensor, link_approx: str = "auto", **kwargs: object):
        """The linearised predictive as a ``torch.distributions`` object (`linearized_predictive`)."""
        return linearized_predictive(self, x, link_approx, **kwargs)

    # ------------------------------------------------------------------ hyperparameters

    def log_marginal_likelihood(
        self,
        prior_precision: float | torch.Tensor | None = None,
        sigma: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The Laplace evidence ``ℓ/T − ½ (t*−m₀)ᵀ Λ₀ (t*−m₀) + ½ log|Λ₀| − ½ log|PᵀGP/T + Λ₀|``
        with ``t*`` and the curvature held at the fitted values. Differentiable in
        ``prior_precision`` and, for a likelihood with one tunable noise scale, in ``sigma``
        (``G ∝ 1/σ²``, ``ℓ = −(N·O/2) log 2πσ² − RSS/2σ²``). Returns a 0-d float64 tensor."""
        self._check_fitted()
        if math.isnan(float(self.map_log_likelihood)):
            raise RuntimeError("log_marginal_likelihood: fit(x, y) with targets first")
        lam = self.prior_precision if prior_precision is None else prior_precision
        lam = torch.as_tensor(lam, dtype=torch.float64, device=self.loc.device)
        loglik, c = self.map_log_likelihood, 1.0
        if sigma is not None:
            sigma0 = self._scalar_sigma()
            sigma = torch.as_tensor(sigma, dtype=torch.float64, device=self.loc.device)
            c, loglik = (sigma0 / sigma) ** 2, self._gaussian_loglik(sigma)
        elif self.likelihood.noise_scale_tunable:
            sigma = torch.tensor(self._scalar_sigma(), dtype=torch.float64, device=self.loc.device)
        d = self.loc - self.prior_loc
        return self.posterior.log_evidence(
            loglik / self.temperature, self.prior(lam), d, c, sigma
        )

    def _scalar_sigma(self) -> float:
        if not self.likelihood.noise_scale_tunable:
            raise ValueError("sigma: only a homoscedastic Gaussian with one noise scale has one")
        return float(self.likelihood.sigma.detach())

    def _gaussian_loglik(self, sigma: torch.Tensor) -> torch.Tensor:
        """``log p(D | t*)`` at the noise ``σ`` (`Likelihood.log_likelihood_at_noise`)."""
        stats = self.statistics
        return self.likelihood.log_likelihood_at_noise(
            sigma, stats.residual_sum_of_squares, stats.num_observations
        )

    @_all_or_nothing
    def set_sigma(self, sigma: float | torch.Tensor) -> None:
        """Set the likelihood's noise ``σ`` and update the curvature (``G ∝ 1/σ²``), the MAP
        log-likelihood (from the fit's residual sum of squares) and ``Σ``; a homoscedastic
        Gaussian only."""
        self._check_fitted()
        old = self._scalar_sigma()
        sigma = ck.positive_float(sigma, "sigma")
        with torch.no_grad():
            self.posterior.scale_curvature_((old / sigma) ** 2)
            self.map_log_likelihood.copy_(self._gaussian_loglik(torch.tensor(sigma).double()))
        lik = self.likelihood  # a learned PyroParam or a buffer: set in place
        lik.sigma = torch.full_like(lik.sigma.detach(), sigma)
        self._set_posterior()

    @_all_or_nothing
    def set_prior_precision(self, prior_precision: float | torch.Tensor) -> None:
        """Set ``λ`` in the model's prior (shared with MCMC/SVI on it) and update ``Σ``."""
        self.model.set_prior_precision(prior_precision)
        if self.fitted:
            self._set_posterior()

    @_all_or_nothing
    def optimize_prior_precision(self, method: str = "marglik", **kwargs: object):
        """Choose ``λ`` (and optionally ``σ``) by ``"marglik"`` (type-II maximum likelihood) or
        ``"grid"`` (validation log-likelihood); see `tuning.optimize_prior_precision`."""
        optimize_prior_precision(self, method, **kwargs)
        return self


def _short(t: torch.Tensor) -> str:
    """``λ`` for a message: one number when every coordinate has it."""
    t = t.detach().double().reshape(-1)
    if t.numel() and bool((t == t[0]).all()):
        return f"{float(t[0]):.6g}"
    return f"{t[:3].tolist()}..." if t.numel() > 3 else str(t.tolist())


class FullPrior:
    """``½ (t − m₀)ᵀ Λ₀ (t − m₀)`` added to a loss and gradient: the exact prior of the guide's
    model (`AutoSubspaceLaplace.prior`) whatever the posterior structure."""

    def __init__(self, guide: AutoSubspaceLaplace) -> None:
        self.prior = guide.prior()
        self.loc = guide.prior_loc

    @property
    def matrix(self) -> torch.Tensor:
        """``Λ₀`` ``(K, K)``."""
        return self.prior.matrix()

    def add(self, loss: float, grad: torch.Tensor, t: torch.Tensor) -> tuple[float, torch.Tensor]:
        d = t.detach() - self.loc
        lam_d = self.prior.apply(d)
        total = loss + float(d @ lam_d) / 2
        if not math.isfinite(total):
            raise FloatingPointError("fit: the negative log joint is not finite at the MAP search")
        return total, grad + lam_d
