"""K-FAC: Kronecker-factored blocks of a network's GGN (type-2 Fisher), in one pass over the data.

For an ``nn.Linear`` layer ``z = W a + b`` the GGN block of ``W`` is
``Σ_n Σ_c (g_{n,c} g_{n,c}ᵀ) ⊗ (a_n a_nᵀ)`` (row-major ``vec W``), where ``a_n`` is the layer's
input and ``g_{n,c} = J_{z,n}ᵀ L_n[:, c]`` the output-Hessian factor's column ``c``
(``L_n L_nᵀ = H_n``, `Likelihood.hessian_factor`) back-propagated to the layer's output. K-FAC
replaces the sum of Kronecker products by the Kronecker product of sums (Martens & Grosse 2015;
Ritter et al. 2018, eq. 7; Eschenhagen et al. 2023, eq. 6)::

    block(W) ≈ G ⊗ A,   G = Σ_{n,c} g_{n,c} g_{n,c}ᵀ  (out, out),   A = (1/N) Σ_n a_n a_nᵀ  (in, in)

so ``G`` is a sum over the data and ``A`` a mean: the split laplace-torch's ``Kron`` stores
(``[G, A]`` per weight, ``kron(G, A)`` its dense block in ``parameters_to_vector`` order, since
``W`` ``(out, in)`` flattens row-major: entry ``(i, j)`` sits at ``i·in + j``). On one data point,
or for a single linear layer with a likelihood whose ``H_n`` is the same for every point (a
Gaussian of fixed ``σ``), ``G ⊗ A`` is the exact GGN block.

Weight sharing (``nn.Conv2d``: ``R`` output locations per image; an ``nn.Linear`` applied to
inputs ``(N, ..., in)``: ``R`` = the product of the middle dimensions) follows Eschenhagen et al.
(2023, sections 3.1-3.2), chosen by ``conv``:

- ``"expand"`` (Grosse & Martens 2016's KFC): locations are extra data points.
  ``A = (1/(N R)) Σ_{n,r} a_{n,r} a_{n,r}ᵀ``, ``G = Σ_{n,r,c} g_{n,r,c} g_{n,r,c}ᵀ`` (``a_{n,r}``
  the unfolded patch, ``in·kh·kw`` long in ``weight.reshape(out, -1)``'s column order).
  curvlinops' ``KFACLinearOperator(kfac_approx="expand")``: laplace-torch's default
  ``CurvlinopsGGN`` backend.
- ``"reduce"``: the shared dimension is reduced before the outer products.
  ``A = (1/N) Σ_n â_n â_nᵀ`` with ``â_n = (1/R) Σ_r a_{n,r}``, ``G = Σ_{n,c} ĝ_{n,c} ĝ_{n,c}ᵀ``
  with ``ĝ_{n,c} = Σ_r g_{n,r,c}``. curvlinops' ``kfac_approx="reduce"`` (laplace-torch's
  ``CurvlinopsGGN`` with ``asdl_fisher_kwargs={"kfac_approx": "reduce"}``).
- ``"backpack"``: BackPack's KFLR/KFAC for convolutions (laplace-torch's ``BackPackGGN``),
  which is neither of the two: ``G`` as in ``"reduce"`` and ``A = (1/N) Σ_{n,r} a_{n,r} a_{n,r}ᵀ``
  (``R`` times ``"expand"``'s ``A``; BackPack's ``HBPConvNd`` docstring notes the factor ``R``).

GPT-2's ``Conv1D`` (``transformers``: ``z = a W + b`` with ``W`` ``(in, out)``) is a Linear
with its weight transposed: the same factors, its block's rows ``vec Wᵀ`` mapped to the flat
positions of ``W`` (`KronBlock.index`); checked against curvlinops on the ``nn.Linear`` twin.

For layers without weight sharing (an MLP) the three coincide, and equal both laplace-torch
backends. laplace-torch's ``KronLaplace.fit`` accumulates per batch ``G_b`` and
``A_b · M_b/N`` (``A_b`` the batch mean) and adds factor by factor, so for the type-2 Fisher its
``H_facs`` equal these full-data factors for ANY batching (checked in the tests); its ``H``
leaves out ``1/σ²`` for regression (``KronLaplace`` multiplies it in, ``_H_factor``).

Bias: ``bias="separate"`` (laplace-torch, curvlinops ``separate_weight_and_bias=True``) gives
the bias its own block ``G`` (``kind="full"``): the exact GGN block of the bias when there is no
weight sharing (and for ``"reduce"``/``"backpack"``); with ``"expand"`` it is the expand
approximation ``Σ_{n,r,c} g gᵀ``, as in curvlinops. ``bias="augment"``: one block for
``[W | b]``, the bias a column of ones appended to every input (``A`` gains a last row and
column); its dense order is row-major ``vec [W | b]``, mapped to the flat vector by
`KronBlock.index`.

A network that reshapes its batch (pairs ``(B, 2, d) → (2B, d)``, sets, tokens ``(B·L, d)``)
gives a layer more rows than data points, and a layer applied twice sees two inputs: each
call's rows are more rows of the sums, ``A = (1/N) Σ_calls Σ_rows a aᵀ / R`` and
``G = Σ_calls Σ_rows g gᵀ`` (``N`` the data points, once), as curvlinops' hooks accumulate them
(laplace-torch's ``KronLaplace``; `tests/test_reshaping_curvature.py` checks both that and the
per-layer definition formed by brute force).

Every other parameter in scope (BatchNorm, LayerNorm, Embedding, LSTM, a Linear/Conv2d whose
parameters are shared or that the forward does not call, a grouped convolution)
gets the exact GGN diagonal (``kind="diagonal"``): ``Σ_n Σ_c ((L_nᵀ J_n)_{c,d})²`` from per-sample
Jacobians of ``L_nᵀ f(x_n)`` with respect to only those parameters (``vmap`` over rows of
``jacrev``; row by row where ``vmap`` fails), in blocks of at most
``jacobians.SQUARE_SUM_NUMBERS // (C·D_diag)`` rows.

``fisher="mc"`` (laplace-torch's ``stochastic=True``, curvlinops' ``fisher_type="mc"``): the
factor's columns are replaced per point by ``mc_samples`` scores ``∇_f log p(ỹ | f_n) / √M`` with
``ỹ ~ p(y | f_n)`` drawn from the likelihood's distribution, whose expected outer product is the
Fisher ``= H_n`` for every likelihood here; so ``E[G_mc] = G``.

Cost per chunk: one forward pass with hooks (each K-FAC layer's input and output), ``C``
backward passes to the layers' outputs (``C`` = the factor's columns, ``mc_samples`` for
``"mc"``), one ``gᵀg`` per layer and column and one ``aᵀa`` per layer; memory is that of one
forward/backward pass on a chunk plus the unfolded patches of a convolution (computed in
sub-blocks of at most `UNFOLD_NUMBERS` numbers). Sums are added in float64 across chunks (so
they do not depend on the chunk size beyond rounding), then all-reduced over
``torch.distributed`` ranks (`distributed.all_reduce_sum`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Bernoulli, Categorical, Independent, Normal
from torch.func import functional_call, vjp, vmap

from .. import batch as batching
from .. import distributed, rng
from ..data import DataSource
from ..flat import eval_mode, flat_parameters, hooked
from ..likelihoods import Likelihood, check_likelihood
from ..threads import thread_policy
from ..validation import check_inputs, check_int, choice, positive_int
from .autodiff import plain_kernels
from .jacobians import SQUARE_SUM_NUMBERS, add_row_jacobian_squares, as_2d
from .output_hessian import hessian_factor

__all__ = ["KronBlock", "KronFactors", "kfac"]

#: ``fisher`` choices: the exact type-2 Fisher (= GGN) or its Monte Carlo estimate.
FISHERS = ("type-2", "mc")
#: ``conv`` choices: how a shared dimension (conv locations, sequence positions) is treated.
CONVS = ("expand", "reduce", "backpack")
#: ``bias`` choices: a block of its own, or a column of ones appended to the inputs.
BIASES = ("separate", "augment")
#: Seed of the generator ``fisher="mc"`` uses when none is given (plus the process's rank).
MC_SEED = 0
#: At most this many numbers in one layer's output per forward/backward pass: the ``C``
#: backward passes of a pass then work in cache-sized tensors (a CNN's first stages at 1024
#: rows run them about 1.6 times slower than at 256), and each pass frees little enough that
#: glibc keeps it for the next instead of returning it and faulting it in again (resnet4, 1024
#: rows, fresh processes: 128-row passes 8.2-8.6 s, 256-row passes 10.4-10.8 s).
PASS_NUMBERS = 2**21
#: ...but at least this many rows a pass (fewer than the chunk only if the chunk is smaller):
#: below it the per-layer, per-column overhead of the ``C`` backward passes dominates
#: (ResNet-18, whose widest output is 64·32·32 numbers a row: 32-row passes 250 s, 64-row 221 s).
MIN_PASS_ROWS = 64
#: Numbers in one sub-block of unfolded convolution patches ``(rows, in·kh·kw, R)``.
UNFOLD_NUMBERS = 8_000_000
#: On CPU, with the ``"expand"`` convention, a network with a ``Conv2d`` runs the K-FAC pass on
#: a channels-last copy of each chunk of 4-D inputs (the user's inputs and network are
#: untouched): the convolutions then work in NHWC, whose input-gradient kernels (the ``C``
#: backward passes) run up to 4 times faster than the NCHW ones on this machine's CPU (a 16→32,
#: stride-2 convolution at 32×32: 6.2 against 24.5 ms), and the expand A factor's channels-last
#: row patches become a cheap copy (``"reduce"``'s ``F.unfold`` wants NCHW: 10% slower there).
CHANNELS_LAST_ON_CPU = True
#: Run each ``Conv2d`` whose output only an eval-mode BatchNorm uses as one function of the
#: convolution's input (`_FoldedConvBN`) after the first chunk: the ``C`` backward passes then
#: skip the BatchNorm's elementwise product (the factors are the same, to rounding).
FOLD_BATCHNORM = True


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


def is_conv1d(m: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (``transformers.pytorch_utils``, recognised without importing
    transformers): ``z = a W + b`` with ``W`` ``(nx, nf)``, a Linear with the weight transposed."""
    return (
        type(m).__name__ == "Conv1D"
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and tuple(m.weight.shape) == (getattr(m, "nx", None), getattr(m, "nf", None))
    )


