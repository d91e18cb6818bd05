"""Tests for `pyro_subspace.metrics`: every number is checked against an independent computation
(scipy, numpy, brute-force Python loops, bins built by hand) or a Monte-Carlo target whose
tolerance is derived from its standard error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from pyro_subspace import metrics


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _t(x: np.ndarray, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=dtype)


# ----------------------------------------------------------------------------- regression


def test_gaussian_nll_matches_scipy():
    rng = _rng(1)
    mean, var = rng.normal(size=50), rng.uniform(0.1, 3.0, size=50)
    y = rng.normal(size=50) * 2
    expected = -stats.norm.logpdf(y, loc=mean, scale=np.sqrt(var)).mean()
    assert metrics.gaussian_nll(_t(mean), _t(var), _t(y)) == pytest.approx(expected, rel=1e-12)
    # (N, 1) inputs are read as (N,), never broadcast to (N, N)
    got = metrics.gaussian_nll(_t(mean)[:, None], _t(var), _t(y)[:, None])
    assert got == pytest.approx(expected, rel=1e-12)
    # float32 input: same number to float32 precision
    got32 = metrics.gaussian_nll(_t(mean, torch.float32), _t(var, torch.float32), _t(y))
    assert got32 == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    rng = _rng(2)
    mean, var, y = (
        _t(a, dtype) for a in (rng.normal(size=40), rng.uniform(0.5, 2, 40), rng.normal(size=40))
    )
    m, v, t = (a.double().numpy() for a in (mean, var, y))  # the values actually stored
    expected = -stats.norm.logpdf(t, loc=m, scale=np.sqrt(v)).mean()
    assert metrics.gaussian_nll(mean, var, y) == pytest.approx(expected, rel=1e-5)
    probs = torch.softmax(_t(rng.normal(size=(40, 3))), dim=1).to(dtype)
    labels = torch.as_tensor(rng.integers(0, 3, size=40))
    p = probs.double().numpy()
    assert metrics.brier_score(probs, labels) == pytest.approx(
        np.mean(np.sum((p - np.eye(3)[labels.numpy()]) ** 2, axis=1)), rel=1e-5
    )


def _mixture_params(s: int = 4, n: int = 3, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = _rng(seed)
    return rng.normal(scale=2.0, size=(s, n)), rng.uniform(0.2, 1.5, size=(s, n))


def test_moment_match_closed_form_and_monte_carlo():
    means, variances = _mixture_params()
    mu, var = metrics.moment_match(_t(means), _t(variances))
    assert mu.shape == var.shape == (3,)
    # paper G.1 formula, evaluated directly with numpy
    mu_np = means.mean(axis=0)
    var_np = (variances + means**2).mean(axis=0) - mu_np**2
    np.testing.assert_allclose(mu.numpy(), mu_np, rtol=1e-12)
    np.testing.assert_allclose(var.numpy(), var_np, rtol=1e-12)
    # a large sample from the equally weighted mixture has that mean and variance
    rng, n_draws = _rng(4), 400_000
    comp = rng.integers(0, means.shape[0], size=(n_draws, means.shape[1]))
    cols = np.arange(means.shape[1])
    draws = means[comp, cols] + np.sqrt(variances[comp, cols]) * rng.normal(size=comp.shape)
    sample_var = draws.var(axis=0)
    centred4 = ((draws - draws.mean(axis=0)) ** 4).mean(axis=0)
    se_mean = np.sqrt(sample_var / n_draws)
    se_var = np.sqrt((centred4 - sample_var**2) / n_draws)
    assert np.all(np.abs(draws.mean(axis=0) - mu.numpy()) < 4 * se_mean)
    assert np.all(np.abs(sample_var - var.numpy()) < 4 * se_var)
    # (S, N, 1) draws are accepted
    mu1, var1 = metrics.moment_match(_t(means)[..., None], _t(variances)[..., None])
    torch.testing.assert_close(mu1, mu)
    torch.testing.assert_close(var1, var)


def test_moment_matched_gaussian_nll_matches_scipy():
    means, variances = _mixture_params(s=5, n=30, seed=5)
    y = _rng(6).normal(size=30)
    mu = means.mean(axis=0)
    var = (variances + means**2).mean(axis=0) - mu**2
    expected = -stats.norm.logpdf(y, loc=mu, scale=np.sqrt(var)).mean()
    got = metrics.moment_matched_gaussian_nll(_t(means), _t(variances), _t(y)[:, None])
    assert got == pytest.approx(expected, rel=1e-12)
    # noise-free draws are fine as long as they disagree
    got0 = metrics.moment_matched_gaussian_nll(_t(means), torch.zeros(5, 30), _t(y))
    var0 = means.var(axis=0)
    assert got0 == pytest.approx(-stats.norm.logpdf(y, mu, np.sqrt(var0)).mean(), rel=1e-12)


def test_mixture_gaussian_nll_matches_brute_force_loop():
    means, variances = _mixture_params(s=6, n=20, seed=7)
    y = _rng(8).normal(size=20) * 2
    total = 0.0
    for n in range(20):
        dens = 0.0
        for s in range(6):
            m, v = means[s, n], variances[s, n]
            dens += math.exp(-((y[n] - m) ** 2) / (2 * v)) / math.sqrt(2 * math.pi * v)
        total += -math.log(dens / 6)
    got = metrics.mixture_gaussian_nll(_t(means), _t(variances), _t(y))
    assert got == pytest.approx(total / 20, rel=1e-12)
    # one draw: the mixture is that Gaussian
    one = metrics.mixture_gaussian_nll(_t(means[:1]), _t(variances[:1]), _t(y))
    assert one == pytest.approx(metrics.gaussian_nll(_t(means[0]), _t(variances[0]), _t(y)))


def test_mixture_gaussian_nll_is_stable_far_in_the_tails():
    means = np.array([[100.0], [101.0], [99.0]])
    variances = np.full((3, 1), 0.01)
    y = np.array([0.0])  # every density underflows to 0 in float64
    assert np.all(stats.norm.pdf(y, means, np.sqrt(variances)) == 0)
    expected = -(np.logaddexp.reduce(stats.norm.logpdf(y, means, np.sqrt(variances))) - np.log(3))
    got = metrics.mixture_gaussian_nll(_t(means), _t(variances), _t(y))
    assert math.isfinite(got) and got == pytest.approx(expected[0], rel=1e-12)


def test_rmse_matches_numpy_and_does_not_broadcast():
    rng = _rng(9)
    pred, y = rng.normal(size=64), rng.normal(size=64)
    expected = np.sqrt(np.mean((pred - y) ** 2))
    for p, t in [(_t(pred), _t(y)), (_t(pred), _t(y)[:, None]), (_t(pred)[:, None], _t(y))]:
        assert metrics.rmse(p, t) == pytest.approx(expected, rel=1e-12)
    # integer targets are allowed
    assert metrics.rmse(torch.zeros(3), torch.tensor([3, 0, 0])) == pytest.approx(math.sqrt(3))


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95])
def test_gaussian_interval_matches_scipy_and_covers_at_level(level):
    rng, n = _rng(10), 200_000
    mean, std = rng.normal(size=n), rng.uniform(0.1, 3.0, size=n)
    lower, upper = metrics.gaussian_interval(_t(mean), _t(std)[:, None], level=level)
    lo_np, hi_np = stats.norm.interval(level, loc=mean, scale=std)
    np.testing.assert_allclose(lower.numpy(), lo_np, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(upper.numpy(), hi_np, rtol=1e-10, atol=1e-10)
    y = mean + std * rng.normal(size=n)
    coverage = metrics.interval_coverage(_t(y), lower, upper)
    assert abs(coverage - level) < 4 * math.sqrt(level * (1 - level) / n)


def test_interval_coverage_counts_ends_as_inside():
    y = torch.tensor([0.0, 1.0, 2.0, 3.0, -1.0])
    lower = torch.tensor([0.0, 0.0, 2.5, 0.0, 0.0])
    upper = torch.tensor([1.0, 1.0, 3.0, 2.0, 0.0])
    expected = sum(lo <= t <= hi for t, lo, hi in zip(y.tolist(), lower.tolist(), upper.tolist()))
    assert metrics.interval_coverage(y[:, None], lower, upper) == pytest.approx(expected / 5)
    assert expected == 2


def test_sample_interval_matches_numpy_quantile_and_normal_interval():
    rng = _rng(11)
    samples = rng.standard_t(df=4, size=(501, 7))
    lower, upper = metrics.sample_interval(_t(samples)[..., None], level=0.8)
    np.testing.assert_allclose(lower.numpy(), np.quantile(samples, 0.1, axis=0), rtol=1e-12)
    np.testing.assert_allclose(upper.numpy(), np.quantile(samples, 0.9, axis=0), rtol=1e-12)
    # a large normal sample gives the Gaussian interval, within the quantile's standard error
    s = 100_000
    normal = _t(rng.normal(size=(s, 3)))
    lower, upper = metrics.sample_interval(normal, level=0.95)
    z = stats.norm.ppf(0.975)
    se = math.sqrt(0.025 * 0.975 / s) / stats.norm.pdf(z)
    assert torch.all((upper - z).abs() < 4 * se) and torch.all((lower + z).abs() < 4 * se)


# ------------------------------------------------------------------------- classification


def _random_probs(n: int, c: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = _rng(seed)
    logits = rng.normal(scale=2.0, size=(n, c))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return probs, rng.integers(0, c, size=n)


def test_categorical_nll_accuracy_brier_mmc_match_loops():
    probs, y = _random_probs(100, 4, seed=12)
    nll = acc = brier = conf = 0.0
    for i in range(100):
        nll -= math.log(probs[i, y[i]])
        acc += float(int(np.argmax(probs[i])) == y[i])
        brier += sum((probs[i, c] - float(c == y[i])) ** 2 for c in range(4))
        conf += max(probs[i])
    p, t = _t(probs), torch.as_tensor(y)
    assert metrics.categorical_nll(p, t) == pytest.approx(nll / 100, rel=1e-12)
    assert metrics.accuracy(p, t[:, None]) == pytest.approx(acc / 100)
    assert metrics.brier_score(p, t) == pytest.approx(brier / 100, rel=1e-12)
    assert metrics.mmc(p) == pytest.approx(conf / 100, rel=1e-12)


def test_categorical_nll_zero_probability_is_large_but_finite():
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    got = metrics.categorical_nll(probs, torch.tensor([1, 0]))
    assert got == pytest.approx((-math.log(metrics.PROB_EPS) + math.log(2)) / 2, rel=1e-5)


def test_accuracy_takes_the_first_class_on_ties():
    probs = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    assert metrics.accuracy(probs, torch.tensor([0, 1])) == 0.5


def _hand_example() -> tuple[np.ndarray, np.ndarray]:
    """3 classes, rows (p, (1-p)/2, (1-p)/2), so confidence p and prediction class 0."""
    groups = [  # (confidence, number of points, number correct)
        (0.34, 2, 1),  # bin 7: 2 points -> dropped
        (0.58, 6, 4),  # bin 12: 6 points -> kept
        (0.75, 3, 3),  # exactly on the 15/20 edge: belongs to bin 15 = (0.70, 0.75]
        (0.72, 4, 2),  # bin 15 as well: 7 points -> kept
        (0.78, 5, 1),  # bin 16: exactly 5 points -> dropped ("at most 5")
        (1.00, 6, 6),  # bin 20, conf exactly 1
    ]
    confs, labels = [], []
    for conf, count, correct in groups:
        confs += [conf] * count
        labels += [0] * correct + [1] * (count - correct)
    c = np.array(confs)
    return np.stack([c, (1 - c) / 2, (1 - c) / 2], axis=1), np.array(labels)


def _hand_bins(probs: np.ndarray, y: np.ndarray, n_bins: int) -> list[tuple[float, float, int]]:
    """(mean confidence, accuracy, count) per bin, built with an explicit loop over points."""
    out = []
    for r in range(1, n_bins + 1):
        members = [
            i
            for i in range(len(y))
            if (r - 1) / n_bins < probs[i].max() <= r / n_bins or (r == 1 and probs[i].max() == 0)
        ]
        if members:
            conf = sum(probs[i].max() for i in members) / len(members)
            acc = sum(float(np.argmax(probs[i]) == y[i]) for i in members) / len(members)
            out.append((conf, acc, len(members)))
        else:
            out.append((float("nan"), float("nan"), 0))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_calibration_errors_hand_example(dtype):
    probs, y = _hand_example()
    n = len(y)
    bins = _hand_bins(probs, y, 20)
    kept = [(c, a, k) for c, a, k in bins if k > 5]
    ece = sum(k / n * abs(a - c) for c, a, k in kept)
    mce = max(abs(a - c) for c, a, k in kept)
    # the same numbers by hand: bin 12 gives |4 - 6 * 0.58| = 0.52, bin 15 |5 - 5.13| = 0.13
    assert [k for _, _, k in kept] == [6, 7, 6]
    assert ece == pytest.approx((0.52 + 0.13) / 26) and mce == pytest.approx(0.52 / 6)
    got_ece, got_mce = metrics.calibration_errors(_t(probs, dtype), torch.as_tensor(y))
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert got_ece == pytest.approx(ece, abs=tol)
    assert got_mce == pytest.approx(mce, abs=tol)
    # keeping every bin changes the answer: the dropped bins really were dropped
    all_ece, _ = metrics.calibration_errors(_t(probs, dtype), torch.as_tensor(y), min_count=0)
    assert all_ece == pytest.approx(sum(k / n * abs(a - c) for c, a, k in bins if k), abs=tol)
    assert abs(all_ece - ece) > 0.01


def test_reliability_diagram_data_matches_hand_bins():
    probs, y = _hand_example()
    conf, acc, count = metrics.reliability_diagram_data(_t(probs), torch.as_tensor(y))
    bins = _hand_bins(probs, y, 20)
    assert count.tolist() == [k for _, _, k in bins] and count[14] == 7  # the 0.75 edge -> bin 15
    np.testing.assert_allclose(conf.numpy(), [c for c, _, _ in bins], rtol=1e-12)
    np.testing.assert_allclose(acc.numpy(), [a for _, a, _ in bins], rtol=1e-12)
    assert torch.isnan(conf[0]) and int(count.sum()) == len(y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_confidence_on_a_bin_edge_and_zero_confidence(dtype):
    # 0.6 = 12/20 is not exactly representable in any dtype; a stored 0.6 is still in bin 12 =
    # (0.55, 0.60], and 0.95 in bin 19 = (0.90, 0.95]
    probs = torch.tensor([[0.6, 0.4], [0.05, 0.95], [0.4, 0.6]], dtype=dtype)
    _, _, count = metrics.reliability_diagram_data(probs, torch.tensor([0, 1, 1]))
    assert count[11] == 2 and count[18] == 1 and count.sum() == 3
    # confidence 0 cannot come from valid probabilities; the binning still puts it in bin 1
    labels = torch.zeros(3, dtype=torch.long)
    _, _, count = metrics._bin_stats(torch.zeros(3, 2), labels, 20, torch.float32)
    assert count[0] == 3


def _synthetic(n: int, gap: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Confidence p ~ U(0.4, 1) on class 0; the label is 0 with probability p - gap."""
    rng = _rng(seed)
    p = rng.uniform(0.4, 1.0, size=n)
    correct = rng.uniform(size=n) < p - gap
    y = np.where(correct, 0, rng.integers(1, 3, size=n))
    return _t(np.stack([p, (1 - p) / 2, (1 - p) / 2], axis=1)), torch.as_tensor(y)


