"""Likelihoods: network outputs to a distribution over targets, tempered and minibatch-scaled.

Every likelihood takes network outputs of shape ``(..., N, O)`` (leading dimensions are draws of
the weights) and targets of shape ``(N,)`` (``(N, 1)`` is accepted for single-output nets and
squeezed, never broadcast to ``(N, N)``), or ``(N, O)`` for multi-output Gaussian regression.

- `log_prob(outputs, y)` is the per-point log-likelihood ``log p(y_n | f_n)``, shape ``(..., N)``;
  a user's own training loop can use ``-log_prob(...).mean()`` as its loss.
- `observe(outputs, y, temperature)` is the Pyro statement ``pyro.sample("obs", ...)`` used inside
  a ``pyro.plate("data", N, subsample_size=B)``: the plate scales the log-likelihood by ``N/B``
  and ``poutine.scale`` by ``1/T``, the tempered posterior ``p(D|t)^{1/T} p(t)`` of Subspace
  Inference eq. (3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pyro import poutine
from pyro import sample as pyro_sample
from pyro.distributions import Bernoulli as _Bernoulli
from pyro.distributions import Categorical as _Categorical
from pyro.distributions import Distribution, Normal, constraints
from pyro.nn import PyroModule, PyroParam


def check_temperature(temperature: float, name: str = "temperature") -> float:
    """Return ``temperature`` as a float after checking it is finite and positive."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{name}: expected a positive number, got {temperature!r}")
    if not (0 < temperature < float("inf")):
        raise ValueError(f"{name}: expected a finite positive number, got {temperature!r}")
    return float(temperature)


