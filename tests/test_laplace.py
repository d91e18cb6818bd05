"""Laplace guides and linearised predictives against closed forms and dense linear algebra."""

import math

import pytest
import torch
from pyro.infer import Predictive
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces
from pyro_subspace.flat import FlatNet, eval_mode
from pyro_subspace.infer import (
    AutoSubspaceLaplace,
    DiagonalLaplace,
    linearized_moments,
    linearized_predictive,
    probit,
)
from pyro_subspace.infer.laplace import validation_log_likelihood
from tests.test_curvature import dense_ggn

N, D_IN = 40, 3


def linear_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D_IN, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3
    y = y + 0.2 * torch.randn(N, generator=gen, dtype=torch.float64)
    torch.manual_seed(seed)
    net = nn.Linear(D_IN, 1).double()
    design = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)  # w = (weight, bias)
    return net, x, y, design


def exact_posterior(a, r, sigma, temperature, prior_precision, prior_mean):
    """Posterior of t for r ~ N(a t, σ² T) (tempered), t ~ N(m0, Λ0⁻¹): dense algebra."""
    precision = a.T @ a / (sigma**2 * temperature) + prior_precision
    mean = torch.linalg.solve(
        precision, a.T @ r / (sigma**2 * temperature) + prior_precision @ prior_mean
    )
    return mean, precision


@pytest.mark.parametrize("basis", ["dense", "index"])
def test_linear_gaussian_laplace_is_the_exact_posterior(basis):
    net, x, y, design = linear_problem()
    sub = subspaces.random(net, 3, seed=1) if basis == "dense" else None
    if basis == "index":
        sub = subspaces.Subspace(torch.full((4,), 0.2, dtype=torch.float64), torch.tensor([0, 2]))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.25), prior_scale=0.7, temperature=2.0)
    guide = AutoSubspaceLaplace(model).fit(x, y)
    p = sub.dense_basis()
    k = p.shape[1]
    a, r = design @ p, y - design @ sub.shift
    mean, precision = exact_posterior(
        a,
        r,
        0.25,
        2.0,
        torch.eye(k, dtype=torch.float64) / 0.49,
        torch.zeros(k, dtype=torch.float64),
    )
    assert torch.allclose(guide.loc, mean, rtol=1e-9, atol=1e-11)
    assert torch.allclose(guide.precision, precision, rtol=1e-9)
    assert torch.allclose(guide.covariance, torch.linalg.inv(precision), rtol=1e-8)
    assert torch.allclose(guide.scale_tril @ guide.scale_tril.T, guide.covariance, rtol=1e-9)


def test_zero_centred_prior_is_the_weight_prior_restricted_to_the_subspace():
    # w ~ N(0, λ⁻¹ I) on all weights; the subspace w = ŵ + P t: prior precision λ PᵀP and
    # mean −(PᵀP)⁻¹Pᵀŵ, i.e. the Gaussian conditional of the weight prior.
    net, x, y, design = linear_problem()
    sub = subspaces.random(net, 2, seed=3)
    sub = subspaces.Subspace(sub.shift, 1.7 * sub.basis)  # not orthonormal
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.25))
    lam = 3.0
    guide = AutoSubspaceLaplace(model, prior_precision=lam, prior_mean="zero").fit(x, y)
    p, w0 = sub.dense_basis(), sub.shift
    prior_prec = lam * p.T @ p
    prior_mean = -torch.linalg.solve(p.T @ p, p.T @ w0)
    mean, precision = exact_posterior(
        design @ p, y - design @ w0, 0.25, 1.0, prior_prec, prior_mean
    )
    assert torch.allclose(guide.loc, mean, rtol=1e-9, atol=1e-11)
    assert torch.allclose(guide.precision, precision, rtol=1e-9)
    # The same posterior by brute force: maximise the full joint over t numerically.
    t = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([t], max_iter=200, tolerance_grad=1e-12, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        w = w0 + p @ t
        loss = ((design @ w - y) ** 2).sum() / (2 * 0.0625) + lam / 2 * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.allclose(guide.loc, t.detach(), atol=1e-7)


def test_rescaled_prior_uses_lambda_times_k_over_d():
    net = linear_problem()[0]
    sub = subspaces.Subspace(torch.zeros(4, dtype=torch.float64), torch.tensor([1, 3]))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.25))
    guide = AutoSubspaceLaplace(model, prior_precision=8.0, rescale_prior=True)
    assert float(guide.prior_precision) == pytest.approx(8.0 * 2 / 4)


