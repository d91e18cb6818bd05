"""Metrics for regression and classification predictives, and for out-of-distribution detection.

Regression: Gaussian NLL, the moment-matched Gaussian NLL of Subspace Inference (Izmailov et al.,
2019, appendix G.1), the Bayesian-model-average mixture NLL, RMSE, and predictive intervals with
their coverage. Classification: NLL, accuracy, ECE/MCE over 20 bins as in Ensemble Model Patching
(Chang et al., appendix D.2, eq. 27), Brier score, and the OOD metrics of Mixtures of Laplace
Approximations (Eschenhagen et al.): mean maximum confidence (MMC) and AUROC.

Inputs are torch tensors of any floating dtype on one device (half precision is upcast to float32
for the computation); scalar metrics come back as Python floats. Single-output regression targets
may be ``(N,)`` or ``(N, 1)``: both are read as ``(N,)``, never broadcast to ``(N, N)``. Every
function validates its input before any work and raises ``TypeError``/``ValueError`` naming the
offending argument.

Example:
    >>> probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    >>> accuracy(probs, torch.tensor([0, 0]))
    0.5
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from sklearn.metrics import roc_auc_score
from torch import Tensor
from torch.distributions import Normal

__all__ = [
    "PROB_EPS",
    "accuracy",
    "brier_score",
    "calibration_errors",
    "categorical_nll",
    "gaussian_interval",
    "gaussian_nll",
    "interval_coverage",
    "mixture_gaussian_nll",
    "mmc",
    "moment_match",
    "moment_matched_gaussian_nll",
    "ood_auroc",
    "reliability_diagram_data",
    "rmse",
    "sample_interval",
]

#: `categorical_nll` clamps probabilities to at least this before the log, so a zero probability
#: of the true class costs ``-log(1e-12) ≈ 27.6`` nats instead of ``inf``.
PROB_EPS = 1e-12


def _tensor(x: object, name: str, kind: str = "float") -> Tensor:
    """Check ``x`` is a non-empty finite tensor of the right kind ("float", "real" or "int")."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    bad_kind = {
        "float": not x.is_floating_point(),
        "real": x.is_complex() or x.dtype == torch.bool,
        "int": x.is_floating_point() or x.is_complex() or x.dtype == torch.bool,
    }[kind]
    if bad_kind:
        what = "integer class labels" if kind == "int" else f"a {kind}-valued tensor"
        raise TypeError(f"{name}: expected {what}, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{name}: expected at least one element, got shape {tuple(x.shape)}")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: expected finite values, found NaN or inf")
    return x


def _vector(x: Tensor, name: str, n: int | None = None, ref: str = "") -> Tensor:
    """Return ``x`` of shape (N,) or (N, 1) as (N,); N must equal ``n`` (described by ``ref``)."""
    v = x[:, 0] if x.dim() == 2 and x.shape[1] == 1 else x
    if v.dim() != 1 or (n is not None and v.shape[0] != n):
        match = f" matching {ref}" if n is not None else ""
        raise ValueError(f"{name}: expected shape (N,) or (N, 1){match}, got {tuple(x.shape)}")
    return v


def _draws(x: Tensor, name: str, like: Tensor | None = None, like_name: str = "") -> Tensor:
    """Return ``x`` of shape (S, N) or (S, N, 1) as (S, N); it must match ``like`` when given."""
    d = x[..., 0] if x.dim() == 3 and x.shape[2] == 1 else x
    if d.dim() != 2 or (like is not None and d.shape != like.shape):
        match = f" matching {like_name} (S, N) = {tuple(like.shape)}" if like is not None else ""
        raise ValueError(f"{name}: expected shape (S, N) or (S, N, 1){match}, got {tuple(x.shape)}")
    return d


def _nonneg(x: Tensor, name: str, strict: bool) -> None:
    """Raise unless ``x > 0`` (``strict``) or ``x >= 0`` everywhere."""
    if bool((x <= 0).any() if strict else (x < 0).any()):
        what = "strictly positive" if strict else "non-negative"
        raise ValueError(f"{name}: expected {what} values, got minimum {float(x.min()):.3g}")


