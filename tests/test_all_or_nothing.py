"""Fits are all or nothing, and the Laplace door reads what a laplace-torch user expects.

Each test builds a case that went silently wrong before: a refit interrupted by
``KeyboardInterrupt`` (a half-fitted guide or mixture that still reported itself fitted), a
last "layer" whose output the network transforms further (a closed-form last-layer Jacobian
of the wrong function), and weights loaded between ``Laplace(net)`` and ``fit`` (a posterior
centred on the weights at construction). The references are the same objects fitted without
interruption and a brute-force GGN."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyro_subspace import likelihoods, subspaces
from pyro_subspace.infer import AutoSubspaceLaplace, Laplace, MixtureOfLaplace, linearized_moments
from pyro_subspace.nn import SubspaceNet
from pyro_subspace.transaction import transaction

from test_laplace_front import brute_force_covariance, classifier


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``module``'s state (a K-FAC posterior's extra state names its modules)."""
    state = module.state_dict().items()
    return {k: v.detach().clone() for k, v in state if isinstance(v, torch.Tensor)}


def _assert_same_state(before: dict, module: nn.Module, skip: str = "\0") -> None:
    after = _state(module)
    assert before.keys() == after.keys()
    for k, v in before.items():
        same = v.shape == after[k].shape and bool(((v == after[k]) | (v.isnan() & after[k].isnan())).all())
        assert k.startswith(skip) or same, k


def _Interrupt(fn, n: int = 1):
    """``fn`` that raises ``KeyboardInterrupt`` at its ``n``-th call (a user's Ctrl-C in the
    middle of a fit, after the fit has written part of its new state); a plain function, so
    it binds as a method when set on a class."""
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(None)
        if len(calls) == n:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return interrupted


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank", "kron"])
def test_an_interrupted_refit_leaves_the_guide_and_model_as_they_were(structure, monkeypatch):
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "all", structure, prior_precision=0.7)
    la.fit(x, y)
    la.optimize_prior_precision("marglik")
    before, model_before = _state(la.guide), _state(la.model)
    reference = linearized_moments(la, x)
    evidence = float(la.log_marginal_likelihood())
    # the refit on other data is interrupted after the GGN was written, before the posterior
    monkeypatch.setattr(
        AutoSubspaceLaplace, "_set_posterior", _Interrupt(AutoSubspaceLaplace._set_posterior)
    )
    with torch.no_grad():
        net[0].weight.add_(0.3)  # new weights: the refit also moves the model's shift
    with pytest.raises(KeyboardInterrupt):
        la.fit(2 * x, y)
    monkeypatch.undo()
    _assert_same_state(before, la.guide)
    _assert_same_state(model_before, la.model, skip="net.")  # the user's weights stay theirs
    assert not torch.equal(la.model.net[0].weight, model_before["net.0.weight"])
    assert la.fitted
    for a, b in zip(linearized_moments(la, x), reference):
        assert torch.equal(a, b)
    assert float(la.log_marginal_likelihood()) == evidence


def test_an_interrupted_tuning_leaves_the_prior_noise_and_posterior_as_they_were(monkeypatch):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x = torch.randn(40, 2, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(40, dtype=torch.float64)
    la = Laplace(net, likelihoods.Gaussian(0.5), "all", prior_precision=0.7, hessian_structure="full").fit(x, y)
    before, model_before = _state(la), _state(la.model)
    # the search rescaled the GGN and wrote σ, then was interrupted while setting λ and Σ
    monkeypatch.setattr(
        AutoSubspaceLaplace, "_set_posterior", _Interrupt(AutoSubspaceLaplace._set_posterior)
    )
    with pytest.raises(KeyboardInterrupt):
        la.optimize_prior_precision("marglik", optimize_sigma=True)
    monkeypatch.undo()
    _assert_same_state(before, la)
    _assert_same_state(model_before, la.model)
    assert float(la.likelihood.sigma) == 0.5
    # uninterrupted, the same call does change them
    la.optimize_prior_precision("marglik", optimize_sigma=True)
    assert float(la.likelihood.sigma) != 0.5 and float(la.prior_precision) != 0.7


def test_an_interrupted_fit_too_large_to_copy_is_left_unfitted(monkeypatch):
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "all", "full", prior_precision=0.7).fit(x, y)
    assert la.fitted
    monkeypatch.setattr("pyro_subspace.transaction.BUDGET_BYTES", 0)  # nothing is copied aside
    monkeypatch.setattr(
        AutoSubspaceLaplace, "_set_posterior", _Interrupt(AutoSubspaceLaplace._set_posterior)
    )
    with pytest.raises(KeyboardInterrupt):
        la.fit(2 * x, y)
    assert not la.fitted  # never half-fitted
    with pytest.raises(RuntimeError, match="call fit"):
        linearized_moments(la, x)


