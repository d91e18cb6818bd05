"""The K-FAC Laplace (``hessian_structure="kron"``) against dense linear algebra.

On nets small enough to form the K-FAC curvature ``C̃`` (`curvature.kfac`'s blocks) densely, the
Kronecker posterior equals the dense posterior built from it: ``Σ = (C̃/T + λ)⁻¹``, the evidence,
the linearised predictive ``J Σ Jᵀ`` (all layers through Jacobian blocks; a last layer from its
features in closed form) and draws within Monte Carlo error; a single linear layer with a
Gaussian likelihood, where K-FAC is exact, gives the full structure's posterior; Ritter et al.'s
damped form is its Kronecker product of damped factors. The comparison with laplace-torch's
``KronLaplace``/``KronLLLaplace`` is in ``test_laplace_kron_vs_laplace_torch.py``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from contracts import assert_close_mc, mc_covariance_se
from torch import nn

from pyro_subspace import FlatNet, likelihoods
from pyro_subspace.curvature import kfac, subspace_jacobians
from pyro_subspace.infer import Laplace
from pyro_subspace.infer.laplace.posteriors import Posterior
from pyro_subspace.infer.laplace.posteriors import kron as kron_module

pytestmark = pytest.mark.usefixtures("one_thread")

LAM = 0.7


def classifier(batchnorm: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    layers = [nn.Linear(3, 6)] + ([nn.BatchNorm1d(6)] if batchnorm else []) + [nn.Tanh(), nn.Linear(6, 3)]
    net = nn.Sequential(*layers).double()
    if batchnorm:
        net.train()
        net(torch.randn(64, 3, dtype=torch.float64))  # running statistics that are not 0/1
        net.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=gen)
    return net, x, y


def dense_kfac(la, x) -> torch.Tensor:
    """``C̃`` ``(K, K)`` in the subspace's coordinates, from `curvature.kfac` directly."""
    net, sub = la.model.flat.net, la.model.subspace
    modules = None if sub.rank == sum(p.numel() for p in net.parameters()) else [net[-1]]
    f = kfac(net, la.likelihood, x, modules=modules, dtype=torch.float64)
    pos = torch.searchsorted(sub.basis, f.index)  # basis sorted: flat order
    out = torch.zeros(sub.rank, sub.rank, dtype=torch.float64)
    out[pos[:, None], pos[None, :]] = f.to_dense()
    return out


def assert_layer_route_is_the_jacobian_route(la, x, chunk: int) -> None:
    """`KronPosterior.linearized_outputs` layer by layer (it must apply) against the contract's
    route through the subspace's Jacobian blocks: means, covariances and variances."""
    post, model = la.guide.posterior, la.model
    w = model.subspace.weights(la.guide.loc)
    assert post._linear_layers(model.flat.net) is not None  # the layer-by-layer route applies
    f, cov = post.linearized_outputs(model, x, w, chunk)
    f_ref, cov_ref = Posterior.linearized_outputs(post, model, x, w, chunk)
    torch.testing.assert_close(f, f_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cov, cov_ref, rtol=1e-10, atol=1e-13)
    _, var = post.linearized_outputs(model, x, w, chunk, diagonal=True)
    torch.testing.assert_close(var, cov_ref.diagonal(dim1=-2, dim2=-1))