def test_laplace_evidence_is_exact_for_a_linear_gaussian_model():
    net, x, y, design = linear_problem()
    sub = subspaces.random(net, 3, seed=1)
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.25), prior_scale=0.7)
    guide = AutoSubspaceLaplace(model).fit(x, y)
    a = design @ sub.dense_basis()
    cov = a @ a.T * 0.49 + 0.0625 * torch.eye(N, dtype=torch.float64)
    exact = torch.distributions.MultivariateNormal(design @ sub.shift, cov).log_prob(y)
    assert float(guide.log_marginal_likelihood()) == pytest.approx(float(exact), rel=1e-10)


def test_evidence_as_a_function_of_sigma_matches_a_refit_at_that_sigma():
    net, x, y, _ = linear_problem()
    sub = subspaces.random(net, 3, seed=1)
    fits = {}
    for sigma in (0.25, 0.375):
        model = SubspaceNet(net, sub, likelihoods.Gaussian(sigma))
        fits[sigma] = AutoSubspaceLaplace(model, prior_precision=2.0).fit(x, y, find_map=False)
    moved = fits[0.25].log_marginal_likelihood(prior_precision=2.0, sigma=0.375)
    assert float(moved) == pytest.approx(float(fits[0.375].log_marginal_likelihood()), rel=1e-10)


def test_marglik_optimum_matches_a_fine_grid_of_the_evidence():
    net, x, y, _ = linear_problem()
    sub = subspaces.Subspace(torch.zeros(4, dtype=torch.float64), torch.arange(4))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(sigma_init=0.5))
    guide = AutoSubspaceLaplace(model, prior_precision=1.0).fit(x, y)
    guide.optimize_prior_precision("marglik", optimize_sigma=True)
    lam, sigma = float(guide.prior_precision), float(model.likelihood.sigma.detach())
    best = float(guide.log_marginal_likelihood())
    # A second, brute-force optimiser: fine grids through the optimum along each coordinate
    # (steps 0.5% in λ and 0.2% in σ) find nothing better and put their argmax next to it.
    lams = lam * torch.logspace(-0.5, 0.5, 461, dtype=torch.float64)
    sigmas = sigma * torch.linspace(0.8, 1.2, 201, dtype=torch.float64)
    along_lam = torch.stack([guide.log_marginal_likelihood(g, sigma) for g in lams])
    along_sigma = torch.stack([guide.log_marginal_likelihood(lam, s) for s in sigmas])
    assert float(along_lam.max()) <= best + 1e-9 and float(along_sigma.max()) <= best + 1e-9
    assert float(lams[along_lam.argmax()]) == pytest.approx(lam, rel=0.006)
    assert float(sigmas[along_sigma.argmax()]) == pytest.approx(sigma, rel=0.0021)
    assert 0.1 < sigma < 0.4  # the data were made with σ = 0.2
    # the posterior was updated with the new hyperparameters
    fresh = AutoSubspaceLaplace(model, prior_precision=lam)
    fresh.fit(x, y)
    assert torch.allclose(fresh.precision, guide.precision, rtol=1e-6)


