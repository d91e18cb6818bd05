"""The maximum-likelihood multivariate t: location, scale matrix and degrees of freedom by ECME.

The reference of the generalised elliptical slice kernel's population scheme (Nishihara, Murray
& Adams 2014, "Parallel MCMC with generalized elliptical slice sampling", JMLR 15) is the multivariate t fitted by maximum likelihood to the other group's
current states. The density of ``t_ν(μ, Σ)`` over ``K`` coordinates is ::

    log t(x) = log Γ((ν+K)/2) − log Γ(ν/2) − (K/2) log(νπ) − ½ log|Σ| − ((ν+K)/2) log(1 + δ/ν),
    δ = (x − μ)ᵀ Σ⁻¹ (x − μ),

and ``ν → ∞`` is the Gaussian ``N(μ, Σ)``. `fit_multivariate_t` maximises the sum over the
``n`` states with the ECME iteration of Liu & Rubin (1995, "ML estimation of the t distribution
using EM and its extensions, ECM and ECME", Statistica Sinica 5):

- E-step: weights ``w_i = (ν + K) / (ν + δ_i)`` (the conditional mean of the Gamma mixing
  variable of the scale-mixture form ``x | τ ~ N(μ, Σ/τ)``, ``τ ~ Gamma(ν/2, ν/2)``);
- CM-steps: ``μ = Σ w_i x_i / Σ w_i``, ``Σ = Σ w_i (x_i − μ)(x_i − μ)ᵀ / n``;
- the "either" step: ``ν`` maximises the *observed* log-likelihood at the new ``(μ, Σ)``, the
  root of its derivative in ``ν`` with the weights recomputed at each trial ``ν``::

      −ψ(ν/2) + log(ν/2) + 1 + (1/n) Σ (log w_i(ν) − w_i(ν)) + ψ((ν+K)/2) − log((ν+K)/2) = 0,

  found by `scipy.optimize.brentq` in ``log ν`` over ``df_bounds``; when the derivative is still
  positive at the upper bound the likelihood increases towards the Gaussian, and ``ν = ∞``.

Each step raises the objective (an ECME iteration is monotone), so the loop stops when one
iteration gains less than ``tol`` nats per state.

*A prior on ν.* From a handful of states the likelihood of ``ν`` is nearly flat above ``ν ≈ 10``
and its maximum is often ``∞``: the states cannot show tails. ``df_prior=(a, b)`` adds the log
density of a ``Gamma(a, b)`` prior on ``ν`` (Juárez & Steel 2010 propose ``Gamma(2, 0.1)``:
mode 10, mean 20) and ``ν`` is then its posterior mode, the root of the score plus
``(2/n)((a − 1)/ν − b)``: always finite, near the prior's mode for few states and the maximum
likelihood one for many.

*Few states.* A scale matrix needs more states than coordinates: with fewer than
``min_states = K + 2`` (or a degenerate set, e.g. chains stuck at one point) the ML scale is
singular. The fit then maximises the log-likelihood plus an inverse-Wishart-shaped penalty
``−(n₀/2)(tr(Σ⁻¹Σ₀) + log|Σ|)`` with ``n₀ = min_states − n`` pseudo-states at a given fallback
covariance ``Σ₀`` (the Laplace or prior covariance): the CM-step becomes
``Σ = (Σ w_i (x_i − μ)(x_i − μ)ᵀ + n₀ Σ₀) / (n + n₀)``, positive definite whatever the states.
The ``ν`` step is unchanged (the penalty does not depend on ``ν``). No Cholesky error reaches the
caller: a scale that is still not positive definite is refitted with ``n₀`` raised to
``min_states``, and without a fallback ``Σ₀`` is the identity times the states' mean variance
(or 1). With ``fallback_loc = μ₀`` the pseudo-states also have a location: the penalty is the
Gaussian log-likelihood of ``n₀`` pseudo-states with mean ``μ₀`` and scatter ``Σ₀``,
``−(n₀/2)(tr(Σ⁻¹(Σ₀ + (μ − μ₀)(μ − μ₀)ᵀ)) + log|Σ|)``, and the CM-steps become
``μ = (Σ w_i x_i + n₀ μ₀) / (Σ w_i + n₀)`` and
``Σ = (Σ w_i (x_i − μ)(x_i − μ)ᵀ + n₀ (Σ₀ + (μ − μ₀)(μ − μ₀)ᵀ)) / (n + n₀)``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

__all__ = ["StudentTFit", "fit_multivariate_t", "multivariate_t_log_density"]

DF_BOUNDS = (1e-3, 1e6)


class StudentTFit(NamedTuple):
    """A fitted multivariate t.

    Attributes:
        loc: ``(K,)`` float64, ``μ``.
        scale: ``(K, K)`` float64, the scale matrix ``Σ`` (the covariance is ``Σ ν/(ν − 2)``).
        df: ``ν`` (``math.inf``: Gaussian).
        log_likelihood: the t log-likelihood of the states at the fit (without the penalty).
        iterations: ECME iterations made.
        converged: whether the last iteration gained less than ``tol`` nats per state.
        shrinkage: ``n₀``, the pseudo-states at the fallback covariance (0: a plain ML fit).
    """

    loc: np.ndarray
    scale: np.ndarray
    df: float
    log_likelihood: float
    iterations: int
    converged: bool
    shrinkage: float


def multivariate_t_log_density(x: Any, loc: Any, scale: Any, df: float) -> np.ndarray:
    """``log t_ν(x | μ, Σ)`` ``(n,)`` (normalised) for ``x`` ``(n, K)``; ``df = inf``: the
    Gaussian. The same density as ``scipy.stats.multivariate_t(loc, scale, df).logpdf``."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    tril = np.linalg.cholesky(np.asarray(scale, dtype=np.float64))
    delta = _mahalanobis(x, np.asarray(loc, dtype=np.float64), tril)
    return _log_density(delta, tril, float(df), x.shape[1])


