"""Binary classification with a logistic link and one logit per point."""

from __future__ import annotations

import math

import torch
from pyro.distributions import Bernoulli as _Bernoulli
from pyro.distributions import Distribution

from ..validation import check_labels
from ..linalg import gaussian_draws
from .base import Likelihood, output_variances


class Bernoulli(Likelihood):
    """Binary classification: ``y_n ~ Bernoulli(sigmoid(f_n))``; one logit per point."""

    num_outputs = 1

    def prepare_target(self, y: torch.Tensor, n: int) -> torch.Tensor:
        y = super().prepare_target(y, n)
        check_labels(y, "y", 2, why=" (Bernoulli targets must be 0 or 1)")  # the one label check
        return y.to(torch.get_default_dtype()) if not y.is_floating_point() else y

    def distribution(self, outputs: torch.Tensor) -> Distribution:
        return _Bernoulli(logits=outputs.squeeze(-1))

    # ------------------------------------------------------------------ the contract

    def _hessian_diagonal(self, out: torch.Tensor) -> torch.Tensor:
        """``p (1 − p)`` with ``p = sigmoid(f)``."""
        p = out.sigmoid()
        return p * (1 - p)

    def _predictive(self, f_mean, f_cov, link_approx, num_samples, generator, include_noise):
        """``"probit"``: ``sigmoid(m / √(1 + π/8 · C))`` (MacKay 1992); ``"mc"``: the mean of
        ``sigmoid(f)`` over ``num_samples`` draws."""
        if link_approx == "mc":
            draws = gaussian_draws(f_mean, f_cov, num_samples, generator)
            probs = draws.squeeze(-1).sigmoid().mean(0)
        else:
            kappa = (1 + math.pi / 8 * output_variances(f_cov)).rsqrt()
            probs = (f_mean * kappa).squeeze(-1).sigmoid()
        return _Bernoulli(probs=probs)

    def _predictive_from_samples(self, out: torch.Tensor) -> Distribution:
        return _Bernoulli(probs=out.squeeze(-1).double().sigmoid())

    def check_targets(self, y, n, num_outputs=None, y_name="y", x_name="x") -> torch.Tensor:
        why = " (Bernoulli targets must be 0 or 1)"
        return check_labels(y, y_name, 2, n, x_name=x_name, why=why)

    def _probs_distribution(self, probs: torch.Tensor) -> Distribution:
        return _Bernoulli(probs=probs)

    def mixture_log_prob(self, weights, comp, y, y_name="y"):
        probs = torch.einsum("m,m...->...", weights.to(comp), comp)
        y = check_labels(y, y_name, 2, probs.shape[0])
        return torch.where(y.to(probs.device).bool(), probs, 1 - probs).clamp_min(1e-12).log()

    def predicted_class(self, predictive: Distribution) -> torch.Tensor:
        """1 where ``P(y = 1) > 0.5``."""
        return (predictive.probs > 0.5).long()

    def mixture_confidence(self, weights, comp) -> torch.Tensor:
        """``max(p, 1 − p)`` of the mixture's ``P(y = 1)``."""
        p = self.mixture(weights, comp).probs
        return p.maximum(1 - p)

    def predictive_log_prob(self, predictive: Distribution, y: torch.Tensor) -> torch.Tensor:
        probs = predictive.probs.clamp_min(1e-12)
        y = self.prepare_target(y, probs.shape[-1]).to(probs.device)
        return torch.where(y.bool(), probs, 1 - probs).clamp_min(1e-12).log()
