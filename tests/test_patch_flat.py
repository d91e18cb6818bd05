"""`nn.patch_flat` and the training paths built on it, against the per-tensor computations.

The flat means and one gather must give the numbers of `PatchFamily.select` slot by slot; the
whole-tensor laws those of Pyro's ``Categorical``/``Bernoulli``/``Normal``/``Delta``; the fused
``Trace_ELBO`` loss and gradient those of the per-site (`PatchedNet.forward`, `PatchedNet.guide`)
pair at the same draw; and training from the same seed the means of the per-slot
implementations (`PatchedNet.negative_elbo` with one Adam group per decay, as `fit` was; an SVI
over per-slot ``pyro.param`` sites with Pyro's per-parameter Adam).
"""

import copy
import io
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_subspace import PatchedNet, likelihoods
from pyro_subspace.minibatch import minibatch_loop, shuffle_generator
from pyro_subspace.nn import patch_flat

pytestmark = pytest.mark.usefixtures("one_thread")
MODES = ["emp", "ecmp", "dropout", "dropconnect", "ensemble"]


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 5),
        nn.ReLU(), nn.Linear(5, 3),
    )  # fmt: skip


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6),
        nn.ReLU(), nn.Linear(6, 3),
    )  # fmt: skip


def data(n=40, seed=1, image=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 3, 3, generator=g) if image else torch.randn(n, 4, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("mode", MODES)
def test_select_is_per_slot_select_and_means_alias(mode):
    model = PatchedNet(conv_net(), likelihoods.Categorical(), mode=mode, n_components=3)
    lay, flat = patch_flat.layout(model), patch_flat.flat_means(model)
    assert flat.numel() == model.num_variational_parameters
    for _ in range(4):
        z = lay.draw(flat)
        zs = lay.split_assignments(z)
        ref = [model.family.select(s, model.means()[s.name], zs, ()) for s in model.slots]
        assert torch.equal(lay.select(flat, z), torch.cat([r.reshape(-1) for r in ref]))
    with torch.no_grad():  # the per-slot parameters are the blocks of the flat means
        flat.mul_(2.0)
    assert torch.equal(torch.cat([p.reshape(-1) for p in model.means().values()]), flat)


def test_flat_means_survive_copies_conversions_and_loading():
    model = PatchedNet(mlp(), likelihoods.Categorical(), mode="ecmp")
    keys = list(model.state_dict())
    flat = patch_flat.flat_means(model)
    assert list(model.state_dict()) == keys  # no new state
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (twin, loaded, model.double()):
        f = patch_flat.flat_means(other)
        assert f.dtype == next(iter(other.means().values())).dtype
        assert torch.equal(f.detach(), torch.cat([p.reshape(-1) for p in other.means().values()]))
    assert patch_flat.flat_means(model) is not flat  # rebuilt after double()
    state = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # in place: seen through the flat means
    f = patch_flat.flat_means(model)
    assert torch.equal(f.detach(), torch.cat([p.reshape(-1) for p in model.means().values()]))
    assert torch.equal(model.state_dict()[keys[0]], state[keys[0]])


def test_whole_tensor_laws_equal_pyro_laws():
    like = torch.zeros((), dtype=torch.float64)
    u = patch_flat.UniformAssignments(7, 5, like)
    z = u.sample()
    ref = dist.Categorical(probs=torch.full((5,), 0.2, dtype=torch.float64)).expand([7])
    torch.testing.assert_close(u.log_prob(z), ref.to_event(1).log_prob(z))
    assert z.shape == (7,) and z.dtype == torch.int64 and 0 <= int(z.min()) and int(z.max()) <= 4
    for keep in (0.3, 1.0):
        b = patch_flat.BernoulliAssignments(9, keep, like)
        m = b.sample((3,))
        want = dist.Bernoulli(probs=torch.tensor(keep, dtype=torch.float64)).expand([9])
        torch.testing.assert_close(
            b.log_prob(m), want.to_event(1).log_prob(m), atol=1e-12, rtol=1e-12
        )
    w = torch.randn(2, 6, dtype=torch.float64)
    taus = torch.tensor([1.0, 1.0, 2.0, 2.0, 0.5, 0.5], dtype=torch.float64)
    for prec in (3.0, taus):
        got = patch_flat.FlatNormalPrior(prec, 6, like).log_prob(w)
        scale = torch.as_tensor(prec, dtype=torch.float64) ** -0.5
        want = dist.Normal(torch.zeros(6, dtype=torch.float64), scale).to_event(1).log_prob(w)
        torch.testing.assert_close(got, want)
    assert float(patch_flat.FlatNormalPrior(3.0, 6, like).log_prob(w[0])) == pytest.approx(
        float(dist.Normal(0.0, 3.0**-0.5).log_prob(w[0]).sum())
    )
    v = torch.randn(5)
    pm = patch_flat.PointMass(v)
    assert pm.rsample() is v and float(pm.log_prob(pm.rsample())) == 0.0
    assert float(pm.log_prob(v.clone())) == 0.0  # equal values elsewhere: Delta's answer
    assert float(pm.log_prob(v + 1)) == -math.inf


def fused_trace_from_per_site(model, tr, x, y):
    """A fused-guide trace whose ``"z"``, ``"w"`` are the per-site guide's draws, flattened, with
    ``w = M_z + σε`` reparameterised through the flat means (the same ``ε``)."""
    sites = model.family.assignment_sites()
    z = torch.cat([tr.nodes[name]["value"].reshape(-1) for name, _, _ in sites])
    zs = {name: tr.nodes[name]["value"] for name, _, _ in sites}
    w = torch.cat([tr.nodes[s.site]["value"].reshape(-1) for s in model.slots])
    loc = [model.family.select(s, m, zs, ()) for s, m in zip(model.slots, model.means().values())]
    eps = (w - torch.cat([m.reshape(-1) for m in loc])).detach()  # σε of the per-site draw
    w = patch_flat.layout(model).select(patch_flat.flat_means(model), z) + eps
    ftr = pyro.poutine.trace(model.fused_guide).get_trace(x, y)
    ftr.nodes["z"]["value"], ftr.nodes["w"]["value"] = z, w
    return ftr


@pytest.mark.parametrize(
    "mode, sigma, taus",
    [("emp", 0.0, 2.0), ("ecmp", 0.0, {"": 2.0, "3": 0.5}), ("ecmp", 0.05, 2.0),
     ("dropout", 0.0, 1.5), ("ensemble", 0.02, 1.0)],
)  # fmt: skip
def test_fused_loss_and_gradient_equal_per_site_at_the_same_draw(mode, sigma, taus):
    """Trace_ELBO over the whole-tensor pair = over the per-site pair, value and gradient."""
    model = PatchedNet(
        mlp(), likelihoods.Categorical(), mode=mode, n_components=3, sigma=sigma,
        prior_precision=taus, init_jitter=0.3,
    ).train()  # fmt: skip
    x, y = data(16)
    params = [model._parameters[s.key] for s in model.slots]
    for seed in range(3):
        pyro.set_rng_seed(seed)
        tr = pyro.poutine.trace(model.guide).get_trace(x, y)
        state = {k: v.clone() for k, v in model.named_buffers()}  # BatchNorm: same statistics
        per_site = Trace_ELBO().differentiable_loss(
            model, pyro.poutine.replay(model.guide, trace=tr), x, y
        )
        grads = torch.autograd.grad(per_site, params)
        for k, v in model.named_buffers():
            v.copy_(state[k])
        ftr = fused_trace_from_per_site(model, tr, x, y)
        guide = pyro.poutine.replay(model.fused_guide, trace=ftr)
        fused = Trace_ELBO().differentiable_loss(model.fused_model, guide, x, y)
        assert float(fused) == pytest.approx(float(per_site), rel=1e-6)
        (g,) = torch.autograd.grad(fused, [patch_flat.flat_means(model)])
        # σ > 0: ∇ log q cancels terms of size |ε|/σ ~ 50 exactly only in exact arithmetic:
        # float32 leaves ~50 × 6e-8 of them
        atol = 1e-6 if sigma == 0 else 2e-5
        for gf, gp in zip(g.split([p.numel() for p in params]), grads):
            torch.testing.assert_close(gf.view(gp.shape), gp, rtol=1e-5, atol=atol)


def per_slot_fit(model, x, y, epochs, lr, batch_size, seed):
    """`PatchedNet.fit(method="torch")` as it was: per-slot `negative_elbo`, one Adam group per
    weight decay, the same minibatches and the same random draws."""
    n = x.shape[0]
    model.sample_outputs(x[:1], 1)  # the draw fit makes to check the targets
    groups = {}
    for k, v in model.weight_decays(n).items():
        groups.setdefault(v, []).append(model._parameters[k])
    opt = torch.optim.Adam([{"params": p, "weight_decay": v} for v, p in groups.items()], lr=lr)
    model.train()
    minibatch_loop(
        lambda idx: model.negative_elbo(x[idx], y[idx], num_data=n, include_penalty=False) / n,
        n, epochs=epochs, batch_size=batch_size, generator=shuffle_generator(seed),
        optimizer=opt, min_batch_size=2, epoch_loss="batches",
    )  # fmt: skip


@pytest.mark.parametrize(
    "mode, sigma",
    [("emp", 0.0), ("ecmp", 0.0), ("ecmp", 0.01), ("dropout", 0.0), ("ensemble", 0.0)],
)
def test_fit_equals_per_slot_training_from_the_same_seed(mode, sigma):
    """In float64: fit's Adam is PyTorch's fused kernel, the reference the per-tensor one; the
    same update to rounding, which Adam's ``m/√v`` of near-zero gradients amplifies (float32:
    differences up to 3.5e-5 after these 12 steps; float64: at most 1.4e-17)."""
    x, y = data(50)
    x = x.double()
    models = [
        PatchedNet(mlp().double(), likelihoods.Categorical(), mode=mode, n_components=3,
                   sigma=sigma)
        for _ in range(2)
    ]  # fmt: skip
    torch.manual_seed(7)
    models[0].fit(x, y, epochs=4, lr=1e-2, batch_size=16, seed=3)
    torch.manual_seed(7)
    per_slot_fit(models[1], x, y, epochs=4, lr=1e-2, batch_size=16, seed=3)
    start = PatchedNet(mlp().double(), likelihoods.Categorical(), mode=mode, n_components=3).means()
    for k, m in models[0].means().items():
        torch.testing.assert_close(m, models[1].means()[k], rtol=1e-5, atol=1e-6)
        assert not torch.equal(m, start[k]) or mode == "dropout"  # trained
    for (k, b0), b1 in zip(models[0].named_buffers(), models[1].buffers()):
        torch.testing.assert_close(b0, b1, rtol=1e-5, atol=1e-6, msg=k)


def per_slot_svi(model, x, y, epochs, lr, batch_size, seed):
    """SVI over the whole-tensor sites as they were: one ``pyro.param`` per mean tensor, the
    ``Normal`` prior and ``Delta`` guide of every weight, Pyro's Adam per parameter."""
    n, lay, lik = x.shape[0], patch_flat.layout(model), model.likelihood
    scales = torch.cat([torch.full((s.numel,), s.precision**-0.5) for s in model.slots])
    init = {s.key: m.detach().clone() for s, m in zip(model.slots, model.means().values())}

    def ref_model(x, y, num_data):
        pyro.sample("z", lay.assignment_law(scales))
        w = pyro.sample("w", dist.Normal(0.0, scales).to_event(1))
        with pyro.plate("data", num_data, subsample=torch.arange(x.shape[0])):
            return lik.observe(model.outputs(lay.split(w), x), y, model.temperature)

    def ref_guide(x, y, num_data):
        z = lay.split_assignments(pyro.sample("z", lay.assignment_law(scales)))
        means = [pyro.param("ref." + s.key, init[s.key]) for s in model.slots]
        loc = torch.cat(
            [model.family.select(s, m, z, ()).reshape(-1) for s, m in zip(model.slots, means)]
        )
        pyro.sample("w", dist.Delta(loc, event_dim=1))

    svi = SVI(ref_model, ref_guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    model.sample_outputs(x[:1], 1)  # the draw fit makes to check the targets
    model.train()
    minibatch_loop(
        lambda idx: svi.step(x[idx], y[idx], n), n, epochs=epochs, batch_size=batch_size,
        generator=shuffle_generator(seed), min_batch_size=2, epoch_loss="batches",
    )  # fmt: skip
    return {s.name: pyro.param("ref." + s.key).detach() for s in model.slots}


@pytest.mark.parametrize("mode", ["emp", "ecmp"])
def test_fit_svi_equals_per_slot_svi_from_the_same_seed(mode):
    x, y = data(50)
    models = [PatchedNet(mlp(), likelihoods.Categorical(), mode=mode, sigma=0.0) for _ in range(2)]
    torch.manual_seed(7)
    models[0].fit(x, y, epochs=4, lr=1e-2, batch_size=16, seed=3, method="svi")
    torch.manual_seed(7)
    ref = per_slot_svi(models[1], x, y, epochs=4, lr=1e-2, batch_size=16, seed=3)
    start = models[1].means()
    for k, m in models[0].means().items():
        torch.testing.assert_close(m, ref[k], rtol=1e-4, atol=1e-5)
        assert not torch.equal(m, start[k])


@pytest.mark.parametrize("mode", ["emp", "ensemble", "ecmp", "dropout", "dropconnect"])
def test_pick_is_select_cut_into_slots_with_the_same_flat_gradient(mode):
    """The per-slot picks (the parameter, its drawn component, ECMP's one gather) give
    `select`'s numbers slot by slot, and inside `shared_gradient` their backward pass leaves
    `select`'s gradient in the flat means' ``.grad`` (accumulated in place into the per-slot
    gradients, views of one buffer); the per-slot gradients are restored afterwards."""
    torch.manual_seed(0)
    model = PatchedNet(mlp(), likelihoods.Categorical(), mode=mode, n_components=3)
    lay, flat = patch_flat.layout(model), patch_flat.flat_means(model)
    params = [model._parameters[s.key] for s in model.slots]
    assert (lay.plan is not None) == (mode in ("emp", "ensemble", "ecmp"))
    if lay.plan is None:
        assert lay.pick(flat, params, lay.draw(flat)) is None  # a mask: `select`
        return
    with patch_flat.shared_gradient(model) as buffer:
        assert flat.grad is buffer and not buffer.any()
        for _ in range(4):
            z = lay.draw(flat)
            weights = [torch.randn(s.shape) for s in model.slots]  # a random linear functional
            got = lay.pick(flat, params, z)
            assert [w.shape for w in got] == [s.shape for s in model.slots]
            want = lay.select(flat, z)
            assert torch.equal(torch.cat([w.reshape(-1) for w in got]), want)
            (g_want,) = torch.autograd.grad(
                (want * torch.cat([w.reshape(-1) for w in weights])).sum(), flat
            )
            buffer.zero_()
            sum((w * c).sum() for w, c in zip(got, weights)).backward()
            assert flat.grad is buffer and torch.equal(buffer, g_want)
    assert all(p.grad is None for p in params)
