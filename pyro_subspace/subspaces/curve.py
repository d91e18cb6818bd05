"""Curve subspaces (Subspace Inference appendix C.3; Garipov et al., 2018).

Two independently trained solutions ``w0`` and ``w1`` are joined by a quadratic Bezier curve

    φ(s) = (1 − s)² w0 + 2 s (1 − s) θ + s² w1,     s ∈ [0, 1],

whose control point ``θ`` is trained by minimising the expected training loss over
``s ~ U[0, 1]`` (`fit_curve`). The curve lies in the 2-D affine plane through ``w0, θ, w1``;
`curve` returns that plane as a `Subspace` with the paper's prior ``N(μ, σ² I)``,
``μ = (w0 + φ(½) + w1)/3``, ``σ = ‖μ − w0‖``, written as ``w = μ + σ Q t`` with ``Q``
orthonormal so that `SubspaceNet`'s standard prior ``t ~ N(0, I_2)`` is exactly that prior.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import validation as ck
from ..flat import FlatNet, eval_mode, preserved
from ..likelihoods import Likelihood, check_likelihood
from ..minibatch import minibatch_loop, shuffle_generator
from .base import Subspace


def bezier(
    w0: torch.Tensor, theta: torch.Tensor, w1: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    """Points ``φ(s)`` of the quadratic Bezier curve, shape ``(*s.shape, D)`` (``s`` in [0, 1])."""
    s = s[..., None]
    return (1 - s) ** 2 * w0 + 2 * s * (1 - s) * theta + s**2 * w1


def _check_points(w0: torch.Tensor, theta: torch.Tensor, w1: torch.Tensor) -> None:
    """Three finite float vectors of one shape ``(D,)``, and end points that differ (beyond
    rounding: ``‖w1 − w0‖ > 100 ε max(‖w0‖, ‖w1‖)``): a curve joins two solutions."""
    for name, w in (("w0", w0), ("theta", theta), ("w1", w1)):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 1:
            raise ValueError(f"{name}: expected a floating-point tensor of shape (D,)")
        if w.shape != w0.shape:
            raise ValueError(f"{name}: shape {tuple(w.shape)} differs from w0's {tuple(w0.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError(f"{name}: contains NaN or inf")
    tol = 100 * torch.finfo(w0.dtype).eps * max(float(w0.norm()), float(w1.norm()))
    if float((w1 - w0).norm()) <= tol:
        raise ValueError(
            "w1: equals w0 (to rounding); a curve joins two different solutions: train a second "
            "network (another seed) for w1"
        )


def _check_problem(net, likelihood, x, y, w0, theta, w1) -> tuple[FlatNet, torch.Tensor]:
    """The checks `fit_curve` and `curve_losses` share, before their work: the likelihood, the
    points, the data against the network and the targets against its output width (one row's
    forward pass). Returns the network's `FlatNet` and the targets as the likelihood takes
    them."""
    check_likelihood(likelihood)
    ck.check_tensor(w0, "w0", floating=True), ck.check_tensor(w1, "w1", floating=True)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor of inputs (N, ...), got {type(x).__name__}")
    ck.check_data(net, x, y, likelihood, require_y=True, dtype=w0.dtype)
    flat = FlatNet(net, batch_strategy="loop")
    if w0.shape != (flat.num_weights,):
        raise ValueError(
            f"w0: expected shape ({flat.num_weights},) for this network, got {tuple(w0.shape)}"
        )
    _check_points(w0, theta, w1)
    with torch.no_grad(), eval_mode(net):
        probe = flat(w0, x[:1])  # only the output width is needed to check the targets
    probe = probe.unsqueeze(-1) if probe.dim() == 1 else probe
    return flat, likelihood.validate(probe.new_zeros(x.shape[0], *probe.shape[1:]), y)


def curve(w0: torch.Tensor, theta: torch.Tensor, w1: torch.Tensor) -> Subspace:
    """The 2-D curve subspace with the prior of paper C.3 folded into shift and basis.

    Args:
        w0, w1: the two end points (trained solutions), shape ``(D,)``.
        theta: the trained control point, shape ``(D,)``.

    Returns:
        A dense `Subspace` with shift ``μ = (w0 + φ(½) + w1)/3`` and basis ``σ Q`` (``D × 2``),
        ``Q`` an orthonormal basis of span{w1 − w0, θ − w0} and ``σ = ‖μ − w0‖``: under
        ``t ~ N(0, I_2)`` the weights are ``N(μ, σ² I)`` on the plane through w0, θ, w1.
    """
    _check_points(w0, theta, w1)
    directions = torch.stack([w1 - w0, theta - w0], dim=1).double()  # shape: (D, 2)
    q, r = torch.linalg.qr(directions)
    tol = 100 * torch.finfo(w0.dtype).eps * r.diagonal().abs().max()
    if r.diagonal().abs().min() <= tol:
        raise ValueError("theta: w0, theta and w1 are collinear; the curve spans no plane")
    mid = bezier(w0, theta, w1, torch.tensor(0.5, dtype=w0.dtype))
    mu = (w0 + mid + w1) / 3
    sigma = (mu - w0).norm()
    return Subspace(mu, (q * sigma).to(w0.dtype))


def curve_losses(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    y: torch.Tensor,
    w0: torch.Tensor,
    theta: torch.Tensor,
    w1: torch.Tensor,
    num_points: int = 21,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean training loss ``−mean_n log p(y_n | f(x_n; w))`` along the curve and the line.

    At each evaluated point the BatchNorm statistics are recomputed from ``x`` (a train-mode
    pass) before the loss is taken in eval mode; the network's own buffers are restored.

    Args:
        net, likelihood, x, y, w0, w1: as in `fit_curve`.
        theta: the control point `fit_curve` trained, shape ``(D,)``.
        num_points: the points ``s`` evaluated, evenly spaced over ``[0, 1]`` (at least the
            two ends).

    Returns:
        ``(s, curve_loss, line_loss)``, each of shape ``(num_points,)``; the line is
        ``(1 − s) w0 + s w1``.
    """
    ck.check_int(num_points, "num_points", 2)
    flat, y = _check_problem(net, likelihood, x, y, w0, theta, w1)
    s = torch.linspace(0, 1, num_points, dtype=w0.dtype)
    curve_w = bezier(w0, theta, w1, s)
    line_w = (1 - s)[:, None] * w0 + s[:, None] * w1

    def loss(w: torch.Tensor) -> float:
        flat.recompute_batchnorm(w, x)  # the statistics at w, one full-batch pass
        out = flat(w, x)
        out = out.unsqueeze(-1) if out.dim() == 1 else out
        return -likelihood.log_prob(out, y).mean().item()

    with torch.no_grad(), preserved(net, buffers=True):
        net.eval()
        results = [torch.tensor([loss(w) for w in ws]) for ws in (curve_w, line_w)]
    return s, results[0], results[1]


