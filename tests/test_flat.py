import copy

import pytest
import torch
from torch import nn

from pyro_subspace.flat import FlatNet, eval_mode, num_weights, preserved, train_mode


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


def test_preserved_restores_modes_and_buffers_on_an_exception():
    net = make_bn_net()
    net[1].eval()
    modes = [m.training for m in net.modules()]
    saved = [b.clone() for b in net.buffers()]
    with pytest.raises(RuntimeError, match="boom"):
        with preserved(net, buffers=True):
            net.train()
            net(torch.randn(16, 4) + 5)  # moves the running statistics
            assert not torch.equal(net[1].running_mean, saved[0])
            raise RuntimeError("boom")
    assert [m.training for m in net.modules()] == modes
    assert all(torch.equal(a, b) for a, b in zip(saved, net.buffers()))
    with train_mode(net):  # buffers are not kept by train_mode: training updates them
        assert all(m.training for m in net.modules())
        net(torch.randn(16, 4) + 5)
    assert [m.training for m in net.modules()] == modes
    assert not torch.equal(net[1].running_mean, saved[0])


def test_preserved_refresh_saves_again_in_place_and_restore_returns_to_it():
    """`Preserved.refresh` (fit_map's per-epoch checkpoint) re-saves every weight and buffer,
    the integer ``num_batches_tracked`` included, into the copies it already holds; `restore`
    then puts back the refreshed values, not the first ones."""
    net = make_bn_net()
    with preserved(net, buffers=True, weights=True) as state:
        copies = [v.data_ptr() for _, v in state.saved_tensors]
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        net(torch.randn(16, 4))  # moves the running statistics and the batch count
        middle = {k: v.clone() for k, v in net.state_dict().items()}
        state.refresh()
        assert [v.data_ptr() for _, v in state.saved_tensors] == copies
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(3.0)
        net(torch.randn(16, 4))
        state.restore()
        for k, v in net.state_dict().items():
            assert torch.equal(v, middle[k]), k
        assert int(net[1].num_batches_tracked) == int(middle["1.num_batches_tracked"]) == 4


def _copy_with(net, params=None, buffers=None):
    """An independent evaluation: a deep copy of ``net`` with some tensors overwritten."""
    other = copy.deepcopy(net)
    state = other.state_dict()
    with torch.no_grad():
        for k, v in {**(params or {}), **(buffers or {})}.items():
            state[k].copy_(v)
    return other


def test_evaluate_overrides_some_parameters_and_per_draw_buffers():
    net = make_bn_net().eval()
    flat = FlatNet(net, batch_strategy="vmap")
    x = torch.randn(9, 4)
    new = {"3.weight": torch.randn(2, 8)}
    torch.testing.assert_close(flat.evaluate(new, x), _copy_with(net, new)(x), rtol=0, atol=0)
    # two draws, each with its own weight and its own BatchNorm running mean
    w = torch.randn(2, 2, 8)
    means = torch.randn(2, 8)
    expected = torch.stack(
        [_copy_with(net, {"3.weight": w[i]}, {"1.running_mean": means[i]})(x) for i in range(2)]
    )
    for strategy in ("vmap", "loop"):
        got = FlatNet(net, batch_strategy=strategy).evaluate(
            {"3.weight": w}, x, {"1.running_mean": means}
        )
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no parameter named 'nope'"):
        flat.evaluate({"nope": w}, x)
    with pytest.raises(ValueError, match=r"'3.weight' must have shape"):
        flat.evaluate({"3.weight": torch.randn(8, 2)}, x)
    with pytest.raises(ValueError, match="no buffer named"):
        flat.evaluate({"3.weight": w}, x, {"1.bogus": means})