@pytest.mark.parametrize("subset,batchnorm", [("last_layer", False), ("all", False), ("all", True)])
def test_kron_posterior_is_the_dense_posterior_of_the_kfac_curvature(subset, batchnorm, device):
    net, x, y = classifier(batchnorm)
    la = Laplace(net.to(device), likelihoods.Categorical(), subset, "kron", LAM, temperature=2.0)
    la.fit(x.to(device), y.to(device))
    assert la.guide.posterior.prior_diagonal.device == device
    la, net = la.cpu(), net.cpu()  # the dense checks below on the CPU
    c = dense_kfac(la, x)
    k = c.shape[0]
    precision = c / 2.0 + LAM * torch.eye(k, dtype=torch.float64)
    sigma = torch.linalg.inv(precision)
    post = la.guide.posterior
    torch.testing.assert_close(post.covariance(), sigma, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(post.marginal_variance(), sigma.diagonal(), rtol=1e-9, atol=0)
    # the evidence: ℓ/T − ½λ|w_S|² + ½ log|λI| − ½ log|C̃/T + λI| (the weight prior N(0, 1/λ))
    w_s = la.model.subspace.shift[la.model.subspace.basis].double()
    logdets = (k * math.log(LAM) - torch.logdet(precision)) / 2
    want = float(la.guide.map_log_likelihood) / 2.0 - LAM * float(w_s @ w_s) / 2 + logdets
    assert float(la.log_marginal_likelihood()) == pytest.approx(float(want), rel=1e-10)
    # the GLM predictive: J Σ Jᵀ with the dense Σ
    xt = x[:7]
    _, jp = next(iter(subspace_jacobians(net, xt, la.model.subspace, 64)))
    f_mean, f_cov = la.guide.posterior.functional_covariance(jp.double()), None
    expected = jp.double() @ sigma @ jp.double().mT
    torch.testing.assert_close(f_mean, expected, rtol=1e-9, atol=1e-12)
    from pyro_subspace.infer import linearized_moments

    _, f_cov = linearized_moments(la.guide, xt)
    torch.testing.assert_close(f_cov, expected, rtol=1e-9, atol=1e-12)
    # draws: covariance Σ within Monte Carlo error, from a generator, the global one untouched
    state = torch.get_rng_state()
    draws = la.guide.draw_latent(20000, torch.Generator().manual_seed(3)) - la.guide.loc
    assert torch.equal(torch.get_rng_state(), state)
    assert_close_mc(draws.T.cov(), sigma, mc_covariance_se(sigma, 20000), "covariance")


def test_last_layer_closed_form_equals_the_jacobian_route():
    """The last layer's ``J Σ Jᵀ`` from its features (no ``CP × CP`` matrix) equals the
    contract's default route through the explicit Jacobian."""
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", "kron", LAM).fit(x, y)
    sub, post = la.model.subspace, la.guide.posterior
    flat = FlatNet(net, batch_strategy="loop")
    _, phi = next(iter(sub.feature_blocks(flat, x[:9], sub.weights(la.guide.loc), 64)))
    closed = post.feature_covariance(phi.double(), sub.rows)
    generic = Posterior.feature_covariance(post, phi.double(), sub.rows)
    torch.testing.assert_close(closed, generic, rtol=1e-10, atol=1e-13)


def test_a_linear_gaussian_model_gives_the_full_posterior():
    """One ``nn.Linear`` with a Gaussian likelihood: ``G = I/σ²`` per point, so K-FAC with the bias
    in ``A`` is the exact GGN, and the Kronecker posterior is the full one."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()
    x = torch.randn(30, 3, dtype=torch.float64)
    y = torch.randn(30, 2, dtype=torch.float64)
    lik = lambda: likelihoods.Gaussian(torch.tensor(0.4, dtype=torch.float64))  # noqa: E731
    kron = Laplace(net, lik(), "all", "kron", LAM, structure_options={"bias": "augment"}).fit(x, y)
    full = Laplace(net, lik(), "all", "full", LAM).fit(x, y)
    torch.testing.assert_close(kron.guide.covariance, full.guide.covariance, rtol=1e-10, atol=1e-13)
    assert float(kron.log_marginal_likelihood()) == pytest.approx(
        float(full.log_marginal_likelihood()), rel=1e-11
    )


def test_ritter_damping_is_the_product_of_damped_factors():
    """``damping="ritter"``: each block's precision is ``(G/(T√N) + √λ I) ⊗ (√N A + √λ I)``
    (Ritter et al. 2018, eq. 11 with ``A`` a mean and ``G`` a sum over the ``N`` points)."""
    net, x, y = classifier()
    la = Laplace(
        net, likelihoods.Categorical(), "last_layer", "kron", LAM, temperature=2.0,
        structure_options={"damping": "ritter"},
    ).fit(x, y)  # fmt: skip
    f = kfac(net, la.likelihood, x, modules=[net[-1]], dtype=torch.float64)
    n, root = 40, math.sqrt(LAM)
    blocks = []
    for block in f.blocks:
        g = block.G / (2.0 * math.sqrt(n)) + root * torch.eye(block.G.shape[0], dtype=torch.float64)
        a = block.A if block.A is not None else torch.ones(1, 1, dtype=torch.float64)
        a = math.sqrt(n) * a + root * torch.eye(a.shape[0], dtype=torch.float64)
        blocks.append(torch.kron(g, a))
    want = torch.block_diag(*blocks)
    torch.testing.assert_close(la.guide.posterior.precision(), want, rtol=1e-10, atol=1e-12)


def test_layerwise_prior_is_tuned_and_a_per_weight_prior_is_refused():
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "all", "kron", LAM).fit(x, y)
    before = float(la.log_marginal_likelihood())
    la.optimize_prior_precision(method="marglik", prior_structure="layerwise")
    lam = la.guide.model.prior_precision
    assert len(torch.unique(lam)) == 4  # one per parameter tensor
    assert float(la.log_marginal_likelihood()) > before
    with pytest.raises(ValueError, match="one λ over each parameter tensor"):
        la.optimize_prior_precision(method="marglik", prior_structure="diag")


def test_a_subspace_of_parts_of_tensors_is_refused_naming_the_structure():
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), torch.tensor([0, 1, 2, 30]), "kron", LAM)
    with pytest.raises(ValueError, match="hessian_structure: 'kron' needs a subspace made of whole"):
        la.fit(x, y)
    assert not la.guide.fitted


def test_state_dict_round_trip_of_a_kron_laplace():
    net, x, y = classifier(batchnorm=True)
    la = Laplace(net, likelihoods.Categorical(), "all", "kron", LAM).fit(x, y)
    fresh = Laplace(net, likelihoods.Categorical(), "all", "kron", LAM)
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)  # the blocks' owners (extra state) are plain lists of strings
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(fresh.predict(x).probs, la.predict(x).probs, rtol=0, atol=0)
    assert float(fresh.log_marginal_likelihood()) == float(la.log_marginal_likelihood())


def test_laplace_torch_damping_flag_is_refused_saying_what_it_does_there():
    net, x, y = classifier()
    with pytest.raises(ValueError, match="damping: laplace-torch 0.3"):
        Laplace(net, likelihoods.Categorical(), "last_layer", "kron", LAM, damping=True)
    with pytest.raises(TypeError, match="structure_options: 'damping' is not an option"):
        Laplace(net, likelihoods.Categorical(), "last_layer", "full", structure_options={"damping": "ritter"})


def test_mola_with_kfac_members_is_the_mixture_of_their_kfac_laplaces():
    """MoLA's Algorithm 1 (App. B.2: K-FAC in all experiments): each member's posterior is the
    K-FAC last-layer Laplace of its network, and the mixture probit averages theirs."""
    from pyro_subspace.infer import LastLayerLaplace, MixtureOfLaplace

    nets = [classifier(seed=s)[0] for s in (0, 1)]
    _, x, y = classifier()
    mola = MixtureOfLaplace(nets, likelihoods.Categorical(), prior_precision=LAM, hessian_structure="kron")
    mola.fit(x, y)
    singles = [
        Laplace(n, likelihoods.Categorical(), "last_layer", "kron", LAM).fit(x, y) for n in nets
    ]
    assert all(g.posterior.name == "kron" for _, g in mola.members)
    want = torch.stack([la(x[:8], link_approx="probit") for la in singles]).mean(0)
    torch.testing.assert_close(mola.predict(x[:8]).probs, want, rtol=1e-10, atol=1e-12)
    llla = LastLayerLaplace(nets[0], likelihoods.Categorical(), prior_precision=LAM,
                            hessian_structure="kron").fit(x, y)  # fmt: skip
    torch.testing.assert_close(llla.predict(x[:8]).probs, singles[0](x[:8]), rtol=1e-10, atol=1e-12)
    mola.optimize_prior_precision("confidence", x[:20], y[:20])  # the paper's tuning rule
    assert mola.prior_precision in set(torch.logspace(-4, 4, 33, dtype=torch.float64).tolist())


def test_auto_picks_full_under_the_budget_and_kron_above_saying_why():
    from pyro_subspace.infer import LastLayerLaplace
    from pyro_subspace.infer.laplace.posteriors import AUTO_BUDGET_BYTES

    net, x, y = classifier()
    small = LastLayerLaplace(net, likelihoods.Categorical(), prior_precision=LAM).fit(x, y)
    guide = small.members[0][1]
    assert guide.hessian_structure == "full" and "<= 128 MiB" in guide.structure_choice
    k = int((AUTO_BUDGET_BYTES / 16) ** 0.5) + 1  # the first K above the budget: 2 float64 K x K
    assert k == 2897  # the rule of K alone, unchanged since four buffers took 256 MiB
    wide = nn.Sequential(nn.Linear(3, k - 1), nn.Tanh(), nn.Linear(k - 1, 1)).double()
    big = LastLayerLaplace(wide, likelihoods.Bernoulli(), prior_precision=LAM)
    big.fit(x, (y > 0).double())  # one output: K = (k - 1) + 1 weights
    guide = big.members[0][1]
    assert guide.model.rank == k and guide.hessian_structure == "kron"
    assert "> 128 MiB" in guide.structure_choice


@pytest.mark.parametrize("bias", ["separate", "augment"])
def test_layer_by_layer_predictive_equals_the_jacobian_route(bias, device):
    """All layers of an MLP: ``J Σ Jᵀ`` from each layer's inputs and output Jacobians (no
    ``(N, O, K)`` Jacobian) equals the contract's route through the subspace's Jacobian blocks;
    an in-place ReLU after a layer does not disturb it."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 4), nn.Tanh(),
                        nn.Linear(4, 3)).double()  # fmt: skip
    x = torch.randn(30, 3, dtype=torch.float64).to(device)
    y = torch.randint(0, 3, (30,)).to(device)
    la = Laplace(net.to(device), likelihoods.Categorical(), "all", "kron", LAM,
                 structure_options={"bias": bias}).fit(x, y)  # fmt: skip
    assert_layer_route_is_the_jacobian_route(la, x[:11], 4)
    model = la.model
    assert torch.equal(FlatNet(net).vector(), model.subspace.shift)  # the weights put back


