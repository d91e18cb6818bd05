"""The in-place factorisations of `pyro_subspace.linalg` that hold the full Laplace structure to
two ``(K, K)`` matrices: the blocked Cholesky factor and triangular inverse on torch's BLAS
(`cholesky_upper_`, `triu_inverse_`; taken above `linalg.BLOCKED_ROW_BYTES` instead of SciPy's
OpenBLAS, whose threaded ``potrf`` crashed at the paper's ``K`` = 42,438 float32) against
torch's dense linear algebra in float32 and float64, at sizes that are and are not multiples of
the block; in place (the result in the input's storage, no ``(K, K)`` temporary); failures
reported as LAPACK's ``info``, as the LAPACK route does.

Tolerances: the matrices have ``κ < 10``; float64 ``1e-10`` relative, float32 ``1e-4``
(``K ε₃₂ κ`` at ``K`` ≤ 260).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pyro_subspace import linalg
from pyro_subspace.linalg import (
    cholesky_reversed_,
    cholesky_upper_,
    posterior_factors_,
    reversed_copy_,
    scale_tril_from_reversed_cholesky_,
    solve_reversed_cholesky,
    triu_inverse_,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
DTYPES = [torch.float64, torch.float32]


def spd(n: int, dtype, seed: int = 0) -> torch.Tensor:
    """A symmetric positive-definite ``(n, n)`` with eigenvalues in about ``[0.6, 3.4]``."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.randn(n, 2 * n + 3, generator=gen, dtype=torch.float64)
    a = b @ b.T / (2 * n + 3)
    a.diagonal().add_(0.5)
    return a.to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.fixture
def blocked(monkeypatch):
    """The blocked torch route at every size, with blocks of 32 rows."""
    monkeypatch.setattr(linalg, "BLOCKED_ROW_BYTES", 0)
    monkeypatch.setattr(linalg, "FACTOR_BLOCK", 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1, 32), (7, 32), (64, 32), (100, 32), (130, 64), (257, 128)])
def test_cholesky_upper_against_torch(dtype, n, block):
    a = spd(n, dtype)
    gen = torch.Generator().manual_seed(2)  # the strict lower triangle: never read, kept
    work = a.triu() + torch.randn(n, n, generator=gen, dtype=dtype).tril(-1)
    lower = work.tril(-1).clone()
    ptr = work.data_ptr()
    assert cholesky_upper_(work, block) == 0
    assert work.data_ptr() == ptr
    want = torch.linalg.cholesky(a.double(), upper=True)
    assert rel(work.triu(), want) < TOL[dtype]
    assert torch.equal(work.tril(-1), lower)  # not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1, 32), (7, 32), (64, 32), (100, 32), (130, 64), (257, 128)])
def test_triu_inverse_against_the_dense_inverse(dtype, n, block):
    u = torch.linalg.cholesky(spd(n, torch.float64, seed=1), upper=True)
    gen = torch.Generator().manual_seed(2)
    work = (u + torch.randn(n, n, generator=gen, dtype=torch.float64).tril(-1)).to(dtype)
    lower = work.tril(-1).clone()
    ptr = work.data_ptr()
    assert triu_inverse_(work, block) == 0
    assert work.data_ptr() == ptr
    assert rel(work.triu(), torch.linalg.inv(u.to(dtype).double())) < TOL[dtype]
    assert torch.equal(work.tril(-1), lower)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_matrix_that_is_not_positive_definite_reports_lapacks_info(dtype, monkeypatch):
    a = spd(100, dtype)
    a[70, 70] = -1.0  # the leading minor of order 71 is the first that is not definite
    want = int(torch.linalg.cholesky_ex(a).info)
    assert want == 71
    assert cholesky_upper_(a.clone(), 32) == want
    nan = a.clone()
    nan[70, 70] = float("nan")
    assert cholesky_upper_(nan, 32) == 71
    # cholesky_reversed_: the same (info, inf) on the LAPACK and the blocked route
    lapack = cholesky_reversed_(reversed_copy_(torch.empty_like(a), a))
    monkeypatch.setattr(linalg, "BLOCKED_ROW_BYTES", 0)
    monkeypatch.setattr(linalg, "FACTOR_BLOCK", 32)
    assert cholesky_reversed_(reversed_copy_(torch.empty_like(a), a)) == lapack
    assert lapack[0] == 100 - 70 and lapack[1] == float("inf")  # J a J: row 70 is row 29


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_zero_on_the_diagonal_reports_its_index_and_leaves_the_matrix(dtype, blocked):
    u = torch.linalg.cholesky(spd(90, torch.float64), upper=True).to(dtype)
    u[40, 40] = 0.0
    work = u.clone()
    assert triu_inverse_(work, 32) == 41
    assert torch.equal(work, u)
    s = u.clone()  # as after cholesky_reversed_: the C-ordered upper triangle holds Mᵀ
    with pytest.raises(torch.linalg.LinAlgError, match="singular factor"):
        scale_tril_from_reversed_cholesky_(s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [100, 257])
