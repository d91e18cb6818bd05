"""MixtureOfLaplace and LastLayerLaplace against closed forms and brute-force Monte Carlo."""

import math

import pytest
import torch
from torch import nn

from pyro_subspace import FlatNet, likelihoods
from pyro_subspace.infer.ensembles import train_ensemble
from pyro_subspace.infer.laplace import linearized_moments
from pyro_subspace.infer.mixture_laplace import LastLayerLaplace, MixtureOfLaplace
from pyro_subspace.infer.mola_bound import far_away_confidence_bound


def _blobs(n=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    y = torch.arange(n) % 3
    return centres[y] + 0.6 * torch.randn(n, 2, generator=gen), y


@pytest.fixture(scope="module")
def trained():
    """Three small ReLU classifiers (with biases) trained from different seeds."""
    x, y = _blobs()
    make = lambda: nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))
    ens = train_ensemble(make, likelihoods.Categorical(), x, y, n_members=3, progress=False,
                         epochs=150, lr=0.03, weight_decay=1e-2)  # fmt: skip
    return x, y, ens.nets


def _closed_form_llla(net, x, y, lam, x_star):
    """LLLA by hand: J_n = [I_C ⊗ φ_nᵀ, I_C] (weights row-major, then bias), exact Hessian."""
    with torch.no_grad():
        phi, phi_s = net[:-1](x).double(), net[:-1](x_star).double()
        f, f_s = net(x).double(), net(x_star).double()
    c = f.shape[1]
    eye = torch.eye(c, dtype=torch.float64)

    def jac(p):
        return torch.cat([torch.kron(eye, p[None, :]), eye], dim=1)  # (C, C·P + C)

    p = f.softmax(-1)
    h = sum(jac(pn).T @ (torch.diag(q) - torch.outer(q, q)) @ jac(pn) for pn, q in zip(phi, p))
    cov = torch.linalg.inv(h + lam * torch.eye(h.shape[0], dtype=torch.float64))
    var = torch.stack([torch.diag(jac(pn) @ cov @ jac(pn).T) for pn in phi_s])
    return cov, (f_s / (1 + math.pi / 8 * var).sqrt()).softmax(-1)


def test_one_member_equals_llla_and_the_closed_form(trained):
    x, y, nets = trained
    lam = 0.6  # N·wd, the prior the networks were trained with
    lik = likelihoods.Categorical()
    x_star = torch.randn(9, 2) * 2
    mola = MixtureOfLaplace(nets[:1], lik, prior_precision=lam).fit(x, y)
    llla = LastLayerLaplace(nets[0], lik, prior_precision=lam).fit(x, y)
    assert torch.equal(mola.predict(x_star).probs, llla.predict(x_star).probs)
    assert torch.equal(mola.weights, torch.ones(1, dtype=torch.float64))
    cov, probs = _closed_form_llla(nets[0], x, y, lam, x_star)
    # float32 network, float64 closed form
    assert torch.allclose(llla.members[0][1].covariance, cov, atol=1e-5, rtol=1e-4)
    assert torch.allclose(llla.predict(x_star).probs, probs, atol=1e-6)
    # the last-layer shortcut (features by a hook) equals the generic Jacobian path
    f_mean, f_cov = llla.logit_moments(x_star)
    ref_mean, ref_cov = linearized_moments(llla.members[0][1], x_star)
    assert torch.allclose(f_mean[0], ref_mean, atol=1e-6)
    assert torch.allclose(f_cov[0], ref_cov, atol=1e-8, rtol=1e-5)


def _brute_force_softmax(mola, x, num_samples, seed):
    """Σ_k π_k E[softmax(f(x; w))], w ~ N(μ_k, Σ_k) over the last layer, by plain sampling."""
    gen = torch.Generator().manual_seed(seed)
    per_member, logit_moments = [], []
    for model, guide in mola.members:
        sub = model.subspace
        mu = sub.shift[sub.basis].double() + guide.loc
        chol = torch.linalg.cholesky(guide.covariance)
        t = mu + torch.randn(num_samples, mu.numel(), generator=gen, dtype=torch.float64) @ chol.T
        w = sub.shift.double().expand(num_samples, -1).clone()
        w[:, sub.basis] = t
        logits = FlatNet(model.flat.net, batch_strategy="vmap")(w.float(), x).double()
        per_member.append(logits.softmax(-1))
        logit_moments.append((logits.mean(0), logits.var(0)))
    return per_member, logit_moments


