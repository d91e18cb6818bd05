"""Nothing silent: class labels, arrays and member outputs are checked in one place (`validation`).

A fractional, negative or too-large class label, a NaN in an array, validation labels of the
wrong count and mixture members of different output widths are each a ``ValueError`` naming the
argument, raised before any forward pass (counted by a pre-hook on each network's first layer),
never a truncated label, a NaN spread by standardisation or a raw shape error after the work.
Whole-number float labels (``1.0``) pass everywhere, as they always did for training targets.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from pyro_subspace import FlatNet, datasets, likelihoods, metrics, subspaces, validation
from pyro_subspace.infer import DeepEnsemble, MixtureOfLaplace
from pyro_subspace.infer.swag import SWAG, MultiSWAG

C = 3
GEN = torch.Generator().manual_seed(0)
X = torch.randn(12, 2, generator=GEN)
Y = torch.arange(12) % C
CAT = likelihoods.Categorical()

#: bad labels for C = 3 classes and 12 rows, each with the text its error must contain
BAD_LABELS = {
    "fraction": (Y.double().index_fill(0, torch.tensor([4]), 0.5), "0.5 at row 4"),
    "float_fraction": (Y.float() + 0.25, "0.25 at row 0"),
    "negative": (Y.index_fill(0, torch.tensor([2]), -1), "-1 at row 2"),
    "too_large": (Y.index_fill(0, torch.tensor([5]), C), "3 at row 5"),
    "too_large_float": (Y.float().index_fill(0, torch.tensor([7]), 4.0), "4 at row 7"),
    "nan": (Y.float().index_fill(0, torch.tensor([1]), math.nan), "nan at row 1"),
}


def counted(n_out: int = C, seed: int = 0) -> nn.Sequential:
    """A tiny MLP whose first layer counts forward passes (``net.calls()``)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, n_out))
    net[0].n_calls = 0
    net[0].register_forward_pre_hook(lambda m, _: setattr(m, "n_calls", m.n_calls + 1))
    return net


def calls(*nets: nn.Module) -> int:
    return sum(net[0].n_calls for net in nets)


def reset(*nets: nn.Module) -> None:
    for net in nets:
        net[0].n_calls = 0


def filled_collector(net: nn.Module, n: int = 4) -> subspaces.SWACollector:
    col = subspaces.SWACollector(net, max_snapshots=n)
    flat, w = FlatNet(net), FlatNet(net).vector().detach()
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        flat.load_vector(w + 0.05 * torch.randn(w.shape, generator=gen, dtype=w.dtype))
        col.collect()
    flat.load_vector(w)
    return col


@pytest.fixture(scope="module")
def mola():
    nets = [counted(seed=1), counted(seed=2)]
    return MixtureOfLaplace(nets, CAT, prior_precision=1.0).fit(X, Y), nets


def predictors(mola_fixture):
    """Each mixture over counted nets: (predictor, nets whose forward passes are counted)."""
    de_nets = [counted(seed=3), counted(seed=4)]
    swag_net = counted(seed=5)
    ms_nets = [counted(seed=6), counted(seed=7)]
    mola, mola_nets = mola_fixture
    return {
        "DeepEnsemble": (DeepEnsemble(de_nets, CAT), de_nets),
        "SWAG": (SWAG(filled_collector(swag_net), CAT, num_samples=3), [swag_net]),
        "MultiSWAG": (
            MultiSWAG([filled_collector(n) for n in ms_nets], CAT, num_samples=2),
            ms_nets,
        ),
        "MixtureOfLaplace": (mola, mola_nets),
    }


# ------------------------------------------------------------------------ the shared helper


def test_check_labels_takes_whole_numbers_and_names_the_first_bad_row():
    out = validation.check_labels(Y.double()[:, None], "labels", C)
    assert out.dtype == torch.int64 and torch.equal(out, Y)
    assert torch.equal(validation.check_labels(Y.to(torch.int32), "labels", C), Y)
    for bad, where in BAD_LABELS.values():
        with pytest.raises(ValueError, match=rf"^labels: .*{where}"):
            validation.check_labels(bad, "labels", C)
    with pytest.raises(ValueError, match=r"^labels: expected 11 labels, one per row of x_val"):
        validation.check_labels(Y, "labels", C, n=11, x_name="x_val")
    with pytest.raises(TypeError, match=r"^labels"):
        validation.check_labels(Y.tolist(), "labels", C)


