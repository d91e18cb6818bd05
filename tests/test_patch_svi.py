"""`nn.patch_svi`: the whole-tensor model/guide, the joint optimiser and the swapped forward.

Checked against independent computations: the loss per draw by hand (NLL + log q − log p, with
each element's component looked up by a Python loop), gradients against autograd of that
hand loss, the joint optimiser against Pyro's one-optimiser-per-parameter Adam, and the swapped
forward against ``torch.func.functional_call``.
"""

import copy
import math

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from torch import nn
from torch.func import functional_call

from pyro_subspace import PatchedNet, likelihoods
from pyro_subspace.nn.patch_flat import flat_means
from pyro_subspace.nn.patch_svi import JointOptim, swapped_forward

pytestmark = pytest.mark.usefixtures("one_thread")


def small_bn_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))


def toy_batch(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randint(0, 3, (n,), generator=g)


def nll_sum(net, weights, x, y):
    out = functional_call(net, {**weights, **dict(net.named_buffers())}, (x,))
    return F.cross_entropy(out, y, reduction="sum")


def split_draw(model, tr):
    """Per-slot weights and per-site assignments from a trace of the fused guide."""
    w = tr.nodes["w"]["value"]
    parts = w.split([s.numel for s in model.slots])
    weights = {s.name: p.view(s.shape) for s, p in zip(model.slots, parts)}
    sites = model.family.assignment_sites()
    zs = tr.nodes["z"]["value"].split([math.prod(shape) for _, shape, _ in sites])
    return weights, {name: z.view(shape) for (name, shape, _), z in zip(sites, zs)}


def selected_mean_by_loop(model, slot, z):
    """The assigned component of every element of an ECMP slot, element by element."""
    m = model.means()[slot.name]
    if slot.kind == "shared":
        return m
    a = z[f"z.{slot.name}"].reshape(-1)
    flat = m.reshape(model.n_components, -1)
    return torch.stack([flat[int(a[i]), i] for i in range(flat.shape[1])]).view(slot.shape)


def test_fused_loss_per_draw_is_nll_plus_one_sample_kl():
    """ECMP, σ > 0, per-layer τ: Trace_ELBO on the fused pair = NLL + log q − log p by hand."""
    taus = {"": 2.0, "3": 0.5}
    lik = likelihoods.Categorical()
    model = PatchedNet(
        small_bn_net(), lik, mode="ecmp", n_components=3, prior_precision=taus, sigma=0.05
    ).train()
    x, y = toy_batch()
    pyro.set_rng_seed(3)
    loss = Trace_ELBO().differentiable_loss(model.fused_model, model.fused_guide, x, y, 40)
    pyro.set_rng_seed(3)  # the same draws: the guide runs first
    tr = pyro.poutine.trace(model.fused_guide).get_trace(x, y, 40)
    weights, z = split_draw(model, tr)
    kl, sig = 0.0, 0.05
    for s in model.slots:
        w, loc = weights[s.name], selected_mean_by_loop(model, s, z)
        assert ((w - loc).abs() < 6 * sig).all()  # drawn around the assigned mean
        tau = taus.get(s.module, taus[""])
        log_q = (-0.5 * ((w - loc) / sig) ** 2 - math.log(sig) - 0.5 * math.log(2 * math.pi)).sum()
        log_p = (-0.5 * tau * w**2 + 0.5 * math.log(tau) - 0.5 * math.log(2 * math.pi)).sum()
        kl = kl + log_q - log_p
    expected = nll_sum(model.net, weights, x, y) * 40 / 16 + kl  # num_data / batch scaling
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-3)


