"""The far-away confidence bound of MoLA (Eschenhagen et al., 2021, B.1: Lemma 1 and Theorem 2),
extended to a last layer with a bias.

Setting. A last-layer Laplace member ``k`` has, for each class ``i``, a Gaussian over the row
``θ_i = [w_i, β_i]`` of the last ``nn.Linear`` (weights ``w_i`` ``(P,)``, bias ``β_i`` if the
layer has one) with mean ``ν_i = [μ_i, μ_βi]`` and covariance ``S_i`` (the ``(i, i)`` block of
``Σ^(k)``, taken at ``rows[i]`` of the `LastLayerSubspace`)

    S_i = [[Σ_(i),  s_i],
           [s_iᵀ,   v_i]],     Σ_(i) = Cov(w_i), the weight block (marginal over the bias).

The probit (eq. 6) uses only ``m_i = ν_iᵀψ`` and ``C_ii = ψᵀ S_i ψ`` with ``ψ = [φ(x), 1]``.

Asymptotic bound (``kind="asymptotic"``). For a piecewise-affine (ReLU) feature map
``φ(δx) = δ a + c`` once ``δx`` is in its last linear region (Hein et al., 2019, Lemma 3 in the
paper), hidden-layer biases included. Then ``m_i = δ μ_iᵀa + O(1)`` and
``C_ii = δ² aᵀΣ_(i)a + O(δ)``: the bias row ``(s_i, v_i)`` enters only the ``O(δ)`` and ``O(1)``
terms, so for ``a ≠ 0``

    lim_{δ→∞} z_i(δx) = μ_iᵀa / √(π/8 · aᵀΣ_(i)a),
    |lim z_i| ≤ ‖μ_i‖ / √(π/8 · λ_min(Σ_(i))) =: b_i                (eq. 11 with the weight block)

by Cauchy–Schwarz and ``aᵀΣa ≥ λ_min‖a‖²``. With Lemma 1's softmax step and Theorem 2's mixture
(linearity of eq. 9),

    limsup_{δ→∞} max_c p_MoLA(y = c | δx) ≤ Σ_k π^(k) max_c 1 / (1 + Σ_{i≠c} exp(−(b_i^(k) + b_c^(k)))).

Without biases anywhere this is exactly the paper's Theorem 2 and holds for all ``δ ≥ α``
(``|z_i|`` increases in ``δ``, its Lemma 4). With biases it is a statement about the limit: at
finite ``δ`` the confidence may exceed it by ``O(1/δ)`` (``≈ 1.04/δ`` in the extremal example
of `tests/test_mixture_laplace.py`, where the limit meets the bound to ``2·10⁻⁸``); and inputs
with ``a = 0`` (every unit dead along ``x``) tend to a constant output the bound does not cover.

Uniform bound (``kind="uniform"``). For *every* input, at any ``δ``: ``|m_i| ≤ ‖ν_i‖‖ψ‖`` and
``C_ii ≥ λ_min(S_i)‖ψ‖²`` (``‖ψ‖ ≥ 1`` with the bias entry), so

    |z_i| ≤ ‖ν_i‖ / √(π/8 · λ_min(S_i)) =: b̃_i

and the same expression with ``b̃`` bounds the confidence everywhere. ``b̃_i ≥ b_i`` (Cauchy
interlacing: ``λ_min(S_i) ≤ λ_min(Σ_(i))``; ``‖ν_i‖ ≥ ‖μ_i‖``), so it is the looser of the two.

Why the bound is ≈ 1 at the tuned ``λ`` of the digits benchmarks (`benchmarks/mola_vs_de.py`):
the precision is ``⪰ λI``, so ``λ_min(Σ_(i)) ≤ λ_max(Σ_(i)) ≤ 1/λ`` and ``b_i ≥ ‖μ_i‖·√(8λ/π)``.
There ``‖μ_i‖ ≈ 1.3–1.45`` and the confidence rule of the paper's Appendix F picks
``λ ≈ 28–1000`` (the MLPs are nearly calibrated in distribution, so little spread is allowed):
the measured ``b_i`` are 16–69 and the bound is ``1 − O(e^{−32})``. For ``C = 10`` it drops below 0.99 only if ``b_i + b_c ≲
log(9/0.0101) ≈ 6.8``, which needs ``λ ≲ π/8·(3.4/‖μ‖)² ≈ 2–3``. It is not looseness alone: the
probit confidence at ``δ = 1e6`` is above 0.999 for most test digits. (At ``λ → 0`` the ``b_i``
do become small, 0.1 at ``λ = 1e-4``: the softmax is invariant to adding one vector to every
row, a direction the GGN does not see, so each row keeps a prior variance ``≳ 1/(Cλ)``, which
the per-logit probit counts although the softmax ignores it.)
"""

