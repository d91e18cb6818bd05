"""Pyro models built from a ``torch.nn.Module``."""

from .subspace_net import SubspaceNet

__all__ = ["SubspaceNet"]