def test_calibration_errors_of_calibrated_and_overconfident_data():
    n, n_bins = 200_000, 20
    probs, y = _synthetic(n, gap=0.0, seed=13)
    ece, mce = metrics.calibration_errors(probs, y, n_bins=n_bins)
    counts = metrics.reliability_diagram_data(probs, y, n_bins)[2]
    occupied, min_count = int((counts > 0).sum()), int(counts[counts > 0].min())
    assert occupied == 12  # confidences in (0.4, 1]
    # Given the confidences, acc - conf in bin r has mean 0 and sd <= 0.5 / sqrt(n_r), so
    # E[ECE] <= sum_r n_r / n * 0.5 / sqrt(n_r) <= 0.5 * sqrt(occupied / n) (Cauchy-Schwarz);
    # MCE: 4.5 sd of the smallest bin, a union bound over the 12 occupied bins.
    ece_tol, mce_tol = 4 * 0.5 * math.sqrt(occupied / n), 4.5 * 0.5 / math.sqrt(min_count)
    assert ece < ece_tol and mce < mce_tol
    # labels correct 0.1 less often than stated: ECE and MCE are 0.1 (up to MC error)
    probs, y = _synthetic(n, gap=0.1, seed=14)
    ece, mce = metrics.calibration_errors(probs, y, n_bins=n_bins)
    assert abs(ece - 0.1) < ece_tol and abs(mce - 0.1) < mce_tol


