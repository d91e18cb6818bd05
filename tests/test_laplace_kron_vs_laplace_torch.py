"""K-FAC `infer.Laplace(..., "kron")` against laplace-torch's ``KronLaplace`` / ``KronLLLaplace``
(skipped without laplace-torch; a backend's cases without BackPack or curvlinops).

On the same briefly trained nets (float64, one DataLoader batch of all ``N`` points for
laplace-torch, the type-2 Fisher): an MLP regression with two outputs (Gaussian, fixed ``σ``), an
MLP classification and a small CNN (``Conv2d(1, 4, 3)`` → ReLU → Flatten → Linear on 8×8
images), subset ``"all"`` (``KronLaplace``) and ``"last_layer"`` (``KronLLLaplace``), with a
scalar ``λ`` and a layerwise one (one value per parameter tensor: laplace-torch's
``prior_precision`` of length ``n_layers``), for each laplace-torch backend and our matching
``conv`` convention (`curvature.kfac`): ``BackPackGGN`` ↔ ``conv="backpack"``,
``CurvlinopsGGN`` ↔ ``conv="expand"`` (its default ``kfac_approx``), and for the CNN also
``CurvlinopsGGN`` with ``kfac_approx="reduce"`` ↔ ``conv="reduce"``. Compared, each to
``< 1e-6`` relative (``‖a − b‖ / ‖b‖``, Frobenius; measured at most 3e-13):

1. per Kronecker block, the eigenvalues of ``G ⊗ A`` (all products of the factors'
   eigenvalues; laplace-torch's fitted ``la.H`` is a ``KronDecomposed``, ``[G, A]`` per weight
   and ``[G]`` per bias, our bias block has ``A = [1]``), laplace-torch's times ``_H_factor``
   (its ``H`` leaves out ``1/σ²`` for regression, ours has it in ``G``), and the block layout
   (consecutive parameter tensors in ``parameters_to_vector`` order);
2. the posterior precision applied to random vectors (laplace-torch's
   ``posterior_precision.bmm(V, exponent=±1)``, ours ``KronPosterior.apply_precision(V)`` / ``apply_covariance(V)``), and as a
   dense matrix (``to_matrix()`` against ``precision()``), in laplace-torch's parameter order
   (our coordinates are the flat indices ``la.model.subspace.basis``, checked to be the whole
   vector, or the last Linear's weight (row-major) then bias);
3. the GLM predictive: regression ``(f_mu, f_var (N, O, O)) = la(x)`` on both; classification
   the logit mean and covariance (laplace-torch's ``_glm_predictive_distribution``, ours
   `linearized_moments`) and the probit probabilities ``la(x, link_approx="probit")``;
4. the log marginal likelihood at the same ``λ`` (and ``σ``), then at other values passed to
   ``log_marginal_likelihood(λ', σ')``, after which the predictive variances (Σ re-formed from
   the written-back values, the curvature rescaled for ``σ'``) are compared again. laplace-torch's
   ``KronLLLaplace`` cannot evaluate its evidence with a layerwise ``λ`` (its
   ``prior_precision_diag`` raises); there it is assembled from its own terms (`_their_lml`).

What is not compared, and why:

- ``damping``: laplace-torch 0.3's ``KronLaplace(damping=True)`` loses the flag in
  ``posterior_precision`` (``KronDecomposed.__mul__`` and ``__add__`` build a new
  ``KronDecomposed`` without ``damping``), so its damped posterior, predictive and evidence are
  its undamped ones; its formula ``(l_G + √λ)(l_A + √λ)`` also has ``G`` a sum, not Ritter's
  ``G/√N`` and ``√N A``, and leaves a bias block undamped. Our ``damping="ritter"`` is instead
  checked against laplace-torch's damped ``KronDecomposed`` itself, built from the rescaled
  factors (`test_ritter_damping_is_laplace_torch_damped_kron_of_the_rescaled_factors`).
- ``kfac_approx="reduce"`` on the last layer: laplace-torch's last-layer Laplace refuses
  ``asdl_fisher_kwargs`` (a Linear last layer shares no weights, so the conventions coincide).
- ``fisher="mc"``: the draws of the two libraries differ (unbiasedness is checked in
  ``tests/test_kfac_curvature.py``); ``bias="augment"``: laplace-torch has no such block.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import likelihoods
from pyro_subspace.infer import Laplace, linearized_moments
from pyro_subspace.infer.laplace.posteriors import PriorPrecision

laplace = pytest.importorskip("laplace", reason="laplace-torch is a comparison, not a dependency")
pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
RTOL = 1e-6
N, SIGMA, LAM = 40, 0.3, 0.7
#: the second hyperparameters, passed to ``log_marginal_likelihood``
SIGMA2, LAM2 = 0.55, 2.5


def _mlp(sizes, act):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def _train(net, x, y, regression, steps=300):
    """A few hundred full-batch Adam steps (weight decay ``λ/N``: roughly the MAP of the prior);
    the comparison holds at any weights, training only makes the predictive non-trivial."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=LAM / len(x))
    loss_fn = nn.MSELoss() if regression else nn.CrossEntropyLoss()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
    return net.eval()


