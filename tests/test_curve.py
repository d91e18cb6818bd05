import pytest
import torch
from torch import nn

from pyro_subspace import fit_map, likelihoods, subspaces
from pyro_subspace.subspaces.curve import bezier, curve_losses


def permuted(net: nn.Sequential, perm: torch.Tensor) -> torch.Tensor:
    """The same function with hidden units permuted: a second, distinct minimum."""
    w = {k: v.detach().clone() for k, v in net.state_dict().items()}
    w["0.weight"], w["0.bias"], w["2.weight"] = (
        w["0.weight"][perm],
        w["0.bias"][perm],
        w["2.weight"][:, perm],
    )
    return torch.cat([w[k].reshape(-1) for k in ("0.weight", "0.bias", "2.weight", "2.bias")])


@pytest.fixture(scope="module")
def two_solutions():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 80)[:, None]
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 0]
    net = nn.Sequential(nn.Linear(1, 6), nn.Tanh(), nn.Linear(6, 1))
    lik = likelihoods.Gaussian(0.1)
    fit_map(net, lik, x, y, epochs=1500, lr=0.02, progress=False, seed=0)
    w0 = nn.utils.parameters_to_vector(net.parameters()).detach()
    w1 = permuted(net, torch.tensor([5, 4, 3, 2, 1, 0]))
    return net, lik, x, y, w0, w1


def test_trained_curve_beats_the_straight_line_and_passes_through_the_ends(two_solutions):
    net, lik, x, y, w0, w1 = two_solutions
    before = nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    theta = subspaces.fit_curve(net, lik, x, y, w0, w1, epochs=600, lr=0.02, seed=0, progress=False)
    assert torch.equal(nn.utils.parameters_to_vector(net.parameters()), before)  # net untouched
    ends = bezier(w0, theta, w1, torch.tensor([0.0, 1.0]))
    assert torch.equal(ends[0], w0) and torch.equal(ends[1], w1)
    _, on_curve, on_line = (v.tolist() for v in curve_losses(net, lik, x, y, w0, theta, w1, 11))
    assert on_curve[0] == pytest.approx(on_line[0]) and on_curve[-1] == pytest.approx(on_line[-1])
    # the permuted solutions are equally good, the straight line between them is not
    assert on_line[0] == pytest.approx(on_line[-1], rel=1e-4)
    assert on_line[5] > on_line[0] + 5.0
    assert max(on_curve) < on_line[5] - 0.8 * (on_line[5] - on_line[0])


def test_curve_subspace_contains_the_three_points_with_the_paper_prior():
    gen = torch.Generator().manual_seed(0)
    w0, theta, w1 = (torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(3))
    sub = subspaces.curve(w0, theta, w1)
    assert sub.rank == 2
    for w in (w0, theta, w1, bezier(w0, theta, w1, torch.tensor(0.3, dtype=torch.float64))):
        assert (sub.weights(sub.project(w)) - w).abs().max() < 1e-10
    mid = 0.25 * w0 + 0.5 * theta + 0.25 * w1
    mu = (w0 + mid + w1) / 3
    sigma = (mu - w0).norm()
    assert torch.allclose(sub.shift, mu)
    # t ~ N(0, I) ⇒ w ~ N(μ, σ² I) on the plane: the basis is σ times an orthonormal pair
    assert torch.allclose(sub.basis.T @ sub.basis, sigma**2 * torch.eye(2, dtype=torch.float64))


def test_curve_inputs_are_checked():
    w = torch.randn(5)
    with pytest.raises(ValueError, match="collinear"):
        subspaces.curve(w, 2 * w, 3 * w)
    with pytest.raises(ValueError, match="theta: shape"):
        subspaces.curve(w, torch.randn(4), w + 1)
    with pytest.raises(ValueError, match="w1: contains NaN"):
        subspaces.curve(w, torch.randn(5), torch.full((5,), float("nan")))
    net = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"w0: expected shape \(3,\)"):
        subspaces.fit_curve(
            net,
            likelihoods.Gaussian(1.0),
            torch.randn(4, 2),
            torch.randn(4),
            torch.zeros(5),
            torch.zeros(5),
            progress=False,
        )


