"""Persistence contract: every fitted object round-trips through ``state_dict`` exactly.

`PersistenceContract` is the suite; each object is tested by a subclass named ``Test...`` that
builds the fitted object, a freshly built one to load into, and says what a user reads from it:

    class TestMyGuide(PersistenceContract):
        def fitted(self):           # deterministic: built and fitted from fixed seeds
            ...
        def fresh(self):            # built the same way (same constructor arguments, another
            ...                     # initialisation), never fitted
        def outputs(self, obj):     # tensors / numbers / tuples / dicts of them: predictions,
            ...                     # draws at a fixed seed, everything the object is used for

Both round trips, ``fresh.load_state_dict(obj.state_dict())`` and through ``torch.save`` /
``torch.load(path, weights_only=True)``, must give bit-identical outputs (``torch.equal``, same
dtype). The fresh object must not already give them (or must refuse to, being unfitted), so a
test cannot pass by loading nothing. Other test files reuse it with
``from test_persistence import PersistenceContract``.
"""

from __future__ import annotations

from typing import ClassVar

import pyro
import pytest
import torch
from pyro.infer import Predictive
from torch import nn

from pyro_subspace import FlatNet, SubspaceNet, likelihoods, subspaces
from pyro_subspace.infer import SWAG, MultiSWAG
from pyro_subspace.subspaces import Subspace, SWACollector

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_identical(actual: object, expected: object, where: str = "outputs") -> None:
    """Recursive bit-for-bit equality of tensors (same dtype and shape), numbers and containers."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {actual!r}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual, expected), f"{where}: tensors differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, type(expected)) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _identical(actual: object, expected: object) -> bool:
    try:
        assert_identical(actual, expected)
    except AssertionError:
        return False
    return True


class PersistenceContract:
    """The suite; subclasses implement `fitted`, `fresh` and `outputs` (module docstring)."""

    def fitted(self) -> nn.Module:
        raise NotImplementedError

    def fresh(self) -> nn.Module:
        raise NotImplementedError

    def outputs(self, obj: nn.Module) -> object:
        raise NotImplementedError

    def _check_fresh_differs(self, fresh: nn.Module, expected: object) -> None:
        try:
            before = self.outputs(fresh)
        except (RuntimeError, ValueError):
            return  # unfitted objects may refuse to predict: that differs too
        assert not _identical(before, expected), "fresh() already gives the fitted outputs"

    def test_state_dict_round_trip(self) -> None:
        obj = self.fitted()
        expected = self.outputs(obj)
        new = self.fresh()
        self._check_fresh_differs(new, expected)
        new.load_state_dict(obj.state_dict())  # strict: no missing or unexpected keys
        assert_identical(self.outputs(new), expected)

    def test_torch_save_load_weights_only_round_trip(self, tmp_path) -> None:
        obj = self.fitted()
        expected = self.outputs(obj)
        path = tmp_path / "state.pt"
        torch.save(obj.state_dict(), path)
        new = self.fresh()
        new.load_state_dict(torch.load(path, weights_only=True))
        assert_identical(self.outputs(new), expected)


# ---------------------------------------------------------------- subspaces


class TestDenseSubspace(PersistenceContract):
    def fitted(self):
        gen = torch.Generator().manual_seed(0)
        return Subspace(torch.randn(9, generator=gen), torch.randn(9, 3, generator=gen))

    def fresh(self):
        return Subspace(torch.zeros(9), torch.ones(9, 3))

    def outputs(self, sub):
        t = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -0.25]])
        return sub.weights(t), sub.transpose_apply(torch.arange(9.0)), sub.kind


class TestIndexSubspace(TestDenseSubspace):
    def fitted(self):
        return Subspace(torch.randn(9, generator=torch.Generator().manual_seed(1)),
                        torch.tensor([7, 2, 5]))  # fmt: skip

    def fresh(self):
        return Subspace(torch.zeros(9), torch.arange(3))


# ---------------------------------------------------------------- SubspaceNet


def _bn_net(seed: int, d_in: int = 3, d_out: int = 1) -> nn.Module:
    """A small network with BatchNorm; a few training-mode passes move its running statistics."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(d_in, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, d_out))
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, d_in) + seed)
    return net


