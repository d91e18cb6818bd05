"""SWAG and MultiSWAG predictives (Maddox et al., 2019; Wilson & Izmailov, 2020).

SWAG fits a Gaussian to the iterates of constant-learning-rate SGD (a `SWACollector`):

    Σ = ½ (Σ_diag + D̂ D̂ᵀ / (M − 1)),    Σ_diag = diag(E[w²] − w̄²),

with the ``M`` stored deviations ``D̂`` (``D × M``). A draw is
``w = w̄ + √s (Σ_diag^{1/2} z₁ + D̂ z₂ / √(M − 1)) / √2`` with ``z₁ ~ N(0, I_D)``,
``z₂ ~ N(0, I_M)``: the diagonal part is scaled by the *standard deviation* ``Σ_diag^{1/2}``
(`SWACollector.sample`), and ``s`` multiplies the whole covariance (``s = 1`` is the paper's
``Σ``; Maddox et al.'s code folds the ½ into its default ``scale=0.5`` instead). SWAG-diagonal
(``low_rank=False``) uses ``s·Σ_diag``. The predictive is the Monte Carlo average over draws
(MoLA eq. 4); MultiSWAG is the uniform mixture of the SWAG predictives of ``K`` independently
trained networks.

BatchNorm statistics are not recomputed for each draw (the networks are evaluated in eval mode
with their stored buffers); use networks without BatchNorm, or refresh the statistics yourself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..flat import eval_mode
from ..likelihoods import Likelihood
from ..subspaces import SWACollector
from .ensembles import MixturePredictor, _check_likelihoods, check_inputs, member_predictives

__all__ = ["SWAG", "MultiSWAG"]


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


class SWAG(MixturePredictor):
    """The SWAG posterior of one network and its Monte Carlo predictive.

    Args:
        collector: a `SWACollector` with at least 2 snapshots; its network
            (``collector.flat.net``) supplies the architecture.
        likelihood: the `Likelihood`.
        scale: ``s``, multiplies the SWAG covariance (``1``: the paper's ``Σ``).
        low_rank: diagonal plus low-rank covariance (SWAG); ``False``: SWAG-diagonal.
        num_samples: default number of weight draws ``S`` per prediction.
        seed: default seed of the draws (the same draws every call unless changed).

    Components: ``S`` draws with weights ``1/S``. Memory of a prediction: ``S·D`` weights plus
    ``S`` forward passes (`FlatNet` with a batch of weight vectors).
    """

    def __init__(
        self,
        collector: SWACollector,
        likelihood: Likelihood,
        scale: float = 1.0,
        low_rank: bool = True,
        num_samples: int = 30,
        seed: int = 0,
    ) -> None:
        if not isinstance(collector, SWACollector):
            raise TypeError(f"collector: expected a SWACollector, got {type(collector).__name__}")
        if collector.n_collected < 2:
            raise ValueError(
                f"collector: needs at least 2 snapshots, {collector.n_collected} collected"
            )
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"scale: expected a positive number, got {scale!r}")
        self.collector = collector
        self.likelihood = _check_likelihoods(likelihood, 1)[0]
        self.scale = float(scale)
        self.low_rank = bool(low_rank)
        self.num_samples = _check_positive_int(num_samples, "num_samples")
        self.seed = int(seed)

    def sample_weights(self, num_samples: int | None = None, seed: int | None = None):
        """Flat weight draws ``(S, D)`` from the SWAG Gaussian (`SWACollector.sample`)."""
        s = self.num_samples if num_samples is None else _check_positive_int(num_samples, "S")
        return self.collector.sample(
            s, scale=self.scale, low_rank=self.low_rank, seed=self.seed if seed is None else seed
        )

    def outputs(
        self, x: torch.Tensor, num_samples: int | None = None, seed: int | None = None
    ) -> torch.Tensor:
        """Network outputs at ``S`` weight draws, shape ``(S, N, O)``."""
        check_inputs(x)
        w = self.sample_weights(num_samples, seed)
        flat = self.collector.flat
        with torch.no_grad(), eval_mode(flat.net):
            out = flat(w.to(x.device), x)
        return out.unsqueeze(-1) if out.dim() == 2 else out

    def components(self, x: torch.Tensor, num_samples: int | None = None, seed: int | None = None):
        """Weights ``1/S`` ``(S,)`` and the predictive of each draw (`MixturePredictor`)."""
        out = self.outputs(x, num_samples, seed)
        comp = member_predictives([self.likelihood], [out])
        s = out.shape[0]
        return torch.full((s,), 1.0 / s, dtype=torch.float64, device=x.device), comp


class MultiSWAG(MixturePredictor):
    """MultiSWAG: the uniform mixture of ``K`` SWAG posteriors, one per trained network.

    Args:
        collectors: ``K`` `SWACollector` s (e.g. `TrainedEnsemble.collectors`).
        likelihood: one `Likelihood` or a list of ``K``.
        scale, low_rank, num_samples, seed: as in `SWAG`; ``num_samples`` draws *per member*
            (member ``k`` uses ``seed + k``).

    Components: ``K·S`` draws with weights ``1/(K·S)``.
    """

    def __init__(
        self,
        collectors: Sequence[SWACollector],
        likelihood: Likelihood | Sequence[Likelihood],
        scale: float = 1.0,
        low_rank: bool = True,
        num_samples: int = 30,
        seed: int = 0,
    ) -> None:
        if not isinstance(collectors, Sequence) or len(collectors) == 0:
            raise TypeError(
                f"collectors: expected a non-empty list of SWACollector, got {collectors!r}"
            )
        liks = _check_likelihoods(likelihood, len(collectors))
        self.members = [
            SWAG(c, lik, scale, low_rank, num_samples, seed + k)
            for k, (c, lik) in enumerate(zip(collectors, liks))
        ]
        self.likelihood = liks[0]

    def components(self, x: torch.Tensor, num_samples: int | None = None, seed: int | None = None):
        """Weights ``1/(K·S)`` and the predictive of every draw of every member."""
        outs, liks = [], []
        for k, member in enumerate(self.members):
            outs.append(member.outputs(x, num_samples, None if seed is None else seed + k))
            liks.append(member.likelihood)
        comp = member_predictives(liks, outs)
        m = sum(o.shape[0] for o in outs)
        return torch.full((m,), 1.0 / m, dtype=torch.float64, device=x.device), comp
