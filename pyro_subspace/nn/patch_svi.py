"""A `PatchedNet` training step at the cost of a vanilla one, through plain torch or Pyro's SVI.

Three pieces, each result-preserving:

- `swapped_forward`: the network at given weights by putting the tensors into the modules'
  parameter (and buffer) slots for one forward pass and restoring them afterwards: the same
  computation as ``torch.func.functional_call`` without its per-call bookkeeping (untying,
  name resolution, swapping back through accessors), which on a small net is a sizeable
  fraction of a step.
- `fused_model` / `fused_guide`: the Pyro model and guide of the family eq. (1) with **whole
  tensors as sites**: one site ``"z"`` holding every assignment of the draw (flattened, shape
  ``(A,)``) and one site ``"w"`` holding every weight (flattened, shape ``(D,)``), instead of one
  site per patched unit and per parameter tensor. ``Trace_ELBO`` on them computes the same
  loss as on (`PatchedNet.forward`, `PatchedNet.guide`): the log densities are sums over
  elements, only grouped differently, and ``log p(z) − log q(z) = 0`` either way (the same
  fixed law in model and guide). Pyro's cost per step grows with the number of sites, so this
  pair is what `PatchedNet.fit` (``method="svi"``) uses.
- `JointOptim`: a ``PyroOptim`` that steps ONE torch optimiser over all the parameters rather
  than one optimiser per parameter tensor (Pyro's default). Adam (and SGD) update every element
  independently, so the updates are identical; only the per-tensor Python overhead goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import pyro
import torch
from pyro.distributions import Delta, Normal
from pyro.optim import PyroOptim
from torch import nn

from .patch_family import plate_batch_shape

__all__ = ["JointOptim", "fused_guide", "fused_model", "swapped_forward"]


@contextlib.contextmanager
def _swapped(net: nn.Module, tensors: Mapping[str, torch.Tensor], kind: str) -> Iterator[None]:
    """Put ``tensors`` ({dotted name: tensor}) into the modules' ``_parameters``/``_buffers``
    (``kind``) for the block; the originals are put back on any exit."""
    saved = []
    try:
        for name, value in tensors.items():
            prefix, _, attr = name.rpartition(".")
            slots = getattr(net.get_submodule(prefix), kind)
            if attr not in slots:
                raise ValueError(f"weights: the network has no {kind[1:-1]} named {name!r}")
            saved.append((slots, attr, slots[attr]))
            slots[attr] = value
        yield
    finally:
        for slots, attr, value in reversed(saved):
            slots[attr] = value


def swapped_forward(
    net: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``net(x)`` with the parameters (and buffers) named in ``params`` (``buffers``) replaced.

    The same result as ``torch.func.functional_call(net, {**params, **buffers}, (x,))`` for
    unbatched tensors (each of the replaced tensor's own shape), differentiable in ``params``;
    BatchNorm in training mode updates the buffers it is given in place, exactly as there.

    Args:
        net: the network.
        params: ``{parameter name: tensor of the parameter's shape}``.
        x: inputs ``(N, ...)``.
        buffers: ``{buffer name: tensor of the buffer's shape}``, optional.

    Returns:
        ``net(x)`` at those tensors, ``(N, ...)``.
    """
    with _swapped(net, params, "_parameters"), _swapped(net, buffers or {}, "_buffers"):
        return net(x)


# --------------------------------------------------------------------------------------------
# whole-tensor model and guide


def _assignment_law(model, like: torch.Tensor):
    """The law of the one ``"z"`` site: every assignment element of the draw, flattened ``(A,)``;
    all of a mode's assignments share one law (uniform over K, or Bernoulli(1 − p))."""
    sites = model.family.assignment_sites()
    size = sum(int(torch.Size(shape).numel()) for _, shape, _ in sites)
    return model.family.assignment_dist((size,), sites[0][2], like)


