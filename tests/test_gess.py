"""GeneralizedEllipticalSliceSampler against closed-form Gaussian posteriors, with right and
deliberately wrong references; invariance and reversibility of one transition; batched chains
equal to chains run one at a time; reproducibility."""

import arviz as az
import pyro.distributions as dist
import pytest
import torch
from conftest import conjugate_posterior
from pyro.infer import MCMC
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods
from pyro_subspace.infer import AutoSubspaceLaplace, GeneralizedEllipticalSliceSampler
from pyro_subspace.subspaces import Subspace

# the generalised configuration under its former, deprecated name (kept for one release; the
# warning itself is tested in test_ess_streams.py)
pytestmark = pytest.mark.filterwarnings(
    "ignore:GeneralizedEllipticalSliceSampler is deprecated:DeprecationWarning"
)

SIGMA, PRIOR, N, K = 0.5, 1.5, 40, 3
f64 = torch.float64


def problem(temperature=1.0):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, K, generator=gen, dtype=f64)
    y = x @ torch.tensor([1.0, -0.5, 0.25], dtype=f64)
    y = y + SIGMA * torch.randn(N, generator=gen, dtype=f64)
    prior = dist.Normal(torch.zeros(K, dtype=f64), PRIOR * torch.ones(K, dtype=f64)).to_event(1)

    def loglik(t):  # (B, K) -> (B,), tempered, closed form
        return -0.5 * ((t @ x.T - y) ** 2).sum(-1) / (SIGMA**2 * temperature)

    mean, cov = conjugate_posterior(x, y, SIGMA, PRIOR, temperature)
    return x, y, prior, loglik, mean, cov


def kernel(reference, **kwargs):
    _, _, prior, loglik, _, _ = problem()
    return GeneralizedEllipticalSliceSampler(
        prior=prior, log_likelihood=loglik, reference=reference, **kwargs
    )


def run(kern, *args, samples=1000, warmup=100, chains=4):
    mcmc = MCMC(
        kern, num_samples=samples, warmup_steps=warmup, num_chains=chains, disable_progbar=True
    )
    mcmc.run(*args)
    return mcmc


def assert_matches_gaussian(by_chain, mean, cov):
    """Mean and covariance within 4.5 Monte Carlo standard errors, from ArviZ's ESS."""
    idata = az.from_dict(posterior={"t": by_chain.numpy()})
    assert float(az.rhat(idata)["t"].max()) < 1.05  # a sanity check; the test is below
    # the smaller of bulk and tail ESS: a variance estimate depends on the tails
    ess = min(float(az.ess(idata, method=m)["t"].min()) for m in ("bulk", "tail"))
    samples = by_chain.reshape(-1, by_chain.shape[-1])
    emp_mean, emp_cov = samples.mean(0), torch.cov(samples.T)
    assert ((emp_mean - mean).abs() <= 4.5 * (cov.diagonal() / ess).sqrt()).all(), (emp_mean, mean)
    var = cov.diagonal()
    se = ((var[:, None] * var[None, :] + cov**2) / ess).sqrt()
    assert ((emp_cov - cov).abs() <= 4.5 * se).all(), (emp_cov, cov)


def wrong_references():
    _, _, _, _, mean, cov = problem()
    sd = cov.diagonal().sqrt()
    return {
        "shifted": (mean + sd, cov),
        "too narrow": (mean, cov / 2),
        "too wide": (mean, 25 * cov),
        "far shifted": (mean + 3 * sd, cov),
        "far too narrow": (mean, cov / 4),  # a Gaussian reference mixes badly: needs df
    }


@pytest.mark.parametrize(
    "name, df",
    [
        ("shifted", None),
        ("too narrow", None),
        ("too wide", None),
        ("far shifted", 4),
        ("far shifted", 4.5),  # a real ν: χ²_{ν+K} drawn as 2 Gamma((ν + K)/2)
    ],
)
def test_wrong_fixed_reference_still_samples_the_posterior(name, df):
    *_, mean, cov = problem()
    kern = kernel(wrong_references()[name], df=df, adapt=False, chains=4, seed=11)
    mcmc = run(kern, samples=800)
    assert_matches_gaussian(mcmc.get_samples(group_by_chain=True)["t"], mean, cov)


