"""Gaussian regression: fixed, learned or heteroscedastic noise."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pyro.distributions import Distribution, Normal, constraints
from pyro.nn import PyroParam

from ..validation import check_finite, choice, positive_float
from .base import Likelihood, output_variances


class Gaussian(Likelihood):
    """Gaussian regression: ``y_n ~ N(f_n, σ²)``, or heteroscedastic ``N(f_n[0], s(x_n)²)``.

    Args:
        sigma: observation noise standard deviation. A positive float (or a tensor of shape
            ``(O,)`` for ``O`` outputs) keeps it fixed; a floating-point tensor keeps its dtype
            (float64 stays float64), a float is stored in torch's default dtype. ``None`` (the
            default) makes it a learned point estimate: a Pyro parameter (``PyroParam``,
            constraint positive, initialised at ``sigma_init``) that `fit_map` and ``SVI``
            optimise (type-II maximum likelihood) and that MCMC holds fixed at its current
            value. Our choice, so that elliptical slice sampling keeps a purely Gaussian prior
            over ``t``.
        heteroscedastic: the network outputs two columns per point, the mean and a raw scale;
            the noise scale is ``softplus(raw) + min_scale``.
        global_variance: with ``heteroscedastic``: Subspace Inference's UCI form (appendix
            G.1.1), the variance ``σ²(x) = s² + softplus(raw)`` with a learned global ``s²``
            (a ``PyroParam``, initialised at ``sigma_init²``; the paper's ``s² = 1``), trained
            like ``σ`` by `fit_map` and ``SVI``; ``min_scale`` is then unused.
            ``sigma`` must then be ``None``.
        sigma_init: initial value of a learned ``sigma``.
        min_scale: floor added to the heteroscedastic scale, for numerical safety.
    """

    is_regression = True
    link_approxes = ("closed_form",)

    def glm_prediction(self, f_mean, f_cov, link_approx="auto", num_samples=100, generator=None,
                       diagonal_output=False):  # fmt: skip
        """laplace-torch's regression output: ``(f_mean (N, O), f_cov (N, O, O))``, the
        function-space moments without ``σ²`` (``f_cov``'s diagonal ``(N, O)`` with
        ``diagonal_output``). ``link_approx``: laplace-torch's default ``"probit"`` (which it
        does not use for regression either), ``"auto"`` or ``"closed_form"``."""
        if link_approx != "probit":
            self.check_link_approx(link_approx)
        return f_mean, f_cov.diagonal(dim1=-2, dim2=-1) if diagonal_output else f_cov

    def sample_prediction(self, outputs: torch.Tensor):
        """laplace-torch's ``pred_type="nn"`` regression output: the mean and variance of the
        outputs over the weight draws, ``(N, O)`` each."""
        return outputs.mean(0), outputs.var(0)

    def predictive_samples(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs

    def residual_statistics(self, outputs, y):
        """``(Σ (y − μ)², N·O)`` of a chunk for a homoscedastic Gaussian (`noise_scale_tunable`),
        ``(0.0, 0)`` otherwise."""
        if not self.noise_scale_tunable:
            return 0.0, 0
        loc = self.loc_scale(outputs)[0]
        return float((loc - y.reshape(loc.shape)).double().square().sum()), loc.numel()

    def log_likelihood_at_noise(self, sigma, residual_sum_of_squares, num_observations):
        """``−(N·O/2) log 2πσ² − RSS/2σ²`` (differentiable in ``σ``)."""
        if not self.noise_scale_tunable:
            return super().log_likelihood_at_noise(sigma, residual_sum_of_squares, num_observations)
        return (
            -num_observations / 2 * torch.log(2 * math.pi * sigma**2)
            - residual_sum_of_squares / (2 * sigma**2)
        )

    def check_targets(self, y, n, num_outputs=None, y_name="y", x_name="x") -> torch.Tensor:
        """A real tensor of finite targets, one (row) per row of the inputs."""
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"{y_name}: expected a torch.Tensor of targets, got {type(y).__name__}")
        if y.is_complex() or y.dtype == torch.bool:
            raise TypeError(f"{y_name}: expected real-valued targets, got dtype {y.dtype}")
        if y.dim() == 0 or y.shape[0] != n:
            raise ValueError(
                f"{y_name}: expected {n} targets, one per row of {x_name}, got shape "
                f"{tuple(y.shape)}"
            )
        check_finite(y, y_name)
        return y

    def component(self, predictive):
        """A regression component: its mean and variance ``(N, O)`` each."""
        return predictive.mean, predictive.variance

    def stack_components(self, comps, concat=False):
        join = torch.cat if concat else torch.stack
        return join([c[0] for c in comps]), join([c[1] for c in comps])

    def mixture(self, weights, comp):
        """The mixture of the components' Gaussians over the ``O`` outputs jointly,
        ``MixtureSameFamily`` with batch ``(N,)`` and event ``(O,)``: ``.mean`` ``Σ π_m μ_m``
        and ``.variance`` ``Σ π_m σ_m² + Σ π_m (μ_m − μ)²`` (the moment match, Subspace
        Inference G.1), ``.log_prob`` the mixture density itself."""
        means, variances = comp
        n = means.shape[1]
        mix = torch.distributions.Categorical(probs=weights.to(means).expand(n, -1))
        members = torch.distributions.Independent(
            torch.distributions.Normal(means.movedim(0, 1), variances.sqrt().movedim(0, 1)), 1
        )
        return torch.distributions.MixtureSameFamily(mix, members)

    def mixture_log_prob(self, weights, comp, y, y_name="y"):
        means, variances = comp
        n, o = means.shape[1:]
        if not isinstance(y, torch.Tensor) or y.numel() != n * o:
            raise ValueError(f"{y_name}: expected {n} targets with {o} output(s)")
        yy = y.reshape(n, o).to(means)
        log_p = torch.distributions.Normal(means, variances.sqrt()).log_prob(yy).sum(-1)
        log_w = weights.to(means).clamp_min(1e-300).log()
        return torch.logsumexp(log_w[:, None] + log_p, dim=0)

    def mixture_confidence(self, weights, comp):
        return None

    def __init__(
        self,
        sigma: float | torch.Tensor | None = None,
        heteroscedastic: bool = False,
        sigma_init: float = 1.0,
        min_scale: float = 1e-3,
        global_variance: bool = False,
    ) -> None:
        super().__init__()
        positive_float(min_scale, "min_scale", allow_zero=True)
        positive_float(sigma_init, "sigma_init")
        choice(heteroscedastic, "heteroscedastic", (True, False))
        choice(global_variance, "global_variance", (True, False))
        if global_variance and not heteroscedastic:
            raise ValueError("global_variance: only with heteroscedastic=True")
        self.heteroscedastic = bool(heteroscedastic)
        self.global_variance = bool(global_variance)
        self.min_scale = float(min_scale)
        self.learn_sigma = sigma is None and not self.heteroscedastic
        if self.heteroscedastic:
            if sigma is not None:
                raise ValueError(
                    "sigma: must be None when heteroscedastic=True (the net outputs the scale)"
                )
            self.num_outputs = 2
            if self.global_variance:
                init = torch.tensor(float(sigma_init) ** 2)
                self.s2 = PyroParam(init, constraint=constraints.positive)
        elif sigma is None:
            if not (isinstance(sigma_init, (int, float)) and sigma_init > 0):
                raise ValueError(f"sigma_init: expected a positive number, got {sigma_init!r}")
            self.sigma = PyroParam(torch.tensor(float(sigma_init)), constraint=constraints.positive)
        else:
            floating = isinstance(sigma, torch.Tensor) and sigma.is_floating_point()
            s = torch.as_tensor(sigma, dtype=None if floating else torch.get_default_dtype())
            s = s.detach().clone()  # a tensor keeps its dtype (float64 stays float64)
            if s.dim() > 1 or not torch.isfinite(s).all() or (s <= 0).any():
                raise ValueError(f"sigma: expected a positive float or (O,) tensor, got {sigma!r}")
            self.register_buffer("sigma", s)

    def validate(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.check_outputs(outputs)
        n, o = outputs.shape[-2], outputs.shape[-1]
        if self.heteroscedastic or o == 1:
            return self.prepare_target(y, n)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (n, o):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"y: expected shape ({n}, {o}) for a net with {o} outputs, got {got}")
        if not y.is_floating_point() or not torch.isfinite(y).all():
            raise ValueError(
                "y: expected finite floating-point targets (NaN, inf or integers found)"
            )
        return y

    def prepare_target(self, y: torch.Tensor, n: int) -> torch.Tensor:
        y = super().prepare_target(y, n)
        if not y.is_floating_point():
            raise TypeError(f"y: Gaussian regression needs floating-point targets, got {y.dtype}")
        return y

    def loc_scale(self, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation of ``y``, each ``(..., N)`` (or ``(..., N, O)``)."""
        if self.global_variance:  # σ²(x) = s² + softplus(raw)
            return outputs[..., 0], (self.s2.to(outputs) + F.softplus(outputs[..., 1])).sqrt()
        if self.heteroscedastic:
            return outputs[..., 0], F.softplus(outputs[..., 1]) + self.min_scale
        loc = outputs.squeeze(-1) if outputs.shape[-1] == 1 else outputs
        return loc, self.sigma.to(loc).expand(loc.shape)

    def log_prob_prepared(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.heteroscedastic or outputs.shape[-1] != 1:  # through the distribution
            return super().log_prob_prepared(outputs, y)
        loc, scale = self.loc_scale(outputs)
        # Normal(loc, scale).log_prob(y) term by term as torch writes it (the same numbers),
        # without building and checking a distribution at every likelihood evaluation
        return -((y - loc) ** 2) / (2 * scale**2) - scale.log() - math.log(math.sqrt(2 * math.pi))

    def distribution(self, outputs: torch.Tensor) -> Distribution:
        loc, scale = self.loc_scale(outputs)
        dist = Normal(loc, scale)
        return dist.to_event(1) if loc.dim() == outputs.dim() else dist

    def variance(self, outputs: torch.Tensor) -> torch.Tensor:
        """Observation-noise variance ``σ²`` per point, shape like `loc_scale`'s outputs."""
        return self.loc_scale(outputs)[1].square()

    # ------------------------------------------------------------------ the contract

    @property
    def noise_scale_tunable(self) -> bool:  # type: ignore[override]
        """Homoscedastic with one scalar ``σ``."""
        return not self.heteroscedastic and self.sigma.numel() == 1

    def check_curvature_outputs(self, outputs: object) -> torch.Tensor:
        out = super().check_curvature_outputs(outputs)
        if self.learn_sigma or self.heteroscedastic:
            return out
        if self.sigma.numel() not in (1, out.shape[1]):
            raise ValueError(
                f"outputs: {out.shape[1]} columns, but the likelihood's sigma has "
                f"{self.sigma.numel()} entries"
            )
        return out

    def _hessian_diagonal(self, out: torch.Tensor) -> torch.Tensor:
        """Homoscedastic: ``1/σ²`` (``σ`` fixed, per output, or a learned ``PyroParam`` at its
        current value). Heteroscedastic (columns mean ``μ`` and raw scale ``r``,
        ``s = softplus(r) + min_scale``): the true Hessian in ``r`` depends on ``y`` and can be
        negative, so we use the Fisher ``E_y[∇ log p ∇ log pᵀ]``, positive semi-definite. With
        ``z = (y − μ)/s ~ N(0, 1)`` the score is ``(z/s, (z² − 1) s'/s)``, ``s' = sigmoid(r)``;
        ``E[z²] = 1``, ``E[z³] = 0``, ``E[(z² − 1)²] = 2`` give ``diag(1/s², 2 s'²/s²)``. With
        ``global_variance`` (``v = s² + softplus(r)``) the score in ``r`` is
        ``(z² − 1) v'/(2v)``, ``v' = sigmoid(r)``: ``diag(1/v, v'²/(2v²))``."""
        scale = self.loc_scale(out)[1].detach()
        if not self.heteroscedastic:
            return scale.reshape(out.shape).square().reciprocal()
        ds = out[:, 1].sigmoid()  # d softplus(raw) / d raw
        var = scale.square()
        raw = ds.square() / (2 * var.square()) if self.global_variance else 2 * ds.square() / var
        return torch.stack([var.reciprocal(), raw], -1)

    def _predictive(self, f_mean, f_cov, link_approx, num_samples, generator, include_noise):
        """``N(m, C_oo + σ²)`` per output (closed form); a heteroscedastic net's mean column with
        its predicted ``s(x)²`` at the mean outputs."""
        var_f = output_variances(f_cov)
        with torch.no_grad():
            noise = self.variance(f_mean).detach().to(var_f)
        if self.heteroscedastic:
            mean, var = f_mean[:, :1], var_f[:, :1]
            noise = noise[:, None]
        else:
            mean, var = f_mean, var_f
            noise = noise.reshape(mean.shape)
        return Normal(mean, (var + noise if include_noise else var).sqrt())

    def _predictive_from_samples(self, out: torch.Tensor) -> Distribution:
        with torch.no_grad():
            loc, scale = self.loc_scale(out)
        if loc.dim() == out.dim() - 1:
            loc, scale = loc.unsqueeze(-1), scale.unsqueeze(-1)
        return Normal(loc.double(), scale.double())

    def predictive_log_prob(self, predictive: Distribution, y: torch.Tensor) -> torch.Tensor:
        mean = predictive.mean
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
        n, o = mean.shape[-2:]
        if y.numel() != n * o or y.shape[0] != n:
            raise ValueError(f"y: expected {n} targets with {o} output(s), got {tuple(y.shape)}")
        yy = y.reshape(n, o).to(mean)
        lp = predictive.log_prob(yy)
        return lp if len(predictive.event_shape) == 1 else lp.sum(-1)  # per point, (N,)