def test_ood_auroc():
    rng = _rng(15)
    confident = np.tile([0.95, 0.05], (50, 1)) + rng.uniform(0, 0.04, size=(50, 1)) * [1, -1]
    unsure = np.tile([0.6, 0.4], (40, 1)) + rng.uniform(0, 0.04, size=(40, 1)) * [1, -1]
    assert metrics.ood_auroc(_t(confident), _t(unsure)) == 1.0
    assert metrics.ood_auroc(_t(unsure), _t(confident)) == 0.0
    # same distribution in and out: 0.5 up to the Mann-Whitney null standard deviation
    n_in, n_out = 5000, 4000
    p_in, _ = _random_probs(n_in, 3, seed=16)
    p_out, _ = _random_probs(n_out, 3, seed=17)
    sd = math.sqrt((n_in + n_out + 1) / (12 * n_in * n_out))
    assert abs(metrics.ood_auroc(_t(p_in), _t(p_out)) - 0.5) < 4 * sd
    # brute-force Mann-Whitney count on a small example with ties (a tie counts one half)
    a = np.array([[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.8, 0.2]])
    b = np.array([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    wins = sum(
        1.0 if 1 - j.max() > 1 - i.max() else 0.5 if j.max() == i.max() else 0.0
        for i in a
        for j in b
    )
    assert metrics.ood_auroc(_t(a), _t(b)) == pytest.approx(wins / (len(a) * len(b)))


# ------------------------------------------------------------------------ input validation

N = 100
GOOD = {"mean": torch.zeros(N), "var": torch.ones(N), "y": torch.zeros(N)}
PROBS = torch.full((N, 4), 0.25)
LABELS = torch.zeros(N, dtype=torch.long)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"y": torch.zeros(N, 3)},
            ValueError,
            r"y: expected shape \(N,\) or \(N, 1\) matching mean \(N,\) = \(100,\), got \(100, 3\)",
        ),
        ({"y": torch.zeros(1, N)}, ValueError, r"^y: expected shape"),
        ({"var": torch.ones(N - 1)}, ValueError, r"^var: expected shape .* got \(99,\)"),
        ({"mean": torch.zeros(N, 2)}, ValueError, r"^mean: expected shape"),
        ({"mean": torch.zeros(0)}, ValueError, r"^mean: expected at least one"),
        ({"mean": torch.full((N,), float("nan"))}, ValueError, r"^mean: expected finite"),
        ({"y": torch.full((N,), float("inf"))}, ValueError, r"^y: expected finite"),
        ({"var": -torch.ones(N)}, ValueError, r"^var: expected strictly positive"),
        ({"var": torch.zeros(N)}, ValueError, r"^var: expected strictly positive"),
        ({"mean": [0.0] * N}, TypeError, r"^mean: expected a torch.Tensor"),
        ({"mean": torch.zeros(N, dtype=torch.long)}, TypeError, r"^mean: expected a float"),
    ],
)
def test_gaussian_nll_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        metrics.gaussian_nll(**{**GOOD, **kwargs})


