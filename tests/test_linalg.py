"""The LAPACK routes of the posterior factor (`precision_to_scale_tril`, ``trtri``) and the
covariance from it (`tril_outer`, ``lauum``) against dense inverses, and against the torch
routes they replace (below 64 rows, or with SciPy's LAPACK hidden)."""

from __future__ import annotations

import pytest
import torch

from pyro_subspace import linalg


def spd(k, dtype):
    gen = torch.Generator().manual_seed(k)
    a = torch.randn(k, k + 10, generator=gen, dtype=torch.float64)
    return (a @ a.T / k + 0.1 * torch.eye(k, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("k", [5, 64, 150])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scale_tril_and_covariance_match_the_inverse(k, dtype, monkeypatch):
    p = spd(k, dtype)
    s = linalg.precision_to_scale_tril(p)
    cov = linalg.tril_outer(s)
    inv = torch.linalg.inv(p.double())
    # float64: a condition number ~1e3 times the unit roundoff; float32 the same with 2^-24
    tol = 1e-11 if dtype == torch.float64 else 1e-3
    assert s.dtype == dtype and torch.equal(s, s.tril())
    assert ((s.double() @ s.double().T - inv).abs().max() / inv.abs().max()) < tol
    assert ((cov.double() - inv).abs().max() / inv.abs().max()) < tol
    assert torch.equal(cov, cov.T)
    monkeypatch.setattr(linalg, "_lapack", lambda a: None)  # the torch routes
    s_torch = linalg.precision_to_scale_tril(p)
    cov_torch = linalg.tril_outer(s_torch)
    assert ((s - s_torch).abs().max() / s_torch.abs().max()) < tol
    assert ((cov - cov_torch).abs().max() / cov_torch.abs().max()) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
@pytest.mark.parametrize("n", [10, 130])  # below and above the LAPACK route's 64 rows
def test_eigh_in_place_equals_torch_eigh(n, dtype, tol):
    """`linalg.eigh_` (symmetrise, LAPACK syevd on the matrix's own memory) gives the eigenvalues
    of ``(A + Aᵀ)/2`` that a float64 ``torch.linalg.eigvalsh`` gives, orthonormal vectors that
    reconstruct it, and overwrites its input."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    sym = (a + a.T) / 2
    m = a.to(dtype, copy=True)
    values, vectors = linalg.eigh_(m)
    want = torch.linalg.eigvalsh(sym)
    scale = float(want.abs().max())
    assert float((values.double() - want).abs().max()) < tol * scale
    v = vectors.double()
    assert float((v.T @ v - torch.eye(n, dtype=torch.float64)).abs().max()) < 10 * tol * n
    assert float((v @ torch.diag(values.double()) @ v.T - sym).abs().max()) < 10 * tol * scale
    assert not torch.equal(m.double(), a.to(dtype).double())  # the input was the workspace
