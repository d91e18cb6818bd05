"""Laplace approximations in a subspace: subnetwork, last layer, low-rank, diagonal, any `Subspace`.

- `guide`: `AutoSubspaceLaplace`, the Pyro autoguide (MAP search, curvature, evidence);
- `structures`: full, diagonal or low-rank-plus-isotropic covariance of the coordinates
  (`lowrank`);
- `predictive`: the linearised (GLM) predictive, eqs. (11)–(13) of Subnetwork Inference;
- `tuning`: the prior precision by the evidence or a validation grid;
- `front`: `Laplace(...)` (laplace-torch's habits) and the mean-field `DiagonalLaplace`.
"""

from .front import DiagonalLaplace, Laplace, all_weights
from .guide import AutoSubspaceLaplace
from .predictive import linearized_moments, linearized_predictive, probit
from .structures import (
    STRUCTURES,
    DiagonalStructure,
    FullStructure,
    LowRankStructure,
    make_structure,
)
from .tuning import DEFAULT_GRID, check_grid, validation_log_likelihood

__all__ = [
    "DEFAULT_GRID",
    "STRUCTURES",
    "AutoSubspaceLaplace",
    "DiagonalLaplace",
    "DiagonalStructure",
    "FullStructure",
    "Laplace",
    "LowRankStructure",
    "all_weights",
    "check_grid",
    "linearized_moments",
    "linearized_predictive",
    "make_structure",
    "probit",
    "validation_log_likelihood",
]
