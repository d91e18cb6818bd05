"""laplace-torch 0.3's own example scripts and documentation snippets, run through our door.

Each test runs one port of `benchmarks.laplace_torch_examples` twice, on laplace-torch's
``Laplace`` and on ``pyro_subspace.infer.Laplace``: the port is the script's code written once
as a function of the namespace its ``from laplace import ...`` line brings in, so "only the
import changed" holds by construction (the scripts' other laplace-torch imports,
``laplace.curvature.backpack.BackPackGGN``, ``laplace.utils.enums``, ``laplace.utils``'s
subnetwork masks, stay laplace-torch's). The regression example imports
``marglik_training`` on the same line: there the changed line is ``from pyro_subspace.infer
import Laplace, marglik_training``. Data are seeded synthetic tensors of the scripts' shapes,
third-party extras small stand-ins (the module's docstring lists them).

Every number a script prints or computes is compared: relative difference (largest absolute
difference over the largest reference entry) at most 1e-6 in float64 (the two libraries sum
the same float64 terms in other orders: rounding is ~1e-13 here, and a loop of 100 Adam steps
on the hyperparameters amplifies it by at most the condition of the evidence, far below
1e-6), and 1e-4 in float32 where the script runs in float32 (float32 rounding ~6e-8 per
operation, amplified alike). Where the numbers differ for a reason, the test says it and checks
ours against an independent value instead.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("laplace")

from benchmarks import laplace_torch_examples as ex  # noqa: E402

F32, F64 = ex.F32, ex.F64


def agree(results: dict, dtype: torch.dtype, skip: tuple = ()) -> dict:
    """Assert every number of the two runs agrees to ``ex.TOL[dtype]``; returns the
    differences."""
    diffs = ex.compare(results)
    bad = {k: v for k, v in diffs.items() if k not in skip and not v <= ex.TOL[dtype]}
    assert not bad, f"differ from laplace-torch's (relative): {bad}"
    return diffs


def test_regression_example():
    """``examples/regression_example.py`` in float64: the hand-written loop on ``log λ, log σ``,
    the ``state_dict`` round trip, ``la(x)`` and ``la(x, joint=True)``, and
    ``marglik_training`` (full, BackPackGGN, scalar prior). Epochs shortened (the script: 1000
    each). In float32 (the script's dtype) its numbers cannot agree to 1e-4: laplace-torch's
    own float32 λ is 2.3e-3 from its float64 λ on the same weights (the full GGN's float32
    rounding, most of its spectrum near 0), and moves 7.5e-3 when only its batch size changes
    (150 → 50: `benchmarks/laplace_torch_examples.py --float32-spread`; ours is 2.0e-3 from its
    default), so the float32 run is checked for accuracy instead
    (`test_float32_curvature_and_evidence_as_accurate_as_laplace_torch`) and its
    ``marglik_training`` to 1e-2 (`test_regression_example_marglik_training_float32`)."""
    agree(ex.run(ex.regression_example, F64, n_epochs=100, n_epochs_marglik=5, n_test=50), F64)


MARGLIK = ("marglik_training: sigma", "marglik_training: prior precision", "marglik_training: last marglik")


def test_regression_example_marglik_training_float32():
    """Issue 36: ``marglik_training`` on the regression example in its own float32: the final
    ``σ``, ``λ`` and evidence within 1e-2 relative of laplace-torch's (30 epochs here; the
    benchmark table runs the script's 1000)."""
    diffs = ex.compare(ex.run(ex.regression_example, F32, n_epochs=100, n_epochs_marglik=30, n_test=50))
    bad = {k: diffs[k] for k in MARGLIK if not diffs[k] <= 1e-2}
    assert not bad, bad


@pytest.mark.parametrize("dtype", [F64, F32])
def test_reward_modeling_example(dtype):
    """``examples/reward_modeling_example.py``: ``likelihood="reward_modeling"`` over pairs,
    K-FAC over all weights of a network that reshapes its batch, ``optimize_prior_precision()``
    (laplace-torch's default: 100 Adam steps from λ = 1), the scores' predictive."""
    agree(ex.run(ex.reward_modeling_example, dtype), dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_expectation_example(dtype):
    """``examples/expectation_example.py``: enum arguments, ``enable_backprop=True``,
    ``optimize_prior_precision(PredType.GLM)``, ``functional_samples`` (glm and nn)
    differentiated in the inputs: the printed lines equal, λ and the glm moments with their
    input gradient to tolerance (the draws are not compared: `ex.expectation_example`)."""
    agree(ex.run(ex.expectation_example, dtype), dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_calibration_example(dtype):
    """``examples/calibration_example.py``: last-layer K-FAC on a CNN with batch norm,
    ``optimize_prior_precision(method="marglik")``, accuracy, ECE and NLL of the probit."""
    agree(ex.run(ex.calibration_example, dtype, n_train=128, n_test=50, pretrain_steps=10), dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_calibration_gp_example(dtype):
    """``examples/calibration_gp_example.py``: ``hessian_structure="gp"`` over all weights of a
    CNN with ``independent_outputs=True`` and ``n_subset=m`` (laplace-torch's seeded subset)."""
    agree(ex.run(ex.calibration_gp_example, dtype, n_train=60, n_test=20, ms=(30,), pretrain_steps=5), dtype)


def test_bayesopt_example():
    """``examples/bayesopt_example.py`` (float64: the script sets it): K-FAC over all weights with
    ``enable_backprop=True``, ``optimize_prior_precision(n_steps=50)``, the joint predictive
    as a botorch posterior, EI and its gradient, two steps of the BO loop with retraining
    (50 epochs each; the script: 1000 and 500 steps)."""
    agree(ex.run(ex.bayesopt_example, F64, n_epochs=50, exp_len=2, n_test=100), F64)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_huggingface_example(dtype):
    """``examples/huggingface_example.py``: a GPT-2 classifier on dict batches, last-layer
    ``"full"`` with ``feature_reduction="pick_last"``, ``"all"`` over the grad-enabled head with
    ``"diag"``; the LoRA Laplace's prediction before ``fit``, which laplace-torch 0.3 refuses
    (its script stops there), refused by ours too."""
    results = ex.run(ex.huggingface_example, dtype)
    agree(results, dtype)
    assert results["pyro_subspace"]["LoRA, unfitted: lora_la(X_test)"] == "refused: not fitted"


@pytest.mark.parametrize("dtype", [F64, F32])
def test_readme_quickstart(dtype):
    """README / docs "Simple usage": diag over all weights, gridsearch on a validation loader
    with the glm probit, ``la(x, pred_type="glm", link_approx="probit")``."""
    agree(ex.run(ex.readme_quickstart, dtype), dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_docs_subnetwork(dtype):
    """docs "Subnetwork Laplace": laplace-torch's own masks (``LargestMagnitudeSubnetMask``,
    ``ModuleNameSubnetMask``) and ``subnetwork_indices=`` with ``"subnetwork"``/``"full"``:
    ``n_params`` (the model's weights, as laplace-torch counts), ``Σ`` and the probit."""
    agree(ex.run(ex.docs_subnetwork, dtype), dtype)


LOOP = ("loop: sigma", "loop: prior precision", "loop: neg_marglik", "la(x_test)", "d ml / d obs_noise")


@pytest.mark.parametrize("dtype", [F64, F32])
def test_docs_marginal_likelihood(dtype):
    """docs "Marginal likelihood": the default last-layer K-FAC, ``ml`` and its gradient in
    ``λ`` agree. Its gradient in ``σ`` does not: laplace-torch's K-FAC evidence drops the
    log-determinant's dependence on ``σ`` from its graph (on this net its autograd value is
    −273.3, its own central difference −230.3; for ``"all"`` K-FAC the same −273.3 against
    +104.1), so the hyperparameter loop after it follows another gradient there and is not
    compared. Ours is checked against laplace-torch's own central difference of the same
    evidence instead (h = 1e-6 in float64: truncation ~h² f''' and rounding ~1e-16/h, both
    far below 1e-6)."""
    results = ex.run(ex.docs_marginal_likelihood, dtype, n_steps=5)
    agree(results, dtype, skip=LOOP)
    if dtype != F64:
        return
    import laplace
    import torch.utils.data as data_utils

    with ex.default_dtype(F64):
        model = ex.load_model()
        x, y = ex._regression_data()
        la = laplace.Laplace(model, likelihood="regression")
        la.fit(data_utils.DataLoader(data_utils.TensorDataset(x, y), batch_size=32))
        h = 1e-6
        ml = lambda s: float(la.log_marginal_likelihood(torch.tensor(0.7), torch.tensor(s)))  # noqa: E731
        fd = (ml(0.3 + h) - ml(0.3 - h)) / (2 * h)
    ours = float(results["pyro_subspace"]["d ml / d obs_noise"])
    assert abs(ours - fd) <= 1e-6 * abs(fd), (ours, fd)


def test_float32_curvature_and_evidence_as_accurate_as_laplace_torch():
    """Issue 36 (a), on the regression example's float32 MAP (151 weights, most of the GGN's
    spectrum near 0): our float32 GGN carries no more negative eigen-mass than laplace-torch's
    own float32 GGN of the same net (both the same float32 products in other orders: the
    masses agree within 25 %), and the λ that the example's hyperparameter loop finds in
    float32 is as close to the float64 one (the same weights in float64: our float64 GGN is
    the brute-force one) as laplace-torch's float32 λ is, within a factor 2 (here both about
    1 % off: float32 rounding of a GGN with most of its spectrum near 0 moves λ that much).
    Before the fix our float32 evidence took the GGN's eigenvalues from float32's eigensolver
    (errors ~eps·‖G‖: −9e-3) and clamped the negative ones at 0: λ 4–5 % off where
    laplace-torch's was 0.2 % off (1000 epochs), and this test failed."""
    import copy

    import laplace

    from pyro_subspace.infer import Laplace

    net, x, y = ex.regression_map(300)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=150)
    ours = Laplace(net, "regression", subset_of_weights="all", hessian_structure="full").fit(loader)
    theirs = laplace.Laplace(net, "regression", subset_of_weights="all", hessian_structure="full")
    theirs.fit(loader)

    def negative_mass(ggn):
        eig = torch.linalg.eigvalsh(ggn.detach().double())
        return float(-eig[eig < 0].sum())

    ours_mass, theirs_mass = negative_mass(ours.posterior.curvature()), negative_mass(theirs.H)
    assert ours.posterior.curvature().dtype == F32
    assert ours_mass <= 1.25 * theirs_mass, (ours_mass, theirs_mass)

    with ex.default_dtype(F64):
        net64 = copy.deepcopy(net).double()
        loader64 = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.double(), y.double()), batch_size=150)
        exact = Laplace(net64, "regression", subset_of_weights="all", hessian_structure="full").fit(loader64)
        lam64, sigma64 = ex.hyper_loop(exact, F64, 300)
    lam_ours, sigma_ours = ex.hyper_loop(ours, F32, 300)
    lam_theirs, sigma_theirs = ex.hyper_loop(theirs, F32, 300)
    err_ours, err_theirs = abs(lam_ours / lam64 - 1), abs(lam_theirs / lam64 - 1)
    assert err_ours <= 2 * err_theirs, (lam_ours, lam_theirs, lam64)
    assert abs(sigma_ours / sigma64 - 1) <= 2 * abs(sigma_theirs / sigma64 - 1) + 1e-5
