"""Metrics for regression and classification predictives, and for out-of-distribution detection.

Regression: Gaussian NLL, the moment-matched Gaussian NLL of Subspace Inference (Izmailov et al.,
2019, appendix G.1), the Bayesian-model-average mixture NLL, RMSE, predictive intervals and their
coverage. Classification: NLL, accuracy, ECE/MCE over 20 bins as in Ensemble Model Patching (Chang
et al., appendix D.2, eq. 27), Brier score, and the OOD metrics of Mixtures of Laplace
Approximations (Eschenhagen et al.): mean maximum confidence (MMC) and AUROC.

Inputs are torch tensors of any floating dtype on one device (half precision is upcast to float32
for the computation); scalar metrics come back as Python floats. Single-output regression inputs
may be ``(N,)`` or ``(N, 1)``: both are read as ``(N,)``, never broadcast to ``(N, N)``; likewise
draws ``(S, N)`` or ``(S, N, 1)``. Classification takes ``probs`` of shape ``(N, C)`` (entries in
[0, 1], rows summing to 1 within ``max(1e-3, C * eps(dtype))``) and integer labels ``y`` of shape
``(N,)`` or ``(N, 1)`` in ``[0, C)`` (whole-number floats pass; a fraction is an error, never
truncated: `validation.check_labels`, as for training targets). Every function validates its input
before any work and raises ``TypeError``/``ValueError`` naming the offending argument.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributions import Normal

from . import rng
from .validation import check_int, check_labels, probability

#: `categorical_nll` clamps probabilities to at least this before the log, so a zero probability
#: of the true class costs ``-log(1e-12) ≈ 27.6`` nats instead of ``inf``.
PROB_EPS = 1e-12

#: layout name -> (number of dims, whether a trailing singleton dim is dropped, description)
_LAYOUTS = {
    "N": (1, True, "(N,) or (N, 1)"),
    "SN": (2, True, "(S, N) or (S, N, 1)"),
    "NC": (2, False, "(N, C)"),
}


def _shaped(
    x: object, name: str, layout: str, kind: str = "float", like: tuple | None = None, ref: str = ""
) -> Tensor:
    """Check ``x`` is a non-empty finite tensor of ``kind`` ("float", "real", "int") in ``layout``
    (see `_LAYOUTS`) and, if given, of shape ``like`` (described by ``ref``); return it squeezed."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    bad_kind = {
        "float": not x.is_floating_point(),
        "real": x.is_complex() or x.dtype == torch.bool,
        "int": x.is_floating_point() or x.is_complex() or x.dtype == torch.bool,
        "label": x.is_complex(),  # integers, bools, whole-number floats: `check_labels`
    }[kind]
    if bad_kind:
        what = "integer class labels" if kind in ("int", "label") else f"a {kind}-valued tensor"
        raise TypeError(f"{name}: expected {what}, got dtype {x.dtype}")
    ndim, squeeze, desc = _LAYOUTS[layout]
    v = x[..., 0] if squeeze and x.dim() == ndim + 1 and x.shape[-1] == 1 else x
    if v.dim() != ndim or (like is not None and tuple(v.shape) != tuple(like)):
        match = f" matching {ref}" if like is not None else ""
        raise ValueError(f"{name}: expected shape {desc}{match}, got {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name}: expected at least one point, got shape {tuple(x.shape)}")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: expected finite values, found NaN or inf")
    return v


def _positive(x: Tensor, name: str, strict: bool) -> None:
    """Raise unless ``x > 0`` (``strict``) or ``x >= 0`` everywhere."""
    if bool((x <= 0).any() if strict else (x < 0).any()):
        what = "strictly positive" if strict else "non-negative"
        raise ValueError(f"{name}: expected {what} values, got minimum {float(x.min()):.3g}")


def _common(**tensors: Tensor) -> list[Tensor]:
    """Check all tensors share the first one's device; cast them to one float dtype (>= float32)."""
    (first_name, first), dtype = next(iter(tensors.items())), torch.float32
    for name, t in tensors.items():
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected {first_name}'s device {first.device}, got {t.device}"
            )
        dtype = torch.promote_types(dtype, t.dtype) if t.is_floating_point() else dtype
    return [t.to(dtype) for t in tensors.values()]


