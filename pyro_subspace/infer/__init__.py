"""Inference that Pyro lacks: kernels and guides for subspace models."""

from .chains import run_chains
from .ensembles import DeepEnsemble, MixturePredictor, TrainedEnsemble, train_ensemble
from .ess import EllipticalSliceSampler, one_process
from .gess import GeneralizedEllipticalSliceSampler
from .laplace import (
    AutoSubspaceLaplace,
    DiagonalLaplace,
    Laplace,
    linearized_moments,
    marglik_training,
    linearized_variances,
    linearized_predictive,
    probit,
)
from .mixture_laplace import LastLayerLaplace, MixtureOfLaplace
from .mola_bound import far_away_confidence_bound
from .student_t import fit_multivariate_t
from .swag import SWAG, MultiSWAG
from .temperature_scaling import TemperatureScaling

__all__ = [
    "SWAG",
    "AutoSubspaceLaplace",
    "DeepEnsemble",
    "DiagonalLaplace",
    "EllipticalSliceSampler",
    "GeneralizedEllipticalSliceSampler",
    "Laplace",
    "LastLayerLaplace",
    "MixtureOfLaplace",
    "MixturePredictor",
    "MultiSWAG",
    "TemperatureScaling",
    "TrainedEnsemble",
    "far_away_confidence_bound",
    "fit_multivariate_t",
    "linearized_moments",
    "marglik_training",
    "linearized_variances",
    "linearized_predictive",
    "one_process",
    "probit",
    "run_chains",
    "train_ensemble",
]
