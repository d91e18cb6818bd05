"""Inference that Pyro lacks: kernels and guides for subspace models."""

from .chains import run_chains
from .ensembles import DeepEnsemble, MixturePredictor, TrainedEnsemble, train_ensemble
from .ess import EllipticalSliceSampler
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
    "linearized_moments",
    "marglik_training",
    "linearized_variances",
    "linearized_predictive",
    "probit",
    "run_chains",
    "train_ensemble",
]
