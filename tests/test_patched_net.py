"""PatchedNet: the Ensemble Model Patching objective, assignment structure, overhead, prediction.

Every number is checked against an independent computation: the loss against eq. (7) plus the
expected NLL obtained by enumerating all assignments, the assignment frequencies against their
Bernoulli/uniform laws with binomial tolerances, the overhead against the paper's formulas
(section 3.3), ECE/MCE against a hand computation (appendix D.2).
"""

import copy
import itertools
import math

import pyro
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import Predictive, Trace_ELBO
from torch import nn
from torch.func import functional_call

from pyro_subspace import PatchedNet, datasets, likelihoods, metrics
from pyro_subspace.flat import preserved

pytestmark = pytest.mark.usefixtures("one_thread")


def small_bn_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))


def toy_batch(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randint(0, 3, (n,), generator=g)


def nll_sum(net, weights, x, y):
    """Independent NLL: functional_call + cross_entropy (sum over points), net in train mode."""
    out = functional_call(net, {**weights, **dict(net.named_buffers())}, (x,))
    return F.cross_entropy(out, y, reduction="sum")


def expected_nll_emp(model, x, y):
    """E_z[NLL] under EMP by enumerating all K^L joint assignments (σ -> 0), differentiable."""
    means = model.means()
    k, mods = model.n_components, model.patched_modules
    total = 0.0
    for combo in itertools.product(range(k), repeat=len(mods)):
        z = dict(zip(mods, combo))
        w = {
            s.name: means[s.name][z[s.module]] if s.kind == "patch" else means[s.name]
            for s in model.slots
        }
        total = total + nll_sum(model.net, w, x, y)
    return total / k ** len(mods)


def eq7(model):
    """Eq. (7) by hand: Σ_patched Σ_k τ p_k/2 ‖M_k‖² + Σ_shared τ/2 ‖M‖²."""
    tau, k = model.slots[0].precision, model.n_components
    out = 0.0
    for s in model.slots:
        m = model.means()[s.name]
        if s.kind == "patch":
            out = out + sum(tau * (1 / k) / 2 * m[j].square().sum() for j in range(k))
        else:
            out = out + tau / 2 * m.square().sum()
    return out


def kl_constant(model):
    """C = Σ_weights ½(τσ² − 1 − log τσ²): E KL(N(M,σ²)‖N(0,τ⁻¹)) minus τ/2 M²."""
    ts2 = model.slots[0].precision * model.sigma**2
    return model.num_weights * 0.5 * (ts2 - 1 - math.log(ts2))


def nearest_component(means_k, w):
    """Index of the component nearest to each element: means_k (K, *s), w (S, *s) -> (S, *s)."""
    return (w.unsqueeze(1) - means_k.unsqueeze(0)).abs().argmin(dim=1)


# --------------------------------------------------------------------------------------------
# the objective


def test_svi_loss_per_draw_is_nll_plus_one_sample_kl():
    """For one draw, Trace_ELBO's loss is NLL(W) + log N(W; M_z, σ²) − log N(W; 0, τ⁻¹), by hand."""
    model = PatchedNet(
        small_bn_net(), likelihoods.Categorical(), n_components=3, prior_precision=2.0, sigma=0.05
    ).train()
    x, y = toy_batch()
    pyro.set_rng_seed(3)
    loss = Trace_ELBO().differentiable_loss(model, model.guide, x, y)
    pyro.set_rng_seed(3)  # the same draws again: the guide runs first in Trace_ELBO
    tr = pyro.poutine.trace(model.guide).get_trace(x, y)
    means, tau, sig = model.means(), 2.0, 0.05
    kl, weights = 0.0, {}
    for s in model.slots:
        w = tr.nodes[s.site]["value"]
        weights[s.name] = w
        if s.kind == "patch":
            z = int(tr.nodes[f"z.{s.module}"]["value"])
            loc = means[s.name][z]
            assert ((w - loc).abs() < 6 * sig).all()  # drawn around the assigned mean
        else:
            loc = means[s.name]
        log_q = (-0.5 * ((w - loc) / sig) ** 2 - math.log(sig) - 0.5 * math.log(2 * math.pi)).sum()
        log_p = (-0.5 * tau * w**2 + 0.5 * math.log(tau) - 0.5 * math.log(2 * math.pi)).sum()
        kl = kl + log_q - log_p
    expected = nll_sum(model.net, weights, x, y) + kl
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-3)