def test_mixture_probit_and_mc_against_brute_force_monte_carlo(trained):
    x, y, nets = trained
    mola = MixtureOfLaplace(nets, likelihoods.Categorical(), prior_precision=0.6).fit(x, y)
    x_star = torch.cat([x[:4], torch.randn(4, 2) * 3])
    s = 20_000
    per_member, moments = _brute_force_softmax(mola, x_star, s, seed=123)
    brute = sum(pi * p.mean(0) for pi, p in zip(mola.weights, per_member))
    se = torch.sqrt(sum(pi**2 * p.var(0) for pi, p in zip(mola.weights, per_member)) / s)
    # Monte Carlo over each component's Gaussian on the logits: equal within MC error
    mc = mola.predict(x_star, method="mc", num_samples=s, seed=7).probs
    assert ((mc - brute).abs() <= 5 * math.sqrt(2) * se + 1e-6).all()
    # eq. (1): the probit mixture built from the brute-force logit means and variances
    probit = mola.predict(x_star).probs
    from_samples = sum(
        pi * (m / (1 + math.pi / 8 * v).sqrt()).softmax(-1)
        for pi, (m, v) in zip(mola.weights, moments)
    )
    assert (probit - from_samples).abs().max() < 0.01  # MC error of the sample moments
    # the MPA (eq. 6) itself approximates E[softmax]; its error is not Monte Carlo error: it
    # shrinks the confident class by a few percent here (measured 0.056 at most), and keeps
    # the predicted class
    assert (probit - brute).abs().max() < 0.08
    assert torch.equal(probit.argmax(-1), brute.argmax(-1))
    # components: K per-member probabilities with the uniform weights of eq. (7)
    weights, comp = mola.components(x_star)
    assert comp.shape == (3, 8, 3) and torch.allclose(weights, torch.full((3,), 1 / 3).double())


def test_prior_precision_tuning_scores_match_the_refitted_mixture(trained):
    x, y, nets = trained
    lik = likelihoods.Categorical()
    x_val, y_val = _blobs(30, seed=5)
    grid = torch.tensor([0.01, 0.3, 3.0, 30.0, 300.0], dtype=torch.float64)
    mola = (
        MixtureOfLaplace(nets, lik).fit(x, y).optimize_prior_precision("grid", x_val, y_val, grid)
    )
    best = int(mola.grid_scores[:, 0].argmax())
    assert mola.prior_precision == pytest.approx(float(grid[best]))
    # the eigendecomposition shortcut scores each λ like the refitted mixture's predictive
    for i in (0, 2, 4):
        ref = MixtureOfLaplace(nets, lik, prior_precision=float(grid[i])).fit(x, y)
        lp = ref.log_prob(x_val, y_val).mean()
        assert float(mola.grid_scores[i, 0]) == pytest.approx(float(lp), rel=1e-5)
        mmc = ref.predict(x_val).probs.max(-1).values.mean()
        assert float(mola.grid_scores[i, 1]) == pytest.approx(float(mmc), rel=1e-5)
    # the paper's rule (Appendix F): the smallest λ whose validation MMC reaches the threshold
    mola.optimize_prior_precision("confidence", x_val, y_val, grid, threshold=0.9)
    mmcs = mola.grid_scores[:, 1]
    first = int((mmcs >= 0.9).nonzero()[0, 0])
    assert mola.prior_precision == pytest.approx(float(grid[first]))
    assert first == 0 or mmcs[first - 1] < 0.9