from __future__ import annotations

import math

import torch

from .mixture_laplace import MixtureOfLaplace

__all__ = ["far_away_confidence_bound", "far_away_terms"]

KINDS = ("asymptotic", "uniform")


def _member_blocks(model, guide) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
    """Row means ``(C, P̃)`` and row covariances ``C × (P̃, P̃)`` of one member; ``has_bias``."""
    sub = model.subspace
    rows = getattr(sub, "rows", None)
    if sub.kind != "last_layer" or rows is None:
        raise ValueError(
            "mola: the bound of MoLA B.1 needs subset='last_layer' on a final nn.Linear"
        )
    cov = guide.posterior.covariance()  # (K, K): dense for every structure
    theta = sub.shift[sub.basis].double() + guide.loc.detach().double()
    means = theta[rows]  # (C, P̃)
    blocks = [cov[r[:, None], r[None, :]].double() for r in rows]
    layer = model.flat.net.get_submodule(sub.layer_name)
    return means, blocks, layer.bias is not None


def far_away_terms(mola, kind: str = "asymptotic") -> list[dict[str, torch.Tensor]]:
    """Per member, the ingredients of the bound: ``norm`` ``‖μ_i‖`` (``‖ν_i‖`` for
    ``"uniform"``), ``lambda_min`` ``λ_min(Σ_(i))`` (``λ_min(S_i)``), ``lambda_max`` and
    ``b`` ``(C,)`` float64 each (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if not isinstance(mola, MixtureOfLaplace):
        raise TypeError(
            f"mola: expected a fitted MixtureOfLaplace or LastLayerLaplace, got "
            f"{type(mola).__name__}"
        )
    mola._check_fitted()
    out = []
    for model, guide in mola.members:
        means, blocks, has_bias = _member_blocks(model, guide)
        if kind == "asymptotic" and has_bias:  # the weight block, marginal over the bias
            means, blocks = means[:, :-1], [b[:-1, :-1] for b in blocks]
        eig = torch.stack([torch.linalg.eigvalsh(b) for b in blocks])  # (C, P̃) ascending
        norm = means.norm(dim=1)
        lam_min = eig[:, 0]
        if bool((lam_min <= 0).any()):
            raise FloatingPointError("mola: a row covariance is not positive definite")
        b = norm / (math.pi / 8 * lam_min).sqrt()
        out.append({"norm": norm, "lambda_min": lam_min, "lambda_max": eig[:, -1], "b": b})
    return out


def far_away_confidence_bound(mola, kind: str = "asymptotic") -> float:
    """The far-away confidence bound of MoLA Theorem 2 (Lemma 1 for ``K = 1``), section B.1,
    for a last layer with or without a bias.

    ``kind="asymptotic"`` (default), for inputs ``δx`` with ``δ → ∞`` (``a ≠ 0``, see the
    module docstring):

        limsup max_c p_MoLA(y = c | δx) ≤ Σ_k π^(k) max_c 1 / (1 + Σ_{i≠c} exp(−(b_i^(k) + b_c^(k)))),
        b_i^(k) = ‖μ_(i)^(k)‖ / √(π/8 · λ_min(Σ_(i)^(k))),

    ``μ_(i)``, ``Σ_(i)`` the posterior mean and covariance of the weights of row ``i`` (the
    weight block, the bias marginalised out). Without any bias in the network it holds for all
    ``δ ≥ α`` (the paper's statement); with biases in the limit.

    ``kind="uniform"``: the same expression with ``b̃_i = ‖[μ_i, μ_βi]‖ / √(π/8 · λ_min(S_i))``
    over the augmented row ``[w_i, β_i]``; it bounds the probit confidence at every input.

    (The paper states the bound for the predicted class ``c_*``; the max over ``c`` bounds any
    class.) ``mola``: a fitted last-layer `MixtureOfLaplace` / `LastLayerLaplace` with the
    default full covariance. Returns a float in ``[1/C, 1]``.
    """
    terms_k = far_away_terms(mola, kind)  # checks its arguments first
    total = 0.0
    for pi, terms in zip(mola.weights.tolist(), terms_k):
        b = terms["b"]
        c = b.shape[0]
        if c == 1:  # one logit (Bernoulli): max(p, 1 − p) ≤ sigmoid(b)
            total += pi * float(torch.sigmoid(b[0]))
            continue
        off = torch.exp(-(b[:, None] + b[None, :])) * (
            1 - torch.eye(c, dtype=b.dtype, device=b.device)
        )
        total += pi * float((1 / (1 + off.sum(1))).max())
    return total
