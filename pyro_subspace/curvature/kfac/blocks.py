"""The result types of `kfac`: `KronBlock` (one block's factors and its flat positions) and
`KronFactors` (the blocks of a network), assembled from the pass's reduced sums."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...flat import flat_parameters


@dataclass(eq=False)
class KronBlock:
    """One block of the K-FAC curvature: the parameters it covers and its factors.

    Attributes:
        module: the module's name in the network (``""`` for the network itself).
        params: names of the covered parameters (``net.named_parameters()``), in flat order.
        index: ``(numel,)`` positions in the network's flat vector
            (``parameters_to_vector(net.parameters())``) of this block's rows, in the block's
            own order: row-major ``vec W`` (= flat order), the bias, or row-major
            ``vec [W | b]`` for an augmented block.
        G: ``(q, q)`` output-side factor (a sum over the data), or ``None`` (diagonal block).
        A: ``(p, p)`` input-side factor (a mean over the data), or ``None`` (a bias or diagonal
            block).
        diagonal: ``(numel,)`` exact GGN diagonal of a non-K-FAC block, else ``None``.
        augmented: ``A``'s last row/column belong to the bias (``bias="augment"``).
    """

    module: str
    params: tuple[str, ...]
    index: torch.Tensor
    G: torch.Tensor | None = None
    A: torch.Tensor | None = None
    diagonal: torch.Tensor | None = None
    augmented: bool = False

    @property
    def kind(self) -> str:
        """``"kron"`` (``G ⊗ A``), ``"full"`` (``G`` alone: a bias) or ``"diagonal"``."""
        if self.diagonal is not None:
            return "diagonal"
        return "full" if self.A is None else "kron"

    @property
    def numel(self) -> int:
        """Number of weights the block covers."""
        return self.index.numel()

    def to_dense(self) -> torch.Tensor:
        """The block as a dense ``(numel, numel)`` matrix in its own order (`index`):
        ``torch.kron(G, A)``, ``G`` or ``diag(diagonal)``. For tests and small layers."""
        if self.diagonal is not None:
            return torch.diag(self.diagonal)
        return self.G.clone() if self.A is None else torch.kron(self.G, self.A)

    def diag(self) -> torch.Tensor:
        """The block's diagonal ``(numel,)`` in its own order, without forming it densely."""
        if self.diagonal is not None:
            return self.diagonal
        g = self.G.diagonal()
        return g.clone() if self.A is None else torch.outer(g, self.A.diagonal()).reshape(-1)


@dataclass(eq=False)
class KronFactors:
    """K-FAC curvature of a network (`kfac`): a list of blocks over disjoint weights.

    The approximation of the GGN restricted to the covered weights is block diagonal with
    `KronBlock.to_dense` as blocks; `index` says which weights of the flat vector are covered.

    Attributes:
        blocks: the blocks, ordered by their first weight in the flat vector.
        num_data: ``N``, the data points summed over (all ranks).
        num_weights: ``D``, the length of the network's flat vector.
        fisher, conv, bias: the options the factors were computed with.
    """

    blocks: list[KronBlock]
    num_data: int
    num_weights: int
    fisher: str = "type-2"
    conv: str = "expand"
    bias: str = "separate"
    _order: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def index(self) -> torch.Tensor:
        """``(K,)`` positions of the covered weights in the flat vector, ascending: the order
        of the rows of `to_dense` and `diag` (``parameters_to_vector`` order restricted to
        the covered parameters)."""
        if self._order is None:
            self._order = torch.cat([b.index for b in self.blocks]).sort().values
        return self._order

    def _local(self, block: KronBlock) -> torch.Tensor:
        return torch.searchsorted(self.index, block.index)

    def to_dense(self) -> torch.Tensor:
        """``(K, K)`` block-diagonal approximation in `index` order (tests, small nets only)."""
        first = self.blocks[0].G if self.blocks[0].G is not None else self.blocks[0].diagonal
        k = self.index.numel()
        out = torch.zeros(k, k, dtype=first.dtype, device=first.device)
        for b in self.blocks:
            pos = self._local(b).to(first.device)
            out[pos[:, None], pos[None, :]] = b.to_dense()
        return out

    def diag(self) -> torch.Tensor:
        """``(K,)`` diagonal of the approximation in `index` order."""
        first = self.blocks[0].G if self.blocks[0].G is not None else self.blocks[0].diagonal
        out = torch.zeros(self.index.numel(), dtype=first.dtype, device=first.device)
        for b in self.blocks:
            out[self._local(b).to(first.device)] = b.diag()
        return out


def _assemble(net, layers, diagonal, diag_sums, count, dtype, fisher, conv, bias) -> KronFactors:
    """The blocks from the reduced sums: ``A /= N``, flat positions, the requested dtype."""
    starts, offset = {}, 0
    for _, p in flat_parameters(net):  # positions in the flat vector of trainable weights
        starts[id(p)] = offset
        offset += p.numel()
    pnames = {id(p): n for n, p in net.named_parameters()}
    named = dict(net.named_parameters())

    def span(p) -> torch.Tensor:
        return torch.arange(starts[id(p)], starts[id(p)] + p.numel())

    blocks = []
    for lay in layers:
        g = lay.G.to(dtype)
        if lay.weight is None:  # the bias alone
            blocks.append(KronBlock(lay.name, (pnames[id(lay.bias)],), span(lay.bias), G=g))
            continue
        a = (lay.A / count).to(dtype)
        w = lay.weight
        if lay.transposed:  # Conv1D: W (in, out); the block's row (o, i) is W[i, o]
            in_f, out_f = w.shape
            rows = torch.arange(out_f)[:, None]
            wpos = starts[id(w)] + torch.arange(in_f)[None, :] * out_f + rows
        else:
            out_f, in_f = w.shape[0], w.numel() // w.shape[0]
            rows = torch.arange(out_f)[:, None]
            wpos = starts[id(w)] + rows * in_f + torch.arange(in_f)[None, :]
        if lay.augment:
            bpos = starts[id(lay.bias)] + rows
            index = torch.cat([wpos, bpos], 1).reshape(-1)  # row-major vec [W | b]
            names = (pnames[id(w)], pnames[id(lay.bias)])
            blocks.append(KronBlock(lay.name, names, index, G=g, A=a, augmented=True))
            continue
        index = wpos.reshape(-1) if lay.transposed else span(w)  # row-major vec W (out, in)
        blocks.append(KronBlock(lay.name, (pnames[id(w)],), index, G=g, A=a))
        if lay.bias is not None:
            blocks.append(KronBlock(lay.name, (pnames[id(lay.bias)],), span(lay.bias), G=g.clone()))
    for module, names in diagonal.items():
        if not names:
            continue
        names = sorted(names, key=lambda nm: starts[id(named[nm])])
        index = torch.cat([span(named[nm]) for nm in names])
        diag = torch.cat([diag_sums[nm].reshape(-1) for nm in names]).to(dtype)
        blocks.append(KronBlock(module, tuple(names), index, diagonal=diag))
    blocks.sort(key=lambda b: int(b.index.min()))
    return KronFactors(blocks, count, offset, fisher, conv, bias)