def test_an_interrupted_mixture_refit_keeps_every_member_of_the_old_fit(monkeypatch):
    nets = [classifier(seed)[0] for seed in range(3)]
    _, x, y = classifier()
    mola = MixtureOfLaplace(nets, likelihoods.Categorical(), prior_precision=0.7).fit(x, y)
    reference = mola.predict(x).probs
    members, weights = list(mola.members), mola.weights.clone()
    # the refit is interrupted while fitting the third member
    monkeypatch.setattr(AutoSubspaceLaplace, "fit", _Interrupt(AutoSubspaceLaplace.fit, n=3))
    with pytest.raises(KeyboardInterrupt):
        mola.fit(2 * x, y)
    monkeypatch.undo()
    assert mola.members == members and torch.equal(mola.weights, weights)
    assert torch.equal(mola.predict(x).probs, reference)
    # an interrupted tuning: the members' λ and Σ as they were
    lam = mola.member_prior_precisions.clone()
    monkeypatch.setattr(
        AutoSubspaceLaplace, "_set_posterior", _Interrupt(AutoSubspaceLaplace._set_posterior, n=2)
    )
    with pytest.raises(KeyboardInterrupt):
        mola.optimize_prior_precision("grid", x_val=x, y_val=y)
    monkeypatch.undo()
    assert torch.equal(mola.member_prior_precisions, lam)
    assert torch.equal(mola.predict(x).probs, reference)


def test_transaction_restores_replaced_buffers_and_plain_attributes():
    lin = nn.Linear(3, 2)
    lin.register_buffer("stats", torch.zeros(3))
    lin.history = [1]
    obj = type("Plain", (), {})()
    obj.members, obj.count = [lin], 1
    weight = lin.weight
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    with pytest.raises(ValueError):
        with transaction(lin, obj):
            lin.weight.data.mul_(2)
            lin._buffers["stats"] = torch.ones(3)  # replaced, not written in place
            lin.history.append(2)
            lin.extra = "new"
            obj.members.append(None)
            obj.count = 2
            raise ValueError
    assert lin.weight is weight  # an optimiser's reference still points at it
    _assert_same_state(before, lin)
    assert lin.history == [1] and not hasattr(lin, "extra")
    assert obj.members == [lin] and obj.count == 1