def test_svi_loss_and_gradient_equal_expected_nll_plus_eq7():
    """E[loss] = E_z NLL + eq. (7) + C and E[∇_M loss] = ∇_M(E_z NLL + eq. 7), within MC error."""
    model = PatchedNet(
        small_bn_net(),
        likelihoods.Categorical(),
        n_components=3,
        prior_precision=5.0,
        sigma=1e-3,
        init_jitter=0.5,
    ).train()
    x, y = toy_batch()
    params = [model.means()[s.name] for s in model.slots]
    target = expected_nll_emp(model, x, y) + eq7(model)
    exact_grads = torch.autograd.grad(target, params)
    # the closed-form eq. (7) is the model's own penalty, and not a vacuous one
    assert float(model.penalty()) == pytest.approx(float(eq7(model)), rel=1e-6)
    naive = sum(model.slots[0].precision / 2 * params[i].square().sum() for i in range(len(params)))
    assert float(naive - eq7(model)) > 20  # forgetting p_k = 1/K would be far outside the tolerance

    r = 120
    elbo = Trace_ELBO()
    losses, grads = [], [[] for _ in params]
    for _ in range(r):
        loss = elbo.differentiable_loss(model, model.guide, x, y)
        for acc, g in zip(grads, torch.autograd.grad(loss, params)):
            acc.append(g)
        losses.append(float(loss))
    losses_t = torch.tensor(losses)
    se = float(losses_t.std() / math.sqrt(r))
    assert model.elbo_constant == pytest.approx(kl_constant(model))
    got = float(losses_t.mean()) - kl_constant(model)
    assert abs(got - float(target)) < 4 * se, (got, float(target), se)
    for acc, exact in zip(grads, exact_grads):
        g = torch.stack(acc)
        se_g = g.std(0) / math.sqrt(r)
        assert ((g.mean(0) - exact).abs() <= 4 * se_g + 1e-3).all()

    # the plain-torch loss (closed-form eq. 7) estimates the same objective without C
    torch.manual_seed(0)
    direct = torch.tensor([float(model.negative_elbo(x, y)) for _ in range(r)])
    se_d = float(direct.std() / math.sqrt(r))
    assert abs(float(direct.mean()) - float(target)) < 4 * se_d + 1e-4


def test_sigma_zero_limit_gives_exactly_nll_plus_l2_of_the_drawn_component():
    """σ = 0: a Delta guide; the loss is NLL(M_z) + τ/2 ‖M_z‖² + C, with no noise at all."""
    model = PatchedNet(
        small_bn_net(),
        likelihoods.Categorical(),
        mode="ecmp",
        n_components=3,
        sigma=0.0,
        prior_precision=2.0,
    ).train()
    x, y = toy_batch()
    pyro.set_rng_seed(5)
    loss = Trace_ELBO().differentiable_loss(model, model.guide, x, y)
    pyro.set_rng_seed(5)
    tr = pyro.poutine.trace(model.guide).get_trace(x, y)
    w, l2 = {}, 0.0
    for s in model.slots:
        m = model.means()[s.name]
        if s.kind == "patch":  # ECMP: gather each element's component by hand
            z = tr.nodes[f"z.{s.name}"]["value"]
            m = torch.stack([m[int(k)].reshape(-1)[i] for i, k in enumerate(z.reshape(-1))])
            m = m.reshape(s.shape)
        assert torch.equal(tr.nodes[s.site]["value"], m)
        w[s.name] = m
        l2 = l2 + 2.0 / 2 * m.square().sum()
    expected = nll_sum(model.net, w, x, y) + l2 + model.elbo_constant
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    # gradients: exactly the pathwise ones given z, no score-function contribution from z
    params = [model._parameters[s.key] for s in model.slots]
    for g_svi, g_hand in zip(
        torch.autograd.grad(loss, params), torch.autograd.grad(expected, params)
    ):
        torch.testing.assert_close(g_svi, g_hand, rtol=1e-5, atol=1e-6)
    assert model.elbo_constant == pytest.approx(model.num_weights * 0.5 * math.log(math.pi))


