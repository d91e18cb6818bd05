"""Pyro models built from a ``torch.nn.Module``."""

from .patched_net import PatchedNet
from .subspace_net import SubspaceNet

__all__ = ["PatchedNet", "SubspaceNet"]