def _common(**tensors: Tensor) -> list[Tensor]:
    """Check all tensors share the first one's device; cast to one float dtype (>= float32)."""
    (first_name, first), dtype = next(iter(tensors.items())), torch.float32
    for name, t in tensors.items():
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected device {first.device} of {first_name}, got {t.device}"
            )
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in tensors.values()]


def _level(level: object) -> float:
    """Check a central-interval probability mass lies in the open interval (0, 1)."""
    if isinstance(level, bool) or not isinstance(level, Real):
        raise TypeError(f"level: expected a float in (0, 1), got {level!r}")
    if not 0 < level < 1:
        raise ValueError(f"level: expected a value in the open interval (0, 1), got {level!r}")
    return float(level)


def _int(value: object, name: str, minimum: int) -> int:
    """Check ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _probs(probs: object, name: str = "probs") -> Tensor:
    """Validate class probabilities (N, C): in [0, 1], rows summing to 1; return >= float32."""
    p = _tensor(probs, name)
    if p.dim() != 2:
        raise ValueError(
            f"{name}: expected class probabilities of shape (N, C), got {tuple(p.shape)}"
        )
    if bool(((p < 0) | (p > 1)).any()):
        lo, hi = float(p.min()), float(p.max())
        raise ValueError(f"{name}: expected probabilities in [0, 1], got values in [{lo}, {hi}]")
    atol = max(1e-3, p.shape[1] * torch.finfo(p.dtype).eps)  # rounding of C stored entries
    p = p.to(torch.promote_types(p.dtype, torch.float32))
    dev = float((p.sum(dim=1) - 1).abs().max())
    if dev > atol:
        raise ValueError(
            f"{name}: expected rows summing to 1 (atol {atol:.1e}), max deviation {dev:.3g}"
        )
    return p


def _classification(probs: object, y: object) -> tuple[Tensor, Tensor]:
    """Validate probs (N, C) and integer labels y (N,) or (N, 1) in [0, C); return (probs, y)."""
    p = _probs(probs)
    n, c = p.shape
    labels = _vector(_tensor(y, "y", "int"), "y", n, f"probs (N, C) = {(n, c)}")
    if labels.device != p.device:
        raise ValueError(f"y: expected device {p.device} of probs, got {labels.device}")
    if bool(((labels < 0) | (labels >= c)).any()):
        lo, hi = int(labels.min()), int(labels.max())
        raise ValueError(f"y: expected labels in [0, {c}), got values in [{lo}, {hi}]")
    return p, labels.long()


def _mean_var_y(mean: object, var: object, y: object, var_name: str) -> list[Tensor]:
    """Validate mean, var (> 0), y of shape (N,) or (N, 1); return them as (N,) in one dtype."""
    m = _vector(_tensor(mean, "mean"), "mean")
    ref = f"mean (N,) = ({m.shape[0]},)"
    v = _vector(_tensor(var, var_name), var_name, m.shape[0], ref)
    t = _vector(_tensor(y, "y", "real"), "y", m.shape[0], ref)
    _nonneg(v, var_name, strict=True)
    return _common(mean=m, **{var_name: v}, y=t)


def _draws_pair(means: object, variances: object) -> tuple[Tensor, Tensor]:
    """Validate predictive means and variances of S draws, both (S, N) (or (S, N, 1))."""
    m = _draws(_tensor(means, "means"), "means")
    v = _draws(_tensor(variances, "variances"), "variances", m, "means")
    _nonneg(v, "variances", strict=False)
    return m, v


def gaussian_nll(mean: Tensor, var: Tensor, y: Tensor) -> float:
    """Mean negative log-likelihood of ``y`` under independent ``N(mean, var)``.

    Args:
        mean: predictive means, shape (N,) or (N, 1).
        var: predictive variances, strictly positive, shape (N,) or (N, 1).
        y: targets, shape (N,) or (N, 1).

    Returns:
        ``-1/N sum_n log N(y_n | mean_n, var_n)`` (``torch.distributions.Normal.log_prob``).
    """
    m, v, t = _mean_var_y(mean, var, y, "var")
    return float(-Normal(m, v.sqrt()).log_prob(t).mean())


def _moment_match(m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and variance over draws (dim 0) of an equal mixture; see `moment_match`."""
    return m.mean(dim=0), v.mean(dim=0) + m.var(dim=0, correction=0)


