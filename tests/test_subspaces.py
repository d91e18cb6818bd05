import importlib

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA
from torch import nn

from pyro_subspace import subspaces
from pyro_subspace.subspaces import Subspace, SWACollector


def small_net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))


def test_dense_and_index_weights_match_dense_linear_algebra(device):
    d, k = 12, 4
    shift = torch.randn(d, dtype=torch.float64).to(device)
    basis = torch.randn(d, k, dtype=torch.float64).to(device)
    t = torch.randn(5, 3, k, dtype=torch.float64).to(device)
    dense = Subspace(shift, basis)
    assert dense.rank == k and dense.dim == d and dense.kind == "dense"
    assert torch.allclose(dense.weights(t), shift + torch.einsum("dk,...k->...d", basis, t))
    idx = torch.tensor([7, 0, 3, 11])  # on the CPU: the subspace moves it to the shift's device
    sub = Subspace(shift, idx)
    eye = torch.eye(d, dtype=torch.float64, device=device)[:, idx.to(device)]  # built independently
    assert sub.kind != "dense" and sub.rank == 4
    assert torch.allclose(sub.weights(t), shift + torch.einsum("dk,...k->...d", eye, t))
    assert torch.equal(sub.dense_basis(), eye)
    v = torch.randn(2, d, dtype=torch.float64).to(device)
    assert torch.allclose(sub.transpose_apply(v), v @ eye)
    assert torch.allclose(dense.transpose_apply(v), v @ basis)


def test_subnormal_entries_of_the_shift_and_basis_are_zeroed_and_no_other_entry_moves():
    """A basis from an SVD of snapshots where some weights never moved holds subnormal floats
    (slow arithmetic on a CPU): the subspace keeps them as 0, every normal entry as given."""
    tiny = torch.finfo(torch.float32).tiny
    shift = torch.tensor([1.0, tiny / 3, -2.0])
    basis = torch.tensor([[0.6, 0.0], [tiny / 5, 1.0], [0.8, -tiny / 7]])
    sub = Subspace(shift, basis)
    assert torch.equal(sub.shift, torch.tensor([1.0, 0.0, -2.0]))
    assert torch.equal(sub.basis, torch.tensor([[0.6, 0.0], [0.0, 1.0], [0.8, 0.0]]))
    assert float(shift[1]) > 0  # the caller's tensors are copied, not changed


def test_projection_recovers_coordinates_and_is_orthogonal():
    d, k = 30, 3
    sub = Subspace(torch.randn(d, dtype=torch.float64), torch.randn(d, k, dtype=torch.float64))
    t = torch.randn(6, k, dtype=torch.float64)
    assert torch.allclose(sub.project(sub.weights(t)), t, atol=1e-10)
    w = torch.randn(d, dtype=torch.float64)
    resid = w - sub.weights(sub.project(w))
    assert torch.allclose(sub.basis.T @ resid, torch.zeros(k, dtype=torch.float64), atol=1e-10)


def test_weights_are_differentiable_for_both_bases():
    for basis in (torch.randn(8, 2), torch.tensor([1, 5])):
        sub = Subspace(torch.randn(8), basis)
        t = torch.randn(2, requires_grad=True)
        (sub.weights(t) ** 2).sum().backward()
        expected = 2 * sub.dense_basis().T @ sub.weights(t.detach())
        assert torch.allclose(t.grad, expected, atol=1e-5)


def test_save_load_and_device_dtype(tmp_path):
    for basis in (torch.randn(9, 3), torch.tensor([0, 4, 8])):
        sub = Subspace(torch.randn(9), basis)
        sub.save(tmp_path / "s.pt")
        back = Subspace.load(tmp_path / "s.pt")
        assert torch.equal(back.shift, sub.shift) and torch.equal(back.basis, sub.basis)
        torch.save(sub, tmp_path / "whole.pt")
        whole = torch.load(tmp_path / "whole.pt", weights_only=False)
        assert torch.equal(whole.weights(torch.ones(3)), sub.weights(torch.ones(3)))
        moved = sub.to(torch.float64).to("cpu")
        assert moved.shift.dtype == torch.float64
        assert moved.basis.dtype == (torch.int64 if sub.kind != "dense" else torch.float64)


