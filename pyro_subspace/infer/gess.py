"""The deprecated name of the generalised elliptical slice configuration.

`GeneralizedEllipticalSliceSampler` is `EllipticalSliceSampler` with a fitted reference and
per-chain random streams (``rng="chains"``); it stays for one release and warns when created.
``GeneralizedEllipticalSliceSampler(model, reference, df, adapt, chains, seed, chunk_size,
max_shrinks)`` draws exactly what ``EllipticalSliceSampler(model, chunk_size,
max_shrinks=max_shrinks, reference=reference, df=df, adapt=adapt, chains=chains, seed=seed,
rng="chains")`` draws.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .ess import EllipticalSliceSampler

__all__ = ["GeneralizedEllipticalSliceSampler"]


class GeneralizedEllipticalSliceSampler(EllipticalSliceSampler):
    """Deprecated: use ``EllipticalSliceSampler(model, reference=..., df=..., chains=...,
    seed=...)``; this alias (default ``reference="warmup"``, always ``rng="chains"``) keeps its
    former signature and random stream for one release and emits a ``DeprecationWarning``."""

    def __init__(
        self,
        model: Any = None,
        reference: Any = "warmup",
        df: float | None = None,
        adapt: bool | None = None,
        chains: int | None = None,
        seed: int | None = None,
        chunk_size: int = 4096,
        max_shrinks: int = 200,
        *,
        prior: Any = None,
        log_likelihood: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        warnings.warn(
            "GeneralizedEllipticalSliceSampler is deprecated and will be removed in the next "
            "release; use EllipticalSliceSampler(model, reference=..., df=..., chains=..., "
            "seed=...) (rng='chains' keeps this kernel's random stream for reference='prior')",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(
            model,
            chunk_size,
            max_shrinks=max_shrinks,
            reference=reference,
            df=df,
            adapt=adapt,
            chains=chains,
            seed=seed,
            rng="chains",
            prior=prior,
            log_likelihood=log_likelihood,
        )