def fit_multivariate_t(
    x: Any,
    *,
    df: float | None = None,
    fallback: Any = None,
    fallback_loc: Any = None,
    min_states: int | None = None,
    tol: float = 1e-9,
    max_iter: int = 1000,
    df_bounds: tuple[float, float] = DF_BOUNDS,
    df_prior: tuple[float, float] | None = None,
) -> StudentTFit:
    """The maximum-likelihood multivariate t of the rows of ``x`` (ECME, Liu & Rubin 1995).

    Args:
        x: ``(n, K)`` states (a NumPy array or a tensor), ``n ≥ 1``, finite.
        df: ``None``: fit ``ν`` (a real number or ``math.inf``); a positive number (or
            ``math.inf``): keep ``ν`` fixed and fit ``(μ, Σ)`` (EM for a known ``ν``).
        fallback: ``(K, K)`` positive definite covariance the scale is shrunk towards when the
            states are too few (``n < min_states``) or degenerate (see the module notes).
        fallback_loc: ``(K,)``: the pseudo-states also sit at this location, so the location
            is shrunk towards it too (needs ``fallback``; module notes).
        min_states: the states a fit needs without shrinkage; default ``K + 2``.
        tol: stop when an iteration gains less than ``tol`` nats per state.
        max_iter: iterations at most (``converged`` is False when they run out).
        df_bounds: the interval of the root search for ``ν`` (the derivative's sign at the
            upper bound decides ``ν = ∞``; below the lower bound ``ν`` is clipped to it).
        df_prior: ``None`` (maximum likelihood) or ``(a, b)``: ``ν`` is the mode of its
            posterior under a ``Gamma(a, b)`` prior (shape ``a ≥ 1``, rate ``b > 0``).

    Returns:
        A `StudentTFit` ``(loc (K,), scale (K, K), df, log_likelihood, iterations, converged,
        shrinkage)``.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> x = rng.standard_normal((2000, 2)) / np.sqrt(rng.chisquare(4, (2000, 1)) / 4)
        >>> fit = fit_multivariate_t(x)
        >>> 3 < fit.df < 5.5, np.allclose(fit.loc, 0, atol=0.1)
        (True, True)
    """
    x = _states(x)
    n, k = x.shape
    if df is not None:
        if isinstance(df, bool) or not isinstance(df, (int, float)) or not df > 0:
            raise ValueError(f"df: expected None (fitted) or a positive number, got {df!r}")
        df = float(df)
    if min_states is None:
        min_states = k + 2
    elif isinstance(min_states, bool) or not isinstance(min_states, int) or min_states < 1:
        raise ValueError(f"min_states: expected a positive int, got {min_states!r}")
    if fallback is not None:
        fallback = np.asarray(fallback, dtype=np.float64)
        if fallback.shape != (k, k) or not np.isfinite(fallback).all():
            raise ValueError(
                f"fallback: expected a finite ({k}, {k}) covariance, got shape {fallback.shape}"
            )
        if _cholesky(fallback) is None:
            raise ValueError("fallback: the covariance is not positive definite")
    if fallback_loc is not None:
        fallback_loc = np.asarray(fallback_loc, dtype=np.float64)
        if fallback is None:
            raise ValueError("fallback_loc: needs fallback= (the pseudo-states' covariance)")
        if fallback_loc.shape != (k,) or not np.isfinite(fallback_loc).all():
            raise ValueError(
                f"fallback_loc: expected a finite ({k},) location, got shape {fallback_loc.shape}"
            )
    lo, hi = df_bounds
    if not 0 < lo < hi:
        raise ValueError(f"df_bounds: expected 0 < low < high, got {df_bounds!r}")
    if df_prior is not None:
        if (
            not isinstance(df_prior, tuple)
            or len(df_prior) != 2
            or not df_prior[0] >= 1
            or not df_prior[1] > 0
        ):
            raise ValueError(
                f"df_prior: expected None or (shape >= 1, rate > 0) of a Gamma prior, got "
                f"{df_prior!r}"
            )
        df_prior = (float(df_prior[0]), float(df_prior[1]))
    if not tol > 0:
        raise ValueError(f"tol: expected a positive number, got {tol!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter: expected a positive int, got {max_iter!r}")

    shrink = float(max(0, min_states - n))
    args = (tol, max_iter, df_bounds, df_prior)
    fit = _ecme(x, df, fallback, fallback_loc, shrink, *args)
    if fit is None:  # degenerate states: as many pseudo-states as a fit needs
        fit = _ecme(x, df, fallback, fallback_loc, float(min_states), *args)
    return fit


