"""The one evaluator: a `SubspaceNet`'s tempered log-likelihood, its gradient and its GGN over a
data source, in chunks.

Every method that needs the full-data likelihood goes through `Evaluator`: the elliptical slice
sampler (`log_likelihood`), the Laplace MAP search (`nll_and_grad`), the Laplace curvature and
evidence (`ggn`, `map_statistics`). The data are read chunk by chunk from a `data.DataSource`
(tensors, a ``Dataset`` or a ``DataLoader``), so memory is bounded by the chunk, not by ``N``.
Under ``torch.distributed`` the source is the rank's shard and every sum goes through the one
hook `DataSource.reduce` (an ``all_reduce``; a no-op without a process group).
"""

from __future__ import annotations

import torch
from pyro.nn import PyroModule

from .. import batch as batching
from ..data import DataSource
from ..flat import FlatNet, preserved
from ..curvature.gram import RootRows


class MapStatistics:
    """Sums of one pass's outputs for the Laplace evidence: ``log p(D | t)`` (untempered) and,
    for a likelihood with one tunable noise scale, the residual sum of squares and the number of
    observations (`Likelihood.residual_statistics`; else 0, 0). `Evaluator.map_statistics` runs
    its own pass; a curvature pass that sees the outputs anyway adds them here instead."""

    def __init__(self, likelihood) -> None:
        self.likelihood = likelihood
        self.loglik, self.sse, self.count = 0.0, 0.0, 0

    def add(self, outputs: torch.Tensor, y: torch.Tensor, prepared: bool = True) -> None:
        """Add a chunk: outputs ``(n, O)`` and its targets (``prepared=False``: as the data
        source holds them; they are checked and prepared here)."""
        lik = self.likelihood
        with torch.no_grad():
            if not prepared:
                y = lik.validate(outputs, y.to(outputs.device))
            self.loglik += float(lik.log_prob_prepared(outputs, y).sum())
            sse, count = lik.residual_statistics(outputs, y)
        self.sse, self.count = self.sse + sse, self.count + count

    def totals(self) -> tuple[float, float, int]:
        return self.loglik, self.sse, self.count


