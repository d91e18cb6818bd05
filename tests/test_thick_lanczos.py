"""Thick-restart Lanczos against dense ``torch.linalg.eigh`` and ARPACK's product count.

Tolerances follow from the stopping test (see `test_block_lanczos`): a residual ``r`` gives
``|θ − λ| <= r²/gap``, so ``tol = 1e-10`` on separated eigenvalues gives them to rounding.
"""

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import LinearOperator, eigsh

from pyro_subspace.curvature import GGNOperator
from pyro_subspace.curvature.thick_lanczos import thick_restart_lanczos_eigh
from tests.test_block_lanczos import check_pairs
from tests.test_curvature import dense_ggn, make_problem


def decaying(d=300, seed=0):
    """``U diag(λ) Uᵀ`` with a random orthogonal ``U`` and ``λ_i = 100 i^(-1.5)``."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen)).Q
    lam = 100 * torch.arange(1, d + 1, dtype=torch.float64) ** -1.5
    return (u * lam) @ u.T


def test_on_the_ggn_operator_equals_dense_eigh():
    """Categorical GGN, D = 38: top 5 to 1e-8 (rounding in fact), within D products."""
    net, lik, x = make_problem("categorical_3")
    g = dense_ggn(net, lik, x)
    op = GGNOperator(net, lik, x)
    values, vectors, products = thick_restart_lanczos_eigh(op.matvec, op.dim, 5, tol=1e-10)
    ref = torch.linalg.eigvalsh(g).flip(0)
    gap = float((ref[:5] - ref[1:6]).min() / ref[0])
    assert gap > 1e-3
    check_pairs(values, vectors, g, 5, 1e-8, 1e-12 / gap**2 + 1e-9)
    assert products == op.products <= op.dim


@pytest.mark.parametrize("tol", [1e-6, 1e-10])
def test_no_more_products_than_arpack(tol):
    """Same operator, same start vector, same test: ARPACK (default ncv = 2k + 1 = 21) needs at
    least as many products; the eigenpairs agree with dense eigh."""
    a = decaying()
    v0 = np.random.default_rng(0).standard_normal(a.shape[0])
    count = [0]

    def mv(v):
        count[0] += 1
        return a.numpy() @ np.ravel(v)

    op = LinearOperator(a.shape, matvec=mv, dtype=np.float64)
    eigsh(op, k=10, which="LA", tol=tol, v0=v0)
    values, vectors, products = thick_restart_lanczos_eigh(
        lambda v: a @ v, a.shape[0], 10, tol=tol, v0=torch.from_numpy(v0)
    )
    assert products <= count[0]
    # residual r <= tol θ gives |θ − λ| <= r²/gap and angles <= r/gap (gap >= 0.5 here)
    check_pairs(values, vectors, a, 10, max(1e-12, 4 * tol**2 * 100), 1e-12 + 8 * tol**2 * 100)


def test_thick_restarts_with_a_small_basis():
    """ncv = k + 3 forces many restarts; still the dense eigenpairs to 1e-8."""
    a = decaying()
    values, vectors, products = thick_restart_lanczos_eigh(
        lambda v: a @ v, 300, 6, tol=1e-10, ncv=9
    )
    assert products > 9  # restarted
    check_pairs(values, vectors, a, 6, 1e-8, 1e-9)


def test_rank_below_k_and_zero_operator():
    """A GGN from 3 data points (rank <= 3) asked for 5 pairs: the 3 nonzero eigenvalues, two
    zeros, 5 orthonormal vectors with ‖G y − θ y‖ ~ rounding. A = 0: zeros, orthonormal."""
    net, lik, x = make_problem("gaussian_1", n=3)
    g = dense_ggn(net, lik, x)
    op = GGNOperator(net, lik, x)
    values, vectors, _ = thick_restart_lanczos_eigh(op.matvec, op.dim, 5, tol=1e-10)
    ref = torch.linalg.eigvalsh(g).flip(0)[:5]
    assert (values - ref).abs().max() <= 1e-10 * ref[0]
    assert torch.allclose(vectors.T @ vectors, torch.eye(5, dtype=torch.float64), atol=1e-10)
    assert (g @ vectors - vectors * values).norm(dim=0).max() <= 1e-8 * ref[0]
    zero, vecs, products = thick_restart_lanczos_eigh(torch.zeros_like, 20, 4)
    assert (zero == 0).all() and products == 4
    assert torch.allclose(vecs.T @ vecs, torch.eye(4, dtype=torch.float64), atol=1e-12)


def test_budget_warns_and_exact_at_dim():
    a = decaying(40)
    with pytest.warns(RuntimeWarning, match="max_products"):
        _, _, products = thick_restart_lanczos_eigh(
            lambda v: a @ v, 40, 5, tol=1e-14, ncv=7, max_products=8
        )
    assert products == 8
    values, vectors, products = thick_restart_lanczos_eigh(lambda v: a @ v, 40, 5, tol=0, ncv=40)
    assert products == 40  # tol = 0, ncv = dim: the whole space, exact
    check_pairs(values, vectors, a, 5, 1e-12, 1e-12)


def test_bad_input():
    a = decaying(10)
    mv = lambda v: a @ v
    with pytest.raises(TypeError, match="matvec"):
        thick_restart_lanczos_eigh(a, 10, 2)
    with pytest.raises(ValueError, match="k"):
        thick_restart_lanczos_eigh(mv, 10, 11)
    with pytest.raises(ValueError, match="tol"):
        thick_restart_lanczos_eigh(mv, 10, 2, tol=-1.0)
    with pytest.raises(ValueError, match="ncv"):
        thick_restart_lanczos_eigh(mv, 10, 2, ncv=2)
    with pytest.raises(ValueError, match="v0"):
        thick_restart_lanczos_eigh(mv, 10, 2, v0=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="matvec"):
        thick_restart_lanczos_eigh(lambda v: v[:3], 10, 2)


def test_ggn_eigen_with_tol_uses_thick_restart_and_equals_dense_eigh():
    from pyro_subspace import subspaces

    net, lik, x = make_problem("categorical_3")
    g = dense_ggn(net, lik, x)
    sub = subspaces.ggn_eigen(net, lik, x, 4, tol=1e-10)
    check_pairs(sub.eigenvalues, sub.basis, g, 4, 1e-8, 1e-8)
    with pytest.raises(ValueError, match="tol"):
        subspaces.ggn_eigen(net, lik, x, 4, tol=-1.0)