@pytest.mark.parametrize("df", [None, 5])
def test_adapted_reference_from_warmup_needs_fewer_evaluations_than_plain_ess(df):
    *_, mean, cov = problem()
    mcmc = run(kernel("warmup", df=df, chains=4, seed=3), samples=1000, warmup=200)
    assert_matches_gaussian(mcmc.get_samples(group_by_chain=True)["t"], mean, cov)
    plain = run(kernel("prior", chains=4, seed=3), samples=300, warmup=0)  # plain ESS
    evals = sum(mcmc.diagnostics()["evaluations per draw"].values())
    assert 4 <= evals < sum(plain.diagnostics()["evaluations per draw"].values())


def subspace_model(temperature):
    x, y, *_ = problem()
    net = nn.Linear(K, 1, bias=False).double()
    sub = Subspace(torch.zeros(K, dtype=f64), torch.eye(K, dtype=f64))
    lik = likelihoods.Gaussian(SIGMA)
    model = SubspaceNet(net, sub, lik, prior_scale=PRIOR, temperature=temperature)
    return model, x, y


@pytest.mark.parametrize("reference", ["laplace", "guide"])
def test_subspace_net_posterior_with_laplace_and_prior_references(reference):
    model, x, y = subspace_model(temperature=2.0)
    mean, cov = conjugate_posterior(x, y, SIGMA, PRIOR, temperature=2.0)
    if reference == "guide":
        reference = AutoSubspaceLaplace(model).fit(x, y)
        # linear-Gaussian: the Laplace guide is the posterior (dense algebra, independent)
        torch.testing.assert_close(reference.loc, mean)
    kern = GeneralizedEllipticalSliceSampler(model, reference=reference, chains=2, seed=5)
    mcmc = run(kern, x, y, samples=600, chains=2)
    assert_matches_gaussian(mcmc.get_samples(group_by_chain=True)["t"], mean, cov)


@pytest.mark.parametrize(
    "name, df", [("far shifted", None), ("too narrow", None), ("far too narrow", 4)]
)
def test_one_transition_leaves_the_posterior_invariant_and_is_reversible(name, df):
    """Start 1500 independent chains (one batch) at exact posterior draws, take one transition
    each: the new states are again posterior draws, and (x, x') is exchangeable (detailed balance):
    E[x x'ᵀ] = E[x' xᵀ] (Gaussian reference; with df the scale draw and the slice step compose
    to an invariant but not reversible kernel), within Monte Carlo error of 1500 pairs. This
    also covers references too poor to mix well enough for the long-run tests above."""
    *_, mean, cov = problem()
    n = 1500
    gen = torch.Generator().manual_seed(1)
    start = mean + torch.randn(n, K, generator=gen, dtype=f64) @ torch.linalg.cholesky(cov).T
    kern = kernel(wrong_references()[name], df=df, adapt=False, chains=n, seed=2)
    kern.initial_params = {"t": start}  # all n chains start at once
    nxt = []
    for _ in range(n):  # Pyro's driver: chain c's setup, then its transition
        kern.setup(0)
        nxt.append(kern.sample(kern.initial_params)["t"])
        kern.cleanup()
    nxt = torch.stack(nxt)
    assert not torch.equal(nxt, start)
    sd = cov.diagonal().sqrt()
    assert ((nxt.mean(0) - mean).abs() <= 4.5 * sd / n**0.5).all()
    var = cov.diagonal()
    se = ((var[:, None] * var[None, :] + cov**2) / n).sqrt()
    assert ((torch.cov(nxt.T) - cov).abs() <= 4.5 * se).all()
    if df is not None:
        return
    a, b = start - mean, nxt - mean
    cross = a.T @ b / n  # E[x x'ᵀ]; detailed balance makes it symmetric
    prod = a[:, :, None] * b[:, None, :] - b[:, :, None] * a[:, None, :]
    se_asym = prod.std(0) / n**0.5
    assert ((cross - cross.T).abs() <= 4.5 * se_asym + 1e-12).all()