def moment_match(means: Tensor, variances: Tensor) -> tuple[Tensor, Tensor]:
    """Moment-match one Gaussian per point to an equally weighted mixture of S Gaussians.

    Subspace Inference, appendix G.1: ``mu = 1/S sum_s mu_s`` and
    ``var = 1/S sum_s (var_s + mu_s^2) - mu^2``, computed in the algebraically equal,
    cancellation-free form ``mean_s(var_s) + var_s(mu_s)`` (population variance over draws).

    Args:
        means: predictive means of S posterior draws, shape (S, N) or (S, N, 1).
        variances: their predictive variances, non-negative, same shape.

    Returns:
        ``(mu, var)``, each of shape (N,); ``var >= 0``.
    """
    m, v = _draws_pair(means, variances)
    return _moment_match(*_common(means=m, variances=v))


def moment_matched_gaussian_nll(means: Tensor, variances: Tensor, y: Tensor) -> float:
    """Gaussian NLL of ``y`` under the moment-matched predictive of Subspace Inference (app. G.1).

    Args:
        means: predictive means of S posterior draws, shape (S, N) or (S, N, 1).
        variances: their predictive variances, non-negative, same shape; the moment-matched
            variance of every point must be > 0.
        y: targets, shape (N,) or (N, 1).

    Returns:
        `gaussian_nll` of ``y`` under ``N(mu, var)`` from `moment_match`.
    """
    m, v = _draws_pair(means, variances)
    t = _vector(_tensor(y, "y", "real"), "y", m.shape[1], f"means (S, N) = {tuple(m.shape)}")
    m, v, t = _common(means=m, variances=v, y=t)
    mu, var = _moment_match(m, v)
    if bool((var <= 0).any()):
        raise ValueError(
            f"variances: moment-matched variance is 0 at {int((var <= 0).sum())} point(s) (all "
            "draws noise-free and identical there); include observation noise in variances"
        )
    return float(-Normal(mu, var.sqrt()).log_prob(t).mean())


def mixture_gaussian_nll(means: Tensor, variances: Tensor, y: Tensor) -> float:
    """NLL of the Bayesian model average: an equally weighted mixture of S Gaussians per point.

    ``-1/N sum_n log(1/S sum_s N(y_n | means[s, n], variances[s, n]))``, computed with
    ``torch.logsumexp`` (Subspace Inference, appendix G.1, the estimator it contrasts with).

    Args:
        means: predictive means of S posterior draws, shape (S, N) or (S, N, 1).
        variances: their predictive variances, strictly positive, same shape.
        y: targets, shape (N,) or (N, 1).

    Returns:
        The mean mixture NLL over the N points.
    """
    m, v = _draws_pair(means, variances)
    t = _vector(_tensor(y, "y", "real"), "y", m.shape[1], f"means (S, N) = {tuple(m.shape)}")
    _nonneg(v, "variances", strict=True)
    m, v, t = _common(means=m, variances=v, y=t)
    log_p = Normal(m, v.sqrt()).log_prob(t)  # shape (S, N)
    return float(-(torch.logsumexp(log_p, dim=0) - math.log(m.shape[0])).mean())


def rmse(pred: Tensor, y: Tensor) -> float:
    """Root mean squared error ``sqrt(1/N sum_n (pred_n - y_n)^2)``; pred, y: (N,) or (N, 1)."""
    p = _vector(_tensor(pred, "pred"), "pred")
    t = _vector(_tensor(y, "y", "real"), "y", p.shape[0], f"pred (N,) = ({p.shape[0]},)")
    p, t = _common(pred=p, y=t)
    return float((p - t).square().mean().sqrt())


def gaussian_interval(mean: Tensor, std: Tensor, level: float = 0.95) -> tuple[Tensor, Tensor]:
    """Central ``level`` interval ``mean ± z std`` with ``z`` = standard ``Normal.icdf((1+level)/2)``.

    Args:
        mean: predictive means, shape (N,) or (N, 1).
        std: predictive standard deviations, non-negative, shape (N,) or (N, 1).
        level: probability mass of the interval, in (0, 1).

    Returns:
        ``(lower, upper)``, each of shape (N,).
    """
    lvl = _level(level)
    m = _vector(_tensor(mean, "mean"), "mean")
    s = _vector(_tensor(std, "std"), "std", m.shape[0], f"mean (N,) = ({m.shape[0]},)")
    _nonneg(s, "std", strict=False)
    m, s = _common(mean=m, std=s)
    z = Normal(0.0, 1.0).icdf(torch.tensor((1 + lvl) / 2, dtype=m.dtype, device=m.device))
    return m - z * s, m + z * s