class _Layer:
    """A Linear (or GPT-2's Conv1D) or Conv2d handled by K-FAC, and its running float64 sums."""

    def __init__(self, name: str, module: nn.Module, weight, bias, augment: bool, pnames) -> None:
        self.name, self.module = name, module
        self.weight, self.bias = weight, bias  # the parameters covered (None: not covered)
        #: names of the covered parameters, weight first
        self.names = [pnames[id(p)] for p in (weight, bias) if p is not None]
        self.conv = isinstance(module, nn.Conv2d)
        #: GPT-2's Conv1D: ``W`` is stored ``(in, out)``, its block's rows are ``vec Wᵀ``
        self.transposed = is_conv1d(module)
        self.augment = augment and weight is not None and bias is not None
        self.A: torch.Tensor | float = 0.0  # Σ over the chunks of `_input_sum`, float64
        self.G: torch.Tensor | None = None  # Σ gᵀg, float64


def _check_modules(net: nn.Module, modules: object) -> list[nn.Module]:
    """The roots of the covered scope: ``[net]`` or the given submodules (objects or names)."""
    if modules is None:
        return [net]
    if isinstance(modules, (nn.Module, str)):
        modules = [modules]
    if not isinstance(modules, Iterable):
        raise TypeError(
            f"modules: expected None, a module, a module name or a list of them, got "
            f"{type(modules).__name__}"
        )
    by_name = dict(net.named_modules())
    ids = {id(m) for m in by_name.values()}
    roots = []
    for m in modules:
        if isinstance(m, str):
            if m not in by_name:
                raise ValueError(f"modules: the network has no submodule named {m!r}")
            m = by_name[m]
        elif not isinstance(m, nn.Module):
            raise TypeError(f"modules: expected modules or names, got {type(m).__name__}")
        elif id(m) not in ids:
            raise ValueError(f"modules: {type(m).__name__} is not a submodule of net")
        roots.append(m)
    if not roots:
        raise ValueError("modules: expected at least one module, got an empty list")
    return roots


