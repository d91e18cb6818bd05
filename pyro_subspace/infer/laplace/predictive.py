"""The linearised (GLM) predictive of a Laplace guide, Subnetwork Inference eqs. (11)–(13).

``f(x, ŵ + P t) ≈ f(x, w*) + J_P(x)(t − t*)`` with ``t ~ N(t*, Σ)`` gives Gaussian outputs
``N(f(x, w*), J_P Σ J_Pᵀ)`` (`linearized_moments`); the likelihood turns them into a predictive
distribution (closed form, probit or Monte Carlo: `Likelihood.predictive_from_moments`).
"""

from __future__ import annotations

import torch
from pyro.infer.autoguide import AutoGuide

from ... import batch as batching
from ... import validation as ck
from ...data import DataSource
from ...flat import FlatNet


def _check_guide(guide: object):
    """The fitted Laplace guide of ``guide``: itself, or the ``laplace_guide`` of the object
    `infer.Laplace` returns."""
    guide = getattr(guide, "laplace_guide", guide)
    # a Laplace guide: fitted state (`_check_fitted`) and a `Posterior`
    if not (callable(getattr(guide, "_check_fitted", None)) and hasattr(guide, "posterior")):
        raise TypeError(
            f"guide: expected an AutoSubspaceLaplace (e.g. from infer.Laplace), "
            f"got {type(guide).__name__}"
        )
    guide._check_fitted()
    return guide


