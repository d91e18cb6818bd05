"""Tuning the prior precision ``λ`` of a Laplace posterior: one module for every posterior.

- ``"marglik"``: maximise the Laplace evidence over ``log λ`` (and ``log σ``) by L-BFGS
  (type-II maximum likelihood, MacKay 1992; Immer et al. 2021);
- ``"grid"``: the ``λ`` of `DEFAULT_GRID` (or yours) with the best linearised predictive
  log-likelihood of validation data (Subnetwork Inference tunes ``λ`` this way). The Jacobians of
  the validation inputs are computed once; each ``λ`` costs one factorisation.

One grid search serves every posterior: `grid_covariances` gives a posterior's linearised
outputs for every ``λ`` of the grid, `grid_scores` scores the mixture of one or more of them
(the validation log-likelihood and the mean confidence), `select_on_grid` picks by the
log-likelihood or by MoLA's confidence rule. `MixtureOfLaplace` tunes one ``λ`` shared by its
members with them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

from ... import heap
from ...data import as_tensors
from ...flat import FlatNet
from ...subspaces.last_layer import uses_features
from ...validation import check_int

#: The default grid of prior precisions, ``10^-4 … 10^4`` (33 values), for every posterior.
DEFAULT_GRID = torch.logspace(-4, 4, 33, dtype=torch.float64)
METHODS = ("marglik", "grid")


def _real_numbers(value: object, name: str, expected: str) -> torch.Tensor:
    """``value`` (a tensor, an array or a nested sequence of real numbers) as a tensor, or a
    ``TypeError`` naming ``name``: a string, a mapping, a ragged or mixed sequence, booleans or
    complex numbers are not numbers of a grid or labels of groups."""
    what = f"{type(value).__name__} {value!r}" if isinstance(value, (str, bytes)) else (
        type(value).__name__
    )
    if isinstance(value, (str, bytes, Mapping)):
        raise TypeError(f"{name}: expected {expected}, got {what}")
    try:
        values = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{name}: expected {expected}, got a {what} that is not an array of numbers"
        ) from None
    if values.dtype == torch.bool or values.is_complex():
        raise TypeError(f"{name}: expected {expected}, got dtype {values.dtype}")
    return values


def check_grid(grid: object) -> torch.Tensor:
    """``grid`` as positive finite float64 values (``None``: `DEFAULT_GRID`); a ``TypeError``
    (not numbers) or ``ValueError`` (empty, not positive or not finite) naming ``grid``."""
    if grid is None:
        return DEFAULT_GRID.clone()
    expected = "prior precisions: a tensor or sequence of positive numbers"
    grid = _real_numbers(grid, "grid", expected).to(torch.float64).reshape(-1)
    if grid.numel() == 0 or not bool(torch.isfinite(grid).all()) or bool((grid <= 0).any()):
        raise ValueError(f"grid: expected positive finite precisions, got {grid}")
    return grid


def _check_groups(groups: object, rank: int) -> torch.Tensor | None:
    """``groups`` as ``(rank,)`` int64 labels ``>= 0`` (``None`` stays ``None``)."""
    if groups is None:
        return None
    expected = f"({rank},) integer labels >= 0, one per coordinate"
    labels = _real_numbers(groups, "groups", expected)
    if labels.is_floating_point():
        raise TypeError(f"groups: expected {expected}, got dtype {labels.dtype}")
    if labels.shape != (rank,) or int(labels.min()) < 0:
        raise ValueError(f"groups: expected {expected}, got shape {tuple(labels.shape)}" + (
            f" and labels down to {int(labels.min())}" if labels.numel() else ""
        ))  # fmt: skip
    return labels.long()


def _check_adam(adam: object) -> tuple[int, float] | None:
    """``adam`` as ``(n_steps, lr)``: an int ``>= 1`` and a positive finite learning rate."""
    if adam is None:
        return None
    expected = "(n_steps, lr): an int >= 1 and a positive finite learning rate"
    if isinstance(adam, (str, bytes)) or not isinstance(adam, Sequence) or len(adam) != 2:
        raise TypeError(f"adam: expected {expected}, got {adam!r}")
    n_steps, lr = adam
    if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral):
        raise TypeError(f"adam: expected {expected}, got n_steps={n_steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"adam: expected {expected}, got lr={lr!r}")
    if n_steps < 1 or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"adam: expected {expected}, got {adam!r}")
    return int(n_steps), float(lr)


def grid_covariances(guide, x: torch.Tensor, chunk_size: int | None = None):
    """The linearised outputs of a fitted guide at ``x`` for every scalar ``λ`` of a grid:
    ``f_mean`` ``(N, O)`` and ``f_cov(λ)`` ``(N, O, O)`` (eqs. 11–12), the Jacobians computed
    once.

    The posterior sweeps ``λ`` in its own way (`Posterior.functional_covariance_on_grid`): the
    full structure with one eigendecomposition for the whole grid, the others by forming
    ``Σ(λ)`` per ``λ`` (a last layer from its features)."""
    guide._check_fitted()
    model, posterior = guide.model, guide.posterior
    sub = model.subspace
    chunk = guide.chunk_size if chunk_size is None else chunk_size
    w = sub.weights(guide.loc).detach()
    flat = FlatNet(model.flat.net, batch_strategy="loop")
    features = uses_features(sub, flat, x, w)
    blocks = list(
        sub.feature_blocks(flat, x, w, chunk) if features else sub.jacobian_blocks(flat, x, w, chunk)
    )
    f_mean = torch.cat([b[0] for b in blocks]).double()
    prior_at = lambda lam: posterior.effective_prior(guide.prior(lam))  # noqa: E731
    rows = sub.rows if features else None
    f_cov = posterior.functional_covariance_on_grid([b for _, b in blocks], prior_at, rows)
    # the pass's blocks, freed now, stay in the C heap beside the posterior's (K, K) matrices
    # (5 GB of 20.8 at the Subnetwork paper's K = 42,438): give them back once they are large
    nbytes = sum(b.numel() * b.element_size() for _, b in blocks)
    del blocks
    heap.trim_after(nbytes)
    return f_mean, f_cov


def grid_scores(members, weights, likelihood, y, grid, y_name: str = "y_val") -> torch.Tensor:
    """The one grid scorer: for each ``λ`` the mixture ``Σ_m π_m p_m(y | x)`` of the members'
    linearised predictives, its mean log-likelihood of ``y`` and its mean confidence (MMC;
    NaN for regression), ``(G, 2)`` float64. ``members``: ``(likelihood, f_mean, f_cov)`` per
    member (`grid_covariances`); one member of weight 1 scores a single Laplace posterior."""
    scores = []
    for lam in grid:
        comps = [
            lik.component(lik.predictive_from_moments(f_mean, f_cov(lam), "auto"))
            for lik, f_mean, f_cov in members
        ]
        comp = likelihood.stack_components(comps)
        loglik = likelihood.mixture_log_prob(weights, comp, y, y_name).mean()
        conf = likelihood.mixture_confidence(weights, comp)  # None for regression
        mmc = conf.mean() if conf is not None else loglik.new_tensor(math.nan)
        scores.append(torch.stack([loglik, mmc]))
    return torch.stack(scores)


def select_on_grid(grid: torch.Tensor, scores: torch.Tensor, threshold: float | None = None):
    """The ``λ`` a grid search picks from `grid_scores`: the best validation log-likelihood, or,
    with a ``threshold`` (MoLA's confidence rule, appendix F), the smallest ``λ`` whose mean
    confidence reaches it (the largest if none does)."""
    if threshold is None:
        return grid[int(scores[:, 0].argmax())]
    order = grid.argsort()
    ok = (scores[order, 1] >= threshold).nonzero()
    return grid[order[int(ok[0, 0])]] if ok.numel() else grid[order[-1]]


def validation_log_likelihood(guide, x, y, prior_precisions) -> torch.Tensor:
    """Mean linearised predictive log-likelihood of ``(x, y)`` per ``λ``, ``(G,)`` float64
    (`grid_scores` of the one guide)."""
    f_mean, f_cov = grid_covariances(guide, x)
    y = guide.likelihood.validate(f_mean, y)
    weights = torch.ones(1, dtype=torch.float64, device=f_mean.device)
    members = [(guide.likelihood, f_mean, f_cov)]
    return grid_scores(members, weights, guide.likelihood, y, prior_precisions, "y")[:, 0]


def optimize_prior_precision(
    guide,
    method: str = "marglik",
    *,
    optimize_sigma: bool | None = None,
    x_val: object = None,
    y_val: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    max_iter: int | None = None,
    groups: torch.Tensor | None = None,
    adam: tuple[int, float] | None = None,
) -> None:
    """Choose ``λ`` (and with ``optimize_sigma`` the noise ``σ``) for ``guide``; write it into
    the model's prior and update ``Σ``. ``t*`` is kept.

    ``optimize_sigma`` (a `Gaussian` likelihood only), ``max_iter`` (L-BFGS iterations, default
    100), ``groups`` and ``adam`` belong to ``"marglik"``; ``x_val``, ``y_val`` and ``grid`` to
    ``"grid"``. A keyword the chosen method does not use is an error, never silently ignored.

    ``groups`` ``(K,)``: integer labels ``0 … G−1``; one ``λ`` per label is tuned (laplace-torch's
    ``prior_structure="layerwise"`` labels the parameter tensors, ``"diag"`` every weight);
    ``None``: one ``λ``. ``adam`` ``(n_steps, lr)``: laplace-torch's schedule (Adam on
    ``log λ``) instead of L-BFGS to convergence."""
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    given = {
        "optimize_sigma": optimize_sigma, "max_iter": max_iter, "groups": groups, "adam": adam,
        "x_val": x_val, "y_val": y_val, "grid": grid,
    }  # fmt: skip
    unused = _UNUSED[method]
    for name, value in given.items():
        if name in unused and value is not None:
            raise TypeError(
                f"{name}: not used by method={method!r} ({_USED_BY[name]} only); leave it out"
            )
    if optimize_sigma is not None and optimize_sigma not in (True, False):
        raise TypeError(f"optimize_sigma: expected True or False, got {optimize_sigma!r}")
    if max_iter is not None:
        check_int(max_iter, "max_iter", 1)
    # the method's own arguments, before the validation data is read or anything is fitted
    grid = check_grid(grid) if method == "grid" else None
    groups = _check_groups(groups, guide.model.rank)
    adam = _check_adam(adam)
    if optimize_sigma and not hasattr(guide.likelihood, "sigma"):
        raise ValueError(
            f"optimize_sigma: the {type(guide.likelihood).__name__} likelihood has no noise σ "
            "to tune (a Gaussian likelihood has)"
        )
    guide._check_fitted()
    if method == "marglik":
        if adam is not None and max_iter is not None:
            raise TypeError("max_iter: L-BFGS's; with adam=(n_steps, lr) leave it out")
        _optimize_marglik(
            guide, bool(optimize_sigma), 100 if max_iter is None else max_iter, groups, adam
        )
    elif method == "grid":
        if x_val is None or (y_val is None and isinstance(x_val, torch.Tensor)):
            raise ValueError(
                "x_val, y_val: the grid method needs validation data: tensors, or a Dataset /"
                " DataLoader of (x, y) as x_val"
            )
        # width, dtype, device, NaN, labels: before any work, named as the caller's arguments
        guide.model.check_data(x_val, y_val, x_name="x_val", y_name="y_val")
        x_val, y_val = as_tensors(x_val, y_val)  # a Dataset / DataLoader: read once
        scores = validation_log_likelihood(guide, x_val, y_val, grid)
        guide.grid_scores = scores
        guide.set_prior_precision(select_on_grid(grid, scores[:, None]))


#: the keywords each method does not use, and which method uses each
_UNUSED = {
    "marglik": ("x_val", "y_val", "grid"),
    "grid": ("optimize_sigma", "max_iter", "groups", "adam"),
}
_USED_BY = {
    "optimize_sigma": "'marglik'", "max_iter": "'marglik'", "groups": "'marglik'",
    "adam": "'marglik'",
    "x_val": "'grid'", "y_val": "'grid'", "grid": "'grid'",
}  # fmt: skip


def _optimize_marglik(guide, optimize_sigma: bool, max_iter: int, groups=None, adam=None) -> None:
    lam0 = guide.prior_precision
    if groups is None:
        log_lam = lam0.mean().log().detach().clone().requires_grad_(True)
        expand = lambda v: v  # noqa: E731 - one λ
    else:
        groups = groups.to(guide.loc.device)  # (K,) int64 labels >= 0 (`_check_groups`)
        n_groups = int(groups.max()) + 1
        start = lam0.expand(guide.model.rank).double()
        sums = torch.zeros(n_groups, dtype=torch.float64, device=start.device)
        counts = torch.zeros_like(sums).index_add_(0, groups, torch.ones_like(start))
        log_lam = sums.index_add_(0, groups, start.log()) / counts.clamp_min(1)  # group means
        log_lam.requires_grad_(True)
        expand = lambda v: v[groups]  # noqa: E731 - one λ per group
    params = [log_lam]
    if optimize_sigma:
        log_sigma = torch.tensor(math.log(guide._scalar_sigma()), dtype=torch.float64)
        params.append(log_sigma.requires_grad_(True))

    def loss() -> torch.Tensor:
        sigma = params[1].exp() if optimize_sigma else None
        return -guide.log_marginal_likelihood(expand(log_lam.exp()), sigma)

    if adam is None:
        opt = torch.optim.LBFGS(params, max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            value = loss()
            value.backward()
            return value

        opt.step(closure)
    else:
        n_steps, lr = adam  # checked (`_check_adam`)
        opt = torch.optim.Adam(params, lr=lr)
        for _ in range(n_steps):
            opt.zero_grad()
            loss().backward()
            opt.step()
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise FloatingPointError("optimize_prior_precision: the evidence diverged")
    if optimize_sigma:
        guide.set_sigma(float(params[1].detach().exp()))
    guide.set_prior_precision(expand(log_lam.detach().exp()))