class Likelihood(PyroModule):
    """Base class. Subclasses define `distribution`, `check_outputs` and `prepare_target`."""

    #: number of network outputs per point this likelihood needs, or ``None`` for any.
    num_outputs: int | None = None

    def distribution(self, outputs: torch.Tensor) -> Distribution:
        """The observation distribution with batch shape ``(..., N)`` given outputs ``(..., N, O)``."""
        raise NotImplementedError

    def check_outputs(self, outputs: torch.Tensor) -> None:
        """Raise ``ValueError`` if the network's outputs do not fit this likelihood."""
        if outputs.dim() < 2:
            raise ValueError(
                f"outputs: expected network outputs of shape (..., N, O), got {tuple(outputs.shape)}"
            )
        if self.num_outputs is not None and outputs.shape[-1] != self.num_outputs:
            raise ValueError(
                f"outputs: {type(self).__name__} needs {self.num_outputs} network output(s) per "
                f"point, the network gives {outputs.shape[-1]}"
            )

    def prepare_target(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """Validate targets for ``n`` points and return them in the shape `log_prob` expects."""
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
        if y.dim() == 0 or y.shape[0] != n:
            raise ValueError(
                f"y: expected {n} targets (first dimension), got shape {tuple(y.shape)}"
            )
        if y.is_floating_point() and not torch.isfinite(y).all():
            raise ValueError("y: contains NaN or inf")
        if y.dim() == 2 and y.shape[1] == 1:
            y = y.squeeze(-1)
        if y.dim() != 1:
            raise ValueError(f"y: expected shape ({n},) or ({n}, 1), got {tuple(y.shape)}")
        return y

    def log_prob(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-point log-likelihood ``log p(y_n | f_n)``.

        Args:
            outputs: network outputs, shape ``(..., N, O)``.
            y: targets, shape ``(N,)`` (or ``(N, 1)``; ``(N, O)`` for multi-output regression).

        Returns:
            Shape ``(..., N)``: untempered, unscaled.
        """
        y = self.validate(outputs, y)
        return self.distribution(outputs).log_prob(y)

    def validate(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Check ``outputs`` ``(..., N, O)`` and targets together; return the prepared targets."""
        self.check_outputs(outputs)
        return self.prepare_target(y, outputs.shape[-2])

    def observe(
        self,
        outputs: torch.Tensor,
        y: torch.Tensor | None = None,
        temperature: float = 1.0,
        name: str = "obs",
    ) -> torch.Tensor:
        """``pyro.sample(name, p(y | f), obs=y)`` scaled by ``1/temperature``; call inside a plate.

        ``y`` must already be prepared (`prepare_target`) and subsampled like ``outputs``.
        """
        dist = self.distribution(outputs)
        with poutine.scale(scale=1.0 / temperature):
            return pyro_sample(name, dist, obs=y)

    def mean(self, outputs: torch.Tensor) -> torch.Tensor:
        """Predictive mean of ``y`` given outputs: regression mean or class probabilities."""
        return self.distribution(outputs).mean


class Gaussian(Likelihood):
    """Gaussian regression: ``y_n ~ N(f_n, σ²)``, or heteroscedastic ``N(f_n[0], s(x_n)²)``.

    Args:
        sigma: observation noise standard deviation. A positive float (or a tensor of shape
            ``(O,)`` for ``O`` outputs) keeps it fixed. ``None`` (the default) makes it a learned
            point estimate: a Pyro parameter (``PyroParam``, constraint positive, initialised at
            ``sigma_init``) that `fit_map` and ``SVI`` optimise (type-II maximum likelihood) and
            that MCMC holds fixed at its current value. Our choice, so that elliptical slice
            sampling keeps a purely Gaussian prior over ``t``.
        heteroscedastic: the network outputs two columns per point, the mean and a raw scale;
            the noise scale is ``softplus(raw) + min_scale`` (the paper's UCI nets, appendix G.1).
            ``sigma`` must then be ``None``.
        sigma_init: initial value of a learned ``sigma``.
        min_scale: floor added to the heteroscedastic scale, for numerical safety.
    """

    def __init__(
        self,
        sigma: float | torch.Tensor | None = None,
        heteroscedastic: bool = False,
        sigma_init: float = 1.0,
        min_scale: float = 1e-3,
    ) -> None:
        super().__init__()
        self.heteroscedastic = bool(heteroscedastic)
        self.min_scale = float(min_scale)
        self.learn_sigma = sigma is None and not self.heteroscedastic
        if self.heteroscedastic:
            if sigma is not None:
                raise ValueError(
                    "sigma: must be None when heteroscedastic=True (the net outputs the scale)"
                )
            self.num_outputs = 2
        elif sigma is None:
            if not (isinstance(sigma_init, (int, float)) and sigma_init > 0):
                raise ValueError(f"sigma_init: expected a positive number, got {sigma_init!r}")
            self.sigma = PyroParam(torch.tensor(float(sigma_init)), constraint=constraints.positive)
        else:
            s = torch.as_tensor(sigma, dtype=torch.get_default_dtype())
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
        if self.heteroscedastic:
            return outputs[..., 0], F.softplus(outputs[..., 1]) + self.min_scale
        loc = outputs.squeeze(-1) if outputs.shape[-1] == 1 else outputs
        return loc, self.sigma.to(loc).expand(loc.shape)

    def distribution(self, outputs: torch.Tensor) -> Distribution:
        loc, scale = self.loc_scale(outputs)
        dist = Normal(loc, scale)
        return dist.to_event(1) if loc.dim() == outputs.dim() else dist

    def variance(self, outputs: torch.Tensor) -> torch.Tensor:
        """Observation-noise variance ``σ²`` per point, shape like `loc_scale`'s outputs."""
        return self.loc_scale(outputs)[1].square()


class Categorical(Likelihood):
    """Classification: ``y_n ~ Categorical(softmax(f_n))``; outputs are ``C >= 2`` logits."""

    def check_outputs(self, outputs: torch.Tensor) -> None:
        super().check_outputs(outputs)
        if outputs.shape[-1] < 2:
            raise ValueError(
                f"outputs: Categorical needs >= 2 logits per point, got {outputs.shape[-1]}"
            )

    def prepare_target(self, y: torch.Tensor, n: int) -> torch.Tensor:
        y = super().prepare_target(y, n)
        if y.is_floating_point():
            if (y != y.round()).any():
                raise ValueError("y: class labels must be integers")
            y = y.long()
        if (y < 0).any():
            raise ValueError("y: class labels must be non-negative")
        return y

    def distribution(self, outputs: torch.Tensor) -> Distribution:
        return _Categorical(logits=outputs)

    def validate(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y = super().validate(outputs, y)
        if (y >= outputs.shape[-1]).any():
            raise ValueError(f"y: labels must lie in [0, {outputs.shape[-1]}) for this network")
        return y

    def mean(self, outputs: torch.Tensor) -> torch.Tensor:
        """Class probabilities, shape ``(..., N, C)``."""
        return outputs.softmax(-1)


class Bernoulli(Likelihood):
    """Binary classification: ``y_n ~ Bernoulli(sigmoid(f_n))``; one logit per point."""

    num_outputs = 1

    def prepare_target(self, y: torch.Tensor, n: int) -> torch.Tensor:
        y = super().prepare_target(y, n)
        if ((y != 0) & (y != 1)).any():
            raise ValueError("y: Bernoulli targets must be 0 or 1")
        return y.to(torch.get_default_dtype()) if not y.is_floating_point() else y

    def distribution(self, outputs: torch.Tensor) -> Distribution:
        return _Bernoulli(logits=outputs.squeeze(-1))