def _plan(net: nn.Module, roots: list[nn.Module], augment: bool):
    """``(layers, diagonal)``: the K-FAC layers and ``{module name: [parameter names]}`` of the
    other covered parameters, both in scope order; names and flat offsets of all parameters."""
    names = {id(m): n for n, m in net.named_modules()}
    pnames = {id(p): n for n, p in net.named_parameters()}
    owners: dict[int, int] = {}
    for m in net.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    scope, seen = [], set()
    for root in roots:
        for m in root.modules():
            if id(m) not in seen:
                seen.add(id(m))
                scope.append(m)
    layers, diagonal, taken = [], {}, set()
    for m in scope:
        own = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in taken]
        if not own:
            continue
        taken.update(id(p) for p in own)
        kron = (
            (isinstance(m, (nn.Linear, nn.Conv2d)) or is_conv1d(m))
            and (not isinstance(m, nn.Conv2d) or m.groups == 1)
            and all(owners[id(p)] == 1 for p in m.parameters(recurse=False))
        )
        if kron:
            w = m.weight if m.weight.requires_grad else None
            b = m.bias if m.bias is not None and m.bias.requires_grad else None
            layers.append(_Layer(names[id(m)], m, w, b, augment, pnames))
        else:
            diagonal[names[id(m)]] = [pnames[id(p)] for p in own]
    if not layers and not diagonal:
        raise ValueError(
            "modules: no parameters that require grad in "
            + ("net" if roots == [net] else "the given modules")
        )
    return layers, diagonal


