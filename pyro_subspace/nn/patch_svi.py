"""A `PatchedNet` training step at the cost of a vanilla one, through plain torch or Pyro's SVI.

Four pieces, each result-preserving:

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
  pair is what `PatchedNet.fit` (``method="svi"``) uses. The guide declares ONE param site,
  ``"loc_flat"``, the flat means of `patch_flat.flat_means` (the per-slot means are views of
  it), selects the drawn components with one gather, and the sites' laws are `patch_flat`'s
  whole-tensor ones (``randint`` draws, a dot-product prior, a ``Delta`` with free
  ``log_prob``): the same log densities, without Pyro's per-element and per-site overhead.
- `torch_step`: `PatchedNet.fit`'s plain-torch step on the same flat means, eq. (7) as a
  per-element weight decay of one Adam.
- `JointOptim`: a ``PyroOptim`` that steps ONE torch optimiser over all the parameters rather
  than one optimiser per parameter tensor (Pyro's default). Adam (and SGD) update every element
  independently, so the updates are identical; only the per-tensor Python overhead goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import pyro
import torch
from pyro.distributions import Normal, constraints
from pyro.optim import PyroOptim
from pyro.poutine.runtime import effectful
from torch import nn

from ..minibatch import fused_option
from . import patch_flat
from .patch_family import plate_batch_shape

__all__ = ["JointOptim", "fused_guide", "fused_model", "svi_step", "swapped_forward", "torch_step"]

#: the name of the param site holding the flat means in `fused_guide`.
FLAT_SITE = "loc_flat"


@contextlib.contextmanager
def _swapped(net: nn.Module, tensors: Mapping[str, torch.Tensor], kind: str) -> Iterator[None]:
    """Put ``tensors`` ({dotted name: tensor}) into the modules' ``_parameters``/``_buffers``
    (``kind``) for the block; the originals are put back on any exit."""
    saved = []
    try:
        for name, value in tensors.items():
            slots, attr = _place(net, name, kind)
            saved.append((slots, attr, slots[attr]))
            slots[attr] = value
        yield
    finally:
        for slots, attr, value in reversed(saved):
            slots[attr] = value


def _place(net: nn.Module, name: str, kind: str) -> tuple[dict, str]:
    """``(the module's _parameters/_buffers dict, attribute)`` of the dotted ``name``."""
    prefix, _, attr = name.rpartition(".")
    slots = getattr(net.get_submodule(prefix), kind)
    if attr not in slots:
        raise ValueError(f"weights: the network has no {kind[1:-1]} named {name!r}")
    return slots, attr


def _placed_forward(net: nn.Module, places: list, values: list, x: torch.Tensor) -> torch.Tensor:
    """`swapped_forward` with the places resolved (`_place`): ``(N, O)`` outputs."""
    saved = [slots[attr] for slots, attr in places]
    try:
        for (slots, attr), value in zip(places, values):
            slots[attr] = value
        out = net(x)
    finally:
        for (slots, attr), value in zip(places, saved):
            slots[attr] = value
    return out.unsqueeze(-1) if out.dim() == 1 else out  # as `PatchedNet.outputs`


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
    lay = patch_flat.layout(model)
    z = pyro.sample("z", lay.assignment_law(like))
    w = pyro.sample("w", _prior(model, like))
    n = x.shape[0]
    total = n if num_data is None else num_data
    with pyro.plate("data", total, dim=-1, subsample=_arange(n, x.device)):
        out = _forward(model, lay.split(w), x, z)
        return model.likelihood.observe(out, y, model.temperature)


def fused_guide(model, x: torch.Tensor, y: torch.Tensor | None = None, num_data: int | None = None):
    """The guide eq. (1) with whole-tensor sites: ``"z"`` ``(A,)`` from the fixed law, then
    ``"w"`` ``(D,)`` from ``N(M_z, σ²)`` (a ``Delta`` at ``M_z`` for ``σ = 0``), the selected
    means flattened in slot order.

    The means enter through ONE param site, ``"loc_flat"``: the flat means ``(P,)`` of
    `patch_flat.flat_means`, of which the per-slot parameters are views, so ``SVI`` updates
    them with one optimiser step on one tensor. Returns ``{"z": (A,), "w": (D,)}``."""
    _check_unbatched()
    like = model._like()
    lay = patch_flat.layout(model)
    flat = _flat_param(model)
    z = pyro.sample("z", lay.assignment_law(like))
    loc = lay.select(flat, z)  # shape: (D,)
    if model.sigma == 0:
        d = patch_flat.PointMass(loc)
    else:
        d = Normal(loc, model.sigma).to_event(1)
    return {"z": z, "w": pyro.sample("w", d)}


def _flat_param(model) -> torch.Tensor:
    """A Pyro param statement for the flat means, outside the global param store (as
    ``PyroModule`` does in local-param mode): only handlers such as ``SVI``'s see it."""
    flat = patch_flat.flat_means(model)
    return effectful(type="param")(lambda *_, **__: flat)(
        FLAT_SITE, constraint=constraints.real, event_dim=None, name=FLAT_SITE
    )


def _forward(model, weights: dict[str, torch.Tensor], x: torch.Tensor, z: torch.Tensor):
    """Outputs ``(N, O)`` at one draw's weights (the drawn member's statistics if ensemble)."""
    if model.mode == "ensemble":
        return model.outputs(weights, x, z[0])
    out = swapped_forward(model.net, weights, x)
    return out.unsqueeze(-1) if out.dim() == 1 else out  # as `PatchedNet.outputs`


def _prior(model, like: torch.Tensor) -> patch_flat.FlatNormalPrior:
    """``N(0, τ⁻¹ I)`` over every weight in slot order; the per-weight precisions cached by the
    model (``flat_cache``) per dtype and device (the slots and their ``τ`` are fixed at
    construction)."""
    cache = model.flat_cache.prior_precisions
    key = (like.dtype, like.device)
    if key not in cache:
        taus = {s.precision for s in model.slots}
        if len(taus) == 1:
            cache[key] = taus.pop()
        else:
            cache[key] = torch.cat([like.new_full((s.numel,), s.precision) for s in model.slots])
    return patch_flat.FlatNormalPrior(cache[key], model.num_weights, like)


_ARANGE: dict = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    if key not in _ARANGE:
        _ARANGE[key] = torch.arange(n, device=device)
    return _ARANGE[key]


def svi_step(model, num_data: int, lr: float, probe: torch.Tensor | None = None):
    """`PatchedNet.fit`'s ``"svi"`` step on a minibatch ``(x_b, y_b)`` of ``N = num_data``
    points: ``SVI(fused_model, fused_guide, JointOptim(Adam), Trace_ELBO()).step``, with Pyro's
    validation off. With ``probe``, outputs ``(1, O)`` of one row, the targets are checked per
    batch against outputs of that width (streamed data); else the caller checked them once."""
    from pyro.infer import SVI, Trace_ELBO

    n = num_data
    optim = JointOptim(torch.optim.Adam, {"lr": lr})
    svi = SVI(model.fused_model, model.fused_guide, optim, Trace_ELBO())
    constant = model.elbo_constant

    def step(xb: torch.Tensor, yb: torch.Tensor) -> float:
        if probe is not None:
            yb = model.likelihood.validate(probe.new_zeros(xb.shape[0], *probe.shape[1:]), yb)
        with pyro.validation_enabled(False):
            return (svi.step(xb, yb, num_data=n) - constant) / n

    return step


def torch_step(model, num_data: int, lr: float, validate: bool = False):
    """`PatchedNet.fit`'s ``"torch"`` step on a minibatch ``(x_b, y_b)`` of ``N = num_data``
    points, and its optimiser: `PatchedNet.negative_elbo` without the penalty, over ``N``,
    computed from the per-slot means (`patch_flat.FlatLayout.pick`; with ``σ > 0`` or a mask
    one gather from the flat means), and Adam on the flat means with eq. (7) as per-element
    weight decay (`PatchedNet.weight_decays`). The same numbers as the per-slot computation
    with one Adam group per decay value. Run the steps inside `patch_flat.shared_gradient`,
    whose buffer the optimiser keeps as the flat gradient (``optimizer.grad_buffer``: set it
    there). Under data parallelism ``N`` is the total over the ranks. ``validate``: check the
    targets against the outputs per batch (streamed data; tensors are checked once by the
    caller)."""
    n = num_data
    lay = patch_flat.layout(model)
    flat = patch_flat.flat_means(model)
    decays = model.weight_decays(n)
    decay = torch.cat([flat.new_full((b,), decays[s.key]) for s, b in zip(model.slots, lay.blocks)])
    sigma, temperature, lik = model.sigma, model.temperature, model.likelihood
    # a learned noise scale (Gaussian(sigma=None)) is trained too, as SVI trains its PyroParam
    learned = [p for p in lik.parameters() if p.requires_grad]
    optimizer = _DecayedAdam([flat], decay, lr=lr, others=learned)
    params = [model._parameters[s.key] for s in model.slots]

    ensemble = model.mode == "ensemble"
    # where each slot's tensor goes in the network, resolved once (`_swapped` per step otherwise)
    places = [_place(model.net, s.name, "_parameters") for s in model.slots]
    shapes, names = [s.shape for s in model.slots], [s.name for s in model.slots]

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        z = lay.draw(flat)
        if sigma > 0:  # one draw of σ ε for all weights, added to all (D,) at once after one
            w = lay.select(flat, z)  # gather (block views then a cat measured slower here)
            w = w + sigma * torch.randn(w.shape, dtype=w.dtype, device=w.device)
            ws = [v.view(sh) for v, sh in zip(w.split(lay.sizes), shapes)]
        else:  # slot by slot; the gradient reaches flat.grad (`patch_flat.shared_gradient`)
            ws = lay.pick(flat, params, z) or [
                v.view(sh) for v, sh in zip(lay.select(flat, z).split(lay.sizes), shapes)
            ]
        if ensemble:  # the drawn member's statistics
            out = _forward(model, dict(zip(names, ws)), xb, z)
        else:
            out = _placed_forward(model.net, places, ws, xb)
        if validate:
            yb = lik.validate(out, yb)
        # targets validated once by the caller: the minibatch's mean NLL by the likelihood's
        # fastest kernel (`Likelihood.training_loss`: cross_entropy for a Categorical)
        loss = lik.training_loss(out, yb)
        return loss if temperature == 1 else loss / temperature

    return step, optimizer


class _DecayedAdam(torch.optim.Adam):
    """Adam with a per-element L2 coefficient ``decay`` (the tensor form of ``weight_decay``:
    ``grad += decay ⊙ param`` before the update) on one parameter; ``others`` (e.g. a learned
    noise scale) in a second group without decay; optionally a shared gradient buffer
    (`grad_buffer`, `zero_grad`)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        decay: torch.Tensor,
        lr: float,
        others: list[torch.Tensor] = (),
    ) -> None:
        groups = [{"params": params}] + ([{"params": list(others)}] if others else [])
        super().__init__(groups, lr=lr, **fused_option(groups))
        self.decay = decay
        #: the flat gradient buffer of `patch_flat.shared_gradient` (``None``: not shared)
        self.grad_buffer: torch.Tensor | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As Adam's, except that a shared gradient buffer is zeroed in place and is again the
        flat means' ``.grad`` (a gradient reduction may have replaced it): the per-slot
        gradients stay views of it."""
        if self.grad_buffer is None:
            return super().zero_grad(set_to_none)
        (flat,) = self.param_groups[0]["params"]
        flat.grad = self.grad_buffer.zero_()
        for group in self.param_groups[1:]:
            for p in group["params"]:
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                p.grad.addcmul_(self.decay, p)
        return super().step(closure)


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
            store = pyro.get_param_store()  # a fixed order: sets are unordered
            new.sort(key=lambda p: store.param_name(p) or "")
            if self._joint is None:
                self._joint = self.pt_optim_constructor(new, **self.pt_optim_args)
            else:
                self._joint.add_param_group({"params": new})
            self._seen.update(new)
        if self._joint is not None:
            self._joint.step(*args, **kwargs)