@pytest.mark.parametrize(
    "shift, basis, exc, match",
    [
        (torch.zeros(5, 2), torch.zeros(5, 1), ValueError, "shift: expected shape"),
        (
            torch.zeros(5),
            torch.zeros(4, 2),
            ValueError,
            r"basis: expected a dense basis of shape \(D, K\) = \(5",
        ),
        (torch.zeros(5), torch.tensor([0, 5]), ValueError, r"basis: indices must lie in \[0, 5\)"),
        (torch.zeros(5), torch.tensor([1, 1]), ValueError, "basis: indices must be distinct"),
        (torch.tensor([0.0, float("nan")]), torch.zeros(2, 1), ValueError, "shift: contains NaN"),
        (torch.zeros(3), [[1.0]], TypeError, "basis: expected a tensor"),
    ],
)
def test_subspace_rejects_bad_input(shift, basis, exc, match):
    with pytest.raises(exc, match=match):
        Subspace(shift, basis)


def test_weights_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"t: expected shape \(\.\.\., 2\)"):
        Subspace(torch.zeros(4), torch.zeros(4, 2)).weights(torch.zeros(3))


def test_random_subspace_is_seeded_unit_norm_and_shifted_at_the_weights(device):
    net = small_net().to(device)
    a = subspaces.random(net, 5, seed=3)
    b = subspaces.random(net, 5, seed=3)
    c = subspaces.random(net, 5, seed=4)
    assert torch.equal(a.basis, b.basis) and not torch.equal(a.basis, c.basis)
    assert a.basis.device == a.shift.device == device
    assert torch.allclose(a.basis.norm(dim=0), torch.ones(5, device=device), atol=1e-6)
    assert torch.equal(a.shift, nn.utils.parameters_to_vector(net.parameters()).detach())
    # the same directions on every device: drawn by a CPU generator, then moved
    assert torch.equal(a.basis.cpu(), subspaces.random(small_net(), 5, seed=3).basis)
    with pytest.raises(ValueError, match="rank"):
        subspaces.random(net, 0)


def run_trajectory(net, collector, directions, steps, noise=0.0, seed=0):
    """Move the net's weights along w0 + directions @ z_i and collect each snapshot."""
    gen = torch.Generator().manual_seed(seed)
    w0 = nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    snaps = []
    for _ in range(steps):
        z = torch.randn(directions.shape[1], generator=gen, dtype=torch.float64)
        w = w0 + (directions @ z).float() + noise * torch.randn(w0.shape, generator=gen)
        nn.utils.vector_to_parameters(w, net.parameters())
        collector.collect()
        snaps.append(w)
    return torch.stack(snaps)


def test_collector_mean_variance_and_last_deviations_match_numpy():
    net = small_net()
    col = SWACollector(net, max_snapshots=4)
    d = col.flat.num_weights
    snaps = (
        run_trajectory(net, col, torch.randn(d, 3, dtype=torch.float64), steps=7).double().numpy()
    )
    assert col.n_collected == 7 and col.num_snapshots == 4
    np.testing.assert_allclose(col.mean.numpy(), snaps.mean(0), atol=1e-5)
    np.testing.assert_allclose(col.variance.numpy(), snaps.var(0), atol=1e-4)
    # Algorithm 2 stores w_i − w̄_i with the running mean at step i.
    running = np.cumsum(snaps, 0) / np.arange(1, 8)[:, None]
    np.testing.assert_allclose(col.deviations.numpy(), (snaps - running)[-4:], atol=1e-5)


def test_pca_recovers_planted_directions_and_their_covariance():
    net = small_net()
    col = SWACollector(net, max_snapshots=20)
    d = col.flat.num_weights
    q, _ = torch.linalg.qr(torch.randn(d, 3, dtype=torch.float64))
    planted = q * torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    run_trajectory(net, col, planted, steps=40, noise=1e-4)
    sub = subspaces.pca(col, rank=3, seed=0)
    assert torch.allclose(sub.shift, col.mean)
    # Span: projecting the planted directions onto the PCA basis leaves ~nothing behind.
    basis, _ = torch.linalg.qr(sub.basis.double())
    resid = q - basis @ (basis.T @ q)
    assert resid.norm() < 1e-3
    # Scale: P Pᵀ equals the covariance of the stored deviations (dense eigh, independent).
    dev = col.deviations.double()
    cov = dev.T @ dev / (dev.shape[0] - 1)
    evals, evecs = torch.linalg.eigh(cov)
    top = evecs[:, -3:] * evals[-3:]
    ppt = sub.basis.double() @ sub.basis.double().T
    assert torch.allclose(ppt, top @ evecs[:, -3:].T, atol=1e-4 * cov.abs().max())