def _check_generator(generator: object, device: torch.device) -> torch.Generator:
    """The generator for ``fisher="mc"``: the given one, one seeded with an int, or one
    seeded with ``MC_SEED + rank``."""
    if isinstance(generator, torch.Generator):
        return generator
    if generator is None:
        return torch.Generator(device=device).manual_seed(MC_SEED + distributed.world()[0])
    if isinstance(generator, bool) or not isinstance(generator, int):
        raise TypeError(
            f"generator: expected a torch.Generator, an int seed or None, got "
            f"{type(generator).__name__}"
        )
    check_int(generator, "generator", 0, 2**63 - 1)
    return torch.Generator(device=device).manual_seed(generator)


@thread_policy
def kfac(
    net: nn.Module,
    likelihood: Likelihood,
    x: object,
    y: torch.Tensor | None = None,
    *,
    modules: nn.Module | str | Sequence[nn.Module | str] | None = None,
    fisher: str = "type-2",
    conv: str = "expand",
    bias: str = "separate",
    chunk_size: int = 1024,
    generator: torch.Generator | int | None = None,
    mc_samples: int = 1,
    dtype: torch.dtype | None = None,
    on_outputs: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None,
) -> KronFactors:
    """K-FAC factors of the GGN (type-2 Fisher) for ``nn.Linear``/``nn.Conv2d`` layers, the
    exact GGN diagonal for every other covered parameter, in one pass over the data.

    Martens & Grosse (2015); Ritter et al. (2018) eq. 7 (the Laplace use); Grosse & Martens
    (2016) and Eschenhagen et al. (2023) eqs. 10-13 for convolutions and weight sharing (the
    module docstring states every convention and which laplace-torch backend it equals).
    No prior and no temperature are added. The network runs in eval mode.

    Args:
        net: the network; its current weights are used. Outputs ``(N, O)`` (or ``(N,)``).
        likelihood: a `Likelihood`; its `Likelihood.hessian_factor` (or, for ``"mc"``, its
            ``distribution``) gives the back-propagated columns.
        x: inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)`` (its batches
            are split further into ``chunk_size`` rows and moved to the network's device).
        y: targets ``(N, ...)`` with tensor ``x``: accepted and checked for length only; the
            type-2 and MC Fishers do not depend on them.
        modules: what to cover: ``None`` (every parameter of ``net`` that requires grad), or a
            module, a name from ``net.named_modules()`` or a list of them (everything inside
            them, e.g. ``[net[-1]]`` for a last-layer Laplace).
        fisher: ``"type-2"`` (the exact GGN's factors) or ``"mc"`` (sampled targets).
        conv: ``"expand"``, ``"reduce"`` or ``"backpack"`` for weight sharing (module
            docstring); irrelevant for layers without it.
        bias: ``"separate"`` (bias block ``G``) or ``"augment"`` (one block for ``[W | b]``).
        chunk_size: at most this many rows per forward/backward pass (fewer where one layer's
            output would exceed `PASS_NUMBERS` numbers); the factors do not depend on it.
        generator: for ``"mc"``: a ``torch.Generator`` (on the network's device, or on the
            CPU: draws are then moved), an int seed, or ``None``: a new generator seeded with
            ``MC_SEED`` plus the process's rank. Torch's global generators are not advanced.
        mc_samples: draws per data point for ``"mc"`` (must be 1 for ``"type-2"``).
        dtype: dtype of the returned factors (default the network's). Each chunk's products
            are formed in the network's dtype and added up in float64.
        on_outputs: called with each pass's outputs ``(n, O)`` (detached) and its rows of the
            targets (``None`` without targets), so that a caller computes statistics of the
            same forward pass (the Laplace evidence's ``log p(D | θ)``) without a second one.

    Returns:
        `KronFactors`: for each K-FAC layer a ``"kron"`` block ``G ⊗ A`` of the weight (plus a
        ``"full"`` block ``G`` of the bias with ``bias="separate"``), and one ``"diagonal"``
        block per other module owning covered parameters.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        >>> factors = kfac(net, Categorical(), torch.randn(20, 3))
        >>> [(b.module, b.kind, b.numel) for b in factors.blocks]
        [('0', 'kron', 15), ('0', 'full', 5), ('2', 'kron', 10), ('2', 'full', 2)]
        >>> factors.to_dense().shape
        torch.Size([32, 32])
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    params = list(net.parameters())
    if not params:
        raise ValueError("net: the network has no parameters")
    check_likelihood(likelihood)
    choice(fisher, "fisher", FISHERS)
    choice(conv, "conv", CONVS)
    choice(bias, "bias", BIASES)
    positive_int(chunk_size, "chunk_size")
    positive_int(mc_samples, "mc_samples")
    if fisher == "type-2" and mc_samples != 1:
        raise ValueError(f"mc_samples: only fisher='mc' draws samples, got {mc_samples}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype: expected a floating-point torch.dtype or None, got {dtype!r}")
    device = params[0].device
    gen = _check_generator(generator, device) if fisher == "mc" else None
    if isinstance(x, torch.Tensor) or batching.is_mapping(x):
        check_inputs(net, x, "x")
    source = DataSource(x, y, chunk_size)  # a Dataset/DataLoader, else a TypeError naming x
    layers, diagonal = _plan(net, _check_modules(net, modules), bias == "augment")

    out_dtype = dtype or params[0].dtype
    named = dict(net.named_parameters())
    diag_sums = {p: 0.0 for names in diagonal.values() for p in names}
    count, first = 0, True
    folds: dict[str, _Fold] = {}
    modules = dict(net.named_modules())
    # diagonal blocks of a module's own parameters: per-sample Jacobians of the module alone,
    # from the same backward passes (`_local_diagonal_sums`); others through the whole network
    local = [_Layer(name, modules[name], None, None, False, {}) for name in diagonal]
    nhwc = (
        CHANNELS_LAST_ON_CPU
        and conv == "expand"
        and device.type == "cpu"
        and any(isinstance(m, nn.Conv2d) for m in net.modules())
    )
    with eval_mode(net), torch.enable_grad():
        for xs, ys in source:
            xs = batching.to_device(xs, device)
            if first and batching.rows(xs):  # the chunk, or fewer rows where a layer's output is large
                chunk_size = _rows_per_pass(net, layers + local, xs, chunk_size)
            ycs = ys.split(chunk_size) if ys is not None else None
            for i, xc in enumerate(batching.split(xs, chunk_size)):
                if nhwc and isinstance(xc, torch.Tensor) and xc.dim() == 4:  # channels last: the C backward passes' convolutions run faster on CPU
                    xc = xc.contiguous(memory_format=torch.channels_last)
                links: dict | None = {} if first and FOLD_BATCHNORM else None
                out, seen = _hooked_forward(net, layers + local, xc, folds, links)
                if first:
                    layers = _settle(layers, seen, diagonal, diag_sums)
                    local = [m for m in local if _usable_local(m, seen[m.name], batching.rows(xc))]
                    first = False
                    keep = {lay.name for lay in layers} | {m.name for m in local}
                    seen = {k: v for k, v in seen.items() if k in keep}
                    if links:  # the next chunks run each Conv2d + BatchNorm pair as one
                        once = [lay for lay in layers if len(seen[lay.name]) == 1]
                        folds = _fold_pairs(once, local, links, out)
                    links = None
                _check_calls(layers, seen)
                out2 = as_2d(out)
                if on_outputs is not None:
                    on_outputs(out2.detach(), None if ycs is None else ycs[i])
                for lay in layers:  # every call's rows (a reshaped batch, a layer used twice)
                    if lay.weight is not None:
                        for a, _ in seen[lay.name]:
                            lay.A = lay.A + _input_sum(lay, a, conv)
                # a layer whose output is the network's (J_z = I) gets G = Σ_n H_n directly:
                # no backward pass, and no C·out² per row for a last layer of many classes
                last = [lay for lay in layers if fisher == "type-2" and _is_output(lay, seen, out2)]
                for lay in last:
                    _add_sum(lay, likelihood.output_hessian_sum(out2.detach()))
                rest = [lay for lay in layers if lay not in last]
                whole = [m for m in diagonal if m not in {q.name for q in local}]
                if rest or local or whole:  # the factor's columns (not needed for `last` alone)
                    if fisher == "mc":
                        factor = _mc_factor(likelihood, out2.detach(), mc_samples, gen)
                    else:
                        factor = hessian_factor(likelihood, out2.detach()).to(out2)
                    scales = {n: f.scale for n, f in folds.items() if f.used}
                    local_grads = _backward(out2, factor, rest, seen, conv, local, scales)
                    # a folded BatchNorm's input is the convolution's output its fold kept
                    pre = {f.bn_name: f.pre for f in folds.values() if f.used}
                    for m, cols in zip(local, local_grads):
                        _local_diagonal_sums(
                            m, pre.get(m.name, seen[m.name][0][0]), cols, diagonal[m.name],
                            diag_sums,
                        )  # fmt: skip
                    if whole:  # modules without a local Jacobian: through the whole network
                        others = {n: diag_sums[n] for m in whole for n in diagonal[m]}
                        _diagonal_sums(net, named, others, xc, factor)
                        diag_sums.update(others)
                for f in folds.values():
                    f.pre = f.scale = None
                del out, seen
                count += batching.rows(xc)

    _fill_zeros(layers, diag_sums, named, device)  # a shard without rows adds zeros
    # one all_reduce over the ranks for every sum (float64)
    sums = [count] + [t for lay in layers for t in (lay.A, lay.G)] + list(diag_sums.values())
    reduced = distributed.all_reduce_sum(*sums)  # a tuple: there are always two or more
    count, rest = round(reduced[0]), list(reduced[1:])
    for lay in layers:
        lay.A, lay.G = rest.pop(0), rest.pop(0)
    for name in diag_sums:
        diag_sums[name] = rest.pop(0)
    if count == 0:
        raise ValueError("x: the data source yielded no rows")
    return _assemble(net, layers, diagonal, diag_sums, count, out_dtype, fisher, conv, bias)


def _fill_zeros(layers: list[_Layer], diag_sums: dict, named: dict, device) -> None:
    """Zero sums (float64) where no chunk added anything, so every rank packs the same shapes."""
    for lay in layers:
        m = lay.module
        if lay.G is None:
            q = m.out_channels if lay.conv else m.nf if lay.transposed else m.out_features
            lay.G = torch.zeros(q, q, dtype=torch.float64, device=device)
        if lay.weight is not None and not isinstance(lay.A, torch.Tensor):
            p = m.in_channels * math.prod(m.kernel_size) if lay.conv else m.nx if lay.transposed else m.in_features
            p += int(lay.augment)
            lay.A = torch.zeros(p, p, dtype=torch.float64, device=device)
    for name, value in diag_sums.items():
        if not isinstance(value, torch.Tensor):
            diag_sums[name] = torch.zeros_like(named[name], dtype=torch.float64)


def _hooked_forward(
    net: nn.Module,
    layers: list[_Layer],
    x: torch.Tensor,
    folds: dict[str, _Fold] | None = None,
    links: dict | None = None,
):
    """``net(x)`` with forward hooks keeping every K-FAC layer's ``(input, output)``; the
    outputs require grad (a leaf where nothing before them does), and the network continues
    with a clone, so later in-place ops (``ReLU(inplace=True)``) do not rebase them.

    ``folds`` (`_fold_pairs`): each folded convolution runs as `_FoldedConvBN` and its
    BatchNorm as the identity, for this pass. ``links``: filled with each layer's raw input and
    the clone it returned (``{name: (input, clone)}``), from which `_fold_pairs` finds the
    pairs."""
    seen: dict[str, list] = {lay.name: [] for lay in layers}
    folds = folds or {}

    def hook(name: str):
        def keep(module, inp, out):
            if not isinstance(out, torch.Tensor) or not inp or not isinstance(inp[0], torch.Tensor):
                seen[name].append((None, None))
                return None
            z = out if out.requires_grad else out.detach().requires_grad_(True)
            seen[name].append((inp[0].detach(), z))
            clone = z.clone()
            if links is not None:
                links[name] = (inp[0], clone)
            return clone

        return keep

    # first (hooks run in order): an eval-mode BatchNorm's output as `_affine_batchnorm`'s
    folded_bns = {id(f.bn) for f in folds.values()}
    handles = [
        m.register_forward_hook(_affine_batchnorm)
        for m in net.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and _uses_running_stats(m)
        and id(m) not in folded_bns
    ]
    handles += [lay.module.register_forward_hook(hook(lay.name)) for lay in layers]
    try:
        for f in folds.values():  # instance attributes: the classes' forward is untouched
            f.conv.forward, f.bn.forward = f.forward, _identity
        out = batching.call(net, x)  # a mapping by `batch`'s rule; a ModelOutput's logits
    finally:
        for f in folds.values():
            del f.conv.forward, f.bn.forward
        for h in handles:
            h.remove()
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"net: expected a tensor output (N, O), got {type(out).__name__}")
    return out, seen


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


def _rows_per_pass(net: nn.Module, layers: list[_Layer], x: torch.Tensor, chunk: int) -> int:
    """``chunk``, or fewer rows so that no K-FAC layer's output holds more than `PASS_NUMBERS`
    numbers (measured by a forward pass of one row), but not fewer than `MIN_PASS_ROWS`."""
    with torch.no_grad():
        _, seen = _hooked_forward(net, layers, batching.take(x, slice(0, 1)))
    widest = max(
        (z.numel() for calls in seen.values() for _, z in calls if z is not None), default=1
    )
    return max(1, min(chunk, max(MIN_PASS_ROWS, PASS_NUMBERS // widest)))


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


def _usable(lay: _Layer, calls: list) -> str | None:
    """Why a layer's forward calls do not fit K-FAC (``None``: they do).

    Every call on tensor inputs of rows ``(m, ..., in)`` (``(m, C, H, W)`` for a Conv2d) fits,
    whatever ``m``: a network that reshapes its batch (pairs ``(B, 2, d) → (2B, d)``, sets,
    tokens ``(B·L, d)``) gives a layer more rows than data points, and a layer applied twice
    sees two inputs. As curvlinops' hooks (laplace-torch's default backend) do, each call's
    rows are more rows of the sums: ``A = (1/N) Σ_calls Σ_rows a aᵀ / R`` and
    ``G = Σ_calls Σ_rows g gᵀ`` (``R`` the shared dimensions of a row, ``"expand"``); the
    network's ``N`` data points still count once."""
    if not calls:
        return "it was not called in the forward pass"
    for a, _ in calls:
        if a is None:
            return "its input or output is not a tensor"
        if lay.conv and a.dim() != 4:
            return f"its input has shape {tuple(a.shape)}, not (N, C, H, W)"
        if a.dim() < 2:
            return f"its input {tuple(a.shape)} has no rows"
    return None


