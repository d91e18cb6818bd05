"""Elliptical slice sampling over a Gaussian reference, as a Pyro ``MCMCKernel``.

The target is ``π(t) ∝ p(t) L(t)`` with a Gaussian prior ``p``. Elliptical slice sampling
(Murray, Adams & MacKay, 2010) moves along ellipses through the current point drawn from a
Gaussian ``R = N(μ, Σ)``, the *reference*, and slices the rest of the density,
``L̃ = π / R`` (Nishihara, Murray & Adams 2014, section 3; Fagan, Bhandari & Cunningham 2016,
eq. 3). With ``R = p`` (``reference="prior"``) ``L̃ = L`` and this is Murray et al.'s plain
kernel; a reference fitted to the posterior (a Laplace guide, SWAG moments, the warm-up draws)
is the generalised kernel. One transition from ``t`` (Murray et al., Fig. 2, with ``L̃``)::

    ν ~ N(0, Σ);  log y = log L̃(t) + log u,  u ~ U(0, 1)
    φ ~ U[0, 2π];  [φ_min, φ_max] = [φ − 2π, φ]
    loop:  t' = μ + (t − μ) cos φ + ν sin φ
           if log L̃(t') > log y: accept t'
           else shrink the bracket towards 0 at φ and draw φ ~ U[φ_min, φ_max]

*Multivariate-t reference* ``R = t_df(μ, Σ)`` (Nishihara et al., Algorithm 2): first draw the
scale ``s ~ InvGamma((df + K)/2, (df + (t − μ)ᵀΣ⁻¹(t − μ))/2)``, then the transition above with
``ν ~ N(0, s Σ)``; ``L̃ = π / R`` does not depend on ``s``. Its heavier tails make the sampler
robust to a reference that is too narrow. Every reference leaves ``π`` invariant; the closer
``R`` is to ``π``, the closer a draw is to an independent one at one evaluation per draw. No step
size to tune, no gradients: Subspace Inference (Izmailov et al., 2019, appendix F) recommends
the kernel for the subspace posterior, with ``L`` the tempered likelihood ``p(D|t)^{1/T}`` of
their eq. (3), summed over the full training set in chunks.

The core is BlackJAX-shaped: `elliptical_slice_step` is one pure transition over a
`SliceState` ``(position, log_likelihood)`` returning an `SliceInfo` ``(angle, shrinks)``,
parameterised by a reference that supplies ``(μ, Σ)`` and its random stream (the `Reference`
contract). Two references implement it:

- `PriorReference`: the model's own Gaussian prior sites (any Pyro model, one chain at a time),
  drawing from torch's global generator (reproducible with ``pyro.set_rng_seed``);
- `ChainReference`: a Gaussian or multivariate-t ``(μ_c, Σ_c)`` per chain over ``t`` ``(K,)``,
  chain ``c`` drawing from its own NumPy generator, so that ``C`` chains advance together, their
  ``(B, K)`` proposals evaluated in one batched likelihood call, and equal the chains run one
  at a time.

`EllipticalSliceSampler` wraps that core in Pyro's ``MCMCKernel`` contract.

Adaptation (by default only for ``reference="warmup"``, which starts as the prior): the
reference is refitted from the later half of the warm-up draws of *all the chains advanced
together*, pooled (Nishihara et al., section 4, fit one reference to the states of many
parallel chains), once the pool holds ≥ 20 K draws. An elliptical slice move keeps the radius
``|t − μ|`` correlated (even with ``R = π``, ``E[cos² φ] = 1/2``), so a chain's second moments
have about a third of its draws as effective draws, and a covariance from ``n`` draws carries a
sampling error of about ``(K + K(K+1)/2) / (2 n_eff)`` nats of KL divergence (``n_eff ≈ n/3``),
e.g. 0.25 nats for ``K = 10`` from 4 chains × 100 draws. A fitted reference (Laplace, SWAG
moments, a given Gaussian) is deterministic and is therefore kept fixed by default; refit it
(``adapt=True``) when the fit is known to be poor. Adaptation ends with the warm-up; the draws
after it come from a fixed kernel that leaves ``π`` invariant.

*The population scheme* (``reference="auto"``; Nishihara, Murray & Adams 2014, section 4 and
their code ``robertnishihara/gess``): the ``C`` chains form two independent populations, each of
two groups. Each group takes ``repeats`` steps with a multivariate t fitted (`student_t`: ECME of
Liu & Rubin 1995, a real ``ν`` under a Gamma prior) to the *other* group's current states, then the
other group likewise, alternating, in warm-up and sampling alike: a group's kernel leaves ``π``
invariant whatever the other group's states, so no adaptation ends and every draw counts. The
populations never exchange states, so R-hat across them can see what two coupled groups hide
(`_Population`; `diagnostics.check` runs after the run).
"""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from .. import distributed
from ..diagnostics import check_draws
from ..exceptions import ConvergenceWarning, UnsupportedModelError
from ..validation import positive_int
from .gaussian_prior import (
    GaussianSite,
    gaussian_moments,
    gaussian_priors,
    refuse_subsampling,
)
from .student_t import fit_multivariate_t

REFERENCES = ("prior", "warmup", "laplace", "auto")
RANDOM_STREAMS = ("global", "chains")
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
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: chain j's seed is hash of (seed, j)


# --- the core: a state, an info record and one pure transition --------------------------------


class SliceState(NamedTuple):
    """The state of ``B`` chains.

    Attributes:
        position: ``(B, K)`` float64 for a `ChainReference`; for a `PriorReference` (one
            chain) a dict of the latent sites' tensors.
        log_likelihood: ``(B,)`` float64, the log-density at ``position`` that the slice is cut
            in once the reference's log-density is divided out: ``log L(t)`` for a
            `PriorReference` (the reference is the target's own prior), ``log p(t) + log L(t)``
            for a `ChainReference` (the step slices ``log L̃ = log p + log L − log R``).
    """

    position: Any
    log_likelihood: np.ndarray


class SliceInfo(NamedTuple):
    """What one transition did, per chain.

    Attributes:
        angle: ``(B,)`` the accepted ``φ``, in ``(−2π, 2π)``.
        shrinks: ``(B,)`` int, bracket shrinkages before the acceptance; the chain evaluated
            the likelihood ``shrinks + 1`` times, a batched step made ``max(shrinks) + 1`` calls.
    """

    angle: np.ndarray
    shrinks: np.ndarray