def linearized_moments(
    guide: AutoGuide,
    x: torch.Tensor,
    chunk_size: int | None = None,
    diagonal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance of the linearised outputs (eqs. 11–12).

    Args:
        guide: a fitted `AutoSubspaceLaplace` (any structure and subspace kind).
        x: inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)`` (its inputs in its
            order; the targets are not used).
        chunk_size: rows per Jacobian block (default the guide's).
        diagonal: fill only the variances ``C_oo`` (all that the probit and regression
            predictives use); the other entries are 0.

    Returns:
        ``f_mean`` ``(N, O)`` and ``f_cov`` ``(N, O, O)``, float64 (``J_P Σ J_Pᵀ`` is computed
        in the posterior's dtype: float32 for a float32 network's full structure,
        `AutoSubspaceLaplace`).
    """
    f_mean, f_cov = _moments(_check_guide(guide), x, chunk_size, diagonal)
    return f_mean, torch.diag_embed(f_cov) if diagonal else f_cov


def joint_moments(
    guide: AutoGuide, x: torch.Tensor, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint linearised predictive over all the rows of ``x`` (laplace-torch's
    ``joint=True``, the GP form ``N([f(x_1), …], Cov[f(x_1), …])``): ``f_mean`` ``(N·O,)`` and
    ``J Σ Jᵀ`` ``(N·O, N·O)``, float64, ``J`` ``(N·O, K)`` the stacked Jacobians of the
    subspace's coordinates (eqs. 11–12 over every pair of points). Memory ``N·O·(K + N·O)``:
    for a few hundred test points, as laplace-torch's."""
    guide = _check_guide(guide)
    guide.model.check_data(x)
    ck.positive_int(chunk_size, "chunk_size", allow_none=True)
    chunk = guide.chunk_size if chunk_size is None else chunk_size
    model, posterior = guide.model, guide.posterior
    w = model.subspace.weights(guide.loc).detach()
    flat = FlatNet(model.flat.net, batch_strategy="loop")
    inputs = [x] if isinstance(x, torch.Tensor) or batching.is_mapping(x) else DataSource(x, None, chunk).inputs()
    outs, jacs = [], []
    for xc in inputs:
        for out, jp in model.subspace.jacobian_blocks(flat, xc, w, chunk):
            outs.append(out.double()), jacs.append(jp)
    jac = torch.cat(jacs).to(posterior.buffer_dtype)  # (N, O, K)
    n, o, k = jac.shape
    f_cov = posterior.functional_covariance(jac.reshape(1, n * o, k))[0]
    return torch.cat(outs).reshape(-1), f_cov.double()


def differentiable_moments(
    guide: AutoGuide, x: torch.Tensor, joint: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The linearised predictive's moments as differentiable functions of the inputs
    (laplace-torch's ``enable_backprop=True``: acquisition functions of Bayesian optimisation
    take gradients in ``x``): ``f(x)`` ``(N, O)`` and ``J Σ Jᵀ`` ``(N, O, O)`` (``joint``:
    ``(N·O,)`` and ``(N·O, N·O)``), ``J = ∂f/∂t`` ``(N, O, K)`` by ``torch.func.jacrev`` in the
    coordinates at ``t*`` with the graph to ``x`` kept, ``J Σ Jᵀ`` by the structure's own
    `Posterior.functional_covariance` (differentiable in ``J``)."""
    guide = _check_guide(guide)
    guide.model.check_data(x)
    model = guide.model
    t0 = guide.loc.detach().to(model.subspace.shift.dtype)

    def outputs(t: torch.Tensor) -> torch.Tensor:
        return model.outputs(t, x)

    jac = torch.func.jacrev(outputs)(t0)  # (N, O, K), differentiable in x
    f_mean = outputs(t0)
    # the structure's own J Σ Jᵀ (K-FAC: per layer in its eigenbasis, never the K × K Σ, which
    # took 1.6 s a call for 2751 weights in laplace-torch's Bayesian-optimisation example)
    if joint:
        flat_jac = jac.reshape(1, -1, jac.shape[-1])  # (1, N·O, K)
        return f_mean.reshape(-1), guide.posterior.functional_covariance(flat_jac)[0]
    return f_mean, guide.posterior.functional_covariance(jac)


def linearized_variances(
    guide: AutoGuide, x: torch.Tensor, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``f_mean`` ``(N, O)`` and the variances ``diag(J_P Σ J_Pᵀ)`` ``(N, O)``, float64: what
    the probit and the Gaussian closed form read (`linearized_moments` with only these; no
    ``N × O × O`` array, so a last layer of many classes predicts in ``O(N·C)`` memory)."""
    return _moments(_check_guide(guide), x, chunk_size, True)


def _moments(guide, x, chunk_size: int | None, variances: bool):
    """``f_mean`` ``(N, O)`` and ``J Σ Jᵀ`` ``(N, O, O)`` (its variances ``(N, O)`` with
    ``variances``) of a checked, fitted guide (`Posterior.linearized_outputs`)."""
    guide.model.check_data(x)
    ck.positive_int(chunk_size, "chunk_size", allow_none=True)
    chunk = guide.chunk_size if chunk_size is None else chunk_size
    w = guide.model.subspace.weights(guide.loc).detach()
    if isinstance(x, torch.Tensor) or batching.is_mapping(x):
        return guide.posterior.linearized_outputs(guide.model, x, w, chunk, variances)
    # a Dataset / DataLoader: its batches in its order, each as it comes (batches padded to
    # different lengths are never concatenated), the moments joined along the rows
    parts = [
        guide.posterior.linearized_outputs(guide.model, xc, w, chunk, variances)
        for xc in DataSource(x, None, chunk).inputs()
    ]
    return torch.cat([m for m, _ in parts]), torch.cat([c for _, c in parts])


def linearized_predictive(
    guide: AutoGuide,
    x: torch.Tensor,
    link_approx: str = "auto",
    num_samples: int = 1000,
    seed: int | None = 0,
    include_noise: bool = True,
    chunk_size: int | None = None,
):
    """The linearised (GLM) posterior predictive (eqs. 11–13) as a ``torch.distributions``
    object: ``Normal`` ``(N, O)`` for regression (``J_P Σ J_Pᵀ + σ²``), ``Categorical``
    ``(N,)`` (``.probs`` ``(N, C)``) or ``Bernoulli`` ``(N,)`` for classification.

    Args:
        guide: a fitted `AutoSubspaceLaplace`.
        x: inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` (its inputs, `linearized_moments`).
        link_approx: ``"auto"``, ``"closed_form"`` (regression), ``"probit"`` (the
            classification default, MoLA eq. 6) or ``"mc"``.
        num_samples: Monte Carlo draws of the outputs per input (``"mc"``).
        seed: seed of those draws (``None``: torch's global generator).
        include_noise: add the observation noise (regression).
        chunk_size: rows per Jacobian block.
    """
    guide = _check_guide(guide)
    ck.positive_int(num_samples, "num_samples"), ck.check_int(seed, "seed", 0, allow_none=True)
    lik = guide.likelihood
    link_approx = lik.check_link_approx(link_approx)
    # the variances alone where the link reads nothing else (no N x O x O array)
    f_mean, f_cov = _moments(guide, x, chunk_size, link_approx in lik.diagonal_links)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=f_mean.device).manual_seed(seed)
    return lik.predictive_from_moments(f_mean, f_cov, link_approx, num_samples, gen, include_noise)


def probit(f_mean: torch.Tensor, f_cov: torch.Tensor, likelihood) -> torch.Tensor:
    """(Multi-class) probit approximation of ``E[softmax(f)]`` for ``f ~ N(f_mean, f_cov)``:
    ``softmax(f_c / √(1 + π/8 · Σ_cc))`` (MoLA eq. 6); ``(N, C)`` or ``(N,)`` for Bernoulli."""
    return likelihood.predictive_from_moments(f_mean, f_cov, "probit").probs