def _settle(layers, seen, diagonal, diag_sums) -> list[_Layer]:
    """On the first chunk: layers whose calls do not fit K-FAC get the GGN diagonal (warned)."""
    kept = []
    for lay in layers:
        why = _usable(lay, seen[lay.name])
        if why is None:
            kept.append(lay)
            continue
        warnings.warn(
            f"kfac: layer {lay.name!r} gets the exact GGN diagonal instead of K-FAC: {why}",
            stacklevel=3,
        )
        diagonal[lay.name] = list(lay.names)
        diag_sums.update({nm: 0.0 for nm in lay.names})
    return kept


def _check_calls(layers: list[_Layer], seen: dict) -> None:
    for lay in layers:
        why = _usable(lay, seen[lay.name])
        if why is not None:
            raise ValueError(
                f"net: layer {lay.name!r} fitted K-FAC on the first chunk, not now: {why}"
            )


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
    if lay.conv:
        p = lay.module.in_channels * math.prod(lay.module.kernel_size)
        per_row = _patches(lay, a[:1]).numel()
        step = max(1, UNFOLD_NUMBERS // max(1, per_row))  # sub-blocks bound the patches' memory
        total = 0.0
        for start in range(0, a.shape[0], step):
            u = _patches(lay, a[start : start + step])  # shape: (rows, P, R)
            r = u.shape[2]
            if conv == "reduce":
                rows = u.mean(2)
            else:
                rows = u.transpose(1, 2).reshape(-1, p)
            rows = _ones_column(rows) if lay.augment else rows
            total = total + (_gram(rows) / r if conv == "expand" else _gram(rows))
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


def _grad_gram(lay: _Layer, g: torch.Tensor, conv: str) -> torch.Tensor:
    """``Σ gᵀg`` ``(out, out)`` of one back-propagated column at a layer's output: over data
    points and locations (``"expand"``) or of the sums over the locations (``"reduce"``,
    ``"backpack"``). A convolution's ``(n, out, R)`` is multiplied as ``(n·R, out)`` rows when it
    is channels-last (a view), else per data point where ``R ≥ out`` (no transposed copy), else
    as rows."""
    if lay.conv:
        if conv == "expand" and g.dim() == 4 and g.is_contiguous(memory_format=torch.channels_last):
            # channels last (`CHANNELS_LAST_ON_CPU`): the (n·R, out) rows are a view, one product
            return _rows_gram(g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]))
        g = g.flatten(2)  # shape: (n, out, R)
        if conv != "expand":
            return _rows_gram(g.sum(2))
        if g.shape[2] >= g.shape[1]:
            return torch.matmul(g, g.transpose(1, 2)).sum(0)
        return _rows_gram(g.transpose(1, 2).reshape(-1, g.shape[1]))
    if g.dim() > 2 and conv != "expand":
        return _rows_gram(g.sum(tuple(range(1, g.dim() - 1))))
    return _rows_gram(g.reshape(-1, g.shape[-1]))