class Reference(Protocol):
    """The Gaussian reference ``R = N(μ, Σ)`` of `elliptical_slice_step` and its random stream.

    Random numbers are drawn in this order per chain: the momentum, then ``(u, v)``, then one
    uniform per shrinkage; a reference owns the generator(s) they come from. Per-chain scalars
    and chain indices ``rows`` are Python lists (a step handles a few chains at a time).
    """

    def momentum(self, position: Any) -> Any:
        """``ν ~ N(0, Σ)`` (``N(0, s Σ)`` after the scale draw of a t reference), like
        ``position``."""

    def slice_draws(self) -> tuple[list[float], list[float]]:
        """``(log u, v)``, ``B`` each: the slice height's ``log u`` and the first angle's
        ``φ / 2π``, ``u, v ~ U[0, 1)``."""

    def uniforms(self, rows: list[int]) -> list[float]:
        """``U[0, 1)`` draws for the angles of the still-open brackets of chains ``rows``."""

    def log_density(self, t: Any, rows: list[int]) -> list[float] | None:
        """``log R(t)`` of the points ``t`` of chains ``rows``, up to a constant; ``None`` when
        ``R`` is the target's own prior (nothing to divide out: ``L̃ = L``)."""

    def point(self, position: Any, momentum: Any, angle: list[float], rows: list[int]) -> Any:
        """The points ``μ + (t − μ) cos φ + ν sin φ`` of chains ``rows``."""

    def put(self, position: Any, rows: list[int], proposal: Any, accepted: list[bool]) -> Any:
        """``position`` with the proposals whose ``accepted`` is true written to chains ``rows``
        (``proposal`` holds one point per open bracket, ``rows`` the accepted ones' chains)."""


def elliptical_slice_step(
    state: SliceState,
    reference: Reference,
    log_likelihood: Callable[[Any, list[int]], Any],
    max_shrinks: int = 200,
) -> tuple[SliceState, SliceInfo]:
    """One elliptical slice transition of ``B`` chains (Murray et al. 2010, Fig. 2, with the
    likelihood ``L̃ = π / R`` of a reference ``R``: Nishihara et al. 2014; Fagan et al. 2016,
    eq. 3). Pure apart from the reference's random stream.

    Args:
        state: positions and their `SliceState.log_likelihood` ``(B,)``.
        reference: ``(μ, Σ)`` and the random stream (`PriorReference`, `ChainReference`).
        log_likelihood: ``(points of chains rows, rows) -> (len(rows),)`` (an array or a
            list), the same quantity as `SliceState.log_likelihood`; the still-open brackets
            are evaluated together.
        max_shrinks: bracket shrinkages before the step raises ``RuntimeError``.

    Returns:
        ``(state, info)``: the new positions with their log-likelihoods, and a `SliceInfo`.
        A non-finite log-likelihood is never accepted.

    Example:
        >>> import numpy as np
        >>> from pyro_subspace.infer.ess import ChainReference, SliceState, elliptical_slice_step
        >>> ref = ChainReference(torch.zeros(2).double(), torch.eye(2).double(), None, [0, 1, 2])
        >>> def log_target(t, rows):  # π = N(0, I) · N(t | 1, I)
        ...     return -0.5 * (t**2).sum(-1) - 0.5 * ((t - 1) ** 2).sum(-1)
        >>> x = np.zeros((3, 2))
        >>> state, info = elliptical_slice_step(SliceState(x, log_target(x, None)), ref, log_target)
        >>> state.position.shape, info.shrinks.shape
        ((3, 2), (3,))
    """
    x, ell = state
    size = ell.shape[0]
    nu = reference.momentum(x)
    log_u, v = reference.slice_draws()
    # the bracket's bookkeeping in Python floats: the same IEEE arithmetic as float64 arrays,
    # without NumPy's per-call overhead on a handful of chains; the points are the reference's
    new_ell = ell.tolist()
    log_r = reference.log_density(x, list(range(size)))
    if log_r is not None:
        log_y = [e - r + lu for e, r, lu in zip(new_ell, log_r, log_u)]
    else:
        log_y = [e + lu for e, lu in zip(new_ell, log_u)]
    phi = [w * 2 * math.pi for w in v]
    lo, hi = [p - 2 * math.pi for p in phi], list(phi)
    new_x, angle, shrinks = x, [0.0] * size, [0] * size
    active = list(range(size))
    for n in range(max_shrinks):
        ph = [phi[c] for c in active]
        proposal = reference.point(x, nu, ph, active)
        values = log_likelihood(proposal, active)
        values = values.tolist() if isinstance(values, np.ndarray) else [float(e) for e in values]
        log_r = reference.log_density(proposal, active)
        if log_r is None:  # a NaN or infinite log-likelihood is never accepted
            ok = [math.isfinite(e) and e > log_y[c] for c, e in zip(active, values)]
        else:
            ok = [math.isfinite(e) and e - r > log_y[c] for c, e, r in zip(active, values, log_r)]
        if any(ok):
            done = [c for c, a in zip(active, ok) if a]
            new_x = reference.put(new_x, done, proposal, ok)
            for c, e, p, a in zip(active, values, ph, ok):
                if a:
                    new_ell[c], angle[c], shrinks[c] = e, p, n
            active = [c for c, a in zip(active, ok) if not a]
            if not active:
                info = SliceInfo(np.array(angle), np.array(shrinks, dtype=np.int64))
                return SliceState(new_x, np.array(new_ell)), info
        for c in active:  # shrink towards 0 at φ, redraw φ from the chain's stream
            if phi[c] < 0:
                lo[c] = phi[c]
            else:
                hi[c] = phi[c]
        for c, r in zip(active, reference.uniforms(active)):
            phi[c] = lo[c] + (hi[c] - lo[c]) * r
    raise RuntimeError(
        f"sample: no acceptable point after {max_shrinks} bracket shrinkages; the "
        "log-likelihood is NaN or -inf around the current state"
    )