def small_classifier(case="categorical", seed=0):
    torch.manual_seed(seed)
    o = 3 if case == "categorical" else 1
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, o)).double()
    x = torch.randn(30, 2, dtype=torch.float64)
    lik = likelihoods.Categorical() if case == "categorical" else likelihoods.Bernoulli()
    y = torch.randint(0, 3, (30,)) if case == "categorical" else torch.randint(0, 2, (30,))
    return net, x, y, lik


def dense_jacobian(net, x, w):
    flat = FlatNet(net)
    with eval_mode(net):
        return torch.autograd.functional.jacobian(lambda v: flat(v, x), w)  # (N, O, D)


@pytest.mark.parametrize("basis", ["index", "dense"])
def test_subnetwork_precision_and_linearized_covariance_against_dense_jacobians(basis, device):
    net, x, y, lik = small_classifier()
    net, x, y = net.to(device), x.to(device), y.to(device)
    w0 = FlatNet(net).vector()
    if basis == "index":
        sub = subspaces.Subspace(w0, torch.tensor([0, 5, 13, 20, 33, 38]))
    else:
        sub = subspaces.random(net, 4, seed=2)
    model = SubspaceNet(net, sub, lik)
    guide = AutoSubspaceLaplace(model, prior_precision=2.5, prior_mean="zero").fit(x, y)
    assert guide.loc.device == guide.precision.device == device
    w_star = sub.weights(guide.loc)
    p = sub.dense_basis()
    expected = p.T @ dense_ggn_at(net, lik, x, w_star) @ p + 2.5 * p.T @ p
    assert torch.allclose(guide.precision, expected, rtol=1e-8, atol=1e-10)
    x_test = torch.randn(7, 2, dtype=torch.float64).to(device)
    f_mean, f_cov = linearized_moments(guide, x_test)
    jp = dense_jacobian(net, x_test, w_star) @ p
    assert torch.allclose(f_cov, jp @ guide.covariance @ jp.transpose(1, 2), rtol=1e-8, atol=1e-12)
    with eval_mode(net):
        assert torch.allclose(f_mean, FlatNet(net)(w_star, x_test), rtol=1e-12)


def dense_ggn_at(net, lik, x, w):
    saved = FlatNet(net).vector()
    FlatNet(net).load_vector(w)
    try:
        return dense_ggn(net, lik, x)
    finally:
        FlatNet(net).load_vector(saved)


def test_map_search_reaches_a_stationary_point_of_the_log_joint():
    net, x, y, lik = small_classifier()
    sub = subspaces.random(net, 5, seed=4)
    model = SubspaceNet(net, sub, lik, prior_scale=2.0)
    guide = AutoSubspaceLaplace(model).fit(x, y)
    t = guide.loc.clone().requires_grad_(True)
    loss = -lik.log_prob(model.outputs(t, x), y).sum() + (t @ t) / 8
    (grad,) = torch.autograd.grad(loss, t)
    assert grad.abs().max() < 1e-6
    assert guide.loc.abs().max() > 1e-3  # it moved away from the shift


@pytest.mark.parametrize("case", ["categorical", "bernoulli"])
def test_probit_and_monte_carlo_classification_predictives(case):
    net, x, y, lik = small_classifier(case)
    sub = subspaces.Subspace(FlatNet(net).vector(), torch.arange(12, 21))
    guide = AutoSubspaceLaplace(SubspaceNet(net, sub, lik), prior_precision=0.3)
    guide.fit(x, y, find_map=False)
    x_test = 3 * torch.randn(6, 2, dtype=torch.float64)
    f_mean, f_cov = linearized_moments(guide, x_test)
    var = f_cov.diagonal(dim1=-2, dim2=-1)
    z = f_mean / (1 + math.pi / 8 * var).sqrt()
    expected = z.softmax(-1) if case == "categorical" else z.squeeze(-1).sigmoid()
    assert torch.allclose(linearized_predictive(guide, x_test).probs, expected, rtol=1e-12)
    assert torch.allclose(probit(f_mean, f_cov, lik), expected, rtol=1e-12)
    s = 4000
    mc = linearized_predictive(guide, x_test, link_approx="mc", num_samples=s, seed=1).probs
    # independent Monte Carlo: torch's MultivariateNormal sampler, many more draws
    gen_draws = torch.distributions.MultivariateNormal(f_mean, f_cov).sample((100000,))
    probs = gen_draws.softmax(-1) if case == "categorical" else gen_draws.squeeze(-1).sigmoid()
    ref, sd = probs.mean(0), probs.std(0)
    assert ((mc - ref).abs() <= 5 * sd / math.sqrt(s) + 1e-9).all()