def fit_curve(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    y: torch.Tensor,
    w0: torch.Tensor,
    w1: torch.Tensor,
    *,
    epochs: int = 200,
    lr: float = 1e-2,
    batch_size: int | None = None,
    weight_decay: float = 0.0,
    seed: int | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """Train the Bezier control point ``θ`` between ``w0`` and ``w1`` (Garipov et al., 2018).

    Minimises ``E_{s ~ U[0,1]} [−mean_n log p(y_n | f(x_n; φ(s)))] + (λ/2)‖θ‖²`` with Adam, one
    ``s`` per minibatch, starting from the midpoint ``(w0 + w1)/2``. In networks with BatchNorm
    the training passes use batch statistics; the network's own buffers and modes are restored.

    Args:
        net: the architecture of ``w0`` and ``w1``; its parameters are not changed.
        likelihood: the `Likelihood` whose `log_prob` is the loss.
        x, y: training data ``(N, ...)`` and ``(N,)``.
        w0, w1: the end points, shape ``(D,)`` in ``parameters_to_vector`` order.
        epochs, lr, batch_size, weight_decay, seed, progress: training settings.

    Returns:
        ``θ``, shape ``(D,)``; the curve passes through ``w0`` (s = 0) and ``w1`` (s = 1) exactly.
    """
    ck.positive_int(epochs, "epochs"), ck.positive_float(lr, "lr")
    ck.positive_int(batch_size, "batch_size", allow_none=True)
    ck.positive_float(weight_decay, "weight_decay", allow_zero=True)
    ck.check_int(seed, "seed", 0, allow_none=True)
    ck.choice(progress, "progress", (True, False))
    flat, y = _check_problem(net, likelihood, x, y, w0, w0, w1)  # theta starts at the midpoint
    n = x.shape[0]
    gen = shuffle_generator(seed)
    w0, w1 = w0.detach(), w1.detach()
    theta = ((w0 + w1) / 2).clone().requires_grad_(True)

    def step(idx: torch.Tensor) -> torch.Tensor:
        s = torch.rand((), generator=gen, dtype=w0.dtype)  # one point of the curve per minibatch
        out = flat(bezier(w0, theta, w1, s), x[idx])
        out = out.unsqueeze(-1) if out.dim() == 1 else out
        return -likelihood.log_prob(out, y[idx]).mean()

    with preserved(net, buffers=True):
        net.train()
        minibatch_loop(
            step,
            n,
            epochs=epochs,
            batch_size=batch_size,
            generator=gen,
            optimizer=torch.optim.Adam([theta], lr=lr, weight_decay=weight_decay),
            device=x.device,
            desc="fit_curve",
            progress=progress,
        )
    return theta.detach()