class TestSubspaceNet(PersistenceContract):
    x = torch.linspace(-1, 1, 30).reshape(10, 3)

    def _model(self, seed, sigma, prior_scale):
        net = _bn_net(seed)
        sub = subspaces.random(net, 4, seed=seed)
        return SubspaceNet(net, sub, likelihoods.Gaussian(sigma=sigma), prior_scale=prior_scale)

    def fitted(self):
        return self._model(0, sigma=0.3, prior_scale=0.5)

    def fresh(self):
        return self._model(1, sigma=1.0, prior_scale=1.0)

    def outputs(self, model):
        t = torch.linspace(-1, 1, 12).reshape(3, 4)
        pyro.set_rng_seed(0)
        pred = Predictive(model, posterior_samples={"t": t}, return_sites=["obs", "f"])(self.x)
        return model.outputs(t, self.x), pred, model.prior_scale


# ---------------------------------------------------------------- SWACollector


def _run_trajectory(collector: SWACollector, steps: int, seed: int) -> None:
    """Random-walk the collector's network weights (a stand-in for SGD), collecting each step;
    training-mode passes move any BatchNorm statistics."""
    flat, gen = collector.flat, torch.Generator().manual_seed(seed)
    w0 = flat.vector()
    d_in = next(flat.net.parameters()).shape[1]
    for _ in range(steps):
        flat.load_vector(w0 + 0.1 * torch.randn(w0.shape, generator=gen))
        with torch.no_grad():
            flat.net(torch.randn(16, d_in, generator=gen))
        collector.collect()


class TestSWACollector(PersistenceContract):
    kwargs: ClassVar[dict] = {"max_snapshots": 4}  # 7 snapshots: the ring of the last 4 has wrapped

    def fitted(self):
        col = SWACollector(_bn_net(0), **self.kwargs)
        _run_trajectory(col, 7, seed=0)
        return col

    def fresh(self):
        return SWACollector(_bn_net(1), **self.kwargs)

    def outputs(self, col):
        sub = subspaces.pca(col, rank=2, seed=0)
        stats = (col.mean, col.variance, col.deviations, col.covariance_factor())
        return col.n_collected, col.num_snapshots, stats, (sub.shift, sub.basis)

    def test_collecting_continues_after_reload(self):
        col = self.fitted()
        new = SWACollector(_bn_net(0), **self.kwargs)
        new.load_state_dict(col.state_dict())
        FlatNet(new.flat.net).load_vector(col.flat.vector())  # both networks at the same weights
        _run_trajectory(col, 3, seed=5)
        _run_trajectory(new, 3, seed=5)
        assert_identical(self.outputs(new), self.outputs(col))


class TestFrequentDirectionsCollector(TestSWACollector):
    kwargs: ClassVar[dict] = {
        "method": "frequent_directions",
        "rank": 3,
    }  # 7 rows: the sketch has shrunk


# ---------------------------------------------------------------- SWAG, MultiSWAG


def _filled_collector(seed: int) -> SWACollector:
    col = SWACollector(_bn_net(seed, d_in=2, d_out=3), max_snapshots=5)
    _run_trajectory(col, 7, seed=seed)
    return col


class TestSWAG(PersistenceContract):
    x = torch.linspace(-2, 2, 14).reshape(7, 2)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])

    def fitted(self):
        return SWAG(_filled_collector(0), likelihoods.Categorical(), num_samples=6, seed=3)

    def fresh(self):
        col = SWACollector(_bn_net(1, d_in=2, d_out=3), max_snapshots=5)
        return SWAG(col, likelihoods.Categorical(), num_samples=6, seed=3)

    def outputs(self, swag):
        torch.manual_seed(11)  # seed=None draws from the global generator: the same after reload
        unseeded = SWAG(swag.collector, swag.likelihood, seed=None).sample_weights(2)
        return swag.sample_weights(), unseeded, swag.predict(self.x).probs, swag.log_prob(self.x, self.y)


class TestMultiSWAG(TestSWAG):
    def fitted(self):
        cols = [_filled_collector(0), _filled_collector(1)]
        return MultiSWAG(cols, likelihoods.Categorical(), num_samples=4, seed=3)

    def fresh(self):
        cols = [SWACollector(_bn_net(s, d_in=2, d_out=3), max_snapshots=5) for s in (2, 3)]
        return MultiSWAG(cols, likelihoods.Categorical(), num_samples=4, seed=3)

    def outputs(self, multi):
        weights, probs = multi.components(self.x)
        return weights, probs, multi.predict(self.x).probs, multi.log_prob(self.x, self.y)
