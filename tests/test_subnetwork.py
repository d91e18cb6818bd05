import pytest
import torch
from torch import nn

from pyro_subspace import likelihoods, subspaces
from pyro_subspace.flat import FlatNet


def make_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2))


def test_magnitude_random_and_explicit_indices():
    net = make_net()
    w = nn.utils.parameters_to_vector(net.parameters()).detach()
    sub = subspaces.subnetwork(net, 5, "magnitude")
    assert sub.kind != "dense" and torch.equal(sub.shift, w)
    assert set(sub.basis.tolist()) == set(w.abs().argsort(descending=True)[:5].tolist())
    a = subspaces.subnetwork(net, 7, "random", seed=1)
    b = subspaces.subnetwork(net, 7, "random", seed=1)
    c = subspaces.subnetwork(net, 7, "random", seed=2)
    assert torch.equal(a.basis, b.basis) and not torch.equal(a.basis, c.basis)
    assert a.basis.unique().numel() == 7
    explicit = subspaces.subnetwork(net, strategy="indices", indices=[9, 2, 30])
    assert explicit.basis.tolist() == [2, 9, 30]


def test_last_layer_and_names_pick_the_right_flat_positions():
    net = make_net()
    # flat order: 0.weight (18), 0.bias (6), 2.weight (12), 2.bias (2)
    last = subspaces.subnetwork(net, strategy="last_layer")
    assert last.basis.tolist() == list(range(24, 38))
    named = subspaces.subnetwork(net, strategy="names", names=["0.bias", "2"])
    assert named.basis.tolist() == list(range(18, 24)) + list(range(24, 38))
    with pytest.raises(ValueError, match="names: 'nope' matches no parameter"):
        subspaces.subnetwork(net, strategy="names", names=["nope"])
    with pytest.raises(ValueError, match="n_params: 'last_layer' selects 14 weights, not 3"):
        subspaces.subnetwork(net, 3, strategy="last_layer")


def test_swag_strategy_picks_the_largest_swag_variances():
    net = make_net()
    col = subspaces.SWACollector(net)
    gen = torch.Generator().manual_seed(0)
    scales = torch.rand(FlatNet(net).num_weights, generator=gen)
    w0 = nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    for _ in range(30):
        nn.utils.vector_to_parameters(
            w0 + scales * torch.randn(w0.shape, generator=gen), net.parameters()
        )
        col.collect()
    sub = subspaces.subnetwork(net, 6, "swag", collector=col)
    assert set(sub.basis.tolist()) == set(col.variance.argsort(descending=True)[:6].tolist())


def dense_ggn_diagonal(net, x, sigma):
    """diag(Jᵀ J)/σ² for a Gaussian likelihood, from the full Jacobian (brute force)."""
    flat = FlatNet(net)
    w = flat.vector()
    jac = torch.func.jacrev(lambda v: flat(v, x))(w)  # (N, O, D)
    return (jac**2).sum((0, 1)) / sigma**2


def test_diag_laplace_picks_the_largest_marginal_variances_and_the_dead_relu_warning():
    net = make_net().double()
    with torch.no_grad():
        net[0].bias[0] = -100.0  # hidden unit 0 is dead on every input
    x = torch.randn(40, 3, dtype=torch.float64)
    lik = likelihoods.Gaussian(0.5)
    prec = 2.0
    variances = 1.0 / (dense_ggn_diagonal(net, x, 0.5) + prec)
    sub = subspaces.subnetwork(net, 8, "diag_laplace", likelihood=lik, x=x, prior_precision=prec)
    top = variances.argsort(descending=True)[:8]
    assert set(sub.basis.tolist()) == set(top.tolist())
    # the dead unit's weights (0.weight row 0, 0.bias[0], 2.weight column 0) have zero curvature,
    # hence the prior variance 1/λ, the largest possible: diagonal Laplace selects them
    dead = {0, 1, 2, 18, 24, 30}
    assert dead <= set(sub.basis.tolist())
    assert torch.allclose(variances[list(dead)], torch.full((6,), 1 / prec, dtype=torch.float64))


def test_bad_arguments():
    net = make_net()
    with pytest.raises(ValueError, match="strategy"):
        subspaces.subnetwork(net, 3, "largest")
    with pytest.raises(ValueError, match=r"n_params: expected an int in \[1, 38\]"):
        subspaces.subnetwork(net, 0, "magnitude")
    with pytest.raises(ValueError, match="likelihood: 'diag_laplace' needs"):
        subspaces.subnetwork(net, 3, "diag_laplace")
    with pytest.raises(ValueError, match="collector"):
        subspaces.subnetwork(net, 3, "swag")
    with pytest.raises(ValueError, match="indices"):
        subspaces.subnetwork(net, strategy="indices", indices=[38])


@pytest.mark.parametrize(
    "strategy, kwargs, unused",
    [
        ("magnitude", {"x": torch.randn(4, 3)}, "x"),
        ("magnitude", {"prior_precision": 100.0}, "prior_precision"),
        ("last_layer", {"seed": 0}, "seed"),
        ("diag_laplace", {"likelihood": likelihoods.Categorical(), "x": 1, "seed": 0}, "seed"),
        ("random", {"names": ["0"]}, "names"),
    ],
)
def test_an_argument_the_strategy_does_not_use_is_named(strategy, kwargs, unused):
    n = None if strategy == "last_layer" else 3
    with pytest.raises(ValueError, match=f"^{unused}: strategy '{strategy}' does not use it"):
        subspaces.subnetwork(make_net(), n, strategy, **kwargs)


@pytest.mark.parametrize(
    "lik, out_dim",
    [
        (likelihoods.Categorical(), 3),
        (likelihoods.Bernoulli(), 1),
        (likelihoods.Gaussian(heteroscedastic=True), 2),
    ],
)
def test_ggn_diagonal_matches_the_dense_hessian_of_the_loss_in_the_outputs(lik, out_dim):
    from pyro_subspace.curvature import ggn_diagonal

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, out_dim)).double()
    x = torch.randn(9, 3, dtype=torch.float64)
    flat = FlatNet(net)
    w = flat.vector()
    jac = torch.func.jacrev(lambda v: flat(v, x))(w)  # (N, O, D)
    out = flat(w, x).detach()
    if isinstance(lik, likelihoods.Gaussian):  # Fisher of N(y | m, s(r)) in (m, r): closed form
        s = torch.nn.functional.softplus(out[:, 1]) + lik.min_scale
        ds = torch.sigmoid(out[:, 1])
        hess = torch.diag_embed(torch.stack([1 / s**2, 2 * ds**2 / s**2], -1))
    else:  # the Hessian of -log p(y|f) in f does not depend on y for these likelihoods
        y0 = torch.zeros(1, dtype=torch.long if out_dim > 1 else torch.float64)
        hess = torch.stack([
            torch.autograd.functional.hessian(lambda f: -lik.log_prob(f[None], y0).sum(), o)
            for o in out
        ])  # fmt: skip
    dense = torch.einsum("nod,nop,npd->d", jac, hess, jac)
    assert torch.allclose(ggn_diagonal(net, lik, x, chunk_size=4), dense, atol=1e-10)