def test_weight_decays_reproduce_the_gradient_of_eq7():
    model = PatchedNet(
        small_bn_net(), likelihoods.Categorical(), n_components=4, prior_precision=3.0
    )
    n = 100
    grads = torch.autograd.grad(
        model.penalty() / n, [model._parameters[s.key] for s in model.slots]
    )
    decays = model.weight_decays(n)
    for s, g in zip(model.slots, grads):
        torch.testing.assert_close(g, decays[s.key] * model._parameters[s.key])


# --------------------------------------------------------------------------------------------
# assignment structure of each mode


def _draws(model, s=4000):
    torch.manual_seed(0)
    return model.sample_weights(s)


def _binomial_ok(freq, p, n):
    return (freq - p).abs().max() <= 4.5 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_emp_draws_a_whole_layer_from_one_component():
    model = PatchedNet(small_bn_net(), likelihoods.Categorical(), n_components=3, sigma=1e-4)
    d, s = _draws(model), 4000
    for mod in model.patched_modules:
        comps = []
        for slot in (sl for sl in model.slots if sl.module == mod):
            c = nearest_component(model.means()[slot.name], d[slot.site]).reshape(s, -1)
            assert (c == c[:, :1]).all()  # every element of the tensor: the same component
            comps.append(c[:, 0])
        assert all(torch.equal(comps[0], c) for c in comps)  # weight and bias together
        assert torch.equal(comps[0], d[f"z.{mod}"])
        freq = torch.bincount(comps[0], minlength=3).double() / s
        assert _binomial_ok(freq, 1 / 3, s)
    # shared weights: N(M, σ²) around their single mean
    shared = next(sl for sl in model.slots if sl.kind == "shared")
    dev = (d[shared.site] - model.means()[shared.name]) / model.sigma
    assert abs(float(dev.std()) - 1) < 0.02 and abs(float(dev.mean())) < 0.02


def test_ecmp_draws_elements_independently():
    model = PatchedNet(
        small_bn_net(), likelihoods.Categorical(), n_components=3, mode="ecmp", sigma=1e-4
    )
    d, s = _draws(model), 4000
    slot = next(sl for sl in model.slots if sl.name == "3.weight")
    c = nearest_component(model.means()[slot.name], d[slot.site]).reshape(s, -1)  # (S, 12)
    for k in range(3):
        assert _binomial_ok((c == k).double().mean(0), 1 / 3, s)
    same = (c[:, 0] == c[:, 1]).double().mean()  # independent elements agree w.p. Σ p_k² = 1/3
    assert _binomial_ok(same[None], 1 / 3, s)
    assert (c != c[:, :1]).any(dim=1).double().mean() > 0.99  # a draw mixes components