def test_regression_grid_scores_match_the_refitted_mixture_density():
    # regression: the grid scores the mixture-of-Gaussians density (it raised AttributeError)
    torch.manual_seed(0)
    x, y = torch.randn(50, 2), torch.randn(50)
    nets = [nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(2)]
    lik = likelihoods.Gaussian(sigma=0.5)
    grid = torch.tensor([0.01, 1.0, 100.0], dtype=torch.float64)
    mola = MixtureOfLaplace(nets, lik).fit(x, y)
    mola.optimize_prior_precision("grid", x[:20], y[:20], grid)
    for i in range(3):
        ref = MixtureOfLaplace(nets, lik, prior_precision=float(grid[i])).fit(x, y)
        lp = ref.log_prob(x[:20], y[:20]).mean()
        assert float(mola.grid_scores[i, 0]) == pytest.approx(float(lp), rel=1e-5)
    assert mola.prior_precision == float(grid[int(mola.grid_scores[:, 0].argmax())])
    assert torch.equal(
        mola.member_prior_precisions, torch.full((2,), mola.prior_precision, dtype=torch.float64)
    )
    # "marglik": each member its own evidence-maximising λ; no shared value is claimed
    mola.optimize_prior_precision("marglik")
    own = [float(g.prior_precision) for _, g in mola.members]
    assert mola.prior_precision is None and mola.member_prior_precisions.tolist() == own


def test_far_away_confidence_map_tends_to_one_laplace_stays_below_the_bound():
    x, y = _blobs()
    make = lambda: nn.Sequential(  # a ReLU network without biases (MoLA B.1)
        nn.Linear(2, 16, bias=False), nn.ReLU(), nn.Linear(16, 16, bias=False), nn.ReLU(),
        nn.Linear(16, 3, bias=False),
    )  # fmt: skip
    ens = train_ensemble(make, likelihoods.Categorical(), x, y, n_members=3, progress=False,
                         epochs=150, lr=0.03, weight_decay=1e-2)  # fmt: skip
    lik, lam = likelihoods.Categorical(), 0.6
    mola = MixtureOfLaplace(ens.nets, lik, prior_precision=lam).fit(x, y)
    llla = LastLayerLaplace(ens.nets[0], lik, prior_precision=lam).fit(x, y)
    bounds = {"mola": far_away_confidence_bound(mola), "llla": far_away_confidence_bound(llla)}
    # the bound by hand: b_i = ‖μ_(i)‖ / √(π/8 λ_min(Σ_(i))) per row of the last weight matrix
    _, guide = llla.members[0]
    mu = ens.nets[0][-1].weight.detach().double()
    cov = guide.covariance
    b = torch.stack([
        mu[i].norm() / (math.pi / 8 * torch.linalg.eigvalsh(cov[16 * i : 16 * i + 16, 16 * i : 16 * i + 16]).min()).sqrt()
        for i in range(3)
    ])  # fmt: skip
    by_hand = max(
        1 / (1 + sum(math.exp(-(b[i] + b[c])) for i in range(3) if i != c)) for c in range(3)
    )
    assert bounds["llla"] == pytest.approx(float(by_hand), rel=1e-10)
    assert bounds["mola"] < 0.99 and bounds["llla"] < 0.99
    x_star = torch.randn(20, 2)
    for delta in (1e2, 1e4, 1e6):
        with torch.no_grad():
            conf_map = ens.nets[0](delta * x_star).softmax(-1).max(-1).values
        if delta >= 1e4:
            assert (conf_map > 1 - 1e-6).all()
        for name, method in (("mola", mola), ("llla", llla)):
            conf = method.predict(delta * x_star).probs.max(-1).values
            assert (conf <= bounds[name] + 1e-9).all(), (name, delta, conf.max())


