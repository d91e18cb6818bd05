"""Every entry point that takes (x, y) tensors gives the same numbers from a Dataset/DataLoader.

The streamed paths read the same rows in chunks, so they differ from the in-memory ones only
in the order of float64 sums: relative tolerance 1e-10 (ESS chains: identical decisions, so
equal to the same rounding).
"""

import copy

import pyro
import pytest
import torch
from pyro.infer import MCMC
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import (
    EllipticalSliceSampler,
    SubspaceNet,
    fit_map,
    likelihoods,
    subspaces,
)
from pyro_subspace.curvature import ggn_diagonal, ggn_in_subspace, ggn_vector_product
from pyro_subspace.infer import AutoSubspaceLaplace, MixtureOfLaplace

TOL = 1e-10


def setup():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(40, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    return net, x, y, DataLoader(TensorDataset(x, y), batch_size=7)


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|``."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def same(a, b):
    err = rel_err(a, b)
    assert err < TOL, err


def test_curvature_and_selection_stream():
    net, x, y, loader = setup()
    lik = likelihoods.Gaussian(0.3)
    v = torch.randn(sum(p.numel() for p in net.parameters()), dtype=torch.float64)
    same(ggn_vector_product(net, lik, loader, v, chunk_size=5), ggn_vector_product(net, lik, x, v))
    same(ggn_diagonal(net, lik, TensorDataset(x, y)), ggn_diagonal(net, lik, x))
    sel = subspaces.subnetwork(net, 5, strategy="diag_laplace", likelihood=lik, x=loader)
    ref = subspaces.subnetwork(net, 5, strategy="diag_laplace", likelihood=lik, x=x)
    assert torch.equal(sel.basis, ref.basis)
    same(ggn_in_subspace(net, lik, loader, ref), ggn_in_subspace(net, lik, x, ref))
    a = subspaces.ggn_eigen(net, lik, loader, 3, num_iter=12)
    b = subspaces.ggn_eigen(net, lik, x, 3, num_iter=12)
    same(a.eigenvalues, b.eigenvalues)
    same(a.basis, b.basis)


def test_laplace_ess_and_mola_stream():
    net, x, y, loader = setup()
    lik = likelihoods.Gaussian(0.3)
    sub = subspaces.subnetwork(net, strategy="indices", indices=[0, 4, 9, 20, 30])
    results, maps = [], []
    for data in ((x, y), (loader, None)):
        model = SubspaceNet(net, sub, lik, prior_scale=1.5)
        guide = AutoSubspaceLaplace(model).fit(*data, find_map=False)
        evidence = guide.log_marginal_likelihood().detach()
        map_guide = AutoSubspaceLaplace(model).fit(*data)  # L-BFGS: agrees to its tolerance
        pyro.set_rng_seed(3)
        mcmc = MCMC(EllipticalSliceSampler(model), 30, 10, disable_progbar=True)
        mcmc.run(*[d for d in data if d is not None])
        mola = MixtureOfLaplace([net, copy.deepcopy(net)], lik).fit(*data)
        results.append((guide.covariance, evidence, mcmc.get_samples()["t"], mola.log_evidences))
        maps.append(map_guide)
    for a, b in zip(*results, strict=True):
        same(a, b)
    # L-BFGS also stops when the loss changes by < 1e-15 (AutoSubspaceLaplace.fit): near a
    # quadratic minimum that leaves ‖Δt‖ ~ sqrt(2·1e-15·λ_max(Σ)) per run; 10x margin
    cov = maps[1].covariance
    bound = 10 * (2e-15 * torch.linalg.eigvalsh(cov)[-1]).sqrt()
    assert (maps[0].loc - maps[1].loc).norm() <= bound


def test_fit_map_streams():
    net, x, y, _ = setup()
    nets = [copy.deepcopy(net) for _ in range(2)]
    lik = likelihoods.Gaussian(0.3)
    h1 = fit_map(nets[0], lik, x, y, epochs=5, progress=False)  # full batch
    h2 = fit_map(nets[1], lik, TensorDataset(x, y), epochs=5, progress=False)
    assert rel_err(h2, h1) < TOL  # the streamed full batch is the tensor fit
    for p, q in zip(nets[1].parameters(), nets[0].parameters(), strict=True):
        assert rel_err(p.detach(), q.detach()) < TOL


def test_patched_net_fit_streams():
    """Full batch, a Dataset gives the tensor fit in both methods (the same draws; only the
    order of the rows inside the batch differs: the DataLoader shuffles with its own draws);
    bad targets in a DataLoader are named, and the failed fit leaves the model unchanged."""
    from pyro_subspace import PatchedNet

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(48, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (48,), generator=gen)

    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
        return PatchedNet(net.double(), likelihoods.Categorical(), mode="ecmp")

    for method in ("torch", "svi"):
        models, histories = [make(), make()], []
        for model, data in zip(models, [(x, y), (TensorDataset(x, y), None)], strict=True):
            pyro.clear_param_store()
            torch.manual_seed(5)  # the patch draws
            histories.append(model.fit(*data, epochs=3, batch_size=48, seed=1, method=method))
        same(histories[1], histories[0])
        for (k, p), q in zip(models[1].state_dict().items(), models[0].state_dict().values()):
            if p.is_floating_point():
                same(p, q)
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = DataLoader(TensorDataset(x, y + 5), batch_size=16)  # class 5..7 of 3
    with pytest.raises(ValueError, match="y"):
        model.fit(loader, epochs=1)
    for k, v in model.state_dict().items():  # the failed fit left the model as it was
        assert torch.equal(v, before[k]), k


def test_iterable_streams_without_a_length():
    """A DataLoader over an iterable data set without a length: fit_map gives the fit of the
    same batches from a map-style DataLoader (same order); PatchedNet.fit, which needs N for
    eq. (7), says so by argument."""
    from torch.utils.data import IterableDataset

    from pyro_subspace import PatchedNet

    class Stream(IterableDataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __iter__(self):
            return zip(self.x, self.y)

    net, x, y, _ = setup()
    nets = [copy.deepcopy(net) for _ in range(2)]
    lik = likelihoods.Gaussian(0.3)
    h1 = fit_map(
        nets[0], lik, DataLoader(TensorDataset(x, y), batch_size=8), epochs=3, progress=False
    )
    h2 = fit_map(nets[1], lik, DataLoader(Stream(x, y), batch_size=8), epochs=3, progress=False)
    assert rel_err(h2, h1) < TOL  # the streamed full batch is the tensor fit
    for p, q in zip(nets[1].parameters(), nets[0].parameters(), strict=True):
        assert rel_err(p.detach(), q.detach()) < TOL
    model = PatchedNet(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double(), lik)
    with pytest.raises(ValueError, match="^x: PatchedNet.fit needs the number of training"):
        model.fit(DataLoader(Stream(x, y), batch_size=8), epochs=1)


def test_num_data_counts_the_rows_a_loader_yields():
    # N is what an iteration yields (counted here by iterating), not len(dataset): a dropped
    # last batch, a subset sampler and a batch sampler of the user's each change it
    from torch.utils.data import BatchSampler, SequentialSampler, SubsetRandomSampler

    from pyro_subspace.data import DataSource

    data = TensorDataset(torch.randn(40, 2), torch.randn(40))
    loaders = [
        DataLoader(data, batch_size=13, drop_last=True),
        DataLoader(data, batch_size=6, sampler=SubsetRandomSampler(range(20))),
        DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(range(33)), 7, False)),
        DataLoader(data, batch_size=9),
    ]
    for loader in loaders:
        state = torch.get_rng_state()
        n = DataSource(loader).num_data
        assert torch.equal(torch.get_rng_state(), state)  # counting draws nothing
        assert n == sum(len(b[0]) for b in loader)
