"""EK-FAC's eigenvalue re-estimation for chosen Kronecker directions, in one pass over the data.

George et al. (2018), eq. 9: the eigenvalue of a direction ``p = v ⊗ u`` of a layer's K-FAC
eigenbasis is re-estimated as the second moment of the per-example gradients projected onto it.
For the GGN (the type-2 Fisher) the per-example "gradients" are ``J_nᵀ L_{n,c}`` (one per
column of the output-Hessian factor, ``L_n L_nᵀ = H_n``), and the layer's part of it is
``G_{n,c} = Σ_s g_{n,s,c} a_{n,s}ᵀ`` (``a`` the layer's inputs or a convolution's patches at
location ``s``, ``g`` the column back-propagated to its outputs), so

    s(p) = Σ_n Σ_c (vᵀ G_{n,c} u)² = Σ_n Σ_c (Σ_s (vᵀ g_{n,s,c}) (a_{n,s}ᵀ u))² = pᵀ G p,

the exact GGN's Rayleigh quotient. `ekfac_eigenvalues` forms it from one forward pass with
hooks and ``C`` backward passes to the layers' outputs per chunk (as the K-FAC pass), projecting
``a`` onto the chosen ``u`` (a ``Conv2d``'s patches by a convolution with ``u`` as its kernel, so
patches are never unfolded) and ``g`` onto the chosen ``v``: curvlinops'
``EKFACLinearOperator`` forms the same numbers for every pair ``(v_i, u_j)``. Where a layer's
rows are not the data points (a network that reshapes its batch, a layer called twice), and for
entries of diagonal blocks of the Monte Carlo Fisher, the quotients come from forward-mode
products instead (`curvature.ggn_in_subspace`), which hold for any network; an entry ``e_m`` of a
diagonal block of the type-2 K-FAC is its exact GGN diagonal ``G_mm`` already.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import batch as batching
from .. import distributed
from ..curvature import ggn_in_subspace
from ..curvature.jacobians import as_2d
from ..curvature.kfac import is_conv1d
from ..curvature.output_hessian import hessian_factor
from ..data import DataSource
from ..flat import eval_mode


def ekfac_eigenvalues(
    net: nn.Module,
    likelihood,
    x: object,
    factors,
    chosen: list,
    sub,
    chunk_size: int,
) -> torch.Tensor:
    """``s_k = p_kᵀ G p_k`` ``(K,)`` float64 for the directions ``chosen`` (`kfac_eigen`'s
    ``(block, (V_G, U_A), m)`` or ``(block, None, m)``), ``sub`` their `KroneckerSubspace` (same
    order), at the network's current weights (``sub.shift``)."""
    modules = dict(net.named_modules())
    # per K-FAC block with chosen columns: the coordinates and their factors v (q,), u (p,)
    layers: dict[str, dict] = {}
    slow, exact = [], []
    for k, (b, eig, m) in enumerate(chosen):
        block = factors.blocks[b]
        module = modules.get(block.module)
        fast = eig is not None and (
            (isinstance(module, nn.Conv2d) and module.groups == 1)
            or type(module) is nn.Linear
            or is_conv1d(module)
        )
        if eig is None and factors.fisher == "type-2":
            exact.append((k, block.diagonal[m]))  # K-FAC's diagonal blocks are exact: G_mm
            continue
        if not fast:
            slow.append(k)
            continue
        vg, ua = eig
        p = ua.shape[0]
        entry = layers.setdefault(block.module, {"module": module, "weight": [], "bias": []})
        kind = "bias" if block.A is None else "weight"
        entry[kind].append((k, vg[:, m // p], ua[:, m % p], block.augmented))
    values = torch.zeros(len(chosen), dtype=torch.float64, device=sub.shift.device)
    failed = _hooked_pass(net, likelihood, x, layers, values, chunk_size)
    values = distributed.all_reduce_sum(values)
    for k, value in exact:  # already summed over the ranks by the K-FAC pass
        values[k] = value
    for name in failed:
        slow += [k for kind in ("weight", "bias") for k, *_ in layers[name][kind]]
    if slow:  # forward-mode products: any network, any parameter
        part = _restricted(sub, slow)
        quotients = ggn_in_subspace(net, likelihood, x, part, chunk_size, w=sub.shift)
        values[torch.tensor(slow, device=values.device)] = quotients.diagonal().double()
    return values


def _restricted(sub, coordinates: list[int]):
    """The subspace of ``sub``'s columns ``coordinates`` (in that order)."""
    from .kronecker import KroneckerSubspace

    basis_blocks, cols = [], []
    stored = sub.columns.tolist()
    for i0, q, p, start, v, u, c0, r in sub._factors():
        keep = [j for j in range(r) if stored[c0 + j] in coordinates]
        if not keep:
            continue
        if start is not None:
            index = torch.arange(start, start + q * p, device=sub.shift.device)
        else:
            index = sub.index[i0 : i0 + q * p]
        basis_blocks.append((index, v[:, keep], u[:, keep]))
        cols += [coordinates.index(stored[c0 + j]) for j in keep]
    return KroneckerSubspace(sub.shift, basis_blocks, columns=torch.tensor(cols))


def _hooked_pass(net, likelihood, x, layers: dict, values: torch.Tensor, chunk_size: int) -> set:
    """Add ``Σ_n Σ_c (vᵀ G_{n,c} u)²`` of every fast direction to ``values``; return the names
    of the layers whose calls do not give one row per data point (their sums are dropped)."""
    failed: set[str] = set()
    if not layers:
        return failed
    device = values.device
    seen: dict[str, list] = {name: [] for name in layers}

    def hook(name):
        def keep(module, inp, out):
            z = out if out.requires_grad else out.detach().requires_grad_(True)
            seen[name].append((inp[0].detach(), z))
            return z.clone()  # later in-place ops (ReLU(inplace=True)) must not rebase z

        return keep

    handles = [entry["module"].register_forward_hook(hook(name)) for name, entry in layers.items()]
    try:
        with eval_mode(net), torch.enable_grad():
            for xs in DataSource(x, None, chunk_size).inputs():
                for xc in batching.split(batching.to_device(xs, device), chunk_size):
                    for calls in seen.values():
                        calls.clear()
                    out2 = as_2d(batching.call(net, xc))
                    n = batching.rows(xc)
                    live = {}
                    for name, entry in layers.items():
                        if name in failed:
                            continue
                        calls = seen[name]
                        if len(calls) != 1 or calls[0][0].shape[0] != n or calls[0][1].shape[0] != n:
                            failed.add(name)  # rows that are not the data points
                            continue
                        live[name] = _projected_inputs(entry, calls[0][0])
                    if not live:
                        continue
                    factor = hessian_factor(likelihood, out2.detach()).to(out2)
                    zs = [seen[name][0][1] for name in live]
                    cols = factor.shape[-1]
                    for c in range(cols):
                        grads = torch.autograd.grad(
                            (out2 * factor[:, :, c]).sum(), zs, retain_graph=c + 1 < cols,
                            allow_unused=True,
                        )  # fmt: skip
                        for (name, pa), g in zip(live.items(), grads):
                            if g is not None:
                                _add_squares(layers[name], pa, g.detach(), values)
    finally:
        for h in handles:
            h.remove()
        for calls in seen.values():
            calls.clear()
    for name in failed:
        for kind in ("weight", "bias"):
            for k, *_ in layers[name][kind]:
                values[k] = 0.0
    return failed


def _projected_inputs(entry: dict, a: torch.Tensor) -> torch.Tensor | None:
    """``a_{n,s}ᵀ u_k`` for the layer's weight directions: ``(n, ..., r)`` for a Linear (rows
    ``(n, ..., in)``), ``(n, r, H', W')`` for a Conv2d (its patches, by a convolution with the
    ``u_k`` as kernels); ``None`` without weight directions."""
    if not entry["weight"]:
        return None
    m = entry["module"]
    u = torch.stack([uk for _, _, uk, _ in entry["weight"]], 1).to(a)  # shape: (p, r)
    augmented = entry["weight"][0][3]
    if isinstance(m, nn.Conv2d):
        p = u.shape[0] - int(augmented)
        kernel = u[:p].T.reshape(u.shape[1], m.in_channels, *m.kernel_size)
        pa = m._conv_forward(a, kernel, None)  # every padding mode, as the layer pads
        if augmented:  # the ones column of the patches
            pa = pa + u[p][None, :, None, None]
        return pa
    if augmented:
        a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1)
    return a @ u


def _add_squares(entry: dict, pa, g: torch.Tensor, values: torch.Tensor) -> None:
    """``values[k] += Σ_n (vᵀ G_{n,c} u)²`` for one back-propagated column ``g`` at the layer's
    outputs (``(n, ..., out)``, or ``(n, out, H', W')`` for a Conv2d)."""
    conv = isinstance(entry["module"], nn.Conv2d)
    if entry["weight"]:
        v = torch.stack([vk for _, vk, _, _ in entry["weight"]], 1).to(g)  # shape: (q, r)
        if conv:
            proj = torch.einsum("nohw,or->nrhw", g, v) * pa
            dots = proj.sum((2, 3))
        else:
            proj = (g @ v) * pa  # shape: (n, ..., r)
            dots = proj.reshape(proj.shape[0], -1, proj.shape[-1]).sum(1)
        ks = torch.tensor([k for k, *_ in entry["weight"]], device=values.device)
        values.index_add_(0, ks, dots.double().square().sum(0))
    if entry["bias"]:
        v = torch.stack([vk for _, vk, _, _ in entry["bias"]], 1).to(g)
        gs = g.sum((2, 3)) if conv else g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)
        ks = torch.tensor([k for k, *_ in entry["bias"]], device=values.device)
        values.index_add_(0, ks, (gs @ v).double().square().sum(0))