def test_draw_validation():
    m, v, y = torch.zeros(5, N), torch.ones(5, N), torch.zeros(N)
    with pytest.raises(ValueError, match=r"^variances: expected shape .* matching means"):
        metrics.moment_match(m, torch.ones(5, N + 1))
    with pytest.raises(ValueError, match=r"^means: expected shape \(S, N\)"):
        metrics.moment_match(torch.zeros(N), torch.ones(N))
    with pytest.raises(ValueError, match=r"^variances: expected non-negative"):
        metrics.moment_match(m, -v)
    with pytest.raises(ValueError, match=r"^y: expected shape .* matching means \(S, N\)"):
        metrics.mixture_gaussian_nll(m, v, torch.zeros(N + 1))
    with pytest.raises(ValueError, match=r"^y: expected shape"):
        metrics.moment_matched_gaussian_nll(m, v, torch.zeros(N, 2))
    with pytest.raises(ValueError, match=r"^variances: expected strictly positive"):
        metrics.mixture_gaussian_nll(m, torch.zeros(5, N), y)
    with pytest.raises(ValueError, match=r"^variances: the moment-matched variance is 0"):
        metrics.moment_matched_gaussian_nll(m, torch.zeros(5, N), y)
    with pytest.raises(ValueError, match=r"^means: expected finite"):
        metrics.mixture_gaussian_nll(m.index_fill(1, torch.tensor([3]), float("nan")), v, y)
    with pytest.raises(ValueError, match=r"^samples: expected finite"):
        metrics.sample_interval(torch.tensor([[0.0, float("nan")]]))


