"""Tests for pyro_subspace.datasets, checked against independent numpy/sklearn computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.datasets import load_diabetes, load_digits
from sklearn.model_selection import train_test_split

from pyro_subspace import datasets


def _interval_index(x: torch.Tensor, intervals) -> torch.Tensor:
    """Index of the interval containing each x, -1 if none."""
    idx = torch.full(x.shape, -1)
    for k, (lo, hi) in enumerate(intervals):
        idx[(x >= lo) & (x <= hi)] = k
    return idx


# ---------------------------------------------------------------- toy regression (Izmailov 2019)


@pytest.fixture(scope="module")
def big_toy() -> datasets.Dataset:
    return datasets.toy_regression(n=6000, noise_std=0.3, seed=3, n_test=3000, n_grid=50)


def test_toy_shapes_and_dtypes():
    d = datasets.toy_regression(n=37, n_test=11, n_grid=23)
    assert d.task == "regression" and d.n_classes is None and d.name == "toy"
    assert d.x_train.shape == (37, 2) and d.x_test.shape == (11, 2)
    assert d.y_train.shape == (37,) and d.y_test.shape == (11,)
    assert d.x_train.dtype == d.y_train.dtype == torch.float32
    assert d.grid.shape == (23, 2) and d.grid_x.shape == (23,) and d.x_train_raw.shape == (37,)
    assert d.n_train == 37 and d.n_features == 2
    assert d.x_mean is None and d.y_std is None
    torch.testing.assert_close(
        d.grid_x, torch.tensor(np.linspace(-10, 10, 23), dtype=torch.float32)
    )


def test_toy_features_are_exactly_x_and_x_squared(big_toy):
    x = big_toy.x_train_raw
    assert torch.equal(big_toy.x_train[:, 0], x)
    assert torch.equal(big_toy.x_train[:, 1], x * x)
    assert torch.equal(big_toy.x_test[:, 1], big_toy.x_test[:, 0] ** 2)
    assert torch.equal(big_toy.grid, datasets.toy_features(big_toy.grid_x))
    assert torch.equal(
        datasets.toy_features(torch.tensor([-2.0, 3.0])), torch.tensor([[-2.0, 4], [3, 9]])
    )


def test_toy_inputs_in_three_intervals_about_a_third_each(big_toy):
    for x in (big_toy.x_train_raw, big_toy.x_test[:, 0]):
        idx = _interval_index(x, [(-7.2, -4.8), (-1.2, 1.2), (4.8, 7.2)])
        assert (idx >= 0).all()
        n = x.shape[0]
        counts = torch.bincount(idx, minlength=3).double()
        # Binomial(n, 1/3): 5 standard deviations
        assert (counts - n / 3).abs().max() < 5 * math.sqrt(n * 2 / 9)
        # uniform within an interval: the mean of x in the middle interval is ~0
        mid = x[idx == 1].double()
        assert mid.mean().abs() < 5 * 2.4 / math.sqrt(12 * mid.numel())


def test_toy_f_has_unit_std_and_noise_matches(big_toy):
    assert float(big_toy.f_train.double().std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    for y, f in ((big_toy.y_train, big_toy.f_train), (big_toy.y_test, big_toy.f_test)):
        resid = (y - f).double()
        n = resid.numel()
        # sample std of n normals: relative standard error ~ 1/sqrt(2n)
        assert float(resid.std()) == pytest.approx(0.3, rel=5 / math.sqrt(2 * n))
        assert abs(float(resid.mean())) < 5 * 0.3 / math.sqrt(n)


def test_toy_f_is_one_function_on_train_test_and_grid():
    """f_grid (a fine linspace) interpolates f_train and f_test: the same net and scale."""
    d = datasets.toy_regression(n=300, n_test=300, n_grid=4001, seed=1)
    for x, f in ((d.x_train_raw, d.f_train), (d.x_test[:, 0], d.f_test)):
        interp = np.interp(x.numpy(), d.grid_x.numpy(), d.f_grid.numpy())
        np.testing.assert_allclose(interp, f.numpy(), atol=5e-3)


def test_toy_seed_reproducible_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = datasets.toy_regression(n=50, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(999)
    b = datasets.toy_regression(n=50, seed=7)
    c = datasets.toy_regression(n=50, seed=8)
    for name in ("x_train", "y_train", "x_test", "y_test", "f_grid"):
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert not torch.equal(getattr(a, name), getattr(c, name))


def test_toy_noiseless():
    d = datasets.toy_regression(n=20, noise_std=0.0)
    assert torch.equal(d.y_train, d.f_train)


# ---------------------------------------------------------------- in-between (Daxberger 2021)


def test_in_between_clusters_gap_and_noise():
    d = datasets.in_between(n=4001, noise_std=0.2, seed=0, n_test=2000, n_grid=31)
    assert d.x_train.shape == (4001, 1) and d.x_test.shape == (2000, 1)
    assert d.grid.shape == (31, 1) and d.grid_x.shape == (31,)
    assert torch.equal(d.x_train[:, 0], d.x_train_raw)
    x = d.x_train_raw
    (a0, b0), (a1, b1) = datasets.IN_BETWEEN_CLUSTERS
    assert a0 < b0 < a1 < b1  # two clusters with a real gap
    idx = _interval_index(x, datasets.IN_BETWEEN_CLUSTERS)
    assert (idx >= 0).all()
    assert torch.bincount(idx).tolist() == [2000, 2001]
    # test points cover the gap; the grid reaches beyond the data on both sides
    xt = d.x_test[:, 0]
    assert ((xt > b0) & (xt < a1)).any()
    assert d.grid_x.min() < x.min() and d.grid_x.max() > x.max()
    # f is the documented sin(3x) + 0.5x; residual noise has std noise_std
    torch.testing.assert_close(d.f_train, torch.sin(3 * x) + 0.5 * x)
    resid = (d.y_train - d.f_train).double()
    assert float(resid.std()) == pytest.approx(0.2, rel=5 / math.sqrt(2 * 4001))


def test_in_between_seeds():
    a, b, c = (datasets.in_between(seed=s) for s in (0, 0, 1))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)


# ---------------------------------------------------------------- scikit-learn bundled data


def _numpy_standardize(x_tr: np.ndarray, x_te: np.ndarray):
    mean, std = x_tr.mean(0), x_tr.std(0)
    std[std == 0] = 1.0
    return (x_tr - mean) / std, (x_te - mean) / std, mean, std


@pytest.mark.parametrize("seed, frac", [(0, 0.1), (3, 0.25)])
def test_diabetes_split_and_standardisation(seed, frac):
    raw = load_diabetes(scaled=False)
    d = datasets.diabetes(seed=seed, test_fraction=frac)
    n = raw.data.shape[0]
    assert d.x_test.shape == (math.ceil(frac * n), 10) and d.n_train == n - math.ceil(frac * n)
    assert d.task == "regression" and d.y_train.dtype == torch.float32
    # independent computation: same seeded split of row indices, numpy statistics
    i_tr, i_te = train_test_split(np.arange(n), test_size=frac, random_state=seed)
    x_tr, x_te, mean, std = _numpy_standardize(raw.data[i_tr], raw.data[i_te])
    y_mean, y_std = raw.target[i_tr].mean(), raw.target[i_tr].std()
    np.testing.assert_allclose(d.x_train.numpy(), x_tr, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d.x_test.numpy(), x_te, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d.y_test.numpy(), (raw.target[i_te] - y_mean) / y_std, atol=1e-5)
    np.testing.assert_allclose(d.x_mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(d.x_std.numpy(), std, rtol=1e-6)
    assert d.y_mean == pytest.approx(y_mean) and d.y_std == pytest.approx(y_std)
    # train features: mean 0, std 1; targets too
    np.testing.assert_allclose(d.x_train.double().mean(0).numpy(), 0, atol=1e-5)
    np.testing.assert_allclose(d.x_train.double().std(0, unbiased=False).numpy(), 1, atol=1e-5)
    assert abs(float(d.y_train.double().mean())) < 1e-5
    # the stored statistics undo the standardisation
    np.testing.assert_allclose(d.y_train.numpy() * d.y_std + d.y_mean, raw.target[i_tr], rtol=1e-5)


def test_diabetes_raw_and_seeds():
    raw = load_diabetes(scaled=False)
    d = datasets.diabetes(standardize=False)
    assert d.x_mean is None and d.x_std is None and d.y_mean is None and d.y_std is None
    i_tr, _ = train_test_split(np.arange(442), test_size=0.1, random_state=0)
    np.testing.assert_allclose(d.x_train.numpy(), raw.data[i_tr], rtol=1e-6)
    assert not torch.equal(datasets.diabetes(seed=1).y_train, datasets.diabetes(seed=0).y_train)


def test_digits_stratified_standardised_constant_pixels():
    raw = load_digits()
    d = datasets.digits(seed=2, test_fraction=0.2)
    assert d.task == "classification" and d.n_classes == 10
    assert d.y_train.dtype == torch.int64 and d.x_train.dtype == torch.float32
    assert d.x_test.shape == (math.ceil(0.2 * 1797), 64) and d.n_train + d.x_test.shape[0] == 1797
    i_tr, i_te = train_test_split(
        np.arange(1797), test_size=0.2, random_state=2, stratify=raw.target
    )
    x_tr, x_te, _, std = _numpy_standardize(raw.data[i_tr], raw.data[i_te])
    np.testing.assert_allclose(d.x_train.numpy(), x_tr, atol=1e-5)
    np.testing.assert_allclose(d.x_test.numpy(), x_te, atol=1e-5)
    np.testing.assert_allclose(d.x_std.numpy(), std, rtol=1e-6)
    np.testing.assert_array_equal(d.y_test.numpy(), raw.target[i_te])
    # some pixels are blank in the whole training split: std recorded as 1, no NaN
    constant = raw.data[i_tr].std(0) == 0
    assert constant.any() and torch.isfinite(d.x_test).all()
    assert (d.x_std.numpy()[constant] == 1).all()
    assert (d.x_train.numpy()[:, constant] == 0).all()
    sd = d.x_train.double().std(0, unbiased=False).numpy()
    np.testing.assert_allclose(sd[~constant], 1, atol=1e-5)
    # stratification: class proportions agree with the full data to within one sample
    full = np.bincount(raw.target, minlength=10) / 1797
    for y in (d.y_train, d.y_test):
        counts = np.bincount(y.numpy(), minlength=10)
        assert np.all(np.abs(counts - full * len(y)) <= 1.0)


# ---------------------------------------------------------------- CSV


def _write_csv(path, header, rows, delimiter=","):
    path.write_text("\n".join(delimiter.join(map(str, r)) for r in [header, *rows]) + "\n")


def test_from_csv_round_trip_regression(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3)).round(4)
    y = (x @ [1.0, -2.0, 0.5]).round(4)
    path = tmp_path / "data.csv"
    _write_csv(path, ["a", "target", "b", "c"], [[r[0], t, r[1], r[2]] for r, t in zip(x, y)])
    d = datasets.from_csv(path, "target", standardize=False, test_fraction=0.2, seed=4)
    assert d.name == "data" and d.task == "regression" and d.n_features == 3
    i_tr, i_te = train_test_split(np.arange(50), test_size=0.2, random_state=4)
    np.testing.assert_allclose(d.x_train.numpy(), x[i_tr], rtol=1e-6)
    np.testing.assert_allclose(d.y_test.numpy(), y[i_te], rtol=1e-6)
    # a chosen subset of features, in the given order, with standardisation and ';'
    path2 = tmp_path / "semi.csv"
    _write_csv(path2, ["a", "target", "b", "c"], [[r[0], t, r[1], r[2]] for r, t in zip(x, y)], ";")
    d2 = datasets.from_csv(path2, "target", features=["c", "a"], delimiter=";", seed=4)
    i_tr, i_te = train_test_split(np.arange(50), test_size=0.1, random_state=4)
    x_tr, x_te, _, _ = _numpy_standardize(x[i_tr][:, [2, 0]], x[i_te][:, [2, 0]])
    np.testing.assert_allclose(d2.x_train.numpy(), x_tr, atol=1e-5)
    np.testing.assert_allclose(d2.x_test.numpy(), x_te, atol=1e-5)
    assert d2.y_std == pytest.approx(y[i_tr].std())


def test_from_csv_classification_labels(tmp_path):
    path = tmp_path / "cls.csv"
    labels = ["cat", "dog", "emu"] * 10
    _write_csv(path, ["x", "label"], [[i, lab] for i, lab in enumerate(labels)])
    d = datasets.from_csv(path, "label", task="classification", test_fraction=0.3)
    assert d.n_classes == 3 and d.y_train.dtype == torch.int64
    # sorted labels -> 0..2, and x encodes the row so the mapping can be checked
    x_raw = d.x_test[:, 0] * d.x_std[0] + d.x_mean[0]
    expected = [["cat", "dog", "emu"].index(labels[round(float(v))]) for v in x_raw]
    assert d.y_test.tolist() == expected
    assert np.bincount(d.y_test.numpy()).tolist() == [3, 3, 3]  # stratified
    # numeric labels sort numerically, not as strings
    path2 = tmp_path / "num.csv"
    _write_csv(path2, ["x", "y"], [[i, [10, 9, 2][i % 3]] for i in range(30)])
    d2 = datasets.from_csv(path2, "y", task="classification", standardize=False)
    mapping = {int(x): int(y) for x, y in zip(d2.x_train[:, 0], d2.y_train)}
    assert all(mapping[i] == [2, 1, 0][i % 3] for i in mapping)


def test_from_csv_errors(tmp_path):
    path = tmp_path / "bad.csv"
    _write_csv(path, ["a", "b", "y"], [[1, 2, 3], [4, "oops", 6], [7, 8, 9]])
    with pytest.raises(ValueError, match=r"column 'b'.*'oops'.*line 3"):
        datasets.from_csv(path, "y")
    with pytest.raises(ValueError, match="target"):
        datasets.from_csv(path, "nope")
    with pytest.raises(ValueError, match="features"):
        datasets.from_csv(path, "y", features=["a", "zzz"])
    with pytest.raises(ValueError, match="features"):
        datasets.from_csv(path, "y", features=["y"])
    with pytest.raises(ValueError, match="task"):
        datasets.from_csv(path, "y", task="ranking")
    with pytest.raises(ValueError, match="test_fraction"):
        datasets.from_csv(path, "y", test_fraction=1.0)
    _write_csv(path, ["a", "y"], [[1, 2], [float("nan"), 3]])
    with pytest.raises(ValueError, match="column 'a'.*nan"):
        datasets.from_csv(path, "y")
    path.write_text("a,y\n1,2\n\n1,2,3\n")  # blank lines are skipped but still counted
    with pytest.raises(ValueError, match="line 4"):
        datasets.from_csv(path, "y")
    path.write_text("a,y\n1,u\n2,\n")
    with pytest.raises(ValueError, match="target: empty label on line 3"):
        datasets.from_csv(path, "y", task="classification")
    path.write_text("a,y\n")
    with pytest.raises(ValueError, match="path"):
        datasets.from_csv(path, "y")


# ---------------------------------------------------------------- registry and validation


def test_load_dispatches_and_rejects_unknown():
    assert torch.equal(datasets.load("toy", n=10).y_train, datasets.toy_regression(n=10).y_train)
    assert datasets.load("in_between").name == "in_between"
    assert datasets.load("diabetes").name == "diabetes"
    assert datasets.load("digits", test_fraction=0.5).n_classes == 10
    with pytest.raises(ValueError, match="diabetes.*digits.*in_between.*toy"):
        datasets.load("mnist")


@pytest.mark.parametrize(
    "fn, kwargs, arg",
    [
        (datasets.toy_regression, {"n": 0}, "n"),
        (datasets.toy_regression, {"n_test": 0}, "n_test"),
        (datasets.toy_regression, {"n_grid": 1}, "n_grid"),
        (datasets.toy_regression, {"noise_std": -0.1}, "noise_std"),
        (datasets.toy_regression, {"noise_std": float("nan")}, "noise_std"),
        (datasets.toy_regression, {"n": 2.5}, "n"),
        (datasets.in_between, {"n": -3}, "n"),
        (datasets.in_between, {"noise_std": -1}, "noise_std"),
        (datasets.diabetes, {"test_fraction": 0.0}, "test_fraction"),
        (datasets.digits, {"test_fraction": 1.5}, "test_fraction"),
    ],
)
def test_validation_names_the_argument(fn, kwargs, arg):
    with pytest.raises(ValueError, match=f"^{arg}:"):
        fn(**kwargs)


def test_dataset_checks_shapes_and_task():
    x, y = torch.zeros(4, 2), torch.zeros(4)
    with pytest.raises(ValueError, match="task"):
        datasets.Dataset("d", "ranking", x, y, x, y)
    with pytest.raises(ValueError, match="x_test, y_test"):
        datasets.Dataset("d", "regression", x, y, x, torch.zeros(3))
    d = datasets.Dataset("d", "regression", x, y, x, y)
    with pytest.raises(AttributeError):
        d.name = "e"  # frozen
    with pytest.raises(ValueError, match="x: expected shape"):
        datasets.toy_features(torch.zeros(3, 1))


def test_from_arrays_splits_like_the_bundled_loaders():
    raw = load_diabetes(scaled=False)
    mine = datasets.from_arrays(raw.data, raw.target, name="diabetes", seed=3)
    ref = datasets.diabetes(seed=3)
    for field in ("x_train", "y_train", "x_test", "y_test", "x_mean", "x_std"):
        assert torch.equal(getattr(mine, field), getattr(ref, field)), field
    assert (mine.y_mean, mine.y_std) == (ref.y_mean, ref.y_std)
    digits = load_digits()
    both = datasets.from_arrays(
        digits.data, digits.target, "classification", seed=0, test_fraction=0.2
    )
    assert torch.equal(both.x_test, datasets.digits(seed=0).x_test) and both.n_classes == 10
    with pytest.raises(ValueError, match="task"):
        datasets.from_arrays(raw.data, raw.target, task="ranking")
    with pytest.raises(ValueError, match="x, y"):
        datasets.from_arrays(raw.data, raw.target[:-1])
