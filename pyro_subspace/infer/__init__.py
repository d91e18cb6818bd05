"""Inference that Pyro lacks: kernels and guides for subspace models."""

from .ess import EllipticalSliceSampler
from .laplace import AutoSubspaceLaplace, linearized_moments, linearized_predictive, probit

__all__ = [
    "AutoSubspaceLaplace",
    "EllipticalSliceSampler",
    "linearized_moments",
    "linearized_predictive",
    "probit",
]