def test_linear_gaussian_members_are_the_exact_posterior_and_evidence():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 30)[:, None]
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(30)
    nets = [nn.Sequential(nn.Linear(1, 6), nn.Tanh(), nn.Linear(6, 1)).double() for _ in range(2)]
    sigma, lam = 0.3, 2.0
    lik = likelihoods.Gaussian(sigma=sigma)
    mola = MixtureOfLaplace(nets, lik, weights="evidence", prior_precision=lam)
    mola.fit(x.double(), y.double(), find_map=True)
    x_star = torch.linspace(-3, 3, 7, dtype=torch.float64)[:, None]
    weights, (means, variances) = mola.components(x_star)
    log_dens, exact_ev = [], []
    for k, net in enumerate(nets):
        with torch.no_grad():
            phi = torch.cat([net[:-1](x.double()), torch.ones(30, 1, dtype=torch.float64)], 1)
            phi_s = torch.cat([net[:-1](x_star), torch.ones(7, 1, dtype=torch.float64)], 1)
        a = phi.T @ phi / sigma**2 + lam * torch.eye(7, dtype=torch.float64)
        cov = torch.linalg.inv(a)
        mean = cov @ phi.T @ y.double() / sigma**2
        model, guide = mola.members[k]
        sub = model.subspace
        assert torch.allclose(sub.shift[sub.basis] + guide.loc, mean, atol=1e-6)
        assert torch.allclose(guide.covariance, cov, atol=1e-8)
        m_s, v_s = phi_s @ mean, ((phi_s @ cov) * phi_s).sum(1) + sigma**2
        assert torch.allclose(means[k, :, 0], m_s, atol=1e-6)
        assert torch.allclose(variances[k, :, 0], v_s, atol=1e-8)
        log_dens.append(torch.distributions.Normal(m_s, v_s.sqrt()))
        marginal = phi @ phi.T / lam + sigma**2 * torch.eye(30, dtype=torch.float64)
        exact_ev.append(
            torch.distributions.MultivariateNormal(torch.zeros(30, dtype=torch.float64), marginal)
            .log_prob(y.double())
        )  # fmt: skip
    # the Laplace evidence of a linear-Gaussian member is exact; weights ∝ evidence (E.1)
    exact_ev = torch.stack(exact_ev)
    assert torch.allclose(mola.log_evidences, exact_ev, atol=1e-6)
    assert torch.allclose(weights, torch.softmax(exact_ev, 0), atol=1e-6)
    y_star = torch.sin(2 * x_star[:, 0])
    mix = torch.logsumexp(
        torch.stack([w.log() + d.log_prob(y_star) for w, d in zip(weights, log_dens)]), 0
    )
    assert torch.allclose(mola.log_prob(x_star, y_star), mix, atol=1e-6)
    pred = mola.predict(x_star)  # the mixture of Gaussians; its moments
    mean, var = pred.mean, pred.variance
    mu = (weights[:, None] * means[:, :, 0]).sum(0)
    second = (weights[:, None] * (variances[:, :, 0] + means[:, :, 0] ** 2)).sum(0)
    assert torch.allclose(mean[:, 0], mu) and torch.allclose(var[:, 0], second - mu**2)


def test_any_subspace_builder_and_the_sampling_predictive(trained):
    from pyro_subspace import subspaces
    from pyro_subspace.infer.laplace import probit

    x, y, nets = trained
    lik = likelihoods.Categorical()
    pick = lambda net: subspaces.subnetwork(net, 12, strategy="magnitude")
    mola = MixtureOfLaplace(nets[:2], lik, subset=pick, prior_precision=0.6).fit(x, y)
    assert all(model.subspace.rank == 12 for model, _ in mola.members)
    x_star = torch.randn(6, 2)
    manual = sum(probit(*linearized_moments(g, x_star), lik) for _, g in mola.members) / 2
    assert torch.allclose(mola.predict(x_star).probs, manual, atol=1e-10)
    # weight draws pushed through the network (eq. 4; not linearised, so for hidden weights it
    # differs from the GLM predictive): K·S components of weight π_k / S
    weights, comp = mola.components(x_star, method="sample", num_samples=10)
    assert comp.shape == (20, 6, 3) and torch.allclose(weights.sum(), torch.ones(1).double())