def _rows_gram(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows`` in the rows' dtype (`_gram` widens it to float64)."""
    return rows.T @ rows


def _usable_local(m: _Layer, calls: list, n: int) -> bool:
    """A diagonal module whose own Jacobian can be taken per sample: called once per forward on
    a tensor of ``n`` rows, giving a tensor of ``n`` rows."""
    return (
        len(calls) == 1
        and calls[0][0] is not None
        and calls[0][0].shape[:1] == (n,)
        and calls[0][1].shape[:1] == (n,)
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


def _backward(
    out2, factor, layers, seen, conv: str, local=(), scales=None
) -> list[list[torch.Tensor]]:
    """``G += Σ_c g_cᵀ g_c`` per layer: one backward pass per column ``c`` of ``factor``
    ``(n, O, C)`` to the layers' outputs (curvlinops does the same per column); the columns'
    products are added in the network's dtype, then once to the float64 sum. ``scales``
    ``{layer name: s}``: a folded convolution's columns were taken at its BatchNorm's output
    (`_Fold`), so its sum is ``diag(s) (Σ g'ᵀg') diag(s)``."""
    if not layers and not local:
        return []
    # every call's output: a layer applied twice sums the products of both calls
    owner = [i for i, lay in enumerate(layers) for _ in seen[lay.name]]
    zs = [z for lay in layers for _, z in seen[lay.name]]
    local_zs = [seen[m.name][0][1] for m in local]
    local_cols: list[list[torch.Tensor]] = [[] for _ in local]
    cols = factor.shape[-1]
    chunk_sums: list[torch.Tensor | None] = [None for _ in layers]
    for c in range(cols):
        grads = torch.autograd.grad(
            (out2 * factor[:, :, c]).sum(), zs + local_zs, retain_graph=c + 1 < cols,
            allow_unused=True,
        )  # fmt: skip
        for i, g in enumerate(grads[len(zs):]):
            local_cols[i].append(torch.zeros_like(local_zs[i]) if g is None else g.detach())
        for i, g in zip(owner, grads[: len(zs)]):
            if g is None:  # the call does not reach the outputs
                continue
            gram = _grad_gram(layers[i], g, conv)
            chunk_sums[i] = gram if chunk_sums[i] is None else chunk_sums[i].add_(gram)
    for lay, total in zip(layers, chunk_sums):
        if total is not None:
            s = (scales or {}).get(lay.name)
            if s is not None:
                total = total * s[:, None] * s[None, :]
            _add_sum(lay, total.double())
    return local_cols


def _is_output(lay: _Layer, seen: dict, out2: torch.Tensor) -> bool:
    """The network's outputs are this Linear layer's (the clone its hook returned, possibly
    reshaped to 2-D): then ``∂f/∂z = I``."""
    if len(seen[lay.name]) != 1:
        return False
    z = seen[lay.name][0][1]
    fn = out2.grad_fn
    while fn is not None and type(fn).__name__ in ("ViewBackward0", "ReshapeAliasBackward0"):
        fn = fn.next_functions[0][0]
    if lay.conv or z.shape != out2.shape or fn is None or type(fn).__name__ != "CloneBackward0":
        return False
    return fn.next_functions[0][0] is z.grad_fn


def _add_sum(lay: _Layer, g: torch.Tensor) -> None:
    lay.G = g if lay.G is None else lay.G + g


def _draw(dist, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """One draw of ``dist`` from ``generator``: Normal, Categorical and Bernoulli (wrapped in
    ``Independent`` or not) by ``randn``/``multinomial``/``bernoulli`` with the generator; any
    other distribution by its own ``sample()`` inside `rng.preserved` after seeding torch's
    global generator from ``generator`` (so the caller's global stream does not move)."""
    base = dist
    while isinstance(base, Independent):
        base = base.base_dist
    gd = generator.device
    if isinstance(base, Normal):
        loc, scale = base.loc, base.scale
        eps = torch.randn(loc.shape, generator=generator, dtype=loc.dtype, device=gd)
        return loc + scale * eps.to(device)
    if isinstance(base, Categorical):
        probs = base.probs
        k = probs.shape[-1]
        idx = torch.multinomial(probs.reshape(-1, k).to(gd), 1, generator=generator)
        return idx.reshape(probs.shape[:-1]).to(device)
    if isinstance(base, Bernoulli):
        return torch.bernoulli(base.probs.to(gd), generator=generator).to(device)
    seed = int(torch.randint(2**62, (), generator=generator, device=gd))
    with rng.preserved(numpy=False, python=False):
        torch.manual_seed(seed)
        return dist.sample()


def _mc_factor(likelihood, out2: torch.Tensor, m: int, generator) -> torch.Tensor:
    """``(n, O, M)`` scores ``∇_f log p(ỹ | f_n) / √M``, ``ỹ ~ p(y | f_n)``: ``E[s sᵀ]`` is the
    Fisher, the likelihood's ``H_n``."""
    likelihood.check_curvature_outputs(out2)
    cols = []
    for _ in range(m):
        with torch.no_grad():
            ys = _draw(likelihood.distribution(out2), generator, out2.device)
        f = out2.detach().requires_grad_(True)
        (score,) = torch.autograd.grad(likelihood.log_prob_prepared(f, ys).sum(), f)
        cols.append(score)
    return torch.stack(cols, -1).div_(math.sqrt(m))


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
