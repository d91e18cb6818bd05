"""The last-layer subspace: the weights and bias of a network's final ``nn.Linear``.

A last linear layer ``f = W φ(x) + b`` is linear in its own weights, so the Jacobian of the
outputs with respect to them needs no differentiation: ``∂f_c/∂W_{c'p} = δ_{cc'} φ_p`` and
``∂f_c/∂b_{c'} = δ_{cc'}``, with the penultimate features ``φ`` read in one forward pass (MoLA
A.2; the last-layer Laplace of Kristiadi et al., 2020). The output covariance of a Gaussian
``N(·, Σ)`` over these weights is then ``C_cd = φ̃ᵀ Σ_(c,d) φ̃`` with ``φ̃ = [φ, 1]``
(`LastLayerSubspace.feature_blocks` + `rows`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torch import nn

from .. import batch as batching
from ..linalg import symmetrize_
from ..flat import FlatNet, eval_mode, flat_parameters
from ..curvature.gram import gram_from_blocks
from ..curvature.jacobians import Blocks, as_2d, weighted
from .base import IndexSubspace
from .feature_reduction import attention_mask, check_reduction, faithful, reduce_features


def find_last_layer(net: nn.Module) -> tuple[str, nn.Module]:
    """``(name, module)`` of the last module (in ``net.modules()`` order) that holds parameters
    of its own: the one definition of "the last layer" in this library."""
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    found = [(n, m) for n, m in net.named_modules() if list(m.parameters(recurse=False))]
    if not found:
        raise ValueError("net: the network has no parameters")
    return found[-1]


def last_layer_indices(net: nn.Module) -> torch.Tensor:
    """Flat indices (in the flat vector of trainable weights, `flat.flat_parameters`) of every
    parameter of `find_last_layer`; a ``ValueError`` when all of them are frozen."""
    name, last = find_last_layer(net)
    own = [id(p) for p in last.parameters(recurse=False)]
    spans, offset = [], 0
    for _, p in flat_parameters(net):
        if id(p) in own:
            spans.append(torch.arange(offset, offset + p.numel()))
        offset += p.numel()
    if not spans:
        raise ValueError(
            f"net: the last layer {name!r} has requires_grad=False: no weights to infer; "
            f"unfreeze it (net.get_submodule({name!r}).requires_grad_(True))"
        )
    return torch.cat(spans)


#: modules that may follow the last linear layer without changing its outputs' values (in the
#: evaluation mode the features are read in)
PASS_THROUGH = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Dropout, nn.AlphaDropout)

#: what to do when the last linear layer is not the network's output
NOT_THE_OUTPUT = (
    "the closed-form last-layer Jacobian assumes f = W φ + b; use a subnetwork of its indices, "
    "subspaces.subnetwork(net, strategy='names', names=[{name!r}]), or a network that ends in "
    "its linear layer (put the output transform in the likelihood)"
)


class ReductionWarning(UserWarning):
    """A ``feature_reduction`` that does not reproduce the network's outputs from the last
    layer's (`feature_reduction.faithful`): the predictive's variances then use other
    positions' features than the network's outputs, as laplace-torch's do."""


#: what `ReductionWarning` says
UNFAITHFUL = (
    "feature_reduction={r!r} does not give the network's outputs from its last layer's "
    "outputs on these inputs (the network keeps other positions, e.g. the last non-padding "
    "token under right padding): the predictive's variances use the reduced features, as "
    "laplace-torch's do (the fit uses the network's exact GGN on these rows); with an "
    "attention mask, 'pick_last_token' or 'masked_average' read the tokens the network attends to"
)