def _vectors(**xs: object) -> list[Tensor]:
    """Validate ``(N,)``/``(N, 1)`` inputs (N from the first; ``y`` may be integer) as ``(N,)``."""
    (name0, x0), *rest = xs.items()
    first = _shaped(x0, name0, "N")
    ref = f"{name0} (N,) = {tuple(first.shape)}"
    out = [_shaped(x, n, "N", "real" if n == "y" else "float", first.shape, ref) for n, x in rest]
    return _common(**dict(zip(xs, [first, *out])))


def _mixture(means: object, variances: object, y: object, strict: bool) -> list[Tensor]:
    """Validate S draws of means and variances (S, N) and, unless ``y`` is None, targets (N,)."""
    m = _shaped(means, "means", "SN")
    ref = f"means (S, N) = {tuple(m.shape)}"
    v = _shaped(variances, "variances", "SN", like=m.shape, ref=ref)
    _positive(v, "variances", strict)
    if y is None:
        return _common(means=m, variances=v)
    return _common(means=m, variances=v, y=_shaped(y, "y", "N", "real", m.shape[1:], ref))


def _level(level: object) -> float:
    """Check a central-interval probability mass lies in the open interval (0, 1)."""
    probability(level, "level")
    return float(level)


def _int(value: object, name: str, minimum: int) -> int:
    """Check ``value`` is an int >= ``minimum``."""
    check_int(value, name, minimum)
    return value


def _probs(probs: object, name: str = "probs") -> Tensor:
    """Validate class probabilities (N, C) and return them in a dtype of at least float32."""
    p = _shaped(probs, name, "NC")
    if bool(((p < 0) | (p > 1)).any()):
        lo, hi = float(p.min()), float(p.max())
        raise ValueError(f"{name}: expected probabilities in [0, 1], got values in [{lo}, {hi}]")
    atol = max(1e-3, p.shape[1] * torch.finfo(p.dtype).eps)  # rounding of C stored entries
    p = p.to(torch.promote_types(p.dtype, torch.float32))
    dev = float((p.sum(dim=1) - 1).abs().max())
    if dev > atol:
        raise ValueError(f"{name}: expected rows summing to 1 (atol {atol:.1e}), off by {dev:.3g}")
    return p


def _classification(probs: object, y: object) -> tuple[Tensor, Tensor]:
    """Validate probs (N, C) and labels y (N,) or (N, 1) in [0, C); return (probs, y as long)."""
    p = _probs(probs)
    n, c = p.shape
    t = _shaped(y, "y", "N", "label", (n,), f"probs (N, C) = {(n, c)}")
    if t.device != p.device:
        raise ValueError(f"y: expected probs' device {p.device}, got {t.device}")
    return p, check_labels(t, "y", c, why=f" for probs with C = {c} columns")


def gaussian_nll(mean: Tensor, var: Tensor, y: Tensor) -> float:
    """Mean negative log-likelihood of ``y`` under independent ``N(mean, var)``.

    Args:
        mean: predictive means, shape (N,) or (N, 1).
        var: predictive variances, strictly positive, shape (N,) or (N, 1).
        y: targets, shape (N,) or (N, 1).
    Returns:
        ``-1/N sum_n log N(y_n | mean_n, var_n)``, via ``torch.distributions.Normal.log_prob``.
    """
    m, v, t = _vectors(mean=mean, var=var, y=y)
    _positive(v, "var", strict=True)
    return float(-Normal(m, v.sqrt()).log_prob(t).mean())


