"""infer.TemperatureScaling (Guo et al., 2017): T* against an independent grid search of the
validation NLL, the NLL's gradient in log T at T*, calibration of an overconfident model, the
predictive, data sources, persistence, bad inputs, all-or-nothing fits and the global RNG."""

import math
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import likelihoods, metrics
from pyro_subspace.exceptions import ConvergenceWarning
from pyro_subspace.infer import TemperatureScaling

D, C, SHARPEN = 4, 4, 3.0


def _overconfident(n, seed, sharpen=SHARPEN):
    """Labels drawn from softmax(W x), and a linear "network" whose logits are sharpen·W x: an
    overconfident model whose calibrating temperature is ``sharpen`` as n → ∞."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(C, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    y = torch.multinomial((x @ w.T).softmax(-1), 1, generator=gen).squeeze(-1)
    net = nn.Linear(D, C, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(sharpen * w)
    return net, x, y


def _nll(z, y, t):
    """The validation NLL at temperature t, by torch's cross-entropy (independent of the
    module's own formulas)."""
    return F.cross_entropy(z / t, y).item()


@pytest.fixture(scope="module")
def problem():
    net, x, y = _overconfident(3000, seed=1)
    return net, x[:1000], y[:1000], x[1000:], y[1000:]


def test_temperature_is_the_grid_minimiser_of_the_validation_nll(problem):
    net, x_val, y_val, _, _ = problem
    ts = TemperatureScaling(net).fit(x_val, y_val)
    t_star = float(ts.temperature)
    with torch.no_grad():
        z = net(x_val)
    grid = torch.logspace(math.log10(0.5), math.log10(20.0), 4001, dtype=torch.float64)
    nlls = torch.tensor([_nll(z, y_val, float(t)) for t in grid], dtype=torch.float64)
    i = int(nlls.argmin())
    assert 0 < i < len(grid) - 1  # an interior minimum of the grid
    # T* lies within one grid spacing of the grid's minimiser, and is no worse than any grid point
    assert float(grid[i - 1]) <= t_star <= float(grid[i + 1])
    assert _nll(z, y_val, t_star) <= float(nlls.min()) + 1e-12
    assert ts.nll_after == pytest.approx(_nll(z, y_val, t_star), rel=1e-12)
    assert ts.nll_before == pytest.approx(_nll(z, y_val, 1.0), rel=1e-12)
    # the overconfident model is softened by about its sharpening factor (1000 points)
    assert 2.4 < t_star < 3.6