def test_check_finite_names_row_and_column():
    a = np.zeros((5, 3))
    a[3, 2] = np.inf
    with pytest.raises(ValueError, match=r"^arr: contains NaN or inf \(inf at row 3, column 2\)"):
        validation.check_finite(a, "arr")
    x = X.clone()
    x[6, 1] = math.nan
    with pytest.raises(ValueError, match=r"^x: contains NaN or inf \(nan at row 6, column 1\)"):
        validation.check_inputs(None, x)


def test_check_data_names_the_callers_label_argument():
    with pytest.raises(ValueError, match=r"^y_val: class labels must be integers.* 0\.5 at row 4"):
        validation.check_data(counted(), X, BAD_LABELS["fraction"][0], CAT, y_name="y_val")
    with pytest.raises(ValueError, match=r"^y_val: expected labels in \[0, 3\), got 3 at row 5"):
        validation.check_data(counted(), X, BAD_LABELS["too_large"][0], CAT, y_name="y_val")


def test_categorical_likelihood_uses_the_shared_check():
    lik = likelihoods.Categorical()
    out = torch.zeros(12, C)
    assert torch.equal(lik.validate(out, Y.float()), Y)  # whole-number floats: as before
    for bad, where in BAD_LABELS.values():
        with pytest.raises(ValueError, match=rf"^y: .*{where}"):
            lik.log_prob(out, bad)
    pred = lik.predictive_from_samples(out[None])
    with pytest.raises(ValueError, match=r"^y: expected labels in \[0, 3\), got 3 at row 5"):
        lik.predictive_log_prob(pred, BAD_LABELS["too_large"][0])  # was a raw gather error


# ------------------------------------------------------------- mixtures: log_prob and y_val


@pytest.mark.parametrize("kind", ["DeepEnsemble", "SWAG", "MultiSWAG", "MixtureOfLaplace"])
def test_mixture_log_prob_rejects_bad_labels_before_any_forward_pass(mola, kind):
    predictor, nets = predictors(mola)[kind]
    for name, (bad, where) in BAD_LABELS.items():
        reset(*nets)
        with pytest.raises(ValueError, match=rf"^y: .*{where}"):
            predictor.log_prob(X, bad)
        assert calls(*nets) == 0, name
    reset(*nets)
    with pytest.raises(ValueError, match=r"^y: expected 12 labels, one per row of x"):
        predictor.log_prob(X, Y[:-1])
    assert calls(*nets) == 0
    # whole-number floats are the same labels
    assert torch.equal(predictor.log_prob(X, Y.double()), predictor.log_prob(X, Y))


def test_bernoulli_ensemble_log_prob_rejects_fractional_labels():
    nets = [counted(1, seed=1), counted(1, seed=2)]
    de = DeepEnsemble(nets, likelihoods.Bernoulli())
    y = (torch.arange(12) % 2).double()
    for bad, where in [(y.index_fill(0, torch.tensor([3]), 0.5), "0.5 at row 3"),
                       (y.index_fill(0, torch.tensor([2]), 2.0), "2 at row 2")]:  # fmt: skip
        reset(*nets)
        with pytest.raises(ValueError, match=rf"^y: .*{where}"):  # was read as bool(0.5) = 1
            de.log_prob(X, bad)
        assert calls(*nets) == 0


def test_regression_log_prob_checks_target_count_and_values_before_work():
    nets = [counted(1, seed=1), counted(1, seed=2)]
    de = DeepEnsemble(nets, likelihoods.Gaussian(0.1))
    y = torch.randn(12)
    cases = [
        (y[:-1], r"^y: expected 12 targets, one per row of x"),
        (y.index_fill(0, torch.tensor([8]), math.inf), r"^y: .*inf at row 8"),
    ]
    for bad, match in cases:
        reset(*nets)
        with pytest.raises(ValueError, match=match):
            de.log_prob(X, bad)
        assert calls(*nets) == 0


@pytest.mark.parametrize("method", ["grid", "confidence"])
def test_mola_validation_labels_are_checked_before_any_work(mola, method):
    mixture, nets = mola
    lam = mixture.prior_precision
    cases = [(bad, where) for bad, where in BAD_LABELS.values()]
    cases.append((Y[:-1], "expected 12 labels, one per row of x_val"))
    for bad, where in cases:
        reset(*nets)
        with pytest.raises(ValueError, match=rf"^y_val: .*{where}"):
            mixture.optimize_prior_precision(method, x_val=X, y_val=bad)
        assert calls(*nets) == 0
        assert mixture.prior_precision == lam
    # whole-number floats tune to the same precision as int64 labels
    grid = torch.tensor([0.1, 1.0, 10.0])
    a = mixture.optimize_prior_precision(method, x_val=X, y_val=Y, grid=grid).prior_precision
    b = mixture.optimize_prior_precision(method, x_val=X, y_val=Y.float(), grid=grid)
    assert b.prior_precision == a


