"""The Laplace guide as a Pyro autoguide: one prior, the diagonal front door, streamed data.

The guide's contract (conjugate posterior and exact evidence on a linear-Gaussian model, every
ELBO particle, ``Predictive``/``AutoGuideList``/``forward``/`sample_weights` drawing one ``Σ``,
persistence) runs for every subspace kind and structure in ``test_contract_guides.py``
(`contracts.guide.BaseGuideTestCase`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces
from pyro_subspace.infer import AutoSubspaceLaplace, DiagonalLaplace, Laplace

pytestmark = pytest.mark.usefixtures("one_thread")


def linear_problem(n: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    net = nn.Linear(3, 1, bias=False).double()
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(
        n, generator=gen, dtype=torch.float64
    )
    return net, x, y


def fitted_linear_guide(prior_mean: str = "shift"):
    net, x, y = linear_problem()
    sub = subspaces.Subspace(torch.zeros(3, dtype=torch.float64), torch.arange(3))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.3), prior_mean=prior_mean)
    guide = AutoSubspaceLaplace(model, prior_precision=2.0).fit(x, y)
    return model, guide, x, y


def test_model_and_guide_share_one_prior():
    model, guide, x, y = fitted_linear_guide(prior_mean="zero")
    guide.set_prior_precision(5.0)
    assert torch.allclose(model.prior_precision, torch.full((3,), 5.0, dtype=torch.float64))
    # the model's prior is the guide's: log N(t | t₀, Λ₀⁻¹) at the posterior mean
    t = guide.loc
    lam = guide.prior_precision_matrix()
    d = t - guide.prior_loc
    expected = (
        -0.5 * d @ lam @ d
        + 0.5 * torch.logdet(lam)
        - 1.5 * torch.log(torch.tensor(2 * torch.pi, dtype=torch.float64))
    )
    assert float(model.prior().log_prob(t)) == pytest.approx(float(expected), rel=1e-10)


def test_diagonal_laplace_is_the_diag_structure_on_all_weights():
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(30, 2, dtype=torch.float64)
    diag = DiagonalLaplace(net, likelihoods.Categorical(), prior_precision=3.0).fit(x)
    front = Laplace(net, likelihoods.Categorical(), "all", "diag", prior_precision=3.0).fit(
        x, find_map=False
    )
    assert torch.equal(diag.variance, front.covariance.diagonal())
    assert diag.variance.shape == (sum(p.numel() for p in net.parameters()),)


def test_laplace_subnetwork_by_diag_laplace_scores_with_its_own_likelihood_and_prior():
    # Subnetwork Inference eq. 23: the K weights of largest 1 / (diag(G) + λ), with G from a
    # brute-force Jacobian of the logits and H = diag(p) - p pᵀ
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(30, 2, dtype=torch.float64)
    la = Laplace(
        net, likelihoods.Categorical(), "subnetwork", "full", prior_precision=3.0, n_params=7,
        strategy="diag_laplace", x=x,
    )  # fmt: skip
    w = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    out = lambda v: torch.func.functional_call(
        net, dict(zip(dict(net.named_parameters()), _split(net, v))), (x,)
    )
    jac = torch.autograd.functional.jacobian(out, w)  # (N, C, D)
    p = torch.softmax(out(w), -1)
    h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    diag_g = torch.einsum("ncd,nce,ned->d", jac, h, jac)
    expected = (1.0 / (diag_g + 3.0)).topk(7).indices.sort().values
    assert torch.equal(la.model.subspace.basis.cpu(), expected)
    with pytest.raises(ValueError, match="x_train"):
        Laplace(net, likelihoods.Categorical(), "subnetwork", n_params=7, strategy="diag_laplace", hessian_structure="full")
    with pytest.raises(ValueError, match="n_params=K"):
        Laplace(net, likelihoods.Categorical(), "subnetwork", hessian_structure="full")


def _split(net: nn.Module, v: torch.Tensor) -> list[torch.Tensor]:
    sizes = [q.numel() for q in net.parameters()]
    return [c.reshape(q.shape) for c, q in zip(v.split(sizes), net.parameters())]


# ---------------------------------------------------------------------- persistence


def _classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(50, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (50,))
    return net, x, y


def test_a_dataloader_gives_the_fit_of_the_tensors():
    """The evaluator streams a DataLoader chunk by chunk; the MAP, curvature and evidence equal
    those of the in-memory tensors (same sums, other chunking: float64 rounding only)."""
    from torch.utils.data import DataLoader, TensorDataset

    net, x, y = _classifier()
    la = lambda: Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=2.0, hessian_structure="full")
    a = la().fit(x, y, find_map=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    b = la().fit(loader, find_map=True)
    c = la().fit(TensorDataset(x, y), find_map=True)
    for other in (b, c):
        assert torch.allclose(other.loc, a.loc, rtol=1e-9, atol=1e-12)
        assert torch.allclose(other.ggn, a.ggn, rtol=1e-10)
        assert float(other.log_marginal_likelihood()) == pytest.approx(
            float(a.log_marginal_likelihood()), rel=1e-10
        )
    with pytest.raises(ValueError, match="y: give either"):
        Laplace(net, likelihoods.Categorical(), "last_layer", hessian_structure="full").fit(loader, y)
    with pytest.raises(TypeError, match="x: expected"):
        Laplace(net, likelihoods.Categorical(), "last_layer", hessian_structure="full").fit([1, 2], y)


def test_isotropic_full_evidence_from_eigenvalues_equals_the_dense_log_determinant():
    """The O(K) spectral evidence (isotropic prior, full structure) against ``torch.logdet`` of
    the dense posterior precision, at several λ and noise scales σ (G ∝ 1/σ²)."""
    import math

    from torch import nn

    from pyro_subspace import SubspaceNet, likelihoods, subspaces
    from pyro_subspace.infer import AutoSubspaceLaplace

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x, y = torch.randn(40, 2, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    d = sum(p.numel() for p in net.parameters())
    sub = subspaces.subnetwork(net, d, strategy="indices", indices=torch.arange(d))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(sigma=0.5), prior_mean="zero")
    model.set_prior_precision(2.0)
    guide = AutoSubspaceLaplace(model).fit(x, y, find_map=False)
    dist = guide.loc - guide.prior_loc
    for lam, sigma in [(2.0, None), (0.3, None), (5.0, 0.7)]:
        c = 1.0 if sigma is None else (0.5 / sigma) ** 2
        loglik = guide.map_log_likelihood if sigma is None else guide._gaussian_loglik(
            torch.tensor(sigma, dtype=torch.float64))  # fmt: skip
        post = c * guide.ggn / guide.temperature + lam * torch.eye(d, dtype=torch.float64)
        dense = (loglik / guide.temperature - lam * dist @ dist / 2
                 + (d * math.log(lam) - torch.logdet(post)) / 2)  # fmt: skip
        fast = guide.log_marginal_likelihood(lam, sigma)
        assert torch.allclose(fast, dense, rtol=1e-12, atol=0)


def _packed(diag, basis, weights):
    """The former low-rank buffer layout ``[[w, 0], [M, δ]]`` ``(K+1, k+1)``."""
    top = torch.cat([weights, weights.new_zeros(1)])[None]
    return torch.cat([top, torch.cat([basis, diag[:, None]], 1)], 0)


def _legacy_state(guide) -> dict:
    """The guide's state as saved before guides held a `Posterior`: the curvature and ``Σ`` in
    the guide's own buffers ``ggn``, ``precision``, ``covariance``, ``scale_tril`` (dense for
    full, ``(K,)`` for diag, packed for lowrank), no ``posterior.*`` keys."""
    state = {k: v.clone() for k, v in guide.state_dict().items() if not k.startswith("posterior.")}
    post = guide.posterior
    if guide.hessian_structure == "full":
        old = {"ggn": post.ggn, "precision": post.precision_matrix,
               "covariance": post.covariance_matrix, "scale_tril": post.scale_tril}  # fmt: skip
    elif guide.hessian_structure == "diag":
        old = {"ggn": post.ggn_diagonal, "precision": post.precision_diagonal,
               "covariance": post.variance, "scale_tril": post.variance.sqrt()}  # fmt: skip
    else:
        u, l, t = post.eigenvectors, post.eigenvalues, float(post.temperature)
        d, q, c = post.scale, post.factor_basis, post.factor_weights
        old = {
            "ggn": _packed(torch.zeros_like(d), u, l),
            "precision": _packed(post.prior_diagonal, u, l / t),
            "covariance": _packed(d.square(), d[:, None] * q, c * (2 + c)),
            "scale_tril": _packed(d, q, c),
        }
    state.update({k: v.clone() for k, v in old.items()})
    return state


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
def test_a_guide_state_saved_before_guides_held_a_posterior_loads(structure):
    """The former buffer names (and the low-rank structure's packed layout) map onto the
    posterior's: the loaded guide predicts, draws and scores the evidence as the saved one."""
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (40,), generator=gen)
    kw = {"rank": 4} if structure == "lowrank" else {}
    la = Laplace(net, likelihoods.Categorical(), "all", structure, 0.8, **kw).fit(x, y)
    state = _legacy_state(la.guide)
    fresh = Laplace(net, likelihoods.Categorical(), "all", structure, 0.8, **kw)
    fresh.model.load_state_dict(la.model.state_dict())
    fresh.guide.load_state_dict(state)
    torch.testing.assert_close(fresh.guide.covariance, la.guide.covariance, rtol=0, atol=0)
    torch.testing.assert_close(fresh.predict(x).probs, la.predict(x).probs, rtol=0, atol=0)
    assert float(fresh.log_marginal_likelihood()) == float(la.log_marginal_likelihood())
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    assert torch.equal(fresh.guide.draw_latent(3, g()), la.guide.draw_latent(3, g()))