def interval_coverage(y: Tensor, lower: Tensor, upper: Tensor) -> float:
    """Fraction of points with ``lower <= y <= upper``; all (N,) or (N, 1), ``lower <= upper``."""
    t = _vector(_tensor(y, "y", "real"), "y")
    ref = f"y (N,) = ({t.shape[0]},)"
    lo = _vector(_tensor(lower, "lower"), "lower", t.shape[0], ref)
    hi = _vector(_tensor(upper, "upper"), "upper", t.shape[0], ref)
    t, lo, hi = _common(y=t, lower=lo, upper=hi)
    if bool((lo > hi).any()):
        raise ValueError(
            f"lower: expected lower <= upper, violated at {int((lo > hi).sum())} points"
        )
    return float(((t >= lo) & (t <= hi)).to(t.dtype).mean())


def sample_interval(samples: Tensor, level: float = 0.95) -> tuple[Tensor, Tensor]:
    """Empirical central ``level`` interval per point from predictive samples (``torch.quantile``).

    Args:
        samples: S predictive draws, shape (S, N) or (S, N, 1).
        level: probability mass of the interval, in (0, 1).

    Returns:
        ``(lower, upper)``, the ``(1-level)/2`` and ``(1+level)/2`` linearly interpolated sample
        quantiles over draws, each of shape (N,).
    """
    lvl = _level(level)
    (s,) = _common(samples=_draws(_tensor(samples, "samples"), "samples"))
    q = torch.tensor([(1 - lvl) / 2, (1 + lvl) / 2], dtype=s.dtype, device=s.device)
    lo, hi = torch.quantile(s, q, dim=0)
    return lo, hi


def categorical_nll(probs: Tensor, y: Tensor) -> float:
    """Mean ``-log probs[n, y_n]``, with probabilities clamped to at least `PROB_EPS` (1e-12).

    Args:
        probs: predictive class probabilities, shape (N, C), rows summing to 1.
        y: integer labels in [0, C), shape (N,) or (N, 1).
    """
    p, t = _classification(probs, y)
    return float(-p.gather(1, t[:, None]).clamp_min(PROB_EPS).log().mean())


def accuracy(probs: Tensor, y: Tensor) -> float:
    """Fraction of points whose ``argmax`` class (the first on ties) equals the label.

    Args:
        probs: predictive class probabilities, shape (N, C), rows summing to 1.
        y: integer labels in [0, C), shape (N,) or (N, 1).
    """
    p, t = _classification(probs, y)
    return float((p.argmax(dim=1) == t).to(p.dtype).mean())


