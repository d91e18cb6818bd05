"""Degenerate work is an error or a warning, never a success; a keyword the chosen method
does not use is an error, never silently ignored.

Each case went through silently before: a minibatch fit whose every batch was skipped
returned a loss of 0.0 having trained nothing; a PCA of a trajectory that never moved
returned a basis of float32 rounding noise (``rank="mle"`` too); ``n_params``/``strategy``
without a subnetwork, ``optimize_sigma`` with the grid method and validation data with the
evidence were accepted and ignored."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pyro_subspace import fit_map, likelihoods, subspaces
from pyro_subspace.infer import Laplace, MixtureOfLaplace
from pyro_subspace.subspaces import SWACollector

from test_laplace_front import classifier
from test_subspaces import run_trajectory, small_net


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def test_a_fit_whose_every_minibatch_is_skipped_is_an_error_before_any_step():
    net, x, y = _bn_net(), torch.randn(20, 3), torch.randn(20)
    before = [p.detach().clone() for p in net.parameters()]
    # BatchNorm in training mode needs two points: minibatches of one are skipped, all of them
    with pytest.raises(ValueError, match="batch_size: .*nothing would be trained"):
        fit_map(net, likelihoods.Gaussian(0.5), x, y, epochs=3, batch_size=1, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    # batch_size=2 trains: the loss is the data's, not 0.0
    history = fit_map(net, likelihoods.Gaussian(0.5), x, y, epochs=3, batch_size=2, progress=False)
    assert min(history) > 0


def test_an_epoch_with_no_step_is_an_error_not_a_zero_loss():
    from pyro_subspace.minibatch import loader_loop

    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 3)))
    with pytest.raises(ValueError, match="x: .*took no step in epoch 1"):
        loader_loop(lambda xb: xb.sum(), empty, 2, None, lambda e, v: None, "fit_map")


def test_pca_of_a_trajectory_that_never_moved_is_an_error():
    net = small_net()
    col = SWACollector(net, max_snapshots=10)
    for _ in range(10):  # the same weights each time: the deviations are rounding noise
        col.collect()
    assert float(col.deviations.abs().max()) > 0  # the running mean's float32 rounding
    for rank in (2, "mle"):
        with pytest.raises(ValueError, match="collector: the collected weights did not move"):
            subspaces.pca(col, rank=rank)


def test_pca_warns_when_the_rank_exceeds_the_directions_moved():
    net = small_net()
    col = SWACollector(net, max_snapshots=20)
    d = col.flat.num_weights
    run_trajectory(net, col, torch.randn(d, 2, dtype=torch.float64), steps=20)  # 2 directions
    with pytest.warns(UserWarning, match="moved in 2 direction"):
        subspaces.pca(col, rank=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert subspaces.pca(col, rank=2).rank == 2
        assert subspaces.pca(col, rank="mle").rank <= 2


def test_laplace_refuses_subnetwork_keywords_without_a_subnetwork():
    net, *_ = classifier()
    lik = likelihoods.Categorical()
    for kw in ({"n_params": 5}, {"strategy": "random"}):
        with pytest.raises(TypeError, match=f"{next(iter(kw))}: only used with .*'subnetwork'"):
            Laplace(net, lik, "last_layer", **kw)
        with pytest.raises(TypeError, match=f"{next(iter(kw))}: only used"):
            Laplace(net, lik, torch.arange(3), **kw)


def test_tuning_refuses_keywords_its_method_does_not_use():
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=0.7, hessian_structure="full").fit(x, y)
    lam = float(la.prior_precision)
    cases = [
        ("grid", {"x_val": x, "y_val": y, "optimize_sigma": True}, "optimize_sigma: not used"),
        ("grid", {"x_val": x, "y_val": y, "max_iter": 5}, "max_iter: not used"),
        ("marglik", {"x_val": x, "y_val": y}, "x_val: not used"),
        ("marglik", {"grid": [1.0, 2.0]}, "grid: not used"),
    ]
    for method, kw, match in cases:
        with pytest.raises(TypeError, match=match):
            la.optimize_prior_precision(method, **kw)
    with pytest.raises(ValueError, match="max_iter: expected an int >= 1"):
        la.optimize_prior_precision("marglik", max_iter=0)
    with pytest.raises(ValueError, match="optimize_sigma: the Categorical likelihood has no"):
        la.optimize_prior_precision("marglik", optimize_sigma=True)
    assert float(la.prior_precision) == lam  # nothing was tuned
    nets = [classifier(s)[0] for s in range(2)]
    mola = MixtureOfLaplace(nets, likelihoods.Categorical()).fit(x, y)
    with pytest.raises(TypeError, match="x_val: not used by method='marglik'"):
        mola.optimize_prior_precision("marglik", x_val=x, y_val=y)
    with pytest.raises(TypeError, match="threshold: not used by method='grid'"):
        mola.optimize_prior_precision("grid", x_val=x, y_val=y, threshold=0.9)


def test_an_ensemble_of_one_network_is_an_error_before_any_training():
    from pyro_subspace.infer import train_ensemble

    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    shared = nn.Linear(3, 2)
    before = shared.weight.detach().clone()
    with pytest.raises(ValueError, match="make_net: members 0 and 1 share parameters"):
        train_ensemble(lambda: shared, likelihoods.Categorical(), x, y, n_members=2, epochs=1,
                       progress=False)  # fmt: skip
    assert torch.equal(shared.weight, before)  # nothing trained
    body = nn.Linear(3, 4)  # a shared layer is the same mistake
    with pytest.raises(ValueError, match="share parameters"):
        train_ensemble(lambda: nn.Sequential(body, nn.Linear(4, 2)), likelihoods.Categorical(),
                       x, y, n_members=2, epochs=1, progress=False)  # fmt: skip
