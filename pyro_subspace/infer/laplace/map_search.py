"""The MAP search of `AutoSubspaceLaplace.fit`: L-BFGS, then exact-Newton steps, and the
warning when it did not converge (split from `guide` to keep modules short)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ...exceptions import ConvergenceWarning


def _find_map(
    objective: Callable, t: torch.Tensor, max_iter: int, tol: float
) -> tuple[torch.Tensor, int, bool]:
    """L-BFGS with a strong-Wolfe line search on ``objective(t) -> (loss, grad)``; returns the
    point, the iterations run and whether the budget (iterations or evaluations) ran out."""
    t = t.clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [t], max_iter=max_iter, tolerance_grad=tol, tolerance_change=1e-15, history_size=20,
        line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure() -> torch.Tensor:
        loss, t.grad = objective(t)
        return torch.tensor(loss, dtype=torch.float64)

    opt.step(closure)
    state = opt.state[opt._params[0]]
    iterations, evaluations = int(state.get("n_iter", 0)), int(state.get("func_evals", 0))
    used_up = iterations >= max_iter or evaluations >= opt.defaults["max_eval"]
    return t.detach(), iterations, used_up


def _newton(
    objective: Callable, t: torch.Tensor, grad: torch.Tensor, ev, prior, steps: int, tol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``steps`` Newton steps ``t − (∇²nll + Λ₀)⁻¹ ∇`` while a gradient entry exceeds
    ``tol``; a step is kept only if the loss does not rise beyond rounding and the largest
    gradient entry falls (near a minimum the loss no longer resolves the decrease, the
    gradient does). Stops at the first refused step or non-positive-definite Hessian."""
    loss = objective(t)[0]
    for _ in range(steps):
        if float(grad.abs().max()) <= tol:
            break
        hessian = ev.hessian(t) + prior.matrix
        chol, info = torch.linalg.cholesky_ex(hessian)
        if info != 0:  # not at a minimum's basin: leave it to the warning
            break
        t_new = t - torch.cholesky_solve(grad[:, None], chol)[:, 0]
        loss_new, grad_new = objective(t_new)
        if loss_new > loss + 1e-12 * (1 + abs(loss)) or grad_new.abs().max() >= grad.abs().max():
            break
        t, grad, loss = t_new, grad_new, loss_new
    return t, grad


#: modules whose output is piecewise linear in their input: a loss built from them has kinks,
#: and a minimum on a kink need not have a zero gradient
KINKED = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.RReLU,
    nn.Hardtanh,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.Hardshrink,
    nn.Softshrink,
    nn.Threshold,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)


def has_kinks(net: nn.Module) -> bool:
    """Whether ``net`` has a piecewise-linear module (`KINKED`; functional calls such as
    ``F.relu`` inside a custom ``forward`` are not seen)."""
    return any(isinstance(m, KINKED) for m in net.modules())


#: a MAP search whose Newton decrement ``√(∇ᵀ Σ ∇)`` is at most this is not warned about:
#: ``t*`` is then within a thousandth of a posterior standard deviation of the MAP (the KL
#: divergence between the two Gaussians is below ``5e-7``), e.g. a float32 search stopped by
#: rounding with a gradient far above ``tol``
NEGLIGIBLE_OFFSET = 1e-3


def posterior_offset(guide, grad: torch.Tensor) -> float | None:
    """``√(∇ᵀ Σ ∇)``, the Newton decrement of the fitted guide at ``t*``: how many posterior
    standard deviations (Mahalanobis) a Gauss–Newton step would still move ``t*``
    (`Posterior.newton_decrement`)."""
    return guide.posterior.newton_decrement(grad)


def _warn_unconverged(
    grad: torch.Tensor,
    tol: float,
    iterations: int,
    max_iter: int | None,
    dtype: torch.dtype,
    kinked: bool = False,
    offset: float | None = None,
) -> None:
    """Warn (`ConvergenceWarning`) unless every gradient entry at ``t*`` is below ``tol`` or
    the Newton decrement ``offset`` (`posterior_offset`) is at most `NEGLIGIBLE_OFFSET`;
    ``max_iter`` is given when the search ran out of its budget; ``kinked``: the network has
    piecewise-linear modules (`has_kinks`), named as a second cause in float32."""
    reached = float(grad.abs().max())
    if reached <= tol or (offset is not None and offset <= NEGLIGIBLE_OFFSET):
        return
    if max_iter is not None:
        why = f"the budget of max_iter={max_iter} iterations ran out"
        how = "raise max_iter (e.g. fit(x, y, max_iter=5000)) or newton_steps"
    elif dtype != torch.float64:
        why = f"the loss stopped decreasing in {dtype} after {iterations} iterations"
        how = "fit a float64 network (net.double() with float64 x and y): float32 rounding"
        how += " keeps the gradient far above tol"
        if kinked:  # float64 alone would not help there: say so before the user tries it
            how += (
                "; the network's ReLU-type modules can also put the minimum on a kink, where"
                " the gradient need not vanish even in float64 (a smooth activation or a"
                " last-layer subspace helps)"
            )
    else:
        why = f"no further decrease at float64 resolution after {iterations} iterations"
        how = "the loss is flat or not smooth near t* (ReLU kinks: a minimum there need not"
        how += " have a zero gradient); a smooth activation or a last-layer subspace helps"
    warnings.warn(
        f"fit: the MAP search did not converge: largest gradient entry {reached:.3g} > "
        f"tol={tol:g} ({why}); "
        + (
            f"a Newton step would move t* by {offset:.2g} posterior standard deviations; "
            if offset is not None
            else ""
        )
        + "t* and the posterior around it are approximate. Fix: "
        f"{how}; or loosen tol",
        ConvergenceWarning,
        stacklevel=3,
    )
