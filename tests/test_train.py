import pytest
import torch
from torch import nn

from pyro_subspace import fit_map, likelihoods, subspaces
from pyro_subspace.flat import flush_subnormal_
from pyro_subspace.validation import FINITE_BLOCK, all_finite


def ridge_problem(n=60, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = x @ torch.linspace(-1, 1, d) + 0.3 * torch.randn(n, generator=gen)
    return x, y


def test_full_batch_map_is_the_ridge_solution():
    x, y = ridge_problem()
    sigma, wd = 0.5, 0.05
    net = nn.Linear(4, 1, bias=False)
    fit_map(
        net,
        likelihoods.Gaussian(sigma),
        x,
        y,
        epochs=3000,
        lr=0.01,
        weight_decay=wd,
        progress=False,
    )
    # minimise (1/N) Σ (y − x w)² / (2σ²) + (λ/2)‖w‖²  ⇒  (XᵀX/(Nσ²) + λI) w = Xᵀy/(Nσ²)
    n = x.shape[0]
    a = x.T.double() @ x.double() / (n * sigma**2) + wd * torch.eye(4, dtype=torch.float64)
    w = torch.linalg.solve(a, x.T.double() @ y.double() / (n * sigma**2))
    assert torch.allclose(net.weight.detach().double().squeeze(0), w, atol=1e-3)


def test_learned_sigma_reaches_the_residual_mle_and_swa_collects_each_epoch():
    x, y = ridge_problem(n=200)
    net = nn.Linear(4, 1)
    lik = likelihoods.Gaussian(sigma_init=2.0)
    col = subspaces.SWACollector(net, max_snapshots=5)
    hist = fit_map(
        net,
        lik,
        x,
        y,
        epochs=1500,
        lr=0.02,
        batch_size=None,
        collector=col,
        swa_epochs=7,
        swa_lr=1e-3,
        progress=False,
        seed=0,
    )
    assert len(hist) == 1507 and col.n_collected == 7 and col.num_snapshots == 5
    resid = y - net(x).squeeze(-1).detach()
    assert abs(lik.sigma.item() - resid.pow(2).mean().sqrt().item()) < 5e-3
    assert hist[-1] < hist[0]


def test_minibatches_and_modes_are_restored():
    x, _ = ridge_problem(n=50)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    net.eval()
    labels = torch.randint(0, 3, (50,))
    hist = fit_map(
        net, likelihoods.Categorical(), x, labels, epochs=30, batch_size=16, seed=1, progress=False
    )
    assert not net.training and hist[-1] < hist[0]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"epochs": -1}, ValueError, "epochs"),
        ({"lr": 0}, ValueError, "lr"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"optimizer": "rmsprop"}, ValueError, "optimizer"),
        ({"swa_epochs": 3}, ValueError, "collector: swa_epochs > 0 needs"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay"),
    ],
)
def test_fit_map_rejects_bad_settings(kwargs, exc, match):
    x, y = ridge_problem()
    with pytest.raises(exc, match=match):
        fit_map(nn.Linear(4, 1), likelihoods.Gaussian(0.1), x, y, progress=False, **kwargs)


def test_fit_map_rejects_bad_data_and_divergence():
    x, y = ridge_problem()
    net = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="x: contains NaN"):
        fit_map(net, likelihoods.Gaussian(0.1), x * float("nan"), y, progress=False)
    with pytest.raises(ValueError, match="y: expected 60 targets"):
        fit_map(net, likelihoods.Gaussian(0.1), x, y[:10], progress=False)
    with pytest.raises(FloatingPointError, match="non-finite|loss became"):
        fit_map(net, likelihoods.Gaussian(0.1), x * 1e30, y, lr=1e10, epochs=5, progress=False)
    other = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="different network"):
        fit_map(
            net,
            likelihoods.Gaussian(0.1),
            x,
            y,
            collector=subspaces.SWACollector(other),
            swa_epochs=2,
            progress=False,
        )


def test_a_frozen_network_is_refused_before_any_work_unless_the_likelihood_learns():
    """Nothing requires grad: a ValueError naming ``net`` (not autograd's RuntimeError from
    ``backward``); a learned noise scale alone is something to train."""
    x, y = ridge_problem()
    net = nn.Linear(4, 1).requires_grad_(False)
    w = net.weight.detach().clone()
    with pytest.raises(ValueError, match="net: no parameter .* requires grad"):
        fit_map(net, likelihoods.Gaussian(0.1), x, y, epochs=2, progress=False)
    lik = likelihoods.Gaussian()  # sigma learned
    fit_map(net, lik, x, y, epochs=2, progress=False)
    assert torch.equal(net.weight, w)


def test_each_phase_uses_its_own_learning_rate():
    # Regression: optimisers write their defaults into shared param groups, so the SWA phase
    # once silently ran at the MAP phase's learning rate.
    x, y = ridge_problem()
    net = nn.Linear(4, 1)
    col = subspaces.SWACollector(net, max_snapshots=5)
    fit_map(
        net,
        likelihoods.Gaussian(0.5),
        x,
        y,
        epochs=1,
        lr=0.5,
        collector=col,
        swa_epochs=5,
        swa_lr=1e-9,
        progress=False,
    )
    assert col.deviations.abs().max() < 1e-6  # a 1e-9 step barely moves the weights