def _problem(kind):
    """``(net, x, y, x_test, task)``, float64, fixed seeds."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(0)
    if kind == "mlp-regression":
        x = torch.randn(N, 3, generator=gen, dtype=F64)
        y = torch.stack([torch.sin(2 * x[:, 0]), x[:, 1] * x[:, 2]], 1)
        y = y + 0.1 * torch.randn(N, 2, generator=gen, dtype=F64)
        net = _mlp([3, 12, 10, 2], nn.Tanh).double()
        x_test = torch.randn(9, 3, generator=gen, dtype=F64)
        return _train(net, x, y, True), x, y, x_test, "regression"
    if kind == "mlp-classification":
        x = torch.randn(N, 4, generator=gen, dtype=F64)
        y = (x @ torch.randn(4, 3, generator=gen, dtype=F64)).argmax(1)
        net = _mlp([4, 12, 10, 3], nn.ReLU).double()
        x_test = torch.randn(9, 4, generator=gen, dtype=F64)
        return _train(net, x, y, False), x, y, x_test, "classification"
    x = torch.randn(N, 1, 8, 8, generator=gen, dtype=F64)
    y = torch.stack([x[..., :4, :].sum((1, 2, 3)), x[..., 4:, :4].sum((1, 2, 3)),
                     x[..., 4:, 4:].sum((1, 2, 3))], 1).argmax(1)  # fmt: skip
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    x_test = torch.randn(9, 1, 8, 8, generator=gen, dtype=F64)
    return _train(net.double(), x, y, False), x, y, x_test, "classification"


def _backend(name):
    pytest.importorskip({"BackPackGGN": "backpack", "CurvlinopsGGN": "curvlinops"}[name])
    from laplace import curvature

    return getattr(curvature, name)


def _layerwise(n_tensors):
    """One ``λ`` per parameter tensor, all different."""
    return torch.tensor([LAM * 1.7**i for i in range(n_tensors)], dtype=F64)


def _ours_laplace(net, lik, subset, options):
    return Laplace(
        net, lik, subset, "kron", prior_precision=LAM, structure_options=options
    )  # fmt: skip


def _fit_both(kind, subset, prior, backend, approx, conv):
    net, x, y, x_test, task = _problem(kind)
    regression = task == "regression"
    cls = laplace.KronLaplace if subset == "all" else laplace.KronLLLaplace
    theirs = cls(
        copy.deepcopy(net),  # BackPack extends (hooks) the model it is given
        task, sigma_noise=SIGMA if regression else 1.0, prior_precision=LAM,
        backend=_backend(backend),
        asdl_fisher_kwargs=None if approx is None else {"kfac_approx": approx},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPack's and curvlinops' full-backward-hook notes
        theirs.fit(DataLoader(TensorDataset(x, y), batch_size=N))
    # σ as a float64 tensor: a Python float is stored in torch's default dtype (float32)
    lik = likelihoods.Gaussian(sigma=torch.tensor(SIGMA, dtype=F64)) if (
        regression
    ) else likelihoods.Categorical()  # fmt: skip
    ours = _ours_laplace(net, lik, subset, {"conv": conv, "fisher": "type-2"})
    if prior == "layerwise":
        lam = _layerwise(theirs.n_layers)
        theirs.prior_precision = lam  # KronLLLaplace knows its layers only after fit
        ours.prior_precision = lam  # before our fit: the model's prior, which the fit uses
    ours.fit(x, y)
    return net, x_test, regression, ours, theirs


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _glm(la, x, regression, ours):
    """``(f_mu, f_var (N, O, O)[, probit probabilities])`` of either library."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if regression:
            return la(x, pred_type="glm")
        if ours:
            f_mu, f_var = linearized_moments(la, x)
        else:
            f_mu, f_var = la._glm_predictive_distribution(x)
        return f_mu, f_var, la(x, pred_type="glm", link_approx="probit")


