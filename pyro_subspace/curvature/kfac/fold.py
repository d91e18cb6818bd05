"""Eval-mode BatchNorm in the K-FAC pass: its output as one scale and shift per feature
(`_affine_batchnorm`), and a ``Conv2d`` whose only consumer is such a BatchNorm run as one
function with the folded weight (`_FoldedConvBN`, `_Fold`, found by `_fold_pairs`;
`factors.FOLD_BATCHNORM`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...flat import hooked
from .layers import _Layer


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _FoldedConvBN(torch.autograd.Function):
    """``z = s ⊙ conv(a; W, b) + t`` (an eval-mode BatchNorm's scale ``s`` and shift ``t`` per
    output channel after a ``Conv2d``), whose backward pass is one convolution input-gradient
    with the folded weight ``s ⊙ W``: the same gradient as the convolution's and the
    BatchNorm's backward passes, without the elementwise product of the latter (one pass over
    the layer's output per column, about 7% of the type-2 Fisher's ``C`` passes on a ResNet).
    Returns ``(z, conv(a))``; the second (what the BatchNorm normalises) carries no gradient.
    Only ``a``'s gradient is computed (the K-FAC pass differentiates with respect to layer
    outputs, never parameters)."""

    @staticmethod
    def forward(ctx, a, weight, bias, scale, shift, stride, padding, dilation):
        pre = F.conv2d(a, weight, bias, stride, padding, dilation)
        shape = (1, -1, 1, 1)
        z = torch.addcmul(shift.reshape(shape), pre, scale.reshape(shape))
        ctx.save_for_backward(a, weight * scale.reshape(-1, 1, 1, 1))
        ctx.conf = (stride, padding, dilation)
        ctx.mark_non_differentiable(pre)
        # `pre` never gets a gradient: without this the engine would fill a zero tensor of its
        # size for it in every backward pass (one write of the layer's output per column)
        ctx.set_materialize_grads(False)
        return z, pre

    @staticmethod
    def backward(ctx, g, _):
        a, folded = ctx.saved_tensors
        grad_a = None
        if ctx.needs_input_grad[0] and g is not None:
            stride, padding, dilation = ctx.conf
            grad_a = torch.ops.aten.convolution_backward(
                g, a, folded, None, stride, padding, dilation, False, [0, 0], 1,
                [True, False, False],
            )[0]  # fmt: skip
        return grad_a, None, None, None, None, None, None, None


class _Fold:
    """A ``Conv2d`` whose only consumer is an eval-mode BatchNorm, run as one `_FoldedConvBN`
    in the K-FAC pass: the convolution's ``G`` is then ``diag(s) G' diag(s)`` of the columns
    ``g'`` at the BatchNorm's output (``g = s ⊙ g'`` at the convolution's), and the BatchNorm's
    input (for its own diagonal) is the ``pre`` the function returns, kept in ``pre``."""

    def __init__(self, conv: nn.Conv2d, bn: nn.Module, bn_name: str) -> None:
        self.conv, self.bn, self.bn_name = conv, bn, bn_name
        #: this chunk's ``conv(a)`` and ``s`` (``None`` until the fold ran; cleared per chunk)
        self.pre: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    @property
    def used(self) -> bool:
        """Whether this pass ran the fold (it keeps ``pre`` until the chunk is done)."""
        return self.pre is not None

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        c = self.conv
        scale, shift = _batchnorm_affine(self.bn)  # (`_affine_batchnorm`'s s and t)
        self.scale = scale.to(a)
        z, self.pre = _FoldedConvBN.apply(
            a, c.weight, c.bias, self.scale, shift.to(a), c.stride, c.padding, c.dilation
        )
        return z


def _fold_pairs(layers: list[_Layer], local: list[_Layer], links: dict, out) -> dict[str, _Fold]:
    """``{conv name: _Fold}`` for every K-FAC ``Conv2d`` (zero padding given as numbers) whose
    returned output is, in the autograd graph of ``out``, consumed by exactly one operation:
    the eval-mode BatchNorm among ``local`` (the pass's diagonal modules: one with affine
    parameters in scope) that takes it as its input, neither with a hook of the user's (nor a
    global one). Found on the first chunk's unfolded pass (`_hooked_forward`'s ``links``); a
    convolution whose output another operation also uses (or nothing) is not folded."""
    if out.grad_fn is None:
        return {}
    uses: dict = {}  # autograd node -> how many nodes reaching `out` take it as an input
    stack, visited = [out.grad_fn], {out.grad_fn}
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            uses[nxt] = uses.get(nxt, 0) + 1
            if nxt not in visited:
                visited.add(nxt)
                stack.append(nxt)
    consumer = {id(links[m.name][0]): m for m in local if m.name in links}
    folds = {}
    for lay in layers:
        c = lay.module
        if not lay.conv or lay.name not in links or c.padding_mode != "zeros":
            continue
        if isinstance(c.padding, str) or c.groups != 1:
            continue
        clone = links[lay.name][1]
        m = consumer.get(id(clone))
        if m is None or not isinstance(m.module, nn.modules.batchnorm._BatchNorm):
            continue
        if not _uses_running_stats(m.module) or m.module.num_features != c.out_channels:
            continue
        if clone.grad_fn is None or uses.get(clone.grad_fn, 0) != 1:
            continue
        if hooked([c, m.module]):  # a user's hook would see the folded values: not folded
            continue
        folds[lay.name] = _Fold(c, m.module, m.name)
    return folds


def _uses_running_stats(m: nn.Module) -> bool:
    return not m.training and m.running_mean is not None and m.running_var is not None


def _affine_batchnorm(module, inp, out):
    """An eval-mode BatchNorm's output recomputed as ``x · s + b`` (its running statistics and
    affine parameters folded into one scale and shift per feature, detached): the same values up
    to rounding, and a backward pass through it costs one multiplication, about a quarter of
    ``native_batch_norm_backward``'s (the ``C`` backward passes cross every BatchNorm)."""
    x = inp[0]
    scale, shift = _batchnorm_affine(module)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.reshape(shape).to(x), x, scale.reshape(shape).to(x))


def _batchnorm_affine(bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval-mode BatchNorm as ``s ⊙ x + t`` per feature, detached: its running statistics
    and affine parameters folded into one scale ``s`` and one shift ``t``, each ``(features,)``."""
    with torch.no_grad():
        scale = (bn.running_var + bn.eps).rsqrt()
        shift = -bn.running_mean * scale
        if bn.weight is not None:
            scale, shift = scale * bn.weight, shift * bn.weight
        if bn.bias is not None:
            shift = shift + bn.bias
    return scale, shift