class _Fixed(nn.Module):
    """A module whose ``index`` buffer every operation replaces (`transaction.REPLACED_ONLY`)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("index", torch.arange(1000))
        self.register_buffer("values", torch.zeros(1000))

    def buffers_replaced_only(self):
        return ("index",)


def test_a_replaced_only_buffer_is_kept_by_reference_and_restored():
    m = _Fixed()
    index = m.index
    with pytest.raises(ValueError):
        with transaction(m):
            m.index = torch.zeros(1000, dtype=torch.long)  # replaced: the original comes back
            m.values.add_(1.0)
            raise ValueError
    assert m.index is index and torch.equal(index, torch.arange(1000))
    assert torch.equal(m.values, torch.zeros(1000))
    from pyro_subspace.transaction import _Snapshot

    assert _Snapshot((m,)).nbytes() == 1000 * 4  # the values only: the index is not copied


@pytest.mark.parametrize("fails", [False, True])
def test_an_in_place_write_into_a_replaced_only_buffer_is_reported(fails):
    m = _Fixed()
    with pytest.raises(RuntimeError, match="replaced-only"):
        with transaction(m):
            m.index.add_(1)  # a library bug: the snapshot could not restore it
            if fails:
                raise ValueError


def test_a_scalar_prior_precision_holds_one_number():
    """A scalar ``λ`` is one number expanded over the ``K`` coordinates in the model, the guide
    and a Kronecker posterior (a 1000-class head's K = 2 million would otherwise hold it in
    four (K,) vectors, and a tuning's snapshot copy them); a per-weight ``λ`` is a vector; a
    state of either loads into the other."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(50, 4), torch.randint(0, 3, (50,))
    la = Laplace(net, likelihoods.Categorical(), "all", "kron", prior_precision=0.7).fit(x, y)
    holders = lambda la: [  # noqa: E731
        la.model._prior_precision, la.model.prior_scale, la.guide.posterior_prior_precision,
        la.guide.posterior.prior_diagonal,
    ]  # fmt: skip
    k = la.model.rank
    for buf in holders(la):
        assert buf.shape == (k,) and buf.stride() == (0,)
    la.optimize_prior_precision("marglik", prior_structure="layerwise")
    for buf in holders(la):
        assert buf.shape == (k,) and buf.is_contiguous() and len(set(buf.tolist())) > 1
    state = la.guide.state_dict()
    fresh = Laplace(net, likelihoods.Categorical(), "all", "kron", prior_precision=0.7)
    fresh.fit(x, y)
    fresh.model.load_state_dict(la.model.state_dict())
    fresh.guide.load_state_dict(state)
    for a, b in zip(holders(fresh), holders(la), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(linearized_moments(fresh, x), linearized_moments(la, x), strict=True):
        assert torch.equal(a, b)
    la.prior_precision = 2.0  # back to one number
    la.log_marginal_likelihood()  # the front's write-back
    assert la.model._prior_precision.stride() == (0,) and la.model.prior_scale.stride() == (0,)
    assert float(la.model._prior_precision[0]) == 2.0


# ------------------------------------------------------------------ the last layer is the output


@pytest.mark.parametrize("kind", ["sequential", "custom"])
def test_a_last_linear_layer_that_is_not_the_output_is_refused(kind):
    torch.manual_seed(0)
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    if kind == "sequential":  # seen without data, at construction
        net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 1), nn.Tanh()).double()
        with pytest.raises(ValueError, match="not the network's output.*names"):
            Laplace(net, likelihoods.Gaussian(0.3), "last_layer", hessian_structure="full")
        return

    class Squashed(nn.Module):  # the forward order is known only from a forward pass
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(3, 5), nn.Linear(5, 1)

        def forward(self, x):
            return torch.tanh(self.head(torch.relu(self.body(x))))

    net = Squashed().double()
    la = Laplace(net, likelihoods.Gaussian(0.3), "last_layer", hessian_structure="full")
    with pytest.raises(ValueError, match="not the network's output"):
        la.fit(x, y)
    assert not la.fitted
    # what the message suggests: a subnetwork of the head's indices, the exact Jacobian
    sub = subspaces.subnetwork(net, strategy="names", names=["head"])
    la = Laplace(net, likelihoods.Gaussian(0.3), sub, prior_precision=0.5, hessian_structure="full").fit(x, y)
    _, var = linearized_moments(la, x)
    jac = torch.autograd.functional.jacobian(
        lambda v: SubspaceNet(net, sub, likelihoods.Gaussian(0.3)).outputs(v, x).reshape(-1),
        torch.zeros(sub.rank, dtype=torch.float64),
    )
    s2 = float(la.likelihood.sigma) ** 2  # σ as the likelihood holds it (float32)
    cov = torch.linalg.inv(jac.T @ jac / s2 + 0.5 * torch.eye(sub.rank, dtype=torch.float64))
    torch.testing.assert_close(var.reshape(-1), ((jac @ cov) * jac).sum(1), rtol=1e-9, atol=0)


def test_pass_through_modules_after_the_last_layer_are_accepted():
    net, x, y = classifier()
    wrapped = nn.Sequential(net, nn.Dropout(0.1), nn.Identity())
    a = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=0.7, hessian_structure="full").fit(x, y)
    b = Laplace(wrapped, likelihoods.Categorical(), "last_layer", prior_precision=0.7, hessian_structure="full").fit(x, y)
    torch.testing.assert_close(a.posterior_covariance, b.posterior_covariance, rtol=0, atol=0)


# ------------------------------------------------------------------ weights are read at fit


def test_weights_loaded_after_construction_are_the_ones_fitted():
    net, x, y = classifier(0)
    trained, _, _ = classifier(1)  # a "checkpoint" loaded between Laplace(...) and fit
    la = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=0.7, hessian_structure="full")
    net.load_state_dict(trained.state_dict())
    la.fit(x, y)
    mean, _ = linearized_moments(la, x)
    torch.testing.assert_close(mean, trained(x).detach(), rtol=0, atol=1e-12)
    d = sum(p.numel() for p in net.parameters())
    expected = brute_force_covariance(trained, x, torch.arange(d - 21, d), 0.7)
    torch.testing.assert_close(la.posterior_covariance, expected, rtol=1e-9, atol=1e-12)
    # the prior's mean (zero weights) in the new coordinates: the evidence of the new weights
    fresh = Laplace(trained, likelihoods.Categorical(), "last_layer", prior_precision=0.7, hessian_structure="full")
    fresh.fit(x, y)
    torch.testing.assert_close(la.log_marginal_likelihood(), fresh.log_marginal_likelihood())
    torch.testing.assert_close(la.model.prior_loc, fresh.model.prior_loc, rtol=0, atol=0)
