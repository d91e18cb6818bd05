import math
import warnings

import pyro
import pytest
import torch
from pyro import poutine
from scipy import stats
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces


def test_gaussian_log_prob_matches_scipy_and_accepts_column_targets():
    out = torch.randn(4, 10, 1, dtype=torch.float64)
    y = torch.randn(10, dtype=torch.float64)
    lik = likelihoods.Gaussian(sigma=0.7)
    lp = lik.log_prob(out, y)
    ref = stats.norm.logpdf(y.numpy(), loc=out[..., 0].numpy(), scale=0.7)
    assert lp.shape == (4, 10)
    assert torch.allclose(lp, torch.as_tensor(ref), atol=1e-5)
    assert torch.allclose(lik.log_prob(out, y[:, None]), lp)  # (N, 1) targets: no (N, N) broadcast


def test_heteroscedastic_and_multioutput_gaussian():
    out = torch.randn(10, 2, dtype=torch.float64)
    y = torch.randn(10, dtype=torch.float64)
    lik = likelihoods.Gaussian(heteroscedastic=True, min_scale=1e-3)
    scale = torch.log1p(torch.exp(out[:, 1])) + 1e-3
    ref = stats.norm.logpdf(y.numpy(), out[:, 0].numpy(), scale.numpy())
    assert torch.allclose(lik.log_prob(out, y), torch.as_tensor(ref), atol=1e-6)
    multi = likelihoods.Gaussian(sigma=0.5)
    y2 = torch.randn(10, 2, dtype=torch.float64)
    ref2 = stats.norm.logpdf(y2.numpy(), out.numpy(), 0.5).sum(-1)
    assert torch.allclose(multi.log_prob(out, y2), torch.as_tensor(ref2), atol=1e-6)


def test_categorical_and_bernoulli_match_closed_forms():
    logits = torch.randn(6, 3, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 0, 2])
    ref = logits[torch.arange(6), y] - torch.logsumexp(logits, -1)
    assert torch.allclose(likelihoods.Categorical().log_prob(logits, y), ref)
    z = torch.randn(6, 1, dtype=torch.float64)
    b = torch.tensor([1.0, 0, 0, 1, 1, 0], dtype=torch.float64)
    p = torch.sigmoid(z[:, 0])
    ref_b = b * p.log() + (1 - b) * (1 - p).log()
    assert torch.allclose(likelihoods.Bernoulli().log_prob(z, b), ref_b)


@pytest.mark.parametrize(
    "lik, outputs, y, match",
    [
        (likelihoods.Gaussian(0.1), torch.zeros(5, 1), torch.zeros(4), "y: expected 5 targets"),
        (
            likelihoods.Gaussian(0.1),
            torch.zeros(5, 1),
            torch.zeros(5, 5),
            r"y: expected shape \(5,\) or \(5, 1\)",
        ),
        (
            likelihoods.Gaussian(0.1),
            torch.zeros(5, 1),
            torch.full((5,), float("nan")),
            "y: contains NaN",
        ),
        (
            likelihoods.Gaussian(heteroscedastic=True),
            torch.zeros(5, 1),
            torch.zeros(5),
            "needs 2 network output",
        ),
        (
            likelihoods.Categorical(),
            torch.zeros(5, 3),
            torch.tensor([0, 1, 2, 3, 0]),
            r"labels must lie in \[0, 3\)",
        ),
        (
            likelihoods.Categorical(),
            torch.zeros(5, 3),
            torch.tensor([0.5, 1, 2, 0, 0]),
            "must be integers",
        ),
        (
            likelihoods.Bernoulli(),
            torch.zeros(5, 1),
            torch.tensor([0.0, 1, 2, 0, 1]),
            "must be 0 or 1",
        ),
    ],
)
def test_likelihoods_reject_bad_targets_and_outputs(lik, outputs, y, match):
    with pytest.raises(ValueError, match=match):
        lik.log_prob(outputs, y)


def test_gaussian_rejects_bad_sigma():
    with pytest.raises(ValueError, match="sigma"):
        likelihoods.Gaussian(sigma=-1.0)
    with pytest.raises(ValueError, match="sigma: must be None when heteroscedastic"):
        likelihoods.Gaussian(sigma=1.0, heteroscedastic=True)


def obs_log_prob_sum(model, *args, **kwargs):
    """Sum over the 'obs' site of the scaled log-probability, as Pyro's inference sees it."""
    trace = poutine.trace(model).get_trace(*args, **kwargs)
    trace.compute_log_prob()
    site = trace.nodes["obs"]
    return site["log_prob_sum"], trace


def make_model(temperature, lik=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1))
    sub = subspaces.random(net, 3, seed=0)
    return SubspaceNet(net, sub, lik or likelihoods.Gaussian(0.3), temperature=temperature)