class PriorReference:
    """The target's own Gaussian prior as the reference (Murray et al.'s plain kernel) over the
    latent sites of a Pyro model, one chain (``B = 1``), drawing from torch's global generator.

    Positions are dicts ``{site: tensor}`` in the sites' dtype and device; ``L̃ = L``.
    """

    def __init__(self, sites: list[GaussianSite]) -> None:
        self.sites = sites
        self.mean = {s.name: s.mean for s in sites}

    def momentum(self, position: dict) -> dict:
        return {s.name: s.centred_draw() for s in self.sites}

    def slice_draws(self) -> tuple[list[float], list[float]]:
        u, v = torch.rand(2).tolist()
        return [math.log(u or 1e-300)], [v]

    def uniforms(self, rows: list[int]) -> list[float]:
        return [torch.rand(()).item()]

    def log_density(self, t: dict, rows: list[int]) -> None:
        return None  # R is the prior: nothing to divide out

    def point(self, position: dict, momentum: dict, angle: list[float], rows: list[int]) -> dict:
        c, s, mu = math.cos(angle[0]), math.sin(angle[0]), self.mean
        return {k: mu[k] + (position[k] - mu[k]) * c + momentum[k] * s for k in position}

    def put(self, position: dict, rows: list[int], proposal: dict, accepted: list[bool]) -> dict:
        return proposal if accepted[0] else position