def _split_assignments(model, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{assignment site: (*event,)}`` from the flattened ``(A,)`` draw of ``"z"``."""
    sites = model.family.assignment_sites()
    sizes = [int(torch.Size(shape).numel()) for _, shape, _ in sites]
    parts = flat.split(sizes)
    return {name: p.reshape(shape) for (name, shape, _), p in zip(sites, parts)}


def _check_unbatched() -> None:
    if plate_batch_shape():
        raise ValueError(
            "fused_model/fused_guide: one draw per step (no vectorised particles); use "
            "PatchedNet.forward / PatchedNet.guide with Predictive or vectorize_particles"
        )


def fused_model(model, x: torch.Tensor, y: torch.Tensor | None = None, num_data: int | None = None):
    """The Pyro model of `PatchedNet` with whole-tensor sites (module docstring).

    Sites: ``"z"`` ``(A,)`` (every assignment, the fixed law), ``"w"`` ``(D,)`` (every weight
    in slot order, prior ``N(0, τ⁻¹ I)`` with each slot's ``τ``), ``"obs"`` in plate
    ``"data"`` of size ``num_data`` (default ``N``; ``x`` ``(N, ...)`` is then a minibatch
    and the log-likelihood is scaled by ``num_data / N``), tempered by ``1/T``. ``x`` and
    ``y`` (prepared by the likelihood) are not checked here: `PatchedNet.fit` checks the data
    once. Call it as ``model.fused_model(x, y, num_data)``.
    """
    _check_unbatched()
    like = model._like()
    z = pyro.sample("z", _assignment_law(model, like))
    w = pyro.sample("w", Normal(like.new_zeros(()), _prior_scales(model, like)).to_event(1))
    weights = {s.name: part.view(s.shape) for s, part in zip(model.slots, _split(model, w))}
    n = x.shape[0]
    total = n if num_data is None else num_data
    with pyro.plate("data", total, dim=-1, subsample=torch.arange(n, device=x.device)):
        if model.mode == "ensemble":  # the member's BatchNorm statistics
            out = model.outputs(weights, x, z[0])
        else:
            out = swapped_forward(model.net, weights, x)
            out = out.unsqueeze(-1) if out.dim() == 1 else out  # as `PatchedNet.outputs`
        return model.likelihood.observe(out, y, model.temperature)


def fused_guide(model, x: torch.Tensor, y: torch.Tensor | None = None, num_data: int | None = None):
    """The guide eq. (1) with whole-tensor sites: ``"z"`` ``(A,)`` from the fixed law, then
    ``"w"`` ``(D,)`` from ``N(M_z, σ²)`` (a ``Delta`` at ``M_z`` for ``σ = 0``), the selected
    means flattened in slot order. Returns ``{"z": (A,), "w": (D,)}``."""
    _check_unbatched()
    like = model._like()
    z_flat = pyro.sample("z", _assignment_law(model, like))
    z = _split_assignments(model, z_flat)
    loc = torch.cat(
        [model.family.select(s, getattr(model, s.key), z, ()).reshape(-1) for s in model.slots]
    )  # through pyro.param (the model is a PyroModule); shape: (D,)
    d = Delta(loc, event_dim=1) if model.sigma == 0 else Normal(loc, model.sigma).to_event(1)
    return {"z": z_flat, "w": pyro.sample("w", d)}


def _prior_scales(model, like: torch.Tensor) -> torch.Tensor:
    """Prior standard deviations ``τ⁻¹ᐟ²`` of every weight in slot order, ``(D,)``; cached on
    the family per dtype and device (the slots and their ``τ`` are fixed at construction)."""
    cache = model.family.__dict__.setdefault("_prior_scales", {})
    key = (like.dtype, like.device)
    if key not in cache:
        cache[key] = torch.cat([like.new_full((s.numel,), s.precision**-0.5) for s in model.slots])
    return cache[key]


def _split(model, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return w.split([s.numel for s in model.slots], dim=-1)


def svi_step(model, x: torch.Tensor, y: torch.Tensor, lr: float):
    """`PatchedNet.fit`'s ``"svi"`` step on minibatch indices ``idx``: ``SVI(fused_model,
    fused_guide, JointOptim(Adam), Trace_ELBO()).step`` over ``N``, with Pyro's validation off
    (``x`` and the prepared ``y`` of ``N`` points were checked once by the caller)."""
    from pyro.infer import SVI, Trace_ELBO

    n = x.shape[0]
    optim = JointOptim(torch.optim.Adam, {"lr": lr})
    svi = SVI(model.fused_model, model.fused_guide, optim, Trace_ELBO())

    def step(idx: torch.Tensor) -> float:
        with pyro.validation_enabled(False):
            return (svi.step(x[idx], y[idx], num_data=n) - model.elbo_constant) / n

    return step


# --------------------------------------------------------------------------------------------
# one optimiser for all parameters


class JointOptim(PyroOptim):
    """A ``PyroOptim`` with one ``optim_constructor`` instance over every parameter it is given.

    ``SVI`` calls it with the parameters of the step; parameters never seen before join as a new
    parameter group (with ``optim_args``). For an element-wise optimiser (Adam, SGD, RMSprop)
    the updates equal those of Pyro's one-optimiser-per-parameter ``PyroOptim``, whenever every
    parameter takes part in every step (as in `PatchedNet.fit`). Optimiser state is not saved by
    `get_state`.

    Example:
        >>> optim = JointOptim(torch.optim.Adam, {"lr": 1e-3})
        >>> svi = SVI(model.fused_model, model.fused_guide, optim, Trace_ELBO())  # doctest: +SKIP
    """

    def __init__(self, optim_constructor: type, optim_args: dict) -> None:
        if not isinstance(optim_args, dict):
            raise TypeError(f"optim_args: expected a dict of settings, got {optim_args!r}")
        super().__init__(optim_constructor, optim_args)
        self._joint: torch.optim.Optimizer | None = None
        self._seen: set[torch.Tensor] = set()

    def __call__(self, params: Iterable[torch.Tensor], *args, **kwargs) -> None:
        new = [p for p in params if p not in self._seen]
        if new:
            new.sort(key=pyro.get_param_store().param_name)  # a fixed order: sets are unordered
            if self._joint is None:
                self._joint = self.pt_optim_constructor(new, **self.pt_optim_args)
            else:
                self._joint.add_param_group({"params": new})
            self._seen.update(new)
        if self._joint is not None:
            self._joint.step(*args, **kwargs)