def test_batchnorm_net_in_training_mode_keeps_its_buffers_and_modes():
    """fit_curve probes the output width in eval mode (a one-row train-mode pass fails in
    BatchNorm) and restores buffers and modes; curve_losses uses the statistics at each point."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 1))
    net[3].eval()  # a mixed mode the user chose
    x, y = torch.randn(30, 2), torch.randn(30)
    net(x)
    saved = [b.clone() for b in net.buffers()]
    w0 = nn.utils.parameters_to_vector(net.parameters()).detach()
    w1 = w0 + 0.5 * torch.randn(w0.shape)
    lik = likelihoods.Gaussian(0.5)
    theta = subspaces.fit_curve(net, lik, x, y, w0, w1, epochs=3, batch_size=10, progress=False)
    s, on_curve, _ = curve_losses(net, lik, x, y, w0, theta, w1, 3)
    assert net.training and net[1].training and not net[3].training
    assert all(torch.equal(a, b) for a, b in zip(saved, net.buffers()))
    # the loss at w1 by hand: BatchNorm with the batch statistics of x at w1 (unbiased variance)
    names = [name for name, _ in net.named_parameters()]
    p = dict(zip(names, torch.split(w1, [10, 5, 5, 5, 5, 1])))
    h = x @ p["0.weight"].view(5, 2).T + p["0.bias"]
    h = (h - h.mean(0)) / torch.sqrt(h.var(0) + net[1].eps) * p["1.weight"] + p["1.bias"]
    f = torch.tanh(h) @ p["3.weight"].view(1, 5).T + p["3.bias"]
    expected = -torch.distributions.Normal(f[:, 0], 0.5).log_prob(y).mean()
    assert float(on_curve[-1]) == pytest.approx(float(expected), rel=1e-5)


def _small_curve_problem():
    """A 2→4→3 classifier, its weights ``w0``, another point ``w1`` and a control point."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(20, 2, dtype=torch.float64), torch.randint(0, 3, (20,))
    w0 = nn.utils.parameters_to_vector(net.parameters()).detach()
    w1 = w0 + 0.3 * torch.randn_like(w0)
    return net, likelihoods.Categorical(), x, y, w0, (w0 + w1) / 2 + 0.1, w1


def test_equal_end_points_and_too_few_curve_points_are_refused_before_any_forward_pass():
    """``fit_curve`` with ``w1 = w0`` (exactly or to rounding) trained for its epochs before
    `curve` found no plane; ``curve_losses(..., num_points=0)`` returned empty curves; a bad
    likelihood, target length, seed or weight length raised deep inside. Each is named now,
    before any forward pass of the network."""
    net, lik, x, y, w0, theta, w1 = _small_curve_problem()
    passes = []
    net.register_forward_hook(lambda *a: passes.append(1))
    rounding = w0 * (1 + torch.finfo(w0.dtype).eps)
    for same in (w0.clone(), rounding):
        with pytest.raises(ValueError, match="^w1: equals w0 .*another seed"):
            subspaces.fit_curve(net, lik, x, y, w0, same, epochs=3, progress=False)
        with pytest.raises(ValueError, match="^w1: equals w0"):
            curve_losses(net, lik, x, y, w0, theta, same)
        with pytest.raises(ValueError, match="^w1: equals w0"):
            subspaces.curve(w0, theta, same)
    for n, error in ((0, ValueError), (1, ValueError), (-1, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="^num_points: expected an int >= 2"):
            curve_losses(net, lik, x, y, w0, theta, w1, num_points=n)
    bad = [
        ({"likelihood": "categorical"}, TypeError, "likelihood"),
        ({"y": y[:5]}, ValueError, "y"),
        ({"x": x.float()}, (TypeError, ValueError), "x"),
        ({"w0": w0[:-1], "theta": theta[:-1], "w1": w1[:-1]}, ValueError, "w0"),
        ({"theta": theta[:-1]}, ValueError, "theta"),
    ]
    args = {"net": net, "likelihood": lik, "x": x, "y": y, "w0": w0, "theta": theta, "w1": w1}
    for change, error, name in bad:
        with pytest.raises(error, match=f"^{name}: "):
            curve_losses(**{**args, **change})
        if "theta" not in change:
            with pytest.raises(error, match=f"^{name}: "):
                kwargs = {k: v for k, v in {**args, **change}.items() if k != "theta"}
                subspaces.fit_curve(**kwargs, epochs=1, progress=False)
    for seed, error in (("a", TypeError), (-1, ValueError)):
        with pytest.raises(error, match="^seed: "):
            subspaces.fit_curve(net, lik, x, y, w0, w1, epochs=1, seed=seed, progress=False)
    with pytest.raises(ValueError, match="^progress: "):
        subspaces.fit_curve(net, lik, x, y, w0, w1, epochs=1, progress="yes")
    assert passes == []
    s, on_curve, on_line = curve_losses(net, lik, x, y, w0, theta, w1, num_points=2)
    assert torch.equal(s, torch.tensor([0.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(on_curve, on_line)  # both ends are on both paths
