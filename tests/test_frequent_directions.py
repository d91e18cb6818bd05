"""Frequent-directions sketch checked against dense float64 linear algebra on the full matrix."""

import io

import pytest
import torch

from pyro_subspace.subspaces.frequent_directions import FrequentDirections

pytestmark = pytest.mark.usefixtures("one_thread")


def _sketch_of(a, ell, dtype=torch.float64):
    fd = FrequentDirections(a.shape[1], ell, dtype=dtype)
    for row in a:
        fd.append(row)
    return fd


@pytest.mark.parametrize("ell", [5, 10, 20, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_covariance_error_bound_and_no_overestimate(ell, dtype):
    a = torch.randn(300, 40, generator=torch.Generator().manual_seed(ell), dtype=torch.float64)
    fd = _sketch_of(a.to(dtype), ell, dtype)
    b = fd.sketch.to(torch.float64)
    a = a.to(dtype).to(torch.float64)
    fro_sq = a.square().sum().item()
    diff = a.T @ a - b.T @ b
    assert fd.n_rows == 300
    assert fd.covariance_error_bound == pytest.approx(fro_sq / ell, rel=1e-6)
    assert torch.linalg.matrix_norm(diff, ord=2).item() <= fro_sq / ell * (1 + 1e-6)
    tol = 1e-8 if dtype == torch.float64 else 1e-5
    assert torch.linalg.eigvalsh(diff).min().item() >= -tol * fro_sq


@pytest.mark.parametrize("n", [1, 6, 10])
def test_exact_until_full(n):
    a = torch.randn(n, 15, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    b = _sketch_of(a, ell=10).sketch
    assert torch.allclose(b.T @ b, a.T @ a, rtol=1e-12, atol=1e-12)


def test_planted_low_rank_subspace_recovered():
    g = torch.Generator().manual_seed(2)
    q, _ = torch.linalg.qr(torch.randn(200, 3, generator=g, dtype=torch.float64))
    z = torch.randn(500, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 2.0, 1.0])
    a = z @ q.T + 1e-3 * torch.randn(500, 200, generator=g, dtype=torch.float64)
    b = _sketch_of(a.float(), ell=10, dtype=torch.float32).sketch.double()
    v = torch.linalg.svd(b, full_matrices=False).Vh[:3].T  # shape: (D, 3)
    assert torch.linalg.norm(q - v @ (v.T @ q)).item() < 1e-2


def test_ell_larger_than_dim_is_exact():
    a = torch.randn(30, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    b = _sketch_of(a, ell=6).sketch
    assert torch.allclose(b.T @ b, a.T @ a, rtol=1e-10, atol=1e-10)


def test_validation():
    with pytest.raises(ValueError, match="dim"):
        FrequentDirections(0, 3)
    with pytest.raises(ValueError, match="ell"):
        FrequentDirections(4, 0)
    with pytest.raises(TypeError, match="dim"):
        FrequentDirections(4.0, 3)
    with pytest.raises(TypeError, match="ell"):
        FrequentDirections(4, True)
    fd = FrequentDirections(4, 3)
    with pytest.raises(ValueError, match="row"):
        fd.append(torch.zeros(5))
    with pytest.raises(ValueError, match="row"):
        fd.append(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="row"):
        fd.append(torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    assert fd.n_rows == 0
    with pytest.raises(ValueError, match="dim=4, ell=3"):
        fd.load_state_dict(FrequentDirections(4, 2).state_dict())


def test_state_dict_round_trip_continues_identically():
    a = torch.randn(40, 12, generator=torch.Generator().manual_seed(4))
    fd = _sketch_of(a[:25], ell=5, dtype=torch.float32)
    buffer = io.BytesIO()
    torch.save(fd.state_dict(), buffer)
    buffer.seek(0)
    restored = FrequentDirections(12, 5)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for row in a[25:]:
        fd.append(row)
        restored.append(row)
    assert torch.equal(restored.sketch, fd.sketch)
    assert restored.n_rows == fd.n_rows == 40
    assert restored.frobenius_sq == fd.frobenius_sq
