"""One elliptical slice transition over a Gaussian or multivariate-t reference.

The target is ``π(t) ∝ p(t) L(t)`` with a Gaussian prior ``p``. Elliptical slice sampling
(Murray, Adams & MacKay, 2010) moves along ellipses through the current point drawn from a
Gaussian ``R = N(μ, Σ)``, the *reference*, and slices the rest of the density,
``L̃ = π / R`` (Nishihara, Murray & Adams 2014, section 3; Fagan, Bhandari & Cunningham 2016,
eq. 3). With ``R = p`` ``L̃ = L`` and this is Murray et al.'s plain kernel; a reference fitted to
the posterior is the generalised kernel. One transition from ``t`` (Murray et al., Fig. 2, with
``L̃``)::

    ν ~ N(0, Σ);  log y = log L̃(t) + log u,  u ~ U(0, 1)
    φ ~ U[0, 2π];  [φ_min, φ_max] = [φ − 2π, φ]
    loop:  t' = μ + (t − μ) cos φ + ν sin φ
           if log L̃(t') > log y: accept t'
           else shrink the bracket towards 0 at φ and draw φ ~ U[φ_min, φ_max]

*Multivariate-t reference* ``R = t_df(μ, Σ)`` (Nishihara et al., Algorithm 2): first draw the
scale ``s ~ InvGamma((df + K)/2, (df + (t − μ)ᵀΣ⁻¹(t − μ))/2)``, then the transition above with
``ν ~ N(0, s Σ)``; ``L̃ = π / R`` does not depend on ``s``. Every reference leaves ``π``
invariant; the closer ``R`` is to ``π``, the closer a draw is to an independent one at one
evaluation per draw.

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

`ess.EllipticalSliceSampler` wraps that core in Pyro's ``MCMCKernel`` contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from .gaussian_prior import GaussianSite


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
