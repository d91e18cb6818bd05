"""`PatchedNet`: the ensemble variational family of Ensemble Model Patching as a Pyro model + guide.

Chang et al., *Ensemble Model Patching* (EMP). Every weight tensor ``W`` of the network gets the
prior ``N(0, τ⁻¹ I)`` (section 3.2). The variational family is eq. (1): each weight element is

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

**Objective.** The assignment is a Pyro site in *both* model and guide, with the same uniform
(or Bernoulli) distribution that has no learnable parameter. The model is therefore the original
model augmented by an independent auxiliary ``z`` (its marginal over weights and data is
unchanged), and ``Trace_ELBO`` on it computes

    loss = E_{z,ε}[ −log p(y | W) ] + E_z KL( N(M_z, σ² I) ‖ N(0, τ⁻¹ I) ) + KL(q(z) ‖ p(z))
         = E[NLL] + Σ_patched Σ_k τ p_k/2 ‖M_k‖² + Σ_shared τ/2 ‖M‖² + C            (eq. 7)

(dropout/DropConnect weights: ``τ(1−p)/2 ‖M‖²``, eq. 2 with ``p_i1 = 1−p``), with
``KL(q(z)‖p(z)) = 0`` and ``C = Σ_weights ½(τσ² − 1 − log τσ²)``; the mixture entropy is
replaced by the average component entropy, the approximation of eqs. (13)–(16) (exact for the
augmented model). Given ``z``, the weights are reparameterised (``Normal.rsample``), so gradients
reach the means ``M_k`` by the pathwise derivative. The score-function term Pyro adds for the
non-reparameterisable ``z`` is ``∇ log q(z) · cost = 0``: ``q(z)`` has no parameters. So SVI's
gradient is exactly the one of Algorithm 1 (``S = 1`` draw per step, appendix B.4).

Dropout follows Table 1 / eq. (10) (Gal & Ghahramani's parameterisation): the mask ``z_{i h₁}``
runs over the rows ``h₁ ∈ [1, H_{i-1}]`` of the paper's ``W_i ∈ R^{H_{i-1}×H_i}``, i.e. the *input*
units of the layer (dim 1 of torch's ``(out, in)`` weight; input channels of a convolution), and
there is no ``1/(1−p)`` rescaling: it is absorbed into ``M``, and train and test both sample.

**Prediction** (Algorithm 1 at test time, eq. 22): `sample_weights` draws ``S`` weight sets at
once and `sample_outputs` evaluates the net on all of them with ``torch.func.vmap`` over
``functional_call`` (eval mode: BatchNorm running statistics), or ``Predictive(model,
guide=model.guide, num_samples=S, parallel=True)``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pyro
import torch
from pyro.distributions import Bernoulli, Categorical, Delta, Normal
from pyro.nn import PyroModule
from pyro.nn.module import pyro_method
from pyro.poutine.runtime import get_plates
from torch import nn
from torch.func import functional_call, vmap

from ..likelihoods import Likelihood, check_temperature
from .subspace_net import _check_inputs, check_data

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


class PatchedNet(PyroModule):
    """A network with the EMP/ECMP/dropout/DropConnect/ensemble variational family (eq. 1).

    Args:
        net: a ``torch.nn.Module`` mapping inputs ``(N, ...)`` to outputs ``(N, O)``. Its
            parameters give the shapes and (``init="copy"``) the initial means; they are never
            changed. Its buffers (BatchNorm running statistics) are used and updated in place
            during training (train mode), except in ``"ensemble"`` mode, which keeps one copy per
            member in ``PatchedNet`` buffers.
        likelihood: a `Likelihood` (`Categorical`, `Gaussian`, `Bernoulli`).
        patches: ``"auto"`` or a list of module names. For ``emp``/``ecmp``, ``"auto"`` patches the
            affine parameters of every BatchNorm/LayerNorm/GroupNorm/InstanceNorm and the output
            layer (the last ``Linear``/``Conv``), section 3.3. For ``dropout``/``dropconnect`` it
            masks the weights of every ``Linear``/``Conv`` but the first (the raw inputs are not
            dropped); a list must name ``Linear``/``Conv`` modules. ``ensemble`` patches
            everything and accepts only ``"auto"``.
        n_components: ``K >= 2`` (the paper uses 5). Ignored by dropout/DropConnect (``K = 2``
            with a zero component, Table 1).
        mode: one of ``"emp"``, ``"ecmp"``, ``"dropout"``, ``"dropconnect"``, ``"ensemble"``.
        prior_precision: ``τ`` of the prior ``N(0, τ⁻¹ I)``; a positive float, or a dict
            ``{module name: τ}`` overriding it per layer (``""`` key: the default).
        sigma: the fixed, small standard deviation ``σ`` of every Gaussian component (eq. 4).
            ``0`` is the limit ``σ → 0`` (the paper suggests machine epsilon): the guide puts a
            ``Delta`` at ``M_z``, ``Trace_ELBO``'s ``−log p(W)`` is then exactly
            ``τ/2 ‖M_z‖² + const``, and no weight noise is drawn (cheaper training).
        drop_prob: dropout/DropConnect probability of the zero component (``1 - p_i``).
        temperature: likelihood temperature ``T`` (log-likelihood scaled by ``1/T``).
        subsample_size: default minibatch size of the ``"data"`` plate.
        init: ``"reset"``: each component of a patched module is an independent draw of the
            module's own ``reset_parameters()`` (normalisation layers, whose reset is constant,
            get ``init_jitter`` Gaussian noise), as for an ensemble trained from scratch;
            ``"copy"``: every component is the net's current value plus ``init_jitter × rms``
            noise, to patch a pretrained net. Shared and dropout means always start at the net's
            current values.
        init_jitter: scale of the initial noise between components.
        seed: seeds the initialisation.

    Call as ``model(x, y=None, subsample_size=None, num_data=None)``: ``x`` ``(N, ...)``, ``y``
    ``(N,)``. ``num_data`` says ``x`` is a minibatch of a data set of that size (the plate scales
    the log-likelihood by ``num_data / N``). Sites: one ``"z.<module>"`` (emp/ensemble: ``"z"``)
    or ``"z.<param>"`` (ecmp, dropout, dropconnect) assignment per patched unit, one
    ``"w.<param>"`` per parameter tensor, ``"f"`` (outputs ``(N, O)``), ``"obs"`` in plate
    ``"data"``. The guide is `guide` (same signature). Put the model in ``train()`` mode for SVI
    (BatchNorm uses batch statistics and updates its running statistics) and ``eval()`` for
    prediction. As for any ``PyroModule``, the means live in Pyro's global param store under
    the names ``loc_<param>``: call ``pyro.clear_param_store()`` before building a second model.

    Example:
        >>> net = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
        >>> model = PatchedNet(net, likelihoods.Categorical(), mode="ecmp", prior_precision=1.0)
        >>> svi = SVI(model, model.guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
        >>> svi.step(x_batch, y_batch, num_data=len(x_train))  # doctest: +SKIP
        >>> probs = model.eval().predictive_mean(x_test, num_samples=100)  # doctest: +SKIP
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        patches: str | Sequence[str] = "auto",
        n_components: int = 5,
        mode: str = "emp",
        prior_precision: float | dict[str, float] = 1.0,
        sigma: float = 1e-3,
        drop_prob: float = 0.5,
        temperature: float = 1.0,
        subsample_size: int | None = None,
        init: str = "reset",
        init_jitter: float = 0.1,
        seed: int = 0,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        if not isinstance(likelihood, Likelihood):
            raise TypeError(
                f"likelihood: expected a pyro_subspace Likelihood, got {type(likelihood).__name__}"
            )
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if isinstance(n_components, bool) or not isinstance(n_components, int):
            raise TypeError(f"n_components: expected an int >= 2, got {n_components!r}")
        if n_components < 2:
            raise ValueError(f"n_components: expected an int >= 2, got {n_components}")
        _positive(sigma, "sigma", allow_zero=True)
        _positive(init_jitter, "init_jitter", allow_zero=True)
        if isinstance(drop_prob, bool) or not isinstance(drop_prob, (int, float)):
            raise TypeError(f"drop_prob: expected a float in (0, 1), got {drop_prob!r}")
        if not 0 < drop_prob < 1:
            raise ValueError(f"drop_prob: expected a float in (0, 1), got {drop_prob!r}")
        check_temperature(temperature)
        if subsample_size is not None:
            _check_size(subsample_size, "subsample_size")
        if init not in ("reset", "copy"):
            raise ValueError(f"init: expected 'reset' or 'copy', got {init!r}")
        if not any(True for _ in net.parameters()):
            raise ValueError("net: the network has no parameters")
        modules = dict(net.named_modules())
        patched = _choose_patches(net, modules, patches, mode)
        precisions = _precisions(prior_precision, modules)
        super().__init__()
        self.mode = mode
        self.n_components = 2 if mode in ("dropout", "dropconnect") else n_components
        self.sigma = float(sigma)
        self.drop_prob = float(drop_prob)
        self.temperature = float(temperature)
        self.subsample_size = subsample_size
        self.likelihood = likelihood
        self.patched_modules = patched
        self._holder = _Holder(net)  # not a submodule: its parameters are not model parameters
        self._buffer_cache: dict[str, torch.Tensor] | None = None
        self.slots: list[Slot] = []
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for mod_name, module in modules.items():
                for pname, p in module.named_parameters(recurse=False):
                    full = f"{mod_name}.{pname}" if mod_name else pname
                    kind = "shared"
                    if mod_name in patched:
                        kind = "drop" if mode in ("dropout", "dropconnect") else "patch"
                        if kind == "drop" and pname != "weight":
                            kind = "shared"  # Table 1: biases are never dropped (z_j = 1)
                    tau = precisions.get(mod_name, precisions[""])
                    key = "loc_" + full.replace(".", "__")
                    slot = Slot(full, mod_name, p.shape, kind, key, "w." + full, tau)
                    self.slots.append(slot)
                    if kind == "patch":
                        init_value = _components(
                            module, pname, p, self.n_components, init, init_jitter, gen
                        )
                    else:
                        init_value = p.detach().clone()
                    setattr(self, key, nn.Parameter(init_value))
        if mode == "ensemble":  # one set of BatchNorm statistics per member
            self._buffer_keys = {}
            for bname, buf in net.named_buffers():
                key = "buf_" + bname.replace(".", "__")
                self._buffer_keys[bname] = key
                reps = (self.n_components,) + (1,) * buf.dim()
                self.register_buffer(key, buf.detach().clone().unsqueeze(0).repeat(reps))

    # ----------------------------------------------------------------------------------------
    # bookkeeping

    @property
    def net(self) -> nn.Module:
        """The wrapped network (its parameters are not used; its buffers are)."""
        return self._holder.net

    def train(self, mode: bool = True) -> PatchedNet:
        super().train(mode)
        self.net.train(mode)
        return self

    @property
    def num_weights(self) -> int:
        """Number of parameters ``D`` of the network."""
        return sum(s.numel for s in self.slots)

    @property
    def num_variational_parameters(self) -> int:
        """Number of learnable variational parameters (the means ``M``, ``m``)."""
        return sum(s.numel * (self.n_components if s.kind == "patch" else 1) for s in self.slots)

    @property
    def overhead(self) -> float:
        """Parameter overhead in percent: ``100 (#variational − D) / D`` (section 3.3, Table 3).

        Equals ``Σ (K−1) × numel`` over patched tensors: ``2(K−1)N₂`` per BatchNorm layer of
        ``N₂`` units and ``(K−1)(I+1)O`` per patched ``Linear(I, O)``; 0 for dropout/DropConnect
        (fixed zero component, fixed ``p``) and ``100 (K−1)`` for an explicit ensemble.
        """
        d = self.num_weights
        return 100.0 * (self.num_variational_parameters - d) / d

    @property
    def elbo_constant(self) -> float:
        """``C = Σ_weights ½(τσ² − 1 − log τσ²)`` (``σ = 0``: ``Σ_weights ½ log(2π/τ)``):
        ``Trace_ELBO``'s loss minus this is the paper's loss (expected NLL + eq. 7) in
        expectation (see the module docstring)."""
        total = 0.0
        for s in self.slots:
            if self.sigma == 0:  # Delta guide: log q = 0, -log p(M) = τ/2 M² + ½ log(2π/τ)
                total += s.numel * 0.5 * math.log(2 * math.pi / s.precision)
                continue
            ts2 = s.precision * self.sigma**2
            total += s.numel * 0.5 * (ts2 - 1.0 - math.log(ts2))
        return total

    def means(self) -> dict[str, torch.Tensor]:
        """The variational means by parameter name: ``(K, *shape)`` if patched, else ``shape``."""
        return {s.name: self._raw(s) for s in self.slots}

    def _raw(self, slot: Slot) -> torch.Tensor:
        return self._parameters[slot.key]

    def _like(self) -> torch.Tensor:
        """A tensor with the model's dtype and device."""
        return self._parameters[self.slots[0].key]

    def penalty(self) -> torch.Tensor:
        """Eq. (7): ``Σ_patched Σ_k τ p_k/2 ‖M_k‖² + Σ_shared τ/2 ‖M‖²`` (a scalar tensor).

        Dropout/DropConnect weights contribute ``τ (1−p)/2 ‖M‖²`` (eq. 2 with ``p_i1 = 1−p``).
        """
        total = self._like().new_zeros(())
        keep = 1.0 - self.drop_prob
        for s in self.slots:
            m = self._raw(s)
            sq = m.square().sum()
            if s.kind == "patch":
                sq = sq / self.n_components  # uniform p_k = 1/K
            elif s.kind == "drop":
                sq = keep * sq
            total = total + 0.5 * s.precision * sq
        return total

    # ----------------------------------------------------------------------------------------
    # assignments and weights

    def _assignment_sites(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(site name, event shape, kind) of each assignment site, in sampling order."""
        sites = []
        if self.mode == "ensemble":
            return [("z", (), "cat")]
        if self.mode == "emp":
            return [(f"z.{m}", (), "cat") for m in self.patched_modules]
        for s in self.slots:
            if s.kind == "patch":
                sites.append((f"z.{s.name}", tuple(s.shape), "cat"))
            elif s.kind == "drop":
                shape = (s.shape[1],) if self.mode == "dropout" else tuple(s.shape)
                sites.append((f"z.{s.name}", shape, "bern"))
        return sites

    def _assignment_dist(self, shape: tuple[int, ...], kind: str, like: torch.Tensor):
        if kind == "cat":
            probs = like.new_full((self.n_components,), 1.0 / self.n_components)
            d = Categorical(probs=probs)
        else:
            d = Bernoulli(probs=like.new_tensor(1.0 - self.drop_prob))
        return d.expand(shape).to_event(len(shape)) if shape else d

    def _draw_assignments(self, batch: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Assignments drawn with plain ``torch.randint``/``torch.rand`` (the distributions of
        `_assignment_dist`, without their per-call overhead), each ``(*batch, *event)``."""
        like = self._like()
        out = {}
        for name, shape, kind in self._assignment_sites():
            if kind == "cat":
                out[name] = torch.randint(self.n_components, batch + shape, device=like.device)
            else:
                u = torch.rand(batch + shape, dtype=like.dtype, device=like.device)
                out[name] = (u < 1.0 - self.drop_prob).to(like.dtype)
        return out

    def _site_for(self, slot: Slot) -> str | None:
        if slot.kind == "shared":
            return None
        if self.mode == "ensemble":
            return "z"
        if self.mode == "emp":
            return f"z.{slot.module}"
        return f"z.{slot.name}"

    def _loc(
        self, slot: Slot, z: dict[str, torch.Tensor], batch: tuple[int, ...], raw: bool = False
    ) -> torch.Tensor:
        """Mean of the selected component, shape ``(*batch, *slot.shape)``, differentiable in M.

        ``raw=False`` reads the mean through ``PyroModule`` (a ``pyro.param`` statement inside
        model and guide); ``raw=True`` reads the tensor directly (plain-torch paths)."""
        m = self._parameters[slot.key] if raw else getattr(self, slot.key)
        shape = tuple(slot.shape)
        if slot.kind == "shared":
            return m.expand(*batch, *shape)
        a = z[self._site_for(slot)]
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

    def _weight_dist(self, loc: torch.Tensor, slot: Slot):
        if self.sigma == 0:
            return Delta(loc, event_dim=len(slot.shape))
        return Normal(loc, self.sigma).to_event(len(slot.shape))

    def _prior(self, slot: Slot, like: torch.Tensor):
        scale = like.new_tensor(slot.precision**-0.5)
        return Normal(like.new_zeros(()), scale).expand(tuple(slot.shape)).to_event(len(slot.shape))

    @torch.no_grad()
    def sample_weights(self, num_samples: int) -> dict[str, torch.Tensor]:
        """``S`` draws from the variational distribution (Algorithm 1), vectorised.

        Returns:
            ``{"z...": assignments (S, *event), "w.<param>": weights (S, *param.shape)}``: the
            same sites as the guide, usable as ``Predictive(model, posterior_samples=...)``.
        """
        s = _check_size(num_samples, "num_samples")
        z = self._draw_assignments((s,))
        out = dict(z)
        for slot in self.slots:
            loc = self._loc(slot, z, (s,), raw=True)
            out[slot.site] = loc + self.sigma * torch.randn_like(loc) if self.sigma else loc
        return out

    # ----------------------------------------------------------------------------------------
    # network evaluation

    def _net_buffers(self, member: int | torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Buffers for ``functional_call``: the net's own, or (ensemble) member ``member``'s.

        An ``int`` member gives views, so BatchNorm's in-place updates reach the stored copy; a
        tensor ``(B,)`` gives gathered ``(B, *shape)`` copies for ``vmap`` in eval mode.
        """
        if self.mode != "ensemble":
            if self._buffer_cache is not None:  # set by `fit` for the duration of training
                return self._buffer_cache
            return dict(self.net.named_buffers())
        if member is None:
            raise ValueError("member: ensemble mode needs the member index of each draw")
        return {b: self._buffers[key][member] for b, key in self._buffer_keys.items()}

    def outputs(
        self, weights: dict[str, torch.Tensor], x: torch.Tensor, member: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Network outputs at given weights.

        Args:
            weights: ``{param name: (*batch, *shape)}`` with the same ``batch`` for all.
            x: inputs ``(N, ...)``.
            member: ensemble mode only, the member index ``(*batch,)`` choosing BatchNorm buffers.

        Returns:
            ``(*batch, N, O)``. With a batch, eval mode uses ``torch.func.vmap``; train mode
            (BatchNorm updating its statistics in place) loops over the draws.
        """
        first = self.slots[0]
        w0 = weights[first.name]
        batch = w0.shape[: w0.dim() - len(first.shape)]
        net = self.net
        if len(batch) == 0:
            m = None if member is None else int(member)
            out = functional_call(net, {**weights, **self._net_buffers(m)}, (x,))
            return out.unsqueeze(-1) if out.dim() == 1 else out
        flat = {k: v.reshape(-1, *v.shape[len(batch) :]) for k, v in weights.items()}
        b = flat[first.name].shape[0]
        m = None if member is None else member.reshape(-1).expand(b)
        if net.training:
            outs = []
            for i in range(b):
                bufs = self._net_buffers(None if m is None else int(m[i]))
                outs.append(
                    functional_call(net, {**{k: v[i] for k, v in flat.items()}, **bufs}, (x,))
                )
            out = torch.stack(outs)
        else:
            bufs = self._net_buffers(m)
            dims = 0 if m is not None else None

            def one(w: dict, bb: dict) -> torch.Tensor:
                return functional_call(net, {**w, **bb}, (x,))

            out = vmap(one, in_dims=(0, dims))(flat, bufs)
        out = out.unsqueeze(-1) if out.dim() == 2 else out
        return out.reshape(*batch, *out.shape[1:])

    @torch.no_grad()
    def sample_outputs(self, x: torch.Tensor, num_samples: int = 100) -> torch.Tensor:
        """Outputs of ``S`` variational draws (Algorithm 1), shape ``(S, N, O)``; no gradients.

        The network runs in its current mode; call ``model.eval()`` first for test predictions.
        """
        _check_inputs(x)
        draws = self.sample_weights(num_samples)
        weights = {s.name: draws[s.site] for s in self.slots}
        return self.outputs(weights, x, draws["z"] if self.mode == "ensemble" else None)

    @torch.no_grad()
    def predictive_mean(self, x: torch.Tensor, num_samples: int = 100) -> torch.Tensor:
        """Posterior predictive mean by ``S`` draws (eq. 22): class probabilities ``(N, C)`` for
        classification, regression means ``(N,)`` or ``(N, O)``."""
        return self.likelihood.mean(self.sample_outputs(x, num_samples)).mean(0)

    # ----------------------------------------------------------------------------------------
    # the paper's practical implementation: one draw + L2 on the means

    def negative_elbo(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        num_data: int | None = None,
        include_penalty: bool = True,
        validate: bool = True,
    ) -> torch.Tensor:
        """One-draw estimate of the loss of eq. (21)/(20): ``(N/B) Σ_batch NLL / T + eq. (7)``.

        The same objective as ``Trace_ELBO`` on (`forward`, `guide`) minus the constant ``C``
        of the module docstring, with the KL term in closed form (`penalty`) instead of its
        one-sample estimate: "simply enforce L2 regularization on all the learnable variational
        parameters" (section 2). Same expectation, same expected gradient, lower variance, and
        no Pyro bookkeeping per step; `fit` uses it by default.

        Args:
            x: a minibatch ``(B, ...)``; y: its targets ``(B,)``.
            num_data: size ``N`` of the full data set (default ``B``).
            include_penalty: add eq. (7); `fit` leaves it out and lets Adam's ``weight_decay``
                (`weight_decays`) apply its exact gradient, which is cheaper.
            validate: check ``x`` and ``y`` (`fit` checks the whole data once and then passes
                targets already prepared by the likelihood).

        Returns:
            A scalar tensor, differentiable in the means.
        """
        if validate:
            n, _, total = _check_call(x, y, None, num_data)
        else:
            n = x.shape[0]
            total = n if num_data is None else num_data
        like = self._like()
        z = self._draw_assignments(())
        locs = [self._loc(s, z, (), raw=True) for s in self.slots]
        if self.sigma > 0:  # one draw of σ ε for all weights
            noise = torch.randn(self.num_weights, dtype=like.dtype, device=like.device)
            noise = torch.split(noise * self.sigma, [s.numel for s in self.slots])
            weights = {s.name: m + e.view(s.shape) for s, m, e in zip(self.slots, locs, noise)}
        else:
            weights = {s.name: m for s, m in zip(self.slots, locs)}
        out = self.outputs(weights, x, z["z"] if self.mode == "ensemble" else None)
        yb = self.likelihood.validate(out, y) if validate else y
        log_lik = self.likelihood.distribution(out).log_prob(yb)
        nll = -log_lik.sum() * (total / n) / self.temperature
        return nll + self.penalty() if include_penalty else nll

    def weight_decays(self, num_data: int) -> dict[str, float]:
        """Per-parameter L2 coefficients on the *mean* loss that reproduce `penalty` (eq. 7).

        ``∂/∂M [penalty / N] = (τ c / N) M`` with ``c = p_k = 1/K`` (patched), ``1 − p``
        (dropout/DropConnect weights) or 1 (shared): Adam's ``weight_decay`` of that size per
        parameter, exactly what the vanilla net's L2 is.

        Returns:
            ``{attribute name of the mean: coefficient}``.
        """
        coef = {"patch": 1.0 / self.n_components, "drop": 1.0 - self.drop_prob, "shared": 1.0}
        return {s.key: s.precision * coef[s.kind] / num_data for s in self.slots}

    def fit(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        epochs: int = 100,
        lr: float = 1e-3,
        batch_size: int = 128,
        method: str = "torch",
        seed: int | None = None,
    ) -> list[float]:
        """Train the means with Adam on shuffled minibatches, one draw per step (Algorithm 1).

        Args:
            x: training inputs ``(N, ...)``; y: targets ``(N,)``.
            epochs, lr, batch_size: Adam (default settings, as the paper) and minibatching.
            method: ``"torch"``: `negative_elbo` with ``torch.optim.Adam``; ``"svi"``: Pyro's
                ``SVI(self, self.guide, pyro.optim.Adam, Trace_ELBO())`` on the same objective
                (several times slower per step on small nets: Pyro's tracing dominates).
            seed: seeds the shuffling (and nothing else; seed Pyro/torch for the draws).

        Returns:
            Mean loss per data point of each epoch: for ``"torch"`` the expected NLL part of
            `negative_elbo` over ``N`` (the penalty is applied as weight decay); for ``"svi"`` the
            whole ELBO loss over ``N``, which includes the constant ``C``.
        """
        n = _check_inputs(x)
        _check_call(x, y, None, None)
        for name, value in (("epochs", epochs), ("batch_size", batch_size)):
            _check_size(value, name)
        _positive(lr, "lr")
        if method not in ("torch", "svi"):
            raise ValueError(f"method: expected 'torch' or 'svi', got {method!r}")
        with torch.no_grad():  # check the targets against the outputs once, not every step
            probe = self.eval().sample_outputs(x[:1], 1)[0]
        y = self.likelihood.validate(probe.new_zeros(n, *probe.shape[1:]), y)
        gen = torch.Generator()
        gen.manual_seed(seed) if seed is not None else gen.seed()
        self.train()
        if method == "svi":
            from pyro.infer import SVI, Trace_ELBO

            svi = SVI(self, self.guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())

            def step(xb: torch.Tensor, yb: torch.Tensor) -> float:
                return svi.step(xb, yb, num_data=n)
        else:
            decays = self.weight_decays(n)
            groups = [
                {"params": [self._parameters[k]], "weight_decay": v} for k, v in decays.items()
            ]
            opt = torch.optim.Adam(groups, lr=lr)

            def step(xb: torch.Tensor, yb: torch.Tensor) -> float:
                opt.zero_grad()
                with pyro.validation_enabled(False):  # data validated once, above
                    nll = self.negative_elbo(
                        xb, yb, num_data=n, include_penalty=False, validate=False
                    )
                (nll / n).backward()  # the penalty's gradient: Adam's weight_decay (eq. 7)
                opt.step()
                return float(nll.detach())

        history = []
        self._buffer_cache = dict(self.net.named_buffers())  # the same tensors, looked up once
        try:
            for _ in range(epochs):
                order = torch.randperm(n, generator=gen).to(x.device)
                total = 0.0
                batches = 0
                for start in range(0, n, batch_size):
                    idx = order[start : start + batch_size]
                    if idx.numel() < 2 and n >= 2:  # BatchNorm needs two points: skip a single
                        continue
                    total += step(x[idx], y[idx])
                    batches += 1
                history.append(total / max(batches, 1) / n)
        finally:
            self._buffer_cache = None
        return history

    # ----------------------------------------------------------------------------------------
    # Pyro model and guide

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        subsample_size: int | None = None,
        num_data: int | None = None,
    ) -> torch.Tensor:
        n, size, total = _check_call(x, y, subsample_size or self.subsample_size, num_data)
        like = self._like()
        z = {}
        for name, shape, kind in self._assignment_sites():
            z[name] = pyro.sample(name, self._assignment_dist(shape, kind, like))
        weights = {}
        for s in self.slots:
            w = pyro.sample(s.site, self._prior(s, like))
            weights[s.name] = _drop_data_dim(w, len(s.shape))
        member = _drop_data_dim(z["z"], 0) if self.mode == "ensemble" else None
        if num_data is not None:  # x is already a minibatch of a data set of num_data points
            plate_kwargs = {"subsample": torch.arange(n, device=x.device)}
        else:
            plate_kwargs = {"subsample_size": size}
        with pyro.plate("data", total, dim=-1, **plate_kwargs) as idx:
            xb = x if size is None else x[idx]
            yb = y if (y is None or size is None) else y[idx]
            out = self.outputs(weights, xb, member)
            if yb is not None:
                yb = self.likelihood.validate(out, yb)
            else:
                self.likelihood.check_outputs(out)
            pyro.deterministic("f", out, event_dim=1)
            return self.likelihood.observe(out, yb, self.temperature)

    @pyro_method
    def guide(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        subsample_size: int | None = None,
        num_data: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """The variational distribution eq. (1) with assignments eqs. (5)/(6)/Table 1.

        Samples each assignment site from its fixed uniform (Bernoulli) distribution, then each
        weight site from ``N(M_z, σ²)`` by reparameterisation. Vectorised plates (``Predictive(...,
        parallel=True)``, ``vectorize_particles=True``) get independent assignments per draw.
        """
        batch = _plate_batch_shape()
        like = self._like()
        z = {}
        for name, shape, kind in self._assignment_sites():
            d = self._assignment_dist(shape, kind, like)
            z[name] = pyro.sample(name, d.expand(batch + d.batch_shape) if batch else d)
        out = dict(z)
        for s in self.slots:
            loc = self._loc(s, z, batch)
            out[s.site] = pyro.sample(s.site, self._weight_dist(loc, s))
        return out


class _Holder:
    """Keeps the wrapped net out of ``PatchedNet``'s submodules (and out of the param store)."""

    def __init__(self, net: nn.Module) -> None:
        self.net = net


def _plate_batch_shape() -> tuple[int, ...]:
    """Batch shape of the enclosing vectorised plates (``()`` outside any)."""
    plates = [f for f in get_plates() if f.vectorized and f.dim is not None]
    if not plates:
        return ()
    shape = [1] * max(-f.dim for f in plates)
    for f in plates:
        shape[f.dim] = f.size
    return tuple(shape)


def _drop_data_dim(v: torch.Tensor, event_dim: int) -> torch.Tensor:
    """Vectorised draws carry a singleton at the data plate's dim -1 left of the event; drop it."""
    batch = v.dim() - event_dim
    if batch >= 2 and v.shape[batch - 1] == 1:
        return v.squeeze(batch - 1)
    return v


def _choose_patches(
    net: nn.Module, modules: dict[str, nn.Module], patches: str | Sequence[str], mode: str
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
            out[k] = _positive(v, f"prior_precision[{k!r}]")
        return out
    return {"": _positive(prior_precision, "prior_precision")}


def _positive(value: object, name: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive float, got {value!r}")
    ok = value >= 0 if allow_zero else value > 0
    if not ok or not math.isfinite(value):
        raise ValueError(
            f"{name}: expected a finite {'non-negative' if allow_zero else 'positive'} float, got {value!r}"
        )
    return float(value)


def _check_size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _check_call(x, y, size, num_data) -> tuple[int, int | None, int]:
    """Validate a model call; return (N, subsample size, plate size)."""
    n = check_data(x, y)
    if size is not None:
        _check_size(size, "subsample_size")
        if size > n:
            raise ValueError(f"subsample_size: {size} exceeds the number of data points {n}")
    if num_data is not None:
        _check_size(num_data, "num_data")
        if num_data < n:
            raise ValueError(f"num_data: {num_data} is smaller than the batch size {n}")
        if size is not None:
            raise ValueError("num_data: give either num_data (x is a minibatch) or subsample_size")
        return n, None, num_data
    return n, size, n


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
