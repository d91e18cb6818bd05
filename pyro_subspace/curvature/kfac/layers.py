"""Which modules K-FAC covers: the ``nn.Linear``/``nn.Conv2d`` (and GPT-2 ``Conv1D``) layers with
their running float64 sums (`_Layer`), the exact-diagonal rest, and the checks of each layer's
forward calls against what K-FAC assumes (the package docstring)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn


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