class Evaluator:
    """Full-data quantities of ``model`` at coordinates ``t`` over ``data``.

    Args:
        model: the `SubspaceNet`.
        data: a `DataSource` with targets.
        recompute_bn: before each `log_likelihood`, recompute the network's BatchNorm running
            statistics at ``w = ŵ + P t`` from the training inputs (cumulative average over the
            chunks, as drbayes does), so the density is a fixed function of ``t``; the user's
            buffers are put back after every evaluation (`flat.preserved`: also when it
            raises or is interrupted), so `restore` finds nothing left to undo.

    ``temperature`` is ``T`` for ``N = data.num_data`` (``N/K`` when the model's is ``"auto"``).
    """

    def __init__(self, model: PyroModule, data: DataSource, recompute_bn: bool = False) -> None:
        self.model, self.data = model, data
        self.num_data = data.num_data
        self.temperature = model.temperature_for(self.num_data)
        net = model.flat.net
        self._bn = [
            m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        ]
        self._saved = None
        self._validated: list | None = None  # in-memory data: validated once, then reused
        if recompute_bn and self._bn:
            self._saved = [(b, b.detach().clone()) for b in net.buffers()]

    def chunks(self):
        """``(x_c, y_c)`` with the targets validated for the likelihood (once for in-memory
        tensors; streamed sources are validated chunk by chunk as they arrive)."""
        if self._validated is not None:
            yield from self._validated
            return
        validated = [] if self.data.loader is None else None
        for pair in self._validate():
            if validated is not None:
                validated.append(pair)
            yield pair
        self._validated = validated

    def _validate(self):
        model = self.model
        probe = None
        for xc, yc in self.data:
            if yc is None:
                raise ValueError("y: the evaluator needs targets")
            if probe is None:  # only the output width is needed to check the targets
                with torch.no_grad():
                    probe = model.outputs(model.subspace.shift.new_zeros(model.rank), batching.take(xc, slice(0, 1)))
            yield xc, model.likelihood.validate(probe.expand(batching.rows(xc), *probe.shape[1:]), yc)

    # ------------------------------------------------------------------ likelihood

    def _log_probs(self, t: torch.Tensor, xc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        """``log p(y_n | f(x_n; ŵ + P t))`` of one chunk, ``(n,)`` (``(B, n)`` for ``t``
        ``(B, K)``): the one place the likelihood meets the data; every sum below is over it."""
        return self.model.likelihood.log_prob_prepared(self.model.outputs(t, xc), yc)

    def log_likelihood(self, t: torch.Tensor) -> float | torch.Tensor:
        """Tempered ``log p(D | t) / T`` without gradients: a float for ``t`` ``(K,)``; for a
        batch ``(B, K)`` a float64 ``(B,)`` tensor, one batched forward per chunk (the chains
        of the generalised elliptical slice kernel), the per-point terms summed in float64."""
        if t.dim() == 2:
            if self._saved is not None:
                raise ValueError(
                    "t: a batch of coordinates with recompute_bn (the BatchNorm statistics "
                    "are refreshed at one point at a time): evaluate them one by one"
                )
            total = torch.zeros(t.shape[0], dtype=torch.float64, device=t.device)
            with torch.no_grad():
                for xc, yc in self.chunks():
                    total = total + self._log_probs(t, xc, yc).double().sum(-1)
            return self.data.reduce(total) / self.temperature
        model = self.model
        # with the refresh, the user's buffers are put back after every evaluation, also when
        # it raises or is interrupted (Pyro calls no kernel cleanup on exceptions)
        keep = preserved(model.flat.net, modes=False, buffers=self._saved is not None)
        with torch.no_grad(), keep:
            if self._saved is not None:
                self._refresh_batchnorm(t)
            total = 0.0
            for xc, yc in self.chunks():
                total += self._log_probs(t, xc, yc).sum().item()
        return self.data.reduce(total) / self.temperature

    def nll_and_grad(self, t: torch.Tensor) -> tuple[float, torch.Tensor]:
        """``−log p(D | t)/T`` and its gradient ``(K,)`` (float64), chunk by chunk."""
        t = t.detach().requires_grad_(True)
        total, grad = 0.0, torch.zeros_like(t)
        for xc, yc in self.chunks():
            nll = -self._log_probs(t, xc, yc).sum() / self.temperature
            (g,) = torch.autograd.grad(nll, t)
            total, grad = total + float(nll.detach()), grad + g.double()
        return self.data.reduce(total, grad)

    def hessian(self, t: torch.Tensor) -> torch.Tensor:
        """The exact Hessian ``∇²_t (−log p(D | t)/T)`` ``(K, K)``, float64, symmetrised: per
        chunk, the gradient's ``K`` reverse-over-reverse products with the unit vectors,
        batched (a loop where a layer has no batching rule). Costs about ``K`` backward
        passes over the data; the Laplace MAP search uses it for its Newton steps."""
        t = t.detach().requires_grad_(True)
        eye = torch.eye(t.shape[0], dtype=t.dtype, device=t.device)
        total = torch.zeros(t.shape[0], t.shape[0], dtype=torch.float64, device=t.device)
        for xc, yc in self.chunks():
            nll = -self._log_probs(t, xc, yc).sum() / self.temperature
            (g,) = torch.autograd.grad(nll, t, create_graph=True)
            try:
                (rows,) = torch.autograd.grad(g, t, eye, retain_graph=True, is_grads_batched=True)
            except RuntimeError:  # no vmap rule for a layer (e.g. fused RNN kernels)
                rows = torch.stack(
                    [torch.autograd.grad(g, t, e, retain_graph=True)[0] for e in eye]
                )
            total += rows.double()
        total = self.data.reduce(total)
        return (total + total.T) / 2

    def map_statistics(self, t: torch.Tensor) -> tuple[float, float, int]:
        """``log p(D | t)`` (untempered) and, for a likelihood with one tunable noise scale,
        the residual sum of squares and the number of observations (else 0, 0)."""
        stats = MapStatistics(self.model.likelihood)
        with torch.no_grad():
            for xc, yc in self.chunks():
                stats.add(self.model.outputs(t, xc), yc)
        return self.data.reduce(*stats.totals())

    # ------------------------------------------------------------------ curvature

    def ggn(
        self,
        t: torch.Tensor,
        diagonal: bool = False,
        chunk_size: int | None = None,
        dtype: torch.dtype = torch.float64,
        rows: RootRows | None = None,
    ):
        """``Pᵀ G P`` ``(K, K)`` (or its diagonal ``(K,)``) at ``w = ŵ + P t``, untempered,
        exactly symmetric (`Subspace.ggn_sum`), in ``dtype``, from the subspace's Jacobian blocks (Subnetwork
        Inference eqs. 9, 15), weighted by the output-Hessian factor ``H_n = L_n L_nᵀ`` inside
        the Jacobian pass. Float32 networks: float32 products, float64 sums (`gram`). In-memory
        data go to the subspace in one call (its blocks bound the memory); the batches of a
        ``DataLoader`` are summed in float64. ``rows`` (a `gram.RootRows`) collects the root
        ``A`` with ``AᵀA = PᵀGP`` instead, for in-memory data on one process only (the rows of
        a stream or of one shard are not the whole root): ``None`` is returned when all of
        them fit under its limit (the GGN is then formed from ``rows.parts`` when needed)."""
        model = self.model
        w = model.subspace.weights(t).detach()
        flat = FlatNet(model.flat.net, batch_strategy="loop")
        chunk = chunk_size or self.data.chunk_size
        factor = model.likelihood.hessian_factor
        if self.data.loader is None:
            keep = rows if not self.data.sharded else None
            total = model.subspace.ggn_sum(
                flat, self.data.x, w, chunk, factor, diagonal, dtype=dtype, rows=keep
            )
        else:
            total = None
            for xc in self.data.inputs():
                total = model.subspace.ggn_sum(
                    flat, xc, w, chunk, factor, diagonal, total, dtype=torch.float64
                )
        if total is None and rows is not None and rows.kept:
            return None
        return self.data.reduce(total).detach().to(dtype)  # ggn_sum's are exactly symmetric

    # ------------------------------------------------------------------ BatchNorm

    def restore(self) -> None:
        """Put the user's BatchNorm buffers back (after `recompute_bn` evaluations)."""
        if self._saved is not None:
            with torch.no_grad():
                for buf, saved in self._saved:
                    buf.copy_(saved)

    def _average_batchnorm(self) -> None:
        stats = [s for m in self._bn for s in (m.running_mean, m.running_var) if s is not None]
        n = self.data.local_num_data
        summed = self.data.reduce(*[s * n for s in stats])
        with torch.no_grad():
            for s, total in zip(stats, summed if len(stats) > 1 else [summed], strict=True):
                s.copy_(total / self.num_data)

    def _refresh_batchnorm(self, t: torch.Tensor) -> None:
        """Recompute BatchNorm running statistics at ``w = ŵ + P t`` over the inputs
        (`FlatNet.recompute_batchnorm`, streamed chunk by chunk); on failure the user's buffers
        are put back."""
        try:
            self.model.flat.recompute_batchnorm(self.model.subspace.weights(t), self.data.inputs())
            if self.data.sharded:  # average the shards' statistics, weighted by their rows
                self._average_batchnorm()
        except BaseException:
            self.restore()
            raise