# ------------------------------------------------------------------- member output widths


def test_mixtures_reject_members_of_different_output_widths_before_work():
    nets = [counted(C, seed=1), counted(C + 1, seed=2)]
    with pytest.raises(ValueError, match=r"^nets: member 1 gives 4 output\(s\) but member 0"):
        DeepEnsemble(nets, CAT)
    with pytest.raises(ValueError, match=r"^nets: member 1 gives 4"):
        MixtureOfLaplace(nets, CAT)
    with pytest.raises(ValueError, match=r"^collectors: member 1 gives 4"):
        MultiSWAG([filled_collector(n) for n in nets], CAT)
    assert calls(*nets) == 0


class Wrapped(nn.Module):
    """A network whose output width its structure does not tell (not an nn.Sequential)."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.body = nn.Linear(2, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_members_whose_structure_hides_the_width_get_a_named_error():
    de = DeepEnsemble([Wrapped(C), Wrapped(C + 1)], CAT)  # cannot be told before a forward pass
    with pytest.raises(ValueError, match=r"^nets: member 1 gives outputs of shape .* \(12, 4\)"):
        de.predict(X)  # was a raw torch.cat size error
    one = DeepEnsemble([Wrapped(C)], CAT)
    with pytest.raises(ValueError, match=r"^y: expected labels in \[0, 3\), got 3 at row 5"):
        one.log_prob(X, BAD_LABELS["too_large"][0])  # range known after the forward pass only


# ---------------------------------------------------------------------- datasets.from_arrays


def _arrays(n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)), rng.normal(size=n)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_from_arrays_rejects_non_finite_cells_like_from_csv(tmp_path, value):
    x, y = _arrays()
    x[7, 2] = value
    with pytest.raises(ValueError, match=r"^x: contains NaN or inf \(.* at row 7, column 2\)"):
        datasets.from_arrays(x, y)
    x, y = _arrays()
    y[11] = value
    with pytest.raises(ValueError, match=r"^y: contains NaN or inf \(.* at row 11\)"):
        datasets.from_arrays(x, y)
    labels = (np.arange(30) % 2).astype(float)
    labels[11] = value
    with pytest.raises(ValueError, match=r"^y: .* at row 11"):
        datasets.from_arrays(x, labels, task="classification")
    # from_csv rejects the same cell
    path = tmp_path / "d.csv"
    path.write_text("a,b,t\n1,2,0\n3," + str(value) + ",1\n4,5,0\n")
    with pytest.raises(ValueError, match=r"column 'b'.* line 3"):
        datasets.from_csv(path, "t")


def test_from_arrays_rejects_fractional_and_negative_labels():
    x, _ = _arrays()
    y = (np.arange(30) % 3).astype(float)
    for bad, where in [(0.5, "0.5 at row 4"), (2.7, "2.7 at row 4"), (-1, "-1 at row 4")]:
        yy = y.copy()
        yy[[4, 10]] = bad  # twice: the stratified split took it and the label was truncated
        with pytest.raises(ValueError, match=rf"^y: class labels must be .*{where}"):
            datasets.from_arrays(x, yy, task="classification", test_fraction=0.3)
    data = datasets.from_arrays(x, y, task="classification")  # whole-number floats pass
    assert data.y_train.dtype == torch.int64 and data.n_classes == 3


# -------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize(
    "fn",
    [
        metrics.accuracy,
        metrics.categorical_nll,
        metrics.brier_score,
        metrics.calibration_errors,
        metrics.reliability_diagram_data,
        metrics.classification_scores,
    ],
)
def test_metrics_take_labels_through_the_shared_check(fn):
    probs = torch.softmax(torch.randn(12, C, generator=torch.Generator().manual_seed(2)), -1)
    for bad, where in BAD_LABELS.values():
        if "nan" in where:
            continue  # a NaN label is "y: expected finite values", checked with the shape
        with pytest.raises(ValueError, match=rf"^y: .*{where}"):
            fn(probs, bad)
    binned = fn in (metrics.calibration_errors, metrics.classification_scores)
    kwargs = {"min_count": 0} if binned else {}
    a, b = fn(probs, Y, **kwargs), fn(probs, Y.double(), **kwargs)  # whole-number floats pass
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
