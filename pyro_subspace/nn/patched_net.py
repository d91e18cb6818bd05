"""`PatchedNet`: the ensemble variational family of Ensemble Model Patching as a Pyro model + guide.

Chang et al., *Ensemble Model Patching* (EMP). The family (eq. 1: per weight element a mixture
of ``K`` narrow Gaussians with uniform, fixed weights, and an assignment whose structure is the
method: EMP, ECMP, MC dropout, DropConnect, explicit ensemble; Table 1) is described and built in
`patch_family`; the prior is ``N(0, τ⁻¹ I)`` on every weight (section 3.2). The network is
evaluated at the drawn weights by `FlatNet.evaluate` (``torch.func.functional_call``, and
``vmap`` over draws in eval mode).

**Objective.** ``Trace_ELBO`` on (`forward`, `guide`) is the paper's loss, expected NLL plus
the closed-form KL term eq. (7), plus a constant ``C`` (`patch_family` derives it); `fit` and
`negative_elbo` use eq. (7) in closed form directly, Adam's weight decay applying its gradient.

**Prediction** (Algorithm 1 at test time, eq. 22): `sample_weights` draws ``S`` weight sets at
once and `sample_outputs` evaluates the net on all of them in eval mode (BatchNorm running
statistics) with ``torch.func.vmap``, or ``Predictive(model, guide=model.guide, num_samples=S,
parallel=True)``.

**Persistence.** The means, the likelihood's parameters and the BatchNorm running statistics
(the net's own, or one copy per member in ``"ensemble"`` mode) are in `state_dict`; a
`PatchedNet` built with the same arguments on the same architecture loads it and predicts
bit-identically.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import pyro
import torch
from pyro.nn import PyroModule
from pyro.nn.module import pyro_method
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .. import batch as batching
from .. import distributed, validation
from ..data import check_batchnorm_loader
from ..flat import FlatNet, eval_mode, preserved, train_mode
from ..likelihoods import Likelihood, check_temperature
from ..minibatch import loader_loop, minibatch_loop, shuffle_generator
from ..threads import thread_policy
from . import patch_flat, patch_svi
from .patch_family import PatchFamily, check_call, drop_data_dim, plate_batch_shape, positive

__all__ = ["PatchedNet"]


class PatchedNet(PyroModule):
    """A network with the EMP/ECMP/dropout/DropConnect/ensemble variational family (eq. 1).

    Args:
        net: a ``torch.nn.Module`` mapping inputs ``(N, ...)`` to outputs ``(N, O)``. Its
            parameters give the shapes and (``init="copy"``) the initial means; they are never
            changed. Its buffers (BatchNorm running statistics) are used and updated in place
            during training (train mode), except in ``"ensemble"`` mode, which keeps one copy per
            member. Either way they are ``PatchedNet`` buffers, saved in its `state_dict`.
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
            The default ``0`` is the limit ``σ → 0`` of the paper's choice ("fixing σ to be
            small, e.g. machine epsilon", section 3.1; the `pyro-subspace patch` command and
            ``benchmarks/patches_digits.py`` use it too): the guide puts a ``Delta`` at
            ``M_z``, ``Trace_ELBO``'s ``−log p(W)`` is then exactly ``τ/2 ‖M_z‖² + const``, and
            no weight noise is drawn. At float32's machine epsilon the noise moves a weight by
            about ``10⁻⁷`` (relative ``10⁻⁶`` at a typical ``|w| ≈ 0.1``), far below one Adam
            step, while drawing it costs ``D`` normal numbers a step (about 10% of a plain step
            of the digits MLP); a positive ``σ`` draws it as eq. (1) writes.
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
    ``Predictive``; `fit`, `sample_outputs` and `predictive_mean` set the mode they need and
    restore the user's. As for any ``PyroModule``, the means live in Pyro's global param store under
    the names ``loc_<param>``: call ``pyro.clear_param_store()`` before building a second model.

    Example:
        >>> x, y = torch.randn(100, 64), torch.randint(0, 10, (100,))
        >>> net = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
        >>> model = PatchedNet(net, likelihoods.Categorical(), mode="ecmp", prior_precision=1.0)
        >>> svi = SVI(model, model.guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
        >>> loss = svi.step(x[:20], y[:20], num_data=100) - model.elbo_constant  # C dominates
        >>> model.predictive_mean(x[:5], num_samples=8).shape  # class probabilities
        torch.Size([5, 10])
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        patches: str | Sequence[str] = "auto",
        n_components: int = 5,
        mode: str = "emp",
        prior_precision: float | dict[str, float] = 1.0,
        sigma: float = 0.0,
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
        family = PatchFamily(net, patches, mode, n_components, prior_precision, sigma, drop_prob)
        positive(init_jitter, "init_jitter", allow_zero=True)
        check_temperature(temperature)
        if subsample_size is not None:
            validation.positive_int(subsample_size, "subsample_size")
        if init not in ("reset", "copy"):
            raise ValueError(f"init: expected 'reset' or 'copy', got {init!r}")
        super().__init__()
        self.family = family
        self.flat_cache = patch_flat.FlatCache()  # the flat means, layout and prior, rebuilt on use
        self.temperature = float(temperature)
        self.subsample_size = subsample_size
        self.likelihood = likelihood
        # the net is not a submodule: its parameters are no model parameters, only the means are
        self.flat = FlatNet(net, batch_strategy="vmap")
        for key, value in family.initial_means(net, init, init_jitter, seed).items():
            setattr(self, key, nn.Parameter(value))
        # BatchNorm running statistics live in PatchedNet's buffers (state_dict, `to`): the
        # net's own tensors, or in ensemble mode one copy per member, shape (K, *shape)
        self._buffer_keys = {b: "buf_" + b.replace(".", "__") for b, _ in net.named_buffers()}
        for bname, buf in net.named_buffers():
            if mode == "ensemble":
                reps = (self.n_components,) + (1,) * buf.dim()
                buf = buf.detach().clone().unsqueeze(0).repeat(reps)
            self.register_buffer(self._buffer_keys[bname], buf)

    # ----------------------------------------------------------------------------------------
    # bookkeeping

    @property
    def net(self) -> nn.Module:
        """The wrapped network (its parameters are not used; its buffers are)."""
        return self.flat.net

    mode = property(lambda self: self.family.mode, doc="The method (`patch_family.MODES`).")
    slots = property(lambda self: self.family.slots, doc="One `Slot` per parameter tensor.")
    patched_modules = property(lambda self: self.family.patched_modules, doc="Patched modules.")
    n_components = property(lambda self: self.family.n_components, doc="``K``.")
    sigma = property(lambda self: self.family.sigma, doc="``σ`` of the components.")
    drop_prob = property(lambda self: self.family.drop_prob, doc="Dropout probability ``p``.")
    num_weights = property(lambda self: self.family.num_weights, doc="``D`` of the network.")
    num_variational_parameters = property(
        lambda self: self.family.num_variational_parameters,
        doc="Number of learnable variational parameters (the means ``M``, ``m``).",
    )

    def train(self, mode: bool = True) -> PatchedNet:
        super().train(mode)
        self.net.train(mode)
        return self

    def _apply(self, fn: Callable, recurse: bool = True) -> PatchedNet:
        """``to``/``double``/...: the net follows, and outside ensemble mode the buffers stay the
        net's own tensors."""
        self.net._apply(fn)
        super()._apply(fn, recurse)
        if self.mode != "ensemble":
            for bname, key in self._buffer_keys.items():
                self._buffers[key] = self.net.get_buffer(bname)
        return self

    overhead = property(
        lambda self: self.family.overhead, doc="Parameter overhead in percent (Table 3)."
    )

    @property
    def elbo_constant(self) -> float:
        """``C = Σ_weights ½(τσ² − 1 − log τσ²)`` (``σ = 0``: ``Σ_weights ½ log(2π/τ)``):
        ``Trace_ELBO``'s loss minus this is the paper's loss (expected NLL + eq. 7) in
        expectation (derived in `patch_family`)."""
        return self.family.elbo_constant

    def means(self) -> dict[str, torch.Tensor]:
        """The variational means by parameter name: ``(K, *shape)`` if patched, else ``shape``."""
        return {s.name: self._parameters[s.key] for s in self.slots}

    def _like(self) -> torch.Tensor:
        """A tensor with the model's dtype and device."""
        return self._parameters[self.slots[0].key]

    def penalty(self) -> torch.Tensor:
        """Eq. (7) at the current means, a scalar tensor (`PatchFamily.penalty`)."""
        return self.family.penalty(self._parameters)

    @torch.no_grad()
    def sample_weights(self, num_samples: int) -> dict[str, torch.Tensor]:
        """``S`` draws from the variational distribution (Algorithm 1), vectorised.

        Returns:
            ``{"z...": assignments (S, *event), "w.<param>": weights (S, *param.shape)}``: the
            same sites as the guide, usable as ``Predictive(model, posterior_samples=...)``.
        """
        return self.family.sample(
            self._parameters, validation.positive_int(num_samples, "num_samples")
        )

    # ----------------------------------------------------------------------------------------
    # network evaluation

    def _member_buffers(self, member: int | torch.Tensor) -> dict[str, torch.Tensor]:
        """Ensemble mode: the BatchNorm buffers of ``member``. An ``int`` gives views, so
        BatchNorm's in-place updates reach the stored copy; a tensor ``(*batch,)`` gives
        gathered ``(*batch, *shape)`` copies, one per draw."""
        return {b: self._buffers[key][member] for b, key in self._buffer_keys.items()}

    def outputs(
        self, weights: dict[str, torch.Tensor], x: torch.Tensor, member: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Network outputs at given weights, in the network's current mode.

        Args:
            weights: ``{param name: (*batch, *shape)}`` with the same ``batch`` for all.
            x: inputs ``(N, ...)``.
            member: ensemble mode only, the member index ``(*batch,)`` choosing BatchNorm buffers.

        Returns:
            ``(*batch, N, O)``. With a batch, eval mode uses ``torch.func.vmap``; train mode
            (BatchNorm updating its statistics in place) loops over the draws (`FlatNet.evaluate`).
        """
        first = self.slots[0]
        w0 = weights[first.name]
        batch = tuple(w0.shape[: w0.dim() - len(first.shape)])
        buffers = None
        if self.mode == "ensemble":
            if member is None:
                raise ValueError("member: ensemble mode needs the member index of each draw")
            size = math.prod(batch)
            member = member.reshape(-1).expand(size).reshape(batch)
            if batch and self.net.training:  # each draw updates its member's statistics in turn
                flat = {k: v.reshape(size, *v.shape[len(batch) :]) for k, v in weights.items()}
                members = member.reshape(-1)
                outs = [
                    self.outputs({k: v[i] for k, v in flat.items()}, x, members[i])
                    for i in range(size)
                ]
                out = torch.stack(outs)
                return out.reshape(*batch, *out.shape[1:])
            buffers = self._member_buffers(int(member) if not batch else member)
        if batch or any(weights.get(s.name, x).shape != s.shape for s in self.slots):
            out = self.flat.evaluate(weights, x, buffers)  # batched, or checks a partial dict
        else:  # one draw: no functional_call bookkeeping (patch_svi.swapped_forward)
            out = patch_svi.swapped_forward(self.net, weights, x, buffers)
        return out.unsqueeze(-1) if out.dim() == len(batch) + 1 else out

    @torch.no_grad()
    def sample_outputs(self, x: torch.Tensor, num_samples: int = 100) -> torch.Tensor:
        """Outputs of ``S`` variational draws (Algorithm 1), shape ``(S, N, O)``; no gradients.

        Evaluated in eval mode (BatchNorm uses its running statistics and leaves them
        unchanged); the modes of the model and the net are restored afterwards.
        """
        validation.check_data(self.net, x)
        draws = self.sample_weights(num_samples)
        weights = {s.name: draws[s.site] for s in self.slots}
        with eval_mode(self, self.net):
            return self.outputs(weights, x, draws["z"] if self.mode == "ensemble" else None)

    @torch.no_grad()
    def _one_draw_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """``sample_outputs(x, 1)[0]`` (the same draw from the same random stream, the same
        outputs ``(N, O)``) through the one-draw path, without ``vmap``'s set-up."""
        draws = self.sample_weights(1)
        weights = {s.name: draws[s.site][0] for s in self.slots}
        with eval_mode(self, self.net):
            return self.outputs(weights, x, draws["z"][0] if self.mode == "ensemble" else None)

    @torch.no_grad()
    def predictive_mean(self, x: torch.Tensor, num_samples: int = 100) -> torch.Tensor:
        """Posterior predictive mean by ``S`` draws (eq. 22) in eval mode (`sample_outputs`):
        class probabilities ``(N, C)`` for classification, regression means ``(N,)`` or
        ``(N, O)``."""
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
        (`elbo_constant`), with the KL term in closed form (`penalty`) instead of its
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
            n, _, total = check_call(x, y, None, num_data)
        else:
            n = batching.rows(x)
            total = n if num_data is None else num_data
        like = self._like()
        z = self.family.draw_assignments((), like)
        locs = [self.family.select(s, self._parameters[s.key], z, ()) for s in self.slots]
        if self.sigma > 0:  # one draw of σ ε for all weights
            noise = torch.randn(self.num_weights, dtype=like.dtype, device=like.device)
            noise = torch.split(noise * self.sigma, [s.numel for s in self.slots])
            weights = {s.name: m + e.view(s.shape) for s, m, e in zip(self.slots, locs, noise)}
        else:
            weights = {s.name: m for s, m in zip(self.slots, locs)}
        out = self.outputs(weights, x, z["z"] if self.mode == "ensemble" else None)
        yb = self.likelihood.validate(out, y) if validate else y
        # the minibatch's mean NLL by the likelihood's fastest kernel (cross_entropy for a
        # Categorical), scaled to the N points: fit's own step computes it alike
        nll = self.likelihood.training_loss(out, yb) * total / self.temperature
        return nll + self.penalty() if include_penalty else nll

    def weight_decays(self, num_data: int) -> dict[str, float]:
        """Per-mean L2 coefficients on the *mean* loss that reproduce `penalty` (eq. 7), by
        attribute name of the mean (`PatchFamily.weight_decays`)."""
        return self.family.weight_decays(num_data)

    @thread_policy
    def fit(
        self,
        x: object,
        y: torch.Tensor | None = None,
        *,
        epochs: int = 100,
        lr: float = 1e-3,
        batch_size: int = 128,
        method: str = "torch",
        seed: int | None = None,
    ) -> list[float]:
        """Train the means with Adam on shuffled minibatches, one draw per step (Algorithm 1).

        Runs on `minibatch_loop` in training mode (BatchNorm uses batch statistics and updates
        its running statistics); the modes of the model and the net are restored afterwards. A
        last minibatch of one point is skipped (BatchNorm needs two).

        Args:
            x: training inputs ``(N, ...)``, or a ``Dataset`` of ``(x_n, y_n)`` (shuffled
                minibatches of ``batch_size``, a last batch of one point dropped) or a
                ``DataLoader`` (used as is), streamed: memory bounded by the batch, ``N`` its
                length, the targets checked batch by batch.
            y: targets ``(N,)``; ``None`` with a Dataset/DataLoader.
            epochs, lr, batch_size: Adam (default settings, as the paper) and minibatching.
            method: ``"torch"``: `negative_elbo` with ``torch.optim.Adam``; ``"svi"``: Pyro's
                ``SVI(self.fused_model, self.fused_guide, Adam, Trace_ELBO())`` on the same
                objective, with whole-tensor sites and one Adam for all means (`patch_svi`).
                Both step on the means laid end to end in one tensor (`patch_flat.flat_means`;
                the per-slot means become views of it), one gather per draw.
            seed: seeds the shuffling (and nothing else; seed Pyro/torch for the draws). With
                ``None`` the shuffling seed is one draw from torch's global generator, so
                ``torch.manual_seed`` alone makes the fit reproducible.

        Any exception, ``KeyboardInterrupt`` included, leaves the means, the likelihood's
        parameters and the BatchNorm statistics as they were before the call
        (`flat.preserved`).

        **Data-parallel** under a process group (`distributed`, ``method="torch"`` only): each
        rank passes its shard, ``batch_size`` is per rank, ``N`` the total. All ranks take rank
        0's random stream and state, so they draw the same assignment and noise per step (one
        draw per global minibatch, Algorithm 1), and the gradients are all-reduced per step
        (`distributed.reduce_gradients`, as in `fit_map`, whose docstring covers BatchNorm).

        Returns:
            Mean loss per data point of each epoch: for ``"torch"`` the expected NLL part of
            `negative_elbo` over ``N`` (the penalty is applied as weight decay); for ``"svi"`` the
            ELBO loss minus the constant `elbo_constant` (which would dominate it) over ``N``.
        """
        streamed = isinstance(x, (Dataset, DataLoader))
        # tensors: width, dtype, finiteness and targets against the net; a Dataset: its first item
        n = validation.check_data(self.net, x, y, self.likelihood, require_y=not streamed)
        if streamed and n == 0:
            raise ValueError(
                "x: PatchedNet.fit needs the number of training points N (eq. 7 weighs the prior "
                "by 1/N): give a Dataset with a length (or a DataLoader over one)"
            )
        validation.positive_int(epochs, "epochs"), validation.positive_int(batch_size, "batch_size")
        positive(lr, "lr")
        validation.choice(method, "method", ("torch", "svi"))
        if distributed.active() and method == "svi":
            raise ValueError("method: 'svi' is not data-parallel (torch.distributed); use 'torch'")
        local_n = n
        if distributed.active():  # one draw per global minibatch: every rank follows rank 0's stream
            n = sum(distributed.gather_ints(local_n))
            distributed.share_random_stream()
        gen = shuffle_generator(seed)
        # one draw's outputs on the first row: the targets of tensors are checked against them once
        # (streamed targets: per batch); drawn for a stream too, so that the training draws are the
        # same whatever the source
        first = batching.take(x, slice(0, 1)) if not streamed else _first_row(x)
        if first is not None:
            probe = self._one_draw_outputs(first)
        if not streamed:
            y = self.likelihood.validate(probe.new_zeros(local_n, *probe.shape[1:]), y)
        check_batchnorm_loader(self.net, x)
        if method == "svi":  # SVI(fused_model, fused_guide, Adam, Trace_ELBO()): patch_svi
            step = patch_svi.svi_step(self, n, lr, probe if streamed and first is not None else None)
            optimizer = None
        else:  # negative_elbo without the penalty over N, from the flat means; eq. (7) by Adam
            step, optimizer = patch_svi.torch_step(self, n, lr, validate=streamed)
        # torch: the per-slot means' gradients are views of the flat means' (one buffer)
        shared = patch_flat.shared_gradient(self) if optimizer is not None else nullcontext()

        def on_epoch(epoch: int, loss: float) -> None:
            distributed.sync_buffers(self)

        with (
            preserved(self, self.net, buffers="error", weights="error"),
            train_mode(self, self.net),
            shared as buffer,
        ):
            if optimizer is not None:
                optimizer.grad_buffer = buffer
            distributed.broadcast_state(self)  # rank 0's means and buffers, as DDP does
            if streamed:  # BatchNorm needs two points: a last batch of one is dropped
                loader = x if isinstance(x, DataLoader) else DataLoader(
                    x, batch_size=batch_size, shuffle=True, generator=gen,
                    drop_last=local_n % batch_size == 1,
                )  # fmt: skip
                return loader_loop(step, loader, epochs, optimizer, on_epoch, "PatchedNet.fit")
            return minibatch_loop(
                lambda idx: step(x[idx], y[idx]),
                local_n,
                epochs=epochs,
                batch_size=batch_size,
                generator=gen,
                optimizer=optimizer,
                device=batching.device_of(x),
                min_batch_size=2,
                epoch_loss="batches",
                on_epoch=on_epoch,
                desc="PatchedNet.fit",
                data_parallel=True,
            )

    # ----------------------------------------------------------------------------------------
    # Pyro model and guide

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        subsample_size: int | None = None,
        num_data: int | None = None,
    ) -> torch.Tensor:
        """Model: ``"obs"`` ``(N,)`` given ``x`` ``(N, ...)`` (returned; sampled if ``y`` is None),
        ``x`` a minibatch of ``num_data`` points if given. With `guide`, ``Trace_ELBO`` is eq. (7)
        plus `elbo_constant`, which dominates it: subtract it. Sites: see the class."""
        validation.check_data(self.net, x, y, self.likelihood)
        n, size, total = check_call(x, y, subsample_size or self.subsample_size, num_data)
        like = self._like()
        z = {}
        for name, shape, kind in self.family.assignment_sites():
            z[name] = pyro.sample(name, self.family.assignment_dist(shape, kind, like))
        weights = {}
        for s in self.slots:
            w = pyro.sample(s.site, self.family.prior(s, like))
            weights[s.name] = drop_data_dim(w, len(s.shape))
        member = drop_data_dim(z["z"], 0) if self.mode == "ensemble" else None
        if num_data is not None:  # x is already a minibatch of a data set of num_data points
            plate_kwargs = {"subsample": torch.arange(n, device=batching.device_of(x))}
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

    fused_model = pyro_method(patch_svi.fused_model)
    fused_guide = pyro_method(patch_svi.fused_guide)

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
        batch = plate_batch_shape()
        like = self._like()
        z = {}
        for name, shape, kind in self.family.assignment_sites():
            d = self.family.assignment_dist(shape, kind, like)
            z[name] = pyro.sample(name, d.expand(batch + d.batch_shape) if batch else d)
        out = dict(z)
        for s in self.slots:
            loc = self.family.select(s, getattr(self, s.key), z, batch)  # through pyro.param
            out[s.site] = pyro.sample(s.site, self.family.weight_dist(loc, s))
        return out


def _first_row(data: Dataset | DataLoader) -> torch.Tensor | None:
    """The inputs of a map-style data set's first item as a batch of one, else ``None``."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    try:
        item = dataset[0]
    except (TypeError, IndexError, NotImplementedError, KeyError):
        return None
    xs = item[0] if isinstance(item, (tuple, list)) else item
    return xs.unsqueeze(0) if isinstance(xs, torch.Tensor) else None
