"""Pyro models built from a ``torch.nn.Module``."""

from .last_token import LastToken
from .patched_net import PatchedNet
from .subspace_net import SubspaceNet

__all__ = ["LastToken", "PatchedNet", "SubspaceNet"]