@pytest.mark.parametrize("mode", ["dropout", "dropconnect"])
def test_dropout_modes_hit_the_zero_component_with_probability_p(mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    model = PatchedNet(net, likelihoods.Categorical(), mode=mode, drop_prob=0.3, sigma=1e-5)
    assert model.patched_modules == ["2", "4"]  # every Linear but the first
    d, s = _draws(model), 4000
    w = d["w.2.weight"]  # (S, out=4, in=5)
    zero = w.abs() < 1e-3
    assert _binomial_ok(zero.double().mean(0).flatten(), 0.3, s)
    if mode == "dropout":  # Table 1: z_{i h1}, one per input unit: whole columns of (out, in)
        assert (zero == zero[:, :1, :]).all()
        both = (zero[:, 0, 0] & zero[:, 0, 1]).double().mean()
    else:  # DropConnect: element-wise
        assert not (zero == zero[:, :1, :]).all()
        both = (zero[:, 0, 0] & zero[:, 1, 0]).double().mean()
    assert _binomial_ok(both[None], 0.09, s)  # independent units / elements
    kept = ~zero
    torch.testing.assert_close(  # the non-zero component is M
        w[kept], model.means()["2.weight"].expand_as(w)[kept], atol=1e-4, rtol=0
    )
    assert (d["w.2.bias"].abs() > 1e-3).all() or model.means()["2.bias"].abs().min() < 1e-3
    assert model.overhead == 0.0


def test_explicit_ensemble_uses_one_assignment_for_the_whole_net():
    model = PatchedNet(
        small_bn_net(), likelihoods.Categorical(), n_components=4, mode="ensemble", sigma=1e-4
    )
    s = 2000
    d = _draws(model, s)
    comps = [
        nearest_component(model.means()[sl.name], d[sl.site]).reshape(s, -1) for sl in model.slots
    ]
    for c in comps:
        assert (c == d["z"][:, None]).all()
    assert _binomial_ok(torch.bincount(d["z"], minlength=4).double() / s, 0.25, s)
    assert model.overhead == pytest.approx(300.0)


def test_guide_under_vectorised_predictive_draws_independent_assignments():
    model = PatchedNet(small_bn_net(), likelihoods.Categorical(), n_components=3, sigma=1e-4)
    x, _ = toy_batch()
    model.eval()
    pred = Predictive(model, guide=model.guide, num_samples=600, parallel=True)(x)
    z = pred["z.1"].reshape(-1)
    assert z.shape == (600,) and _binomial_ok(
        torch.bincount(z, minlength=3).double() / 600, 1 / 3, 600
    )
    assert pred["obs"].shape == (600, 16) and pred["f"].shape[-2:] == (16, 3)
    # the model's outputs equal the net evaluated at the guide's weights, draw by draw
    w = {s.name: pred[s.site].reshape(600, *s.shape) for s in model.slots}
    f = pred["f"].reshape(600, 16, 3)
    for i in (0, 7, 599):
        with torch.no_grad():
            out = functional_call(
                model.net,
                {**{k: v[i] for k, v in w.items()}, **dict(model.net.named_buffers())},
                (x,),
            )
        torch.testing.assert_close(f[i], out)
    seq = Predictive(model, guide=model.guide, num_samples=5)(x)  # sequential Predictive too
    assert seq["obs"].shape == (5, 16)


# --------------------------------------------------------------------------------------------
# parameter overhead (section 3.3)


def test_overhead_equals_the_paper_formulas_on_a_bn_mlp_and_a_cnn():
    k = 5
    mlp = nn.Sequential(
        nn.Linear(64, 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    d = sum(p.numel() for p in mlp.parameters())
    paper = 2 * (k - 1) * 128 * 2 + (k - 1) * (128 + 1) * 10  # 2(K-1)N2 per BN, (K-1)(I+1)O
    for mode in ("emp", "ecmp"):
        model = PatchedNet(mlp, likelihoods.Categorical(), mode=mode, n_components=k)
        assert model.patched_modules == ["1", "4", "6"]
        assert model.overhead == pytest.approx(100 * paper / d)
    first = PatchedNet(mlp, likelihoods.Categorical(), patches=["0", "6"], n_components=k)
    paper_io = (k - 1) * ((64 + 1) * 128 + (128 + 1) * 10)  # input + output layers
    assert first.overhead == pytest.approx(100 * paper_io / d)

    cnn = nn.Sequential(
        nn.Conv2d(1, 8, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )
    d = sum(p.numel() for p in cnn.parameters())
    paper = 2 * (k - 1) * 8 + 2 * (k - 1) * 16 + (k - 1) * (16 * 4 * 4 + 1) * 10
    assert PatchedNet(cnn, likelihoods.Categorical()).overhead == pytest.approx(100 * paper / d)
    convs = PatchedNet(cnn, likelihoods.Categorical(), patches=["0", "3"], n_components=k)
    paper_conv = (k - 1) * (3**2 * 1 * 8 + 3**2 * 8 * 16)  # (K-1)(k1² I1 O1 + kL² IL OL), no bias
    assert convs.overhead == pytest.approx(100 * paper_conv / d)
    assert PatchedNet(cnn, likelihoods.Categorical(), mode="dropout").overhead == 0.0
    ens = PatchedNet(cnn, likelihoods.Categorical(), mode="ensemble", n_components=k)
    assert ens.overhead == pytest.approx(100 * (k - 1))
    x = torch.randn(6, 1, 8, 8)
    assert ens.eval().sample_outputs(x, 3).shape == (3, 6, 10)


# --------------------------------------------------------------------------------------------
# calibration errors (appendix D.2)


def test_ece_mce_match_a_hand_computation():
    rows = []  # (confidence, correct)
    rows += [(0.93, True)] * 9 + [(0.93, False)] * 3  # bin (0.90, 0.95]: 12 points, acc 0.75
    rows += [(0.71, True)] * 4 + [(0.71, False)] * 4  # bin (0.70, 0.75]: 8 points, acc 0.5
    rows += [(0.55, True)] * 3  # bin (0.55 is in (0.50, 0.55]]: 3 points <= 5, dropped
    probs = torch.tensor([[c, 1 - c] for c, _ in rows], dtype=torch.float64)
    y = torch.tensor([0 if ok else 1 for _, ok in rows])
    n = len(rows)
    ece_hand = 12 / n * abs(0.75 - 0.93) + 8 / n * abs(0.5 - 0.71)
    mce_hand = max(abs(0.75 - 0.93), abs(0.5 - 0.71))
    ece, mce = metrics.calibration_errors(probs, y, n_bins=20, min_count=5)
    assert ece == pytest.approx(ece_hand, abs=1e-12) and mce == pytest.approx(mce_hand, abs=1e-12)


# --------------------------------------------------------------------------------------------
# BatchNorm: train and eval mode


@pytest.mark.parametrize("mode", ["emp", "ecmp"])
def test_batchnorm_eval_predictions_are_sensible_without_variance_shift(mode):
    data = datasets.digits(seed=0)
    x, y = data.x_train[:600], data.y_train[:600]
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )
    model = PatchedNet(net, likelihoods.Categorical(), mode=mode, seed=0)
    model.fit(x, y, epochs=15, batch_size=64, lr=1e-2, seed=0)
    model.eval()
    torch.manual_seed(1)
    probs = model.predictive_mean(data.x_test, 50)
    assert torch.isfinite(probs).all()
    assert metrics.accuracy(probs, data.y_test) > 0.85
    assert metrics.categorical_nll(probs, data.y_test) < 0.6
    # eval mode (running statistics) agrees with train mode (batch statistics) on the test set
    d = model.sample_weights(50)
    with torch.no_grad(), preserved(model.net, buffers=True):
        model.train()  # predictive_mean always runs in eval mode: the batch-statistics outputs
        out = model.outputs({s.name: d[s.site] for s in model.slots}, data.x_test)
        model.eval()
    probs_train = out.softmax(-1).mean(0)
    assert (probs.argmax(1) == probs_train.argmax(1)).double().mean() > 0.95
    # no variance shift: each BN's running variance is the variance of its inputs under the
    # variational draws at test time (what dropout's deterministic test pass breaks)
    inputs = {1: [], 4: []}
    hooks = [
        model.net[i].register_forward_hook(lambda m, a, o, i=i: inputs[i].append(a[0].detach()))
        for i in (1, 4)
    ]
    d = model.sample_weights(20)
    with torch.no_grad():
        for j in range(20):  # one draw at a time: hooks cannot capture tensors inside vmap
            model.outputs({s.name: d[s.site][j] for s in model.slots}, x)
    for h in hooks:
        h.remove()
    for i, a in inputs.items():
        ratio = torch.cat(a).var(0) / model.net[i].running_var
        assert 0.75 < float(ratio.median()) < 1.33


def test_dropout_deterministic_test_pass_shows_the_variance_shift():
    """The motivation (section 3): BN statistics gathered under dropout's zeros do not match a
    deterministic test pass; the MC predictive does match them."""
    data = datasets.digits(seed=0)
    x, y = data.x_train[:600], data.y_train[:600]
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )
    model = PatchedNet(net, likelihoods.Categorical(), mode="dropout", drop_prob=0.5, seed=0)
    model.fit(x, y, epochs=5, batch_size=64, seed=0)
    model.eval()
    seen = []
    hook = model.net[3].register_forward_hook(lambda m, a, o: seen.append(a[0].detach()))
    d = model.sample_weights(10)
    with torch.no_grad():
        for i in range(10):  # one draw at a time: hooks cannot capture tensors inside vmap
            model.outputs({s.name: d[s.site][i] for s in model.slots}, x)
        model.outputs(model.means(), x)  # dropout switched off: the weight means
    hook.remove()
    rv = model.net[3].running_var
    mc_ratio = float((torch.cat(seen[:10]).var(0) / rv).median())
    det_ratio = float((seen[10].var(0) / rv).median())
    assert 0.75 < mc_ratio < 1.33 and det_ratio > 1.5


def test_ensemble_keeps_batchnorm_statistics_per_member():
    model = PatchedNet(small_bn_net(), likelihoods.Categorical(), n_components=3, mode="ensemble")
    x, y = toy_batch(n=32)
    model.train()
    before = model._buffers["buf_1__running_mean"].clone()
    tr = pyro.poutine.trace(model.guide).get_trace(x, y)
    pyro.poutine.replay(model, trace=tr)(x, y)
    z = int(tr.nodes["z"]["value"])
    after = model._buffers["buf_1__running_mean"]
    changed = [not torch.equal(before[k], after[k]) for k in range(3)]
    assert changed == [k == z for k in range(3)]
    model.eval()
    out = model.sample_outputs(x, 7)
    assert out.shape == (7, 32, 3) and torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# prediction and errors


def test_svi_training_updates_batchnorm_running_statistics_once_per_step():
    model = PatchedNet(small_bn_net(), likelihoods.Categorical(), mode="emp", n_components=2)
    x, y = toy_batch(n=64)
    svi = pyro.infer.SVI(model, model.guide, pyro.optim.Adam({"lr": 1e-4}), Trace_ELBO())
    model.train()
    for _ in range(60):  # slow learning: the EMA (momentum 0.1) has converged after 60 steps
        svi.step(x, y)
    bn = model.net[1]
    assert int(bn.num_batches_tracked) == 60
    # the running mean tracks the batch mean of the BN inputs (shared layer 0 feeds it)
    with torch.no_grad():
        pre = functional_call(
            model.net[0],
            {k.split(".", 1)[1]: v for k, v in model.means().items() if k.startswith("0.")},
            (x,),
        )
    torch.testing.assert_close(bn.running_mean, pre.mean(0), atol=0.02, rtol=0.05)


def test_vectorised_outputs_equal_the_loop_over_draws(device):
    model = PatchedNet(small_bn_net().to(device), likelihoods.Categorical(), mode="ecmp").eval()
    x = toy_batch()[0].to(device)
    d = model.sample_weights(6)
    w = {s.name: d[s.site] for s in model.slots}
    batched = model.outputs(w, x)
    for i in range(6):
        torch.testing.assert_close(batched[i], model.outputs({k: v[i] for k, v in w.items()}, x))
    probs = model.predictive_mean(x, 6)
    assert probs.shape == (16, 3) and torch.allclose(probs.sum(-1), torch.ones(16, device=device))
    assert batched.device == probs.device == device


def test_svi_fit_and_gaussian_likelihood_run():
    torch.manual_seed(0)
    x = torch.randn(40, 2)
    y = x[:, 0] - x[:, 1]
    net = nn.Sequential(nn.Linear(2, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 1))
    model = PatchedNet(net, likelihoods.Gaussian(0.1), mode="ecmp", n_components=2)
    assert model.patched_modules == ["1", "3"]
    hist = model.fit(x, y, epochs=30, batch_size=20, lr=1e-2, method="svi", seed=0)
    assert hist[-1] < hist[0] and all(math.isfinite(h) for h in hist)
    assert model.eval().predictive_mean(x, 4).shape == (40,)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"mode": "mc"}, ValueError, "mode"),
        ({"n_components": 1}, ValueError, "n_components"),
        ({"n_components": 2.5}, TypeError, "n_components"),
        ({"patches": ["9"]}, ValueError, "patches"),
        ({"patches": ["2"]}, ValueError, "patches"),  # ReLU has no parameters
        ({"patches": "bn"}, ValueError, "patches"),
        ({"patches": ["1"], "mode": "dropout"}, ValueError, "patches"),
        ({"patches": ["1"], "mode": "ensemble"}, ValueError, "patches"),
        ({"sigma": -1.0}, ValueError, "sigma"),
        ({"drop_prob": 1.0}, ValueError, "drop_prob"),
        ({"prior_precision": -1.0}, ValueError, "prior_precision"),
        ({"prior_precision": {"7": 1.0}}, ValueError, "prior_precision"),
        ({"init": "zeros"}, ValueError, "init"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, err, match):
    with pytest.raises(err, match=match):
        PatchedNet(small_bn_net(), likelihoods.Categorical(), **kwargs)