@pytest.mark.parametrize("conv", ["expand", "backpack"])
@pytest.mark.parametrize("small_passes", [False, True])
def test_layer_by_layer_predictive_of_a_cnn_equals_the_jacobian_route(conv, small_passes, monkeypatch):
    """A CNN (strided, padded Conv2d layers, in-place ReLU, a Linear head): the Conv2d blocks'
    ``J Σ Jᵀ`` from patches and output Jacobians equals the route through Jacobian blocks;
    also when the memory bounds make each pass and each Conv2d block one row."""
    if small_passes:
        monkeypatch.setattr(kron_module, "PASS_NUMBERS", 1000)  # 3 x 213 numbers a row
        monkeypatch.setattr(kron_module, "CONV_BLOCK_NUMBERS", 1)
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(3, 2, 3, stride=2),
        nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3),
    ).double()  # fmt: skip
    x = torch.randn(20, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (20,))
    la = Laplace(net, likelihoods.Categorical(), "all", "kron", LAM,
                 structure_options={"conv": conv}).fit(x, y)  # fmt: skip
    assert_layer_route_is_the_jacobian_route(la, x[:7], 3)


def test_layer_by_layer_predictive_with_batchnorm_diagonal_blocks():
    """BatchNorm's parameters (exact-diagonal blocks) enter through per-sample Jacobians of the
    module itself: the result equals the route through the subspace's Jacobian blocks."""
    net, x, y = classifier(batchnorm=True)
    la = Laplace(net, likelihoods.Categorical(), "all", "kron", LAM).fit(x, y)
    assert_layer_route_is_the_jacobian_route(la, x[:9], 4)