# --- the iteration ---------------------------------------------------------------------------


def _states(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a tensor
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"x: expected states of shape (n, K), n, K >= 1, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x: the states contain NaN or infinite values")
    return x


def _ecme(
    x, df, fallback, fallback_loc, shrink, tol, max_iter, df_bounds, df_prior
) -> StudentTFit | None:
    """ECME from the states' mean and (shrunk) covariance, ``ν`` = 20 (or the fixed one);
    ``None`` when the scale is not positive definite (degenerate states, no shrinkage)."""
    n, k = x.shape
    cov0 = None
    if shrink > 0:
        if fallback is not None:
            cov0 = fallback
        else:  # no fallback: an isotropic one at the states' mean variance
            var = float(x.var(0).mean()) if n > 1 else 0.0
            cov0 = (var if var > 0 else 1.0) * np.eye(k)
    pull = fallback_loc is not None and shrink > 0  # pseudo-states at a location too

    def locate(weights: np.ndarray) -> np.ndarray:
        if pull:
            return (weights @ x + shrink * fallback_loc) / (weights.sum() + shrink)
        return weights @ x / weights.sum()

    def target_at(loc: np.ndarray) -> np.ndarray | None:
        """The pseudo-states' scatter about ``loc``: ``Σ₀ (+ (μ − μ₀)(μ − μ₀)ᵀ)``."""
        if not pull:
            return cov0
        d = loc - fallback_loc
        return cov0 + np.outer(d, d)

    loc = locate(np.ones(n))
    centred = x - loc
    target = target_at(loc)
    scale = _scale(centred, np.ones(n), target, shrink)
    nu = 20.0 if df is None else df
    tril = _cholesky(scale)
    if tril is None:
        return None
    delta = _mahalanobis(x, loc, tril)
    objective = _log_density(delta, tril, nu, k).sum() + _penalty(tril, target, shrink)
    objective += _log_df_prior(nu, df_prior) if df is None else 0.0
    converged, it = False, 0
    for it in range(1, max_iter + 1):
        weights = np.ones(n) if math.isinf(nu) else (nu + k) / (nu + delta)  # E-step
        loc = locate(weights)  # CM-steps
        centred = x - loc
        target = target_at(loc)
        scale = _scale(centred, weights, target, shrink)
        tril = _cholesky(scale)
        if tril is None:
            return None
        delta = _mahalanobis(x, loc, tril)
        if df is None:  # the "either" step: ν maximises the observed likelihood
            nu = _df_root(delta, k, df_bounds, nu, df_prior)
        loglik = _log_density(delta, tril, nu, k).sum()
        new = loglik + _penalty(tril, target, shrink)  # the objective ECME raises
        new += _log_df_prior(nu, df_prior) if df is None else 0.0
        gain, objective = new - objective, new
        if abs(gain) < tol * n:
            converged = True
            break
    return StudentTFit(loc, scale, nu, float(loglik), it, converged, shrink)


