"""`fit_map`: MAP training (then an optional constant-learning-rate SWA phase) on `minibatch_loop`."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import validation as ck
from . import batch as batching
from . import distributed
from .data import check_batchnorm_loader
from .exceptions import TrainingDivergedError
from .flat import Preserved, eval_mode, preserved, train_mode
from .likelihoods import Likelihood
from .minibatch import foreach_option, loader_loop, minibatch_loop, shuffle_generator
from .subspaces import SWACollector
from .threads import thread_policy


@thread_policy
def fit_map(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    epochs: int = 100,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    batch_size: int | None = None,
    optimizer: str = "adam",
    momentum: float = 0.9,
    collector: SWACollector | None = None,
    swa_epochs: int = 0,
    swa_lr: float | None = None,
    seed: int | None = None,
    progress: bool = True,
) -> list[float]:
    """Train ``net`` in place by minimising ``−mean_n log p(y_n | f(x_n; w))`` plus weight decay.

    Weight decay ``λ`` on the mean loss is the Gaussian prior ``N(0, (Nλ)⁻¹ I)`` on the weights, so
    the result is a MAP estimate. Learnable likelihood parameters (a `Gaussian` with
    ``sigma=None``) are trained alongside, without decay. With a ``collector``, ``swa_epochs`` of
    SGD at the constant rate ``swa_lr`` follow (weights only: likelihood parameters keep their MAP
    values), calling ``collector.collect()`` after each epoch
    (Subspace Inference C.2 / Algorithm 2): ``collector.mean`` is then the SWA solution, while the
    network keeps the last iterate.

    Args:
        net: the network (outputs ``(N, O)``); trained in place, its train/eval mode restored.
        likelihood: the `Likelihood` whose `log_prob` is the loss.
        x: inputs ``(N, ...)``; y: targets ``(N,)`` (``(N, 1)`` accepted). Or ``x`` a
            ``Dataset`` of ``(x_n, y_n)`` (shuffled minibatches of ``batch_size`` by a
            ``DataLoader``) or a ``DataLoader`` (used as is), with ``y=None``: streamed, memory
            bounded by the batch.
        epochs: epochs of the first (MAP) phase with ``optimizer`` ("adam" or "sgd").
        lr, weight_decay, momentum: optimiser settings (momentum for SGD only).
        batch_size: minibatch size (``None``: full batch).
        collector: a `SWACollector` built on this ``net``; required when ``swa_epochs > 0``.
        swa_epochs, swa_lr: the SWA phase (``swa_lr`` defaults to ``lr``).
        seed: seeds the minibatch shuffling (``None``: the seed is one draw from torch's
            global generator, so ``torch.manual_seed`` alone makes the fit reproducible).
        progress: show a ``tqdm`` progress bar.

    **Data-parallel** under an initialised process group (`distributed`; ``torchrun``): each
    rank passes its shard (`distributed.shard` of the tensors, a ``Dataset`` shard, or a
    ``DataLoader`` with a ``DistributedSampler``, whose ``set_epoch`` is called every epoch)
    and ``batch_size`` is per rank. The gradients are reduced with one ``all_reduce`` per step
    through `distributed.reduce_gradients` (not ``DistributedDataParallel``: the likelihood's
    parameters train too): every step is the step of one process on the union of the ranks'
    minibatches, so a full-batch fit on 2 ranks with half the data each gives the weights of
    the full-batch fit in one process (to rounding). Rank 0's starting weights are copied to
    every rank first (`distributed.broadcast_state`); every rank must take equally many steps
    per epoch (a ``ValueError`` before any work otherwise). BatchNorm normalises with each
    rank's own minibatch statistics (torch's ``SyncBatchNorm``, GPU only, for global ones) and
    its running statistics are averaged over the ranks after every epoch
    (`distributed.sync_buffers`), so all ranks end with the same network and the same SWA
    collector. The returned losses are the global ones. Without a process group nothing changes.

    Returns:
        The mean training loss of each epoch, MAP phase then SWA phase.

    Raises:
        TrainingDivergedError: (a ``FloatingPointError``) the loss, the outputs or the weights
            became non-finite. The network (weights and BatchNorm statistics) and the
            likelihood's parameters are set back to the end of the last epoch with a finite
            loss and finite weights; ``.epoch`` is the epoch that diverged and
            ``.restored_epoch`` the one kept (``0``: the weights before training), both
            counted from 1 over the MAP then SWA epochs.

    Any other exception, ``KeyboardInterrupt`` included, leaves ``net``, ``likelihood`` and
    ``collector`` exactly as they were before the call (`flat.preserved`).
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    if not isinstance(likelihood, Likelihood):
        raise TypeError(
            f"likelihood: expected a pyro_subspace Likelihood, got {type(likelihood).__name__}"
        )
    ck.nonneg_int(epochs, "epochs"), ck.nonneg_int(swa_epochs, "swa_epochs")
    ck.positive_float(lr, "lr"), ck.positive_float(swa_lr, "swa_lr", allow_none=True)
    ck.positive_float(weight_decay, "weight_decay", allow_zero=True)
    ck.positive_float(momentum, "momentum", allow_zero=True)
    ck.positive_int(batch_size, "batch_size", allow_none=True)
    ck.choice(optimizer, "optimizer", ("adam", "sgd"))
    streamed = isinstance(x, (Dataset, DataLoader))
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    rows = batching.rows_or_none(x)  # in-memory inputs (a tensor or a mapping), before checks
    if batchnorm and batch_size == 1 and rows is not None and rows > 1 and epochs + swa_epochs:
        raise ValueError(  # before any forward pass: every minibatch would be skipped
            "batch_size: minibatches of 1 are all skipped with BatchNorm in training mode "
            "(it needs two points), so nothing would be trained: use batch_size >= 2"
        )
    trainable = [p for p in list(net.parameters()) + list(likelihood.parameters()) if p.requires_grad]
    if not trainable and epochs + swa_epochs:
        raise ValueError(
            "net: no parameter of the network (or the likelihood) requires grad, so there is "
            "nothing to train: unfreeze the ones to fit (e.g. net.requires_grad_(True))"
        )
    # tensors: width, dtype, finiteness and targets against the net; a Dataset: its first item
    n = ck.check_data(net, x, y, likelihood, require_y=not streamed)
    if swa_epochs > 0:
        if not isinstance(collector, SWACollector):
            raise ValueError("collector: swa_epochs > 0 needs a SWACollector built on this net")
        if collector.flat.net is not net:
            raise ValueError("collector: was built on a different network than net")
    if not streamed:
        with torch.no_grad(), eval_mode(net):
            # only the output width is needed to check the targets
            probe = batching.call(net, batching.take(x, slice(0, 1)))
        probe = probe.unsqueeze(-1) if probe.dim() == 1 else probe
        y = likelihood.validate(probe.new_zeros(n, *probe.shape[1:]), y)

    gen = shuffle_generator(seed)
    groups = [{"params": list(net.parameters()), "weight_decay": float(weight_decay)}]
    extra = [p for p in likelihood.parameters() if p.requires_grad]
    if extra:
        groups.append({"params": extra, "weight_decay": 0.0})

    def make(kind: str, rate: float, params: list[dict]) -> torch.optim.Optimizer:
        params = [dict(g) for g in params]  # optimisers write their defaults into the groups
        # the multi-tensor kernels (`minibatch.foreach_option`): on CPU the same numbers bit for
        # bit as the default per-tensor ones a user's own loop gets, so the MAP every subspace
        # method starts from stays the one the committed tables were computed from; not the
        # fused kernel, which rounds differently (`PatchedNet.fit`, whose optimiser over its own
        # flat means no user loop matches, takes it: `minibatch.fused_option`)
        kernel = foreach_option(params)
        if kind == "adam":
            return torch.optim.Adam(params, lr=rate, **kernel)
        return torch.optim.SGD(params, lr=rate, momentum=momentum, **kernel)

    def batch_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        # per step only the step: tensor targets were validated once above (a stream's per
        # batch), and non-finite outputs make a non-finite loss, which take_steps reports
        out = batching.call(net, xb)  # a mapping by `batch`'s rule; a ModelOutput's logits
        out = out.unsqueeze(-1) if out.dim() == 1 else out
        return likelihood.training_loss(out, likelihood.validate(out, yb) if streamed else yb)

    # the last epoch with a finite loss and finite weights: where a divergence goes back to
    last_good = {"epoch": 0, "state": Preserved((net, likelihood), False, True, True)}
    offset = 0  # epochs of earlier phases (errors count epochs within their phase)
    in_swa = False  # not `offset > 0`: the SWA phase may follow epochs=0

    def checkpoint(epoch: int, loss: float) -> None:
        distributed.sync_buffers(net)  # BatchNorm statistics equal on every rank
        # a few reductions over all the weights laid end to end (`validation.all_finite`)
        if not ck.all_finite(*net.parameters()):
            raise TrainingDivergedError(
                f"fit_map: the weights became non-finite at epoch {epoch + 1}", epoch + 1
            )
        last_good["epoch"] = offset + epoch + 1
        last_good["state"].refresh()  # into the copies it holds: no new memory per epoch
        if in_swa:
            collector.collect()

    # BatchNorm in training mode needs two rows: a last minibatch of one is skipped
    check_batchnorm_loader(net, x)
    if streamed:  # memory bounded by the batch
        if isinstance(x, DataLoader):
            loader = x
        else:
            size = batch_size or len(x)
            loader = DataLoader(
                x,
                batch_size=size,
                shuffle=True,
                generator=gen,  # type: ignore[arg-type]
                drop_last=batchnorm and hasattr(x, "__len__") and len(x) % size == 1 and len(x) > 1,
            )

        def phase(epochs: int, opt: torch.optim.Optimizer, desc: str) -> list[float]:
            return loader_loop(
                lambda xb, yb: batch_loss(xb, yb), loader, epochs, opt, checkpoint, desc, offset
            )
    else:
        loop = dict(
            batch_size=batch_size, generator=gen, device=batching.device_of(x), progress=progress
        )
        loop["min_batch_size"] = 2 if batchnorm else 1

        def phase(epochs: int, opt: torch.optim.Optimizer, desc: str) -> list[float]:
            return minibatch_loop(
                lambda idx: batch_loss(batching.take(x, idx), y[idx]), n, epochs=epochs, optimizer=opt,
                on_epoch=checkpoint, desc=desc, data_parallel=True, **loop,
            )  # fmt: skip

    history: list[float] = []
    users = (net, likelihood) + ((collector,) if collector is not None else ())
    # an interrupted or failing fit leaves the user's objects as they were
    with preserved(*users, buffers="error", weights="error") as saved, train_mode(net):
        try:
            distributed.broadcast_state(net, likelihood)  # rank 0's start, as DDP does
            history += phase(epochs, make(optimizer, lr, groups), "fit_map")
            if swa_epochs:  # the SWA phase moves the weights only; likelihood parameters stay
                offset, in_swa = epochs, True
                opt = make("sgd", lr if swa_lr is None else swa_lr, groups[:1])
                history += phase(swa_epochs, opt, "fit_map (swa)")
        except TrainingDivergedError as err:
            epoch, good = offset + err.epoch, last_good["epoch"]
            last_good["state"].restore()
            saved.keep_changes()  # keep the last finite weights, not those before training
            raise TrainingDivergedError(
                f"{err}. fit_map diverged at epoch {epoch}; the network keeps the weights of "
                f"epoch {good} (0: those before training), the last with a finite loss",
                epoch,
                good,
            ) from err
    return history
