"""Input validation at the public boundary (issue 12, "Checks missing or too late").

Every bad input gets a ``ValueError``/``TypeError`` whose message starts with the argument's
name, raised before any forward pass of the network (counted by a forward pre-hook).
"""

from __future__ import annotations

import math

import pyro
import pytest
import torch
from pyro.infer import MCMC, NUTS
from torch import nn

import pyro_subspace as ps
from pyro_subspace import validation as ck
from pyro_subspace import datasets, infer, likelihoods, subspaces
from pyro_subspace.convert import to_inference_data

N = 10


class Counted(nn.Sequential):
    """A Sequential MLP that counts its forward passes (functional calls included)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.calls = 0
        self.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def mlp(n_in: int = 3, n_out: int = 1, seed: int = 0) -> Counted:
    torch.manual_seed(seed)
    return Counted(nn.Linear(n_in, 6), nn.Tanh(), nn.Linear(6, n_out))


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 3, generator=g), torch.randn(N, generator=g)


def raises_named(exc, arg: str, fn, net: Counted | None = None, match: str | None = None):
    """``fn()`` raises ``exc`` whose message starts with ``arg:`` and ``net`` never ran."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert msg.split(":")[0].strip().startswith(arg) or msg.startswith(arg), msg
    if match is not None:
        assert match in msg, msg
    if net is not None:
        assert net.calls == 0, f"the network ran {net.calls} time(s) before the error"
    return msg


# ----------------------------------------------------------------------------- the module


@pytest.mark.parametrize("bad", [0, -3, 2.0, "3", None, True])
def test_positive_int_rejects(bad):
    with pytest.raises((TypeError, ValueError), match="^k: expected an int >= 1"):
        ck.positive_int(bad, "k")


def test_scalar_checks_accept_and_name():
    assert ck.positive_int(3, "k") == 3 and ck.nonneg_int(0, "k") == 0
    assert ck.positive_int(None, "k", allow_none=True) is None
    assert ck.positive_float(2, "s") == 2.0 and ck.positive_float(0, "s", allow_zero=True) == 0.0
    assert ck.probability(0.25, "p") == 0.25 and ck.choice("a", "c", ("a", "b")) == "a"
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="^s: expected a finite number > 0"):
            ck.positive_float(bad, "s")
    for bad in (0.0, 1.0, math.nan, 2.0):
        with pytest.raises(ValueError, match="^p: "):
            ck.probability(bad, "p")
    with pytest.raises(ValueError, match=r"^c: expected one of \('a', 'b'\), got 'z'"):
        ck.choice("z", "c", ("a", "b"))
    with pytest.raises(ValueError, match="^c: "):
        ck.choice(["unhashable"], "c", ("a", "b"))


def test_check_tensor():
    with pytest.raises(TypeError, match="^w: expected a torch.Tensor"):
        ck.check_tensor([1.0], "w")
    with pytest.raises(TypeError, match="^w: expected a floating-point"):
        ck.check_tensor(torch.ones(2, dtype=torch.long), "w", floating=True)
    with pytest.raises(ValueError, match="^w: expected 1 dimension"):
        ck.check_tensor(torch.ones(2, 2), "w", ndim=1)
    with pytest.raises(ValueError, match="^w: contains NaN"):
        ck.check_tensor(torch.tensor([1.0, math.nan]), "w")
    with pytest.raises(ValueError, match="^w: expected a non-empty"):
        ck.check_tensor(torch.ones(0), "w")


def test_net_spec_reads_structure_without_calling():
    net = mlp(4, 2)
    spec = ck.net_spec(net)
    assert (spec.in_kind, spec.in_width, spec.in_ndim, spec.out_width) == ("linear", 4, 2, 2)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    spec = ck.net_spec(conv)
    assert (spec.in_kind, spec.in_width, spec.in_ndim, spec.out_width) == ("conv", 3, 4, None)
    flat = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    assert (ck.net_spec(flat).in_kind, ck.net_spec(flat).in_width) == ("flatten", 12)
    assert net.calls == 0

    class Rows(nn.Module):  # an unknown layer: x need not be 2-D any more
        def forward(self, x):
            return x.flatten(1)

    seq = nn.Sequential(nn.Linear(3, 4), Rows(), nn.Linear(8, 2))
    assert ck.net_spec(seq).in_ndim is None
    assert ck.check_data(seq, torch.randn(5, 2, 3)) == 5


