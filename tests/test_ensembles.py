"""Deep ensembles: the mixture-predictive interface against direct computations (SWAG: test_swag)."""

import math

import pytest
import torch
from torch import nn

from pyro_subspace import FlatNet, likelihoods, metrics
from pyro_subspace.infer.ensembles import DeepEnsemble, train_ensemble


def _blobs(n=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    y = torch.arange(n) % 3
    return centres[y] + 0.6 * torch.randn(n, 2, generator=gen), y


def _make_net():
    return nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))


def test_train_ensemble_seeds_members_and_collects_swag_from_the_map():
    x, y = _blobs()
    lik = likelihoods.Categorical()
    kw = {"epochs": 30, "lr": 0.05, "batch_size": 20}
    ens = train_ensemble(_make_net, lik, x, y, n_members=3, progress=False, collector=True,
                         swa_epochs=4, swa_lr=0.05, **kw)  # fmt: skip
    assert ens.seeds == [0, 1, 2] and len(ens.nets) == 3 and len(ens.losses[0]) == 30 + 4
    w = [FlatNet(n).vector() for n in ens.nets]
    assert not torch.allclose(w[0], w[1])
    again = train_ensemble(_make_net, lik, x, y, seeds=[1], progress=False, **kw)
    assert torch.equal(FlatNet(again.nets[0]).vector(), w[1])  # reproducible per seed
    for net, col in zip(ens.nets, ens.collectors):
        assert col.n_collected == 4 and col.flat.net is not net
        assert not torch.equal(col.flat.vector(), FlatNet(net).vector())  # nets stay at the MAP
    assert ens.likelihoods[0] is lik  # nothing learnable: shared
    with pytest.raises(ValueError, match="seeds"):
        train_ensemble(_make_net, lik, x, y, seeds=[0, 0])
    with pytest.raises(ValueError, match="swa_epochs"):
        train_ensemble(_make_net, lik, x, y, collector=True, swa_epochs=1)
    with pytest.raises(TypeError, match="make_net"):
        train_ensemble(None, lik, x, y)
    with pytest.raises(TypeError, match="seed"):
        train_ensemble(_make_net, lik, x, y, seed=3)


def test_learned_noise_is_copied_per_member():
    x = torch.linspace(-1, 1, 20)[:, None]
    y = x[:, 0] ** 2
    ens = train_ensemble(lambda: nn.Linear(1, 1), likelihoods.Gaussian(), x, y, n_members=2,
                         progress=False, epochs=5)  # fmt: skip
    assert ens.likelihoods[0] is not ens.likelihoods[1]


def test_deep_ensemble_classification_is_the_average_softmax():
    x, y = _blobs()
    torch.manual_seed(0)
    nets = [_make_net() for _ in range(3)]
    de = DeepEnsemble(nets, likelihoods.Categorical())
    probs = de.predict(x).probs
    direct = torch.stack([n(x).softmax(-1) for n in nets]).mean(0).double()
    assert probs.shape == (60, 3) and torch.allclose(probs, direct, atol=1e-6)
    lp = de.log_prob(x, y)
    assert torch.allclose(lp, direct[torch.arange(60), y].log(), atol=1e-6)
    assert metrics.categorical_nll(probs, y) == pytest.approx(-lp.mean().item(), abs=1e-6)


def test_deep_ensemble_regression_mixture_and_moment_match():
    torch.manual_seed(1)
    x = torch.randn(25, 2)
    y = torch.randn(25)
    nets = [nn.Linear(2, 1) for _ in range(4)]
    lik = [likelihoods.Gaussian(sigma=s) for s in (0.3, 0.5, 0.7, 0.9)]
    de = DeepEnsemble(nets, lik)
    means = torch.stack([n(x)[:, 0] for n in nets]).detach().double()
    var = torch.tensor([0.09, 0.25, 0.49, 0.81], dtype=torch.float64)[:, None].expand(4, 25)
    pred = de.predict(x)  # the mixture of Gaussians; its moments
    mean, v = pred.mean, pred.variance
    assert mean.shape == (25, 1)
    assert torch.allclose(mean[:, 0], means.mean(0), atol=1e-6)
    assert torch.allclose(v[:, 0], (var + means**2).mean(0) - means.mean(0) ** 2, atol=1e-6)
    # log_prob is the mixture density, the same number metrics computes independently
    nll = metrics.mixture_gaussian_nll(means, var.contiguous(), y.double())
    assert -de.log_prob(x, y).mean().item() == pytest.approx(nll, abs=1e-6)
    with pytest.raises(ValueError, match="likelihood"):
        DeepEnsemble(nets, lik[:2])
    with pytest.raises(TypeError, match="nets"):
        DeepEnsemble(nets[0], lik[0])
    with pytest.raises(ValueError, match="x"):
        de.predict(torch.full((3, 2), math.nan))


def test_mixture_predictives_are_distributions_with_the_old_numbers():
    """Regression with two outputs: the mixture of Gaussians (MixtureSameFamily over the
    outputs jointly) has the moment-matched mean/variance the tuple form returned, and its
    log_prob is log Σ_m π_m Π_o N(y_o | μ_mo, σ²_mo), as `log_prob` computed it."""
    from pyro_subspace.likelihoods import Gaussian

    torch.manual_seed(0)
    means = torch.randn(3, 5, 2, dtype=torch.float64)
    variances = torch.rand(3, 5, 2, dtype=torch.float64) + 0.1
    weights = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    mix = Gaussian(sigma=1.0).mixture(weights, (means, variances))
    assert isinstance(mix, torch.distributions.Distribution)
    w = weights[:, None, None]
    mean = (w * means).sum(0)
    torch.testing.assert_close(mix.mean, mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        mix.variance, (w * variances).sum(0) + (w * (means - mean).square()).sum(0),
        rtol=1e-12, atol=0,
    )  # fmt: skip
    y = torch.randn(5, 2, dtype=torch.float64)
    joint = torch.distributions.Normal(means, variances.sqrt()).log_prob(y).sum(-1)
    expected = torch.logsumexp(weights.log()[:, None] + joint, 0)
    torch.testing.assert_close(mix.log_prob(y), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        Gaussian(sigma=1.0).mixture_log_prob(weights, (means, variances), y), expected,
        rtol=1e-12, atol=0,
    )  # fmt: skip