def test_pca_rank_larger_than_snapshots_is_an_error():
    net = small_net()
    col = SWACollector(net, max_snapshots=5)
    run_trajectory(net, col, torch.randn(col.flat.num_weights, 2, dtype=torch.float64), steps=3)
    with pytest.raises(
        ValueError, match="rank: 4 is larger than the number of collected snapshots M=3"
    ):
        subspaces.pca(col, rank=4)
    with pytest.raises(RuntimeError, match="call collect"):
        _ = SWACollector(net).mean
    with pytest.raises(ValueError, match="max_snapshots"):
        SWACollector(net, max_snapshots=1)


def test_minka_matches_scikit_learn_on_data_of_known_dimension():
    rng = np.random.default_rng(0)
    n, d, k = 500, 15, 4
    signal = rng.normal(size=(n, k)) @ (rng.normal(size=(k, d)) * 3.0)
    data = signal + 0.5 * rng.normal(size=(n, d))
    ref = PCA(n_components="mle", svd_solver="full").fit(data)
    spectrum = PCA(svd_solver="full").fit(data).explained_variance_  # all d eigenvalues
    ours = subspaces.minka_dimension(spectrum, n_samples=n)
    assert ours == ref.n_components_ == k


def test_pca_mle_chooses_the_planted_dimension_of_a_trajectory():
    net = small_net()
    col = SWACollector(net, max_snapshots=30)
    d = col.flat.num_weights
    q, _ = torch.linalg.qr(torch.randn(d, 3, dtype=torch.float64))
    run_trajectory(net, col, q * torch.tensor([3.0, 2.0, 1.5], dtype=torch.float64), 60, noise=0.05)
    assert subspaces.pca(col, rank="mle").rank == 3


def test_frequent_directions_collector_spans_planted_directions_of_a_long_trajectory():
    net = small_net()
    col = SWACollector(net, method="frequent_directions", rank=6)
    d = col.flat.num_weights
    q, _ = torch.linalg.qr(torch.randn(d, 3, dtype=torch.float64))
    run_trajectory(
        net, col, q * torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64), 200, noise=1e-3
    )
    assert col.n_collected == 200 and col.num_snapshots == 6 and col.deviations.shape == (6, d)
    sub = subspaces.pca(col, rank=3)
    basis, _ = torch.linalg.qr(sub.basis.double())
    assert (q - basis @ (basis.T @ q)).norm() < 1e-2
    with pytest.raises(ValueError, match="rank: 7 is larger"):
        subspaces.pca(col, rank=7)
    with pytest.raises(ValueError, match="rank: frequent directions needs"):
        SWACollector(net, method="frequent_directions")
    with pytest.raises(ValueError, match="method"):
        SWACollector(net, method="online")


@pytest.mark.parametrize("rank,snapshots", [(3, 12), (5, 5), ("mle", 12)])
def test_pca_from_the_gram_matrix_equals_the_svd_block_by_block(rank, snapshots, monkeypatch):
    """Where ``M <= K + 10`` (and for ``"mle"``) the basis comes from the ``(M, M)`` Gram
    matrix of the deviations, block by block over the weights: it equals scikit-learn's
    ``randomized_svd`` (the other route, exact there: its sketch spans every snapshot) and the
    dense SVD, signs included, with blocks of a few weights as with one block."""
    from sklearn.utils.extmath import randomized_svd

    module = importlib.import_module("pyro_subspace.subspaces.pca")  # not the function pca
    net = small_net()
    col = SWACollector(net, max_snapshots=snapshots)
    d = col.flat.num_weights
    planted = torch.randn(d, 4, dtype=torch.float64) * torch.tensor([3.0, 2.0, 1.0, 0.5]).double()
    run_trajectory(net, col, planted, steps=snapshots + 4, noise=0.05)
    dev = col.covariance_factor().double().numpy()
    whole = subspaces.pca(col, rank=rank)
    k = whole.rank
    _, s, vt = randomized_svd(dev, k, random_state=0)
    want = torch.from_numpy(vt.T * s)
    scale = float(want.abs().max())
    assert float((whole.basis.double() - want).abs().max()) < 1e-5 * scale  # float32 basis
    u, s_dense, _ = np.linalg.svd(dev, full_matrices=False)
    signs = np.sign(u[np.abs(u).argmax(0), range(u.shape[1])])  # the convention, from the SVD
    dense = torch.from_numpy((dev.T @ (u * signs))[:, :k])
    assert float((whole.basis.double() - dense).abs().max()) < 1e-5 * scale
    monkeypatch.setattr(module, "GRAM_BLOCK_NUMBERS", 3 * snapshots)  # blocks of 3 weights
    blocks = subspaces.pca(col, rank=rank)
    assert float((blocks.basis.double() - whole.basis.double()).abs().max()) < 1e-6 * scale