def test_bad_call_arguments():
    model = PatchedNet(small_bn_net(), likelihoods.Categorical())
    x, y = toy_batch()
    with pytest.raises(TypeError, match="net"):
        PatchedNet("net", likelihoods.Categorical())
    with pytest.raises(TypeError, match="likelihood"):
        PatchedNet(small_bn_net(), "categorical")
    with pytest.raises(ValueError, match="num_samples"):
        model.sample_outputs(x, 0)
    with pytest.raises(ValueError, match="y"):
        model(x, y[:3])
    with pytest.raises(ValueError, match="x"):
        model.sample_outputs(torch.full((2, 3), float("nan")))
    with pytest.raises(ValueError, match="num_data"):
        model(x, y, num_data=3)


def test_predictive_mean_after_fit_runs_in_eval_mode_and_restores_the_modes():
    """Right after `fit`, `predictive_mean` uses the BatchNorm running statistics (eval mode),
    leaves them unchanged and puts back the user's modes; the numbers equal a hand evaluation
    of a copy of the net in eval mode at the same draws."""
    x, y = toy_batch(n=40)
    model = PatchedNet(small_bn_net(), likelihoods.Categorical(), mode="ecmp", sigma=0.01)
    model.net[3].eval()  # a mixed mode the user chose; fit trains in train mode, then restores
    modes = [m.training for m in model.net.modules()]
    model.fit(x, y, epochs=3, batch_size=16, seed=0)
    assert [m.training for m in model.net.modules()] == modes and model.training
    assert int(model.net[1].num_batches_tracked) == 9  # fit ran in train mode: 3 x 3 batches
    saved = [b.clone() for b in model.net.buffers()]
    torch.manual_seed(5)
    probs = model.predictive_mean(x, 7)
    assert [m.training for m in model.net.modules()] == modes and model.training
    assert all(torch.equal(a, b) for a, b in zip(saved, model.net.buffers()))
    torch.manual_seed(5)  # the same draws again
    draws = model.sample_weights(7)
    reference = copy.deepcopy(model.net).eval()
    expected = []
    with torch.no_grad():
        for i in range(7):
            for s in model.slots:
                reference.get_parameter(s.name).copy_(draws[s.site][i])
            expected.append(F.softmax(reference(x), dim=-1))
    torch.testing.assert_close(probs, torch.stack(expected).mean(0))
    model.train()  # and not what train mode (batch statistics) would give
    with torch.no_grad(), preserved(model.net, buffers=True):
        train_out = model.outputs({s.name: draws[s.site] for s in model.slots}, x)
    assert not torch.allclose(train_out.softmax(-1).mean(0), probs, atol=1e-3)


@pytest.mark.parametrize("method", ["torch", "svi"])
def test_fit_learns_a_gaussian_noise_scale_left_free(method):
    # Gaussian(sigma=None): both fit methods optimise σ with the means (the same objective; the
    # torch path had left σ at its initial 1.0). The expected log-likelihood at the fitted means
    # is maximal at σ*² = E_z mean_n (y_n − f_z(x_n))² (400 draws of the patches). Adam with one
    # draw per step settles near, not at, σ*: 12-16 % above it for both methods here (SVI being
    # Pyro's own optimisation of the same ELBO), so the bound is 25 %, far from the 1.0 start
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = x.sum(-1) + 0.1 * torch.randn(64)
    lik = likelihoods.Gaussian()
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    model = PatchedNet(net, lik, mode="emp")
    model.fit(x, y, epochs=1500, lr=1e-2, batch_size=64, seed=0, method=method)
    with torch.no_grad():
        f = model.sample_outputs(x, 400)[..., 0]
    best = float(((y - f) ** 2).mean().sqrt())
    assert best < 0.2 and float(lik.sigma.detach()) == pytest.approx(best, rel=0.25)