def _their_lml(theirs, lam=None, sigma=None):
    """laplace-torch's ``log_marginal_likelihood(λ, σ)``. ``KronLLLaplace`` takes a layerwise
    ``λ`` (its ``posterior_precision`` adds one per block) but its ``prior_precision_diag``
    knows only a scalar or a per-weight one (``ValueError``), which its evidence's prior terms
    read; there the evidence is assembled from laplace-torch's own terms, ``log_likelihood −
    ½ (log_det_posterior_precision − log|P₀| + scatter)``, with the layerwise ``P₀`` expanded
    over the last layer's parameter tensors."""
    if lam is not None:
        theirs.prior_precision = lam
    if sigma is not None:
        theirs.sigma_noise = sigma
    prior = torch.as_tensor(theirs.prior_precision).reshape(-1)
    if not (isinstance(theirs, laplace.KronLLLaplace) and len(prior) > 1):
        return theirs.log_marginal_likelihood()
    sizes = [p.numel() for p in theirs.model.last_layer.parameters()]
    diag = torch.cat([v * torch.ones(n, dtype=F64) for v, n in zip(prior, sizes)])
    delta = theirs.mean - theirs.prior_mean
    ratio = theirs.log_det_posterior_precision - diag.log().sum()
    return theirs.log_likelihood - 0.5 * (ratio + (delta * diag) @ delta)


def errors(kind, subset, prior, backend, approx, conv):
    """The relative differences, ours against laplace-torch, by quantity."""
    net, x_test, regression, ours, theirs = _fit_both(kind, subset, prior, backend, approx, conv)
    post, out = ours.guide.posterior, {}
    # coordinates: laplace-torch's parameter vector (all weights, or the last layer's)
    d = sum(p.numel() for p in net.parameters())
    k = theirs.n_params
    assert torch.equal(ours.model.subspace.basis.cpu(), torch.arange(d - k, d))
    # 1. eigenvalues of each G ⊗ A block (laplace-torch's H without 1/σ²), and the layout
    h_factor = float(theirs._H_factor)
    assert len(post.blocks()) == len(theirs.H.eigenvalues)
    eig, at = [], 0
    for block, ls in zip(post.blocks(), theirs.H.eigenvalues):
        n = block["gvals"].numel() * block["avals"].numel()
        assert torch.equal(block["pos"].cpu(), torch.arange(at, at + n)), (kind, at)
        at += n
        mine = torch.outer(block["gvals"], block["avals"]).reshape(-1).sort().values
        want = (ls[0] if len(ls) == 1 else torch.outer(ls[0], ls[1]).reshape(-1)) * h_factor
        eig.append(_rel(mine, want.sort().values))
    out["eigenvalues"] = max(eig)
    # 2. the posterior precision (and covariance) on random vectors, and dense
    v = torch.randn(5, k, dtype=F64, generator=torch.Generator().manual_seed(2))
    out["precision @ v"] = _rel(post.apply_precision(v), theirs.posterior_precision.bmm(v, exponent=1))
    out["covariance @ v"] = _rel(
        post.apply_covariance(v), theirs.posterior_precision.bmm(v, exponent=-1)
    )
    out["dense precision"] = _rel(post.precision(), theirs.posterior_precision.to_matrix())
    # 3. the GLM predictive
    mine, want = _glm(ours, x_test, regression, True), _glm(theirs, x_test, regression, False)
    out["f_mu"], out["f_var"] = _rel(mine[0], want[0]), _rel(mine[1], want[1])
    if not regression:
        out["probit"] = _rel(mine[2], want[2])
    # 4. the evidence, at (λ, σ) and then at (λ', σ') given to it (and written back)
    out["lml"] = _rel(ours.log_marginal_likelihood(), _their_lml(theirs))
    lam2 = torch.tensor(LAM2, dtype=F64) if prior == "scalar" else 2 * _layerwise(theirs.n_layers)
    sigma2 = torch.tensor(SIGMA2, dtype=F64) if regression else None
    out["lml(λ', σ')"] = _rel(
        ours.log_marginal_likelihood(lam2, sigma2), _their_lml(theirs, lam2, sigma2)
    )
    mine, want = _glm(ours, x_test, regression, True), _glm(theirs, x_test, regression, False)
    out["f_var(λ', σ')"] = _rel(mine[1], want[1])
    return out


