"""The full-covariance Laplace posterior from fewer GGN rows than weights (issue 13):
``Σ = D (I − BᵀB) D`` by Woodbury's identity from the root ``A`` (``AᵀA = PᵀGP``), the factor
``L`` formed on first use. Against dense float64 linear algebra on the stored curvature."""

import math

import pytest
import torch
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces
from pyro_subspace.curvature import gram
from pyro_subspace.data import DataSource
from pyro_subspace.flat import FlatNet
from pyro_subspace.infer import AutoSubspaceLaplace, linearized_moments
from pyro_subspace.nn.evaluator import Evaluator

pytestmark = pytest.mark.usefixtures("one_thread")

K = 60


def make_guide(lik, n, lam, temperature=1.0, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    out = 1 if isinstance(lik, likelihoods.Gaussian) else 3
    net = nn.Sequential(
        nn.Linear(3, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, out)
    )
    net = net.to(dtype)
    x = torch.randn(n, 3).to(dtype)
    y = torch.randn(n).to(dtype) if out == 1 else torch.randint(0, 3, (n,))
    d = sum(p.numel() for p in net.parameters())
    idx = torch.randperm(d, generator=torch.Generator().manual_seed(seed))[:K]
    sub = subspaces.subnetwork(net, strategy="indices", indices=idx)
    model = SubspaceNet(net, sub, lik, temperature=temperature)
    return AutoSubspaceLaplace(model, prior_precision=lam), x, y


def dense_covariance(la, lam):
    lam = torch.as_tensor(lam, dtype=torch.float64)
    prior = torch.diag(lam) if lam.dim() == 1 else lam * torch.eye(K, dtype=torch.float64)
    return torch.linalg.inv(la.ggn.double() / la.temperature + prior)


def rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


CASES = [  # (likelihood, N): rows N·O (Gaussian) or N·(O−1) (3 classes), all below 2K/3 = 40
    (likelihoods.Gaussian(0.3), 25),
    (likelihoods.Categorical(), 15),
]


@pytest.mark.parametrize("lik,n", CASES)
@pytest.mark.parametrize("diagonal_prior", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_woodbury_posterior_equals_the_dense_inverse(lik, n, diagonal_prior, temperature):
    lam = torch.linspace(0.5, 3.0, K, dtype=torch.float64) if diagonal_prior else 2.0
    la, x, y = make_guide(lik, n, lam, temperature)
    la.fit(x, y, find_map=False)
    pending = {"ggn", "precision_matrix", "covariance_matrix", "scale_tril"}
    assert la.posterior.pending == pending  # Woodbury's route: only B (r, K) is formed
    eager = Evaluator(la.model, DataSource(x, y, 64)).ggn(la.loc)  # Σ AᵀA without the rows
    prior = torch.diag(torch.as_tensor(lam).expand(K))
    want = torch.linalg.inv(eager.double() / la.temperature + prior)
    # the marginal variances and the linearised predictive read B, not a formed Σ
    assert rel(la.posterior.marginal_variance(), want.diagonal()) < 1e-11
    _, f_cov = linearized_moments(la, x[:6])
    assert la.posterior.pending == pending
    w = la.model.subspace.weights(la.loc).detach()
    blocks = la.model.subspace.jacobian_blocks(FlatNet(la.model.flat.net), x[:6], w, 64)
    jac = torch.cat([j for _, j in blocks])  # shape: (6, O, K)
    want_f = torch.einsum("nok,kl,npl->nop", jac.double(), want, jac.double())
    assert rel(f_cov, want_f) < 1e-10
    assert torch.equal(f_cov, f_cov.mT)
    # Σ on first read
    assert rel(la.covariance, want) < 1e-11
    assert torch.equal(la.covariance, la.covariance.T)
    assert "covariance_matrix" not in la.posterior.pending
    assert rel(la.ggn, eager) < 1e-14  # formed on first use from the kept rows
    assert rel(la.precision, la.ggn / la.temperature + prior) < 1e-14
    # the linearised predictive uses Σ itself while the factor is not formed
    _, f_cov = linearized_moments(la, x[:6])
    assert "scale_tril" in la.posterior.pending  # the moments formed no factor
    assert rel(f_cov, want_f) < 1e-10
    # the factor on first use: the Cholesky factor of Σ
    assert rel(la.scale_tril, torch.linalg.cholesky(want)) < 1e-10
    assert "scale_tril" not in la.posterior.pending


def test_a_cast_posterior_keeps_its_woodbury_form(device):
    """``B`` of the pending Woodbury form moves and casts with the buffers (``.to``)."""
    la, x, y = make_guide(likelihoods.Gaussian(0.3), 25, 2.0)
    la.fit(x, y, find_map=False)
    want = dense_covariance(la, 2.0).to(device)
    post = la.posterior
    assert "covariance_matrix" in post.pending
    post.to(device=device, dtype=torch.float32)
    assert post.__dict__["_woodbury"].a.dtype == torch.float32
    assert post.covariance().dtype == torch.float32 and post.covariance().device == want.device
    assert rel(post.covariance().cpu(), want.cpu()) < 1e-5


def test_more_rows_than_the_limit_take_the_dense_route():
    la, x, y = make_guide(likelihoods.Gaussian(0.3), 50, 2.0)  # 50 rows > 2K/3 = 40
    la.fit(x, y, find_map=False)
    assert "scale_tril" not in la.posterior.pending
    assert rel(la.covariance, dense_covariance(la, 2.0)) < 1e-11
    rows = gram.RootRows(5)
    blocks = [(None, torch.ones(2, 1, 3)), (None, torch.ones(2, 1, 3)), (None, torch.ones(2, 1, 3))]
    assert len(list(rows.tap(iter(blocks)))) == 3 and rows.matrix() is None  # 6 > 5 rows
    rows = gram.RootRows(6)
    list(rows.tap(iter(blocks)))
    assert torch.equal(rows.matrix(), torch.ones(6, 3))  # exactly at the limit: kept


def test_retuned_prior_reuses_the_rows_and_a_changed_curvature_does_not():
    la, x, y = make_guide(likelihoods.Gaussian(0.3), 25, 2.0)
    la.fit(x, y, find_map=False)
    la.set_prior_precision(0.7)
    assert "scale_tril" in la.posterior.pending
    assert rel(la.covariance, dense_covariance(la, 0.7)) < 1e-11
    with torch.no_grad():
        la.ggn.mul_(3.0)  # e.g. a re-tuned noise scale: the rows no longer match the curvature
    la.set_prior_precision(0.7)
    assert "scale_tril" not in la.posterior.pending
    assert rel(la.covariance, dense_covariance(la, 0.7)) < 1e-11


def test_state_dict_holds_the_factor_formed_on_first_use(tmp_path):
    la, x, y = make_guide(likelihoods.Categorical(), 15, 2.0)
    la.fit(x, y, find_map=False)
    assert "scale_tril" in la.posterior.pending
    torch.save(la.state_dict(), tmp_path / "guide.pt")
    fresh, _, _ = make_guide(likelihoods.Categorical(), 15, 2.0)
    fresh.load_state_dict(torch.load(tmp_path / "guide.pt", weights_only=True))
    assert "scale_tril" not in fresh.posterior.pending
    assert torch.equal(fresh.scale_tril, la.scale_tril)
    assert rel(fresh.scale_tril, torch.linalg.cholesky(dense_covariance(la, 2.0))) < 1e-10
    assert torch.equal(fresh.sample_weights(4, seed=1), la.sample_weights(4, seed=1))


def test_float32_woodbury_against_float64():
    """Float32 buffers: the Woodbury covariance is as close to the float64 one as float32
    rounding times the (modest) condition number allows."""
    la32, x, y = make_guide(likelihoods.Gaussian(0.3), 25, 2.0, dtype=torch.float32)
    la32.fit(x, y, find_map=False)
    la64, x64, y64 = make_guide(likelihoods.Gaussian(0.3), 25, 2.0)
    la64.fit(x64, y64, find_map=False)
    # the moments from B (Σ not formed): (JD)(JD)ᵀ − (JDBᵀ)(JDBᵀ)ᵀ loses what I − BᵀB does
    _, f32 = linearized_moments(la32, x[:8])
    _, f64 = linearized_moments(la64, x64[:8])
    assert "covariance_matrix" in la32.posterior.pending
    assert la32.posterior.__dict__["_woodbury"].a.dtype == torch.float32  # factors in float32
    assert float(((f32.double() - f64) / f64).abs().max()) < 1e-5
    assert "scale_tril" in la32.posterior.pending and la32.covariance.dtype == torch.float32
    assert rel(la32.covariance, la64.covariance) < 1e-5
    assert rel(la32.scale_tril, la64.scale_tril) < 1e-5


def test_evidence_from_the_rows_equals_the_dense_one():
    """The evidence's ``log|cG/T + λI|`` from the eigenvalues of the ``(r, r)`` ``A Aᵀ`` of the
    kept rows (no ``(K, K)`` GGN formed) equals the one from the formed GGN's eigenvalues and a
    dense ``slogdet``, also at another ``λ`` and ``σ``."""
    la, x, y = make_guide(likelihoods.Gaussian(0.3), 25, 2.0)
    la.fit(x, y, find_map=False)
    got = [la.log_marginal_likelihood(), la.log_marginal_likelihood(0.5, sigma=0.4)]
    assert "ggn" in la.posterior.pending  # the evidence formed no K x K GGN
    with torch.no_grad():
        la.ggn.mul_(1.0)  # the rows no longer count: the formed GGN's eigenvalues
    want = [la.log_marginal_likelihood(), la.log_marginal_likelihood(0.5, sigma=0.4)]
    for g, w in zip(got, want, strict=True):
        assert abs(float(g - w)) < 1e-9 * abs(float(w))
    g64 = la.ggn.double()
    logdet = torch.linalg.slogdet(g64 / la.temperature + 2.0 * torch.eye(K, dtype=torch.float64))
    d = la.loc - la.prior_loc
    dense = la.map_log_likelihood / la.temperature - 2.0 * d.square().sum() / 2
    dense = dense + (K * math.log(2.0) - logdet.logabsdet) / 2
    assert abs(float(got[0] - dense)) < 1e-9 * abs(float(dense))
