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

import inspect
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from pyro import poutine
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from torch.func import functional_call

from ..nn import SubspaceNet
from .gaussian_prior import check_full_data, gaussian_priors


class EllipticalSliceSampler(MCMCKernel):
    """Elliptical slice sampler for Pyro models whose latents all have fixed Gaussian priors.

    Use it like ``NUTS``: ``MCMC(EllipticalSliceSampler(model), num_samples, warmup_steps,
    num_chains).run(*args)``. Every latent site must be ``Normal``/``MultivariateNormal``
    (``.to_event`` allowed) with parameters that do not depend on other latents; the rest of
    the joint density (observed sites, ``pyro.factor``, tempering by ``poutine.scale``) is the
    likelihood ``L(θ)``.

    For a `SubspaceNet`, ``L(t) = p(D | w = ŵ + P t)^{1/T}`` is evaluated over the whole
    training set in chunks of ``chunk_size`` rows under ``torch.no_grad()`` (memory bounded by
    the chunk, not by ``N``), ignoring the model's ``subsample_size``. Other models are traced by
    Pyro once per evaluation and must not subsample.

    Args:
        model: a Pyro model (callable) or a `SubspaceNet`.
        chunk_size: rows of data per forward pass for a `SubspaceNet` likelihood.
        recompute_bn: for a `SubspaceNet` whose network has BatchNorm layers: before each
            likelihood evaluation, recompute the running statistics at the proposed weights from
            the training inputs (cumulative average over the chunks, as drbayes does for CIFAR
            nets), so the sampled density is a fixed function of ``t``. Doubles the cost of an
            evaluation; off by default. The user's BatchNorm buffers are restored at `cleanup`.
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
    ) -> None:
        if not callable(model):
            raise TypeError(f"model: expected a Pyro model (callable), got {type(model).__name__}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
        if isinstance(max_shrinks, bool) or not isinstance(max_shrinks, int) or max_shrinks < 1:
            raise ValueError(f"max_shrinks: expected a positive int, got {max_shrinks!r}")
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
        """Split the model into its Gaussian priors and the likelihood; draw the start."""
        self._reset_counters()
        self._warmup_steps = warmup_steps
        self._args, self._kwargs = args, kwargs
        # A SubspaceNet called without y samples "obs"; that is a prediction, not a latent.
        is_subspace = isinstance(self.model, SubspaceNet)
        model = poutine.block(self.model, hide=["obs"]) if is_subspace else self.model
        self._priors = gaussian_priors(model, args, kwargs)
        if not self._priors:
            raise TypeError("model: has no latent sample sites to sample")
        self._means = {s.name: s.mean for s in self._priors}
        self._loglik_fn = self._subspace_loglik() if is_subspace else None
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
            raise ValueError(f"initial_params: the log-likelihood at the start is {self._loglik}")

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
        if getattr(self, "_saved_buffers", None) is not None:
            with torch.no_grad():
                for buf, saved in self._saved_buffers:
                    buf.copy_(saved)
            self._saved_buffers = None
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
            return self._loglik_fn(params[self._priors[0].name])
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

    def _subspace_loglik(self) -> Callable[[torch.Tensor], float]:
        model: SubspaceNet = self.model
        bound = inspect.signature(model.forward).bind(*self._args, **self._kwargs)
        x, y = bound.arguments["x"], bound.arguments.get("y")
        n = x.shape[0]
        if y is None:  # no observations: the posterior is the prior
            return lambda t: 0.0
        with torch.no_grad():  # only the output width is needed to check the targets
            probe = model.outputs(model.subspace.shift.new_zeros(model.rank), x[:1])
        y = model.likelihood.validate(probe.expand(n, *probe.shape[1:]), y)
        inv_t = 1.0 / model.temperature_for(n)
        net = model.flat.net
        bn = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        self._saved_buffers = None
        if self.recompute_bn and bn:
            self._saved_buffers = [(b, b.detach().clone()) for b in net.buffers()]

        def loglik(t: torch.Tensor) -> float:
            with torch.no_grad():
                if self._saved_buffers is not None:
                    self._refresh_batchnorm(model, t, x, bn)
                total = 0.0
                for i in range(0, n, self.chunk_size):
                    out = model.outputs(t, x[i : i + self.chunk_size])
                    total += model.likelihood.log_prob(out, y[i : i + self.chunk_size]).sum().item()
            return total * inv_t

        return loglik

    def _refresh_batchnorm(
        self, model: SubspaceNet, t: torch.Tensor, x: torch.Tensor, bn: list
    ) -> None:
        """Recompute BatchNorm running statistics at ``w = ŵ + P t`` over ``x`` in chunks."""
        net = model.flat.net
        params = model.flat.unflatten(model.subspace.weights(t))
        momenta = [m.momentum for m in bn]
        for m in bn:
            m.reset_running_stats()
        modes = [(m, m.training) for m in net.modules()]
        try:
            net.train()
            for i in range(0, x.shape[0], self.chunk_size):
                chunk = x[i : i + self.chunk_size]
                for m in bn:  # average over chunks weighted by their sizes
                    m.momentum = chunk.shape[0] / (i + chunk.shape[0])
                functional_call(net, {**params, **dict(net.named_buffers())}, (chunk,))
        finally:
            for m, momentum in zip(bn, momenta):
                m.momentum = momentum
            for m, training in modes:
                m.training = training
