"""Property-based tests (hypothesis) of the public API under bad input (issue 12).

For random bad inputs (wrong shapes, dtypes, NaN/inf, empty, non-tensors; out-of-range and
wrong-typed scalars), every entry point raises a ``ValueError``/``TypeError`` whose message
starts with the argument's name, and the network has not run a single forward pass (a forward
pre-hook counts them), so the error came before any expensive work.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pyro_subspace as ps
from pyro_subspace import infer, likelihoods, subspaces

FAST = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
D_IN = 3


class Counted(nn.Sequential):
    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.calls = 0
        self.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def mlp(n_out: int = 1, seed: int = 0) -> Counted:
    torch.manual_seed(seed)
    return Counted(nn.Linear(D_IN, 5), nn.Tanh(), nn.Linear(5, n_out))


GAUSS = likelihoods.Gaussian(0.1)
X = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(0))
Y = torch.randn(8, generator=torch.Generator().manual_seed(1))


@functools.cache
def fitted():
    """A fitted Laplace guide, a deep ensemble and a PatchedNet on counted nets (built once)."""
    net = mlp()
    model = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), GAUSS)
    guide = infer.AutoSubspaceLaplace(model).fit(X, Y, max_iter=5)
    ens = infer.DeepEnsemble([mlp(seed=1), mlp(seed=2)], GAUSS)
    pnet = mlp(3, seed=3)
    patched = ps.PatchedNet(pnet, likelihoods.Categorical(), n_components=2)
    return {"guide": (guide, net), "ensemble": (ens, ens.nets), "patched": (patched, pnet)}


def entry_points():
    """``name -> (call(x, y), nets whose forward passes are counted)``, fresh where cheap."""
    out = {}

    def model_call(x, y):
        net = mlp()
        m = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), GAUSS)
        return (lambda: m(x, y)), [net]

    def fit_map_call(x, y):
        net = mlp()
        return (lambda: ps.fit_map(net, GAUSS, x, y, epochs=1, progress=False)), [net]

    def laplace_fit(x, y):
        net = mlp()
        g = infer.AutoSubspaceLaplace(ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), GAUSS))
        return (lambda: g.fit(x, y)), [net]

    def ess_likelihood(x, y):
        net = mlp()
        m = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), GAUSS)
        return (lambda: m.log_likelihood_fn(x, y)), [net]

    def predictive(x, y):
        guide, net = fitted()["guide"]
        return (lambda: infer.linearized_predictive(guide, x)), [net]

    def ensemble(x, y):
        ens, nets = fitted()["ensemble"]
        return (lambda: ens.predict(x).probs), nets

    def patched(x, y):
        pn, net = fitted()["patched"]
        return (lambda: pn.predictive_mean(x, 2)), [net]

    def eigen(x, y):
        net = mlp()
        return (lambda: subspaces.ggn_eigen(net, GAUSS, x, 2)), [net]

    def select(x, y):
        net = mlp()
        return (lambda: subspaces.subnetwork(net, 3, "diag_laplace", likelihood=GAUSS, x=x)), [net]

    for f in (
        model_call,
        fit_map_call,
        laplace_fit,
        ess_likelihood,
        predictive,
        ensemble,
        patched,
        eigen,
        select,
    ):
        out[f.__name__] = f
    return out


ENTRIES = entry_points()


@st.composite
def bad_inputs(draw):
    """A bad ``x`` for a ``Linear(3, ·)``-first network, and its number of rows (or None)."""
    n = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["width", "ndim", "dtype", "nonfinite", "empty", "type"]))
    if kind == "width":
        return torch.randn(n, draw(st.integers(1, 7).filter(lambda w: w != D_IN))), n
    if kind == "ndim":
        shape = draw(st.sampled_from([(n,), (n, 1, D_IN), (n, D_IN, 1), (1, n, D_IN)]))
        return torch.randn(shape), shape[0]
    if kind == "dtype":
        dtype = draw(
            st.sampled_from(
                [
                    torch.float64,
                    torch.float16,
                    torch.int64,
                    torch.int32,
                    torch.uint8,
                    torch.bool,
                    torch.complex64,
                ]
            )
        )
        return torch.ones(n, D_IN).to(dtype), n
    if kind == "nonfinite":
        x = torch.randn(n, D_IN)
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, D_IN - 1))
        x[i, j] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return x, n
    if kind == "empty":
        return torch.zeros(0, D_IN), None
    return draw(st.sampled_from([X.tolist(), X.numpy(), 1.5, "x", None, np.float32(2.0)])), None


def _assert_named(call, nets, arg):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    msg = str(info.value)
    assert msg.split(":")[0].strip().startswith(arg), msg
    assert all(net.calls == 0 for net in nets), (msg, [net.calls for net in nets])


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@FAST
@given(bad=bad_inputs())
def test_bad_x_is_named_before_any_forward_pass(entry, bad):
    x, n = bad
    call, nets = ENTRIES[entry](x, torch.randn(n if n is not None else 4))
    for net in nets:  # the fitted objects' nets ran while being fitted
        net.calls = 0
    _assert_named(call, nets, "x")


@st.composite
def bad_targets(draw):
    kind = draw(st.sampled_from(["length", "nonfinite", "integer", "width", "type", "scalar"]))
    n = X.shape[0]
    if kind == "length":
        return torch.randn(draw(st.integers(1, 12).filter(lambda m: m != n)))
    if kind == "nonfinite":
        y = torch.randn(n)
        y[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, math.inf]))
        return y
    if kind == "integer":
        return torch.zeros(n, dtype=draw(st.sampled_from([torch.int64, torch.int32])))
    if kind == "width":
        return torch.randn(n, draw(st.integers(2, 4)))
    if kind == "scalar":
        return torch.tensor(0.5)
    return draw(st.sampled_from([Y.tolist(), Y.numpy(), "y", 3.0]))


@pytest.mark.parametrize("entry", ["model_call", "fit_map_call", "laplace_fit", "ess_likelihood"])
@FAST
@given(y=bad_targets())
def test_bad_y_is_named_before_any_forward_pass(entry, y):
    call, nets = ENTRIES[entry](X, y)
    _assert_named(call, nets, "y")


NOT_POSITIVE_INT = st.one_of(
    st.integers(max_value=0),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=2),
    st.booleans(),
    st.just([1]),
)
NOT_POSITIVE_FLOAT = st.one_of(
    st.floats(max_value=0.0),
    st.just(math.nan),
    st.just(math.inf),
    st.text(max_size=2),
    st.booleans(),
    st.just([1.0]),
)


def _scalar_calls():
    net = mlp()
    model = ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), GAUSS)
    guide, gnet = fitted()["guide"]
    return (
        net,
        gnet,
        {
            "batch_size": lambda v: ps.fit_map(net, GAUSS, X, Y, batch_size=v, progress=False),
            "max_iter": lambda v: infer.AutoSubspaceLaplace(model).fit(X, Y, max_iter=v),
            "chunk_size": lambda v: infer.AutoSubspaceLaplace(model, chunk_size=v),
            "num_samples": lambda v: infer.linearized_predictive(guide, X, num_samples=v),
            "max_shrinks": lambda v: infer.EllipticalSliceSampler(model, max_shrinks=v),
            "rank": lambda v: subspaces.random(net, v),
            "subsample_size": lambda v: model(X, Y, subsample_size=v),
            "n_components": lambda v: ps.PatchedNet(net, GAUSS, n_components=v),
        },
        {
            "lr": lambda v: ps.fit_map(net, GAUSS, X, Y, lr=v, progress=False),
            "temperature": lambda v: ps.SubspaceNet(net, model.subspace, GAUSS, temperature=v),
            "prior_scale": lambda v: ps.SubspaceNet(net, model.subspace, GAUSS, prior_scale=v),
            "prior_precision": lambda v: infer.Laplace(net, GAUSS, prior_precision=v, hessian_structure="full"),
            "sigma_init": lambda v: likelihoods.Gaussian(sigma_init=v),
            "tol": lambda v: infer.AutoSubspaceLaplace(model).fit(X, Y, tol=v),
        },
    )


INT_ARGS = sorted(_scalar_calls()[2])
FLOAT_ARGS = sorted(_scalar_calls()[3])


@pytest.mark.parametrize("arg", INT_ARGS)
@FAST
@given(value=NOT_POSITIVE_INT)
def test_bad_counts_are_named(arg, value):
    net, gnet, calls, _ = _scalar_calls()
    gnet.calls = 0
    _assert_named(lambda: calls[arg](value), [net, gnet], arg)


@pytest.mark.parametrize("arg", FLOAT_ARGS)
@FAST
@given(value=NOT_POSITIVE_FLOAT)
def test_bad_positive_numbers_are_named(arg, value):
    net, gnet, _, calls = _scalar_calls()
    _assert_named(lambda: calls[arg](value), [net, gnet], arg)
