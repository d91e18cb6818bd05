"""Chains advanced together by the generalised elliptical slice kernel: `ChainBatch` (a fitted
reference, optionally adapted in warm-up) and `Population` (``reference="auto"``).

*Adaptation* (by default only for ``reference="warmup"``, which starts as the prior): the
reference is refitted from the later half of the warm-up draws of *all the chains advanced
together*, pooled (Nishihara, Murray & Adams 2014, section 4: fit one reference to the states of
many parallel chains), once the pool holds ≥ 20 K draws. An elliptical slice move keeps the
radius ``|t − μ|`` correlated (even with ``R = π``, ``E[cos² φ] = 1/2``), so a chain's second
moments have about a third of its draws as effective draws, and a covariance from ``n`` draws
carries a sampling error of about ``(K + K(K+1)/2) / (2 n_eff)`` nats of KL divergence
(``n_eff ≈ n/3``), e.g. 0.25 nats for ``K = 10`` from 4 chains × 100 draws. A fitted reference
(Laplace, SWAG moments, a given Gaussian) is deterministic and is therefore kept fixed by
default; refit it (``adapt=True``) when the fit is known to be poor. Adaptation ends with the
warm-up; the draws after it come from a fixed kernel that leaves ``π`` invariant.

*The population scheme* (``reference="auto"``; Nishihara, Murray & Adams 2014, section 4 and
their code ``robertnishihara/gess``): the ``C`` chains form two independent populations, each of
two groups. Each group takes ``repeats`` steps with a multivariate t fitted (`student_t`: ECME of
Liu & Rubin 1995, a real ``ν`` under a Gamma prior) to the *other* group's current states, then
the other group likewise, alternating, in warm-up and sampling alike: a group's kernel leaves
``π`` invariant whatever the other group's states, so no adaptation ends and every draw counts.
The populations never exchange states, so R-hat across them can see what two coupled groups
hide (`Population`; `diagnostics.check` runs after the run).

The sampler's arithmetic is float64 NumPy; only the log-likelihood runs in torch, on the
model's dtype and device. A batch holds the trajectory ``(C, K)`` per step that Pyro's
sequential driver replays chain by chain, and per step each chain's likelihood evaluations
(and, in a population, the ``ν`` of the reference its transition used).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .gaussian_prior import gaussian_moments
from .slice_step import (
    ChainReference,
    SliceInfo,
    SliceState,
    _cholesky,
    _gaussian,
    elliptical_slice_step,
)
from .student_t import fit_multivariate_t

INFLATION, SHRINKAGE = 1.2, 0.1  # of the covariance refitted from warm-up draws
MIN_DRAWS_PER_DIM = 20  # a refit needs at least 20 K warm-up draws in its window
START_DISPERSION = 2.0  # chains start at draws of N(μ, 4 Σ) of a fitted reference
POPULATIONS = 2  # reference="auto": independent populations, so that R-hat can compare them
REPEATS = 1  # reference="auto": steps of a group between refits
FIT_STATES = 3  # reference="auto": a t fit counts at least 3 (K + 2) states, pseudo-states included
DF_PRIOR = (2.0, 0.1)  # reference="auto": ν's Gamma prior (Juárez & Steel 2010; mode 10, mean 20)
# reference="auto": ECME stops at a gain below 1e-5 nats per state (a reference needs no tighter
# fit; 1.3 ms a fit of 7 states in 5-D against 5.2 ms at 1e-7, the same ν to 3 digits)
FIT_TOL, FIT_MAX_ITER = 1e-5, 100


class ChainBatch:
    """``C`` chains advanced together by `elliptical_slice_step`: states ``(C, K)`` per step
    (the trajectory the driver replays), a `ChainReference` and the adaptation schedule. The
    sampler's arithmetic is float64 NumPy; only the log-likelihood runs in torch, on the
    model's dtype and device."""

    def __init__(self, kernel, prior, loglik, mu, cov, seeds, warmup, start, args, kwargs):
        self.kernel, self.loglik, self.warmup = kernel, loglik, warmup
        self.fn: Callable | None = None  # the likelihood of one point {"t": t}
        self.args, self.kwargs = args, kwargs
        self.size, self.opened, self.passes, self.steps = len(seeds), 0, 0, 0
        self.model_dtype, self.model_device = prior.mean.dtype, prior.mean.device
        k = mu.shape[-1]
        if prior.event_shape != (k,):
            raise ValueError(
                f"reference: has K={k} coordinates, the prior's event shape is "
                f"{tuple(prior.event_shape)}"
            )
        self.k = k
        prior_mu, prior_cov = gaussian_moments(prior)
        self.prior_mu = prior_mu.cpu().numpy()
        self.prior_inv = np.linalg.inv(_cholesky(prior_cov).cpu().numpy())  # L₀⁻¹
        self.evals = np.zeros(self.size, dtype=np.int64)
        #: ``(C,)`` per step of the trajectory: each chain's likelihood evaluations in the
        #: transition that reached it (step 0, the start: zeros)
        self.step_evals = [np.zeros(self.size, dtype=np.int64)]
        self.reference = ChainReference(mu, cov, kernel.df, seeds)
        self.info: SliceInfo | None = None
        if start is None:  # a draw from the reference (the prior for "warmup"/"prior"),
            # a fitted one widened: dispersed starts, so that R-hat can detect unmixed chains
            ref = kernel.reference
            fitted = not isinstance(ref, str) or ref == "laplace"
            fitted = fitted or (ref == "auto" and kernel.model is not None)  # at the Laplace fit
            # "auto" starts at draws of the Laplace fit itself: its population refits from the
            # states, and a start far out at T = 1 can seed a chain in a minor mode it never
            # leaves (toy K = 10: a mode 7 nats below the main one, held by 1 chain of 48)
            spread = 1.0 if ref == "auto" else START_DISPERSION
            x = self.reference.start(spread if fitted else 1.0)
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

    @property
    def mu(self) -> np.ndarray:
        """``(C, K)``: every chain's reference mean."""
        return self.reference.mu

    @property
    def tril(self) -> np.ndarray:
        """``(C, K, K)``: every chain's reference Cholesky factor ``L_c``."""
        return self.reference.tril

    def _log_reference(self, t: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return self.reference._log_density(t, idx)

    def _log_target(self, t: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """``log p(t) + log L(t)`` ``(B,)`` (up to a constant) for ``t`` ``(B, K)``."""
        z = (t - self.prior_mu) @ self.prior_inv.T
        loglik = self.loglik(torch.from_numpy(t).to(self.model_device, self.model_dtype))
        return -0.5 * (z * z).sum(-1) + loglik.detach().double().cpu().numpy()

    def move(self, step: int, chain: int, t: torch.Tensor) -> None:
        """Put chain ``chain`` at ``t`` ``(K,)`` at ``step``, which must be the batch's latest
        (no chain has gone past it), and compute its log-density there: a position that a
        direct caller of ``sample`` gives instead of the chain's state."""
        if len(self.states) != step + 1:
            raise ValueError(
                f"params: chain {chain} of {self.size} chains advanced together is at step "
                f"{step}, which the batch has gone past (its later steps are computed and "
                "replayed); only a chain at the batch's latest step can be given another "
                "position, e.g. with chains=None, where every chain is its own batch"
            )
        row = t.detach().double().cpu().numpy().reshape(1, self.k)
        lp = self._log_target(row)
        if np.isnan(lp).any():
            raise ValueError("params: the log-density at the given position is NaN")
        self.evals[chain] += 1
        self.step_evals[step] = self.step_evals[step].copy()
        self.step_evals[step][chain] += 1
        self.passes += 1
        x, lps = self.x.copy(), self.lp.copy()
        x[chain], lps[chain] = row[0], lp[0]
        self.x, self.lp = x, lps
        states = self.states[step].clone()  # the tensors returned before stay as they were
        states[chain] = t.detach().to(states)
        self.states[step] = states

    def advance(self) -> None:
        """One transition of every chain (Nishihara et al. 2014, Alg. 2; Murray et al. 2010)."""
        state, info = elliptical_slice_step(
            SliceState(self.x, self.lp), self.reference, self._log_target, self.kernel.max_shrinks
        )
        self.passes += int(info.shrinks.max()) + 1
        self.evals += info.shrinks + 1
        self.step_evals.append(info.shrinks + 1)
        self.x, self.lp, self.info = state.position, state.log_likelihood, info
        self.states.append(torch.from_numpy(self.x).to(self.model_device, self.model_dtype))
        self.steps = step = len(self.states) - 1
        if self.schedule and step == self.schedule[0]:
            self.schedule.pop(0)
            self._refit(step)

    def free(self) -> None:
        """Drop the trajectory and its per-step statistics (the batch is finished)."""
        self.states, self.step_evals = self.states[:1], self.step_evals[:1]

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
        self.reference.refit(mean, tril)


class Population(ChainBatch):
    """``reference="auto"``: Nishihara, Murray & Adams's (2014) two-group scheme over ``C``
    chains, in `POPULATIONS` independent populations.

    Chain ``c`` belongs to population ``c // (C/P)`` and, within it, to group 0 (its first half)
    or group 1. One `advance` is a sweep: for each population, a multivariate t is fitted to
    group 1's *current* states (`student_t.fit_multivariate_t`, ECME); group 0 then takes
    ``repeats`` scale-mixture elliptical slice steps with it (`ChainReference`, ``L̃ = π / t``);
    then group 1 likewise with the t of group 0's new states. The fit: ``ν`` is the mode under
    a ``Gamma(2, 0.1)`` prior (`DF_PRIOR`; the kernel's ``df`` fixes it instead), since a group
    of ``K + 2`` states shows no tails and its maximum-likelihood ``ν`` is mostly ``∞``; the
    fit counts at least ``3 (K + 2)`` states (`FIT_STATES`), the missing ones pseudo-states
    with the Laplace fit's mean and covariance (``model=None``: the prior's covariance, and no
    location, since the prior's mean is no estimate of the posterior's), since a location and
    a scale
    from ``K + 2`` states are noisy (a KL divergence of about ``K / (2 (K + 2))`` nats from the
    location alone). Measured on the toy problem at K = 5, 28 chains (bulk effective draws
    per draw, 300-400 draws per chain): at T = 1, ν = 5 with an unshrunk scale 0.21, the
    scale shrunk as above 0.40; ν fitted under the prior 0.35, by maximum likelihood 0.28
    (``∞`` in 94 % of the fits, the scale shrunk to 5 (K + 2) states); location shrunk too
    0.50 (1.62 likelihood evaluations a draw against 2.06). At T = N/K, K = 10, 48 chains:
    0.34 with the scale shrunk, 0.65 with the location shrunk too (1.73 evaluations a draw
    against 2.28).

    Each group's kernel leaves ``π`` invariant for every fixed state of the other group (the
    fit is a deterministic function of those states: ECME starts from their mean and
    covariance, never from an earlier fit), so the population's product target
    ``π(x₁) π(x₂)`` is invariant and every chain's marginal is ``π``; refitting therefore goes
    on through warm-up and sampling. The groups of all populations advance together in one
    batched likelihood call per shrink round (``C/2`` chains). A sweep appends
    ``repeats`` steps to the trajectory: step ``j`` holds each group's ``j``-th new state.
    """

    def __init__(self, kernel, prior, loglik, mu, cov, seeds, warmup, start, args, kwargs):
        super().__init__(kernel, prior, loglik, mu, cov, seeds, warmup, start, args, kwargs)
        per = self.size // POPULATIONS
        self.population = [c // per for c in range(self.size)]
        self.groups = [
            [c for c in range(self.size) if (c % per) // (per // 2) == g] for g in (0, 1)
        ]
        self.refs = []
        for rows in self.groups:  # the chains' own generators (the start drew from them)
            ref = ChainReference(mu, cov, kernel.df, [0] * len(rows))
            ref.gens = [self.reference.gens[c] for c in rows]
            self.refs.append(ref)
        tril = _cholesky(cov).cpu().numpy()
        self.fallback = tril @ tril.T  # the Laplace (or prior) covariance
        # pseudo-states at the Laplace fit's mean too; the prior's mean (model=None) is no
        # estimate of where the posterior is (a banana's arms mixed worse pulled to it)
        laplace = kernel.model is not None
        self.fallback_loc = mu.double().cpu().numpy() if laplace else None
        #: ``(step, population, group, ν)`` of every fit: the reference each group used from
        #: ``step`` on
        self.fits: list[tuple[int, int, int, float]] = []
        #: ``(C,)`` per step: the ``ν`` of the t reference each chain's transition used
        self.step_df = [np.full(self.size, np.nan)]
        self.checked = False  # diagnostics.check ran at the end of the run

    @property
    def mu(self) -> np.ndarray:
        out = np.empty((self.size, self.k))
        for rows, ref in zip(self.groups, self.refs):
            out[rows] = ref.mu
        return out

    @property
    def tril(self) -> np.ndarray:
        out = np.empty((self.size, self.k, self.k))
        for rows, ref in zip(self.groups, self.refs):
            out[rows] = ref.tril
        return out

    def free(self) -> None:
        super().free()
        self.step_df = self.step_df[:1]

    def reference_df(self, chain: int) -> np.ndarray:
        """The ``ν`` of chain ``chain``'s reference at each of its group's updates."""
        population, group = self.population[chain], int(chain not in self.groups[0])
        return np.array([f[3] for f in self.fits if f[1:3] == (population, group)])

    def _fit(self, group: int) -> None:
        """Group ``group``'s t, per population, from the other group's current states."""
        mine, theirs = self.groups[group], self.groups[1 - group]
        for p in range(POPULATIONS):
            rows = [i for i, c in enumerate(mine) if self.population[c] == p]
            other = [c for c in theirs if self.population[c] == p]
            fit = fit_multivariate_t(
                self.x[other],
                df=self.kernel.df,
                fallback=self.fallback,
                fallback_loc=self.fallback_loc,
                min_states=FIT_STATES * (self.k + 2),
                df_prior=DF_PRIOR,
                tol=FIT_TOL,
                max_iter=FIT_MAX_ITER,
            )
            df = self.kernel.df if isinstance(self.kernel.df, int) else fit.df
            self.refs[group].refit(fit.loc, np.linalg.cholesky(fit.scale), rows=rows, df=df)
            self.fits.append((len(self.states) - 1, p, group, float(fit.df)))

    def advance(self) -> None:
        """One sweep: each group ``repeats`` steps with the t of the other group's states."""
        repeats = self.kernel.repeats
        x, lp = self.x.copy(), self.lp.copy()
        new = np.repeat(x[None], repeats, 0)  # (repeats, C, K): the sweep's trajectory
        evals = np.zeros((repeats, self.size), dtype=np.int64)
        dfs = np.full((repeats, self.size), np.nan)
        angle, shrinks = np.zeros(self.size), np.zeros(self.size, dtype=np.int64)
        for group, rows in enumerate(self.groups):
            self.x = x
            self._fit(group)
            dfs[:, rows] = [math.inf if _gaussian(v) else v for v in self.refs[group].df]
            state = SliceState(x[rows], lp[rows])
            for j in range(repeats):
                state, info = elliptical_slice_step(
                    state, self.refs[group], self._log_target, self.kernel.max_shrinks
                )
                self.passes += int(info.shrinks.max()) + 1
                self.evals[rows] += info.shrinks + 1
                evals[j, rows] = info.shrinks + 1
                new[j, rows] = state.position
            x[rows], lp[rows] = state.position, state.log_likelihood
            angle[rows], shrinks[rows] = info.angle, info.shrinks
        self.x, self.lp, self.info = x, lp, SliceInfo(angle, shrinks)
        for j in range(repeats):
            self.states.append(torch.from_numpy(new[j]).to(self.model_device, self.model_dtype))
            self.step_evals.append(evals[j])
            self.step_df.append(dfs[j])
        self.steps = len(self.states) - 1


def _adapt_schedule(warmup: int) -> list[int]:
    steps, n = [], 25
    while n < warmup:
        steps.append(n)
        n *= 2
    if warmup >= 25:
        steps.append(warmup)
    return sorted(set(steps))