def _bin_stats(p: Tensor, t: Tensor, n_bins: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin sums of confidence and correctness and counts, bins ``((r-1)/R, r/R]``."""
    conf = p.max(dim=1).values
    correct = (p.argmax(dim=1) == t).to(p.dtype)
    edges = (torch.arange(1, n_bins, dtype=torch.float64) / n_bins).to(p.dtype).to(p.device)
    idx = torch.bucketize(conf, edges)  # edges[i-1] < conf <= edges[i]; conf = 0 goes to bin 1
    sums = torch.zeros(2, n_bins, dtype=p.dtype, device=p.device)
    sums[0].index_add_(0, idx, conf)
    sums[1].index_add_(0, idx, correct)
    return sums[0], sums[1], torch.bincount(idx, minlength=n_bins)


def calibration_errors(
    probs: Tensor, y: Tensor, n_bins: int = 20, min_count: int = 5
) -> tuple[float, float]:
    """Expected and maximum calibration error (Ensemble Model Patching, appendix D.2, eq. 27).

    Confidence is the maximum probability; bin ``r`` holds points with confidence in
    ``((r-1)/n_bins, r/n_bins]`` (confidence 0 goes to bin 1). Bins with at most ``min_count``
    points are dropped (the paper removes bins with at most 5 samples). Then
    ``ECE = sum_r |B_r|/n |acc(B_r) - conf(B_r)|`` over kept bins, with ``n`` the total number of
    points N (dropped points included), and ``MCE = max_r |acc(B_r) - conf(B_r)|`` over kept bins.

    Args:
        probs: predictive class probabilities, shape (N, C), rows summing to 1.
        y: integer labels in [0, C), shape (N,) or (N, 1).
        n_bins: number of equal-width confidence bins.
        min_count: bins with ``count <= min_count`` are ignored.

    Returns:
        ``(ece, mce)``. Raises ``ValueError`` when every bin is dropped.
    """
    n_bins, min_count = _int(n_bins, "n_bins", 1), _int(min_count, "min_count", 0)
    p, t = _classification(probs, y)
    conf_sum, acc_sum, count = _bin_stats(p, t, n_bins)
    keep = count > min_count
    if not bool(keep.any()):
        raise ValueError(
            f"probs: all {n_bins} bins hold at most min_count={min_count} of the N={p.shape[0]} "
            "points; use more points, fewer bins or a lower min_count"
        )
    gap = (acc_sum[keep] - conf_sum[keep]).abs() / count[keep]
    return float((count[keep] * gap).sum() / p.shape[0]), float(gap.max())


def reliability_diagram_data(
    probs: Tensor, y: Tensor, n_bins: int = 20
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin mean confidence, accuracy and count for a reliability diagram.

    Bins as in `calibration_errors`, none dropped.

    Args:
        probs: predictive class probabilities, shape (N, C), rows summing to 1.
        y: integer labels in [0, C), shape (N,) or (N, 1).
        n_bins: number of equal-width confidence bins.

    Returns:
        ``(confidence, accuracy, count)``, each of shape (n_bins,); confidence and accuracy are
        NaN for empty bins (matplotlib skips them), count is int64.
    """
    n_bins = _int(n_bins, "n_bins", 1)
    conf_sum, acc_sum, count = _bin_stats(*_classification(probs, y), n_bins)
    denom = count.to(conf_sum.dtype)  # 0 / 0 = NaN marks empty bins
    return conf_sum / denom, acc_sum / denom, count


def brier_score(probs: Tensor, y: Tensor) -> float:
    """Mean over points of ``sum_c (probs[n, c] - onehot(y_n)_c)^2``.

    Args:
        probs: predictive class probabilities, shape (N, C), rows summing to 1.
        y: integer labels in [0, C), shape (N,) or (N, 1).
    """
    p, t = _classification(probs, y)
    onehot = torch.nn.functional.one_hot(t, p.shape[1]).to(p.dtype)
    return float((p - onehot).square().sum(dim=1).mean())


def mmc(probs: Tensor) -> float:
    """Mean maximum confidence ``1/N sum_n max_c probs[n, c]``; probs: (N, C), rows sum to 1."""
    return float(_probs(probs).max(dim=1).values.mean())


def ood_auroc(probs_in: Tensor, probs_out: Tensor) -> float:
    """AUROC for telling out-of-distribution from in-distribution points by ``1 - max_c p_c``.

    OOD points are the positive class; ``sklearn.metrics.roc_auc_score`` does the work (ties
    count one half), as in Mixtures of Laplace Approximations.

    Args:
        probs_in: predictive probabilities on in-distribution points, shape (N, C).
        probs_out: predictive probabilities on OOD points, shape (M, C), same C.

    Returns:
        AUROC in [0, 1]; 1 means every OOD point is less confident than every in-distribution one.
    """
    p_in, p_out = _probs(probs_in, "probs_in"), _probs(probs_out, "probs_out")
    if p_out.shape[1] != p_in.shape[1]:
        raise ValueError(
            f"probs_out: expected shape (M, C) with C = {p_in.shape[1]} as in probs_in, "
            f"got {tuple(p_out.shape)}"
        )
    scores = torch.cat([1 - p_in.max(dim=1).values, 1 - p_out.max(dim=1).values.to(p_in)])
    labels = torch.cat([torch.zeros(p_in.shape[0]), torch.ones(p_out.shape[0])])
    return float(roc_auc_score(labels.numpy(), scores.detach().cpu().double().numpy()))
