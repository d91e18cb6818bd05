"""The full structure at large ``K`` (issue 37): two ``(K, K)`` matrices, the GGN and the
Cholesky factor, formed in place by LAPACK (``K ≥ 64``: the contract suite's ``K = 6`` takes
torch's route), checked in float32 and float64 against dense linear algebra.

Tolerances: float64 ``1e-10`` relative (``κ ≈ 1e2`` times a few ``K ε``); float32
``200 · K · ε₃₂ · κ``-free bound ``1e-3`` where ``κ(Σ⁻¹) ≈ 1e2`` and ``K = 96``
(Cholesky's backward error ``K ε ‖P‖`` times ``κ``: ``96 · 6e-8 · 1e2 ≈ 6e-4``).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from pyro_subspace.infer.laplace.posteriors import full
from pyro_subspace.infer.laplace.posteriors.base import PriorPrecision
from pyro_subspace.infer.laplace.posteriors.full import FullPosterior

K = 96
T = 2.0
TOL = {torch.float64: 1e-10, torch.float32: 1e-3}


class Evaluator:
    temperature = T

    def __init__(self, c: torch.Tensor) -> None:
        self.c = c

    def ggn(self, t, diagonal=False, dtype=torch.float64, rows=None, **kwargs):
        return self.c.to(dtype).clone()


def ggn(seed: int = 0, rank: int = 2 * K) -> torch.Tensor:
    """A GGN ``(K, K)`` from ``rank`` rows (``N·C ≥ K``: the formed, not the Woodbury, route)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rank, K, generator=gen, dtype=torch.float64) / rank**0.5
    return a.T @ a


def fitted(dtype, lam=0.7, seed=0, rank=2 * K):
    c = ggn(seed, rank)
    post = FullPosterior(K, dtype=dtype)
    post.fit_curvature(Evaluator(c), torch.zeros(K, dtype=torch.float64))
    prior = PriorPrecision(torch.as_tensor(lam, dtype=torch.float64), None, K)
    post.set_prior(prior)
    return post, prior, c.to(dtype).double()  # the reference: the GGN as the buffers hold it


def rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def held(post) -> set[str]:
    """The ``(K, K)`` buffers that hold memory."""
    return {name for name in full.BUFFERS if post._buffers[name].is_contiguous()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fit_evidence_predictive_and_draws_hold_the_ggn_and_the_factor(dtype, monkeypatch):
    monkeypatch.setattr(full, "FACTOR_LOG_DET_MIN_K", 64)  # the evidence from the factor
    post, prior, c = fitted(dtype, lam=[0.5 + i / K for i in range(K)])
    precision = c / T + torch.diag(prior.lam)
    cov = torch.linalg.inv(precision)
    assert held(post) == {"ggn", "scale_tril"}
    assert post.pending == {"precision_matrix", "covariance_matrix"}
    # L: the Cholesky factor of Σ, lower triangular, formed without Σ
    assert torch.equal(post.scale_tril, post.scale_tril.tril())
    assert rel(post.scale_tril, torch.linalg.cholesky(cov)) < TOL[dtype]
    # the evidence at the factor's λ from its diagonal; at another λ from a dense log-det
    assert abs(float(post.log_det(prior)) - float(torch.logdet(precision))) < TOL[dtype] * K
    assert rel(post.marginal_variance(), cov.diagonal()) < TOL[dtype]
    gen = torch.Generator().manual_seed(3)
    jac = torch.randn(5, 3, K, generator=gen, dtype=torch.float64)
    want = torch.einsum("nok,kl,npl->nop", jac, cov, jac)
    assert rel(post.functional_covariance(jac.to(dtype)), want) < TOL[dtype]
    v = torch.randn(4, K, generator=gen, dtype=torch.float64)
    assert rel(post.apply_covariance(v), v @ cov) < TOL[dtype]
    eps = torch.randn(7, K, generator=gen, dtype=torch.float64)
    assert rel(post.draw(eps), eps.to(dtype).double() @ post.scale_tril.double().T) < 1e-6
    assert held(post) == {"ggn", "scale_tril"}  # still two matrices
    # precision and covariance: formed when read, then kept
    assert rel(post.covariance_matrix, cov) < TOL[dtype]
    assert torch.equal(post.covariance_matrix, post.covariance_matrix.T)
    assert rel(post.precision_matrix, precision) < TOL[dtype]
    assert held(post) == set(full.BUFFERS)
    post.set_prior(prior)  # a new prior: the stale two given back
    assert held(post) == {"ggn", "scale_tril"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_eigenvalues_for_marglik_take_the_factors_memory_and_it_comes_back(dtype):
    post, prior, c = fitted(dtype)
    factor = post.scale_tril.clone()
    lam = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    logdet = post.log_det(PriorPrecision(lam, None, K))
    assert "scale_tril" in post.pending and held(post) == {"ggn"}  # given back
    want = torch.logdet(c / T + 3.0 * torch.eye(K, dtype=torch.float64))
    assert abs(float(logdet) - float(want)) < TOL[dtype] * K
    (grad,) = torch.autograd.grad(logdet, lam)  # d/dλ log|P| = tr(P⁻¹)
    want_grad = torch.linalg.inv(c / T + 3.0 * torch.eye(K, dtype=torch.float64)).trace()
    assert abs(float(grad) - float(want_grad)) < TOL[dtype] * float(want_grad)
    assert torch.equal(post.scale_tril, factor)  # formed again for the kept prior, the same


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("eigen", [True, False, "blocked"])
def test_the_grid_by_one_eigenbasis_or_one_factor_per_lambda(dtype, eigen, monkeypatch):
    if eigen == "blocked":  # the paper's size: factor and solves on torch's BLAS, not SciPy's
        from pyro_subspace import linalg

        monkeypatch.setattr(linalg, "BLOCKED_ROW_BYTES", 8)
        eigen = False
    post, prior, c = fitted(dtype)
    if not eigen:  # three (K, K) matrices do not fit: one Cholesky factor per λ
        size = torch.empty((), dtype=dtype).element_size()
        monkeypatch.setattr(full, "MAX_BYTES", int(2.5 * size * K * K))
        monkeypatch.setattr(full, "GRID_SOLVE_BYTES", 3 * 3 * K * size)  # 3 points a solve: 3, 3, 2
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randn(4, 3, K, generator=gen, dtype=torch.float64) for _ in range(2)]
    f_cov = post.functional_covariance_on_grid(blocks, lambda lam: PriorPrecision(lam, None, K))
    assert held(post) == {"ggn", "scale_tril"} if not eigen else held(post) <= {"ggn", "scale_tril"}
    jac = torch.cat(blocks)
    for lam in (0.05, 1.0, 40.0):
        cov = torch.linalg.inv(c / T + lam * torch.eye(K, dtype=torch.float64))
        want = torch.einsum("nok,kl,npl->nop", jac, cov, jac)
        cond = float(torch.linalg.cond(c / T + lam * torch.eye(K, dtype=torch.float64)))
        tol = TOL[dtype] if dtype == torch.float64 else 2 * K * 6e-8 * cond
        assert rel(f_cov(torch.tensor(lam, dtype=torch.float64)), want) < tol, lam
    # the factor comes back for the prior set before the sweep
    assert rel(post.scale_tril, torch.linalg.cholesky(torch.linalg.inv(c / T + 0.7 * torch.eye(K, dtype=torch.float64)))) < TOL[dtype]


def test_the_size_rule_counts_two_matrices_and_names_the_sizes():
    FullPosterior(42438, dtype=torch.float32)  # the paper's K: 2 x 7.2 GB, no memory until fit
    with pytest.raises(ValueError, match=r"46,341.*two.*16\.0 GiB.*kron"):
        FullPosterior(46341, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"32,769.*float64.*dtype=torch.float32"):
        FullPosterior(32769, dtype=torch.float64)


def test_an_ill_conditioned_float32_precision_is_repaired_in_float64_or_warned(monkeypatch):
    """A GGN of rank ``K/2`` and λ = 1e-5: ``κ ≈ 1e5``, above `FLOAT32_MAX_CONDITION`. Where a float64 factor fits it is
    formed in float64 (and matches float64 to float32 rounding of the GGN); where it does not,
    the float32 factor is kept with a warning that states the condition bound."""
    post32, _, _ = fitted(torch.float32, lam=1e-5, rank=K // 2)
    ref = post32.ggn.double() / T + 1e-5 * torch.eye(K, dtype=torch.float64)
    want = torch.linalg.cholesky(torch.linalg.inv(ref))
    assert rel(post32.scale_tril, want) < 1e-5  # float64 factor of the float32 GGN, rounded
    size = 4 * K * K
    monkeypatch.setattr(full, "MAX_BYTES", 3 * size)  # two float32 fit, a float64 repair not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post, _, _ = fitted(torch.float32, lam=1e-5, rank=K // 2)
    assert any("condition number above" in str(w.message) for w in caught)
    assert bool(torch.isfinite(post.scale_tril).all())
    # float32 Cholesky + inverse lose about κ ε₃₂ relative: compare the covariance it implies
    # on the well-determined directions (J of the GGN's top eigenvectors), not the tiny ones
    e, u = torch.linalg.eigh(ref)
    top = u[:, -10:].T[None]  # shape: (1, 10, K)
    got = post.functional_covariance(top.float()).double()
    assert rel(got, torch.diag(1 / e[-10:])[None]) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_feature_covariance_of_a_last_layer_from_the_factor(dtype):
    """``C_cd = φ̃ᵀ Σ_(c,d) φ̃`` (MoLA A.2) for 3 classes of 32 features, without ``Σ``."""
    post, prior, c = fitted(dtype)
    cov = torch.linalg.inv(c / T + 0.7 * torch.eye(K, dtype=torch.float64))
    rows = torch.arange(K).view(3, K // 3)
    phi = torch.randn(5, K // 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    jac = torch.zeros(5, 3, K, dtype=torch.float64)
    for i in range(3):
        jac[:, i, rows[i]] = phi
    want = torch.einsum("nok,kl,npl->nop", jac, cov, jac)
    assert rel(post.feature_covariance(phi.to(dtype), rows), want) < TOL[dtype]
    got = post.feature_covariance(phi.to(dtype), rows, diagonal=True)
    assert rel(got, want.diagonal(dim1=-2, dim2=-1)) < TOL[dtype]
    assert held(post) == {"ggn", "scale_tril"}


def test_root_rows_hold_nothing_when_the_points_will_exceed_the_limit():
    """`RootRows.points`: ``N·C`` rows known to exceed the limit from the first block, so none
    is held back (``2K/3`` held rows would be ``2/3`` of a ``(K, K)`` matrix at the peak)."""
    from pyro_subspace.curvature.gram import RootRows

    blocks = [(None, torch.ones(2, 3, 5)) for _ in range(3)]  # 3 blocks of 2 points x 3 rows
    over = RootRows(17, points=6)  # 18 rows > 17
    passed = list(over.tap(iter(blocks)))
    assert over.parts is None and len(passed) == 3 and all(p[1] is b[1] for p, b in zip(passed, blocks))
    under = RootRows(18, points=6)  # 18 rows, at the limit: every block held
    assert list(under.tap(iter(blocks))) == [] and under.kept
    assert torch.equal(under.matrix(), torch.ones(18, 5))


def _guide_over_96_weights(dtype):
    """A fitted `AutoSubspaceLaplace` (λ = 0.8) over ``K`` = 96 random weights of a 4-24-4 MLP
    with ``N·C`` = 320 GGN rows > ``K`` (the formed route): ``(net, subspace, guide, x)``."""
    from torch import nn

    from pyro_subspace import SubspaceNet, likelihoods, subspaces
    from pyro_subspace.infer import AutoSubspaceLaplace

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 24), nn.Tanh(), nn.Linear(24, 4)).to(dtype)
    x = torch.randn(80, 4, dtype=dtype)
    y = torch.randint(0, 4, (80,))
    idx = torch.randperm(sum(p.numel() for p in net.parameters()))[:K]
    sub = subspaces.subnetwork(net, strategy="indices", indices=idx)
    la = AutoSubspaceLaplace(SubspaceNet(net, sub, likelihoods.Categorical()), prior_precision=0.8)
    la.fit(x, y, find_map=False)
    return net, sub, la, x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_guide_over_a_subnetwork_of_96_weights(dtype, monkeypatch):
    """Through `AutoSubspaceLaplace` with ``N·C`` = 320 GGN rows > ``K`` = 96 (the formed
    route): the covariance, the linearised predictive and draws against dense linear algebra on
    the guide's GGN; the evidence from the factor equals the one from the GGN's eigenvalues."""
    from pyro_subspace.flat import FlatNet
    from pyro_subspace.infer import linearized_moments

    net, sub, la, x = _guide_over_96_weights(dtype)
    post = la.posterior
    assert post.buffer_dtype == dtype and held(post) == {"ggn", "scale_tril"}
    cov = torch.linalg.inv(la.ggn.double() / la.temperature + 0.8 * torch.eye(K, dtype=torch.float64))
    _, f_cov = linearized_moments(la, x[:7])
    w = sub.weights(la.loc).detach()
    jac = torch.cat([j for _, j in sub.jacobian_blocks(FlatNet(net), x[:7], w, 64)]).double()
    assert rel(f_cov, torch.einsum("nok,kl,npl->nop", jac, cov, jac)) < TOL[dtype]
    draws = la.sample_weights(3, seed=1)
    assert draws.shape == (3, w.numel()) and bool(torch.isfinite(draws).all())
    assert held(post) == {"ggn", "scale_tril"}
    monkeypatch.setattr(full, "FACTOR_LOG_DET_MIN_K", 64)
    from_factor = float(la.log_marginal_likelihood())
    monkeypatch.setattr(full, "FACTOR_LOG_DET_MIN_K", 10**9)
    from_eigenvalues = float(la.log_marginal_likelihood())
    assert abs(from_factor - from_eigenvalues) < TOL[dtype] * K * max(1.0, abs(from_eigenvalues))
    assert rel(la.covariance, cov) < TOL[dtype]  # formed when read


def test_marglik_eigenvalues_in_the_buffers_dtype_where_float64_copies_do_not_fit(monkeypatch):
    """Where two float64 copies of a float32 GGN do not fit under `MAX_BYTES`, the eigenvalues
    are taken in float32 (one copy): within float32's eigensolver error ``K ε ‖G‖``."""
    monkeypatch.setattr(full, "MAX_BYTES", 3 * 4 * K * K)  # two float32 fit, float64 copies not
    post, _, c = fitted(torch.float32)
    seen, eigvalsh = [], torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda a: seen.append(a.dtype) or eigvalsh(a))
    got = post.ggn_eigenvalues()
    assert seen == [torch.float32]
    want = torch.linalg.eigvalsh(c)
    assert float((got - want).abs().max()) < K * 6e-8 * float(want.max())
    assert held(post) == {"ggn"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("diagonal", [False, True])
def test_a_one_off_evidence_at_another_lambda_is_one_cholesky_not_an_eigendecomposition(
    dtype, diagonal, monkeypatch
):
    """At ``K ≥`` `FACTOR_LOG_DET_MIN_K` the evidence at a prior other than the factor's, with
    nothing to differentiate, is one Cholesky in the factor's memory (no eigenvalues, no dense
    float64 copy), equal to the dense log-determinant; the factor comes back at the kept prior."""
    monkeypatch.setattr(full, "FACTOR_LOG_DET_MIN_K", 64)
    post, prior, c = fitted(dtype)
    factor = post.scale_tril.clone()
    seen, eigvalsh = [], torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda a: seen.append(a.dtype) or eigvalsh(a))
    lam = torch.linspace(2.0, 4.0, K, dtype=torch.float64) if diagonal else torch.tensor(3.0).double()
    got = post.log_det(PriorPrecision(lam, None, K))
    want = torch.logdet(c / T + torch.diag(lam.expand(K)))
    assert abs(float(got) - float(want)) < TOL[dtype] * K
    assert seen == [] and held(post) == {"ggn", "scale_tril"}  # in the factor's memory
    assert "scale_tril" in post.pending  # overwritten: formed again when read
    assert rel(post.scale_tril, factor.double()) < TOL[dtype]
    # a λ optimiser's eigenvalues, once computed, serve every later scalar λ in O(K)
    post.log_det(PriorPrecision(torch.tensor(2.0).double().requires_grad_(), None, K))
    assert len(seen) == 1
    again = post.log_det(PriorPrecision(torch.tensor(5.0).double(), None, K))
    want = torch.logdet(c / T + 5.0 * torch.eye(K, dtype=torch.float64))
    assert abs(float(again) - float(want)) < TOL[dtype] * K and len(seen) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cloned", [False, True])
def test_the_state_holds_the_two_matrices_and_the_prior_and_loads_bit_for_bit(
    dtype, cloned, tmp_path, monkeypatch
):
    """A fitted posterior's state: the GGN and the factor, the prior they were formed with,
    and zero-stride placeholders for the unformed ``Σ⁻¹`` and ``Σ`` (at the paper's ``K`` two
    matrices saved, not four). Loaded (from disk, or from a cloned state whose placeholders
    became zeros), the two are formed on first use from the saved prior, equal bit for bit to
    the original's; the evidence is read off the loaded factor."""
    monkeypatch.setattr(full, "FACTOR_LOG_DET_MIN_K", 64)
    post, prior, c = fitted(dtype, lam=[0.5 + i / K for i in range(K)])
    state = post.state_dict()
    assert held(post) == {"ggn", "scale_tril"}  # saving formed nothing more
    assert {n for n in full.BUFFERS if 0 in state[n].stride()} == {
        "precision_matrix", "covariance_matrix"
    }
    assert torch.equal(state["formed_prior_lam"], prior.lam) and state["formed_prior_gram"].numel() == 0
    if cloned:
        state = {name: value.clone() for name, value in state.items()}
    torch.save(state, tmp_path / "post.pt")
    loaded = FullPosterior(K, dtype=dtype)
    loaded.load_state_dict(torch.load(tmp_path / "post.pt", weights_only=True))
    assert held(loaded) == {"ggn", "scale_tril"}
    assert loaded.pending == {"precision_matrix", "covariance_matrix"}
    assert torch.equal(loaded.log_det(prior), post.log_det(prior))  # off the factor
    assert torch.equal(loaded.precision_matrix, post.precision_matrix)
    assert torch.equal(loaded.covariance_matrix, post.covariance_matrix)
    assert rel(loaded.covariance_matrix, torch.linalg.inv(c / T + torch.diag(prior.lam))) < TOL[dtype]
    again = FullPosterior(K, dtype=dtype)  # a state with everything formed: all four kept
    again.load_state_dict(post.state_dict())
    assert held(again) == set(full.BUFFERS) and again.pending == frozenset()
    assert torch.equal(again.precision_matrix, post.precision_matrix)
    unfitted = FullPosterior(K, dtype=dtype)
    unfitted.load_state_dict(FullPosterior(K, dtype=dtype).state_dict())
    assert held(unfitted) == set()  # placeholders stay placeholders: no (K, K) memory


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_loaded_state_is_copied_not_kept(dtype, tmp_path):
    """Nothing of a loaded state is kept by reference: the saved prior becomes the pending
    one as a copy. Writing NaN into the state after loading leaves the loaded posterior equal
    to the original; and a state read with ``torch.load(mmap=True)`` leaves no mapping of its
    file once it is deleted (a kept 0-d λ held the whole file, 14.4 GB at the paper's ``K``,
    in the RSS)."""
    import gc

    post, prior, c = fitted(dtype, lam=[0.5 + i / K for i in range(K)])
    state = {name: value.clone() for name, value in post.state_dict().items()}  # (not post's)
    again = FullPosterior(K, dtype=dtype)
    again.load_state_dict(state)
    for value in state.values():
        if value.is_floating_point():
            value.fill_(float("nan"))
    assert torch.equal(again.precision_matrix, post.precision_matrix)
    assert torch.equal(again.covariance_matrix, post.covariance_matrix)
    path = tmp_path / "posterior.pt"
    torch.save(post.state_dict(), path)
    mapped = FullPosterior(K, dtype=dtype)
    saved = torch.load(path, mmap=True, weights_only=True)
    mapped.load_state_dict(saved)
    del saved
    gc.collect()
    assert torch.equal(mapped.covariance_matrix, post.covariance_matrix)
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            assert str(path) not in f.read()


def test_the_fit_gives_the_passes_freed_heap_back_before_the_factor(monkeypatch):
    """After the Jacobian passes of a fit whose GGN holds at least `heap.TRIM_MIN_BYTES`, the
    C heap's free pages go back to the OS (glibc ``malloc_trim``) before the factor is formed;
    below it, not."""
    from pyro_subspace import heap

    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    fitted(torch.float64)
    assert calls == []  # 96 x 96: far below TRIM_MIN_BYTES
    monkeypatch.setattr(heap, "TRIM_MIN_BYTES", 8 * K * K)
    fitted(torch.float64)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_grids_jacobians_in_the_buffers_dtype_and_their_heap_given_back(dtype, monkeypatch):
    """The grid search's validation Jacobians (`tuning.grid_covariances`) are stacked once, in
    the dtype the sweep computes in (the buffers': no float64 copy of a float32 pass), the
    sweep agrees with dense linear algebra, and once the pass's blocks held at least
    `heap.TRIM_MIN_BYTES` the freed C heap is given back; below it, not."""
    from pyro_subspace import heap
    from pyro_subspace.flat import FlatNet
    from pyro_subspace.infer.laplace import tuning

    net, sub, la, x = _guide_over_96_weights(dtype)
    stacked, calls = [], []
    original = full.stacked_jacobians
    monkeypatch.setattr(full, "stacked_jacobians", lambda *a: stacked.append(original(*a)) or stacked[-1])
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    xv = x[:9]
    _, f_cov = tuning.grid_covariances(la, xv, chunk_size=4)  # three blocks of (≤4, 4, 96)
    assert calls == [] and [j.dtype for j in stacked] == [dtype]
    w = sub.weights(la.loc).detach()
    jac = torch.cat([j for _, j in sub.jacobian_blocks(FlatNet(net), xv, w, 64)]).double()
    for lam in (0.1, 0.8, 5.0):
        cov = torch.linalg.inv(la.ggn.double() / la.temperature + lam * torch.eye(K, dtype=torch.float64))
        want = torch.einsum("nok,kl,npl->nop", jac, cov, jac)
        got = f_cov(torch.tensor(lam, dtype=torch.float64))
        assert got.dtype == torch.float64 and rel(got, want) < 10 * TOL[dtype], lam
    monkeypatch.setattr(heap, "TRIM_MIN_BYTES", jac.numel() * torch.empty((), dtype=dtype).element_size())
    tuning.grid_covariances(la, xv, chunk_size=4)
    assert calls == [1]


def test_trim_returns_free_heap_pages_where_glibc_has_malloc_trim():
    """`heap.trim` on glibc: after freeing many blocks below the mmap threshold the heap's free
    pages are released (RSS falls); elsewhere it is a no-op returning False."""
    import ctypes.util
    import os

    from pyro_subspace import heap

    if heap._malloc_trim() is None or not os.path.exists("/proc/self/statm"):
        assert heap.trim() is False
        return

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    assert ctypes.util.find_library("c")
    blocks = [bytearray(64 * 1024) for _ in range(4096)]  # 256 MiB of 64 KiB heap blocks
    for b in blocks:
        b[::4096] = b"\x01" * len(b[::4096])  # touched: resident
    before = rss()
    del blocks[:-1]  # all but the last: free, below the top of the heap
    assert heap.trim() is True
    assert rss() < before - 128 * 2**20  # most of the 256 MiB given back