def test_a_full_structure_too_large_to_hold_is_refused_naming_kron():
    """A last layer with C = 1000 classes and P = 2048 features: the full structure's (K, K)
    buffers would take 4·K²·4 bytes ≈ 62 TiB; refused at construction, before any work."""
    net = nn.Sequential(nn.Linear(2048, 1000))
    with pytest.raises(ValueError, match="hessian_structure: 'full' over K = 2,049,000 .*'kron'"):
        Laplace(net, likelihoods.Categorical(), "last_layer", "full")
    la = Laplace(net, likelihoods.Categorical(), "last_layer", "kron")  # K-FAC is built
    assert la.n_params == 2_049_000


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_the_bridge_of_a_last_layer_reads_the_whole_logit_covariance(structure):
    """``link_approx="bridge"`` needs the off-diagonal logit covariances: the last layer's
    predictive gives it the whole ``(N, C, C)`` (only the probit gets the variances alone)."""
    from pyro_subspace.infer import linearized_moments, linearized_predictive
    from pyro_subspace.likelihoods.categorical import laplace_bridge

    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", structure, LAM).fit(x, y)
    f_mean, f_cov = linearized_moments(la.guide, x[:6])
    want = laplace_bridge(f_mean, f_cov)
    got = linearized_predictive(la.guide, x[:6], link_approx="bridge").probs
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert bool((f_cov - torch.diag_embed(f_cov.diagonal(dim1=-2, dim2=-1))).abs().max() > 0)
