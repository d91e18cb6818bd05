"""Generalised elliptical slice sampling with a fitted reference, several chains in one pass.

Plain elliptical slice sampling (`EllipticalSliceSampler`) slices over the prior; when the
posterior is much narrower than the prior (``T = 1``) most proposals are rejected and the moves are
short. Here the ellipse is drawn around a *reference* ``R`` fitted to the posterior (a Laplace
guide, SWAG moments in the subspace, or the warm-up draws), and the likelihood is the ratio of the
target ``π(t) ∝ p(t) L(t)`` to the reference (Nishihara, Murray & Adams 2014, section 3; Fagan,
Bhandari & Cunningham 2016, eq. 3):

    π(t) = R(t) · L̃(t),   L̃(t) = p(t) L(t) / R(t)

*Gaussian reference* ``R = N(μ, Σ)``: one transition from ``t`` (Murray et al. 2010, Fig. 2, with
``L̃`` for ``L``):

    ν ~ N(0, Σ);  log y = log L̃(t) + log u,  u ~ U(0, 1)
    φ ~ U[0, 2π];  [φ_min, φ_max] = [φ − 2π, φ]
    loop:  t' = μ + (t − μ) cos φ + ν sin φ
           accept t' if log L̃(t') > log y, else shrink the bracket and redraw φ

*Multivariate-t reference* ``R = t_df(μ, Σ)`` (Nishihara et al., Algorithm 2): first draw the scale
``s ~ InvGamma((df + K)/2, (df + (t − μ)ᵀΣ⁻¹(t − μ))/2)``, then the transition above with
``ν ~ N(0, s Σ)``; ``L̃ = π / R`` does not depend on ``s``. Heavier tails than a Gaussian make the
sampler robust to a reference that is too narrow. Both leave ``π`` invariant for any reference; the
closer ``R`` is to ``π``, the closer a draw is to an independent one at one evaluation per draw.

Chains: ``MCMC(kernel, num_samples, warmup_steps, num_chains=C)``. With ``chains=C`` the kernel
advances all ``C`` chains together, each still-open bracket proposing once per pass, and evaluates
the ``(B, K)`` proposals in one batched call of the log-likelihood; Pyro's sequential driver then
replays chain ``c``'s stored trajectory. Chain ``j`` draws its random numbers from its own
generator (seeded from ``seed`` and ``j``), so the batched chains equal the chains run one at a
time. ``j`` counts the chains this kernel object has started, across ``MCMC`` runs: a second run
with the same kernel continues with new chains (new draws); a new kernel with the same ``seed``
repeats the first run.

Adaptation (by default only for ``reference="warmup"``, whose start is the prior): the
reference is refitted from the later half of the warm-up draws of *all the chains advanced
together*, pooled (as Nishihara et al., section 4, fit one reference to the states of many
parallel chains), once the pool holds ≥ 20 K draws. A covariance from one
chain's few warm-up draws is a poor reference: an elliptical slice move keeps the radius
``|t − μ|`` correlated (even with ``R = π``, ``E[cos² φ] = 1/2``), so a chain's second moments
have about a third of its draws as effective draws. Chains run one at a time (``chains=None``)
can pool only their own draws. Adaptation ends with the warm-up; the draws after it come from a
fixed kernel that leaves ``π`` invariant.

A fitted reference (Laplace, SWAG moments, a given Gaussian) is kept fixed by default: it is
deterministic, while a covariance estimated from ``n`` warm-up draws carries a sampling error of
about ``(K + K(K+1)/2) / (2 n_eff)`` nats of KL divergence (``n_eff ≈ n/3`` for second moments,
above), e.g. 0.25 nats for ``K = 10`` from 4 chains × 100 draws, more than the Laplace fit's own
error on the subspace posteriors of the benchmarks (measured: the refit needed 1.1–1.9
evaluations per draw where the Laplace reference needed 1.0–1.4, ``benchmarks/results/
ess_vs_nuts_gess.txt``). Refit it (``adapt=True``) when the fit is known to be poor.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from ..exceptions import ConvergenceWarning
from .gaussian_prior import gaussian_moments, refuse_subsampling

REFERENCES = ("warmup", "laplace", "prior")
INFLATION, SHRINKAGE = 1.2, 0.1  # of the covariance refitted from warm-up draws
MIN_DRAWS_PER_DIM = 20  # a refit needs at least 20 K warm-up draws in its window
START_DISPERSION = 2.0  # chains start at draws of N(μ, 4 Σ) of a fitted reference
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: chain j's seed is hash of (seed, j)


class GeneralizedEllipticalSliceSampler(MCMCKernel):
    """Elliptical slice sampling over a fitted Gaussian or multivariate-t reference.

    Args:
        model: a `SubspaceNet` (anything with ``prior()``, ``evaluator(x, y, chunk_size)`` and
            ``outputs(t, x)``); or None with ``prior`` and ``log_likelihood``.
        reference: where ``(μ, Σ)`` comes from: ``"warmup"`` (start from the prior, refit from
            the chain's warm-up draws), ``"laplace"`` (an `AutoSubspaceLaplace` fitted to the
            data at the first `setup`), ``"prior"`` (the prior, never adapted: plain ESS), a
            fitted `AutoSubspaceLaplace`, a ``Normal``/``MultivariateNormal`` over ``t``, or a
            pair ``(μ (K,), Σ (K, K) or (K,))``, e.g. SWAG moments mapped into the subspace.
        df: ``None`` for a Gaussian reference, a positive int for a multivariate-t reference.
        adapt: refit ``(μ, Σ)`` from the warm-up draws of the chains advanced together,
            pooled (the later half, at warm-up steps 25, 50, 100, … and at the end of warm-up,
            once the pool holds ≥ 20 K draws). With ``chains=None`` each chain pools its own.
            ``None`` (default): only for ``reference="warmup"``; a fitted reference is kept
            (see the module notes: a refit from a few hundred draws is a worse reference).
        chains: ``None``: every ``MCMC`` chain is sampled on its own; an int ``C``: the kernel
            advances ``C`` chains together; run it with ``MCMC(..., num_chains=C)`` (in one
            process: in a worker of Pyro's multiprocessing driver each chain runs on its own).
        seed: base seed of the chains' generators; ``None`` (and in a worker process of Pyro's
            parallel driver, which seeds each worker): drawn from torch's global generator
            (reproducible with ``torch.manual_seed``).
        chunk_size: rows of data per forward pass.
        max_shrinks: bracket shrinkages before a transition raises ``RuntimeError``.
        prior: with ``model=None``: a ``Normal``/``MultivariateNormal`` over ``t``, event ``(K,)``.
        log_likelihood: with ``model=None``: ``(B, K) -> (B,)``, ``log L`` of a batch of points.

    Shapes: the latent site ``"t"`` is ``(K,)`` per chain; internally the chains' states are
    ``(C, K)`` and the log-likelihood is called on ``(B, K)``, ``B ≤ C`` open brackets.
    Diagnostics: ``"evaluations per draw"`` (likelihood evaluations of this chain per
    transition) and ``"passes per draw"`` (batched calls per transition, ≥ 1).
    """

    def __init__(
        self,
        model: Any = None,
        reference: Any = "warmup",
        df: int | None = None,
        adapt: bool | None = None,
        chains: int | None = None,
        seed: int | None = None,
        chunk_size: int = 4096,
        max_shrinks: int = 200,
        *,
        prior: Any = None,
        log_likelihood: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if model is None:
            if prior is None or not callable(log_likelihood):
                raise TypeError(
                    "model: give a SubspaceNet, or prior= (a Gaussian over t) and "
                    "log_likelihood= (a function (B, K) -> (B,))"
                )
        elif prior is not None or log_likelihood is not None:
            raise ValueError("prior, log_likelihood: give either a model or these, not both")
        elif not all(hasattr(model, a) for a in ("prior", "evaluator", "outputs")):
            raise TypeError(
                f"model: expected a SubspaceNet (prior, evaluator, outputs), got "
                f"{type(model).__name__}; for other Pyro models use EllipticalSliceSampler"
            )
        if isinstance(reference, str) and reference not in REFERENCES:
            raise ValueError(
                f"reference: expected one of {REFERENCES} or a Gaussian, got {reference!r}"
            )
        if reference == "laplace" and model is None:
            raise ValueError("reference: 'laplace' needs a SubspaceNet model")
        if df is not None and (isinstance(df, bool) or not isinstance(df, int) or df < 1):
            raise ValueError(f"df: expected None (Gaussian) or a positive int, got {df!r}")
        for name, value in (("chunk_size", chunk_size), ("max_shrinks", max_shrinks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if adapt is not None and not isinstance(adapt, bool):
            raise TypeError(f"adapt: expected None, True or False, got {type(adapt).__name__}")
        if chains is not None and (
            isinstance(chains, bool) or not isinstance(chains, int) or chains < 1
        ):
            raise ValueError(f"chains: expected None or a positive int, got {chains!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
        self.model, self.reference, self.df = model, reference, df
        if adapt is None:  # refit only a reference that starts as the prior
            adapt = isinstance(reference, str) and reference == "warmup"
        self.adapt = adapt
        self.chains, self.seed = chains, seed
        self.chunk_size, self.max_shrinks = chunk_size, max_shrinks
        self._prior = prior if model is None else None
        self._user_loglik = log_likelihood
        self._pid = os.getpid()
        self._chain_count = 0  # chains started by this kernel: the index of the next one
        self._batch: _Batch | None = None
        self._laplace_key: tuple | None = None
        self._initial_params: dict | None = None
        self._user_initial = False
        self.transforms: dict = {}
        super().__init__()

    # --- the MCMCKernel contract ------------------------------------------------------------

    @property
    def initial_params(self) -> dict | None:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict | None) -> None:
        self._initial_params = None if params is None else dict(params)
        self._user_initial = params is not None

    def setup(self, warmup_steps: int, *args: Any, **kwargs: Any) -> None:
        """Start a chain: a new batch of ``chains`` chains, or the next chain of the batch."""
        refuse_subsampling(kwargs)
        size = self.chains if self.chains and os.getpid() == self._pid else 1
        batch = self._batch
        new = (
            batch is None
            or batch.opened >= batch.size
            or not _same(batch.args, args)
            or list(batch.kwargs) != list(kwargs)
            or not _same(tuple(batch.kwargs.values()), tuple(kwargs.values()))
            or batch.warmup != warmup_steps
        )
        if new:
            start = None
            if self._user_initial:
                start = torch.as_tensor(self._initial_params["t"]).double()
                if size > 1 and (start.dim() != 2 or start.shape[0] != size):
                    raise ValueError(
                        f"initial_params: with chains={size} set kernel.initial_params to "
                        f"{{'t': ({size}, K)}} (all chains start at once), got shape "
                        f"{tuple(start.shape)}; MCMC's initial_params needs chains=None"
                    )
            prior, loglik = self._target(args, kwargs)
            mu, cov = self._initial_reference(prior, args, kwargs)
            first = self._chain_count
            if self.seed is not None and os.getpid() == self._pid:
                seeds = [(self.seed * _MIX + 7919 * (first + j)) % 2**63 for j in range(size)]
            else:
                seeds = torch.randint(0, 2**62, (size,)).tolist()
            self._batch = batch = _Batch(
                self, prior, loglik, mu, cov, seeds, warmup_steps, start, args, kwargs
            )
            self._chain_count += size
        self._chain = batch.opened
        batch.opened += 1
        self._step = 0
        self._initial_params = {"t": batch.states[0][self._chain].clone()}

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Chain ``c``'s next state (advancing the whole batch when it is the first to ask)."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("sample: call setup() first (the MCMC driver does)")
        self._step += 1
        while len(batch.states) <= self._step:
            batch.advance()
        return {"t": batch.states[self._step][self._chain]}

    def logging(self) -> OrderedDict:
        return OrderedDict([("evals/draw", f"{self.evaluations_per_draw:.2f}")])

    @property
    def evaluations_per_draw(self) -> float:
        """Likelihood evaluations of the current chain per transition so far."""
        b = self._batch
        return 0.0 if b is None else float(b.evals[self._chain]) / max(b.steps, 1)

    def diagnostics(self) -> dict:
        b = self._batch
        steps = max(b.steps, 1)
        return {
            "divergences": [],
            "acceptance rate": 1.0,
            "evaluations per draw": float(b.evals[self._chain]) / steps,
            "passes per draw": b.passes / steps,
        }

    def cleanup(self) -> None:
        b = self._batch
        if b is not None and b.opened >= b.size:
            b.states = b.states[:1]  # free the trajectory; the batch is finished
        if not self._user_initial:
            self._initial_params = None

    # --- the target and the reference -------------------------------------------------------

    def _target(self, args: tuple, kwargs: dict):
        """``(prior, log L)`` with ``log L: (B, K) -> (B,)`` float64."""
        if self.model is None:
            return self._prior, lambda t: torch.as_tensor(self._user_loglik(t)).double()
        model = self.model
        prior = model.prior()
        y = args[1] if len(args) > 1 else kwargs.get("y")
        x = args[0] if args else kwargs.get("x")
        if y is None and (x is None or isinstance(x, torch.Tensor)):  # no targets: the prior
            return prior, lambda t: t.new_zeros(t.shape[0], dtype=torch.float64)
        ev = model.evaluator(x, y, self.chunk_size)  # a Dataset / DataLoader brings its targets
        return prior, ev.log_likelihood  # (B, K) -> (B,): all ranks' shards, the full data

    def _initial_reference(self, prior: Any, args: tuple, kwargs: dict):
        """``(μ (K,), Σ (K, K))`` float64 of the reference before any adaptation."""
        ref = self.reference
        if isinstance(ref, str):
            if ref != "laplace":
                return gaussian_moments(prior)
            key = (
                id(args[0]) if args else None,
                id(args[1]) if len(args) > 1 else None,
                self.model.temperature,
                self.model.rank,
            )
            if self._laplace_key != key:  # fit once per data set, not once per chain
                from .laplace import AutoSubspaceLaplace

                guide = AutoSubspaceLaplace(self.model, chunk_size=min(self.chunk_size, 1024))
                # a reference needs no tight MAP: the sampler is exact for any reference, so
                # the search's ConvergenceWarning (about a fit the user did not ask for) is moot
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ConvergenceWarning)
                    guide.fit(*args, **kwargs, max_iter=100, tol=1e-3)
                self._laplace, self._laplace_key = gaussian_moments(guide), key
            return self._laplace
        return gaussian_moments(ref)


class _Batch:
    """``C`` chains advanced together: states ``(C, K)`` per step, each chain with its own
    generator and reference ``(μ_c, L_c)`` (the same for all after a pooled refit). The
    sampler's own arithmetic is in float64 numpy (small arrays: per-operation overhead, not
    flops, is its cost); only the log-likelihood runs in torch, on the model's dtype."""

    def __init__(self, kernel, prior, loglik, mu, cov, seeds, warmup, start, args, kwargs):
        self.kernel, self.loglik, self.warmup = kernel, loglik, warmup
        self.args, self.kwargs = args, kwargs
        self.size, self.opened, self.passes, self.steps = len(seeds), 0, 0, 0
        # the chains run in NumPy on the CPU; the states and the likelihood follow the model
        self.model_dtype, self.model_device = prior.mean.dtype, prior.mean.device
        k = mu.shape[-1]
        if prior.event_shape != (k,):
            raise ValueError(
                f"reference: has K={k} coordinates, the prior's event shape is "
                f"{tuple(prior.event_shape)}"
            )
        self.k, self.df = k, kernel.df
        prior_mu, prior_cov = gaussian_moments(prior)
        self.prior_mu = prior_mu.cpu().numpy()
        self.prior_inv = np.linalg.inv(_cholesky(prior_cov).cpu().numpy())  # L₀⁻¹
        self.gens = [np.random.default_rng(int(s)) for s in seeds]
        self.evals = np.zeros(self.size, dtype=np.int64)
        self.mu = np.repeat(mu.cpu().numpy()[None], self.size, 0)
        self.tril = np.repeat(_cholesky(cov).cpu().numpy()[None], self.size, 0)
        self.tril_inv = np.linalg.inv(self.tril)
        if start is None:  # a draw from the reference (the prior for "warmup"/"prior"),
            # a fitted one widened: dispersed starts, so that R-hat can detect unmixed chains
            eps = np.stack([g.standard_normal(k) for g in self.gens])
            fitted = not (isinstance(kernel.reference, str) and kernel.reference != "laplace")
            spread = START_DISPERSION if fitted else 1.0
            x = self.mu + spread * np.einsum("cij,cj->ci", self.tril, eps)
        else:
            x = np.broadcast_to(start.cpu().numpy().reshape(-1, k), (self.size, k)).copy()
        self.lp = self._log_target(x)
        if not np.isfinite(self.lp).all():
            raise ValueError(
                "initial_params: the log-density at the start is not finite; check the data, "
                "the network's outputs and the reference"
            )
        self.x = x
        self.states = [torch.from_numpy(x).to(self.model_device, self.model_dtype)]
        plain = isinstance(kernel.reference, str) and kernel.reference == "prior"
        adapt = kernel.adapt and not plain
        self.schedule = _adapt_schedule(warmup) if adapt else []

    def _log_target(self, t: np.ndarray) -> np.ndarray:
        """``log p(t) + log L(t)`` ``(B,)`` (up to a constant) for ``t`` ``(B, K)``."""
        z = (t - self.prior_mu) @ self.prior_inv.T
        loglik = self.loglik(torch.from_numpy(t).to(self.model_device, self.model_dtype))
        return -0.5 * (z * z).sum(-1) + loglik.detach().double().cpu().numpy()

    def _log_reference(self, t: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``log R(t)`` up to a constant per chain, ``(B,)``, for chains ``idx``."""
        z = np.einsum("bij,bj->bi", self.tril_inv[idx], t - self.mu[idx])
        maha = (z * z).sum(-1)
        if self.df is None:
            return -0.5 * maha
        return -0.5 * (self.df + self.k) * np.log1p(maha / self.df)

    def advance(self) -> None:
        """One transition of every chain (Nishihara et al. 2014, Alg. 2; Murray et al. 2010)."""
        k, df, every = self.k, self.df, np.arange(self.size)
        x, mu = self.x, self.mu
        # per-chain random numbers, in the same order whatever the batch size
        extra = 0 if df is None else df + k
        draws = [(g.standard_normal(extra + k), g.random(2)) for g in self.gens]
        normals = np.stack([d[0] for d in draws])
        u, phi = np.stack([d[1] for d in draws]).T
        eps = normals[:, extra:]
        nu = np.einsum("cij,cj->ci", self.tril, eps)
        if df is not None:  # s ~ InvGamma((df+K)/2, (df + δᵀΣ⁻¹δ)/2) = (df + δᵀΣ⁻¹δ) / χ²_{df+K}
            z = np.einsum("cij,cj->ci", self.tril_inv, x - mu)
            scale = (df + (z * z).sum(-1)) / (normals[:, :extra] ** 2).sum(-1)
            nu = nu * np.sqrt(scale)[:, None]
        log_y = self.lp - self._log_reference(x, every) + np.log(np.maximum(u, 1e-300))
        phi = phi * 2 * math.pi
        lo, hi = phi - 2 * math.pi, phi.copy()
        active = every
        new_x, new_lp = x.copy(), self.lp.copy()
        for _ in range(self.kernel.max_shrinks):
            a, ph = active, phi[active]
            prop = mu[a] + (x[a] - mu[a]) * np.cos(ph)[:, None] + nu[a] * np.sin(ph)[:, None]
            lp = self._log_target(prop)
            self.passes += 1
            self.evals[a] += 1
            with np.errstate(invalid="ignore"):
                ok = (lp - self._log_reference(prop, a) > log_y[a]) & np.isfinite(lp)
            new_x[a[ok]], new_lp[a[ok]] = prop[ok], lp[ok]
            active = a[~ok]
            if active.size == 0:
                break
            neg = phi[active] < 0  # shrink towards 0 at φ, redraw φ from the chain's stream
            lo[active[neg]] = phi[active[neg]]
            hi[active[~neg]] = phi[active[~neg]]
            r = np.array([self.gens[c].random() for c in active])
            phi[active] = lo[active] + (hi[active] - lo[active]) * r
        else:
            raise RuntimeError(
                f"sample: no acceptable point after {self.kernel.max_shrinks} bracket "
                "shrinkages; the log-likelihood is NaN or -inf around the current state"
            )
        self.x, self.lp = new_x, new_lp
        self.states.append(torch.from_numpy(new_x).to(self.model_device, self.model_dtype))
        self.steps = step = len(self.states) - 1
        if self.schedule and step == self.schedule[0]:
            self.schedule.pop(0)
            self._refit(step)

    def _refit(self, step: int) -> None:
        """``(μ, Σ)`` of every chain from the later half of all chains' warm-up draws so far,
        pooled (Nishihara et al. 2014, section 4: one reference from many parallel chains)."""
        draws = np.stack([s.double().cpu().numpy() for s in self.states[step // 2 + 1 : step + 1]])
        pooled = draws.reshape(-1, self.k)  # (n C, K)
        n = pooled.shape[0]
        if n < MIN_DRAWS_PER_DIM * self.k:  # a covariance from fewer draws is worse than none
            return
        mean = pooled.mean(0)
        cov = np.cov(pooled, rowvar=False).reshape(self.k, self.k)
        # a little shrinkage towards the diagonal, and an inflation: a reference a bit wider
        # than the posterior keeps L̃ bounded in the tails
        cov = INFLATION * ((1 - SHRINKAGE) * cov + SHRINKAGE * np.diag(np.diag(cov)))
        try:
            tril = _cholesky(torch.from_numpy(cov)).cpu().numpy()
        except ValueError:
            return  # a degenerate window (e.g. stuck chains): keep the old reference
        self.mu[:], self.tril[:] = mean, tril
        self.tril_inv[:] = np.linalg.inv(tril)


def _same(a: tuple, b: tuple) -> bool:
    """The same call arguments, by identity (a new ``MCMC.run`` on other data starts a batch)."""
    return len(a) == len(b) and all(u is v for u, v in zip(a, b))


def _adapt_schedule(warmup: int) -> list[int]:
    steps, n = [], 25
    while n < warmup:
        steps.append(n)
        n *= 2
    if warmup >= 25:
        steps.append(warmup)
    return sorted(set(steps))


def _cholesky(cov: torch.Tensor) -> torch.Tensor:
    cov = cov.double()
    if cov.dim() == 1:
        cov = torch.diag(cov)
    jitter = 1e-12 * float(cov.diagonal().abs().mean())
    eye = torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    factor, info = torch.linalg.cholesky_ex(cov + jitter * eye)
    if int(info) != 0 or not bool(torch.isfinite(factor).all()):
        raise ValueError("reference: the covariance is not positive definite")
    return factor