def test_regression_predictive_is_closed_form_and_matches_pyro_predictive():
    net, x, y, design = linear_problem()
    sub = subspaces.random(net, 3, seed=1)
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.25), prior_scale=0.7)
    guide = AutoSubspaceLaplace(model).fit(x, y)
    mean, var = _mean_var(linearized_predictive(guide, x[:5]))
    a = design[:5] @ sub.dense_basis()
    expected_var = torch.einsum("nk,kj,nj->n", a, guide.covariance, a) + 0.0625
    assert mean.shape == var.shape == (5, 1)
    assert torch.allclose(var[:, 0], expected_var, rtol=1e-10)
    s = 20000
    f = Predictive(model, guide=guide, num_samples=s, parallel=True)(x[:5])["f"].reshape(s, 5)
    f_var = expected_var - 0.0625
    # a linear model: the sampling predictive has the same moments, up to MC error
    assert ((f.mean(0) - mean[:, 0]).abs() <= 5 * (f_var / s).sqrt()).all()
    assert ((f.var(0) / f_var - 1).abs() <= 5 * math.sqrt(2 / s)).all()


def test_heteroscedastic_regression_uses_the_predicted_noise():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.linspace(-2, 2, 25, dtype=torch.float64)[:, None]
    y = torch.sin(2 * x[:, 0])
    lik = likelihoods.Gaussian(heteroscedastic=True)
    sub = subspaces.subnetwork(net, 18, strategy="last_layer")
    guide = AutoSubspaceLaplace(SubspaceNet(net, sub, lik)).fit(x, y, find_map=False)
    mean, var = _mean_var(linearized_predictive(guide, x))
    f_mean, f_cov = linearized_moments(guide, x)
    noise = (torch.nn.functional.softplus(f_mean[:, 1]) + lik.min_scale) ** 2
    assert torch.allclose(mean[:, 0], f_mean[:, 0])
    assert torch.allclose(var[:, 0], f_cov[:, 0, 0] + noise, rtol=1e-10)


def test_validation_grid_picks_the_best_refit():
    net, x, y, _ = linear_problem()
    sub = subspaces.random(net, 3, seed=1)
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.25))
    guide = AutoSubspaceLaplace(model).fit(x[:25], y[:25], find_map=False)
    grid = torch.logspace(-3, 3, 13, dtype=torch.float64)
    scores = validation_log_likelihood(guide, x[25:], y[25:], grid)
    for lam, score in zip(grid, scores):  # second path: refit at λ and score by hand
        # a model of its own: the prior lives in the model, which the first guide still uses
        own = SubspaceNet(net, sub, likelihoods.Gaussian(0.25))
        refit = AutoSubspaceLaplace(own, prior_precision=float(lam))
        mean, var = _mean_var(
            linearized_predictive(refit.fit(x[:25], y[:25], find_map=False), x[25:])
        )
        ll = torch.distributions.Normal(mean[:, 0], var[:, 0].sqrt()).log_prob(y[25:]).mean()
        assert float(score) == pytest.approx(float(ll), rel=1e-10)
    guide.optimize_prior_precision("grid", x_val=x[25:], y_val=y[25:], grid=grid)
    assert float(guide.prior_precision) == float(grid[int(scores.argmax())])


