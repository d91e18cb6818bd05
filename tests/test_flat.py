import pytest
import torch
from torch import nn

from pyro_subspace.flat import FlatNet, eval_mode, num_weights


def make_bn_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    net.train()
    for _ in range(3):  # give BatchNorm non-trivial running statistics
        net(torch.randn(32, 4) * 3 + 1)
    return net


def test_flat_order_and_values_match_the_module():
    net = make_bn_net()
    flat = FlatNet(net)
    w = flat.vector()
    assert torch.equal(w, nn.utils.parameters_to_vector(net.parameters()))
    assert flat.num_weights == num_weights(net) == w.numel()
    x = torch.randn(10, 4)
    with eval_mode(net):
        expected = net(x)  # running statistics used, as the functional call must
        got = flat(w, x)
    assert torch.allclose(got, expected, atol=1e-6)
    parts = flat.unflatten(w)
    for name, p in net.named_parameters():
        assert torch.equal(parts[name], p.detach())


@pytest.mark.parametrize("strategy", ["vmap", "loop", "auto"])
def test_batched_weights_equal_a_loop_over_weights(strategy):
    net = make_bn_net()
    flat = FlatNet(net, batch_strategy=strategy)
    w = flat.vector() + 0.1 * torch.randn(3, 2, flat.num_weights)
    x = torch.randn(7, 4)
    with eval_mode(net):
        batched = flat(w, x)
        looped = torch.stack([torch.stack([flat(w[i, j], x) for j in range(2)]) for i in range(3)])
        chunked = flat.chunked(w, x, chunk_size=3)
    assert batched.shape == (3, 2, 7, 2)
    assert torch.allclose(batched, looped, atol=1e-6)
    assert torch.allclose(chunked, batched, atol=1e-6)


def test_functional_call_leaves_parameters_and_modes_untouched():
    net = make_bn_net()
    before = nn.utils.parameters_to_vector(net.parameters()).clone()
    net[1].eval()  # a mixed mode the user chose
    flat = FlatNet(net)
    with eval_mode(net):
        flat(torch.zeros(flat.num_weights), torch.randn(5, 4))
    assert torch.equal(nn.utils.parameters_to_vector(net.parameters()), before)
    assert net.training and net[0].training and not net[1].training


def test_load_vector_round_trip_and_errors():
    net = make_bn_net()
    flat = FlatNet(net)
    w = torch.randn(flat.num_weights)
    flat.load_vector(w)
    assert torch.equal(flat.vector(), w)
    with pytest.raises(ValueError, match="w: expected shape"):
        flat.load_vector(torch.randn(flat.num_weights + 1))
    with pytest.raises(TypeError, match="net"):
        FlatNet("not a module")
    with pytest.raises(ValueError, match="batch_strategy"):
        FlatNet(net, batch_strategy="pmap")
    with pytest.raises(ValueError, match="chunk_size"):
        flat.chunked(w, torch.randn(3, 4), chunk_size=0)
