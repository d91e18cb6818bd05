"""The weight-sharing conventions (``conv="expand"``, ``"reduce"``, ``"backpack"``; the package
docstring): a layer's inputs as the rows of ``A`` (a Conv2d's unfolded patches, or their
grams without unfolding them) and its back-propagated columns as the rows of ``G``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...linalg import blas_module, blas_threads
from .layers import _Layer

#: Numbers in one sub-block of unfolded convolution patches ``(rows, in·kh·kw, R)``.
UNFOLD_NUMBERS = 8_000_000


def _patches(lay: _Layer, a: torch.Tensor) -> torch.Tensor:
    return conv_patches(lay.module, a)


def conv_patches(m: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """Unfolded input patches ``(n, in·kh·kw, R)`` of the Conv2d ``m`` for its input ``a``
    ``(n, in, H, W)`` (``F.unfold``; the column order of ``weight.reshape(out, -1)``, ``R`` the
    output locations)."""
    if m.padding_mode == "zeros" and not isinstance(m.padding, str):
        return F.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride)
    # a padding mode or a string padding: pad as Conv2d._conv_forward does, then unfold
    return F.unfold(_padded(m, a), m.kernel_size, m.dilation, 0, m.stride)


def _gram(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows`` in float64 (float32 products are formed in float32, then widened)."""
    return _rows_gram(rows).double()


