"""laplace-torch's own calls at `infer.Laplace`'s door, with only the import changed.

laplace-torch 0.3 names its likelihoods by string (``"classification"``, ``"regression"`` with
``sigma_noise=``, ``"reward_modeling"``) or by its ``str`` enum members, and its
``optimize_prior_precision`` takes ``pred_type`` first. Each is checked against the likelihood
objects it maps to, and, where laplace-torch is installed, against laplace-torch itself on its
reward-modeling example (a 3-100-1 scorer on pairs, float64).
"""

from __future__ import annotations

import enum
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import infer, likelihoods

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
LAM = 0.8


class PredType(str, enum.Enum):
    """A stand-in of laplace-torch's ``str`` enums (``laplace.utils.enums``)."""

    GLM = "glm"


class LikelihoodName(str, enum.Enum):
    CLASSIFICATION = "classification"
    REGRESSION = "regression"


def _classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
    x = torch.randn(30, 4, dtype=F64)
    return net, x, torch.randint(0, 3, (30,))


def _regressor():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)
    x = torch.randn(30, 2, dtype=F64)
    return net, x, torch.sin(x[:, :1]) + 0.1 * torch.randn(30, 1, dtype=F64)


@pytest.mark.parametrize("name", ["classification", LikelihoodName.CLASSIFICATION])
def test_classification_by_name_is_the_categorical_likelihood(name):
    net, x, y = _classifier()
    by_name = infer.Laplace(net, name, "all", "full", prior_precision=LAM).fit(x, y)
    by_object = infer.Laplace(net, likelihoods.Categorical(), "all", "full", prior_precision=LAM).fit(x, y)
    assert isinstance(by_name.model.likelihood, likelihoods.Categorical)
    torch.testing.assert_close(by_name(x), by_object(x), rtol=0, atol=0)
    torch.testing.assert_close(by_name.log_marginal_likelihood(), by_object.log_marginal_likelihood())