def test_the_reversed_factor_and_its_inverse_agree_with_lapack_and_the_dense_inverse(
    dtype, n, monkeypatch
):
    p = spd(n, dtype, seed=3)
    cov = torch.linalg.inv(p.double())
    results = {}
    for route in ("lapack", "blocked"):
        if route == "blocked":
            monkeypatch.setattr(linalg, "BLOCKED_ROW_BYTES", 0)
            monkeypatch.setattr(linalg, "FACTOR_BLOCK", 48)
        s = reversed_copy_(torch.empty_like(p), p)
        ptr = s.data_ptr()
        info, condition = cholesky_reversed_(s)
        assert info == 0 and 1.0 < condition < 1e2
        assert s.data_ptr() == ptr
        # the C-ordered upper triangle holds Mᵀ with J P J = M Mᵀ
        m = s.triu().mT.double()
        assert rel(m @ m.T, p.double().flip(-2, -1)) < TOL[dtype]
        x = torch.randn(5, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        if route == "blocked":  # torch's trsm, never SciPy's OpenBLAS, above the rule
            monkeypatch.setattr("scipy.linalg.blas.strsm", None)
            monkeypatch.setattr("scipy.linalg.blas.dtrsm", None)
        y = solve_reversed_cholesky(s, x)
        assert rel(y.double() @ y.double().T, x @ cov @ x.T) < TOL[dtype]
        out = scale_tril_from_reversed_cholesky_(s)
        assert out.data_ptr() == ptr and out.untyped_storage().data_ptr() == ptr
        assert torch.equal(out, out.tril())
        assert rel(out.double() @ out.double().T, cov) < TOL[dtype]
        assert rel(out, torch.linalg.cholesky(cov)) < TOL[dtype]
        results[route] = (out.clone(), condition)
    assert rel(results["blocked"][0], results["lapack"][0]) < TOL[dtype]
    assert abs(results["blocked"][1] / results["lapack"][1] - 1) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_k_by_k_temporary_on_the_blocked_route(dtype, blocked):
    """torch's allocations (the profiler's) during the factor and its inverse: none is larger
    than a ``b × K`` panel (``K`` = 400, ``b`` = 32: a twelfth of a matrix)."""
    n = 400
    s = reversed_copy_(torch.empty(n, n, dtype=dtype), spd(n, dtype))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert cholesky_reversed_(s)[0] == 0
        assert triu_inverse_(s) == 0  # (`scale_tril_from_reversed_cholesky_`'s inverse)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 2 * 32 * n * s.element_size() < n * n * s.element_size() / 6
    # the whole of `FullPosterior`'s chain: `reverse_`'s blocks of 2¹⁶ numbers at most
    p = spd(n, dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert cholesky_reversed_(reversed_copy_(s, p))[0] == 0
        scale_tril_from_reversed_cholesky_(s)
    assert max(e.self_cpu_memory_usage for e in prof.events()) <= 2**16 * s.element_size()
    assert rel(s.double() @ s.double().T, torch.linalg.inv(p.double())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_posterior_factors_on_the_blocked_route(dtype, blocked):
    k = 100
    prec = spd(k, dtype, seed=5)
    scale, cov = torch.empty_like(prec), torch.empty_like(prec)
    assert posterior_factors_(prec, scale, cov)
    want = torch.linalg.inv(prec.double())
    assert rel(cov, want) < TOL[dtype]
    assert rel(scale, torch.linalg.cholesky(want)) < TOL[dtype]
    indefinite = prec.clone()
    indefinite[50, 50] = -1.0
    assert not posterior_factors_(indefinite, scale, cov)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_full_structure_on_the_blocked_route_equals_the_lapack_route(dtype, monkeypatch):
    """`FullPosterior` (``K`` = 96, blocks of 40): the factor, the evidence, the predictive and
    the per-λ factor of the grid sweep (`solve_reversed_cholesky`) as on the LAPACK route."""
    from pyro_subspace.infer.laplace.posteriors import full
    from pyro_subspace.infer.laplace.posteriors.base import PriorPrecision
    from pyro_subspace.infer.laplace.posteriors.full import FullPosterior

    k = 96
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2 * k, k, generator=gen, dtype=torch.float64) / (2 * k) ** 0.5
    ggn = rows.T @ rows

    class Evaluator:
        temperature = 1.0

        def ggn(self, t, diagonal=False, dtype=torch.float64, rows=None, **kwargs):
            return ggn.to(dtype).clone()

    jac = torch.randn(5, 3, k, generator=gen, dtype=torch.float64)
    blocks = [jac[:2], jac[2:]]
    prior = PriorPrecision(torch.tensor(0.7, dtype=torch.float64), None, k)
    size = torch.empty((), dtype=dtype).element_size()
    monkeypatch.setattr(full, "MAX_BYTES", int(2.5 * size * k * k))  # the grid: a factor per λ
    got = {}
    for route in ("lapack", "blocked"):
        if route == "blocked":
            monkeypatch.setattr(linalg, "BLOCKED_ROW_BYTES", 0)
            monkeypatch.setattr(linalg, "FACTOR_BLOCK", 40)
        post = FullPosterior(k, dtype=dtype)
        post.fit_curvature(Evaluator(), torch.zeros(k, dtype=torch.float64))
        post.set_prior(prior)
        f_cov = post.functional_covariance_on_grid(blocks, lambda lam: PriorPrecision(lam, None, k))
        got[route] = (
            post.scale_tril.clone(),
            float(post.log_det(prior)),
            post.functional_covariance(jac.to(dtype)),
            f_cov(torch.tensor(2.0, dtype=torch.float64)),
        )
    cov = torch.linalg.inv(ggn.to(dtype).double() + 0.7 * torch.eye(k, dtype=torch.float64))
    assert rel(got["blocked"][0], torch.linalg.cholesky(cov)) < TOL[dtype]
    assert rel(got["blocked"][0], got["lapack"][0]) < TOL[dtype]
    assert abs(got["blocked"][1] - got["lapack"][1]) < TOL[dtype] * k
    assert rel(got["blocked"][2], got["lapack"][2]) < TOL[dtype]
    assert rel(got["blocked"][3], got["lapack"][3]) < TOL[dtype]