def test_data_check_messages_say_the_fix():
    net = mlp()
    x = torch.randn(N, 3)
    msg = raises_named(TypeError, "x", lambda: ck.check_data(net, x.double()), net)
    assert "float64 but the network is float32: call x.float() or net.double()" in msg
    msg = raises_named(ValueError, "x", lambda: ck.check_data(net, x[:, 0]), net)
    assert "x.reshape(-1, 3)" in msg
    raises_named(ValueError, "x", lambda: ck.check_data(net, x[:, :2]), net, "takes 3")
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    raises_named(
        ValueError, "x", lambda: ck.check_data(conv, torch.randn(2, 1, 5, 5)), None, "3 channels"
    )
    # any other module: dtype, device and finiteness only (its call order is unknown)
    assert ck.check_data(nn.Linear(3, 1), torch.randn(4, 7)) == 4


# ----------------------------------------------------------------------- issue 12 reproducers


def test_from_csv_duplicated_column_name(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("a,a,y\n1,2,3\n4,5,6\n7,8,9\n")
    with pytest.raises(ValueError, match=r"^path: .*duplicated column names \['a'\]"):
        datasets.from_csv(path, "y")
    ok = tmp_path / "ok.csv"
    ok.write_text("a,b,y\n1,2,3\n4,5,6\n7,8,9\n")
    with pytest.raises(ValueError, match="^features: "):
        datasets.from_csv(ok, "y", features=["a", "a"])


@pytest.mark.parametrize(
    "make_x, exc, fix",
    [
        (lambda x: x[:, :2], ValueError, "(N, 3)"),
        (lambda x: x[:, 0], ValueError, "reshape"),
        (lambda x: x.double(), TypeError, "x.float()"),
    ],
)
def test_subspace_net_and_nuts_check_x_first(data, make_x, exc, fix):
    x, y = data
    net = mlp()
    model = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), likelihoods.Gaussian(0.1))
    raises_named(exc, "x", lambda: model(make_x(x), y), net, fix)
    mcmc = MCMC(NUTS(model), num_samples=1, warmup_steps=0, disable_progbar=True)
    raises_named(exc, "x", lambda: mcmc.run(make_x(x), y), net, fix)


def test_integer_targets_for_regression_fail_before_work(data):
    x, y = data
    net = mlp()
    model = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), likelihoods.Gaussian(0.1))
    raises_named(TypeError, "y", lambda: model(x, y.long()), net)


def test_fit_map_checks_before_training(data):
    x, y = data
    net = mlp()
    w = ps.FlatNet(net).vector().clone()
    lik = likelihoods.Gaussian(0.1)
    raises_named(
        TypeError,
        "x",
        lambda: ps.fit_map(net, lik, x.double(), y, progress=False),
        net,
        "x.float()",
    )
    raises_named(
        ValueError,
        "weight_decay",
        lambda: ps.fit_map(net, lik, x, y, weight_decay=math.nan, progress=False),
        net,
    )
    raises_named(
        ValueError,
        "collector",
        lambda: ps.fit_map(net, lik, x, y, swa_epochs=2, progress=False),
        net,
    )
    assert torch.equal(ps.FlatNet(net).vector(), w)


def test_fit_curve_checks_end_points(data):
    x, y = data
    net = mlp()
    w0 = ps.FlatNet(net).vector()
    raises_named(
        ValueError,
        "w1",
        lambda: subspaces.fit_curve(
            net, likelihoods.Gaussian(0.1), x, y, w0, w0[:-1], epochs=1, progress=False
        ),
        net,
    )


