"""Run by tests/test_trust_state.py in two fresh processes: prints one hash per method.

Only ``torch.manual_seed`` is called (once per method); every library call is seedless.
"""

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
warnings.simplefilter("ignore")

import pyro
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

from pyro_subspace import (
    EllipticalSliceSampler,
    PatchedNet,
    SubspaceNet,
    fit_map,
    likelihoods,
    subspaces,
)
from pyro_subspace.infer import AutoSubspaceLaplace, MixtureOfLaplace


def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def setup():
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1))
    x = torch.randn(20, 3)
    y = x[:, 0].sin() + 0.1 * torch.randn(20)
    return net, x, y


def trained():
    net, x, y = setup()
    fit_map(net, likelihoods.Gaussian(0.3), x, y, epochs=3, batch_size=8, progress=False)
    return net, x, y


def subspace_model():
    net, x, y = trained()
    return SubspaceNet(net, subspaces.random(net, 2), likelihoods.Gaussian(0.3)), x, y


def case_fit_map():
    net, _, _ = trained()
    return digest(*net.parameters())


def case_ess():
    model, x, y = subspace_model()
    mcmc = MCMC(EllipticalSliceSampler(model), 10, 5, disable_progbar=True)
    mcmc.run(x, y)
    return digest(mcmc.get_samples()["t"])


def case_nuts():
    model, x, y = subspace_model()
    mcmc = MCMC(NUTS(model), 5, 5, disable_progbar=True)
    mcmc.run(x, y)
    return digest(mcmc.get_samples()["t"])


def case_svi():
    model, x, y = subspace_model()
    guide = AutoNormal(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(5):
        svi.step(x, y)
    return digest(*[p for _, p in sorted(pyro.get_param_store().named_parameters())])


def case_laplace():
    model, x, y = subspace_model()
    guide = AutoSubspaceLaplace(model, prior_precision=1.0).fit(x, y, find_map=False)
    return digest(guide.sample_weights(5))


def case_patched():
    net, x, y = setup()
    pnet = PatchedNet(net, likelihoods.Gaussian(0.3), mode="ensemble", n_components=2)
    pnet.fit(x, y, epochs=2, batch_size=8)
    return digest(pnet.predictive_mean(x, num_samples=3))


def case_mola():
    nets = [trained()[0] for _ in range(2)]
    _, x, y = setup()
    mola = MixtureOfLaplace(nets, likelihoods.Gaussian(0.3)).fit(x, y)
    weights, comp = mola.components(x, method="sample", num_samples=3)
    return digest(weights, *(comp if isinstance(comp, tuple) else (comp,)))


for case in (case_fit_map, case_ess, case_nuts, case_svi, case_laplace, case_patched, case_mola):
    pyro.clear_param_store()
    torch.manual_seed(0)
    print(case.__name__, case())
