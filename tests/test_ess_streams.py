"""The one elliptical slice kernel: both configurations keep the random streams of the two
kernels it replaced (draws pinned from them), the deprecated alias, the choice of stream, and
the step function's state and info record."""

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces
from pyro_subspace.infer import EllipticalSliceSampler, GeneralizedEllipticalSliceSampler
from pyro_subspace.infer.ess import (
    ChainReference,
    SliceInfo,
    SliceState,
    elliptical_slice_step,
)
from pyro_subspace.subspaces import Subspace

f64 = torch.float64
SIGMA, PRIOR = 0.5, 1.5


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=gen, dtype=f64)
    y = x @ torch.tensor([1.0, -0.5, 0.25], dtype=f64)
    return x, y + SIGMA * torch.randn(40, generator=gen, dtype=f64)


def linear(temperature):
    x, y = data()
    net = nn.Linear(3, 1, bias=False).double()
    sub = Subspace(torch.zeros(3, dtype=f64), torch.eye(3, dtype=f64))
    lik = likelihoods.Gaussian(SIGMA)
    return SubspaceNet(net, sub, lik, prior_scale=PRIOR, temperature=temperature), x, y


def float32_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    model = SubspaceNet(net, subspaces.random(net, 3, seed=0), likelihoods.Gaussian(0.3))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 2, generator=gen)
    return model, x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(50, generator=gen)


def conjugate():
    x, y = data()
    prior = dist.Normal(torch.zeros(3, dtype=f64), PRIOR * torch.ones(3, dtype=f64)).to_event(1)
    return prior, lambda t: -0.5 * ((t @ x.T - y) ** 2).sum(-1) / SIGMA**2


@pytest.fixture(autouse=True)
def _sequential_chains(monkeypatch):
    """Pyro's driver runs chains in worker processes (each seeded by Pyro) when the machine has
    more cores than chains; the pinned draws are those of chains run in this process."""
    from pyro.infer.mcmc import api

    monkeypatch.setattr(api.mp, "cpu_count", lambda: 1)


def first_and_last(kernel, *args, samples=10, warmup=5, chains=1, seed=0):
    """Chain 0's first draw and the last chain's last draw of a fixed-seed run."""
    pyro.set_rng_seed(seed)
    mcmc = MCMC(
        kernel, num_samples=samples, warmup_steps=warmup, num_chains=chains, disable_progbar=True
    )
    mcmc.run(*args)
    t = mcmc.get_samples(group_by_chain=True)["t"].double()
    return t[0, 0], t[-1, -1]


def _run(name):
    """The fixed-seed run ``name`` of `PINNED`: ``(chain 0's first draw, last chain's last)``."""
    prior, loglik = conjugate()
    if name == "plain_subspace_net":  # rng="global": torch's global generator
        model, x, y = linear(2.0)
        return first_and_last(EllipticalSliceSampler(model), x, y, chains=2)
    if name == "plain_float32_net":
        model, x, y = float32_net()
        return first_and_last(EllipticalSliceSampler(model, chunk_size=16), x, y, seed=3)
    if name == "plain_prior_and_loglik":
        kernel = EllipticalSliceSampler(prior=prior, log_likelihood=lambda t: float(loglik(t)))
        return first_and_last(kernel, seed=6)
    if name == "chains_warmup_refit":  # rng="chains": a NumPy generator per chain
        kernel = EllipticalSliceSampler(
            prior=prior, log_likelihood=loglik, reference="warmup", chains=4, seed=2
        )
        return first_and_last(kernel, warmup=60, chains=4)
    if name == "chains_t_reference":
        reference = (torch.tensor([1.0, -0.5, 0.25], dtype=f64), 0.01 * torch.eye(3, dtype=f64))
        kernel = EllipticalSliceSampler(
            prior=prior, log_likelihood=loglik, reference=reference, df=4, chains=3, seed=7
        )
        return first_and_last(kernel, chains=3)
    if name == "chains_laplace_net":
        model, x, y = linear(2.0)
        kernel = EllipticalSliceSampler(model, reference="laplace", chains=2, seed=5)
        return first_and_last(kernel, x, y, chains=2)
    assert name == "chains_prior_global_seed"  # per-chain seeds drawn from torch's generator
    kernel = EllipticalSliceSampler(
        prior=prior, log_likelihood=loglik, reference="prior", rng="chains"
    )
    return first_and_last(kernel, seed=8)