def _padded(m: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """``a`` padded as ``Conv2d._conv_forward`` pads it (every padding mode and string padding;
    its private ``_reversed_padding_repeated_twice``: left, right, top, bottom)."""
    pad = m._reversed_padding_repeated_twice
    if not any(pad):
        return a
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    return F.pad(a, pad, mode=mode)


def _locations(m: nn.Conv2d, a: torch.Tensor) -> int:
    """The number ``R`` of output locations of the Conv2d ``m`` at its input ``a``."""
    left, right, top, bottom = m._reversed_padding_repeated_twice
    size = (a.shape[2] + top + bottom, a.shape[3] + left + right)
    return math.prod(
        (s - d * (k - 1) - 1) // st + 1
        for s, k, st, d in zip(size, m.kernel_size, m.stride, m.dilation)
    )


def expand_patch_gram(m: nn.Conv2d, a: torch.Tensor, augment: bool = False) -> torch.Tensor:
    """``Σ_{n,r} u_{n,r} u_{n,r}ᵀ`` ``(P, P)`` (``P = in·kh·kw``, plus one with ``augment``: a
    ones column) over the unfolded patches ``u`` of the Conv2d ``m`` at its input ``a``
    ``(n, in, H, W)``, without unfolding them: equal to ``U ᵀU`` of `conv_patches`' rows.

    Patches at kernel rows ``i`` and ``i'`` read the (padded) input rows ``s·r + d·i`` and
    ``s·r + d·i'`` (stride ``s``, dilation ``d``), so each block ``(i, i')`` is a sum over the
    output rows ``r`` of the products ``M_Δ(y) = Z_yᵀ Z_{y+dΔ}`` of *row* patches ``Z_y``
    ``(n·W_out, kw·in)`` (the input row ``y`` unfolded along the width only), ``Δ = i' - i``.
    Only ``kh`` offsets ``Δ ≥ 0`` are multiplied (``M_{-Δ}`` is a transpose), once per padded row
    instead of ``kh²`` times per output row: about ``kh`` times fewer multiply-adds than the
    gram of the full patches for a stride-1 convolution (and no ``kh·kw``-fold copy of the
    input, only a ``kw``-fold one)."""
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    rows = _padded(m, a).permute(2, 0, 3, 1).contiguous()  # (hp, n, wp, c): channels last
    hp, n, wp, c = rows.shape
    h_out = (hp - dh * (kh - 1) - 1) // sh + 1
    w_out = (wp - dw * (kw - 1) - 1) // sw + 1
    st = rows.stride()
    taps = rows.as_strided((hp, n, w_out, kw, c), (st[0], st[1], sw * st[2], dw * st[2], 1))
    # row patches (hp, n·W_out, kw·c): the products below are Zᵀ Z' with the summed dimension
    # leading (BLAS runs them about twice as fast as Z Z'ᵀ), copied from runs of c numbers
    z = taps.reshape(hp, n * w_out, kw * c)
    q = c * kw
    blocks = z.new_empty(kh, kh, q, q)
    last = sh * (h_out - 1) + 1  # rows s·r, r < h_out, from a block's first row
    for delta in range(kh):
        prod = torch.matmul(z[: hp - dh * delta].transpose(1, 2), z[dh * delta :])
        for i in range(kh - delta):
            block = prod[dh * i : dh * i + last : sh].sum(0)
            blocks[i, i + delta] = block
            if delta:
                blocks[i + delta, i] = block.T
    # (i, i', j·c, j'·c') -> (c, i, j, c', i', j'): the order of weight.reshape(out, -1)
    p = c * kh * kw
    gram = blocks.reshape(kh, kh, kw, c, kw, c).permute(3, 0, 2, 5, 1, 4).reshape(p, p)
    if not augment:
        return gram.double()
    sums = z.sum(1)  # (hp, kw·c)
    col = torch.stack([sums[dh * i : dh * i + last : sh].sum(0) for i in range(kh)])
    col = col.reshape(kh, kw, c).permute(2, 0, 1).reshape(p)
    out = gram.new_empty(p + 1, p + 1)
    out[:p, :p], out[:p, p], out[p, :p] = gram, col, col
    out[p, p] = h_out * z.shape[1]  # the number of patches
    return out.double()


def reduce_patch_means(m: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """The mean over the output locations of the unfolded patches ``(n, in·kh·kw)`` of the
    Conv2d ``m`` at its input ``a`` ``(n, in, H, W)`` (K-FAC-reduce's rows of ``A``), without
    unfolding them: equal to ``conv_patches(m, a).mean(2)``.

    The patch entry at kernel position ``(i, j)`` reads the (padded) input at rows
    ``s_h·r + d_h·i`` and columns ``s_w·q + d_w·j`` over the output locations ``(r, q)``; its sum
    over them is a strided sum of the input, taken in two steps (rows for each ``i``, then
    columns for each ``j``): ``kh`` reads of the input instead of the ``kh·kw``-fold copy that
    `conv_patches` writes."""
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    x = _padded(m, a)
    n, c, hp, wp = x.shape
    h_out = (hp - dh * (kh - 1) - 1) // sh + 1
    w_out = (wp - dw * (kw - 1) - 1) // sw + 1
    out = x.new_empty(n, c, kh, kw)
    for i in range(kh):
        rows = x[:, :, dh * i : dh * i + sh * (h_out - 1) + 1 : sh].sum(2)  # (n, c, wp)
        for j in range(kw):
            out[:, :, i, j] = rows[:, :, dw * j : dw * j + sw * (w_out - 1) + 1 : sw].sum(-1)
    return out.reshape(n, c * kh * kw) / (h_out * w_out)


def _input_sum(lay: _Layer, a: torch.Tensor, conv: str) -> torch.Tensor:
    """This chunk's contribution to ``N·A`` (``"expand"``: already divided by ``R``)."""
    if lay.conv and conv == "expand":
        m = lay.module
        per_row = a[0].numel() * m.kernel_size[1]  # the row patches' numbers per data point
        step = max(1, UNFOLD_NUMBERS // max(1, per_row))
        r = _locations(m, a)
        total = 0.0
        for start in range(0, a.shape[0], step):
            total = total + expand_patch_gram(m, a[start : start + step], lay.augment)
        return total / r
    if lay.conv and conv == "reduce":
        rows = reduce_patch_means(lay.module, a)
        return _gram(_ones_column(rows) if lay.augment else rows)
    if lay.conv:  # "backpack": every location's patch a row, unscaled
        p = lay.module.in_channels * math.prod(lay.module.kernel_size)
        per_row = _patches(lay, a[:1]).numel()
        step = max(1, UNFOLD_NUMBERS // max(1, per_row))  # sub-blocks bound the patches' memory
        total = 0.0
        for start in range(0, a.shape[0], step):
            u = _patches(lay, a[start : start + step])  # shape: (rows, P, R)
            rows = u.transpose(1, 2).reshape(-1, p)
            total = total + _gram(_ones_column(rows) if lay.augment else rows)
        return total
    r = math.prod(a.shape[1:-1])
    if conv == "reduce" and a.dim() > 2:
        rows = a.mean(tuple(range(1, a.dim() - 1)))
    else:
        rows = a.reshape(-1, a.shape[-1])
    rows = _ones_column(rows) if lay.augment else rows
    return _gram(rows) / r if conv == "expand" and r > 1 else _gram(rows)


def _ones_column(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], 1)


def _grad_gram(lay: _Layer, g: torch.Tensor, conv: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out + Σ gᵀg`` ``(out, out)`` of one back-propagated column at a layer's output (``out``
    ``None``: a new sum): over data points and locations (``"expand"``) or of the sums over the
    locations (``"reduce"``, ``"backpack"``). A convolution's ``(n, out, R)`` is multiplied as
    ``(n·R, out)`` rows when it is channels-last (a view), else per data point where ``R ≥ out``
    (no transposed copy), else as rows. Products of rows may fill only the lower triangle
    (`_add_rows_gram_`): call ``symmetrize_(sum, upper=False)`` once the columns are in."""
    if lay.conv:
        if conv == "expand" and g.dim() == 4 and g.is_contiguous(memory_format=torch.channels_last):
            # channels last (`CHANNELS_LAST_ON_CPU`): the (n·R, out) rows are a view, one product
            return _add_rows_gram_(out, g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]))
        g = g.flatten(2)  # shape: (n, out, R)
        if conv != "expand":
            return _add_rows_gram_(out, g.sum(2))
        if g.shape[2] >= g.shape[1]:
            gram = torch.matmul(g, g.transpose(1, 2)).sum(0)
            return gram if out is None else out.add_(gram)
        return _add_rows_gram_(out, g.transpose(1, 2).reshape(-1, g.shape[1]))
    if g.dim() > 2 and conv != "expand":
        return _add_rows_gram_(out, g.sum(tuple(range(1, g.dim() - 1))))
    return _add_rows_gram_(out, g.reshape(-1, g.shape[-1]))


def _add_rows_gram_(acc: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``acc += rowsᵀ rows`` in place (``acc`` ``None``: a new zero sum), ``rows`` ``(m, out)``:
    on CPU BLAS ``syrk`` into ``acc``'s memory (half the multiplications of a general product,
    and no ``(out, out)`` temporary: LoRA's ``B`` has ``out`` = 2304 on GPT-2 small), which
    writes only ``acc``'s lower triangle; elsewhere ``addmm_`` (both triangles)."""
    p = rows.shape[-1]
    acc = rows.new_zeros(p, p) if acc is None else acc
    blas = blas_module(rows)
    if blas is None or acc.dtype != rows.dtype or not acc.is_contiguous() or rows.shape[0] == 0:
        return acc.addmm_(rows.T, rows)
    syrk = blas.ssyrk if rows.dtype == torch.float32 else blas.dsyrk
    target = acc.numpy().T  # Fortran-ordered view of acc: its upper triangle is acc's lower
    with blas_threads():  # the Fortran view of the C-ordered rows is rowsᵀ (out, m)
        res = syrk(1.0, rows.detach().contiguous().numpy().T, beta=1.0, c=target, overwrite_c=1)
    if res.ctypes.data != target.ctypes.data:  # f2py copied: write the result back
        acc.copy_(torch.from_numpy(res.T))
    return acc


def _rows_gram(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows`` in the rows' dtype (`_gram` widens it to float64)."""
    return rows.T @ rows