def test_gradient_of_the_nll_in_log_temperature_vanishes_at_the_optimum(problem):
    net, x_val, y_val, _, _ = problem
    ts = TemperatureScaling(net).fit(x_val, y_val)
    with torch.no_grad():
        z = net(x_val)
    log_t = torch.tensor(math.log(float(ts.temperature)), dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(F.cross_entropy(z / log_t.exp(), y_val), log_t, create_graph=True)
    (curv,) = torch.autograd.grad(grad, log_t)
    scale = z.abs().max().item()
    assert abs(grad.item()) < 1e-12 * scale  # float64 resolution, not a tolerance of a search
    assert curv.item() > 0  # a minimum


def test_calibration_improves_ece_and_nll_on_held_out_data_and_keeps_the_accuracy(problem):
    net, x_val, y_val, x_test, y_test = problem
    ts = TemperatureScaling(net).fit(x_val, y_val)
    with torch.no_grad():
        p_map = net(x_test).softmax(-1)
    p_ts = ts.predict(x_test).probs
    ece_map = metrics.calibration_errors(p_map, y_test)[0]
    ece_ts = metrics.calibration_errors(p_ts, y_test)[0]
    assert ece_ts < 0.5 * ece_map and ece_map > 0.1  # the model was overconfident; now it is not
    assert metrics.categorical_nll(p_ts, y_test) < metrics.categorical_nll(p_map, y_test)
    assert torch.equal(p_ts.argmax(-1), p_map.argmax(-1))  # T > 0 keeps every predicted class


def test_predict_and_log_prob_are_the_tempered_softmax(problem):
    net, x_val, y_val, x_test, y_test = problem
    ts = TemperatureScaling(net).fit(x_val, y_val)
    t = float(ts.temperature)
    with torch.no_grad():
        expected = (net(x_test[:50]) / t).softmax(-1)
    pred = ts.predict(x_test[:50])
    assert isinstance(pred, torch.distributions.Categorical)
    assert pred.probs.dtype == torch.float64
    torch.testing.assert_close(pred.probs, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        ts.log_prob(x_test[:50], y_test[:50]),
        expected.gather(1, y_test[:50, None]).squeeze(1).log(),
        rtol=0,
        atol=1e-12,
    )
    weights, comp = ts.components(x_test[:50])
    assert weights.tolist() == [1.0] and comp.shape == (1, 50, C)
    torch.testing.assert_close(ts.logits(x_test[:50]) * t, net(x_test[:50]).detach())


def test_float32_network_gets_float64_logits_and_the_same_optimum(problem):
    net, x_val, y_val, _, _ = problem
    net32 = nn.Linear(D, C, bias=False)
    with torch.no_grad():
        net32.weight.copy_(net.weight)
    t32 = float(TemperatureScaling(net32).fit(x_val.float(), y_val).temperature)
    with torch.no_grad():
        z = net32(x_val.float()).double()
    grid = torch.linspace(0.9, 1.1, 2001, dtype=torch.float64) * t32
    nlls = torch.tensor([_nll(z, y_val, float(t)) for t in grid], dtype=torch.float64)
    assert int(nlls.argmin()) in (999, 1000, 1001)  # t32 is the grid's centre


def test_fit_is_deterministic_and_chunking_and_data_sources_agree(problem):
    net, x_val, y_val, _, _ = problem
    t = float(TemperatureScaling(net).fit(x_val, y_val).temperature)
    assert float(TemperatureScaling(net).fit(x_val, y_val).temperature) == t
    chunked = TemperatureScaling(net, chunk_size=7).fit(x_val, y_val)
    assert float(chunked.temperature) == pytest.approx(t, rel=1e-12)
    ds = TensorDataset(x_val, y_val)
    assert float(TemperatureScaling(net).fit(ds).temperature) == pytest.approx(t, rel=1e-12)
    loader = DataLoader(ds, batch_size=64, shuffle=False)
    assert float(TemperatureScaling(net).fit(loader).temperature) == pytest.approx(t, rel=1e-12)


def test_bernoulli_one_logit_matches_a_grid_search_of_the_binary_nll():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(800, 3, generator=gen, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = torch.bernoulli((x @ w).sigmoid(), generator=gen)
    net = nn.Linear(3, 1).double()
    with torch.no_grad():
        net.weight.copy_(0.4 * w[None])  # underconfident: T* < 1
        net.bias.zero_()
    ts = TemperatureScaling(net, likelihoods.Bernoulli()).fit(x, y)
    t_star = float(ts.temperature)
    with torch.no_grad():
        z = net(x).squeeze(-1)
    grid = torch.logspace(-2, 1, 6001, dtype=torch.float64)
    nlls = torch.tensor(
        [F.binary_cross_entropy_with_logits(z / t, y).item() for t in grid], dtype=torch.float64
    )
    i = int(nlls.argmin())
    assert float(grid[i - 1]) <= t_star <= float(grid[i + 1])
    assert 0.25 < t_star < 0.6
    pred = ts.predict(x[:5])
    assert isinstance(pred, torch.distributions.Bernoulli)
    torch.testing.assert_close(pred.probs, (z[:5] / t_star).sigmoid(), rtol=0, atol=1e-12)


def test_separable_validation_data_stop_at_the_lower_bound_with_a_warning():
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, -1.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0])
    net = nn.Linear(2, 2, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(torch.eye(2, dtype=torch.float64))
    with pytest.warns(ConvergenceWarning, match="T_min"):
        ts = TemperatureScaling(net).fit(x, y, bounds=(0.01, 100.0))
    assert float(ts.temperature) == pytest.approx(0.01, rel=1e-15)
    with pytest.warns(ConvergenceWarning, match="T_max"):  # every label the unlikely class
        ts.fit(x, 1 - y, bounds=(0.01, 100.0))
    assert float(ts.temperature) == pytest.approx(100.0, rel=1e-15)


def test_persistence_round_trips_through_weights_only_load(problem, tmp_path):
    net, x_val, y_val, x_test, _ = problem
    ts = TemperatureScaling(net).fit(x_val, y_val)
    torch.save(ts.state_dict(), tmp_path / "ts.pt")
    fresh = TemperatureScaling(nn.Linear(D, C, bias=False).double())
    with pytest.raises(RuntimeError, match="fit"):
        fresh.predict(x_test[:3])
    fresh.load_state_dict(torch.load(tmp_path / "ts.pt", weights_only=True))
    assert torch.equal(fresh.temperature, ts.temperature)
    assert torch.equal(fresh.predict(x_test[:9]).probs, ts.predict(x_test[:9]).probs)


def test_network_mode_and_global_random_state_are_untouched(problem):
    inner, x_val, y_val, x_test, _ = problem
    net = nn.Sequential(nn.Dropout(0.5), inner)  # in training mode every call would differ
    net.train()
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    ts = TemperatureScaling(net).fit(x_val, y_val)
    p1 = ts.predict(x_test[:20]).probs
    p2 = ts.predict(x_test[:20]).probs
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]
    assert torch.equal(p1, p2)  # dropout off: eval mode during the forward passes
    assert net.training and all(m.training for m in net)  # the user's mode is restored