@pytest.mark.parametrize("name", ["regression", LikelihoodName.REGRESSION])
def test_regression_by_name_takes_sigma_noise_at_construction(name):
    net, x, y = _regressor()
    by_name = infer.Laplace(net, name, "all", "full", prior_precision=LAM, sigma_noise=0.3).fit(x, y)
    dtype = next(net.parameters()).dtype  # σ in the network's dtype, as laplace-torch keeps it
    lik = likelihoods.Gaussian(sigma=torch.tensor(0.3, dtype=dtype))
    by_object = infer.Laplace(net, lik, "all", "full", prior_precision=LAM).fit(x, y)
    assert by_name.sigma_noise.dtype == dtype and float(by_name.sigma_noise) == float(torch.tensor(0.3, dtype=dtype))
    for a, b in zip(by_name(x), by_object(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(by_name.log_marginal_likelihood(), by_object.log_marginal_likelihood())
    default = infer.Laplace(net, "regression", "all", "full")
    assert float(default.sigma_noise) == 1.0  # laplace-torch's default


def test_unknown_names_and_misplaced_sigma_noise_are_refused_before_any_work():
    net, _, _ = _classifier()
    with pytest.raises(ValueError, match="^likelihood: .*'classification', 'regression', 'reward_modeling'"):
        infer.Laplace(net, "classificaton")
    with pytest.raises(ValueError, match="^sigma_noise: only for likelihood='regression'"):
        infer.Laplace(net, "classification", sigma_noise=0.1)
    with pytest.raises(ValueError, match="^sigma_noise: only for a Gaussian"):
        infer.Laplace(net, likelihoods.Categorical(), sigma_noise=0.1)


def test_optimize_prior_precision_takes_pred_type_first_and_warns_on_the_former_order():
    net, x, y = _classifier()

    def fitted():
        return infer.Laplace(net, "classification", "all", "full", prior_precision=LAM).fit(x, y)

    reference = fitted().optimize_prior_precision(method="marglik").prior_precision
    ours = fitted().optimize_prior_precision("glm", "marglik").prior_precision
    theirs = fitted().optimize_prior_precision(PredType.GLM).prior_precision
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    torch.testing.assert_close(theirs, reference, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="method='marglik'"):
        former = fitted().optimize_prior_precision("marglik").prior_precision
    torch.testing.assert_close(former, reference, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        fitted().optimize_prior_precision()


class SimpleRewardModel(nn.Module):
    """laplace-torch's ``examples/reward_modeling_example.py`` scorer: pairs ``(B, 2, 3)`` give
    ``(B, 2)`` logits, single items ``(N, 3)`` their ``(N, 1)`` scores."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 100), nn.ReLU(), nn.Linear(100, 1))

    def forward(self, x):
        if len(x.shape) == 3:
            batch_size, _, dim = x.shape
            return self.net(x.reshape(-1, dim)).reshape(batch_size, 2)
        return self.net(x)


def _reward_problem():
    torch.manual_seed(0)
    x = torch.randn(10, 2, 3, dtype=F64)
    y = torch.randint(2, (10,))
    loader = DataLoader(TensorDataset(x, y), batch_size=3)
    model = SimpleRewardModel().to(F64)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=1e-3)
    for _ in range(10):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return model.eval(), loader, torch.randn(5, 3, dtype=F64)


def test_reward_modeling_fits_the_pairs_as_classification_and_predicts_scores():
    model, loader, x_test = _reward_problem()
    la = infer.Laplace(model, "reward_modeling", "all", "full", prior_precision=LAM).fit(loader)
    clf = infer.Laplace(model, likelihoods.Categorical(), "all", "full", prior_precision=LAM)
    clf.fit(loader)
    torch.testing.assert_close(la.posterior_precision, clf.posterior_precision, rtol=0, atol=0)
    f_mu, f_var = la(x_test)
    assert f_mu.shape == (5, 1) and f_var.shape == (5, 1, 1)
    with torch.no_grad():
        torch.testing.assert_close(f_mu, model(x_test))
    # the scores' GLM variance J Σ Jᵀ from brute-force Jacobians of each test item
    params = dict(model.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x_test,)))(params)
    j = torch.cat([jac[n].reshape(5, 1, -1) for n in params], -1)
    sigma = la.posterior_covariance
    torch.testing.assert_close(f_var, j @ sigma @ j.mT, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_reward_modeling_equals_laplace_torch(structure):
    laplace = pytest.importorskip("laplace", reason="laplace-torch is a comparison only")
    model, loader, x_test = _reward_problem()
    ours = infer.Laplace(model, "reward_modeling", "all", structure, prior_precision=LAM).fit(loader)
    theirs = laplace.Laplace(
        model, "reward_modeling", subset_of_weights="all", hessian_structure=structure,
        prior_precision=LAM,
    )  # fmt: skip
    theirs.fit(loader)
    for a, b in zip(ours(x_test), theirs(x_test)):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-6
    a, b = ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()
    assert abs(float(a - b)) < 1e-6 * abs(float(b))


@pytest.mark.parametrize("structure", ["full", "diag", "kron", "lowrank"])
def test_the_joint_predictive_is_the_stacked_linearisation(structure):
    """laplace-torch's ``la(x, joint=True)``: ``f_mu`` ``(N·O,)`` and ``J Σ Jᵀ`` ``(N·O, N·O)``
    over all pairs of test points; its diagonal blocks are the marginal ``la(x)``'s."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 2)).to(F64)
    x, y = torch.randn(25, 2, dtype=F64), torch.randn(25, 2, dtype=F64)
    x_test = torch.randn(4, 2, dtype=F64)
    kw = {"rank": 6} if structure == "lowrank" else {}
    la = infer.Laplace(net, "regression", "all", structure, prior_precision=LAM, sigma_noise=0.5, **kw)
    la.fit(x, y)
    f_mu, f_cov = la(x_test, joint=True)
    assert f_mu.shape == (8,) and f_cov.shape == (8, 8)
    params = dict(net.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(net, p, (x_test,)))(params)
    j = torch.cat([jac[n].reshape(8, -1) for n in params], -1)
    sigma = torch.linalg.inv(la.guide.posterior.precision().to(F64))
    torch.testing.assert_close(f_cov, j @ sigma @ j.T, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(f_mu, net(x_test).reshape(-1))
    _, marginal = la(x_test)
    blocks = f_cov.reshape(4, 2, 4, 2).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    torch.testing.assert_close(blocks, marginal, rtol=1e-12, atol=1e-14)


def test_the_joint_predictive_is_refused_where_laplace_torch_ignores_it():
    net, x, y = _classifier()
    la = infer.Laplace(net, "classification", "all", "full").fit(x, y)
    with pytest.raises(ValueError, match="^joint: .*regression"):
        la(x, joint=True)


def test_functional_samples_draw_the_linearised_outputs():
    net, x, y = _regressor()
    la = infer.Laplace(net, "regression", "all", "full", prior_precision=LAM, sigma_noise=0.5).fit(x, y)
    f_mu, f_var = la(x[:5])
    draws = la.functional_samples(x[:5], n_samples=4000, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (4000, 5, 1)
    se = (f_var[:, 0, 0] / 4000).sqrt()
    assert bool(((draws.mean(0)[:, 0] - f_mu[:, 0]).abs() < 4 * se).all())
    # the variance's standard error for Gaussian draws: var · √(2/(S−1))
    assert bool(((draws.var(0)[:, 0] - f_var[:, 0, 0]).abs() < 4 * f_var[:, 0, 0] * (2 / 3999) ** 0.5).all())
    same = la.functional_samples(x[:5], n_samples=3, generator=torch.Generator().manual_seed(1))
    again = la.functional_samples(x[:5], n_samples=3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(same, again)


def test_n_params_and_prior_precision_have_laplace_torch_shapes():
    net, x, y = _classifier()
    d = sum(p.numel() for p in net.parameters())
    idx = torch.tensor([0, 5, 40, 60])
    sub = infer.Laplace(net, "classification", idx, "full").fit(x, y)
    assert sub.n_params == d and sub.n_params_subnet == 4  # SubnetLaplace counts the model
    last = infer.Laplace(net, "classification", "last_layer", "full").fit(x, y)
    assert last.n_params == 27
    la = infer.Laplace(net, "classification", "all", "full", prior_precision=LAM).fit(x, y)
    assert la.prior_precision.shape == (1,) and float(la.prior_precision) == LAM
    la.optimize_prior_precision("glm", "marglik", prior_structure="layerwise")
    assert la.prior_precision.shape == (4,)  # one per parameter tensor
    la.optimize_prior_precision("glm", "marglik", prior_structure="diag")
    assert la.prior_precision.shape == (d,)


@pytest.mark.parametrize("name, conv", [("CurvlinopsGGN", "expand"), ("AsdlGGN", "expand"), ("BackPackGGN", "backpack")])
def test_a_ggn_backend_class_is_the_exact_ggn_and_its_conv_convention(name, conv):
    net, x, y = _classifier()
    backend = type(name, (), {})  # read by name: laplace-torch is not imported
    la = infer.Laplace(net, "classification", "all", "kron", backend=backend).fit(x, y)
    assert la.guide.posterior.conv == conv
    full = infer.Laplace(net, "classification", "all", "full", backend=backend, prior_precision=LAM).fit(x, y)
    plain = infer.Laplace(net, "classification", "all", "full", prior_precision=LAM).fit(x, y)
    torch.testing.assert_close(full.posterior_precision, plain.posterior_precision, rtol=0, atol=0)
    reduced = infer.Laplace(net, "classification", "all", "kron", asdl_fisher_kwargs={"kfac_approx": "reduce"})
    assert reduced.guide.posterior.conv == "reduce"


def test_empirical_fisher_and_hessian_backends_are_refused_saying_so():
    net, _, _ = _classifier()
    for name, match in (("CurvlinopsEF", "empirical Fisher"), ("AsdlHessian", "GGN backends")):
        with pytest.raises(ValueError, match=f"^backend: {name} .*{match}"):
            infer.Laplace(net, "classification", backend=type(name, (), {}))
    with pytest.raises(TypeError, match="^backend_kwargs: only"):
        infer.Laplace(net, "classification", backend_kwargs={"foo": 1})


def test_float_indices_are_refused_naming_subset_of_weights():
    net, _, _ = _classifier()
    with pytest.raises(TypeError, match="^subset_of_weights: .*integer tensor"):
        infer.Laplace(net, "classification", torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="^subset_of_weights: flat indices must be 1-D"):
        infer.Laplace(net, "classification", torch.tensor([[0, 3]]))


def test_a_failed_tuning_leaves_the_prior_as_it_was_init_prior_prec_included():
    net, x, y = _classifier()
    la = infer.Laplace(net, "classification", "all", "full", prior_precision=LAM).fit(x, y)
    before = la(x)
    with pytest.raises(TypeError, match="grid"):
        la.optimize_prior_precision("glm", "gridsearch", init_prior_prec=7.0, x_val=x, y_val=y, grid="abc")
    assert float(la.prior_precision) == LAM
    torch.testing.assert_close(la(x), before, rtol=0, atol=0)


@pytest.mark.parametrize("structure", ["full", "diag", "kron", "lowrank"])
def test_enable_backprop_makes_the_predictive_differentiable_in_the_inputs(structure):
    """laplace-torch's ``enable_backprop=True`` (Bayesian optimisation): ``la(x)``'s moments
    equal the default path's and their gradient in ``x`` equals central finite differences."""
    net, x, y = _regressor()
    kw = {"rank": 5} if structure == "lowrank" else {}
    la = infer.Laplace(net, "regression", "all", structure, prior_precision=LAM, sigma_noise=0.5, enable_backprop=True, **kw)
    la.fit(x, y)
    plain = infer.Laplace(net, "regression", "all", structure, prior_precision=LAM, sigma_noise=0.5, **kw).fit(x, y)
    x_test = torch.randn(3, 2, dtype=F64, requires_grad=True)
    f_mu, f_var = la(x_test)
    want_mu, want_var = plain(x_test.detach())
    torch.testing.assert_close(f_mu.detach(), want_mu, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f_var.detach(), want_var, rtol=1e-8, atol=1e-12)

    def acquisition(z):  # an upper confidence bound
        m, v = la(z)
        return (m[:, 0] + 2 * v[:, 0, 0].sqrt()).sum()

    (grad,) = torch.autograd.grad(acquisition(x_test), x_test)
    h, fd = 1e-6, torch.zeros_like(grad)
    for i in range(3):
        for j in range(2):
            e = torch.zeros_like(x_test)
            e[i, j] = h
            fd[i, j] = (acquisition(x_test.detach() + e) - acquisition(x_test.detach() - e)) / (2 * h)
    torch.testing.assert_close(grad, fd, rtol=1e-5, atol=1e-8)
    samples = la.functional_samples(x_test, n_samples=2, generator=torch.Generator().manual_seed(0))
    assert samples.requires_grad