def test_a_batch_in_training_mode_updates_batchnorm_draw_by_draw():
    net = make_bn_net()
    reference = copy.deepcopy(net)
    flat = FlatNet(net, batch_strategy="vmap")  # vmap cannot update buffers: a loop is used
    w = flat.vector() + 0.1 * torch.randn(3, flat.num_weights)
    x = torch.randn(12, 4)
    got = flat(w, x)
    expected = []
    for i in range(3):
        nn.utils.vector_to_parameters(w[i], reference.parameters())
        expected.append(reference(x))
    torch.testing.assert_close(got, torch.stack(expected).detach())
    torch.testing.assert_close(net[1].running_mean, reference[1].running_mean)
    assert int(net[1].num_batches_tracked) == int(reference[1].num_batches_tracked)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_recompute_batchnorm_sets_the_statistics_of_the_data_at_w(chunk_size):
    net = make_bn_net()
    net[1].eval()
    net[1].momentum = 0.3
    flat = FlatNet(net)
    w = flat.vector() + 0.2 * torch.randn(flat.num_weights)
    x = torch.randn(13, 4) * 2
    flat.recompute_batchnorm(w, x, chunk_size=chunk_size)
    h = x @ flat.unflatten(w)["0.weight"].T + flat.unflatten(w)["0.bias"]  # the BN inputs
    chunks = [h] if chunk_size is None else list(h.split(chunk_size))
    sizes = torch.tensor([float(c.shape[0]) for c in chunks])
    mean = sum(s * c.mean(0) for s, c in zip(sizes, chunks)) / sizes.sum()
    var = sum(s * c.var(0) for s, c in zip(sizes, chunks)) / sizes.sum()  # unbiased per chunk
    torch.testing.assert_close(net[1].running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net[1].running_var, var, rtol=1e-5, atol=1e-6)
    assert net[1].momentum == 0.3 and net.training and not net[1].training
    with pytest.raises(ValueError, match="chunk_size"):
        flat.recompute_batchnorm(w, x, chunk_size=0)


def test_plain_mlp_path_gives_functional_calls_numbers_and_respects_hooks():
    """An ``nn.Sequential`` of Linear layers and elementwise activations is evaluated layer by
    layer (`FlatNet._plain_forward`): bit-identical to ``functional_call``, for one and for a
    batch of weight vectors; a registered hook sends it back through the modules' calls."""
    from torch.func import functional_call

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.GELU(),
                        nn.Linear(8, 2))  # fmt: skip
    flat = FlatNet(net)
    assert flat.mode_free and not FlatNet(nn.Sequential(nn.Linear(3, 2), nn.Dropout())).mode_free
    w, x = torch.randn(4, flat.num_weights), torch.randn(5, 3)
    want = torch.stack([functional_call(net, flat.unflatten(w[i]), (x,)) for i in range(4)])
    assert torch.equal(flat(w, x), want) and torch.equal(flat(w[1], x), want[1])
    handle = net[2].register_forward_hook(lambda m, i, o: 2 * o)
    try:
        hooked = flat(w[1], x)
        assert torch.equal(hooked, functional_call(net, flat.unflatten(w[1]), (x,)))
        assert not torch.equal(hooked, want[1])
    finally:
        handle.remove()
    part = {"0.weight": w[0, :24].view(8, 3)}  # a subset: the others keep the net's own
    assert torch.equal(flat.evaluate(part, x), functional_call(net, part, (x,)))


def test_load_vector_copies_and_never_ties_the_weights_to_the_vector():
    """``load_vector(w)`` copies: afterwards a write into ``w`` leaves the network as it was,
    a training step leaves ``w`` as it was, and each parameter keeps its own storage (an
    optimiser's references stay valid). torch's ``vector_to_parameters`` makes the parameters
    views of the vector, which tied a network to an SWA mean it was loaded from."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    flat = FlatNet(net)
    storages = [p.data_ptr() for p in net.parameters()]
    w = torch.randn(flat.num_weights)
    kept = w.clone()
    flat.load_vector(w)
    torch.testing.assert_close(flat.vector(), kept, rtol=0, atol=0)
    assert [p.data_ptr() for p in net.parameters()] == storages
    w.add_(1.0)  # the caller's vector changes: the network does not
    torch.testing.assert_close(flat.vector(), kept, rtol=0, atol=0)
    w.copy_(kept)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(2.0)  # a training step changes the network: not the vector
    torch.testing.assert_close(w, kept, rtol=0, atol=0)
