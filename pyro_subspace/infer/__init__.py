"""Inference that Pyro lacks: kernels and guides for subspace models."""

from .ess import EllipticalSliceSampler

__all__ = ["EllipticalSliceSampler"]