def test_ggn_eigen_matches_dense_eigh():
    net, x, _, lik = small_classifier()
    sub = subspaces.ggn_eigen(net, lik, x, 4, num_iter=39)  # D = 39: exact
    values, vectors = torch.linalg.eigh(dense_ggn(net, lik, x))
    top = values.flip(0)[:4]
    assert torch.allclose(sub.eigenvalues, top, rtol=1e-8)
    assert torch.allclose(sub.basis.T @ sub.basis, torch.eye(4, dtype=torch.float64), atol=1e-10)
    overlap = (sub.basis.T @ vectors[:, -4:]).abs()  # the same invariant subspace
    assert torch.allclose(overlap.square().sum(1), torch.ones(4, dtype=torch.float64), atol=1e-8)
    assert torch.equal(sub.shift, FlatNet(net).vector())


def test_bad_arguments_fail_early():
    net, x, y, lik = small_classifier()
    sub = subspaces.random(net, 3, seed=0)
    model = SubspaceNet(net, sub, lik)
    with pytest.raises(TypeError, match="model"):
        AutoSubspaceLaplace(net)
    with pytest.raises(ValueError, match="prior_mean"):
        AutoSubspaceLaplace(model, prior_mean="origin")
    with pytest.raises(ValueError, match="prior_precision"):
        AutoSubspaceLaplace(model, prior_precision=-1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        AutoSubspaceLaplace(model, prior_precision=torch.tensor([1.0, 2, 3]), prior_mean="zero")
    guide = AutoSubspaceLaplace(model)
    with pytest.raises(RuntimeError, match="fit"):
        guide()
    with pytest.raises(ValueError, match="y"):
        guide.fit(x, y[:5])
    guide.fit(x, y)
    with pytest.raises(ValueError, match="link_approx"):
        linearized_predictive(guide, x, link_approx="closed_form")
    with pytest.raises(ValueError, match="x_val"):
        guide.optimize_prior_precision("grid")
    with pytest.raises(ValueError, match="sigma"):
        guide.log_marginal_likelihood(sigma=1.0)
    with pytest.raises(ValueError, match="rank"):
        subspaces.ggn_eigen(net, lik, x, 0)


def test_diagonal_laplace_covariance_against_dense_jacobians():
    net, x, _, lik = small_classifier()
    diag = DiagonalLaplace(net, lik, prior_precision=2.0, temperature=1.5).fit(x)
    variance = 1 / (dense_ggn(net, lik, x).diagonal() / 1.5 + 2.0)
    assert torch.allclose(diag.variance, variance, rtol=1e-10)
    x_test = torch.randn(4, 2, dtype=torch.float64)
    jac = dense_jacobian(net, x_test, FlatNet(net).vector())
    f_mean, f_cov = linearized_moments(diag, x_test)
    expected = jac @ torch.diag(variance) @ jac.transpose(1, 2)
    assert torch.allclose(f_cov, expected, rtol=1e-10, atol=1e-14)
    probs = linearized_predictive(diag, x_test).probs
    assert torch.allclose(probs, probit(f_mean, f_cov, lik))


def test_diagonal_laplace_grid_picks_the_best_validation_likelihood():
    net, x, y, lik = small_classifier()
    grid = torch.logspace(-2, 2, 9, dtype=torch.float64)
    diag = DiagonalLaplace(net, lik).fit(x[:20])
    diag.optimize_prior_precision(x[20:], y[20:], grid)
    scores = []
    for lam in grid:  # second path: a fresh fit at each λ, scored by hand
        refit = DiagonalLaplace(net, lik, prior_precision=float(lam)).fit(x[:20])
        probs = linearized_predictive(refit, x[20:]).probs
        scores.append(float(probs[torch.arange(10), y[20:]].log().mean()))
    assert diag.prior_precision == float(grid[int(torch.tensor(scores).argmax())])


def _mean_var(predictive):
    """Mean and variance of a regression predictive distribution."""
    return predictive.mean, predictive.variance
