"""PatchedNet persistence: the means and the BatchNorm running statistics round-trip through
``state_dict`` into a freshly built PatchedNet and through ``torch.save``/``torch.load`` with
``weights_only=True``, and the predictions after reload are bit-identical."""

import pyro
import pytest
import torch
from torch import nn

from pyro_subspace import PatchedNet, likelihoods

pytestmark = pytest.mark.usefixtures("one_thread")


def bn_net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)
    )


def data(n=40):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g) * 2 + 1, torch.randint(0, 3, (n,), generator=g)


def trained(mode, sigma):
    x, y = data()
    kwargs = dict(mode=mode, n_components=3, sigma=sigma, drop_prob=0.3, seed=2)
    model = PatchedNet(bn_net(0), likelihoods.Categorical(), **kwargs)
    torch.manual_seed(0)
    model.fit(x, y, epochs=4, batch_size=16, lr=1e-2, seed=0)
    return model, kwargs, x


def predictions(model, x):
    torch.manual_seed(7)
    return model.predictive_mean(x, 9)


@pytest.mark.parametrize(
    "mode, sigma", [("emp", 0.0), ("ecmp", 0.01), ("dropout", 0.0), ("ensemble", 0.01)]
)
def test_state_dict_round_trip_through_torch_save_predicts_bit_identically(mode, sigma, tmp_path):
    model, kwargs, x = trained(mode, sigma)
    state = model.state_dict()
    bn_keys = {"buf_1__running_mean", "buf_1__running_var", "buf_1__num_batches_tracked"}
    assert bn_keys <= set(state)
    if mode == "ensemble":  # one set of statistics per member
        assert state["buf_1__running_mean"].shape == (3, 6)
    else:  # the net's own statistics, updated by training
        assert torch.equal(state["buf_1__running_mean"], model.net[1].running_mean)
        assert int(state["buf_1__num_batches_tracked"]) == 12
    expected = predictions(model, x)
    torch.save(state, tmp_path / "patched.pt")
    loaded = torch.load(tmp_path / "patched.pt", weights_only=True)

    pyro.clear_param_store()
    fresh = PatchedNet(bn_net(1), likelihoods.Categorical(), **kwargs)  # another initialisation
    assert not torch.equal(predictions(fresh, x), expected)
    fresh.load_state_dict(loaded)
    assert set(fresh.state_dict()) == set(state)
    for key, value in state.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    if mode != "ensemble":  # the statistics reached the fresh net itself
        assert torch.equal(fresh.net[1].running_var, model.net[1].running_var)
    assert torch.equal(predictions(fresh, x), expected)

    again = PatchedNet(bn_net(3), likelihoods.Categorical(), **kwargs)
    again.load_state_dict(model.state_dict())  # in memory, without a file
    assert torch.equal(predictions(again, x), expected)


def test_the_buffers_stay_the_nets_own_after_a_dtype_change():
    """``model.double()`` converts the net too, and training then updates the very statistics
    that ``state_dict`` saves."""
    model, _, x = trained("emp", 0.0)
    model.double()
    assert model.net[0].weight.dtype == torch.float64
    assert model.buf_1__running_mean is model.net[1].running_mean
    before = model.net[1].running_mean.clone()
    model.fit(x.double(), data()[1], epochs=1, batch_size=16, seed=1)
    assert not torch.equal(model.net[1].running_mean, before)
    assert torch.equal(model.state_dict()["buf_1__running_mean"], model.net[1].running_mean)
