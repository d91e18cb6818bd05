"""pyro_subspace: Bayesian deep learning in a small, well-chosen part of weight space, with Pyro.

A network's weights are written ``w = ŵ + P t``; Pyro's own inference (NUTS, HMC, SVI,
Predictive) runs over the few coordinates ``t`` while the rest stays at a point estimate.
"""

from . import (
    batch,
    convert,
    datasets,
    diagnostics,
    distributed,
    infer,
    likelihoods,
    metrics,
    subspaces,
)
from .exceptions import (
    ConvergenceWarning,
    SubsamplingError,
    TrainingDivergedError,
    UnsupportedModelError,
)
from .flat import FlatNet
from .infer import EllipticalSliceSampler
from .nn import PatchedNet, SubspaceNet
from .threads import num_threads, set_num_threads
from .train import fit_map

__version__ = "0.1.0"

__all__ = [
    "ConvergenceWarning",
    "EllipticalSliceSampler",
    "FlatNet",
    "PatchedNet",
    "SubsamplingError",
    "SubspaceNet",
    "TrainingDivergedError",
    "UnsupportedModelError",
    "batch",
    "convert",
    "datasets",
    "diagnostics",
    "distributed",
    "fit_map",
    "infer",
    "likelihoods",
    "metrics",
    "num_threads",
    "set_num_threads",
    "subspaces",
]