@pytest.mark.parametrize("level", [0, 1, 1.0, -0.1, 1.5, float("nan")])
def test_bad_level_value(level):
    with pytest.raises(ValueError, match=r"^level: expected a value in the open interval"):
        metrics.gaussian_interval(torch.zeros(3), torch.ones(3), level=level)
    with pytest.raises(ValueError, match=r"^level"):
        metrics.sample_interval(torch.zeros(10, 3), level=level)


@pytest.mark.parametrize("level", ["0.9", True, None])
def test_bad_level_type(level):
    with pytest.raises(TypeError, match=r"^level"):
        metrics.gaussian_interval(torch.zeros(3), torch.ones(3), level=level)


def test_interval_validation():
    with pytest.raises(ValueError, match=r"^std: expected non-negative"):
        metrics.gaussian_interval(torch.zeros(3), -torch.ones(3))
    with pytest.raises(ValueError, match=r"^std: expected shape .* matching mean"):
        metrics.gaussian_interval(torch.zeros(3), torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"^lower: expected lower <= upper"):
        metrics.interval_coverage(torch.zeros(3), torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"^upper: expected shape .* matching y"):
        metrics.interval_coverage(torch.zeros(3), torch.zeros(3), torch.ones(4))
    with pytest.raises(ValueError, match=r"^y: expected shape .* matching pred"):
        metrics.rmse(torch.zeros(3), torch.zeros(3, 3))


