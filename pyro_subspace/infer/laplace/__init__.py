"""Laplace approximations in a subspace: subnetwork, last layer, low-rank, diagonal, any `Subspace`.

- `guide`: `AutoSubspaceLaplace`, the Pyro autoguide (MAP search, curvature, evidence);
- `posteriors`: the `Posterior` contract and its full, diagonal and low-rank-plus-isotropic
  implementations (the covariance of the coordinates);
- `predictive`: the linearised (GLM) predictive, eqs. (11)–(13) of Subnetwork Inference;
- `tuning`: the prior precision by the evidence or a validation grid;
- `front`: `Laplace(...)` (laplace-torch's habits) and the mean-field `DiagonalLaplace`;
- `laplace_torch`: laplace-torch's vocabulary (likelihood names, enum members, backends and
  their keywords) translated for `front`;
- `marglik_training`: the network and its prior trained together by the evidence.
"""

from .front import DiagonalLaplace, Laplace, all_weights
from .guide import AutoSubspaceLaplace
from .marglik_training import marglik_training
from .predictive import linearized_moments, linearized_predictive, linearized_variances, probit
from .posteriors import (
    POSTERIORS,
    DiagonalPosterior,
    FullPosterior,
    LowRankPosterior,
    Posterior,
    PriorPrecision,
    make_posterior,
)
from .tuning import DEFAULT_GRID, check_grid, validation_log_likelihood

__all__ = [
    "DEFAULT_GRID",
    "POSTERIORS",
    "AutoSubspaceLaplace",
    "DiagonalLaplace",
    "DiagonalPosterior",
    "FullPosterior",
    "Laplace",
    "LowRankPosterior",
    "Posterior",
    "PriorPrecision",
    "all_weights",
    "check_grid",
    "linearized_moments",
    "linearized_predictive",
    "linearized_variances",
    "make_posterior",
    "marglik_training",
    "probit",
    "validation_log_likelihood",
]