class ChainReference:
    """A Gaussian ``N(μ_c, Σ_c)`` or multivariate-t ``t_ν_c(μ_c, Σ_c)`` reference per chain over
    ``t`` ``(K,)``, chain ``c`` drawing from its own NumPy generator.

    Args:
        mu: ``(K,)`` float64.
        cov: ``(K, K)`` or ``(K,)`` (a diagonal) float64.
        df: ``None`` or ``math.inf`` (Gaussian), or the degrees of freedom ``ν`` of a t
            reference: an int draws its ``χ²_{ν+K}`` as ``ν + K`` squared normals (the stream
            of earlier releases), a float as ``2 Gamma((ν + K)/2)``.
        seeds: one seed per chain, ``C`` in all.

    Positions are ``(C, K)`` float64 arrays; ``mu`` ``(C, K)``, ``tril`` ``(C, K, K)`` (``L_c``,
    ``Σ_c = L_c L_cᵀ``), ``tril_inv`` and ``df`` (a list, ``C``) hold every chain's reference.
    The arithmetic is NumPy float64 (small arrays: per-operation overhead, not flops, is its
    cost).
    """

    def __init__(
        self, mu: torch.Tensor, cov: torch.Tensor, df: float | None, seeds: list[int]
    ) -> None:
        self.k = mu.shape[-1]
        self.gens = [np.random.default_rng(int(s)) for s in seeds]
        size = len(seeds)
        self.df: list[float | None] = [df] * size
        self.mu = np.repeat(mu.cpu().numpy()[None], size, 0)
        self.tril = np.repeat(_cholesky(cov).cpu().numpy()[None], size, 0)
        self.tril_inv = np.linalg.inv(self.tril)

    def start(self, spread: float) -> np.ndarray:
        """``(C, K)`` draws of ``N(μ_c, spread² Σ_c)``: the chains' dispersed starts."""
        eps = np.stack([g.standard_normal(self.k) for g in self.gens])
        return self.mu + spread * np.einsum("cij,cj->ci", self.tril, eps)

    def refit(
        self,
        mean: np.ndarray,
        tril: np.ndarray,
        rows: list[int] | None = None,
        df: float | None | str = "keep",
    ) -> None:
        """The reference of chains ``rows`` (default: all) becomes ``N(mean, tril trilᵀ)``, or
        ``t_df(mean, tril trilᵀ)`` when ``df`` is given (``"keep"``: each chain's own)."""
        idx = slice(None) if rows is None else np.asarray(rows)
        self.mu[idx], self.tril[idx] = mean, tril
        self.tril_inv[idx] = np.linalg.inv(tril)
        if df != "keep":
            for c in range(len(self.gens)) if rows is None else rows:
                self.df[c] = df

    def momentum(self, position: np.ndarray) -> np.ndarray:
        k, dfs = self.k, self.df
        normals, chi2 = [], np.ones(len(self.gens))
        for c, (g, df) in enumerate(zip(self.gens, dfs)):
            if _gaussian(df):
                normals.append(g.standard_normal(k))
            elif isinstance(df, int):  # χ²_{df+K} as a sum of squared normals
                draw = g.standard_normal(df + 2 * k)
                chi2[c] = (draw[: df + k] ** 2).sum()
                normals.append(draw[df + k :])
            else:  # a real ν: χ²_{ν+K} = 2 Gamma((ν + K)/2)
                chi2[c] = 2.0 * g.standard_gamma(0.5 * (df + k))
                normals.append(g.standard_normal(k))
        nu = np.einsum("cij,cj->ci", self.tril, np.stack(normals))
        heavy = [c for c, df in enumerate(dfs) if not _gaussian(df)]
        if heavy:  # s ~ InvGamma((ν+K)/2, (ν + δᵀΣ⁻¹δ)/2) = (ν + δᵀΣ⁻¹δ) / χ²_{ν+K}
            z = np.einsum("cij,cj->ci", self.tril_inv, position - self.mu)
            df = np.array([np.nan if _gaussian(d) else d for d in dfs], dtype=np.float64)
            scale = (df + (z * z).sum(-1)) / chi2
            nu[heavy] = nu[heavy] * np.sqrt(scale[heavy])[:, None]
        return nu

    def slice_draws(self) -> tuple[list[float], list[float]]:
        u, v = np.stack([g.random(2) for g in self.gens]).T
        return np.log(np.maximum(u, 1e-300)).tolist(), v.tolist()

    def uniforms(self, rows: list[int]) -> list[float]:
        return [self.gens[c].random() for c in rows]

    def log_density(self, t: np.ndarray, rows: list[int]) -> list[float]:
        return self._log_density(t, np.asarray(rows)).tolist()

    def _log_density(self, t: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``log R(t)`` ``(B,)`` up to a constant for points ``t`` ``(B, K)`` of chains ``rows``."""
        z = np.einsum("bij,bj->bi", self.tril_inv[rows], t - self.mu[rows])
        maha = (z * z).sum(-1)
        dfs = [self.df[c] for c in rows.tolist()]
        if all(_gaussian(d) for d in dfs):
            return -0.5 * maha
        gauss = np.array([_gaussian(d) for d in dfs])
        df = np.array([1.0 if _gaussian(d) else d for d in dfs], dtype=np.float64)
        return np.where(gauss, -0.5 * maha, -0.5 * (df + self.k) * np.log1p(maha / df))

    def point(
        self, position: np.ndarray, momentum: np.ndarray, angle: list[float], rows: list[int]
    ) -> np.ndarray:
        rows, angle = np.asarray(rows), np.asarray(angle)
        mu = self.mu[rows]
        return (
            mu
            + (position[rows] - mu) * np.cos(angle)[:, None]
            + momentum[rows] * np.sin(angle)[:, None]
        )

    def put(
        self, position: np.ndarray, rows: list[int], proposal: np.ndarray, accepted: list[bool]
    ) -> np.ndarray:
        position = position.copy()
        position[np.asarray(rows)] = proposal[np.asarray(accepted)]
        return position


# --- the Pyro kernel -------------------------------------------------------------------------


class _PriorModel:
    """The Pyro model of the model-free form with ``rng="global"``: one latent site ``"t"``
    under ``prior``. A module-level class (not a closure), so that the kernel pickles: Pyro's
    multiprocessing driver sends it to its workers (``mp_context="spawn"``)."""

    def __init__(self, prior: Any) -> None:
        self.prior = prior

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return pyro.sample("t", self.prior)


class EllipticalSliceSampler(MCMCKernel):
    """Elliptical slice sampling over the prior or a fitted reference, as a Pyro ``MCMCKernel``.

    Use it like ``NUTS``: ``MCMC(EllipticalSliceSampler(model), num_samples, warmup_steps,
    num_chains).run(*args)``. Two configurations of the one kernel (`elliptical_slice_step`):

    - *plain* (``reference="prior"``, no ``df``, ``chains`` or ``seed``; ``rng="global"``):
      Murray et al.'s kernel for any Pyro model whose latents all have fixed Gaussian priors
      (``Normal``/``MultivariateNormal``, ``.to_event`` allowed, parameters not depending on
      other latents, no handler changing their density: a latent under ``poutine.scale`` or
      under ``poutine.mask`` with a mask that is false anywhere is refused); the rest of the
      joint density (observed sites, ``pyro.factor``, tempering by ``poutine.scale`` or masks
      on observations) is ``L(θ)``. A model without latent sites gives empty draws, as with
      HMC/NUTS. One chain at a time, random numbers from torch's global generator
      (`PriorReference`).
    - *generalised* (a fitted ``reference``, ``df``, ``chains`` or ``seed``; ``rng="chains"``):
      over the coordinates ``t`` of a `SubspaceNet`, with a Gaussian or multivariate-t
      reference, chains advanced together in batched likelihood calls, chain ``j`` drawing
      from its own generator seeded from ``seed`` and ``j`` (`ChainReference`).

    A `SubspaceNet` (anything with ``log_likelihood_fn``) has ``L(t) = p(D | w = ŵ + P t)^{1/T}``
    evaluated by its `Evaluator` over the whole training set in chunks of ``chunk_size`` rows
    under ``torch.no_grad()`` (memory bounded by the chunk, not by ``N``; one point ``(K,)`` or
    a batch ``(B, K)`` per call), ignoring the model's ``subsample_size``. Other models are
    traced by Pyro once per evaluation and must not subsample. Like Pyro's HMC, which takes a
    model or a ``potential_fn``, the kernel also takes no model but a ``prior`` (a
    ``Normal``/``MultivariateNormal`` over one latent ``"t"``) and a ``log_likelihood``; then
    ``MCMC.run()`` needs no arguments.

    Args:
        model: a Pyro model (callable) or a `SubspaceNet` (the generalised configuration needs
            a `SubspaceNet`); or None with ``prior`` and ``log_likelihood``.
        chunk_size: rows of data per forward pass for an evaluator likelihood.
        recompute_bn: for a `SubspaceNet` whose network has BatchNorm layers: before each
            likelihood evaluation, recompute the running statistics at the proposed weights from
            the training inputs (cumulative average over the chunks, as drbayes does for CIFAR
            nets), so the sampled density is a fixed function of ``t`` (batched chains are then
            evaluated one point at a time). Doubles the cost of an evaluation; off by default.
            The user's BatchNorm buffers are put back after every evaluation, so they are
            unchanged also when sampling raises or is interrupted (Pyro calls no `cleanup`).
        max_shrinks: bracket shrinkages before a transition gives up and raises
            ``RuntimeError`` (the likelihood is then NaN or flat at ``-inf``).
        reference: where ``(μ, Σ)`` comes from: ``"prior"`` (the prior, never adapted: plain
            ESS), ``"warmup"`` (start from the prior, refit from the warm-up draws),
            ``"laplace"`` (an `AutoSubspaceLaplace` fitted to the data at the first `setup`), a
            fitted `AutoSubspaceLaplace`, a ``Normal``/``MultivariateNormal`` over ``t``, or a
            pair ``(μ (K,), Σ (K, K) or (K,))``, e.g. SWAG moments mapped into the subspace;
            or ``"auto"``, the recommended one at any temperature: Nishihara et al.'s population
            scheme (module notes, `_Population`) over ``chains=C`` chains in two independent
            populations of two groups (``C`` a multiple of 4; ``4 (K + 2)`` recommended), each
            group's multivariate t fitted to the other group's current states after every
            group update, chains starting at draws of the Laplace fit (a `SubspaceNet`) or of
            the prior (``model=None``). It needs all ``C`` chains in one process: in a worker
            of Pyro's multiprocessing driver it refuses (`one_process` keeps them in this
            one). After the run it checks convergence (`diagnostics.check`).
        df: ``None`` for a Gaussian reference (``reference="auto"``: ``ν`` fitted at every
            update), or the degrees of freedom ``ν > 0`` of a multivariate-t reference
            (``math.inf``: Gaussian; with ``"auto"`` the fixed ``ν`` of every fit).
        adapt: refit ``(μ, Σ)`` from the warm-up draws of the chains advanced together, pooled
            (the later half, at warm-up steps 25, 50, 100, … and at the end of warm-up, once
            the pool holds ≥ 20 K draws). With ``chains=None`` each chain pools its own.
            ``None`` (default): only for ``reference="warmup"``; a fitted reference is kept
            (see the module notes: a refit from a few hundred draws is a worse reference).
            Not applicable to ``reference="auto"`` (it refits throughout; leave ``None``).
        chains: ``None``: every ``MCMC`` chain is sampled on its own; an int ``C``: the kernel
            advances ``C`` chains together; run it with ``MCMC(..., num_chains=C)`` (in one
            process: in a worker of Pyro's multiprocessing driver each chain runs on its own).
            Pyro's sequential driver then replays chain ``c``'s stored trajectory. A run with
            fewer chains leaves the batch's other chains to the next ``setup`` with the same
            argument objects (``MCMC.run`` passes new ones to each run: a new run opens a new
            batch, unless it has no arguments).
        seed: base seed of the chains' generators; ``None`` (and in a worker process of Pyro's
            parallel driver, which seeds each worker): drawn from torch's global generator.
            ``j`` counts the chains this kernel object has started, across ``MCMC`` runs: a
            second run with the same kernel continues with new chains; a new kernel with the
            same ``seed`` repeats the first run.
        rng: ``"global"`` (the plain configuration) or ``"chains"`` (the generalised one);
            ``None``: ``"chains"`` when ``reference``, ``df``, ``chains`` or ``seed`` asks for
            it, else ``"global"``. ``rng="chains"`` with ``reference="prior"`` is plain ESS on
            the per-chain generators.
        repeats: with ``reference="auto"``: steps of a group between refits (default 1: every
            step uses the other group's latest states).
        prior: with ``model=None``: a ``Normal``/``MultivariateNormal`` over ``t``, event ``(K,)``.
        log_likelihood: with ``model=None``: ``log L``; ``t (K,) -> float`` for
            ``rng="global"``, ``(B, K) -> (B,)`` (a batch of points) for ``rng="chains"``.

    Shapes: the latent site ``"t"`` is ``(K,)`` per chain; with ``rng="chains"`` the chains'
    states are ``(C, K)`` and the log-likelihood is called on ``(B, K)``, ``B ≤ C`` open
    brackets. Diagnostics: ``"divergences"`` (always empty: every transition moves),
    ``"acceptance rate"`` (1.0), ``"evaluations per draw"`` (likelihood evaluations of the chain
    per transition) and, with ``rng="chains"``, ``"passes per draw"`` (batched calls per
    transition, ≥ 1). `last_info` is the `SliceInfo` of the latest transition (with
    ``rng="chains"``: of the batch's latest step, all its chains).

    Pyro's MCMC contract, as HMC/NUTS keep it: ``cleanup`` forgets everything of the chain
    (its start, the user's ``initial_params`` included, and its cached state), so a kernel
    reused in a new ``MCMC`` starts afresh; every constructor form pickles (Pyro's
    multiprocessing driver, ``mp_context="spawn"``) when the model or ``log_likelihood`` does
    (a module-level function does, a lambda does not); a model the kernel cannot sample raises
    `UnsupportedModelError` (a ``ValueError`` and a ``TypeError``), a subsampled one
    `SubsamplingError` (a ``NotImplementedError`` and a ``ValueError``), both from
    ``pyro_subspace.exceptions``, before any sampling.

    Under ``torch.distributed`` every rank first takes rank 0's random stream
    (`distributed.share_random_stream`) and the evaluator all-reduces the likelihood, so every
    rank makes the same accept and shrink decisions and returns the same chain.

    Example:
        >>> import pyro.distributions as dist
        >>> from pyro.infer import MCMC
        >>> prior = dist.Normal(torch.zeros(2), 1.0).to_event(1)
        >>> def loglik(t):  # a batch (B, 2) -> (B,)
        ...     return -0.5 * ((t - 1.0) ** 2).sum(-1) / 0.25
        >>> plain = EllipticalSliceSampler(prior=prior, log_likelihood=lambda t: float(loglik(t)))
        >>> fitted = EllipticalSliceSampler(  # a Gaussian reference (μ, diagonal Σ), seeded
        ...     prior=prior, log_likelihood=loglik, reference=(torch.ones(2), 0.2 * torch.ones(2)),
        ...     seed=0)
        >>> for kernel in (plain, fitted):
        ...     mcmc = MCMC(kernel, num_samples=50, warmup_steps=10, disable_progbar=True)
        ...     mcmc.run()
        ...     print(kernel.rng, tuple(mcmc.get_samples()["t"].shape))
        global (50, 2)
        chains (50, 2)
    """

    def __init__(
        self,
        model: Any = None,
        chunk_size: int = 4096,
        recompute_bn: bool = False,
        max_shrinks: int = 200,
        *,
        reference: Any = "prior",
        df: float | None = None,
        adapt: bool | None = None,
        chains: int | None = None,
        seed: int | None = None,
        rng: str | None = None,
        repeats: int | None = None,
        prior: Any = None,
        log_likelihood: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        if isinstance(reference, str) and reference not in REFERENCES:
            raise ValueError(
                f"reference: expected one of {REFERENCES} or a Gaussian, got {reference!r}"
            )
        auto = isinstance(reference, str) and reference == "auto"
        if df is not None and (
            isinstance(df, bool) or not isinstance(df, (int, float)) or not df > 0
        ):
            what = "fitted" if auto else "Gaussian"
            raise ValueError(
                f"df: expected None ({what}) or a positive number (math.inf: Gaussian), got {df!r}"
            )
        if adapt is not None and not isinstance(adapt, bool):
            raise TypeError(f"adapt: expected None, True or False, got {type(adapt).__name__}")
        if chains is not None and (
            isinstance(chains, bool) or not isinstance(chains, int) or chains < 1
        ):
            raise ValueError(f"chains: expected None or a positive int, got {chains!r}")
        if repeats is not None:
            positive_int(repeats, "repeats")
            if not auto:
                raise ValueError(
                    "repeats: steps of a group between two refits of reference='auto'; "
                    f"reference={reference!r} takes none"
                )
        if auto:
            if adapt is not None:
                raise ValueError(
                    "adapt: not applicable with reference='auto', which refits each group's "
                    "t reference from the other group's current states after every group "
                    "update, in warm-up and sampling alike; leave adapt=None"
                )
            size = 2 * POPULATIONS
            if chains is None or chains % size:
                raise ValueError(
                    f"chains: reference='auto' advances {POPULATIONS} independent populations "
                    f"of two groups together: expected a multiple of {size} (recommended "
                    f"{size}(K + 2), groups of K + 2 states), got {chains!r}"
                )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
        positive_int(chunk_size, "chunk_size"), positive_int(max_shrinks, "max_shrinks")
        plain = isinstance(reference, str) and reference == "prior"
        asks_chains = not plain or df is not None or chains is not None or seed is not None
        if rng is None:
            rng = "chains" if asks_chains else "global"
        elif rng not in RANDOM_STREAMS:
            raise ValueError(f"rng: expected one of {RANDOM_STREAMS} or None, got {rng!r}")
        elif rng == "global" and asks_chains:
            raise ValueError(
                "rng: 'global' is plain ESS over the prior; a fitted reference, df, chains or "
                "seed needs rng='chains' (or None)"
            )
        self.rng = rng
        self._user_likelihood = log_likelihood
        if model is None:
            if prior is None or not callable(log_likelihood):
                shape = "t -> float" if rng == "global" else "(B, K) -> (B,)"
                raise TypeError(
                    "model: give a Pyro model or a SubspaceNet, or prior= (a Gaussian over t) "
                    f"and log_likelihood= (a function {shape})"
                )
            if rng == "global":
                model = _PriorModel(prior)

        elif prior is not None or log_likelihood is not None:
            raise ValueError("prior, log_likelihood: give either a model or these, not both")
        elif rng == "global" and not callable(model):
            raise TypeError(f"model: expected a Pyro model (callable), got {type(model).__name__}")
        elif rng == "chains" and not all(hasattr(model, a) for a in ("prior", "log_likelihood_fn")):
            raise UnsupportedModelError(
                f"model: expected a SubspaceNet (prior, log_likelihood_fn), got "
                f"{type(model).__name__}; other Pyro models are sampled with "
                "reference='prior' and no df, chains or seed (rng='global')"
            )
        if reference == "laplace" and model is None:
            raise ValueError("reference: 'laplace' needs a SubspaceNet model")
        if adapt is None:  # refit only a reference that starts as the prior
            adapt = isinstance(reference, str) and reference == "warmup"
        self.model, self.reference, self.df, self.adapt = model, reference, df, adapt
        self.chains, self.seed = chains, seed
        self.repeats = (repeats or REPEATS) if auto else None
        self.chunk_size, self.recompute_bn = chunk_size, bool(recompute_bn)
        self.max_shrinks = max_shrinks
        self._prior = prior if rng == "chains" else None
        self._pid = os.getpid()
        self._chain_count = 0  # chains started by this kernel: the index of the next one
        self._batch: _Batch | None = None
        self._laplace_key: tuple | None = None
        self._laplace: tuple | None = None
        self._restore: Callable[[], None] | None = None
        self.transforms: dict = {}
        self.last_info: SliceInfo | None = None
        #: with ``reference="auto"``: the `diagnostics.ConvergenceReport` of the latest run
        self.convergence = None
        self._t = self._evals = 0  # the latest chain's transitions and likelihood evaluations
        self._draw_evals: list[int] = []  # the likelihood evaluations of each transition
        self._chain = 0  # with rng="chains": the latest chain's row in its batch
        self._reset_run()
        super().__init__()

    def _reset_run(self) -> None:
        """Forget every piece of per-chain state (what ``cleanup`` does, as Pyro's HMC/NUTS do
        in theirs): the start (the user's ``initial_params`` too), the cached state and its
        log-likelihood, the likelihood function, the priors and the run's arguments. The
        statistics of the latest chain (`evaluations_per_draw`, `last_info`) stay readable
        until the next ``setup``; a finished batch of ``rng="chains"`` stays for the same
        reason and is never reused."""
        self._initial_params: dict[str, torch.Tensor] | None = None
        self._user_initial = False
        self._warmup_steps = 0
        self._loglik: float | None = None
        self._loglik_fn: Callable | None = None
        self._position: dict[str, torch.Tensor] | None = None  # the state _loglik belongs to
        self._versions: dict[str, int | None] = {}
        self._priors: list[GaussianSite] | None = None
        self._reference: PriorReference | None = None
        self._args: tuple = ()
        self._kwargs: dict = {}
        self._step = 0
        self._ready = False  # setup() done, cleanup() not yet

    def _reset_counters(self) -> None:
        self._t = 0
        self._evals = 0
        self._draw_evals = []
        self.last_info = None

    def __getstate__(self) -> dict:
        """What pickles: the configuration, the chain count and a user's ``initial_params``
        (Pyro's multiprocessing driver sets them before it sends the kernel to a worker); not
        the state of a run (its likelihood closures, open batches, cached data), which a worker
        builds again in its ``setup``."""
        state = self.__dict__.copy()
        for name in ("_loglik_fn", "_position", "_priors", "_reference", "_loglik", "_restore"):
            state[name] = None
        state.update(_args=(), _kwargs={}, _versions={}, _batch=None)
        state.update(_laplace=None, _laplace_key=None, last_info=None, _ready=False)
        return state

    # --- the MCMCKernel contract ------------------------------------------------------------

    @property
    def initial_params(self) -> dict[str, torch.Tensor] | None:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor] | None) -> None:
        self._initial_params = None if params is None else dict(params)
        self._user_initial = params is not None

    def setup(self, warmup_steps: int, *args: Any, **kwargs: Any) -> None:
        """Start a chain: split the model into its Gaussian priors and the likelihood and draw
        the start (``rng="global"``); or open a new batch of ``chains`` chains, or take the next
        chain of the open batch (``rng="chains"``)."""
        refuse_subsampling(kwargs)
        distributed.share_random_stream()
        self._ready = False
        if self.rng == "global":
            self._setup_one(warmup_steps, args, kwargs)
        else:
            self._setup_batch(warmup_steps, args, kwargs)
        self._ready = True

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One transition from ``params`` (``rng="chains"``: chain ``c``'s next state, advancing
        the whole batch when it is the first to ask).

        ``params`` is normally what the previous call returned (Pyro's driver passes it back),
        whose log-likelihood the kernel holds; any other position (a direct caller's, or one a
        ``hook_fn`` changed in place) has its log-likelihood computed first. With
        ``rng="chains"`` a chain can be moved to another position only while no chain of its
        batch has gone past its step (always with ``chains=None``).
        """
        if self.rng == "chains":
            return self._sample_batch(params)
        if not self._ready:
            raise RuntimeError("sample: call setup() first (the MCMC driver does)")
        if not self._priors:  # no latent sites: nothing to move (HMC/NUTS return {} too)
            self._t += 1
            return {}
        if not self._holds(params):
            self._restart_at(params)
        self._t += 1
        state = SliceState(self._position, np.array([self._loglik]))
        state, self.last_info = elliptical_slice_step(
            state,
            self._reference,
            lambda proposal, rows: [self.log_likelihood(proposal)],
            self.max_shrinks,
        )
        self._draw_evals.append(int(self.last_info.shrinks[0]) + 1)
        self._loglik = float(state.log_likelihood[0])
        self._cache_position(state.position)
        return state.position

    def _cache_position(self, position: dict[str, torch.Tensor]) -> None:
        """Remember the state ``self._loglik`` belongs to, with the tensors' version counters
        (an in-place change of a returned tensor is then noticed)."""
        self._position = position
        self._versions = {k: _version(v) for k, v in position.items()}

    def _holds(self, params: Any) -> bool:
        """Whether ``params`` is the cached state (same tensors, unchanged, or equal values)."""
        pos = self._position
        if pos is None or not isinstance(params, dict):
            return False
        for k, v in pos.items():
            p = params.get(k)
            if _version(v) != self._versions.get(k) or not isinstance(p, torch.Tensor):
                return False
            if p is not v and (p.shape != v.shape or not torch.equal(p.to(v), v)):
                return False
        return True

    def _restart_at(self, params: Any) -> dict[str, torch.Tensor]:
        """``params`` as a state of the latent sites, with its log-likelihood computed."""
        if not isinstance(params, dict):
            raise TypeError(
                f"params: expected a dict of the latent sites' values, got {type(params).__name__}"
            )
        names = [s.name for s in self._priors]
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"params: missing values for latent sites {missing}")
        state = {}
        for site in self._priors:
            value = torch.as_tensor(params[site.name]).to(site.mean)
            if tuple(value.shape) != tuple(site.shape):
                raise ValueError(
                    f"params[{site.name!r}]: expected shape {tuple(site.shape)}, got "
                    f"{tuple(value.shape)}"
                )
            state[site.name] = value
        loglik = self.log_likelihood(state)
        if math.isnan(loglik):
            raise ValueError("params: the log-likelihood at the given position is NaN")
        self._loglik = loglik
        self._cache_position(state)
        return state

    def _sample_batch(self, params: Any) -> dict[str, torch.Tensor]:
        batch = self._batch
        if batch is None or not self._ready:
            raise RuntimeError("sample: call setup() first (the MCMC driver does)")
        current = batch.states[self._step][self._chain]
        given = params.get("t") if isinstance(params, dict) else None
        if not isinstance(given, torch.Tensor) or given.shape != current.shape:
            got = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(
                f"params: expected {{'t': a tensor of shape {tuple(current.shape)}}}, got {got}"
            )
        if not torch.equal(given.to(current), current):
            batch.move(self._step, self._chain, given)
        self._step += 1
        while len(batch.states) <= self._step:
            batch.advance()
        self.last_info = batch.info
        self._t += 1
        # a copy: a caller's in-place change must not rewrite the batch's trajectory
        return {"t": batch.states[self._step][self._chain].clone()}

    def logging(self) -> OrderedDict:
        return OrderedDict([("evals/draw", f"{self.evaluations_per_draw:.2f}")])

    def diagnostics(self) -> dict:
        diag = {
            "divergences": [],
            "acceptance rate": 1.0,
            "evaluations per draw": self.evaluations_per_draw,
        }
        if self.rng == "chains":
            b = self._batch
            diag["passes per draw"] = b.passes / max(b.steps, 1)
            kept = slice(b.warmup + 1, self._step + 1)  # the chain's draws after warm-up
            diag["draw evaluations"] = np.array([e[self._chain] for e in b.step_evals[kept]])
            if isinstance(b, _Population):  # the ν of the chain's t at every refit, per draw
                diag["reference df"] = b.reference_df(self._chain)
                diag["draw reference df"] = np.array([d[self._chain] for d in b.step_df[kept]])
        else:
            diag["draw evaluations"] = np.array(self._draw_evals[self._warmup_steps :])
        return diag

    def cleanup(self) -> None:
        """End a chain: put the user's BatchNorm buffers back and forget the chain's state
        (`_reset_run`), the user's ``initial_params`` included, so that the next ``setup`` (a
        new chain, or a new ``MCMC`` with this kernel) starts afresh, as Pyro's HMC/NUTS do."""
        if self._restore is not None:
            self._restore()  # the user's BatchNorm buffers
            self._restore = None
        b = self._batch
        if b is not None and b.opened >= b.size:
            if isinstance(b, _Population) and not b.checked and self._step > b.warmup:
                b.checked = True  # Pyro's driver calls cleanup twice per chain
                draws = torch.stack(b.states[b.warmup + 1 : self._step + 1], 1)  # (C, n, K)
                self.convergence = check_draws(
                    {"t": draws},
                    populations=b.population,
                    kernel=self,
                )
            b.free()  # the batch is finished
        self._reset_run()

    @property
    def chain_populations(self) -> list[int] | None:
        """With ``reference="auto"``: the population of each chain of the latest batch (chains
        of one population are coupled through their references, populations independent), for
        `diagnostics.check`; else ``None``."""
        b = self._batch
        return list(b.population) if isinstance(b, _Population) else None

    @property
    def evaluations_per_draw(self) -> float:
        """Mean number of likelihood evaluations of the current (after a run: the latest) chain
        per transition so far."""
        if self.rng == "chains":
            b = self._batch
            return 0.0 if b is None else float(b.evals[self._chain]) / max(b.steps, 1)
        return self._evals / max(self._t, 1)

    # --- the likelihood ---------------------------------------------------------------------

    def _likelihood(self, args: tuple, kwargs: dict) -> Callable | None:
        """``log L`` of ``{"t": t}``: a float for ``t`` ``(K,)``, float64 ``(B,)`` for a batch
        ``(B, K)`` (a `SubspaceNet`'s `Evaluator`, or the user's function); ``None`` for a Pyro
        model traced by `log_likelihood`. Sets ``self._restore`` (BatchNorm buffers)."""
        self._restore = None
        user = self._user_likelihood
        if user is not None:
            if self.rng == "global":
                return lambda params: float(user(params["t"]))
            return lambda params: torch.as_tensor(user(params["t"])).double()
        if not hasattr(self.model, "log_likelihood_fn"):
            return None
        if self.rng == "chains" and (args[0] if args else kwargs.get("x")) is None:
            return lambda params: 0.0  # no data: the posterior is the prior
        fn, self._restore = self.model.log_likelihood_fn(
            *args, chunk_size=self.chunk_size, recompute_bn=self.recompute_bn, **kwargs
        )
        return fn

    def log_likelihood(self, params: dict[str, torch.Tensor]) -> float:
        """``log L(θ)`` at one point: the tempered full-data log-likelihood of a `SubspaceNet`,
        the user's function, or a Pyro model's log joint minus its Gaussian log prior."""
        fn = self._loglik_fn
        if fn is None and self._batch is not None:  # after a run: the latest batch's data
            fn = self._batch.fn
        if fn is None and self._priors is None:
            raise RuntimeError("log_likelihood: call setup() first (the MCMC driver does)")
        self._evals += 1
        if fn is not None:
            return float(fn(params))
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

    # --- rng="global": one chain over the prior sites of a Pyro model ------------------------

    def _setup_one(self, warmup_steps: int, args: tuple, kwargs: dict) -> None:
        self._reset_counters()
        self._warmup_steps = warmup_steps
        self._args, self._kwargs = args, kwargs
        self._loglik_fn = self._likelihood(args, kwargs)
        if self._loglik_fn is not None and hasattr(self.model, "latent_model"):
            model = self.model.latent_model  # the latent sites alone
        else:
            model = self.model
        self._priors = gaussian_priors(
            model,
            () if model is not self.model else args,
            {} if model is not self.model else kwargs,
        )
        # gaussian_priors traced the model: a plate that subsamples was refused there
        if not self._priors:  # no latent sites: empty draws, as HMC/NUTS give
            self._initial_params = {}
            self._cache_position(self._initial_params)
            return
        self._reference = PriorReference(self._priors)
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
        self._cache_position(self._initial_params)
        self._evals = 0  # count evaluations per transition only
        if not math.isfinite(self._loglik):
            where = "initial_params" if self._user_initial else "model"
            raise ValueError(
                f"{where}: the log-likelihood at the start (a draw from the prior) is "
                f"{self._loglik}; check the data and the network's outputs"
            )

    # --- rng="chains": batches of chains over t, a reference per chain -----------------------

    def _setup_batch(self, warmup_steps: int, args: tuple, kwargs: dict) -> None:
        if self.reference == "auto" and os.getpid() != self._pid:
            cores = max((os.cpu_count() or 2) - 1, 1)
            raise RuntimeError(
                f"reference='auto' advances its chains={self.chains} chains together in one "
                "process (each group's reference is fitted to the other group's current "
                "states), but Pyro's MCMC runs this chain in a worker process of its own (it "
                f"does when num_chains <= os.cpu_count() - 1 = {cores}). "
                "Keep the chains in this process: pass the MCMC to "
                "pyro_subspace.infer.ess.one_process, i.e. one_process(MCMC(kernel, "
                f"num_samples, warmup_steps, num_chains={self.chains})).run(...)"
            )
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
            prior = self._prior if self.model is None else self.model.prior()
            self._loglik_fn = fn = self._likelihood(args, kwargs)
            mu, cov = self._initial_reference(prior, args, kwargs)
            first = self._chain_count
            if self.seed is not None and os.getpid() == self._pid:
                seeds = [(self.seed * _MIX + 7919 * (first + j)) % 2**63 for j in range(size)]
            else:
                seeds = torch.randint(0, 2**62, (size,)).tolist()
            loglik = self._batched(fn)
            kind = _Population if self.reference == "auto" else _Batch
            self._batch = batch = kind(
                self, prior, loglik, mu, cov, seeds, warmup_steps, start, args, kwargs
            )
            batch.fn = fn
            self._chain_count += size
        self._chain = batch.opened
        batch.opened += 1
        self._step = 0
        self._initial_params = {"t": batch.states[0][self._chain].clone()}

    def _batched(self, fn: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        """``(B, K) -> (B,)`` float64 from the likelihood of ``{"t": t}``."""
        if self.recompute_bn and self._user_likelihood is None:  # BatchNorm at each point

            def one_by_one(t: torch.Tensor) -> torch.Tensor:
                values = [float(fn({"t": row})) for row in t]
                return torch.tensor(values, dtype=torch.float64, device=t.device)

            return one_by_one

        def batched(t: torch.Tensor) -> torch.Tensor:
            value = fn({"t": t})
            if not isinstance(value, torch.Tensor):  # no targets: a constant
                return t.new_zeros(t.shape[0], dtype=torch.float64) + value
            return value

        return batched

    def _initial_reference(self, prior: Any, args: tuple, kwargs: dict):
        """``(μ (K,), Σ (K, K))`` float64 of the reference before any adaptation."""
        ref = self.reference
        if isinstance(ref, str):
            if ref not in ("laplace", "auto") or self.model is None:  # "auto": Laplace or prior
                return gaussian_moments(prior)
            # the run's own argument objects, held and compared by identity (an id of a freed
            # object can come back): Pyro's MCMC.run passes the same (detached) tensors to
            # every chain of a run, and new ones to the next run, which therefore fits again
            key = (args, tuple(kwargs), tuple(kwargs.values()))
            old = self._laplace_key
            same = (
                old is not None
                and _same(old[0], args)
                and old[1] == key[1]
                and _same(old[2], key[2])
                and old[3:] == (self.model.temperature, self.model.rank)
            )
            key += (self.model.temperature, self.model.rank)
            if not same:  # fit once per data set, not once per chain
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


class _Population(_Batch):
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


def one_process(mcmc: Any) -> Any:
    """Make Pyro's ``MCMC`` run its chains in this process, one after another.

    ``MCMC(kernel, ..., num_chains=C)`` starts a worker process per chain when the machine has
    more than ``C`` cores; ``EllipticalSliceSampler(reference="auto", chains=C)`` advances its
    ``C`` chains together and needs them in one process (in a worker it refuses). This replaces
    Pyro's multiprocessing runner by its sequential one with the same settings (Pyro's own
    choice on a machine with at most ``C`` cores); an ``MCMC`` already sequential is returned
    as it is. Relies on Pyro's ``MCMC.sampler`` attribute (``_MultiSampler`` and
    ``_UnarySampler``, pyro-ppl 1.8-1.9).

    Args:
        mcmc: a ``pyro.infer.MCMC`` not yet run.

    Returns:
        ``mcmc`` itself, for ``one_process(MCMC(...)).run(*args)``.
    """
    from pyro.infer.mcmc.api import _MultiSampler, _UnarySampler

    sampler = getattr(mcmc, "sampler", None)
    if sampler is None:
        raise TypeError(f"mcmc: expected a pyro.infer.MCMC, got {type(mcmc).__name__}")
    if isinstance(sampler, _MultiSampler):
        # the progress-bar setting went only to the runner's logging thread, which is stopped
        disable_progbar = sampler.log_thread._args[4]
        sampler.terminate()
        mcmc.sampler = _UnarySampler(
            sampler.kernel,
            sampler.num_samples,
            sampler.warmup_steps,
            sampler.num_chains,
            disable_progbar,
            initial_params=sampler.initial_params,
            hook=sampler.hook,
        )
    return mcmc


def _version(t: torch.Tensor) -> int | None:
    """A tensor's version counter (incremented by every in-place change); ``None`` for an
    inference-mode tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


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


def _gaussian(df: float | None) -> bool:
    """Whether degrees of freedom ``df`` mean a Gaussian (``None`` or ``∞``)."""
    return df is None or math.isinf(df)


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