@pytest.mark.parametrize(
    "probs, labels, error, match",
    [
        (
            PROBS + torch.tensor([0.95, -0.95, 0, 0]),
            LABELS,
            ValueError,
            r"^probs: expected .*\[0, 1\]",
        ),
        (PROBS * 1.1, LABELS, ValueError, r"^probs: expected rows summing to 1"),
        (
            PROBS.index_fill(0, torch.tensor([2]), float("nan")),
            LABELS,
            ValueError,
            r"^probs: .*finite",
        ),
        (PROBS[:, 0], LABELS, ValueError, r"^probs: expected shape \(N, C\)"),
        (PROBS[..., None], LABELS, ValueError, r"^probs: expected shape \(N, C\)"),
        (PROBS.double().numpy(), LABELS, TypeError, r"^probs: expected a torch.Tensor"),
        # whole-number float labels pass, as training targets do (test_labels_and_arrays);
        # a fraction is an error, never truncated
        (PROBS, LABELS.float() + 0.5, ValueError, r"^y: class labels must be integers"),
        (PROBS, LABELS.cfloat(), TypeError, r"^y: expected integer class labels"),
        (PROBS, LABELS + 4, ValueError, r"^y: expected labels in \[0, 4\)"),
        (PROBS, LABELS - 1, ValueError, r"^y: expected labels in \[0, 4\)"),
        (
            PROBS,
            LABELS[:-1],
            ValueError,
            r"^y: expected shape .* matching probs \(N, C\) = \(100, 4\)",
        ),
    ],
)
@pytest.mark.parametrize(
    "fn",
    [
        metrics.categorical_nll,
        metrics.accuracy,
        metrics.brier_score,
        metrics.calibration_errors,
        metrics.reliability_diagram_data,
    ],
)
def test_classification_validation(fn, probs, labels, error, match):
    with pytest.raises(error, match=match):
        fn(probs, labels)