def test_temperature_scales_the_log_likelihood_by_exactly_one_over_t():
    x, y = torch.randn(40, 2), torch.randn(40)
    model = make_model(temperature=4.0)
    got, trace = obs_log_prob_sum(model, x, y)
    t = trace.nodes["t"]["value"]
    untempered = likelihoods.Gaussian(0.3).log_prob(model.outputs(t, x), y).sum()
    assert torch.allclose(got, untempered / 4.0, rtol=1e-6)
    auto = make_model(temperature="auto")
    assert auto.temperature_for(40) == 40 / 3
    got_auto, trace = obs_log_prob_sum(auto, x, y)
    untempered = (
        likelihoods.Gaussian(0.3).log_prob(auto.outputs(trace.nodes["t"]["value"], x), y).sum()
    )
    assert torch.allclose(got_auto, untempered * 3 / 40, rtol=1e-6)


def test_subsampling_scales_by_n_over_batch():
    x, y = torch.randn(40, 2), torch.randn(40)
    model = make_model(temperature=2.0)
    got, trace = obs_log_prob_sum(model, x, y, subsample_size=8)
    idx = trace.nodes["data"]["value"]
    assert idx.shape == (8,)
    lp = likelihoods.Gaussian(0.3).log_prob(
        model.outputs(trace.nodes["t"]["value"], x[idx]), y[idx]
    )
    assert torch.allclose(got, lp.sum() * (40 / 8) / 2.0, rtol=1e-6)


def test_learned_sigma_is_a_pyro_param():
    lik = likelihoods.Gaussian(sigma_init=2.0)
    model = make_model(1.0, lik)
    poutine.trace(model).get_trace(torch.randn(5, 2), torch.randn(5))
    assert math.isclose(pyro.param("likelihood.sigma").item(), 2.0, rel_tol=1e-6)


def test_a_new_model_uses_its_own_learned_sigma_not_a_stale_param_store_entry():
    # a first model traced under Pyro leaves "likelihood.sigma" = 2 in the global param store;
    # a second model whose likelihood holds 0.1 (as fit_map leaves it) must observe with 0.1
    x, y = torch.randn(6, 2), torch.randn(6)
    poutine.trace(make_model(1.0, likelihoods.Gaussian(sigma_init=2.0))).get_trace(x, y)
    assert math.isclose(pyro.param("likelihood.sigma").item(), 2.0, rel_tol=1e-6)
    with pytest.warns(UserWarning, match="'likelihood.sigma' = 2 .*this model: 0.1"):
        model = make_model(1.0, likelihoods.Gaussian(sigma_init=0.1))
    got, trace = obs_log_prob_sum(model, x, y)
    f = model.outputs(trace.nodes["t"]["value"], x)[:, 0].detach()
    expected = stats.norm(f.numpy(), 0.1).logpdf(y.numpy()).sum()
    assert math.isclose(float(got), expected, rel_tol=1e-5)
    assert math.isclose(float(model.likelihood.sigma), 0.1, rel_tol=1e-6)
    # the same likelihood again (the store holds its own value): nothing to drop, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_model(1.0, model.likelihood)


def test_gaussian_log_prob_prepared_equals_torchs_normal():
    """The closed form of `Gaussian.log_prob_prepared` gives torch's ``Normal.log_prob``
    numbers exactly (float32 and float64, one and several draws)."""
    from torch.distributions import Normal

    lik = likelihoods.Gaussian(0.3)
    for dtype in (torch.float32, torch.float64):
        out, y = torch.randn(3, 40, 1, dtype=dtype), torch.randn(40, dtype=dtype)
        want = Normal(out.squeeze(-1), lik.sigma.to(dtype)).log_prob(y)  # its float32 σ
        assert torch.equal(lik.log_prob(out, y), want)
        assert torch.equal(lik.log_prob_prepared(out[0], y), want[0])


def test_heteroscedastic_global_variance_is_the_papers_uci_form_and_is_learned():
    # Subspace Inference G.1.1: σ²(x) = s² + softplus(raw), s² learned (initialised at 1)
    from pyro_subspace import fit_map

    lik = likelihoods.Gaussian(heteroscedastic=True, global_variance=True)
    out = torch.tensor([[0.3, -3.0], [1.0, 0.0], [-2.0, 2.0]])
    softplus = torch.log1p(torch.exp(out[:, 1]))
    assert torch.allclose(lik.variance(out), 1.0 + softplus)
    torch.manual_seed(0)
    x = torch.randn(200, 1)
    y = x[:, 0] + 0.05 * torch.randn(200)  # noise far below the initial s = 1
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 2))
    fit_map(net, lik, x, y, epochs=300, lr=1e-2, progress=False)
    assert float(lik.s2.detach()) < 0.1
    with pytest.raises(ValueError, match="global_variance: only with heteroscedastic=True"):
        likelihoods.Gaussian(global_variance=True)
