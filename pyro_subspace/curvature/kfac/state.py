"""The network's state a curvature pass reads, checked finite before it runs: its weights (or
the flat ``w`` given instead of the trainable ones), its frozen parameters and its buffers. A
NaN there would otherwise surface after a forward pass as non-finite ``outputs``."""

from __future__ import annotations

import torch
from torch import nn

from ... import validation as ck


def check_finite_state(net: nn.Module, w: torch.Tensor | None = None, w_name: str = "w") -> None:
    """A ``ValueError`` naming the first non-finite weight unless the state ``net`` computes
    with is finite: ``w`` (flat weights ``(D,)`` used instead of the trainable parameters,
    named ``w_name``) or else every parameter; the parameters ``w`` does not replace (frozen
    ones); the floating-point buffers (no NaN; a normalisation layer's running statistics also
    no inf; an inf elsewhere may be a mask's ``-inf``).

    ``validation.all_finite`` (a few reductions over the weights laid end to end) checks; the
    offending entry is located only when one is not finite."""
    fix = "the network diverged or was loaded from a broken state: give it finite weights"
    if w is not None:
        ck.check_finite(w, w_name, fix)
    params = [(n, p) for n, p in net.named_parameters() if w is None or not p.requires_grad]
    if not ck.all_finite(*(p for _, p in params)):
        for name, p in params:
            index = ck.first_nonfinite(p.detach())
            if index is not None:
                value = p.detach()[index].item() if index else p.item()
                raise ValueError(
                    f"net: its weights contain NaN or inf (parameter {name!r}, entry "
                    f"{tuple(index)}: {value}); {fix}"
                )
    stats = {
        id(b)
        for m in net.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
        for b in (m.running_mean, m.running_var)
        if b is not None
    }
    for name, b in net.named_buffers():
        if not b.is_floating_point():
            continue
        bad = b.isnan() if id(b) not in stats else ~torch.isfinite(b)
        if bool(bad.any()):
            raise ValueError(
                f"net: buffer {name!r} contains {'NaN' if bool(b.isnan().any()) else 'inf'}; "
                "recompute it (BatchNorm statistics: a train-mode pass over the data) or "
                "restore a finite state"
            )