def test_labels_of_shape_n_by_1_are_accepted():
    probs, y = _random_probs(30, 3, seed=18)
    p, t = _t(probs), torch.as_tensor(y)
    assert metrics.brier_score(p, t[:, None]) == metrics.brier_score(p, t)
    assert metrics.calibration_errors(p, t[:, None], 4, 0) == metrics.calibration_errors(p, t, 4, 0)


def test_binning_and_ood_validation():
    with pytest.raises(ValueError, match=r"^n_bins: expected an int >= 1"):
        metrics.calibration_errors(PROBS, LABELS, n_bins=0)
    with pytest.raises(TypeError, match=r"^n_bins: expected an int"):
        metrics.reliability_diagram_data(PROBS, LABELS, n_bins=2.5)
    with pytest.raises(ValueError, match=r"^min_count: expected an int >= 0"):
        metrics.calibration_errors(PROBS, LABELS, min_count=-1)
    with pytest.raises(ValueError, match=r"^probs: all 20 bins hold at most min_count=5"):
        metrics.calibration_errors(PROBS[:5], LABELS[:5])
    with pytest.raises(ValueError, match=r"^probs_out: expected shape \(M, C\) with probs_in's C"):
        metrics.ood_auroc(PROBS, torch.full((10, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"^probs_in: expected rows summing to 1"):
        metrics.ood_auroc(PROBS * 2, PROBS)
    with pytest.raises(ValueError, match=r"^probs: expected probabilities"):
        metrics.mmc(-PROBS)


def test_regression_scores_agree_with_the_single_metrics_and_a_numpy_computation():
    gen = torch.Generator().manual_seed(0)
    means = torch.randn(30, 50, generator=gen, dtype=torch.float64)
    variances = 0.5 + torch.rand(30, 50, generator=gen, dtype=torch.float64)
    y = torch.randn(50, generator=gen, dtype=torch.float64)
    scores = metrics.regression_scores(means, variances, y)
    m, v, t = means.numpy(), variances.numpy(), y.numpy()
    mu = m.mean(0)
    var = (v + m**2).mean(0) - mu**2
    assert scores["rmse"] == pytest.approx(np.sqrt(((mu - t) ** 2).mean()))
    nll_mm = 0.5 * np.log(2 * np.pi * var) + 0.5 * (t - mu) ** 2 / var
    assert scores["nll_moment_matched"] == pytest.approx(nll_mm.mean())
    half = 1.959963984540054 * np.sqrt(var)
    assert scores["coverage95"] == pytest.approx(np.mean(np.abs(t - mu) <= half))
    assert scores["nll"] == pytest.approx(metrics.mixture_gaussian_nll(means, variances, y))


def test_classification_scores_collects_the_four_paper_metrics():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(400, 3, generator=gen).softmax(-1)
    y = torch.randint(0, 3, (400,), generator=gen)
    got = metrics.classification_scores(probs, y)
    assert got["acc"] == pytest.approx((probs.argmax(-1) == y).double().mean().item())
    assert got["nll"] == pytest.approx(-probs[torch.arange(400), y].log().mean().item(), rel=1e-6)
    assert (got["ece"], got["mce"]) == metrics.calibration_errors(probs, y, n_bins=20, min_count=5)
