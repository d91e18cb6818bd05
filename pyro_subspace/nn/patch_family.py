"""The ensemble variational family of Ensemble Model Patching (Chang et al., eq. 1, Table 1).

Every weight tensor ``W`` of the network gets the prior ``N(0, τ⁻¹ I)`` (section 3.2). The
variational family is eq. (1): each weight element is

    W = Σ_k 1[Z = k] ⊙ (M_k + σ ε_k),        ε_k ~ N(0, I),  σ small and fixed,

with uniform, fixed mixing probabilities ``p_k = 1/K`` and an assignment ``Z`` whose structure
is the method (Table 1 and eqs. 5–6):

==============  ================================================  ============================
mode            patched parameters and their assignment            shared parameters
==============  ================================================  ============================
``emp``         K components; one ``z`` per patched *layer*        ``N(M, σ²)`` (eq. 4)
                (weight and bias of a module together, eq. 5)
``ecmp``        K components; one ``z`` per weight *element* (6)    ``N(M, σ²)``
``dropout``     {M, 0}; ``Bernoulli(1-p)`` per *input unit* of      biases, and unmasked layers
                the layer (a row ``h₁`` of the paper's ``W``,
                Table 1 / eq. 10), biases never dropped
``dropconnect`` {M, 0}; ``Bernoulli(1-p)`` per element              as for dropout
``ensemble``    every parameter, K components, one ``z`` for the   none
                whole net (BatchNorm statistics kept per member)
==============  ================================================  ============================

Dropout follows Table 1 / eq. (10) (Gal & Ghahramani's parameterisation): the mask ``z_{i h₁}``
runs over the rows ``h₁ ∈ [1, H_{i-1}]`` of the paper's ``W_i ∈ R^{H_{i-1}×H_i}``, i.e. the *input*
units of the layer (dim 1 of torch's ``(out, in)`` weight; input channels of a convolution), and
there is no ``1/(1−p)`` rescaling: it is absorbed into ``M``, and train and test both sample.

**Objective.** In `PatchedNet` the assignment is a Pyro site in *both* model and guide, with
the same uniform (or Bernoulli) distribution that has no learnable parameter. The model is
therefore the original model augmented by an independent auxiliary ``z`` (its marginal over
weights and data is unchanged), and ``Trace_ELBO`` on it computes

    loss = E_{z,ε}[ −log p(y | W) ] + E_z KL( N(M_z, σ² I) ‖ N(0, τ⁻¹ I) ) + KL(q(z) ‖ p(z))
         = E[NLL] + Σ_patched Σ_k τ p_k/2 ‖M_k‖² + Σ_shared τ/2 ‖M‖² + C            (eq. 7)

(dropout/DropConnect weights: ``τ(1−p)/2 ‖M‖²``, eq. 2 with ``p_i1 = 1−p``), with
``KL(q(z)‖p(z)) = 0`` and ``C = Σ_weights ½(τσ² − 1 − log τσ²)``; the mixture entropy is
replaced by the average component entropy, the approximation of eqs. (13)–(16) (exact for the
augmented model). Nothing in this objective keeps the components apart: with ``σ → 0`` the
mixture entropy is ``log K`` per assignment however close the components are, so they differ only
by their random initialisation (`initial_means`) and what training leaves of it; the expected-NLL
term, averaged over random assignments, pulls them together (``benchmarks/patches_overconfident.py``
measures the spread). In ``ensemble`` mode one ``z`` per step selects one member (``S = 1``,
appendix B.4), so at equal epochs each member gets ``1/K`` of the updates of an independently
trained deep-ensemble member. Given ``z``, the weights are reparameterised (``Normal.rsample``), so gradients
reach the means ``M_k`` by the pathwise derivative. The score-function term Pyro adds for the
non-reparameterisable ``z`` is ``∇ log q(z) · cost = 0``: ``q(z)`` has no parameters. So SVI's
gradient is exactly the one of Algorithm 1 (``S = 1`` draw per step, appendix B.4).

`PatchFamily` knows, for one network, which parameter tensors are patched, masked or shared,
the assignment sites and their laws, how a draw of assignments selects the means, the closed
form KL term (eq. 7), ``C`` and the initial means. `PatchedNet` holds the means and the
BatchNorm statistics, evaluates the net and is the Pyro model and guide.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from pyro.distributions import Bernoulli, Categorical, Delta, Normal
from pyro.poutine.runtime import get_plates
from torch import nn

from .. import validation as ck
from .. import rng
from .subspace_net import check_data

MODES = ("emp", "ecmp", "dropout", "dropconnect", "ensemble")
#: normalisation layers whose affine parameters ``patches="auto"`` patches (section 3.3).
NORM_TYPES = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
)
#: layers with a weight matrix / kernel (the output layer, and dropout's masked layers).
WEIGHT_TYPES = (nn.Linear, nn.modules.conv._ConvNd)


@dataclass
class Slot:
    """One parameter tensor of the network and its variational treatment.

    ``kind`` is ``"shared"`` (``N(M, σ²)``), ``"patch"`` (K components) or ``"drop"`` (``{M, 0}``).
    ``key`` is the attribute of `PatchedNet` holding the mean(s): shape ``shape`` for shared and
    drop, ``(K, *shape)`` for patch. ``site`` is the Pyro sample site of the weights.
    """

    name: str
    module: str
    shape: torch.Size
    kind: str
    key: str
    site: str
    precision: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class PatchFamily:
    """The variational family of eq. (1) on one network: slots, assignments, selection, eq. (7).

    Args: ``net``, ``patches``, ``mode``, ``n_components``, ``prior_precision``, ``sigma`` and
    ``drop_prob`` as in `PatchedNet`, validated here.
    """

    def __init__(
        self,
        net: nn.Module,
        patches: str | Sequence[str],
        mode: str,
        n_components: int,
        prior_precision: float | dict[str, float],
        sigma: float,
        drop_prob: float,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        ck.check_int(n_components, "n_components", 2)
        positive(sigma, "sigma", allow_zero=True)
        ck.probability(drop_prob, "drop_prob")
        if not any(True for _ in net.parameters()):
            raise ValueError("net: the network has no parameters")
        modules = dict(net.named_modules())
        self.patched_modules = _choose_patches(modules, patches, mode)
        precisions = _precisions(prior_precision, modules)
        self.mode = mode
        self.n_components = 2 if mode in ("dropout", "dropconnect") else n_components
        self.sigma = float(sigma)
        self.drop_prob = float(drop_prob)
        self.slots: list[Slot] = []
        for mod_name, module in modules.items():
            for pname, p in module.named_parameters(recurse=False):
                full = f"{mod_name}.{pname}" if mod_name else pname
                kind = "shared"
                if mod_name in self.patched_modules:
                    kind = "drop" if mode in ("dropout", "dropconnect") else "patch"
                    if kind == "drop" and pname != "weight":
                        kind = "shared"  # Table 1: biases are never dropped (z_j = 1)
                tau = precisions.get(mod_name, precisions[""])
                key = "loc_" + full.replace(".", "__")
                self.slots.append(Slot(full, mod_name, p.shape, kind, key, "w." + full, tau))

    # ----------------------------------------------------------------------------------------
    # sizes and constants

    @property
    def num_weights(self) -> int:
        """Number of parameters ``D`` of the network."""
        return sum(s.numel for s in self.slots)

    @property
    def num_variational_parameters(self) -> int:
        """Number of learnable variational parameters (the means ``M``, ``m``)."""
        return sum(s.numel * (self.n_components if s.kind == "patch" else 1) for s in self.slots)

    @property
    def elbo_constant(self) -> float:
        """``C = Σ_weights ½(τσ² − 1 − log τσ²)`` (``σ = 0``: ``Σ_weights ½ log(2π/τ)``)."""
        total = 0.0
        for s in self.slots:
            if self.sigma == 0:  # Delta guide: log q = 0, -log p(M) = τ/2 M² + ½ log(2π/τ)
                total += s.numel * 0.5 * math.log(2 * math.pi / s.precision)
                continue
            ts2 = s.precision * self.sigma**2
            total += s.numel * 0.5 * (ts2 - 1.0 - math.log(ts2))
        return total

    @property
    def overhead(self) -> float:
        """Parameter overhead in percent: ``100 (#variational − D) / D`` (section 3.3, Table 3).

        Equals ``Σ (K−1) × numel`` over patched tensors: ``2(K−1)N₂`` per BatchNorm layer of
        ``N₂`` units and ``(K−1)(I+1)O`` per patched ``Linear(I, O)``; 0 for dropout/DropConnect
        (fixed zero component, fixed ``p``) and ``100 (K−1)`` for an explicit ensemble.
        """
        d = self.num_weights
        return 100.0 * (self.num_variational_parameters - d) / d

    def penalty(self, means: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Eq. (7): ``Σ_patched Σ_k τ p_k/2 ‖M_k‖² + Σ_shared τ/2 ‖M‖²`` (a scalar tensor).

        Dropout/DropConnect weights contribute ``τ (1−p)/2 ‖M‖²`` (eq. 2 with ``p_i1 = 1−p``).
        ``means`` maps slot keys to the means.
        """
        total = means[self.slots[0].key].new_zeros(())
        keep = 1.0 - self.drop_prob
        for s in self.slots:
            sq = means[s.key].square().sum()
            if s.kind == "patch":
                sq = sq / self.n_components  # uniform p_k = 1/K
            elif s.kind == "drop":
                sq = keep * sq
            total = total + 0.5 * s.precision * sq
        return total

    def weight_decays(self, num_data: int) -> dict[str, float]:
        """Per-mean L2 coefficients on the *mean* loss that reproduce `penalty` (eq. 7).

        ``∂/∂M [penalty / N] = (τ c / N) M`` with ``c = p_k = 1/K`` (patched), ``1 − p``
        (dropout/DropConnect weights) or 1 (shared): Adam's ``weight_decay`` of that size per
        mean, exactly what the vanilla net's L2 is.

        Returns:
            ``{slot key (attribute name of the mean): coefficient}``.
        """
        coef = {"patch": 1.0 / self.n_components, "drop": 1.0 - self.drop_prob, "shared": 1.0}
        return {s.key: s.precision * coef[s.kind] / num_data for s in self.slots}

    # ----------------------------------------------------------------------------------------
    # assignments and weights

    def assignment_sites(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(site name, event shape, kind) of each assignment site, in sampling order."""
        if self.mode == "ensemble":
            return [("z", (), "cat")]
        if self.mode == "emp":
            return [(f"z.{m}", (), "cat") for m in self.patched_modules]
        sites = []
        for s in self.slots:
            if s.kind == "patch":
                sites.append((f"z.{s.name}", tuple(s.shape), "cat"))
            elif s.kind == "drop":
                shape = (s.shape[1],) if self.mode == "dropout" else tuple(s.shape)
                sites.append((f"z.{s.name}", shape, "bern"))
        return sites

    def assignment_dist(self, shape: tuple[int, ...], kind: str, like: torch.Tensor):
        """The fixed uniform (``"cat"``) or ``Bernoulli(1 − p)`` (``"bern"``) assignment law."""
        if kind == "cat":
            probs = like.new_full((self.n_components,), 1.0 / self.n_components)
            d = Categorical(probs=probs)
        else:
            d = Bernoulli(probs=like.new_tensor(1.0 - self.drop_prob))
        return d.expand(shape).to_event(len(shape)) if shape else d

    def draw_assignments(
        self, batch: tuple[int, ...], like: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Assignments drawn with plain ``torch.randint``/``torch.rand`` (the laws of
        `assignment_dist`, without their per-call overhead), each ``(*batch, *event)``."""
        out = {}
        for name, shape, kind in self.assignment_sites():
            if kind == "cat":
                out[name] = torch.randint(self.n_components, batch + shape, device=like.device)
            else:
                u = torch.rand(batch + shape, dtype=like.dtype, device=like.device)
                out[name] = (u < 1.0 - self.drop_prob).to(like.dtype)
        return out

    def site_for(self, slot: Slot) -> str | None:
        """The assignment site that selects ``slot``'s component (``None``: shared)."""
        if slot.kind == "shared":
            return None
        if self.mode == "ensemble":
            return "z"
        if self.mode == "emp":
            return f"z.{slot.module}"
        return f"z.{slot.name}"

    def select(
        self, slot: Slot, m: torch.Tensor, z: dict[str, torch.Tensor], batch: tuple[int, ...]
    ) -> torch.Tensor:
        """Mean of the selected component, shape ``(*batch, *slot.shape)``, differentiable in
        the means ``m`` (``slot.shape``, or ``(K, *slot.shape)`` if patched)."""
        shape = tuple(slot.shape)
        if slot.kind == "shared":
            return m.expand(*batch, *shape)
        a = z[self.site_for(slot)]
        if slot.kind == "drop":
            mask = a.to(m.dtype)
            if self.mode == "dropout":  # mask over input units, dim 1 of (out, in, *kernel)
                mask = mask.reshape(*mask.shape, *([1] * (len(shape) - 2)))
                mask = mask.unsqueeze(-len(shape))
            return (m * mask).expand(*batch, *shape)
        if self.mode in ("emp", "ensemble"):  # one component for the whole tensor
            return m[a.long().expand(batch)]
        idx = a.long().expand(*batch, *shape).reshape(-1, slot.numel)  # ecmp: per element
        flat = m.reshape(self.n_components, slot.numel)
        return flat.gather(0, idx).reshape(*batch, *shape)

    def sample(
        self, means: Mapping[str, torch.Tensor], num_samples: int
    ) -> dict[str, torch.Tensor]:
        """``S`` draws of the assignments and weights at the means (slot key -> mean), each
        ``(S, *event)``, keyed by the guide's site names (Algorithm 1)."""
        like = means[self.slots[0].key]
        z = self.draw_assignments((num_samples,), like)
        out = dict(z)
        for slot in self.slots:
            loc = self.select(slot, means[slot.key], z, (num_samples,))
            out[slot.site] = loc + self.sigma * torch.randn_like(loc) if self.sigma else loc
        return out

    def weight_dist(self, loc: torch.Tensor, slot: Slot):
        """``N(loc, σ²)`` over the tensor, or a ``Delta`` at ``loc`` when ``σ = 0``."""
        if self.sigma == 0:
            return Delta(loc, event_dim=len(slot.shape))
        return Normal(loc, self.sigma).to_event(len(slot.shape))

    def prior(self, slot: Slot, like: torch.Tensor):
        """The prior ``N(0, τ⁻¹ I)`` of the tensor."""
        scale = like.new_tensor(slot.precision**-0.5)
        return Normal(like.new_zeros(()), scale).expand(tuple(slot.shape)).to_event(len(slot.shape))

    # ----------------------------------------------------------------------------------------
    # initial means

    def initial_means(
        self, net: nn.Module, init: str, jitter: float, seed: int
    ) -> dict[str, torch.Tensor]:
        """Initial means by slot key: ``(K, *shape)`` for patched slots (`PatchedNet`'s
        ``init``), the net's current values otherwise. Draws from a generator seeded by
        ``seed`` and from torch's global generator seeded by ``seed`` inside `rng.seeded` (the
        caller's CPU and CUDA generators are left untouched)."""
        modules = dict(net.named_modules())
        gen = torch.Generator().manual_seed(seed)
        out = {}
        with rng.seeded(seed, numpy=False, python=False):
            for slot in self.slots:
                module = modules[slot.module]
                pname = slot.name[len(slot.module) + 1 :] if slot.module else slot.name
                p = getattr(module, pname)
                if slot.kind == "patch":
                    out[slot.key] = _components(
                        module, pname, p, self.n_components, init, jitter, gen
                    )
                else:
                    out[slot.key] = p.detach().clone()
        return out


def plate_batch_shape() -> tuple[int, ...]:
    """Batch shape of the enclosing vectorised plates (``()`` outside any)."""
    plates = [f for f in get_plates() if f.vectorized and f.dim is not None]
    if not plates:
        return ()
    shape = [1] * max(-f.dim for f in plates)
    for f in plates:
        shape[f.dim] = f.size
    return tuple(shape)


def drop_data_dim(v: torch.Tensor, event_dim: int) -> torch.Tensor:
    """Vectorised draws carry a singleton at the data plate's dim -1 left of the event; drop it."""
    batch = v.dim() - event_dim
    if batch >= 2 and v.shape[batch - 1] == 1:
        return v.squeeze(batch - 1)
    return v


def _choose_patches(
    modules: dict[str, nn.Module], patches: str | Sequence[str], mode: str
) -> list[str]:
    """Module names to patch (or to mask for dropout/DropConnect), in module order."""
    with_params = [n for n, m in modules.items() if any(True for _ in m.parameters(recurse=False))]
    weighted = [n for n in with_params if isinstance(modules[n], WEIGHT_TYPES)]
    if mode == "ensemble":
        if patches != "auto":
            raise ValueError(
                "patches: an explicit ensemble ('ensemble' mode) patches every layer; pass 'auto'"
            )
        return with_params
    if isinstance(patches, str):
        if patches != "auto":
            raise ValueError(f"patches: expected 'auto' or a list of module names, got {patches!r}")
        if mode in ("dropout", "dropconnect"):
            chosen = weighted[1:]
            if not chosen:
                raise ValueError(
                    "patches: 'auto' dropout masks every Linear/Conv but the first; the net has "
                    f"{len(weighted)}: pass a list of module names"
                )
            return chosen
        norms = [n for n in with_params if isinstance(modules[n], NORM_TYPES)]
        chosen = set(norms) | ({weighted[-1]} if weighted else set())
        if not chosen:
            raise ValueError("patches: 'auto' found no normalisation or Linear/Conv layer to patch")
        return [n for n in with_params if n in chosen]
    if not isinstance(patches, Sequence) or not all(isinstance(p, str) for p in patches):
        raise TypeError(f"patches: expected 'auto' or a list of module names, got {patches!r}")
    if not patches:
        raise ValueError("patches: the list of module names is empty")
    for p in patches:
        if p not in modules:
            raise ValueError(f"patches: no module named {p!r} in net; modules: {list(modules)[1:]}")
        if p not in with_params:
            raise ValueError(f"patches: module {p!r} has no parameters of its own")
        if mode in ("dropout", "dropconnect") and p not in weighted:
            raise ValueError(
                f"patches: {mode} masks Linear/Conv weights; {p!r} is a {type(modules[p]).__name__}"
            )
    return [n for n in with_params if n in set(patches)]


def _precisions(prior_precision: float | dict[str, float], modules: dict) -> dict[str, float]:
    if isinstance(prior_precision, dict):
        out = {"": 1.0}
        for k, v in prior_precision.items():
            if k not in modules:
                raise ValueError(f"prior_precision: no module named {k!r} in net")
            out[k] = positive(v, f"prior_precision[{k!r}]")
        return out
    return {"": positive(prior_precision, "prior_precision")}


def positive(value: object, name: str, allow_zero: bool = False) -> float:
    """``value`` as a float; ``TypeError``/``ValueError`` naming ``name`` unless finite and > 0
    (``>= 0`` with ``allow_zero``)."""
    return ck.positive_float(value, name, allow_zero=allow_zero)


def _components(
    module: nn.Module,
    pname: str,
    p: torch.Tensor,
    k: int,
    init: str,
    jitter: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """Initial component means ``(K, *p.shape)`` of parameter ``pname`` of ``module``."""
    base = p.detach()
    if init == "copy" or not hasattr(module, "reset_parameters"):
        rms = float(base.square().mean().sqrt()) or 1.0
        noise = torch.randn((k, *base.shape), generator=gen, dtype=base.dtype)
        return base.unsqueeze(0) + jitter * rms * noise.to(base.device)
    comps = []
    for _ in range(k):
        fresh = copy.deepcopy(module)
        fresh.reset_parameters()  # the global RNG, forked and seeded by the caller
        value = getattr(fresh, pname).detach()
        if isinstance(module, NORM_TYPES):
            noise = torch.randn(value.shape, generator=gen, dtype=value.dtype)
            value = value + jitter * noise.to(value.device)
        comps.append(value)
    return torch.stack(comps)


def check_call(x, y, size, num_data) -> tuple[int, int | None, int]:
    """Validate a model call; return (N, subsample size, plate size)."""
    n = check_data(x, y)
    if size is not None:
        ck.positive_int(size, "subsample_size")
        if size > n:
            raise ValueError(f"subsample_size: {size} exceeds the number of data points {n}")
    if num_data is not None:
        ck.positive_int(num_data, "num_data")
        if num_data < n:
            raise ValueError(f"num_data: {num_data} is smaller than the batch size {n}")
        if size is not None:
            raise ValueError("num_data: give either num_data (x is a minibatch) or subsample_size")
        return n, None, num_data
    return n, size, n
