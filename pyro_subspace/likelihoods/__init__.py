"""Likelihoods: network outputs to a distribution over targets, tempered and minibatch-scaled.

Every likelihood takes network outputs of shape ``(..., N, O)`` (leading dimensions are draws of
the weights) and targets of shape ``(N,)`` (``(N, 1)`` is accepted for single-output nets and
squeezed, never broadcast to ``(N, N)``), or ``(N, O)`` for multi-output Gaussian regression.
`base.Likelihood` is the contract (log-density, tempered observation, output Hessian,
predictives from output moments and samples); one module per likelihood implements it.
"""

from .base import LINK_APPROXES, Likelihood, check_likelihood, check_temperature
from .bernoulli import Bernoulli
from .categorical import Categorical
from .gaussian import Gaussian

__all__ = [
    "LINK_APPROXES",
    "Bernoulli",
    "Categorical",
    "Gaussian",
    "Likelihood",
    "check_likelihood",
    "check_temperature",
]