#: computed with the two former kernels (ess.py's EllipticalSliceSampler and gess.py's
#: GeneralizedEllipticalSliceSampler) before they became one
PINNED = {
    "plain_subspace_net": (
        [0.16543047972795139, -0.9419587244498095, -0.2371914040965884],
        [0.9740429004335268, -0.3951315482460941, 0.14681971921532555],
    ),
    "plain_float32_net": (
        [-0.3297833204269409, -0.3218642473220825, -0.7040687799453735],
        [-0.3870943784713745, -0.26038870215415955, -0.9213165044784546],
    ),
    "plain_prior_and_loglik": (
        [0.5637382333154723, -0.2250582625538855, -0.19295623755457914],
        [0.9038620016184394, -0.6074429580615925, 0.08025104267804567],
    ),
    "chains_warmup_refit": (
        [1.0399518326443278, -0.4886724062560822, 0.31218785776168867],
        [1.048902575124374, -0.5775674280236929, 0.2518879892613255],
    ),
    "chains_t_reference": (
        [0.8384081459611132, -0.4054140600334683, 0.1569437790400855],
        [1.1037052745440603, -0.6511533477969236, 0.3738361185525918],
    ),
    "chains_laplace_net": (
        [1.0441041477515636, -0.5909617951018254, 0.36607766183594226],
        [0.8956299541046807, -0.26801450072026023, 0.19281613889757607],
    ),
    "chains_prior_global_seed": (
        [1.185304022459067, -0.5536665791427596, 1.0077630372133868],
        [0.878554942462282, -0.41118872925703154, 0.546264212100624],
    ),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_both_configurations_reproduce_the_former_kernels_draws(name):
    first, last = _run(name)
    want_first, want_last = (torch.tensor(v, dtype=f64) for v in PINNED[name])
    torch.testing.assert_close(first, want_first, rtol=0, atol=1e-12)
    torch.testing.assert_close(last, want_last, rtol=0, atol=1e-12)


def test_the_former_name_warns_and_draws_what_the_new_spelling_draws():
    prior, loglik = conjugate()
    with pytest.warns(DeprecationWarning, match="GeneralizedEllipticalSliceSampler.*deprecated"):
        old = GeneralizedEllipticalSliceSampler(
            prior=prior, log_likelihood=loglik, chains=4, seed=2
        )
    assert isinstance(old, EllipticalSliceSampler) and old.rng == "chains"
    assert old.reference == "warmup" and old.adapt  # its former defaults
    first, last = first_and_last(old, warmup=60, chains=4)
    want_first, want_last = (torch.tensor(v, dtype=f64) for v in PINNED["chains_warmup_refit"])
    torch.testing.assert_close(first, want_first, rtol=0, atol=1e-12)
    torch.testing.assert_close(last, want_last, rtol=0, atol=1e-12)
    from pyro_subspace.infer import gess

    assert gess.GeneralizedEllipticalSliceSampler is GeneralizedEllipticalSliceSampler
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new name does not warn
        EllipticalSliceSampler(prior=prior, log_likelihood=loglik, reference="warmup")


def test_the_random_stream_follows_the_configuration():
    model = linear(1.0)[0]
    assert EllipticalSliceSampler(model).rng == "global"
    for options in ({"reference": "laplace"}, {"seed": 0}, {"chains": 2}, {"df": 3}):
        assert EllipticalSliceSampler(model, **options).rng == "chains", options
    assert EllipticalSliceSampler(model, rng="chains").rng == "chains"
    with pytest.raises(ValueError, match="rng: 'global'"):
        EllipticalSliceSampler(model, reference="laplace", rng="global")
    with pytest.raises(ValueError, match="rng: expected one of"):
        EllipticalSliceSampler(model, rng="numpy")

    def pyro_model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    EllipticalSliceSampler(pyro_model)  # any Pyro model: the plain configuration
    with pytest.raises(TypeError, match="model: expected a SubspaceNet"):
        EllipticalSliceSampler(pyro_model, chains=2)


def test_info_record_counts_the_evaluations_of_both_configurations():
    prior, loglik = conjugate()
    plain = EllipticalSliceSampler(prior=prior, log_likelihood=lambda t: float(loglik(t)))
    plain.setup(0)
    params = plain.initial_params
    for _ in range(5):
        before = plain._evals
        params = plain.sample(params)
        info = plain.last_info
        assert isinstance(info, SliceInfo) and info.shrinks.shape == (1,)
        assert plain._evals - before == int(info.shrinks[0]) + 1
        assert -2 * math.pi < info.angle[0] < 2 * math.pi
    kern = EllipticalSliceSampler(prior=prior, log_likelihood=loglik, chains=3, seed=0)
    kern.setup(0)
    params, evals, passes = kern.initial_params, np.zeros(3, dtype=np.int64), 0
    for _ in range(5):
        params = kern.sample(params)
        evals += kern.last_info.shrinks + 1
        passes += int(kern.last_info.shrinks.max()) + 1
    assert kern.diagnostics()["evaluations per draw"] == evals[0] / 5
    assert kern.diagnostics()["passes per draw"] == passes / 5


def test_the_step_function_alone():
    """A flat likelihood accepts the first point of every ellipse, at φ = 2π v; a likelihood that
    is -inf everywhere raises after max_shrinks."""
    ref = ChainReference(torch.zeros(2, dtype=f64), torch.eye(2, dtype=f64), None, [0, 1, 2, 3])
    x = np.ones((4, 2))
    state = SliceState(x, -0.5 * (x**2).sum(-1))  # log π = log N(0, I): L̃ = 1

    def flat(t, rows):
        return -0.5 * (t**2).sum(-1)

    new, info = elliptical_slice_step(state, ref, flat)
    assert (info.shrinks == 0).all() and ((info.angle >= 0) & (info.angle < 2 * math.pi)).all()
    assert not np.allclose(new.position, x)
    np.testing.assert_array_equal(new.log_likelihood, flat(new.position, None))
    with pytest.raises(RuntimeError, match="no acceptable point after 7 bracket shrinkages"):
        elliptical_slice_step(state, ref, lambda t, rows: np.full(len(rows), -np.inf), 7)


def test_batched_chains_with_recomputed_batchnorm_evaluate_point_by_point_and_restore_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
    net.train()
    for _ in range(3):
        net(torch.randn(32, 2))
    saved = [b.clone() for b in net.buffers()]
    model = SubspaceNet(net, subspaces.random(net, 2, seed=0), likelihoods.Gaussian(0.5))
    x, y = torch.randn(40, 2), torch.randn(40)
    kern = EllipticalSliceSampler(model, chunk_size=16, recompute_bn=True, chains=2, seed=0)
    mcmc = MCMC(kern, num_samples=4, warmup_steps=2, num_chains=2, disable_progbar=True)
    mcmc.run(x, y)
    assert torch.isfinite(mcmc.get_samples()["t"]).all()
    t = torch.randn(3, 2)
    batch = kern._batch.loglik(t)
    one = [kern.log_likelihood({"t": row}) for row in t]
    torch.testing.assert_close(batch, torch.tensor(one, dtype=f64))
    assert all(torch.equal(a, b) for a, b in zip(saved, net.buffers()))