def test_swa_phase_after_zero_map_epochs_collects_every_epoch():
    """epochs=0 then swa_epochs=s (the CLI's two-call pattern) collects s snapshots."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 5), nn.ReLU(), nn.Linear(5, 1))
    x, y = torch.randn(20, 1), torch.randn(20)
    col = subspaces.SWACollector(net, max_snapshots=5)
    fit_map(net, likelihoods.Gaussian(0.5), x, y, epochs=0, collector=col, swa_epochs=3,
            swa_lr=1e-2, seed=0, progress=False)  # fmt: skip
    assert col.n_collected == 3 and col.num_snapshots == 3


def test_batchnorm_skips_a_last_minibatch_of_one_row_and_names_a_loader_that_ends_in_one():
    # N = 40 in batches of 13: 13, 13, 13 and 1; BatchNorm cannot train on the single row, so
    # each epoch takes three steps (num_batches_tracked counts the training forwards)
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40)
    for data in ((x, y), (TensorDataset(x, y), None)):
        net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        fit_map(net, likelihoods.Gaussian(0.5), *data, epochs=2, batch_size=13, progress=False)
        assert int(net[1].num_batches_tracked) == 2 * 3
    loader = DataLoader(TensorDataset(x, y), batch_size=13)
    with pytest.raises(ValueError, match="x: the DataLoader's last batch has one row"):
        fit_map(net, likelihoods.Gaussian(0.5), loader, epochs=1, progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_subnormal_weights_are_flushed_after_each_epoch_and_in_the_swa_statistics(dtype):
    """A dead unit's outgoing weight (no data gradient, so Adam leaves it where it is) that weight
    decay had made subnormal is set to 0 after an epoch of `fit_map` (the minibatch loop under
    `fit_map`, `fit_curve` and `PatchedNet.fit` flushes its optimiser's tensors: a CPU runs
    several times slower on subnormals); the SWA collector's statistics never hold one; flushing
    changes no output beyond the subnormals' own size."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)).to(dtype)
    tiny = torch.finfo(dtype).tiny
    with torch.no_grad():
        net[0].weight[0] = -1.0  # unit 0 is dead on inputs in [0, 1]
        net[0].bias[0] = -1.0
        net[2].weight[0, 0] = tiny / 8
        net[0].weight[1, 0] = tiny / 4
    x = torch.rand(16, 2, dtype=dtype)
    y = torch.randn(16, dtype=dtype)
    sub = lambda t: int(((t != 0) & (t.abs() < tiny)).sum())  # noqa: E731
    with torch.no_grad():
        before = net(x)
        flushed = [p.clone() for p in net.parameters()]
    assert flush_subnormal_(*flushed) == 2 and sum(sub(p) for p in flushed) == 0
    col = subspaces.SWACollector(net, max_snapshots=3)
    col.collect()  # a net with subnormal weights: its statistics hold none
    assert sub(col.mean) == 0 and sub(col.running_sq_mean) == 0
    torch.testing.assert_close(col.mean, torch.cat([p.reshape(-1) for p in flushed]), rtol=0, atol=0)
    fit_map(net, likelihoods.Gaussian(sigma=1.0), x, y, epochs=1, lr=1e-12, progress=False)
    assert float(net[2].weight[0, 0]) == 0.0 and sum(sub(p) for p in net.parameters()) == 0
    with torch.no_grad():
        torch.testing.assert_close(net(x), before, rtol=1e-6, atol=0)


def test_all_finite_flags_any_inf_or_nan_and_no_finite_overflow():
    """`all_finite` is False exactly when some entry of some floating-point tensor (of any dtype
    or device group) is ±inf or NaN; huge finite values, whose plain sum overflows, and integer
    tensors are fine."""
    big = torch.full((4,), torch.finfo(torch.float32).max)
    assert torch.isinf(big.sum()) and all_finite(big, torch.zeros(3, dtype=torch.float64))
    assert all_finite(torch.arange(5), torch.ones(2), None) and all_finite()
    with pytest.raises(TypeError, match="tensors: expected torch.Tensors"):
        all_finite(torch.ones(2), [1.0])
    for bad in (float("inf"), -float("inf"), float("nan")):
        for dtype in (torch.float32, torch.float64):
            t = torch.ones(7, dtype=dtype)
            t[3] = bad
            assert not all_finite(torch.ones(2), t)
            assert not all_finite(t.reshape(7, 1).expand(7, 2))  # a non-contiguous view
            assert not all_finite(t.to(torch.complex128))
    # blocks: a large tensor split by rows, many small ones flushed as full blocks; the bad
    # entry in the last row, in the last block, in a later group
    large = torch.zeros(3 * FINITE_BLOCK // 8 + 5, 8)
    small = [torch.zeros(1000) for _ in range(3 * FINITE_BLOCK // 1000)]
    assert all_finite(large, *small)
    large[-1, -1] = float("nan")
    assert not all_finite(large) and not all_finite(*small, large)
    small[-1][-1] = float("inf")
    assert not all_finite(*small) and not all_finite(*small[:-1], torch.ones(3), small[-1])
