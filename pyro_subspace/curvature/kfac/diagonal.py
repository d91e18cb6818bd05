"""The exact GGN diagonal of the covered parameters outside K-FAC's layers (BatchNorm,
LayerNorm, Embedding, shared or uncalled layers, ...): per-sample Jacobians of the module
alone from the pass's own backward passes where it allows (`_local_diagonal_sums`, a
BatchNorm in closed form), else through the whole network (`_diagonal_sums`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from ... import batch as batching
from ..autodiff import plain_kernels
from ..jacobians import SQUARE_SUM_NUMBERS, add_row_jacobian_squares
from .layers import _Layer


def _usable_local(m: _Layer, calls: list, n: int) -> bool:
    """A diagonal module whose own Jacobian can be taken per sample: called once per forward on
    a tensor of ``n`` rows, giving a tensor of ``n`` rows. (The pass asks it at a chunk's ``n``
    and at one row: rows that are positions of a sequence-first layout, each mixing the data
    points, may number ``n`` by chance, but not also one for one data point.)"""
    return (
        len(calls) == 1
        and calls[0][0] is not None
        and calls[0][0].shape[:1] == (n,)
        and calls[0][1].shape[:1] == (n,)
    )


def _check_local_calls(local: list[_Layer], seen: dict, n: int) -> None:
    """Each module of the per-sample route still sees the chunk's ``n`` rows, else a
    ``ValueError`` (its rows would no longer be the data points)."""
    for m in local:
        if not _usable_local(m, seen[m.name], n):
            raise ValueError(
                f"net: module {m.name!r} took one row per data point on the first chunk, not "
                f"on a chunk of {n} rows"
            )


def _local_diagonal_sums(m: _Layer, inp, cols: list, names: list, sums: dict) -> None:
    """``sums[name] += Σ_n Σ_c (g_{n,c}ᵀ ∂z_n/∂θ)²`` for a module's own parameters ``θ``: the
    columns ``g`` ``(C, n, *z)`` back-propagated to its output, pulled back through the module
    alone, per sample (``torch.func``: ``vjp`` at each input, ``vmap`` over samples and
    columns)."""
    prefix = m.name + "." if m.name else ""
    params = {nm[len(prefix):]: dict(m.module.named_parameters(recurse=False))[nm[len(prefix):]]
              for nm in names}  # fmt: skip
    params = {k: v.detach() for k, v in params.items()}
    if not cols:
        return
    if _batchnorm_sums(m.module, inp, cols, prefix, params, sums):
        return
    g = torch.stack(cols, 1)  # (n, C, *z)

    def per_sample(xi, gi):
        _, pull = vjp(lambda p: functional_call(m.module, p, (xi[None],))[0], params)
        return vmap(pull)(gi)[0]

    try:
        jac = vmap(per_sample)(inp, g)
    except (RuntimeError, NotImplementedError):  # an op without a batching rule: row by row
        with plain_kernels():
            rows = []
            for xi, gi in zip(inp, g):
                _, pull = vjp(lambda p: functional_call(m.module, p, (xi[None],))[0], params)
                rows.append({k: torch.stack([pull(c)[0][k] for c in gi]) for k in params})
        jac = {k: torch.stack([r[k] for r in rows]) for k in params}
    for leaf, j in jac.items():
        name = prefix + leaf
        sums[name] = sums[name] + j.detach().square().sum((0, 1)).double()


def _batchnorm_sums(module, inp, cols, prefix: str, params: dict, sums: dict) -> bool:
    """A BatchNorm in eval mode in closed form: ``z = γ x̂ + β`` with ``x̂`` from the running
    statistics, so per sample and column ``J_γ = Σ_r g x̂`` and ``J_β = Σ_r g`` over the
    feature's locations (one pass per column, no ``torch.func``); ``False`` for any other
    module (or a BatchNorm using batch statistics)."""
    bn = nn.modules.batchnorm._BatchNorm
    if not isinstance(module, bn) or module.training or module.running_mean is None:
        return False
    shape = (1, -1) + (1,) * (inp.dim() - 2)
    var = module.running_var.reshape(shape) + module.eps
    xhat = (inp - module.running_mean.reshape(shape)) * var.rsqrt()
    dims = tuple(range(2, inp.dim()))
    for g in cols:  # (n, C_feat, *spatial)
        if "weight" in params:
            jw = (g * xhat).sum(dims) if dims else g * xhat
            sums[prefix + "weight"] = sums[prefix + "weight"] + jw.square().sum(0).double()
        if "bias" in params:
            jb = g.sum(dims) if dims else g
            sums[prefix + "bias"] = sums[prefix + "bias"] + jb.square().sum(0).double()
    return True


def _diagonal_sums(net, named, sums: dict, x: torch.Tensor, factor: torch.Tensor) -> None:
    """``sums[name] += Σ_n Σ_c ((L_nᵀ J_n)_{c,·})²`` for the diagonal parameters: ``vmap`` over
    rows of ``jacrev`` of ``L_nᵀ f(x_n)`` with respect to those parameters only."""
    params = {name: named[name].detach() for name in sums}
    width = sum(p.numel() for p in params.values())
    c = factor.shape[-1]
    rows = max(1, SQUARE_SUM_NUMBERS // max(1, c * width))

    def one(p: dict, xn: torch.Tensor, ln: torch.Tensor) -> torch.Tensor:
        args, kwargs = batching.call_args(net, batching.unsqueeze(xn))
        out = batching.output(functional_call(net, p, args, kwargs))
        return ln.T @ out.reshape(-1)  # shape: (C,)

    factor = factor.detach()
    for name in sums:  # float64 sums
        sums[name] = sums[name] if isinstance(sums[name], torch.Tensor) else torch.zeros(
            named[name].shape, dtype=torch.float64, device=named[name].device
        )
    for xb, lb in zip(batching.split(x, rows), factor.split(rows)):
        add_row_jacobian_squares(one, params, xb, lb, sums)