def uses_features(sub: object, flat: FlatNet, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``sub`` is a last layer whose closed form holds on ``x`` (`LastLayerSubspace.closed_form`):
    the callers that read its features (the linearised predictive, the grid sweep) ask this
    instead of the subspace's type."""
    return isinstance(sub, LastLayerSubspace) and sub.closed_form(flat, x, w)


def _trailing_modules(net: nn.Module) -> list[nn.Module]:
    """The leaf modules a ``nn.Sequential`` network runs after its last parameterised leaf
    (recursing into nested ``nn.Sequential``); ``[]`` for any other network, whose forward order
    is known only from a forward pass."""
    leaves: list[nn.Module] = []

    def walk(m: nn.Module) -> bool:
        if isinstance(m, nn.Sequential):
            return all(walk(child) for child in m)
        leaves.append(m)
        return not list(m.children())  # a composite module: its order is unknown

    if not isinstance(net, nn.Sequential) or not walk(net):
        return []
    last = max((i for i, m in enumerate(leaves) if list(m.parameters())), default=-1)
    return leaves[last + 1 :]


class LastLayerSubspace(IndexSubspace):
    """The subspace of the final ``nn.Linear``'s weight (row-major) and bias.

    Args:
        net: the network; its last module with parameters must be an ``nn.Linear``.
        shift: the flat weights ``ŵ`` ``(D,)``; default the network's current weights.
        feature_reduction: for a layer that sees ``(n, T, P)`` (a sequence per data point)
            while the network outputs ``(n, C)``: which feature row ``φ_n`` the closed form
            reads (`feature_reduction.REDUCTIONS`: laplace-torch's mask-blind
            ``"pick_first"``, ``"pick_last"``, ``"average"``, or the mask-aware
            ``"pick_last_token"``, ``"masked_average"``). ``None``: such a layer takes the
            generic route (the network's exact Jacobian). With a reduction the predictive
            reads the reduced features, as laplace-torch's does, also where the reduction does
            not reproduce the network's outputs (`feature_reduction.faithful`; a warning
            says so); the fit's GGN is the closed form on the rows where it does and the
            network's exact GGN elsewhere (laplace-torch's default curvlinops backend forms
            the exact GGN for ``"full"`` and K-FAC of the layer's own inputs for ``"kron"``
            too, but the ``"diag"`` GGN from the reduced features: there the two differ).

    ``rows`` ``(C, P̃)`` gives, for each output ``c``, the coordinates of ``[W_c, b_c]``
    (``P̃ = P + 1`` with a bias). Persistence: build ``LastLayerSubspace(net, ...)`` again
    with the same ``feature_reduction`` and ``load_state_dict``.
    """

    kind = "last_layer"
    rows: torch.Tensor

    def __init__(
        self, net: nn.Module, shift: torch.Tensor | None = None, feature_reduction: str | None = None
    ) -> None:
        reduction = check_reduction(feature_reduction)
        name, last = find_last_layer(net)
        if type(last) is not nn.Linear:
            raise TypeError(
                f"net: the last layer {name!r} is a {type(last).__name__}, not an nn.Linear; "
                "use subspaces.subnetwork(net, strategy='last_layer') for an index subspace"
            )
        after = [m for m in _trailing_modules(net) if not isinstance(m, PASS_THROUGH)]
        if after:
            raise ValueError(
                f"net: the last linear layer {name!r} is followed by "
                f"{type(after[0]).__name__}, so it is not the network's output; "
                + NOT_THE_OUTPUT.format(name=name)
            )
        flat = FlatNet(net)
        shift = flat.vector() if shift is None else shift
        super().__init__(shift, last_layer_indices(net).to(shift.device))
        self.layer_name = name
        self.feature_reduction = reduction
        c, p = last.weight.shape
        rows = torch.arange(c * p).reshape(c, p)
        if last.bias is not None:
            rows = torch.cat([rows, c * p + torch.arange(c)[:, None]], dim=1)
        self.register_buffer("rows", rows.to(shift.device))

    def buffers_replaced_only(self) -> tuple[str, ...]:
        """The indices and their rows are fixed at construction (`transaction.REPLACED_ONLY`)."""
        return ("basis", "rows")

    def closed_form(self, flat: FlatNet, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether the closed form ``f_n = W φ_n + b`` holds for this network on inputs like
        ``x``: one forward pass over its first two rows, in which the last layer is called once
        on ``(n, P)`` features and gives the network's ``(n, C)`` outputs, one row per data
        point. A network that reshapes its batch (a scorer on pairs ``(B, 2, d) → (2B, d)``
        whose ``(2B, 1)`` scores are read as ``(B, 2)``; a layer on ``(B·L, P)`` tokens) does
        not: its last-layer Jacobian is then taken by the generic `IndexSubspace` route."""
        if not (isinstance(x, torch.Tensor) or batching.is_mapping(x)) or batching.rows(x) == 0:
            return True
        attention_mask(x, self.feature_reduction)  # a mask-aware reduction's mask, before a pass
        layer = flat.net.get_submodule(self.layer_name)
        calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        handle = layer.register_forward_hook(lambda m, inp, out: calls.append((inp[0], out)))
        try:
            with torch.no_grad(), eval_mode(flat.net):
                xc = batching.take(x, slice(0, 2))
                out = flat(w, xc)
        finally:
            handle.remove()
        n = batching.rows(xc)
        if len(calls) != 1 or out.dim() not in (1, 2) or out.shape[0] != n:
            return False
        inp, layer_out = calls[0]
        if self.feature_reduction is not None and inp.dim() > 2:  # (n, T, P) reduced to (n, P)
            mask = attention_mask(xc, self.feature_reduction)
            reduced = reduce_features(layer_out, self.feature_reduction, mask)
            return inp.shape[0] == n and reduced.shape == as_2d(out).shape
        return inp.dim() == 2 and inp.shape[0] == n and layer_out.shape == as_2d(out).shape

    def feature_blocks(
        self, flat: FlatNet, x: torch.Tensor, w: torch.Tensor, chunk_size: int | None = 1024
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(outputs (n, C), φ̃ (n, P̃))`` per chunk at the flat weights ``w``: one forward pass
        each, the penultimate features read by a forward hook on the last layer (reduced to one
        row per data point by ``feature_reduction``). A ``ValueError`` at the first chunk when
        the layer's output is not the network's output (a network that transforms it further,
        e.g. ``Linear → Tanh``, which the closed form would get wrong); a `ReductionWarning`
        where a reduction does not reproduce the network's outputs (laplace-torch's
        predictive reads the reduced features there too)."""
        warned = False
        for _, out, phi, exact in self._reduced_blocks(flat, x, w, chunk_size):
            if not exact and not warned:
                warned = True
                warnings.warn(ReductionWarning(UNFAITHFUL.format(r=self.feature_reduction)), stacklevel=2)
            yield out, phi

    def _reduced_blocks(self, flat, x, w, chunk_size):
        """``(x chunk, outputs, φ̃, faithful)`` per chunk (`feature_blocks`); ``faithful``: the
        reduced layer outputs are the network's (always, without a reduction)."""
        layer = flat.net.get_submodule(self.layer_name)
        feats: list[tuple[torch.Tensor, torch.Tensor]] = []
        handle = layer.register_forward_hook(lambda m, inp, out: feats.append((inp[0], out)))
        reduction = self.feature_reduction
        try:
            with torch.no_grad(), eval_mode(flat.net):
                for xc in batching.split(x, chunk_size or 4096):
                    feats.clear()  # a caller's passes between two chunks are not this one's
                    out = as_2d(flat(w, xc))
                    inp, layer_out = feats.pop()
                    exact = True
                    if reduction is not None and inp.dim() > 2 and not len(feats):
                        mask = attention_mask(xc, reduction)
                        exact = faithful(layer_out, out, reduction, mask)
                        inp = reduce_features(inp, reduction, mask)
                        layer_out = out if exact else reduce_features(layer_out, reduction, mask)
                    if len(feats) or inp.dim() != 2 or layer_out.shape != out.shape:
                        raise ValueError(
                            f"net: the last linear layer {self.layer_name!r} does not see one "
                            f"row of features per data point (input {tuple(inp.shape)}, output "
                            f"{tuple(layer_out.shape)} for outputs {tuple(out.shape)}): a network "
                            "that reshapes its batch; check closed_form(...) first and take "
                            "the IndexSubspace route (jacobian_blocks, ggn_sum do), or give "
                            "feature_reduction for sequence features (n, T, P)"
                        )
                    if exact and (
                        layer_out.numel() != out.numel()
                        or not torch.equal(layer_out.reshape(out.shape), out)
                    ):
                        raise ValueError(
                            f"net: the output of the last linear layer {self.layer_name!r} is "
                            "not the network's output; " + NOT_THE_OUTPUT.format(name=self.layer_name)
                        )
                    phi = inp.detach().reshape(batching.rows(xc), -1).to(out)
                    if self.rows.shape[1] > phi.shape[1]:  # bias column
                        phi = torch.cat([phi, torch.ones_like(phi[:, :1])], dim=1)
                    yield xc, out, phi, exact
        finally:
            handle.remove()

    def jacobian_blocks(self, flat, x, w, chunk_size=1024, factor=None) -> Blocks:
        """``J_n P`` from the features: ``(J P)_{c, rows[c, p]} = φ̃_p``, zero elsewhere
        (the generic `IndexSubspace` route where the closed form does not hold)."""
        if not self.closed_form(flat, x, w):
            return super().jacobian_blocks(flat, x, w, chunk_size, factor)
        return weighted(self._feature_jacobians(flat, x, w, chunk_size), factor)

    def ggn_sum(
        self, flat, x, w, chunk_size, factor, diagonal=False, total=None, dtype=None, rows=None
    ):
        """The closed form ``G_(c,p),(d,q) = Σ_n H_n[c, d] φ̃_np φ̃_nq`` (Kristiadi et al., 2020;
        ``J`` is ``δ_cc' φ̃``): one ``(C²·P̃, n) × (n, P̃)`` product per chunk, ``C`` times fewer
        multiplications than ``Σ AᵀA`` over ``A = L_nᵀ J_n P`` ``(n·C, C·P̃)``; summed over the
        chunks in float64, returned in ``dtype`` (default ``total``'s, else ``w``'s). No
        ``A`` is formed, so ``rows`` stays empty. The generic `IndexSubspace` sum where the
        closed form does not hold (`closed_form`)."""
        if not self.closed_form(flat, x, w):
            return super().ggn_sum(flat, x, w, chunk_size, factor, diagonal, total, dtype, rows)
        c, p = self.rows.shape
        g4 = None
        for xc, out, phi, exact in self._reduced_blocks(flat, x, w, chunk_size):
            if not exact:  # a reduction that is not the network's: its exact GGN on these rows
                blocks = IndexSubspace.jacobian_blocks(self, flat, xc, w, chunk_size, factor)
                total = gram_from_blocks(blocks, diagonal, total, dtype)
                continue
            fac = factor(out).to(phi)
            h = fac @ fac.mT  # shape: (n, C, C)
            hphi = (h[:, :, :, None] * phi[:, None, None, :]).reshape(phi.shape[0], -1)
            part = (hphi.T @ phi).reshape(c, c, p, p)  # [c, d, p, q]
            g4 = part.double() if g4 is None else g4.add_(part)  # float64 sums
        if g4 is None:
            return total
        g4 = g4.to(dtype or (total.dtype if total is not None else phi.dtype))
        if diagonal:
            part = g4.new_zeros(self.rank)
            part[self.rows] = g4.diagonal(dim1=0, dim2=1).diagonal(dim1=0, dim2=1)
        else:
            part = g4.new_zeros(self.rank, self.rank)
            part[self.rows[:, None, :, None], self.rows[None, :, None, :]] = g4
            symmetrize_(part)  # exactly symmetric, as the generic Σ AᵀA
        return part if total is None else total + part

    def _feature_jacobians(self, flat, x, w, chunk_size) -> Blocks:
        c, k = self.rows.shape[0], self.rank
        for out, phi in self.feature_blocks(flat, x, w, chunk_size):
            jp = phi.new_zeros(out.shape[0], c, k)
            index = self.rows.expand(out.shape[0], -1, -1)
            jp.scatter_(2, index, phi[:, None, :].expand(-1, c, -1))
            yield out, jp