def test_constructors_reject_what_fails_later():
    with pytest.raises(ValueError, match="^min_scale: "):
        likelihoods.Gaussian(min_scale=math.nan)
    with pytest.raises(ValueError, match="^sigma_init: "):
        likelihoods.Gaussian(sigma_init=math.inf)
    with pytest.raises(ValueError, match="^temperature: "):
        infer.MixtureOfLaplace([mlp(3, 3)], likelihoods.Categorical(), temperature=0)
    with pytest.raises(ValueError, match="^chunk_size: "):
        infer.MixtureOfLaplace([mlp(3, 3)], likelihoods.Categorical(), chunk_size=0)


def test_subnetwork_indices_blame_indices():
    net = mlp()
    for bad in ([], [1, 1, 2], [0, 10_000]):
        with pytest.raises(ValueError, match="^indices: "):
            subspaces.subnetwork(net, strategy="indices", indices=bad)


def test_laplace_fit_and_predictive_check_x(data):
    x, y = data
    net = mlp()
    model = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), likelihoods.Gaussian(0.1))
    guide = infer.AutoSubspaceLaplace(model)
    bad = x.clone()
    bad[1, 1] = math.nan
    raises_named(ValueError, "x", lambda: guide.fit(bad, y), net, "NaN")
    raises_named(TypeError, "x", lambda: guide.fit(x.double(), y), net, "x.float()")
    guide.fit(x, y, max_iter=5)
    net.calls = 0
    raises_named(ValueError, "x", lambda: infer.linearized_predictive(guide, x[:, :2]), net)
    raises_named(
        ValueError, "chunk_size", lambda: infer.linearized_predictive(guide, x, chunk_size=0), net
    )
    raises_named(
        ValueError, "num_samples", lambda: infer.linearized_predictive(guide, x, num_samples=0), net
    )
    auto = pyro.infer.autoguide.AutoNormal(model)
    raises_named(TypeError, "guide", lambda: infer.linearized_predictive(auto, x), net)


def test_to_inference_data_on_an_mcmc_that_never_ran():
    net = mlp()
    model = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), likelihoods.Gaussian(0.1))
    with pytest.raises(ValueError, match=r"^mcmc: .*run"):
        to_inference_data(MCMC(NUTS(model), num_samples=2))


def test_ess_minus_inf_start_does_not_blame_initial_params():
    def model():
        pyro.sample("t", pyro.distributions.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.factor("lik", torch.tensor(-math.inf))

    mcmc = MCMC(infer.EllipticalSliceSampler(model), num_samples=1, disable_progbar=True)
    with pytest.raises(ValueError, match="^model: ") as info:
        mcmc.run()
    assert "initial_params" not in str(info.value)


def test_patched_net_and_ggn_eigen_check_x(data):
    x, _ = data
    net = mlp(3, 3)
    pn = ps.PatchedNet(net, likelihoods.Categorical(), n_components=2)
    net.calls = 0
    raises_named(ValueError, "x", lambda: pn.predictive_mean(x[:, :2], 2), net)
    raises_named(TypeError, "x", lambda: pn.predictive_mean(x.double(), 2), net)
    raises_named(
        ValueError,
        "x",
        lambda: subspaces.ggn_eigen(net, likelihoods.Categorical(), x[:, 0], 2),
        net,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["fit", "--weight-decay", "nan"],
        ["fit", "--seed", "-1"],
        ["fit", "--prior-scale", "-1"],
        ["fit", "--warmup", "-5"],
        ["patch", "--drop-prob", "2"],
    ],
)
def test_cli_numeric_flags_are_usage_errors(usage_error, argv):
    assert argv[1] in usage_error(argv)


def test_cli_bad_csv_is_a_usage_error(usage_error, tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("a,a,y\n1,2,3\n4,5,6\n7,8,9\n")
    err = usage_error(
        ["fit", "--dataset", "csv", "--csv", str(path), "--target", "y", "--no-progress"]
    )
    assert "duplicated column names" in err and "Traceback" not in err
