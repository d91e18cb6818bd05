"""Elliptical slice sampling (Murray, Adams & MacKay, 2010) as a Pyro ``MCMCKernel``.

For a posterior ``p(θ | D) ∝ N(θ | μ, Σ) · L(θ)`` one transition is (Murray et al., Fig. 2):

    ν ~ N(0, Σ);  log y = log L(θ) + log u,  u ~ U(0, 1)
    φ ~ U[0, 2π];  [φ_min, φ_max] = [φ − 2π, φ]
    loop:  θ' = μ + (θ − μ) cos φ + ν sin φ
           if log L(θ') > log y: accept θ'
           else shrink the bracket towards 0 at φ and draw φ ~ U[φ_min, φ_max]

It has no step size to tune and needs only likelihood evaluations, no gradients. Subspace
Inference (Izmailov et al., 2019, appendix F) recommends it for the subspace posterior because
the prior over ``t`` is Gaussian; ``L`` is then the tempered likelihood ``p(D|t)^{1/T}`` of
eq. (3), summed over the full training set in chunks, without gradients.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from pyro import poutine
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from .. import distributed
from ..validation import positive_int
from .gaussian_prior import check_full_data, gaussian_priors, refuse_subsampling


class EllipticalSliceSampler(MCMCKernel):
    """Elliptical slice sampler for Pyro models whose latents all have fixed Gaussian priors.

    Use it like ``NUTS``: ``MCMC(EllipticalSliceSampler(model), num_samples, warmup_steps,
    num_chains).run(*args)``. Every latent site must be ``Normal``/``MultivariateNormal``
    (``.to_event`` allowed) with parameters that do not depend on other latents; the rest of
    the joint density (observed sites, ``pyro.factor``, tempering by ``poutine.scale``) is the
    likelihood ``L(θ)``.

    A model that offers ``log_likelihood_fn(*args, chunk_size=, recompute_bn=)`` (as
    `SubspaceNet` does: its `Evaluator`) has ``L(t) = p(D | w = ŵ + P t)^{1/T}`` evaluated over
    the whole training set in chunks of ``chunk_size`` rows under ``torch.no_grad()`` (memory
    bounded by the chunk, not by ``N``), ignoring the model's ``subsample_size``. Other models
    are traced by Pyro once per evaluation and must not subsample.

    Like Pyro's HMC, which takes a model or a ``potential_fn``, the kernel also takes no model
    but a ``prior`` (a ``Normal``/``MultivariateNormal`` over one latent ``"t"``) and a
    ``log_likelihood`` function ``t -> float``; then ``MCMC.run()`` needs no arguments.

    Args:
        model: a Pyro model (callable) or a `SubspaceNet`; or None with ``prior`` and
            ``log_likelihood``.
        chunk_size: rows of data per forward pass for an evaluator likelihood.
        recompute_bn: for a `SubspaceNet` whose network has BatchNorm layers: before each
            likelihood evaluation, recompute the running statistics at the proposed weights from
            the training inputs (cumulative average over the chunks, as drbayes does for CIFAR
            nets), so the sampled density is a fixed function of ``t``. Doubles the cost of an
            evaluation; off by default. The user's BatchNorm buffers are put back after every
            evaluation, so they are unchanged also when sampling raises or is interrupted
            (Pyro calls no `cleanup` then).
        max_shrinks: bracket shrinkages before a transition gives up and raises
            ``RuntimeError`` (the likelihood is then NaN or flat at ``-inf``).

    Diagnostics: ``"divergences"`` (always empty: every transition moves), ``"acceptance
    rate"`` (1.0) and ``"evaluations per draw"``.
    """

    def __init__(
        self,
        model: Callable,
        chunk_size: int = 4096,
        recompute_bn: bool = False,
        max_shrinks: int = 200,
        *,
        prior: object = None,
        log_likelihood: Callable[[torch.Tensor], float] | None = None,
    ) -> None:
        if model is None:
            if prior is None or not callable(log_likelihood):
                raise TypeError(
                    "model: give a Pyro model, or prior= (a Gaussian over t) and "
                    "log_likelihood= (a function t -> float)"
                )

            def model(*args: object, **kwargs: object) -> None:
                import pyro

                pyro.sample("t", prior)

            self._fn_likelihood = log_likelihood
        elif not callable(model):
            raise TypeError(f"model: expected a Pyro model (callable), got {type(model).__name__}")
        else:
            if prior is not None or log_likelihood is not None:
                raise ValueError("prior, log_likelihood: give either a model or these, not both")
            self._fn_likelihood = None
        positive_int(chunk_size, "chunk_size"), positive_int(max_shrinks, "max_shrinks")
        self.model = model
        self.chunk_size = chunk_size
        self.recompute_bn = bool(recompute_bn)
        self.max_shrinks = max_shrinks
        self.transforms: dict = {}
        self._initial_params: dict[str, torch.Tensor] | None = None
        self._user_initial = False
        self._reset_counters()
        super().__init__()

    def _reset_counters(self) -> None:
        self._t = 0
        self._warmup_steps = 0
        self._evals = 0
        self._evals_sampling = 0
        self._loglik: float | None = None

    # --- the MCMCKernel contract ------------------------------------------------------------

    def setup(self, warmup_steps: int, *args: Any, **kwargs: Any) -> None:
        """Split the model into its Gaussian priors and the likelihood; draw the start.

        Under ``torch.distributed`` every rank first takes rank 0's random stream
        (`distributed.share_random_stream`): with the all-reduced likelihood, every rank then
        makes the same accept and shrink decisions and returns the same chain."""
        refuse_subsampling(kwargs)
        distributed.share_random_stream()
        self._reset_counters()
        self._warmup_steps = warmup_steps
        self._args, self._kwargs = args, kwargs
        self._restore = None
        if self._fn_likelihood is not None:
            fn = self._fn_likelihood
            self._loglik_fn = lambda params: float(fn(params["t"]))
            model = self.model
        elif hasattr(self.model, "log_likelihood_fn"):  # the model's own full-data evaluator
            self._loglik_fn, self._restore = self.model.log_likelihood_fn(
                *args, chunk_size=self.chunk_size, recompute_bn=self.recompute_bn, **kwargs
            )
            model = self.model.latent_model  # the latent sites alone
        else:
            self._loglik_fn, model = None, self.model
        self._priors = gaussian_priors(
            model,
            () if model is not self.model else args,
            {} if model is not self.model else kwargs,
        )
        if not self._priors:
            raise TypeError("model: has no latent sample sites to sample")
        self._means = {s.name: s.mean for s in self._priors}
        if self._loglik_fn is None:
            with torch.no_grad():
                check_full_data(poutine.trace(self.model).get_trace(*args, **kwargs))
        if not self._user_initial:
            self._initial_params = {s.name: s.fn.sample() for s in self._priors}
        else:
            missing = {s.name for s in self._priors} - set(self._initial_params)
            if missing:
                raise ValueError(
                    f"initial_params: missing values for latent sites {sorted(missing)}"
                )
            for s in self._priors:
                value = self._initial_params[s.name]
                if tuple(value.shape) != tuple(s.shape):
                    raise ValueError(
                        f"initial_params[{s.name!r}]: expected shape {tuple(s.shape)}, "
                        f"got {tuple(value.shape)}"
                    )
        self._loglik = self.log_likelihood(self._initial_params)
        self._evals = 0  # count evaluations per transition only
        if not math.isfinite(self._loglik):
            where = "initial_params" if self._user_initial else "model"
            raise ValueError(
                f"{where}: the log-likelihood at the start (a draw from the prior) is "
                f"{self._loglik}; check the data and the network's outputs"
            )

    @property
    def initial_params(self) -> dict[str, torch.Tensor] | None:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor] | None) -> None:
        self._initial_params = None if params is None else dict(params)
        self._user_initial = params is not None

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One elliptical slice transition from ``params`` (Murray et al. 2010, Fig. 2)."""
        if self._loglik is None:
            raise RuntimeError("sample: call setup() first (the MCMC driver does)")
        mu = self._means
        nu = {s.name: s.centred_draw() for s in self._priors}
        u, phi = torch.rand(2).tolist()
        log_y = self._loglik + math.log(u or 1e-300)
        phi *= 2 * math.pi
        lo, hi = phi - 2 * math.pi, phi
        for _ in range(self.max_shrinks):
            c, s = math.cos(phi), math.sin(phi)
            proposal = {k: mu[k] + (params[k] - mu[k]) * c + nu[k] * s for k in params}
            loglik = self.log_likelihood(proposal)
            if loglik > log_y:
                self._loglik = loglik
                self._t += 1
                return proposal
            if phi < 0:
                lo = phi
            else:
                hi = phi
            phi = lo + (hi - lo) * torch.rand(()).item()
        raise RuntimeError(
            f"sample: no acceptable point after {self.max_shrinks} bracket shrinkages; the "
            "log-likelihood is NaN or -inf around the current state"
        )

    def logging(self) -> OrderedDict:
        return OrderedDict([("evals/draw", f"{self.evaluations_per_draw:.2f}")])

    def diagnostics(self) -> dict:
        return {
            "divergences": [],
            "acceptance rate": 1.0,
            "evaluations per draw": self.evaluations_per_draw,
        }

    def cleanup(self) -> None:
        if getattr(self, "_restore", None) is not None:
            self._restore()  # the user's BatchNorm buffers
            self._restore = None
        if not self._user_initial:
            self._initial_params = None

    # --- the likelihood ---------------------------------------------------------------------

    @property
    def evaluations_per_draw(self) -> float:
        """Mean number of likelihood evaluations per transition so far."""
        return self._evals / max(self._t, 1)

    def log_likelihood(self, params: dict[str, torch.Tensor]) -> float:
        """``log L(θ)``: the model's log joint minus its Gaussian log prior, as a float."""
        self._evals += 1
        if self._loglik_fn is not None:
            return self._loglik_fn(params)
        latent = {s.name for s in self._priors}  # conditioned now, so marked observed: skip by name
        with torch.no_grad():
            conditioned = poutine.condition(self.model, data=params)
            trace = poutine.trace(conditioned).get_trace(*self._args, **self._kwargs)
            value = trace.log_prob_sum(
                site_filter=lambda name, site: (
                    name not in latent and not site["infer"].get("_deterministic")
                )
            )
        return float(value)
