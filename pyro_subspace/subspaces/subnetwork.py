"""Subnetwork selection (Subnetwork Inference, Daxberger et al. 2021, sections 4–5).

A subnetwork is a `Subspace` whose basis is an index selection: ``K`` unit columns ``e_i`` at
the chosen flat positions, never stored as a dense ``(D, K)`` matrix, shifted at the current
(MAP) weights. Strategies:

- ``"diag_laplace"``: the ``K`` largest marginal variances of a diagonal GGN Laplace
  approximation, ``1 / (diag(G) + λ)`` — the paper's Wasserstein-optimal selection (eq. 23).
  **Warning (paper, section 5):** a weight whose GGN diagonal is zero, e.g. into or out of a dead
  ReLU unit, keeps its prior variance, the largest possible, so this strategy can fill the
  subnetwork with weights that do not affect the predictions at all. ``"swag"`` avoids this:
  such weights never move during SGD and get zero SWAG variance.
- ``"swag"``: the ``K`` largest variances of a diagonal SWAG fitted by a `SWACollector`.
- ``"magnitude"``: the ``K`` largest absolute weights (a baseline).
- ``"random"``: ``K`` weights uniformly at random (seeded; the paper's random baseline).
- ``"last_layer"``: every parameter of the last module that has parameters (its weight and bias).
- ``"names"``: every parameter whose name equals, or starts with ``"<name>."``, one of ``names``.
- ``"indices"``: explicit positions in the flat vector of the trainable weights (`flat.flat_parameters`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import validation as ck
from ..curvature import ggn_diagonal
from ..flat import FlatNet, flat_offsets
from ..likelihoods import check_likelihood
from .base import Subspace
from .last_layer import LastLayerSubspace, find_last_layer, last_layer_indices
from .pca import SWACollector

STRATEGIES = ("diag_laplace", "swag", "magnitude", "random", "last_layer", "names", "indices")
#: the keyword arguments each strategy uses; any other one given is a ``ValueError``
USES = {
    "diag_laplace": {"likelihood", "x", "prior_precision", "chunk_size"},
    "swag": {"collector"},
    "magnitude": set(),
    "random": {"seed"},
    "last_layer": set(),
    "names": {"names"},
    "indices": {"indices"},
}


def _positions(net: nn.Module, names: Sequence[str]) -> torch.Tensor:
    spans = flat_offsets(net)
    chosen = []
    for name in names:
        hits = [s for n, s in spans.items() if n == name or n.startswith(name + ".")]
        if not hits:
            raise ValueError(
                f"names: {name!r} matches no parameter or module; known: {list(spans)}"
            )
        chosen += [torch.arange(a, b) for a, b in hits]
    return torch.cat(chosen).unique()


def subnetwork(
    net: nn.Module,
    n_params: int | None = None,
    strategy: str = "diag_laplace",
    *,
    likelihood=None,
    x: torch.Tensor | None = None,
    prior_precision: float | None = None,
    collector: SWACollector | None = None,
    names: Sequence[str] | None = None,
    indices: torch.Tensor | Sequence[int] | None = None,
    seed: int | None = None,
    chunk_size: int | None = None,
) -> Subspace:
    """Select a subnetwork of ``net`` and return it as an index-basis `Subspace` at the MAP.

    Args:
        net: the trained network; its current weights ``ŵ`` (shape ``(D,)``) become the shift.
        n_params: ``K``, how many weights to select (for the scoring strategies).
        strategy: one of `STRATEGIES` (see the module docstring).
        likelihood, x: for ``"diag_laplace"``: the `Likelihood` and training inputs
            ``(N, ...)`` whose GGN diagonal is computed (in chunks of ``chunk_size`` rows).
        prior_precision: ``λ`` of the isotropic Gaussian prior in ``1 / (diag(G) + λ)``
            (``"diag_laplace"``; default ``1``).
        collector: for ``"swag"``: a `SWACollector` built on ``net``.
        names: for ``"names"``: parameter or module names.
        indices: for ``"indices"``: flat positions.
        seed: for ``"random"`` (``None``: torch's global generator, never re-seeded).

    Returns:
        A `Subspace` with shift ``ŵ`` and the selected indices, sorted, as its basis.
    """
    flat = FlatNet(net)
    d = flat.num_weights
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    given = {
        name
        for name, value in (
            ("likelihood", likelihood),
            ("x", x),
            ("prior_precision", prior_precision),
            ("collector", collector),
            ("names", names),
            ("indices", indices),
            ("seed", seed),
            ("chunk_size", chunk_size),
        )  # fmt: skip
        if value is not None
    }
    unused = sorted(given - USES[strategy])
    if unused:  # nothing is accepted and then ignored
        uses = ", ".join(sorted(USES[strategy])) or "none"
        raise ValueError(
            f"{unused[0]}: strategy {strategy!r} does not use it (its keyword arguments: {uses})"
        )
    if prior_precision is None:
        prior_precision = 1.0
    scored = strategy in ("diag_laplace", "swag", "magnitude", "random")
    if scored:
        ck.check_int(n_params, "n_params", 1, d)
    shift = flat.vector()
    if strategy == "diag_laplace":
        if likelihood is None or x is None:
            raise ValueError(
                "likelihood: 'diag_laplace' needs likelihood= and x= (training inputs)"
            )
        check_likelihood(likelihood)
        ck.positive_float(prior_precision, "prior_precision")
        ck.positive_int(chunk_size, "chunk_size", allow_none=True)
        ck.check_data(net, x)
        score = 1.0 / (ggn_diagonal(net, likelihood, x, chunk_size) + prior_precision)
    elif strategy == "swag":
        if not isinstance(collector, SWACollector):
            raise ValueError("collector: 'swag' needs a SWACollector that has collected snapshots")
        if collector.flat.num_weights != d:
            raise ValueError(f"collector: tracks {collector.flat.num_weights} weights, net has {d}")
        score = collector.variance
    elif strategy == "magnitude":
        score = shift.abs()
    elif strategy == "random":
        gen = torch.Generator().manual_seed(seed) if seed is not None else None  # None: global
        score = torch.rand(d, generator=gen)
    if scored:
        chosen = torch.topk(score.to(shift.device), n_params).indices
    elif strategy == "last_layer":
        chosen = last_layer_indices(net)
        if type(find_last_layer(net)[1]) is nn.Linear and (
            n_params is None or n_params == chosen.numel()
        ):  # the kind whose Jacobian comes from the penultimate features
            return LastLayerSubspace(net, shift)
    elif strategy == "names":
        if not names:
            raise ValueError("names: 'names' needs a non-empty list of parameter or module names")
        chosen = _positions(net, [names] if isinstance(names, str) else names)
    else:
        if indices is None:
            raise ValueError("indices: 'indices' needs indices= (flat positions)")
        if not isinstance(indices, (torch.Tensor, Sequence)) or isinstance(indices, str):
            raise TypeError(f"indices: expected integer flat positions, got {indices!r}")
        chosen = torch.as_tensor(indices)
        if chosen.dim() != 1 or chosen.numel() == 0:
            raise ValueError(
                f"indices: expected a non-empty 1-D list of flat positions, got "
                f"shape {tuple(chosen.shape)}"
            )
        if chosen.is_floating_point() or chosen.is_complex() or chosen.dtype == torch.bool:
            raise TypeError("indices: expected integer flat positions")
        if int(chosen.min()) < 0 or int(chosen.max()) >= d:
            raise ValueError(
                f"indices: positions must lie in [0, {d}), got "
                f"[{int(chosen.min())}, {int(chosen.max())}]"
            )
        if chosen.unique().numel() != chosen.numel():
            raise ValueError("indices: contains duplicate positions; pass each weight once")
    if n_params is not None and not scored and chosen.numel() != n_params:
        raise ValueError(f"n_params: {strategy!r} selects {chosen.numel()} weights, not {n_params}")
    return Subspace(shift, chosen.sort().values.to(shift.device))
