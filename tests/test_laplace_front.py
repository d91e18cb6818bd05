"""`infer.Laplace` with laplace-torch's habits: the fit at the network's weights, its argument
and attribute names, and nothing accepted and then ignored. Numbers against a brute-force GGN
(``torch.autograd.functional.jacobian``) and against the same fit reached the other way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import likelihoods
from pyro_subspace.infer import Laplace, linearized_moments

LAM = 0.7


def classifier(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(40, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    return net, x, y


def brute_force_covariance(net, x, indices, lam):
    """``(Σ_n J_nᵀ H_n J_n + λ I)⁻¹`` over the weights at ``indices``, H = diag(p) − ppᵀ."""
    params = dict(net.named_parameters())
    w = torch.nn.utils.parameters_to_vector(net.parameters()).detach()

    def logits(v):
        pieces, at = {}, 0
        for name, p in params.items():
            pieces[name] = v[at : at + p.numel()].reshape(p.shape)
            at += p.numel()
        return torch.func.functional_call(net, pieces, (x,))

    jac = torch.autograd.functional.jacobian(logits, w)[:, :, indices]  # (N, C, K)
    p = torch.softmax(logits(w), -1)
    h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    ggn = torch.einsum("nck,ncd,ndj->kj", jac, h, jac)
    return torch.linalg.inv(ggn + lam * torch.eye(len(indices), dtype=torch.float64))


def test_fit_is_at_the_networks_weights_like_laplace_torch():
    # the net was not trained with weight decay λ/N, so the MAP of this posterior is elsewhere:
    # the default fit keeps t* = 0 (the predictive mean is net(x)); find_map=True moves it
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=LAM, hessian_structure="full").fit(x, y)
    assert torch.equal(la.loc, torch.zeros_like(la.loc))
    mean, _ = linearized_moments(la, x)
    torch.testing.assert_close(mean, net(x).detach(), rtol=0, atol=1e-12)
    d = sum(p.numel() for p in net.parameters())
    last = torch.arange(d - 21, d)  # the 6 x 3 weights and 3 biases of the last layer
    expected = brute_force_covariance(net, x, last, LAM)
    torch.testing.assert_close(la.posterior_covariance, expected, rtol=1e-9, atol=1e-12)
    moved = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=LAM, hessian_structure="full")
    assert float(moved.fit(x, y, find_map=True).loc.abs().max()) > 1e-2


def test_all_weights_leaves_frozen_parameters_out():
    net, x, y = classifier()
    net[0].weight.requires_grad_(False)  # the first 18 of the 45 weights frozen
    la = Laplace(net, likelihoods.Categorical(), "all", prior_precision=LAM, hessian_structure="full").fit(x, y)
    assert la.n_params == 45 - 18
    trainable = torch.arange(18, 45)
    expected = brute_force_covariance(net, x, trainable, LAM)
    torch.testing.assert_close(la.posterior_covariance, expected, rtol=1e-8, atol=1e-11)
    net[0].bias.requires_grad_(False), net[2].requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        Laplace(net, likelihoods.Categorical(), "all", hessian_structure="full")


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
def test_laplace_torch_attribute_names(structure):
    net, x, y = classifier()
    kw = {"rank": 4} if structure == "lowrank" else {}
    la = Laplace(net, likelihoods.Categorical(), "all", structure, LAM, **kw).fit(x, y)
    assert la.get_posterior().sample().shape == (la.n_params,)
    variance = la.posterior_variance
    cov = la.posterior_covariance
    assert cov.shape == (la.n_params, la.n_params)
    torch.testing.assert_close(variance, torch.diagonal(cov), rtol=1e-10, atol=0)
    precision = la.posterior_precision  # laplace-torch's form: (K, K), (K,), ((U, l), p)
    if structure == "lowrank":
        (u, l), p = precision
        dense = torch.diag(p) + (u * l) @ u.T
    else:
        dense = precision if structure == "full" else torch.diag(precision)
    eye = torch.eye(la.n_params, dtype=cov.dtype)
    torch.testing.assert_close(dense @ cov, eye, rtol=0, atol=1e-8)


def test_prior_precision_takes_tensors_and_numpy_scalars_and_its_setter_refits():
    net, x, y = classifier()
    make = lambda lam: Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=lam, hessian_structure="full")
    ref = make(1.3).fit(x, y).posterior_covariance
    for lam in (torch.tensor(1.3, dtype=torch.float64), np.float64(1.3), np.float32(1.3)):
        got = make(lam).fit(x, y).posterior_covariance
        torch.testing.assert_close(got, ref, rtol=1e-6 if lam.dtype == np.float32 else 0, atol=0)
    la = make(LAM).fit(x, y)
    la.prior_precision = 1.3
    assert float(la.prior_precision) == 1.3
    torch.testing.assert_close(la.posterior_covariance, ref, rtol=1e-12, atol=0)


def test_nothing_is_accepted_and_then_ignored():
    net, *_ = classifier()
    lik = likelihoods.Categorical()
    with pytest.raises(ValueError, match="sigma_noise: only for a Gaussian"):  # classification
        Laplace(net, lik, "last_layer", sigma_noise=0.1, hessian_structure="full")
    with pytest.raises(TypeError, match="subnetwork_indices: only with subset_of_weights='subnetwork'"):
        Laplace(net, lik, "last_layer", subnetwork_indices=torch.arange(5), hessian_structure="full")
    with pytest.raises(TypeError, match="subnetwork_indices: .*leave n_params and strategy out"):
        Laplace(net, lik, "subnetwork", n_params=5, subnetwork_indices=torch.arange(5))
    with pytest.raises(TypeError, match="prior_precison"):  # a misspelling
        Laplace(net, lik, "last_layer", prior_precison=100.0, hessian_structure="full")
    with pytest.raises(TypeError, match="seed: unexpected keyword"):  # only with "subnetwork"
        Laplace(net, lik, "last_layer", seed=0, hessian_structure="full")
    a = Laplace(net, lik, "subnetwork", n_params=5, strategy="random", seed=3, hessian_structure="full")
    b = Laplace(net, lik, "subnetwork", n_params=5, strategy="random", seed=3, hessian_structure="full")
    assert torch.equal(a.model.subspace.basis, b.model.subspace.basis)


def test_calling_la_predicts_and_the_pyro_guide_is_la_guide():
    from pyro.infer import Predictive

    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=LAM, hessian_structure="full").fit(x, y)
    probs = la(x, pred_type="glm", link_approx="probit")  # laplace-torch's most common line
    torch.testing.assert_close(probs, la.predict(x, link_approx="probit").probs, rtol=0, atol=0)
    assert la.guide(x)["t"].shape == (la.n_params,)  # the Pyro guide call: one draw of t
    draws = Predictive(la.model, guide=la.guide, num_samples=3)(x)
    assert draws["t"].shape == (3, 1, la.n_params)
    with pytest.raises(TypeError, match="la.guide"):  # la itself is not a guide
        Predictive(la.model, guide=la, num_samples=3)(x)


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_the_probit_predictive_in_chunks_equals_one_pass(structure):
    """``la(x)`` (probit) runs chunk by chunk of ``chunk_size`` rows (memory of one chunk's
    moments): the same probabilities as one pass's moments (brute force: the guide's
    `predict`, which forms them for all rows), a last chunk shorter than the others."""
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "all", structure, LAM, chunk_size=7).fit(x, y)
    want = la.predict(x, link_approx="probit").probs
    torch.testing.assert_close(la(x), want, rtol=1e-15, atol=0)


def test_predict_and_tuning_take_laplace_torch_names():
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=LAM, hessian_structure="full").fit(x, y)
    probit = la.predict(x, pred_type="glm", link_approx="probit").probs
    torch.testing.assert_close(probit, la.predict(x, link_approx="probit").probs)
    with pytest.raises(ValueError, match="pred_type: only 'glm'.*la\\(x, pred_type='nn'\\)"):
        la.predict(x, pred_type="nn")
    torch.manual_seed(5)
    mc_a = la.predict(x, link_approx="mc", n_samples=30).probs
    torch.manual_seed(5)
    mc_b = la.predict(x, link_approx="mc", num_samples=30).probs
    assert torch.equal(mc_a, mc_b)
    # the grid on a DataLoader and by laplace-torch's name = the grid on the tensors
    xv, yv = x[:20], y[:20]
    grid = torch.logspace(-2, 2, 9, dtype=torch.float64)
    la.optimize_prior_precision("grid", x_val=xv, y_val=yv, grid=grid)
    lam, scores = float(la.prior_precision), la.grid_scores.clone()
    other = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=LAM, hessian_structure="full").fit(x, y)
    loader = DataLoader(TensorDataset(xv, yv), batch_size=6)
    other.optimize_prior_precision(method="gridsearch", val_loader=loader, grid=grid)
    assert float(other.prior_precision) == lam
    torch.testing.assert_close(other.grid_scores, scores, rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match="x_val: is float32"):  # named before any work
        other.optimize_prior_precision("grid", x_val=xv.float(), y_val=yv, grid=grid)


def test_a_selected_subnetwork_gets_the_papers_rescaled_prior():
    # Subnetwork Inference, section 4 / appendix C: the K selected weights get λ_S = λ·K/D
    net, x, y = classifier()
    lik, d, k = likelihoods.Categorical(), 45, 8
    la = Laplace(net, lik, "subnetwork", prior_precision=3.0, n_params=k, strategy="magnitude", hessian_structure="full")
    la.fit(x, y)
    indices = la.model.subspace.basis.cpu()
    assert float(la.prior_precision) == pytest.approx(3.0 * k / d, rel=1e-12)
    expected = brute_force_covariance(net, x, indices, 3.0 * k / d)
    torch.testing.assert_close(la.posterior_covariance, expected, rtol=1e-9, atol=1e-12)
    plain = Laplace(net, lik, "subnetwork", prior_precision=3.0, n_params=k, rescale_prior=False, hessian_structure="full")
    expected = brute_force_covariance(net, x, indices, 3.0)
    torch.testing.assert_close(
        plain.fit(x, y).posterior_covariance, expected, rtol=1e-9, atol=1e-12
    )
    # flat indices (laplace-torch's subnetwork_indices) keep λ as given
    by_index = Laplace(net, lik, indices, prior_precision=3.0, hessian_structure="full")
    assert float(by_index.prior_precision) == 3.0


def test_predict_takes_a_dataset_or_dataloader_of_the_inputs():
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", hessian_structure="full").fit(x, y)
    want = la.predict(x, link_approx="probit").probs
    for data in (TensorDataset(x, y), DataLoader(TensorDataset(x, y), batch_size=7)):
        assert torch.equal(la.predict(data, link_approx="probit").probs, want)


def test_sample_draws_like_laplace_torch_last_layer_or_all_weights():
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=LAM, hessian_structure="full").fit(x, y)
    gen = torch.Generator().manual_seed(0)
    draws = la.sample(20000, generator=gen)  # (S, K): laplace-torch's LLLaplace.sample
    w = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    assert draws.shape == (20000, 21)
    last = draws - w[24:]
    cov = la.posterior_covariance
    # sample covariance within Monte Carlo error: sd of an entry is about sqrt(2/S) of scale
    err = (last.T @ last / 20000 - cov).abs().max() / cov.diagonal().max()
    assert err < 5 * (2 / 20000) ** 0.5
    assert abs(float(last.mean(0).abs().max())) < 5 * float(cov.diagonal().max() / 20000) ** 0.5
    again = la.sample(20000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, draws)
    # a subnetwork given by indices: (S, D), the subset drawn, the rest at the MAP
    indices = torch.arange(24, 45)
    sub = Laplace(net, likelihoods.Categorical(), indices, prior_precision=LAM, hessian_structure="full").fit(x, y)
    full = sub.sample(20000, generator=torch.Generator().manual_seed(0))
    assert full.shape == (20000, 45) and torch.equal(full[:, :24], w[:24].expand(20000, 24))
    torch.testing.assert_close(full[:, 24:], draws, rtol=0, atol=1e-12)  # the same posterior