def _scale(centred, weights, target, shrink) -> np.ndarray:
    n = centred.shape[0]
    s = (centred * weights[:, None]).T @ centred
    if shrink > 0:
        s = s + shrink * target
    s = s / (n + shrink)
    return 0.5 * (s + s.T)


def _penalty(tril: np.ndarray, target: np.ndarray | None, shrink: float) -> float:
    """``−(n₀/2)(tr(Σ⁻¹Σ₀) + log|Σ|)``, the inverse-Wishart-shaped shrinkage term."""
    if shrink == 0:
        return 0.0
    inv = np.linalg.inv(tril)
    trace = float(np.trace(inv @ target @ inv.T))  # tr(Σ⁻¹ Σ₀) = tr(L⁻¹ Σ₀ L⁻ᵀ)
    return -0.5 * shrink * (trace + 2 * np.log(np.diag(tril)).sum())


def _cholesky(a: np.ndarray) -> np.ndarray | None:
    try:
        tril = np.linalg.cholesky(a)
    except np.linalg.LinAlgError:
        return None
    return tril if np.isfinite(tril).all() and (np.diag(tril) > 0).all() else None


def _mahalanobis(x: np.ndarray, loc: np.ndarray, tril: np.ndarray) -> np.ndarray:
    # an explicit inverse of the small triangular factor: scipy's solve_triangular took
    # milliseconds per call under OpenBLAS's threads on a busy machine, this microseconds
    z = (x - loc) @ np.linalg.inv(tril).T
    return (z * z).sum(1)


def _log_density(delta: np.ndarray, tril: np.ndarray, nu: float, k: int) -> np.ndarray:
    from scipy import special  # on first use: importing the package loads no scipy

    half_logdet = np.log(np.diag(tril)).sum()
    if math.isinf(nu):
        return -0.5 * delta - half_logdet - 0.5 * k * math.log(2 * math.pi)
    const = (
        special.gammaln(0.5 * (nu + k))
        - special.gammaln(0.5 * nu)
        - 0.5 * k * math.log(nu * math.pi)
    )
    return const - half_logdet - 0.5 * (nu + k) * np.log1p(delta / nu)


def _log_df_prior(nu: float, prior: tuple[float, float] | None) -> float:
    """``log Gamma(ν | a, b)`` up to a constant; 0 without a prior."""
    if prior is None:
        return 0.0
    return (prior[0] - 1) * math.log(nu) - prior[1] * nu


def _df_score(nu: float, delta: np.ndarray, k: int, prior=None) -> float:
    """``(2/n) ∂(ℓ + log p(ν))/∂ν`` at fixed ``(μ, Σ)`` (Liu & Rubin 1995's ECME step), in a
    form that keeps its precision for large ``ν``: ``log w − w + 1 = log1p(a) − a`` with
    ``w = 1 + a``."""
    from scipy import special  # on first use: importing the package loads no scipy

    n = delta.shape[0]
    a = (k - delta) / (nu + delta)
    digammas = (
        special.digamma(0.5 * (nu + k))
        - math.log(0.5 * (nu + k))
        - special.digamma(0.5 * nu)
        + math.log(0.5 * nu)
    )
    score = float(digammas + (np.log1p(a) - a).sum() / n)
    if prior is not None:
        score += 2.0 / n * ((prior[0] - 1) / nu - prior[1])
    return score


def _df_root(
    delta: np.ndarray, k: int, bounds: tuple[float, float], guess: float, prior=None
) -> float:
    """The root of `_df_score` in ``log ν`` (`scipy.optimize.brentq`), bracketed first around
    the previous iteration's ``ν`` (a factor 4 either way), else over ``bounds``; ``∞`` when
    the score is still positive at the upper bound, the lower bound when negative there."""
    from scipy import optimize  # on first use: importing the package loads no scipy

    lo, hi = bounds
    if lo < guess < hi:  # a narrow bracket saves most of brentq's evaluations
        a, b = max(lo, guess / 4), min(hi, guess * 4)
        if _df_score(a, delta, k, prior) > 0 > _df_score(b, delta, k, prior):
            lo, hi = a, b
    if hi == bounds[1] and _df_score(hi, delta, k, prior) >= 0:  # rising to the Gaussian limit
        return math.inf
    if lo == bounds[0] and _df_score(lo, delta, k, prior) <= 0:
        return lo
    u = optimize.brentq(
        lambda u: _df_score(math.exp(u), delta, k, prior),
        math.log(lo),
        math.log(hi),
        xtol=1e-10,
        rtol=1e-10,
    )
    return math.exp(u)