class _Counting(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.inner, self.calls = net, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def _bad_fits(x, y):
    nan_x = x.clone()
    nan_x[3, 1] = float("nan")
    frac = y.double().clone()
    frac[2] = 0.5
    return [
        ({"x_val": x[:, :3], "y_val": y}, ValueError, "x_val"),
        ({"x_val": nan_x, "y_val": y}, ValueError, "x_val"),
        ({"x_val": x.tolist(), "y_val": y}, TypeError, "x_val"),
        ({"x_val": x, "y_val": y[:-1]}, ValueError, "y_val"),
        ({"x_val": x, "y_val": None}, ValueError, "y_val"),
        ({"x_val": x, "y_val": torch.full_like(y, C)}, ValueError, "y_val"),
        ({"x_val": x, "y_val": -y - 1}, ValueError, "y_val"),
        ({"x_val": x, "y_val": frac}, ValueError, "y_val"),
        ({"x_val": TensorDataset(x, y), "y_val": y}, ValueError, "y_val"),
        ({"x_val": x, "y_val": y, "bounds": (0.0, 10.0)}, ValueError, "bounds"),
        ({"x_val": x, "y_val": y, "bounds": (5.0, 1.0)}, ValueError, "bounds"),
        ({"x_val": x, "y_val": y, "bounds": (1.0, math.inf)}, ValueError, "bounds"),
        ({"x_val": x, "y_val": y, "bounds": 3.0}, TypeError, "bounds"),
        ({"x_val": x, "y_val": y, "bounds": "ab"}, TypeError, "bounds"),
    ]


def test_bad_fit_arguments_are_named_before_any_forward_pass_and_change_nothing(problem):
    net, x_val, y_val, _, _ = problem
    seq = nn.Sequential(net)  # the structure tells the widths: checks need no forward pass
    ts = TemperatureScaling(seq).fit(x_val, y_val)
    t, nll = ts.temperature.clone(), ts.nll_after
    calls = []
    handle = seq.register_forward_hook(lambda *a: calls.append(1))
    try:
        for kwargs, err, name in _bad_fits(x_val[:40], y_val[:40]):
            with pytest.raises(err, match=name):
                ts.fit(**kwargs)
            assert not calls, f"a forward pass ran before the error for {name}"
            assert torch.equal(ts.temperature, t) and ts.nll_after == nll
    finally:
        handle.remove()


def test_an_interrupted_fit_leaves_the_fitted_temperature():
    net, x, y = _overconfident(300, seed=5)
    wrapped = _Counting(net)
    ts = TemperatureScaling(wrapped).fit(x, y)
    t = ts.temperature.clone()

    def interrupt(*args):
        raise KeyboardInterrupt

    handle = wrapped.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        ts.fit(x, 1 - y.clamp(max=1))
    handle.remove()
    assert torch.equal(ts.temperature, t)


@pytest.mark.parametrize(
    "args, kwargs, err, name",
    [
        (("not a net",), {}, TypeError, "net"),
        ((nn.Linear(2, 2), "classification"), {}, TypeError, "likelihood"),
        ((nn.Linear(2, 1), likelihoods.Gaussian(sigma=1.0)), {}, ValueError, "likelihood"),
        ((nn.Linear(2, 2),), {"chunk_size": 0}, ValueError, "chunk_size"),
        ((nn.Linear(2, 2),), {"chunk_size": 1.5}, TypeError, "chunk_size"),
    ],
)
def test_bad_constructor_arguments_are_named(args, kwargs, err, name):
    with pytest.raises(err, match=name):
        TemperatureScaling(*args, **kwargs)


def test_predict_checks_its_inputs(problem):
    net, x_val, y_val, x_test, y_test = problem
    ts = TemperatureScaling(nn.Sequential(net)).fit(x_val, y_val)
    with pytest.raises(ValueError, match="x"):
        ts.predict(x_test[:, :2])
    with pytest.raises(ValueError, match="y"):
        ts.log_prob(x_test[:5], y_test[:4])


def test_fits_on_the_networks_device(device):
    net, x, y = _overconfident(500, seed=7)
    t_cpu = float(TemperatureScaling(net).fit(x, y).temperature)
    ts = TemperatureScaling(net.to(device)).fit(x.to(device), y.to(device))
    assert ts.temperature.device.type == device.type
    assert float(ts.temperature) == pytest.approx(t_cpu, rel=1e-9)
    assert ts.predict(x[:4].to(device)).probs.device.type == device.type