@pytest.mark.parametrize("df", [None, 3])
def test_batched_chains_equal_chains_run_one_at_a_time(df):
    """With a fixed reference; an adapted one is refitted from the batch's pooled draws."""
    ref = wrong_references()["shifted"]
    batched = run(kernel(ref, df=df, chains=3, seed=7), samples=150, warmup=60, chains=3)
    separate = run(kernel(ref, df=df, seed=7), samples=150, warmup=60, chains=3)
    one_by_one = torch.stack(
        [
            run(k, samples=150, warmup=60, chains=1).get_samples()["t"]
            for k in [kernel(ref, df=df, seed=7)]
            for _ in range(3)
        ]
    )
    b = batched.get_samples(group_by_chain=True)["t"]
    s = separate.get_samples(group_by_chain=True)["t"]
    torch.testing.assert_close(b, s, rtol=0, atol=1e-12)
    torch.testing.assert_close(b, one_by_one, rtol=0, atol=1e-12)
    evals = batched.diagnostics()["evaluations per draw"]
    assert evals == separate.diagnostics()["evaluations per draw"]
    assert not torch.equal(b[0], b[1])  # the chains are distinct


def test_reproducible_with_torch_manual_seed():
    draws = []
    for seed in (4, 4, 5):
        torch.manual_seed(seed)
        mcmc = run(kernel("warmup", chains=2), samples=50, warmup=30, chains=2)
        draws.append(mcmc.get_samples()["t"])
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


def test_bad_arguments_are_named():
    _, _, prior, loglik, *_ = problem()
    with pytest.raises(TypeError, match="model"):
        GeneralizedEllipticalSliceSampler()
    with pytest.raises(TypeError, match="model"):
        GeneralizedEllipticalSliceSampler(lambda: None)
    with pytest.raises(ValueError, match="reference"):
        GeneralizedEllipticalSliceSampler(prior=prior, log_likelihood=loglik, reference="nope")
    for df in (0, -1.5, True, "5"):  # a real ν > 0 is a t reference (2.5 too, since issue 34)
        with pytest.raises(ValueError, match="df: expected None"):
            GeneralizedEllipticalSliceSampler(prior=prior, log_likelihood=loglik, df=df)
    with pytest.raises(TypeError, match="adapt"):
        GeneralizedEllipticalSliceSampler(prior=prior, log_likelihood=loglik, adapt="yes")
    with pytest.raises(ValueError, match="chains"):
        GeneralizedEllipticalSliceSampler(prior=prior, log_likelihood=loglik, chains=0)
    bad = GeneralizedEllipticalSliceSampler(
        prior=prior, log_likelihood=loglik, reference=(torch.zeros(2), torch.eye(2))
    )
    with pytest.raises(ValueError, match="reference"):
        bad.setup(0)
    with pytest.raises(TypeError, match="reference"):
        GeneralizedEllipticalSliceSampler(prior=prior, log_likelihood=loglik, reference=3).setup(0)


def test_t_reference_log_density_matches_scipy():
    """``log R`` of the multivariate-t reference (up to a constant) against scipy."""
    from scipy.stats import multivariate_t

    *_, mean, cov = problem()
    kern = kernel((mean, cov), df=4, chains=2, seed=0)
    kern.setup(0)
    batch = kern._batch
    pts = torch.randn(6, K, generator=torch.Generator().manual_seed(3), dtype=f64).numpy()
    ours = batch._log_reference(pts, torch.zeros(6, dtype=torch.long).numpy())
    ref = multivariate_t(loc=mean.numpy(), shape=cov.numpy(), df=4).logpdf(pts)
    torch.testing.assert_close(
        torch.from_numpy(ours - ours[0]), torch.from_numpy(ref - ref[0]), rtol=0, atol=1e-10
    )


