"""SWAG and MultiSWAG: the one SWAG posterior of the package (Maddox et al., 2019; Wilson &
Izmailov, 2020).

SWAG fits a Gaussian to the iterates of constant-learning-rate SGD, collected by a
`SWACollector` (running mean ``θ_SWA``, running second moment, the last ``K`` deviations ``D̂``):

    N(θ_SWA, ½ (Σ_diag + D̂ D̂ᵀ / (K − 1))),    Σ_diag = diag(E[θ²] − θ_SWA²),

and draws from it with Maddox et al.'s sampling identity (§4, "SWAG: low rank plus diagonal
covariance structure")

    θ̃ = θ_SWA + (1/√2) Σ_diag^{1/2} z₁ + (1/√(2(K − 1))) D̂ z₂,    z₁ ~ N(0, I_D), z₂ ~ N(0, I_K).

Scale convention: ``scale = s`` multiplies that covariance, and ``s = 1`` (the default) *is*
the paper's ``½ (Σ_diag + D̂D̂ᵀ/(K − 1))``. Maddox et al.'s reference code (``swa_gaussian``,
``SWAG.sample``) instead draws ``θ_SWA + √s (Σ_diag^{1/2} z₁ + D̂ z₂/√(K − 1))`` and reaches the
paper's covariance with ``s = 0.5``: its ``s`` is twice ours. Mixing the two, the paper's ``1/√2``
together with the code's ``s = 0.5``, gives half the paper's covariance; the removed
``SWACollector.sample`` did exactly that by default, which is why it and `SWAG` differed by a
factor 2. SWAG-diagonal (``low_rank=False``) is the paper's ``N(θ_SWA, s·Σ_diag)``.

``K`` here is the number of deviation rows the collector holds (``min(n, max_snapshots)``; the
reference code divides by ``max_num_models − 1`` even before that many were collected), and for
a frequent-directions collector ``D̂ D̂ᵀ/(K − 1)`` is its sketch estimate ``BᵀB/(n − 1)`` of all
``n`` deviations (`SWACollector.covariance_factor`).

The predictive is the Monte Carlo average over draws (MoLA eq. 4); MultiSWAG is the uniform
mixture of the SWAG predictives of ``K`` independently trained networks. BatchNorm statistics
are not recomputed for each draw (the network is evaluated in eval mode with its stored
buffers); use networks without BatchNorm, or refresh the statistics yourself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .. import batch as batching
from ..validation import check_int, positive_float, positive_int
from ..flat import eval_mode
from ..likelihoods import Likelihood
from ..subspaces import SWACollector
from .ensembles import (
    MixturePredictor,
    _check_likelihoods,
    check_inputs,
    member_predictives,
    output_width,
)

__all__ = ["SWAG", "MultiSWAG"]


def _check_positive_int(value: object, name: str) -> int:
    return positive_int(value, name)


def _check_seed(value: object, name: str = "seed") -> int | None:
    return check_int(value, name, 0, allow_none=True)


class SWAG(MixturePredictor, nn.Module):
    """The SWAG posterior of one network and its Monte Carlo predictive.

    Args:
        collector: a `SWACollector`; its network (``collector.flat.net``) supplies the
            architecture. Sampling needs at least 2 collected snapshots; an empty collector is
            accepted so that a fitted SWAG can be restored with `load_state_dict`.
        likelihood: the `Likelihood`.
        scale: ``s``, multiplies the SWAG covariance; ``1`` is the paper's
            ``½ (Σ_diag + D̂D̂ᵀ/(K − 1))`` (module docstring: the reference code's ``0.5``).
        low_rank: diagonal plus low-rank covariance (SWAG); ``False``: SWAG-diagonal ``s·Σ_diag``.
        num_samples: default number of weight draws ``S`` per prediction.
        seed: default seed of the draws: an int gives the same draws every call; ``None`` draws
            from torch's global generator (``torch.manual_seed``), which is advanced, never
            re-seeded.

    Components: ``S`` draws with weights ``1/S``. Memory of a prediction: ``S·D`` weights plus
    ``S`` forward passes (`FlatNet` with a batch of weight vectors).

    Persistence: an ``nn.Module`` whose state is the collector's statistics (``collector.*``),
    the network's parameters and buffers (``net.*``: BatchNorm statistics enter every
    prediction) and the likelihood's (``likelihood.*``). ``SWAG(SWACollector(new_net, M), lik)``
    followed by ``load_state_dict`` (also from ``torch.load(path, weights_only=True)``) gives the
    same draws for the same seed. ``scale``, ``low_rank``, ``num_samples`` and ``seed`` are
    constructor arguments, not state.

    Example:
        >>> x, y = torch.randn(60, 3), torch.randint(0, 2, (60,))
        >>> net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> col = SWACollector(net)
        >>> lik = likelihoods.Categorical()
        >>> _ = fit_map(net, lik, x, y, epochs=0, collector=col, swa_epochs=5, swa_lr=1e-2,
        ...             progress=False)
        >>> probs = SWAG(col, lik).predict(x[:4]).probs
    """

    def __init__(
        self,
        collector: SWACollector,
        likelihood: Likelihood,
        scale: float = 1.0,
        low_rank: bool = True,
        num_samples: int = 30,
        seed: int | None = 0,
    ) -> None:
        if not isinstance(collector, SWACollector):
            raise TypeError(f"collector: expected a SWACollector, got {type(collector).__name__}")
        positive_float(scale, "scale")
        likelihood = _check_likelihoods(likelihood, 1)[0]
        super().__init__()
        self.collector = collector
        self.net = collector.flat.net
        self.likelihood = likelihood
        self.scale = float(scale)
        self.low_rank = bool(low_rank)
        self.num_samples = _check_positive_int(num_samples, "num_samples")
        self.seed = _check_seed(seed)
        self._out_width = output_width([self.net], "collector")

    def sample_weights(
        self, num_samples: int | None = None, seed: int | None = None
    ) -> torch.Tensor:
        """Flat weight draws from the SWAG Gaussian (module docstring), shape ``(S, D)``.

        ``θ̃ = θ_SWA + √s ((1/√2) Σ_diag^{1/2} z₁ + (1/√(2(K − 1))) D̂ z₂)``; ``low_rank=False``:
        ``θ_SWA + √s Σ_diag^{1/2} z₁``. The normals are drawn on the CPU (the same draws on every
        device) from a generator seeded with ``seed`` (default: the constructor's), or from
        torch's global generator when both are ``None``.
        """
        s = self.num_samples
        if num_samples is not None:
            s = _check_positive_int(num_samples, "num_samples")
        seed = self.seed if seed is None else _check_seed(seed)
        col = self.collector
        if col.n_collected < 2:
            raise ValueError(
                f"collector: sampling needs at least 2 snapshots, {col.n_collected} collected; "
                "call collect() during training or load_state_dict() a fitted SWAG"
            )
        gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
        mean = col.mean  # shape: (D,)
        z1 = torch.randn(s, mean.numel(), generator=gen, dtype=mean.dtype).to(mean.device)
        draw = col.variance.sqrt() * z1  # Σ_diag^{1/2} z₁, shape: (S, D)
        if self.low_rank:
            factor = col.covariance_factor()  # D̂ᵀ/√(K − 1) as rows, shape: (K, D)
            z2 = torch.randn(s, factor.shape[0], generator=gen, dtype=mean.dtype).to(mean.device)
            draw = (draw + z2 @ factor) / math.sqrt(2)
        return mean + math.sqrt(self.scale) * draw

    def outputs(
        self, x: torch.Tensor, num_samples: int | None = None, seed: int | None = None
    ) -> torch.Tensor:
        """Network outputs at ``S`` weight draws, shape ``(S, N, O)``."""
        check_inputs(x, nets=[self.collector.flat.net])
        w = self.sample_weights(num_samples, seed)
        flat = self.collector.flat
        with torch.no_grad(), eval_mode(flat.net):
            out = flat(w.to(batching.device_of(x)), x)
        return out.unsqueeze(-1) if out.dim() == 2 else out

    def components(self, x: torch.Tensor, num_samples: int | None = None, seed: int | None = None):
        """Weights ``1/S`` ``(S,)`` and the predictive of each draw (`MixturePredictor`)."""
        out = self.outputs(x, num_samples, seed)
        comp = member_predictives([self.likelihood], [out])
        s = out.shape[0]
        return torch.full((s,), 1.0 / s, dtype=torch.float64, device=batching.device_of(x)), comp


class MultiSWAG(MixturePredictor, nn.Module):
    """MultiSWAG: the uniform mixture of ``K`` SWAG posteriors, one per trained network.

    Args:
        collectors: ``K`` `SWACollector` s (e.g. `TrainedEnsemble.collectors`).
        likelihood: one `Likelihood` or a list of ``K``.
        scale, low_rank, num_samples, seed: as in `SWAG`; ``num_samples`` draws *per member*
            (member ``k`` uses ``seed + k``; with ``seed=None`` every member draws from the
            global generator).

    Components: ``K·S`` draws with weights ``1/(K·S)``. Persistence: the members are an
    ``nn.ModuleList`` of `SWAG` (state keys ``members.k.*``).
    """

    def __init__(
        self,
        collectors: Sequence[SWACollector],
        likelihood: Likelihood | Sequence[Likelihood],
        scale: float = 1.0,
        low_rank: bool = True,
        num_samples: int = 30,
        seed: int | None = 0,
    ) -> None:
        if (
            isinstance(collectors, nn.Module)
            or not isinstance(collectors, Sequence)
            or len(collectors) == 0
        ):
            raise TypeError(
                f"collectors: expected a non-empty list of SWACollector, got {collectors!r}"
            )
        liks = _check_likelihoods(likelihood, len(collectors))
        seed = _check_seed(seed)
        members = [
            SWAG(c, lik, scale, low_rank, num_samples, None if seed is None else seed + k)
            for k, (c, lik) in enumerate(zip(collectors, liks))
        ]
        out_width = output_width([m.net for m in members], "collectors")  # one output space
        super().__init__()
        self.members = nn.ModuleList(members)
        self.likelihood = liks[0]
        self._out_width = out_width

    def components(self, x: torch.Tensor, num_samples: int | None = None, seed: int | None = None):
        """Weights ``1/(K·S)`` and the predictive of every draw of every member."""
        if num_samples is not None:  # named before the first member's forward pass
            _check_positive_int(num_samples, "num_samples")
        seed = _check_seed(seed)  # (member k's seed is seed + k)
        outs, liks = [], []
        for k, member in enumerate(self.members):
            outs.append(member.outputs(x, num_samples, None if seed is None else seed + k))
            liks.append(member.likelihood)
        comp = member_predictives(liks, outs, "collectors")
        m = sum(o.shape[0] for o in outs)
        return torch.full((m,), 1.0 / m, dtype=torch.float64, device=batching.device_of(x)), comp