def test_bad_arguments_and_unfitted_use(trained):
    x, y, nets = trained
    lik = likelihoods.Categorical()
    with pytest.raises(ValueError, match="subset"):
        MixtureOfLaplace(nets, lik, subset="all")
    with pytest.raises(ValueError, match="weights"):
        MixtureOfLaplace(nets, lik, weights=[1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="weights"):
        MixtureOfLaplace(nets, lik, weights="marglik")
    with pytest.raises(ValueError, match="prior_precision"):
        MixtureOfLaplace(nets, lik, prior_precision=0.0)
    with pytest.raises(TypeError, match="nets"):
        MixtureOfLaplace(nets[0], lik)
    mola = MixtureOfLaplace(nets, lik)
    with pytest.raises(RuntimeError, match="fit"):
        mola.predict(x).probs
    mola.fit(x, y)
    with pytest.raises(ValueError, match="method"):
        mola.predict(x, method="closed_form").probs
    with pytest.raises(ValueError, match="x_val"):
        mola.optimize_prior_precision("grid")
    with pytest.raises(ValueError, match="y"):
        MixtureOfLaplace(nets, lik).fit(x)


def test_fit_on_a_dataset_uses_its_training_split():
    from pyro_subspace import datasets

    data = datasets.digits(seed=0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
    lik = likelihoods.Categorical()
    a = LastLayerLaplace(net, lik).fit(data)
    b = LastLayerLaplace(net, lik).fit(data.x_train, data.y_train)
    assert torch.equal(a.predict(data.x_test[:5]).probs, b.predict(data.x_test[:5]).probs)


def test_far_away_bound_with_biases_against_brute_force_and_the_limit(trained):
    """Biases everywhere (the default nn.Linear): the asymptotic bound (weight blocks) against
    the probit confidence at δ·x along 200 random directions, the uniform bound (augmented rows)
    at every δ, the b_i against the dense closed-form LLLA, and the limit z_i(δx) →
    μ_iᵀa / √(π/8 aᵀΣ_(i)a) with a the bias-free feature map (the bias row drops out)."""
    from pyro_subspace.infer.mola_bound import far_away_terms

    x, y, nets = trained
    lik, lam = likelihoods.Categorical(), 0.6
    mola = MixtureOfLaplace(nets, lik, prior_precision=lam).fit(x, y)
    llla = LastLayerLaplace(nets[0], lik, prior_precision=lam).fit(x, y)
    # b_i by hand from the dense Hessian (weights row-major, then the bias)
    cov, _ = _closed_form_llla(nets[0], x, y, lam, x[:1])
    c, p = nets[0][-1].weight.shape
    w = nets[0][-1].weight.detach().double()
    theta = torch.cat([w, nets[0][-1].bias.detach().double()[:, None]], 1)
    idx = [list(range(i * p, i * p + p)) for i in range(c)]
    b_w = [w[i].norm() / (math.pi / 8 * torch.linalg.eigvalsh(cov[idx[i]][:, idx[i]])[0]).sqrt()
           for i in range(c)]  # fmt: skip
    aug = [idx[i] + [c * p + i] for i in range(c)]
    b_aug = [theta[i].norm() / (math.pi / 8 * torch.linalg.eigvalsh(cov[aug[i]][:, aug[i]])[0]).sqrt()
             for i in range(c)]  # fmt: skip
    # cov is the inverse of a float64 Hessian, the guide's a Cholesky of the same: rel 1e-6
    assert far_away_terms(llla)[0]["b"] == pytest.approx(torch.stack(b_w), rel=1e-6)
    assert far_away_terms(llla, "uniform")[0]["b"] == pytest.approx(torch.stack(b_aug), rel=1e-6)
    gen = torch.Generator().manual_seed(3)
    d = torch.randn(200, 2, generator=gen)
    d = d / d.norm(dim=1, keepdim=True)
    for method in (mola, llla):
        asym = far_away_confidence_bound(method)
        uniform = far_away_confidence_bound(method, kind="uniform")
        assert 1 / 3 < asym <= uniform < 1
        scales = (0.1, 1.0, 1e1, 1e2, 1e4, 1e5, 1e6)
        conf = {s: method.predict(s * d).probs.max(-1).values for s in scales}
        for s, cf in conf.items():  # the uniform bound holds at every input
            assert (cf <= uniform + 1e-12).all(), (s, cf.max(), uniform)
        assert (method.predict(x).probs.max(-1).values <= uniform + 1e-12).all()
        # the asymptotic one in the limit: conf(δ) − conf(∞) = O(1/δ), so conf(∞) is within
        # 10·|conf(1e6) − conf(1e5)| (+ float32 features: 1e-6) of conf(1e6)
        slack = 10 * (conf[1e6] - conf[1e5]).abs() + 1e-6
        assert (conf[1e6] <= asym + slack).all(), (conf[1e6].max(), asym)
    # the limit itself, for LLLA: a = φ(x) of the network with every hidden bias zeroed (ReLU)
    feat = nn.Sequential(*[nn.Linear(m.in_features, m.out_features, bias=False)
                           if isinstance(m, nn.Linear) else m for m in nets[0][:-1]])  # fmt: skip
    for m, src in zip(feat, nets[0][:-1]):
        if isinstance(m, nn.Linear):
            m.weight.data.copy_(src.weight.data)
    with torch.no_grad():
        a = feat(d).double()  # (200, P)
    blocks = torch.stack([cov[idx[i]][:, idx[i]] for i in range(c)])
    z_inf = (a @ w.T) / (math.pi / 8 * torch.einsum("np,cpq,nq->nc", a, blocks, a)).sqrt()
    conf_inf = z_inf.softmax(-1).max(-1).values
    live = a.norm(dim=1) > 1e-3  # a = 0: a constant output, outside the asymptotic statement
    assert live.sum() > 150
    assert conf[1e6][live] == pytest.approx(conf_inf[live], abs=1e-4)
    assert (conf_inf[live] <= far_away_confidence_bound(llla) + 1e-12).all()


def test_far_away_bound_is_attained_where_the_direction_is_extremal():
    """A net built so that the bound is reached: features φ = ReLU(x + β), rows μ_2 = −μ_1 ∥ e1,
    tiny data so Σ ≈ λ⁻¹I. Along x = e1, a = e1 ∥ μ_1 and the limit z_1 = −z_2 lies between
    b_i √(λ/(λ + g)) and b_i (g ≥ λ_max of the GGN: ½ Σ_n ‖ψ_n‖² by Gershgorin on the softmax
    Hessian); along e2 (a ⟂ μ) the confidence tends to 1/2."""
    from pyro_subspace.infer.mola_bound import far_away_terms

    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(2)), net[0].bias.copy_(torch.tensor([0.3, -0.2]))
        net[2].weight.copy_(torch.tensor([[0.02, 0.0], [-0.02, 0.0]]))
        net[2].bias.copy_(torch.tensor([0.1, -0.1]))
    gen = torch.Generator().manual_seed(0)
    x = 0.1 * torch.randn(10, 2, generator=gen)
    y = torch.arange(10) % 2
    lam = 1000.0
    llla = LastLayerLaplace(net, likelihoods.Categorical(), prior_precision=lam).fit(x, y)
    with torch.no_grad():
        psi = torch.cat([net[:-1](x), torch.ones(10, 1)], 1).double()
    g = 0.5 * float(psi.square().sum())
    b = far_away_terms(llla)[0]["b"]
    bound = far_away_confidence_bound(llla)
    assert bound == pytest.approx(1 / (1 + math.exp(-float(b.sum()))), rel=1e-12)
    lower = 1 / (1 + math.exp(-float(b.sum()) * math.sqrt(lam / (lam + g))))
    assert 0.8 < lower < bound < 0.9
    # with biases the bound is a limit: the excess over it decays like 1/δ (here ≈ 1.04/δ)
    e1 = torch.tensor([[1.0, 0.0]])
    excess = {s: float(llla.predict(s * e1).probs.max()) - bound for s in (1e4, 1e5, 1e6, 1e8)}
    assert excess[1e4] > 0 and excess[1e5] * 1e5 == pytest.approx(excess[1e4] * 1e4, rel=0.05)
    assert excess[1e6] * 1e6 == pytest.approx(excess[1e5] * 1e5, rel=0.05)
    # at δ = 1e8: 1/δ and float32 features (rel 1e-7 on z ≈ 1) leave < 1e-7
    assert lower - 1e-7 <= bound + excess[1e8] <= bound + 1e-7
    conf_e2 = llla.predict(1e6 * torch.tensor([[0.0, 1.0]])).probs.max()
    assert float(conf_e2) == pytest.approx(0.5, abs=1e-4)


def test_far_away_bound_rejects_what_it_does_not_cover(trained):
    x, y, nets = trained
    lik = likelihoods.Categorical()
    mola = MixtureOfLaplace(nets[:1], lik, prior_precision=0.6)
    with pytest.raises(RuntimeError, match="fit"):
        far_away_confidence_bound(mola)
    mola.fit(x, y)
    with pytest.raises(ValueError, match="kind"):
        far_away_confidence_bound(mola, kind="tight")
    with pytest.raises(TypeError, match="mola"):
        far_away_confidence_bound(nets[0])
    from pyro_subspace.subspaces import subnetwork

    other = MixtureOfLaplace(nets[:1], lik, subset=lambda n: subnetwork(n, 5, "magnitude"))
    with pytest.raises(ValueError, match="last_layer"):
        far_away_confidence_bound(other.fit(x, y))