@pytest.mark.parametrize("mode", ["emp", "dropconnect"])
def test_fused_gradient_equals_hand_gradient(mode):
    """σ = 0: the gradient in the means is that of NLL(M_z) + Σ τ/2 ‖W‖² at the drawn z."""
    patches = "auto" if mode == "emp" else ["3"]
    lik = likelihoods.Categorical()
    model = PatchedNet(
        small_bn_net(), lik, patches, 3, mode, prior_precision=2.0, sigma=0.0
    ).train()
    x, y = toy_batch()
    pyro.set_rng_seed(5)
    loss = Trace_ELBO().differentiable_loss(model.fused_model, model.fused_guide, x, y)
    (flat_grad,) = torch.autograd.grad(loss, [flat_means(model)])  # the guide's one param
    params = [model._parameters[s.key] for s in model.slots]
    grads = flat_grad.split([p.numel() for p in params])
    pyro.set_rng_seed(5)
    _, z = split_draw(model, pyro.poutine.trace(model.fused_guide).get_trace(x, y))
    weights = {}
    for s, m in zip(model.slots, params):
        if s.kind == "shared":
            weights[s.name] = m
        elif mode == "emp":
            weights[s.name] = m[int(z[f"z.{s.module}"])]
        else:  # dropconnect: a {0, 1} mask per element
            weights[s.name] = m * z[f"z.{s.name}"]
    hand = nll_sum(model.net, weights, x, y) + sum(w.square().sum() for w in weights.values())
    for g, h in zip(grads, torch.autograd.grad(hand, params)):
        torch.testing.assert_close(g.view(h.shape), h, rtol=1e-5, atol=1e-6)


def test_joint_optimiser_matches_pyro_adam_per_parameter():
    """Five SVI steps with one Adam over several param sites equal Pyro's one Adam per site
    (a Bayesian linear regression with three param sites of different shapes)."""
    import pyro.distributions as dist

    x, y = torch.randn(30, 3), torch.randn(30)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        pyro.sample("obs", dist.Normal(x @ w, 1.0).to_event(1), obs=y)

    def guide():
        loc = pyro.param("loc", torch.zeros(3))
        log_scale = pyro.param("log_scale", torch.full((3,), -1.0))
        shift = pyro.param("shift", torch.zeros(()))
        pyro.sample("w", dist.Normal(loc + shift, log_scale.exp()).to_event(1))

    results = []
    for optim in (JointOptim(torch.optim.Adam, {"lr": 1e-2}), pyro.optim.Adam({"lr": 1e-2})):
        pyro.clear_param_store()
        svi = SVI(model, guide, optim, Trace_ELBO())
        pyro.set_rng_seed(0)
        for _ in range(5):
            svi.step()
        results.append({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
    assert set(results[0]) == {"loc", "log_scale", "shift"}
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(results[0]["loc"], torch.zeros(3))  # the parameters did move


def test_swapped_forward_equals_functional_call_and_restores():
    net = small_bn_net().train()
    twin = copy.deepcopy(net)
    own = {k: v for k, v in net.named_parameters()}
    x, _ = toy_batch()
    params = {k: torch.randn_like(v, requires_grad=True) for k, v in own.items()}
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    twin_buffers = {k: v.clone() for k, v in net.named_buffers()}
    out = swapped_forward(net, params, x, buffers)
    ref = functional_call(twin, {**params, **twin_buffers}, (x,))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for k in buffers:  # BatchNorm updated the buffers it was given, in place, identically
        torch.testing.assert_close(buffers[k], twin_buffers[k], rtol=0, atol=0)
    assert all(p is own[k] for k, p in net.named_parameters())  # the net's own restored
    assert net[1].running_mean is not buffers["1.running_mean"]
    with pytest.raises(RuntimeError):  # restored after a failing forward too
        swapped_forward(net, params, torch.randn(5, 7))
    assert all(p is own[k] for k, p in net.named_parameters())
    with pytest.raises(ValueError, match="no parameter named 'nope'"):
        swapped_forward(net, {"nope": torch.zeros(1)}, x)


def test_fused_ensemble_updates_only_the_drawn_members_statistics():
    model = PatchedNet(small_bn_net(), likelihoods.Categorical(), mode="ensemble", n_components=4)
    model.train()
    x, y = toy_batch()
    before = model.buf_1__running_mean.clone()
    tr = pyro.poutine.trace(model.fused_guide).get_trace(x, y)
    pyro.poutine.replay(model.fused_model, trace=tr)(x, y)
    member = int(tr.nodes["z"]["value"][0])
    after = model.buf_1__running_mean
    for k in range(4):
        assert torch.equal(after[k], before[k]) == (k != member)


def test_fused_refuses_vectorised_particles():
    model = PatchedNet(small_bn_net(), likelihoods.Categorical()).train()
    x, y = toy_batch()
    with pytest.raises(ValueError, match="vectorised"), pyro.plate("particles", 2, dim=-2):
        model.fused_guide(x, y)
