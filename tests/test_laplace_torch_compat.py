"""laplace-torch's documented usage patterns, written against `infer.Laplace`.

Each test is a pattern from laplace-torch's README and documentation (written from the
documented behaviour, no code copied), run against our door and compared with an
independent computation: the dense GGN from ``torch.autograd.functional.jacobian``, the
closed-form evidence, dense Gaussians. When laplace-torch is installed, the same pattern is
also run there and compared (float64, the same MAP nets, the same λ; skipped otherwise)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import likelihoods
from pyro_subspace.infer import Laplace

try:  # comparisons only, never a dependency
    import laplace as laplace_torch
except ImportError:  # pragma: no cover - the usual case in CI
    laplace_torch = None

needs_laplace_torch = pytest.mark.skipif(
    laplace_torch is None, reason="laplace-torch is a comparison, not a dependency"
)
F64 = torch.float64


def regression_problem(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(40, 2, dtype=F64)
    y = torch.sin(2 * x[:, :1]) + 0.1 * torch.randn(40, 1, dtype=F64)
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    for _ in range(300):  # a MAP estimate (laplace-torch's usage: fit after training)
        opt.zero_grad()
        ((net(x) - y).square().mean() + 1e-3 * sum(p.square().sum() for p in net.parameters())).backward()
        opt.step()
    return net, x, y


def classification_problem(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]], dtype=F64)
    y = torch.arange(60) % 3
    x = centres[y] + 0.7 * torch.randn(60, 2, dtype=F64)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net, x, y


def dense(net, x, indices=None):
    """Outputs ``f (N, O)`` and the Jacobian ``J (N, O, K)`` of the outputs in the weights at
    ``indices`` (all weights by default), by autograd."""
    params = dict(net.named_parameters())
    w = nn.utils.parameters_to_vector(net.parameters()).detach()

    def outputs(v):
        pieces, at = {}, 0
        for name, p in params.items():
            pieces[name] = v[at : at + p.numel()].reshape(p.shape)
            at += p.numel()
        return torch.func.functional_call(net, pieces, (x,))

    jac = torch.autograd.functional.jacobian(outputs, w)
    return outputs(w).detach(), jac if indices is None else jac[..., indices]


def regression_posterior(net, x, lam, sigma, indices=None):
    """``Σ = (JᵀJ/σ² + λI)⁻¹`` and the evidence terms of a Gaussian likelihood, dense."""
    f, jac = dense(net, x, indices)
    j = jac.reshape(-1, jac.shape[-1])
    k = j.shape[1]
    lam = torch.as_tensor(lam, dtype=F64).expand(k)
    precision = j.T @ j / sigma**2 + torch.diag(lam)
    return f, jac, torch.linalg.inv(precision), precision


def regression_evidence(net, x, y, lam, sigma):
    f, jac, _, precision = regression_posterior(net, x, lam, sigma)
    w = nn.utils.parameters_to_vector(net.parameters()).detach()
    lam = torch.as_tensor(lam, dtype=F64).expand(w.numel())
    loglik = torch.distributions.Normal(f, sigma).log_prob(y).sum()
    return (
        loglik - 0.5 * (lam * w.square()).sum()
        + 0.5 * (lam.log().sum() - torch.linalg.slogdet(precision)[1])
    )  # fmt: skip


def softmax_posterior(net, x_train, x, lam, indices):
    """``Σ = (Σ_n J_nᵀ H_n J_n + λI)⁻¹`` (softmax GGN) and the logit moments at ``x``."""
    f_tr, jac_tr = dense(net, x_train, indices)
    p = f_tr.softmax(-1)
    h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    ggn = torch.einsum("nck,ncd,ndj->kj", jac_tr, h, jac_tr)
    k = ggn.shape[0]
    precision = ggn + torch.as_tensor(lam, dtype=F64).expand(k).diag()
    cov = torch.linalg.inv(precision)
    f, jac = dense(net, x, indices)
    return f, torch.einsum("nck,kj,ndj->ncd", jac, cov, jac), cov, ggn


def last_layer(net, d_last: int):
    d = sum(p.numel() for p in net.parameters())
    return torch.arange(d - d_last, d)


# ------------------------------------------------------------------ regression, all weights, full


def test_regression_fit_loader_then_f_mu_f_var():
    net, x, y = regression_problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    la = Laplace(net, likelihoods.Gaussian(torch.tensor(0.2, dtype=F64)), "all", "full",
                 prior_precision=0.5)  # fmt: skip
    la.fit(loader)
    f_mu, f_var = la(x[:7])
    assert f_mu.shape == (7, 1) and f_var.shape == (7, 1, 1) and f_mu.dtype == F64
    f, jac, cov, _ = regression_posterior(net, x, 0.5, 0.2)
    torch.testing.assert_close(f_mu, f[:7], rtol=1e-10, atol=1e-12)
    expected = torch.einsum("nok,kj,npj->nop", jac[:7], cov, jac[:7])
    torch.testing.assert_close(f_var, expected, rtol=1e-8, atol=1e-14)  # without σ², as there
    _, var = la(x[:7], diagonal_output=True)
    torch.testing.assert_close(var, expected[:, :, 0], rtol=1e-8, atol=1e-14)
    # our distribution-valued predictive adds the noise; laplace-torch's f_var does not
    torch.testing.assert_close(
        la.predict(x[:7]).variance, expected[:, :, 0] + 0.04, rtol=1e-8, atol=1e-12
    )


def test_readme_hyperparameter_loop_writes_lambda_and_sigma_back():
    net, x, y = regression_problem()
    la = Laplace(net, likelihoods.Gaussian(torch.tensor(1.0, dtype=F64)), "all", "full")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=40))
    log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(150):
        hyper_optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        hyper_optimizer.step()
    lam, sigma = float(log_prior.exp()), float(log_sigma.exp())
    # the values of the last evaluation were written back, as laplace-torch does
    last_lam = float(la.prior_precision)
    assert float(la.sigma_noise) == pytest.approx(sigma, rel=0.2)
    assert last_lam == pytest.approx(lam, rel=0.2)
    # the evidence it maximised is the dense one, and its gradient there is ~0
    lam_t = torch.tensor(float(la.prior_precision), dtype=F64)
    sigma_t = torch.tensor(float(la.sigma_noise), dtype=F64)
    ours = la.log_marginal_likelihood()
    torch.testing.assert_close(ours, regression_evidence(net, x, y, lam_t, sigma_t), rtol=1e-9, atol=0)
    # predictions after the loop use the written-back λ and σ (not λ = 1, σ = 1)
    f_mu, f_var = la(x[:5])
    _, jac, cov, _ = regression_posterior(net, x, lam_t, sigma_t)
    expected = torch.einsum("nok,kj,npj->nop", jac[:5], cov, jac[:5])
    torch.testing.assert_close(f_var, expected, rtol=1e-8, atol=1e-14)
    assert float(la.guide.likelihood.sigma) == pytest.approx(float(sigma_t), rel=1e-12)


def test_hyperparameter_loop_refactorises_once_not_per_call():
    net, x, y = regression_problem()
    la = Laplace(net, likelihoods.Gaussian(torch.tensor(1.0, dtype=F64)), "all", "full")
    la.fit(x, y)
    calls = []
    original = type(la.guide)._set_posterior
    type(la.guide)._set_posterior = lambda self, *a: (calls.append(1), original(self, *a))[1]
    try:
        for v in (0.5, 0.6, 0.7):
            la.log_marginal_likelihood(torch.tensor([v]), torch.tensor([0.3]))
        assert calls == []  # no K³ factorisation per evaluation
        la(x[:2])
        assert len(calls) == 2  # σ, then λ: once, at the next use
    finally:
        type(la.guide)._set_posterior = original


# ------------------------------------------------------------------ classification


def test_classification_defaults_marglik_and_probit():
    net, x, y = classification_problem()
    la = Laplace(net, likelihoods.Categorical())  # laplace-torch's defaults: last layer, K-FAC
    assert la.hessian_structure == "kron" and la.guide.posterior.name == "kron"
    la = Laplace(net, likelihoods.Categorical(), hessian_structure="full")  # dense algebra below
    la.fit(DataLoader(TensorDataset(x, y), batch_size=16))
    la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit", n_steps=None)  # to convergence
    lam = float(la.prior_precision)
    idx = last_layer(net, 8 * 3 + 3)
    # the tuned λ maximises the dense evidence: d/dlogλ = 0
    def evidence(log_lam):
        f, _, cov, ggn = softmax_posterior(net, x, x[:1], log_lam.exp(), idx)
        w = nn.utils.parameters_to_vector(net.parameters()).detach()[idx]
        loglik = -nn.functional.cross_entropy(dense(net, x)[0], y, reduction="sum")
        k = len(idx)
        lam_ = log_lam.exp()
        return loglik - lam_ * w.square().sum() / 2 + (k * log_lam - torch.logdet(ggn + lam_ * torch.eye(k, dtype=F64))) / 2

    log_lam = torch.tensor(math.log(lam), dtype=F64, requires_grad=True)
    (grad,) = torch.autograd.grad(evidence(log_lam), log_lam)
    assert abs(float(grad)) < 1e-4
    torch.testing.assert_close(la.log_marginal_likelihood(), evidence(log_lam).detach(), rtol=1e-9, atol=0)
    probs = la(x[:9], link_approx="probit")
    f, f_cov, _, _ = softmax_posterior(net, x, x[:9], lam, idx)
    kappa = (1 + math.pi / 8 * f_cov.diagonal(dim1=1, dim2=2)).rsqrt()
    torch.testing.assert_close(probs, (kappa * f).softmax(-1), rtol=1e-9, atol=1e-12)
    assert probs.shape == (9, 3)


def _bridge(f, cov, normalize):
    """The Laplace bridge (Hobbhahn et al. 2022) by dense linear algebra: the Gaussian
    conditioned on 1ᵀf = 0 through the projector form, then eq. (9)."""
    c = f.shape[-1]
    out = []
    for m, s in zip(f, cov):
        ones = torch.ones(c, dtype=F64)
        gain = s @ ones / (ones @ s @ ones)
        m = m - gain * (ones @ m)
        s = s - torch.outer(gain, ones @ s)
        var = s.diagonal()
        if normalize:
            scale = var.mean() / math.sqrt(c / 2)
            m, var = m / scale.sqrt(), var / scale
        alpha = (1 - 2 / c + m.exp() * (-m).exp().sum() / c**2) / var
        out.append(alpha / alpha.sum())
    return torch.stack(out)


@pytest.mark.parametrize("link", ["bridge", "bridge_norm"])
def test_laplace_bridge(link):
    net, x, y = classification_problem()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", "full", prior_precision=2.0)
    probs = la.fit(x, y)(x[:10], link_approx=link)
    idx = last_layer(net, 27)
    f, f_cov, _, _ = softmax_posterior(net, x, x[:10], 2.0, idx)
    torch.testing.assert_close(probs, _bridge(f, f_cov, link == "bridge_norm"), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(probs.sum(-1), torch.ones(10, dtype=F64))


def test_layerwise_prior_maximises_the_evidence_per_parameter_tensor():
    net, x, y = regression_problem()
    la = Laplace(net, likelihoods.Gaussian(torch.tensor(0.2, dtype=F64)), "all", "full")
    la.fit(x, y).optimize_prior_precision(method="marglik", prior_structure="layerwise", n_steps=None)
    groups = la.parameter_groups()
    assert groups.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    per_group = la.prior_precision  # laplace-torch's shape: one value per parameter tensor
    assert per_group.shape == (4,)
    log_lam = per_group.log().clone().requires_grad_(True)
    value = regression_evidence(net, x, y, log_lam.exp()[groups.sizes_index()], 0.2)
    (grad,) = torch.autograd.grad(value, log_lam)
    assert float(grad.abs().max()) < 1e-4  # a stationary point of the dense evidence
    torch.testing.assert_close(la.log_marginal_likelihood(), value.detach(), rtol=1e-9, atol=0)
    # and it beats the best scalar λ
    scalar = Laplace(net, likelihoods.Gaussian(torch.tensor(0.2, dtype=F64)), "all", "full")
    scalar.fit(x, y).optimize_prior_precision(method="marglik", n_steps=None)
    assert float(la.log_marginal_likelihood()) >= float(scalar.log_marginal_likelihood()) - 1e-9
    # laplace-torch's layerwise setter form: one value per parameter tensor
    la.prior_precision = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)
    assert torch.equal(la.prior_precision, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64))
    assert torch.equal(la.guide.prior_precision[groups.sizes_index() == 2].unique(), torch.tensor([3.0], dtype=F64))


def test_gridsearch_with_a_val_loader_picks_the_best_validation_likelihood():
    net, x, y = classification_problem()
    xv, yv = x[40:], y[40:]
    la = Laplace(net, likelihoods.Categorical(), "last_layer").fit(x[:40], y[:40])
    la.optimize_prior_precision(
        method="gridsearch", val_loader=DataLoader(TensorDataset(xv, yv), batch_size=7),
        log_prior_prec_min=-2, log_prior_prec_max=2, grid_size=9,
    )  # fmt: skip
    idx = last_layer(net, 27)
    scores = []
    for lam in torch.logspace(-2, 2, 9, dtype=F64):
        f, f_cov, _, _ = softmax_posterior(net, x[:40], xv, lam, idx)
        kappa = (1 + math.pi / 8 * f_cov.diagonal(dim1=1, dim2=2)).rsqrt()
        scores.append((kappa * f).log_softmax(-1).gather(1, yv[:, None]).mean())
    best = torch.logspace(-2, 2, 9, dtype=F64)[int(torch.stack(scores).argmax())]
    assert float(la.prior_precision) == pytest.approx(float(best), rel=1e-12)


def test_keywords_laplace_torch_has_that_we_cannot_honour_say_what_to_do():
    net, x, y = classification_problem()
    la = Laplace(net, likelihoods.Categorical(), "last_layer").fit(x, y)
    for kw, match in [
        ({"method": "gridsearch", "val_loader": [(x, y)], "loss": lambda a, b: 0}, "loss: "),
        ({"method": "gridsearch", "val_loader": [(x, y)], "pred_type": "nn"}, "pred_type: "),
        ({"method": "gridsearch", "val_loader": [(x, y)], "link_approx": "mc"}, "link_approx: "),
        ({"method": "gridsearch", "prior_structure": "diag", "val_loader": [(x, y)]}, "prior_structure: "),
        ({"method": "marglik", "val_loader": [(x, y)]}, "val_loader: "),
        ({"method": "bayes"}, "method: "),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            la.optimize_prior_precision(**kw)
    with pytest.raises(ValueError, match="joint: "):
        la(x, joint=True)
    with pytest.raises(ValueError, match="override: "):
        la.fit(x, y, override=False)
    with pytest.raises(ValueError, match="sigma_noise: only a Gaussian"):
        la.sigma_noise = 0.3
    assert float(la.sigma_noise) == 1.0  # classification: 1, as in laplace-torch


# ------------------------------------------------------------------ samples


def test_predictive_samples_and_sample_agree_with_the_moments():
    net, x, y = regression_problem()
    sigma = torch.tensor(0.2, dtype=F64)
    la = Laplace(net, likelihoods.Gaussian(sigma), "all", "full", prior_precision=2.0).fit(x, y)
    s = 20000
    f_mu, f_var = la(x[:4])
    glm = la.predictive_samples(x[:4], pred_type="glm", n_samples=s, generator=torch.Generator().manual_seed(0))
    assert glm.shape == (s, 4, 1)
    sd = f_var[:, 0, 0].sqrt()
    assert float(((glm.mean(0) - f_mu)[:, 0] / sd).abs().max()) < 5 / s**0.5
    assert float((glm.var(0)[:, 0] / sd.square() - 1).abs().max()) < 5 * (2 / s) ** 0.5
    # nn: weights drawn, network run; the mean/variance of la(x, pred_type="nn") are theirs
    gen = torch.Generator().manual_seed(1)
    nn_draws = la.predictive_samples(x[:4], pred_type="nn", n_samples=2000, generator=gen)
    mu_nn, var_nn = la(x[:4], pred_type="nn", n_samples=2000, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mu_nn, nn_draws.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var_nn, nn_draws.var(0), rtol=1e-12, atol=1e-12)
    # the weight draws' covariance is Σ (all weights)
    draws = la.sample(s, generator=torch.Generator().manual_seed(2))
    w = nn.utils.parameters_to_vector(net.parameters()).detach()
    _, _, cov, _ = regression_posterior(net, x, 2.0, 0.2)
    centred = draws - w
    err = (centred.T @ centred / s - cov).abs().max() / cov.diagonal().max()
    assert float(err) < 5 * (2 / s) ** 0.5


def test_state_dict_round_trip_and_a_guide_without_its_model_refuses():
    net, x, y = regression_problem()
    la = Laplace(net, likelihoods.Gaussian(torch.tensor(0.5, dtype=F64)), "all", "full").fit(x, y)
    la.optimize_prior_precision(method="marglik")
    state = la.state_dict()
    fresh = Laplace(net, likelihoods.Gaussian(torch.tensor(0.5, dtype=F64)), "all", "full")
    fresh.load_state_dict(state)
    for a, b in zip(la(x[:5]), fresh(x[:5])):
        assert torch.equal(a, b)
    assert torch.equal(la.log_marginal_likelihood(), fresh.log_marginal_likelihood())
    # the guide's state alone, into a fresh object whose model still has λ = 1: refused
    alone = Laplace(net, likelihoods.Gaussian(torch.tensor(0.5, dtype=F64)), "all", "full")
    alone.guide.load_state_dict(la.guide.state_dict())
    with pytest.raises(RuntimeError, match="load the model's state_dict too"):
        alone(x[:5])
    with pytest.raises(ValueError, match="state_dict: holds a Laplace guide's buffers alone"):
        alone.load_state_dict(la.guide.state_dict())


# ------------------------------------------------------------------ against laplace-torch itself


@needs_laplace_torch
def test_regression_and_classification_patterns_match_laplace_torch():
    net, x, y = regression_problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=40)
    theirs = laplace_torch.Laplace(net, "regression", subset_of_weights="all",
                                   hessian_structure="full", sigma_noise=0.2, prior_precision=0.5)  # fmt: skip
    theirs.fit(loader)
    ours = Laplace(net, likelihoods.Gaussian(torch.tensor(0.2, dtype=F64)), "all", "full",
                   prior_precision=0.5).fit(loader)  # fmt: skip
    # relative to the largest entry (float64 on both sides, the same MAP net and λ). On this
    # net laplace-torch's own f_var is 1.6e-6 from the dense inverse (its covariance comes from a
    # less accurate factorisation: 3.5e-5 off the exact inverse here), ours 6e-14: the
    # difference between the two libraries is bounded by laplace-torch's own error
    rel = lambda a, b: float((a - b.to(a)).abs().max() / b.abs().max())  # noqa: E731
    f, jac, cov, _ = regression_posterior(net, x, 0.5, 0.2)
    dense_var = torch.einsum("nok,kj,npj->nop", jac[:6], cov, jac[:6])
    (mu_o, var_o), (mu_t, var_t) = ours(x[:6]), theirs(x[:6])
    assert rel(mu_o, mu_t) < 1e-12 and rel(var_o, dense_var) < 1e-10
    assert rel(var_o, var_t) <= 1.01 * rel(var_t.double(), dense_var) + 1e-12
    dense_lml = regression_evidence(net, x, y, 0.5, 0.2)
    lml_o, lml_t = ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()
    assert rel(lml_o, dense_lml) < 1e-10
    assert rel(lml_o, lml_t) <= 1.01 * rel(lml_t.double(), dense_lml) + 1e-12
    net, x, y = classification_problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=60)
    theirs = laplace_torch.Laplace(net, "classification", subset_of_weights="last_layer",
                                   hessian_structure="full", prior_precision=2.0)  # fmt: skip
    theirs.fit(loader)
    ours = Laplace(net, likelihoods.Categorical(), "last_layer", "full", prior_precision=2.0)
    ours.fit(loader)
    for link in ("probit", "bridge", "bridge_norm"):
        assert rel(ours(x[:8], link_approx=link), theirs(x[:8], link_approx=link)) < 1e-6


def test_a_guide_state_saved_before_the_prior_record_loads_and_asks_for_its_prior():
    net, x, y = regression_problem()
    la = Laplace(net, likelihoods.Gaussian(torch.tensor(0.5, dtype=F64)), "all", "full")
    la.fit(x, y).optimize_prior_precision(method="marglik")
    old = {k: v for k, v in la.guide.state_dict().items() if not k.startswith("posterior_")}
    fresh = Laplace(net, likelihoods.Gaussian(torch.tensor(0.5, dtype=F64)), "all", "full")
    fresh.model.load_state_dict(la.model.state_dict())
    fresh.guide.load_state_dict(old)  # loads (strict): no missing-key error
    with pytest.raises(RuntimeError, match="set_prior_precision"):
        fresh(x[:3])
    fresh.guide.set_prior_precision(fresh.model.prior_precision)
    for a, b in zip(fresh(x[:3]), la(x[:3])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