def test_pooled_refit_is_the_moments_of_all_chains_later_warmup_draws():
    """After warm-up every chain's reference is the (shrunk, inflated) mean and covariance of
    the later half of all chains' warm-up draws, computed here with torch from the trajectory."""
    from pyro_subspace.infer import chain_batch as gess

    chains, warmup = 4, 60  # per chain 30 draws < 20 K = 60: only the pool allows a refit
    kern = kernel("warmup", chains=chains, seed=2)
    assert kern.adapt
    kern.setup(warmup)
    params = kern.initial_params
    for _ in range(warmup):
        params = kern.sample(params)
    batch = kern._batch
    pool = torch.stack(batch.states[warmup // 2 + 1 :]).double().reshape(-1, K)
    cov = torch.cov(pool.T)
    s, c = gess.SHRINKAGE, gess.INFLATION
    cov = c * ((1 - s) * cov + s * torch.diag(cov.diagonal()))
    for j in range(chains):
        torch.testing.assert_close(torch.from_numpy(batch.mu[j]), pool.mean(0))
        tril = torch.from_numpy(batch.tril[j])
        torch.testing.assert_close(tril @ tril.T, cov, rtol=1e-9, atol=1e-12)


def test_fitted_reference_is_kept_and_starts_are_dispersed():
    """By default a given reference is not refitted; chains start at draws of N(μ, 4Σ)."""
    *_, mean, cov = problem()
    n = 4000
    kern = kernel((mean, cov), chains=n, seed=1)
    assert not kern.adapt and kernel("warmup").adapt
    kern.setup(60)
    start = kern._batch.states[0].double()
    params = kern.initial_params
    for _ in range(60):
        params = kern.sample(params)
    torch.testing.assert_close(torch.from_numpy(kern._batch.mu[0]), mean)
    var = 4 * cov.diagonal()  # covariance of N(μ, 4Σ), within 4.5 MC standard errors
    se = ((var[:, None] * var[None, :] + (4 * cov) ** 2) / n).sqrt()
    assert ((torch.cov(start.T) - 4 * cov).abs() <= 4.5 * se).all()
    assert ((start.mean(0) - mean).abs() <= 4.5 * (var / n).sqrt()).all()


def test_the_internal_laplace_reference_fit_does_not_warn_about_its_loose_map(monkeypatch):
    # the kernel fits its reference with tol=1e-3 (any reference is exact): a ConvergenceWarning
    # of that fit concerns nothing the user asked for, so it is not shown; others still are
    import warnings

    from pyro_subspace.exceptions import ConvergenceWarning

    fit = AutoSubspaceLaplace.fit

    def loose_fit(self, *args, **kwargs):
        warnings.warn("fit: the MAP search did not converge", ConvergenceWarning)
        warnings.warn("something else", UserWarning)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(AutoSubspaceLaplace, "fit", loose_fit)
    model, x, y = subspace_model(temperature=1.0)
    kern = GeneralizedEllipticalSliceSampler(model, reference="laplace", chains=1, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(kern, x, y, samples=5, warmup=2, chains=1)
    kinds = [w.category for w in caught]
    assert ConvergenceWarning not in kinds and UserWarning in kinds


def test_a_lowrank_guide_is_a_reference_with_its_dense_covariance():
    # the lowrank structure keeps packed buffers; with k = K its Σ is the full structure's
    from pyro_subspace.infer.gaussian_prior import gaussian_moments

    model, x, y = subspace_model(temperature=1.0)
    full = AutoSubspaceLaplace(model).fit(x, y)
    low = AutoSubspaceLaplace(model, hessian_structure="lowrank", rank=K).fit(x, y)
    mu, cov = gaussian_moments(low)
    torch.testing.assert_close(mu, full.loc)
    torch.testing.assert_close(cov, full.covariance.double(), rtol=1e-9, atol=1e-12)
    kern = GeneralizedEllipticalSliceSampler(model, reference=low, chains=1, seed=0)
    run(kern, x, y, samples=5, warmup=2, chains=1)  # accepted (it raised before)
    from pyro_subspace.infer import EllipticalSliceSampler

    for kernel in (kern, EllipticalSliceSampler(model)):  # not silently dropped by either
        mcmc = MCMC(kernel, num_samples=5, warmup_steps=2, disable_progbar=True)
        with pytest.raises(ValueError, match="subsample_size: elliptical slice sampling needs"):
            mcmc.run(x, y, subsample_size=5)
