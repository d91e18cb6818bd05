"""All variational means of a `PatchedNet` in one flat tensor, and a draw's weights by one gather.

The means ``M`` of a `PatchedNet` are one ``nn.Parameter`` per network parameter tensor (``(K,
*shape)`` if patched), which is what `state_dict`, `PatchedNet.means`, the per-site `guide` and
Pyro's param store see. For training, `flat_means` lays them out end to end in ONE leaf tensor
``(P,)`` (``P`` = `PatchFamily.num_variational_parameters`) and makes every per-slot parameter a
view of its block, so an optimiser step on the flat tensor *is* a step on the means. `FlatLayout`
then turns a draw of every assignment, flattened ``(A,)``, into the selected means of all ``D``
weights with one ``index_select`` (eq. 1 with ``σ → 0``: ``W = M_z``; `FlatLayout.select`), or
slot by slot from the per-slot parameters (`FlatLayout.pick`: the parameter itself, its drawn
component, or ECMP's one gather of the patched elements), whose gradients `shared_gradient`
makes views of the flat gradient: a training step then costs what a plain step on the network costs plus the
draw, and one optimiser update of the flat means, whatever the number of patched tensors. The
per-element arithmetic is that of `PatchFamily.select`: the same numbers.

The distributions of `patch_svi`'s whole-tensor sites are here too, each the law it replaces
with the per-element work done once: `UniformAssignments` (``Categorical(1/K)`` per element),
`BernoulliAssignments`, `FlatNormalPrior` (``N(0, τ⁻¹ I)`` with one dot product) and `PointMass`
(``Delta``, whose ``log_prob`` at its own draw is zero without comparing ``D`` numbers).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import ClassVar

import torch
from pyro.distributions import Delta, TorchDistribution, constraints
from torch import nn

__all__ = [
    "BernoulliAssignments",
    "FlatLayout",
    "FlatNormalPrior",
    "PointMass",
    "UniformAssignments",
    "flat_means",
    "layout",
    "shared_gradient",
]


class FlatLayout:
    """Where every weight's mean lives in the flat means ``(P,)`` and which assignment picks it.

    For weight element ``d`` (slots in order, each flattened), ``base[d]`` is the position of its
    mean (of component 0 if patched) in the flat means, ``stride[d]`` the distance between
    components (the slot's ``numel``; 0 if shared or masked) and ``zpos[d]`` the position of its
    assignment in the flattened draw ``(A,)`` of every assignment site (`PatchFamily.
    assignment_sites`, in order): the layer's for EMP, its own for ECMP, the one of the whole net
    for an ensemble, its input unit's for dropout.

    Args:
        family: the `PatchFamily`.
        device: where the index tensors live.
    """

    def __init__(self, family, device: torch.device | str = "cpu") -> None:
        self.family = family
        k = family.n_components
        sites = family.assignment_sites()
        self.site_sizes = [math.prod(shape) for _, shape, _ in sites]
        self.num_assignments = sum(self.site_sizes)
        self.kind = sites[0][2] if sites else "cat"
        starts = dict(zip([name for name, _, _ in sites], _cumsum([0, *self.site_sizes])))
        self.sizes = [s.numel for s in family.slots]
        self.shapes = [s.shape for s in family.slots]
        self.blocks = [s.numel * (k if s.kind == "patch" else 1) for s in family.slots]
        base, stride, zpos, masked = [], [], [], []  # per weight element, slots in order
        for s, off in zip(family.slots, _cumsum([0, *self.blocks])):
            j = torch.arange(s.numel)
            base.append(off + j)
            stride.append(torch.full_like(j, s.numel if s.kind == "patch" else 0))
            masked.append(torch.full((s.numel,), s.kind == "drop"))
            start = starts.get(family.site_for(s), 0)
            if s.kind == "shared" or family.mode in ("emp", "ensemble"):
                zpos.append(torch.full_like(j, start))
            elif family.mode == "dropout":  # input unit: dim 1 of (out, in, *kernel)
                inner = math.prod(s.shape[2:])
                zpos.append(start + (j // inner) % s.shape[1])
            else:  # ecmp, dropconnect: one assignment per element
                zpos.append(start + j)
        base, stride, zpos, masked = (torch.cat(v) for v in (base, stride, zpos, masked))
        sel = torch.nonzero(stride > 0 if not masked.any() else masked).squeeze(-1)
        self.base = base.to(device)  # shape: (D,)
        self.sel = sel.to(device)  # the weights an assignment acts on, (#,)
        self.stride_sel = stride[sel].to(device)
        zsel = zpos[sel]  # None: the identity (ECMP, DropConnect): z itself, no gather
        identity = len(sel) == self.num_assignments and torch.equal(zsel, torch.arange(len(sel)))
        self.zpos_sel = None if identity else zsel.to(device)
        self.drop = family.mode in ("dropout", "dropconnect")
        self.ones = torch.ones(len(base), device=device) if self.drop else None
        self.device = torch.device(device)
        # where each slot's selected means lie in its per-slot parameter (`pick`): ``None`` for a
        # shared slot (the parameter itself); for a patched one ``j``, the position of its
        # assignments in the draw: the slot's one (EMP, an ensemble) or its elements' (ECMP,
        # ``z[j : j + numel]`` in order). A mask (dropout, DropConnect): no plan, `select`.
        self.plan: list[int | None] | None = None
        ecmp = family.mode == "ecmp" and self.zpos_sel is None
        if (family.mode in ("emp", "ensemble") or ecmp) and not masked.any():
            self.plan = [
                None if s.kind == "shared" else starts.get(family.site_for(s), 0)
                for s in family.slots
            ]
        self.per_element = ecmp
        # ECMP: the flat position of every patched element's component 0 (in the order of `sel`)
        self.gather_base = self.base[self.sel] if ecmp else None

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        """Every assignment of one draw, flattened ``(A,)``: ``torch.randint`` (int64) or
        ``torch.rand < 1 − p`` (``like``'s dtype), the same numbers as `PatchFamily.
        draw_assignments` site after site from the same generator state."""
        if self.kind == "cat":
            return torch.randint(
                self.family.n_components, (self.num_assignments,), device=like.device
            )
        u = torch.rand(self.num_assignments, dtype=like.dtype, device=like.device)
        return (u < 1.0 - self.family.drop_prob).to(like.dtype)

    def select(self, flat: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Selected means of all weights, ``(D,)``, from the flat means ``(P,)`` and the flattened
        assignments ``(A,)``; differentiable in ``flat`` (`PatchFamily.select`, all slots)."""
        zs = z if self.zpos_sel is None else z[self.zpos_sel]  # shape: (#,)
        if self.drop:  # {M, 0}: a mask on the means (P = D)
            return flat * self.ones.to(flat.dtype).index_copy(0, self.sel, zs.to(flat.dtype))
        return flat.index_select(0, self.base.index_add(0, self.sel, self.stride_sel * zs))

    def pick(
        self, flat: torch.Tensor, params: list[torch.Tensor], z: torch.Tensor
    ) -> list[torch.Tensor] | None:
        """Each slot's selected means in its parameter's shape, from the per-slot parameters
        ``params`` (`PatchedNet`'s, in slot order: ``(K, *shape)`` if patched; views of the
        flat means ``flat``) and the flattened assignments ``(A,)``: a shared slot's parameter
        itself; a patched slot's drawn component (EMP, ensembles: ``params[i][k]``) or, with one
        assignment per element (ECMP), the patched slots' elements by one gather from ``flat``.
        `select` cut into the slots, the same numbers; differentiable in ``params`` and
        ``flat``, whose gradients `shared_gradient` makes one. ``None`` without a plan
        (dropout, DropConnect: a mask, `select`)."""
        if self.plan is None:
            return None
        if self.per_element:  # ECMP: one gather of every patched element
            picked = flat.index_select(0, self.gather_base + self.stride_sel * z)
            parts = iter(picked.split([n for j, n in zip(self.plan, self.sizes) if j is not None]))
            return [
                p if j is None else next(parts).view(sh)
                for p, j, sh in zip(params, self.plan, self.shapes)
            ]
        chosen = z.tolist()  # the few assignment sites' components
        return [p if j is None else p[int(chosen[j])] for p, j in zip(params, self.plan)]

    def split(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{parameter name: view (shape)}`` of the flat weights ``(D,)``, slots in order."""
        slots = self.family.slots
        return {s.name: p.view(s.shape) for s, p in zip(slots, w.split(self.sizes))}

    def split_assignments(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{assignment site: (*event,)}`` from the flattened draw ``(A,)``."""
        sites = self.family.assignment_sites()
        return {n: p.reshape(sh) for (n, sh, _), p in zip(sites, z.split(self.site_sizes))}

    def assignment_law(self, like: torch.Tensor) -> TorchDistribution:
        """The law of the flattened draw: `UniformAssignments` or `BernoulliAssignments`."""
        if self.kind == "cat":
            return UniformAssignments(self.num_assignments, self.family.n_components, like)
        return BernoulliAssignments(self.num_assignments, 1.0 - self.family.drop_prob, like)


class FlatCache:
    """What a `PatchedNet` keeps between steps, owned by the model (``model.flat_cache``, made
    in its constructor): the flat means (`flat_means`), the `FlatLayout` of its family on
    one device and the prior precisions of its slots. Copies and pickles start empty (rebuilt on
    use)."""

    __slots__ = ("flat", "layout", "prior_precisions")

    def __init__(self) -> None:
        self.flat: nn.Parameter | None = None
        self.layout: FlatLayout | None = None
        #: the per-weight prior precisions by (dtype, device)
        self.prior_precisions: dict = {}

    def __reduce__(self) -> tuple:
        return (FlatCache, ())

    def __deepcopy__(self, memo: dict) -> FlatCache:
        return FlatCache()


def layout(model) -> FlatLayout:
    """The `FlatLayout` of a `PatchedNet`, built once per device (held by ``model.flat_cache``)."""
    like = model._like()
    cache = model.flat_cache
    if cache.layout is None or cache.layout.device != like.device:
        cache.layout = FlatLayout(model.family, like.device)
    return cache.layout


def flat_means(model) -> nn.Parameter:
    """The means of ``model`` as one leaf ``(P,)`` whose blocks ARE the per-slot parameters.

    On first use (and whenever a per-slot parameter no longer is a view of it: after ``to``,
    ``double``, a deep copy, ``load_state_dict(assign=True)``) the current values are copied into
    a new flat tensor and every per-slot parameter's ``.data`` becomes the view of its block, so
    in-place updates of either (an optimiser step, `flat.preserved`, ``load_state_dict``) are seen
    by both. Gradients are separate: a loss computed from the flat tensor has its gradient in
    ``flat.grad``. The tensor carries ``unconstrained`` (a weak reference to itself), as the
    values of Pyro's param sites do, so that ``SVI`` optimises it when a guide declares it.
    """
    cache = model.flat_cache
    params = [model._parameters[s.key] for s in model.slots]
    flat = cache.flat
    if flat is not None and _aliased(flat, params, layout(model).blocks):
        return flat
    with torch.no_grad():
        data = torch.cat([p.detach().reshape(-1) for p in params])
    flat = nn.Parameter(data)
    for p, block in zip(params, data.split(layout(model).blocks)):
        p.data = block.view(p.shape)
    flat.unconstrained = weakref.ref(flat)
    cache.flat = flat
    return flat


@contextlib.contextmanager
def shared_gradient(model) -> Iterator[torch.Tensor]:
    """Training on the per-slot parameters with the gradient in the flat means: yields a zeroed
    buffer ``(P,)`` that is ``flat_means(model).grad``, every per-slot parameter's ``.grad``
    being the view of its block of it. Autograd accumulates into an existing ``.grad`` in place
    (as under DDP's ``gradient_as_bucket_view``), so a loss built from the per-slot parameters
    (`FlatLayout.pick`) leaves its gradient in ``flat.grad`` with no gather, scatter or ``cat``
    of ``(P,)`` a step; an optimiser on the flat means must zero the buffer in place between
    steps and reassign it to ``flat.grad`` (`patch_svi`'s Adam does). The per-slot gradients
    are restored on exit."""
    flat = flat_means(model)
    params = [model._parameters[s.key] for s in model.slots]
    saved = [p.grad for p in params]
    buffer = torch.zeros_like(flat)
    for p, block in zip(params, buffer.split(layout(model).blocks)):
        p.grad = block.view(p.shape)
    flat.grad = buffer
    try:
        yield buffer
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def _aliased(flat: torch.Tensor, params: list[torch.Tensor], blocks: list[int]) -> bool:
    ptr, size = flat.data_ptr(), flat.element_size()
    for p, off in zip(params, _cumsum([0, *blocks])):
        if p.data_ptr() != ptr + off * size or p.dtype != flat.dtype or not p.is_contiguous():
            return False
    return True


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values[:-1]:
        total += v
        out.append(total)
    return out


# --------------------------------------------------------------------------------------------
# whole-tensor distributions


class UniformAssignments(TorchDistribution):
    """``A`` independent uniform draws from ``{0, …, K−1}``, one event ``(A,)``: the law of
    ``Categorical(probs=1/K).expand([A]).to_event(1)``, sampled with ``torch.randint`` and with
    ``log_prob = −A log K``."""

    arg_constraints: ClassVar[dict] = {}
    has_enumerate_support = False

    def __init__(self, size: int, k: int, like: torch.Tensor) -> None:
        self.k, self.like = k, like
        super().__init__(torch.Size(), torch.Size((size,)), validate_args=False)

    @property
    def support(self):
        return constraints.independent(constraints.integer_interval(0, self.k - 1), 1)

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.event_shape
        return torch.randint(self.k, shape, device=self.like.device)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        lp = -self.event_shape[0] * math.log(self.k)
        return self.like.new_full(value.shape[:-1], lp)


class BernoulliAssignments(TorchDistribution):
    """``A`` independent ``Bernoulli(keep)`` draws (values in ``like``'s dtype), one event
    ``(A,)``: ``log_prob = n₁ log keep + (A − n₁) log(1 − keep)`` with ``n₁`` the ones."""

    arg_constraints: ClassVar[dict] = {}
    support = constraints.independent(constraints.boolean, 1)

    def __init__(self, size: int, keep: float, like: torch.Tensor) -> None:
        self.keep, self.like = keep, like
        super().__init__(torch.Size(), torch.Size((size,)), validate_args=False)

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.event_shape
        u = torch.rand(shape, dtype=self.like.dtype, device=self.like.device)
        return (u < self.keep).to(self.like.dtype)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        ones = value.sum(-1)
        keep = self.like.new_tensor(self.keep)
        return torch.xlogy(ones, keep) + torch.xlogy(self.event_shape[0] - ones, 1 - keep)


class FlatNormalPrior(TorchDistribution):
    """``N(0, diag(τ)⁻¹)`` over ``(D,)`` with per-weight precisions ``τ`` (a float if all are
    equal): ``log_prob(w) = −½ Σ τ w² + ½ Σ log τ − (D/2) log 2π``, one dot product."""

    arg_constraints: ClassVar[dict] = {}
    support = constraints.independent(constraints.real, 1)
    has_rsample = True

    def __init__(self, precision: torch.Tensor | float, size: int, like: torch.Tensor) -> None:
        self.precision, self.like = precision, like
        if isinstance(precision, float):
            log_det = size * math.log(precision)
        else:
            log_det = float(precision.double().log().sum())
        self.constant = 0.5 * log_det - 0.5 * size * math.log(2 * math.pi)
        super().__init__(torch.Size(), torch.Size((size,)), validate_args=False)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.event_shape
        eps = torch.randn(shape, dtype=self.like.dtype, device=self.like.device)
        return eps * self.precision**-0.5

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if isinstance(self.precision, float):
            if value.dim() == 1:
                sq = torch.dot(value, value)
            else:
                sq = value.square().sum(-1)
            return sq * (-0.5 * self.precision) + self.constant
        return (value.square() * self.precision).sum(-1) * -0.5 + self.constant


class PointMass(Delta):
    """``Delta(v, event_dim=1)`` whose draw is ``v`` itself and whose ``log_prob`` at that draw is
    0 with no work (elsewhere it is ``Delta``'s: 0 where equal, ``−inf`` otherwise)."""

    def __init__(self, v: torch.Tensor) -> None:
        super().__init__(v, log_density=0.0, event_dim=1, validate_args=False)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        return self.v if not sample_shape else super().rsample(torch.Size(sample_shape))

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        if x is self.v:
            return self.log_density
        return super().log_prob(x)