def _moment_match(m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and variance of equal mixtures over dim 0; see `moment_match`."""
    return m.mean(dim=0), v.mean(dim=0) + m.var(dim=0, correction=0)


def moment_match(means: Tensor, variances: Tensor) -> tuple[Tensor, Tensor]:
    """Moment-match one Gaussian per point to the equal mixture of S Gaussian predictives.

    Subspace Inference, appendix G.1: ``mu = 1/S sum_s mu_s`` and ``var = 1/S sum_s (var_s +
    mu_s^2) - mu^2``, computed as the algebraically equal, cancellation-free
    ``mean_s(var_s) + popvar_s(mu_s)``.

    Args:
        means: predictive means of S posterior draws, shape (S, N) or (S, N, 1).
        variances: their predictive variances, non-negative, same shape.
    Returns:
        ``(mu, var)``, each of shape (N,), ``var >= 0``.
    """
    return _moment_match(*_mixture(means, variances, None, strict=False))


def moment_matched_gaussian_nll(means: Tensor, variances: Tensor, y: Tensor) -> float:
    """Gaussian NLL of ``y`` under the moment-matched predictive (Subspace Inference, app. G.1).

    Args:
        means: predictive means of S posterior draws, shape (S, N) or (S, N, 1).
        variances: their predictive variances, non-negative, same shape; the moment-matched
            variance (see `moment_match`) must be > 0 at every point.
        y: targets, shape (N,) or (N, 1).
    Returns:
        `gaussian_nll` of ``y`` under ``N(mu, var)``.
    """
    m, v, t = _mixture(means, variances, y, strict=False)
    mu, var = _moment_match(m, v)
    if bool((var <= 0).any()):
        raise ValueError(
            f"variances: the moment-matched variance is 0 at {int((var <= 0).sum())} point(s) "
            "(noise-free, identical draws there); include observation noise in variances"
        )
    return float(-Normal(mu, var.sqrt()).log_prob(t).mean())


def mixture_gaussian_nll(means: Tensor, variances: Tensor, y: Tensor) -> float:
    """NLL of the Bayesian model average, an equal mixture of S Gaussians per point.

    ``-1/N sum_n log(1/S sum_s N(y_n | means[s, n], variances[s, n]))`` with ``torch.logsumexp``;
    the estimator Subspace Inference (app. G.1) contrasts with moment matching.

    Args:
        means: predictive means of S posterior draws, shape (S, N) or (S, N, 1).
        variances: their predictive variances, strictly positive, same shape.
        y: targets, shape (N,) or (N, 1).
    Returns:
        The mixture NLL averaged over the N points.
    """
    m, v, t = _mixture(means, variances, y, strict=True)
    log_p = Normal(m, v.sqrt()).log_prob(t)  # shape (S, N)
    return float(-(torch.logsumexp(log_p, dim=0) - math.log(m.shape[0])).mean())


def rmse(pred: Tensor, y: Tensor) -> float:
    """Root mean squared error ``sqrt(1/N sum_n (pred_n - y_n)^2)``.

    Args:
        pred: point predictions, shape (N,) or (N, 1); y: targets, shape (N,) or (N, 1).
    Returns:
        The RMSE.
    """
    p, t = _vectors(pred=pred, y=y)
    return float((p - t).square().mean().sqrt())


def gaussian_interval(mean: Tensor, std: Tensor, level: float = 0.95) -> tuple[Tensor, Tensor]:
    """Central ``level`` interval ``mean ± z std``, ``z`` the standard ``Normal.icdf((1+level)/2)``.

    Args:
        mean: predictive means, shape (N,) or (N, 1).
        std: predictive standard deviations, non-negative, shape (N,) or (N, 1).
        level: probability mass of the interval, in (0, 1).
    Returns:
        ``(lower, upper)``, each of shape (N,).
    """
    lvl = _level(level)
    m, s = _vectors(mean=mean, std=std)
    _positive(s, "std", strict=False)
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    z = Normal(zero, zero + 1).icdf(zero + (1 + lvl) / 2)
    return m - z * s, m + z * s


def interval_coverage(y: Tensor, lower: Tensor, upper: Tensor) -> float:
    """Fraction of points with ``lower <= y <= upper``.

    Args:
        y: targets, shape (N,) or (N, 1).
        lower, upper: interval ends with ``lower <= upper``, shape (N,) or (N, 1).
    Returns:
        The empirical coverage in [0, 1].
    """
    t, lo, hi = _vectors(y=y, lower=lower, upper=upper)
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
        ``(lower, upper)``: the ``(1-level)/2`` and ``(1+level)/2`` sample quantiles over draws
        (linear interpolation), each of shape (N,).
    """
    lvl = _level(level)
    (s,) = _common(samples=_shaped(samples, "samples", "SN"))
    q = torch.tensor([(1 - lvl) / 2, (1 + lvl) / 2], dtype=s.dtype, device=s.device)
    lo, hi = torch.quantile(s, q, dim=0)
    return lo, hi


def categorical_nll(probs: Tensor, y: Tensor) -> float:
    """Mean ``-log probs[n, y_n]``, probabilities clamped to at least `PROB_EPS` = 1e-12.

    Args:
        probs: class probabilities, shape (N, C); y: integer labels, shape (N,) or (N, 1).
    Returns:
        The mean NLL, finite even where the true class has probability 0.
    """
    p, t = _classification(probs, y)
    return float(-p.gather(1, t[:, None]).clamp_min(PROB_EPS).log().mean())


def accuracy(probs: Tensor, y: Tensor) -> float:
    """Fraction of points whose ``argmax`` class (the first on ties) equals the label.

    Args:
        probs: class probabilities, shape (N, C); y: integer labels, shape (N,) or (N, 1).
    Returns:
        The accuracy in [0, 1].
    """
    p, t = _classification(probs, y)
    return float((p.argmax(dim=1) == t).to(p.dtype).mean())


def _bin_stats(
    p: Tensor, t: Tensor, n_bins: int, input_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin sums of confidence and of correctness, and counts; bin r is ((r-1)/R, r/R].

    The edges r/R are rounded to the input dtype of probs, so a stored 0.6 is in (0.55, 0.6].
    """
    conf, correct = p.max(dim=1).values, (p.argmax(dim=1) == t).to(p.dtype)
    edges = torch.arange(1, n_bins, dtype=torch.float64) / n_bins
    edges = edges.to(input_dtype).to(p.device, p.dtype)
    idx = torch.bucketize(conf, edges)  # edges[i-1] < conf <= edges[i]; conf = 0 goes to bin 1
    sums = torch.zeros(2, n_bins, dtype=p.dtype, device=p.device)
    sums[0].index_add_(0, idx, conf)
    sums[1].index_add_(0, idx, correct)
    return sums[0], sums[1], torch.bincount(idx, minlength=n_bins)


def calibration_errors(
    probs: Tensor, y: Tensor, n_bins: int = 20, min_count: int = 5
) -> tuple[float, float]:
    """Expected and maximum calibration error (Ensemble Model Patching, appendix D.2, eq. 27).

    Confidence is the maximum probability, prediction its argmax. Bin ``r`` holds the points with
    confidence in ``((r-1)/n_bins, r/n_bins]`` (confidence 0 joins bin 1). Bins with at most
    ``min_count`` points are dropped, as the paper drops bins with at most 5 samples. Then
    ``ECE = sum_r |B_r|/n |acc(B_r) - conf(B_r)|`` over kept bins, where ``n`` is the total number
    of points N (points in dropped bins included), and ``MCE = max_r |acc(B_r) - conf(B_r)|``.

    Args:
        probs: class probabilities, shape (N, C); y: integer labels, shape (N,) or (N, 1).
        n_bins: number of equal-width confidence bins; min_count: drop bins with this many or fewer.
    Returns:
        ``(ece, mce)``; raises ``ValueError`` if every bin is dropped.
    """
    n_bins, min_count = _int(n_bins, "n_bins", 1), _int(min_count, "min_count", 0)
    p, t = _classification(probs, y)
    conf_sum, acc_sum, count = _bin_stats(p, t, n_bins, probs.dtype)
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
        probs: class probabilities, shape (N, C); y: integer labels, shape (N,) or (N, 1).
        n_bins: number of equal-width confidence bins.
    Returns:
        ``(confidence, accuracy, count)``, each of shape (n_bins,); confidence and accuracy are
        NaN for empty bins (matplotlib leaves them out); count is int64.
    """
    n_bins = _int(n_bins, "n_bins", 1)
    conf_sum, acc_sum, count = _bin_stats(*_classification(probs, y), n_bins, probs.dtype)
    denom = count.to(conf_sum.dtype)  # 0 / 0 = NaN marks an empty bin
    return conf_sum / denom, acc_sum / denom, count


def brier_score(probs: Tensor, y: Tensor) -> float:
    """Mean over points of ``sum_c (probs[n, c] - onehot(y_n)_c)^2``.

    Args:
        probs: class probabilities, shape (N, C); y: integer labels, shape (N,) or (N, 1).
    Returns:
        The Brier score in [0, 2].
    """
    p, t = _classification(probs, y)
    onehot = torch.nn.functional.one_hot(t, p.shape[1]).to(p.dtype)
    return float((p - onehot).square().sum(dim=1).mean())


def mmc(probs: Tensor) -> float:
    """Mean maximum confidence ``1/N sum_n max_c probs[n, c]`` (Mixtures of Laplace, OOD metric).

    Args:
        probs: class probabilities, shape (N, C).
    Returns:
        The MMC in [1/C, 1].
    """
    return float(_probs(probs).max(dim=1).values.mean())


def ood_auroc(probs_in: Tensor, probs_out: Tensor) -> float:
    """AUROC of telling out-of-distribution from in-distribution points by ``1 - max_c p_c``.

    OOD points are the positive class; ``sklearn.metrics.roc_auc_score`` does the work (ties count
    one half), as in Mixtures of Laplace Approximations.

    Args:
        probs_in: class probabilities on in-distribution points, shape (N, C).
        probs_out: class probabilities on OOD points, shape (M, C), the same C.
    Returns:
        AUROC in [0, 1]; 1 when every OOD point is less confident than every in-distribution one.
    """
    p_in, p_out = _probs(probs_in, "probs_in"), _probs(probs_out, "probs_out")
    if p_out.shape[1] != p_in.shape[1]:
        raise ValueError(
            f"probs_out: expected shape (M, C) with probs_in's C = {p_in.shape[1]}, "
            f"got {tuple(p_out.shape)}"
        )
    scores = [1 - p.max(dim=1).values.detach().cpu().double() for p in (p_in, p_out)]
    labels = torch.cat([torch.zeros(p_in.shape[0]), torch.ones(p_out.shape[0])])
    roc_auc_score = rng.import_keeping_state("sklearn.metrics").roc_auc_score  # on first use

    return float(roc_auc_score(labels.numpy(), torch.cat(scores).numpy()))


def regression_scores(means: Tensor, variances: Tensor, y: Tensor, level: float = 0.95) -> dict:
    """Test NLL, RMSE and interval coverage of a Gaussian posterior predictive from draws.

    Args:
        means, variances: per-draw predictive means and noise variances, shape ``(S, N)``.
        y: targets ``(N,)``.
        level: central interval level for the coverage.

    Returns:
        A dict with keys ``nll`` (the mixture, i.e. Bayesian model average, NLL),
        ``nll_moment_matched`` (the paper's G.1 version: the NLL of one Gaussian with the
        mixture's mean and variance), ``rmse`` (of the moment-matched mean) and ``coverage95``
        (fraction of ``y`` inside the moment-matched Gaussian's central interval; the key says
        95 whatever ``level``).
    """
    mu, var = moment_match(means, variances)
    lower, upper = gaussian_interval(mu, var.sqrt(), level)
    return {
        "nll": mixture_gaussian_nll(means, variances, y),
        "nll_moment_matched": moment_matched_gaussian_nll(means, variances, y),
        "rmse": rmse(mu, y),
        "coverage95": interval_coverage(y, lower, upper),
    }


def classification_scores(
    probs: Tensor, y: Tensor, n_bins: int = 20, min_count: int = 5
) -> dict[str, float]:
    """Accuracy, NLL, ECE and MCE of predictive class probabilities (Ensemble Model Patching,
    appendix D.2: 20 bins, bins of ``<= min_count`` points left out of ECE and MCE).

    Args:
        probs: predictive probabilities ``(N, C)``; y: class indices ``(N,)``.
        n_bins, min_count: as in `calibration_errors`.

    Returns:
        ``{"acc", "nll", "ece", "mce"}`` as floats.
    """
    ece, mce = calibration_errors(probs, y, n_bins=n_bins, min_count=min_count)
    return {"acc": accuracy(probs, y), "nll": categorical_nll(probs, y), "ece": ece, "mce": mce}