def _ids(cases):
    return [
        f"{kind}-{subset}-{prior}-{backend}{'-' + approx if approx else ''}-conv={conv}"
        for kind, subset, prior, backend, approx, conv in cases
    ]


#: (problem, subset, prior, laplace-torch backend, its kfac_approx, our conv)
BACKENDS = {
    "mlp-regression": [("BackPackGGN", None, "backpack"), ("CurvlinopsGGN", None, "expand")],
    "mlp-classification": [("BackPackGGN", None, "backpack"), ("CurvlinopsGGN", None, "expand")],
    "cnn": [
        ("BackPackGGN", None, "backpack"),
        ("CurvlinopsGGN", None, "expand"),
        ("CurvlinopsGGN", "reduce", "reduce"),
    ],
}
CASES = [
    (kind, subset, prior, *backend)
    for kind, backends in BACKENDS.items()
    for subset in ("all", "last_layer")
    for prior in ("scalar", "layerwise")
    for backend in backends
    # laplace-torch's last-layer Laplace refuses asdl_fisher_kwargs (and its Linear last layer
    # shares no weights: every convention is the same there)
    if not (subset == "last_layer" and backend[1] is not None)
]


@pytest.mark.parametrize("kind, subset, prior, backend, approx, conv", CASES, ids=_ids(CASES))
def test_matches_laplace_torch_kron(kind, subset, prior, backend, approx, conv):
    errs = errors(kind, subset, prior, backend, approx, conv)
    bad = {key: value for key, value in errs.items() if not value < RTOL}
    assert not bad, bad


def test_conv_conventions_are_told_apart():
    """The CNN cases are not vacuous: a mismatched convention (our ``"expand"`` against
    ``BackPackGGN``) differs by far more than the tolerance."""
    errs = errors("cnn", "all", "scalar", "BackPackGGN", None, "expand")
    assert errs["eigenvalues"] > 1e-2 and errs["dense precision"] > 1e-2
    assert errs["lml"] > 1e-3


def test_ritter_damping_is_laplace_torch_damped_kron_of_the_rescaled_factors():
    """``damping="ritter"``: per block ``(G/√N + √λ I) ⊗ (√N A + √λ I)`` (Ritter et al. eq. 11;
    ``G`` a sum, ``A`` a mean, a bias block ``A = [1]``). laplace-torch's ``KronLaplace(
    damping=True)`` cannot be compared (module docstring), but its damped ``KronDecomposed``
    (``(l_1 + √δ)(l_2 + √δ)``) built from its own fitted eigenpairs with ``l_G/√N`` and
    ``√N l_A`` is the same matrix, log-determinant and covariance."""
    from laplace.utils.matrix import KronDecomposed

    net, x, y, _, _ = _problem("mlp-classification")
    theirs = laplace.KronLaplace(
        copy.deepcopy(net), "classification", prior_precision=LAM,
        backend=_backend("CurvlinopsGGN"),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.fit(DataLoader(TensorDataset(x, y), batch_size=N))
    root, one = math.sqrt(N), torch.ones(1, dtype=F64)
    vecs, vals = [], []
    for qs, ls in zip(theirs.H.eigenvectors, theirs.H.eigenvalues):
        q_a, l_a = (qs[1], ls[1]) if len(ls) == 2 else (one[:, None], one)  # a bias: A = [1]
        vecs.append([qs[0], q_a])
        vals.append([ls[0] / root, l_a * root])
    deltas = torch.full((len(vals),), LAM, dtype=F64)  # one per block (zip stops at the shortest)
    damped = KronDecomposed(vecs, vals, deltas=deltas, damping=True)
    ours = _ours_laplace(net, likelihoods.Categorical(), "all", {"damping": "ritter"}).fit(x, y)
    post = ours.guide.posterior
    assert _rel(post.precision(), damped.to_matrix()) < RTOL
    assert _rel(post.covariance(), damped.to_matrix(exponent=-1)) < RTOL
    log_det = post.log_det(PriorPrecision(torch.tensor(LAM, dtype=F64), None, post.dim))
    assert _rel(log_det, damped.logdet()) < RTOL
    # and it is not the undamped posterior that laplace-torch's damping=True returns
    assert _rel(post.precision(), theirs.posterior_precision.to_matrix()) > 1e-2
