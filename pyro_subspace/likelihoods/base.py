"""The likelihood contract: network outputs to a distribution over targets, and its math.

A `Likelihood` owns everything that depends on the observation model (GPyTorch's likelihoods are
the model: the method lives on the likelihood, callers never dispatch on its class):

- the log-density and the tempered Pyro observation (`log_prob`, `observe`);
- the output Hessian ``H_n = −∂² log p(y|f)/∂f²`` and a factor ``L_n L_nᵀ = H_n``
  (`output_hessian`, `hessian_factor`): the inner matrix of the GGN, Subnetwork Inference eq. (9);
- the predictive from Gaussian output moments ``f ~ N(m, C)`` (`predictive_from_moments`:
  closed form, probit or Monte Carlo) and from output samples (`predictive_from_samples`), each a
  ``torch.distributions`` object, and the log density of targets under it (`predictive_log_prob`).

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
from pyro import poutine
from pyro import sample as pyro_sample
from pyro.distributions import Distribution
from pyro.nn import PyroModule

from ..validation import check_finite, check_labels, positive_float

#: Ways of turning Gaussian outputs into a predictive (`Likelihood.predictive_from_moments`).
LINK_APPROXES = ("auto", "closed_form", "probit", "mc", "bridge", "bridge_norm")


def check_temperature(temperature: float, name: str = "temperature") -> float:
    """Return ``temperature`` as a float after checking it is finite and positive."""
    return positive_float(temperature, name)


def check_likelihood(likelihood: object, name: str = "likelihood") -> Likelihood:
    """Return ``likelihood`` after checking it implements the `Likelihood` contract."""
    if not isinstance(likelihood, Likelihood):
        hint = _STRING_LIKELIHOODS.get(likelihood) if isinstance(likelihood, str) else None
        raise TypeError(
            f"{name}: expected a pyro_subspace Likelihood (Gaussian, Categorical, Bernoulli or "
            f"your own subclass), got {type(likelihood).__name__}"
            + (f"; for laplace-torch's {likelihood!r} pass {hint}" if hint else "")
        )
    return likelihood


#: laplace-torch's likelihood strings and the objects that replace them here
_STRING_LIKELIHOODS = {
    "regression": "likelihoods.Gaussian(sigma=sigma_noise) (or Gaussian() to learn σ)",
    "classification": "likelihoods.Categorical() (two classes: Bernoulli() for one logit)",
}


class Likelihood(PyroModule):
    """Base class. Subclasses define `distribution`, `check_outputs`, `prepare_target`,
    `_hessian_diagonal` or `_hessian`, `_predictive` and `predictive_log_prob`.

    Contract tests: ``tests/contracts/likelihood.py::BaseLikelihoodTestCase``, run by every
    implementation in ``tests/test_contract_likelihoods.py``, checks them against autograd
    Hessians, closed forms and brute-force Monte Carlo.
    """

    #: number of network outputs per point this likelihood needs, or ``None`` for any.
    num_outputs: int | None = None
    #: True for regression (a Gaussian predictive), False for classification.
    is_regression: bool = False
    #: True when the likelihood has one noise scale ``σ`` that the Laplace evidence can re-tune
    #: (``log p(D|t) = −(N·O/2) log 2πσ² − RSS/2σ²``; then it has ``loc_scale`` and ``sigma``).
    noise_scale_tunable: bool = False
    #: the `link_approx` values this likelihood accepts besides ``"auto"``, first = the default.
    link_approxes: tuple[str, ...] = ("probit", "mc")

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
        if y.is_floating_point():
            check_finite(y, "y")  # names the first bad row
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
        return self.log_prob_prepared(outputs, self.validate(outputs, y))

    def log_prob_prepared(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`log_prob` for targets that `validate` has already returned for outputs of this
        shape (the evaluator validates each chunk's targets once): no checks, same numbers."""
        return self.distribution(outputs).log_prob(y)

    def training_loss(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The minibatch loss ``−mean_n log p(y_n | f_n)`` for prepared targets (`validate`),
        as `fit_map` minimises it: the same objective as `log_prob_prepared`, by the fastest
        kernel there is for it."""
        return -self.log_prob_prepared(outputs, y).mean()

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

    # ------------------------------------------------------------------ curvature

    def check_curvature_outputs(self, outputs: object) -> torch.Tensor:
        """Validate finite float outputs ``(N, O)`` for the curvature methods; return them detached."""
        if not isinstance(outputs, torch.Tensor) or not outputs.is_floating_point():
            raise TypeError(f"outputs: expected a floating-point tensor (N, O), got {outputs!r}")
        if outputs.dim() != 2:
            raise ValueError(f"outputs: expected shape (N, O), got {tuple(outputs.shape)}")
        if not torch.isfinite(outputs).all():
            raise ValueError("outputs: contains NaN or inf")
        self.check_outputs(outputs)
        return outputs.detach()

    def _hessian_diagonal(self, out: torch.Tensor) -> torch.Tensor:
        """The diagonal ``(N, O)`` of a diagonal ``H_n``; likelihoods with a full ``H_n`` override
        `_hessian` and `_hessian_factor` instead."""
        raise NotImplementedError

    def _hessian(self, out: torch.Tensor) -> torch.Tensor:
        return torch.diag_embed(self._hessian_diagonal(out))

    def _hessian_factor(self, out: torch.Tensor) -> torch.Tensor:
        return torch.diag_embed(self._hessian_diagonal(out).sqrt())

    def output_hessian(self, outputs: torch.Tensor) -> torch.Tensor:
        """``H_n = −∂² log p(y | f) / ∂f²`` at the outputs ``f_n`` (the GGN's inner matrix,
        Subnetwork Inference eq. 9); independent of ``y`` for every likelihood here.

        Args:
            outputs: network outputs ``(N, O)``.

        Returns:
            ``(N, O, O)``, detached, positive semi-definite.
        """
        return self._hessian(self.check_curvature_outputs(outputs))

    def output_hessian_sum(self, outputs: torch.Tensor) -> torch.Tensor:
        """``Σ_n H_n`` ``(O, O)`` float64 over the rows of ``outputs`` ``(N, O)``: the K-FAC
        factor ``G`` of a layer whose output is the network's (``J_z = I``). By default from
        `hessian_factor` in row blocks (``O²`` numbers per row at most); a likelihood with a
        closed form overrides it (`Categorical`: ``diag(Σ p) − PᵀP``, no ``N × C × C``)."""
        outputs = self.check_curvature_outputs(outputs)
        o = outputs.shape[-1]
        total = torch.zeros(o, o, dtype=torch.float64, device=outputs.device)
        for block in outputs.split(max(1, 2**22 // (o * o))):
            factor = self._hessian_factor(block).double()
            total += torch.einsum("nor,npr->op", factor, factor)
        return total

    def hessian_factor(self, outputs: torch.Tensor) -> torch.Tensor:
        """``L_n`` ``(N, O, R)`` with ``L_n L_nᵀ = H_n`` (``R = O``, or the rank of ``H_n`` where
        it is known to be lower: ``O − 1`` for `Categorical`), so ``Σ_n (L_nᵀ J_n)ᵀ (L_nᵀ J_n)`` is
        positive semi-definite by construction."""
        return self._hessian_factor(self.check_curvature_outputs(outputs))

    # ------------------------------------------------------------------ predictives

    def check_link_approx(self, link_approx: str) -> str:
        """Resolve ``"auto"`` and raise ``ValueError`` for a method this likelihood lacks."""
        if link_approx not in LINK_APPROXES:
            raise ValueError(f"link_approx: expected one of {LINK_APPROXES}, got {link_approx!r}")
        if link_approx == "auto":
            return self.link_approxes[0]
        if link_approx not in self.link_approxes:
            raise ValueError(
                f"link_approx: {type(self).__name__} supports {self.link_approxes}, "
                f"got {link_approx!r}"
            )
        return link_approx

    def predictive_from_moments(
        self,
        f_mean: torch.Tensor,
        f_cov: torch.Tensor,
        link_approx: str = "auto",
        num_samples: int = 1000,
        generator: torch.Generator | None = None,
        include_noise: bool = True,
    ) -> Distribution:
        """The predictive ``∫ p(y | f) N(f | m, C) df`` of Gaussian outputs (GLM predictive,
        Subnetwork Inference eqs. 11–13; MoLA eq. 6 for the probit).

        Args:
            f_mean: output means ``m`` ``(N, O)``.
            f_cov: output covariances ``C`` ``(N, O, O)``, or only their variances ``(N, O)``
                for a link approximation that reads nothing else (`diagonal_links`: the
                probit and the Gaussian closed form; a last layer of many classes then never
                holds ``N × C × C`` numbers).
            link_approx: ``"auto"`` or one of `link_approxes`: ``"closed_form"`` (Gaussian),
                ``"probit"`` or ``"mc"`` (classification).
            num_samples: Monte Carlo draws per input (``"mc"``).
            generator: for the Monte Carlo draws (``None``: torch's global generator).
            include_noise: add the observation noise (regression).

        Returns:
            A distribution with batch shape ``(N,)`` (``(N, O)`` for Gaussian regression).
        """
        link_approx = self.check_link_approx(link_approx)
        full = (*f_mean.shape, f_mean.shape[-1]) if f_mean.dim() == 2 else None
        if f_mean.dim() != 2 or tuple(f_cov.shape) not in (full, tuple(f_mean.shape)):
            raise ValueError(
                f"f_mean, f_cov: expected shapes (N, O) and (N, O, O) (or variances (N, O)), "
                f"got {tuple(f_mean.shape)} and {tuple(f_cov.shape)}"
            )
        if f_cov.dim() == 2 and link_approx not in self.diagonal_links:
            raise ValueError(
                f"f_cov: variances (N, O) serve only link_approx in {self.diagonal_links}; "
                f"{link_approx!r} needs the covariances (N, O, O)"
            )
        return self._predictive(f_mean, f_cov, link_approx, num_samples, generator, include_noise)

    #: the link approximations that read only the output variances (`predictive_from_moments`)
    diagonal_links: tuple[str, ...] = ("probit", "closed_form")

    def _predictive(self, f_mean, f_cov, link_approx, num_samples, generator, include_noise):
        raise NotImplementedError

    def glm_prediction(
        self,
        f_mean: torch.Tensor,
        f_cov: torch.Tensor,
        link_approx: str = "auto",
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        diagonal_output: bool = False,
    ):
        """What laplace-torch's ``la(x, pred_type="glm")`` returns from the linearised output
        moments ``f_mean`` ``(N, O)``, ``f_cov`` ``(N, O, O)``: here the predictive's class
        probabilities ``(N, C)``; a regression likelihood returns ``(f_mean, f_cov)`` (its
        diagonal ``(N, O)`` with ``diagonal_output``)."""
        return self.predictive_from_moments(
            f_mean, f_cov, link_approx, num_samples, generator
        ).probs

    def sample_prediction(self, outputs: torch.Tensor):
        """What laplace-torch's ``la(x, pred_type="nn")`` returns from the outputs ``(S, N, O)``
        at ``S`` weight draws: here the mean probabilities ``(N, C)``; a regression likelihood
        returns their mean and variance ``(N, O)`` each."""
        return self.mean(outputs).mean(0)

    def predictive_samples(self, outputs: torch.Tensor) -> torch.Tensor:
        """laplace-torch's ``predictive_samples`` from output draws ``(S, N, O)``: the class
        probabilities of each draw (the draws themselves for regression)."""
        return self.mean(outputs)

    # ------------------------------------------------------------------ the noise evidence

    def residual_statistics(self, outputs: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        """What the Laplace evidence needs to re-tune a noise scale (`noise_scale_tunable`):
        the residual sum of squares and the number of observations of a chunk; ``(0.0, 0)``
        for a likelihood without one."""
        return 0.0, 0

    def log_likelihood_at_noise(
        self, sigma: torch.Tensor, residual_sum_of_squares: float, num_observations: float
    ) -> torch.Tensor:
        """``log p(D | t*)`` at another noise scale ``σ`` from `residual_statistics` (a
        likelihood with one tunable noise scale only)."""
        raise ValueError(
            f"sigma: the {type(self).__name__} likelihood has no noise scale to re-tune (a "
            "homoscedastic Gaussian has)"
        )

    # ------------------------------------------------------------------ mixtures of predictives

    def check_targets(
        self, y: object, n: int, num_outputs: int | None = None, y_name: str = "y",
        x_name: str = "x",
    ) -> torch.Tensor:  # fmt: skip
        """Targets of ``n`` inputs checked before any forward pass (mixtures, ensembles): here
        one integer class label per row in ``[0, C)`` (`validation.check_labels`; ``C`` =
        ``num_outputs`` when the networks' structure tells it), as int64."""
        why = f" for members with {num_outputs} outputs" if num_outputs is not None else ""
        return check_labels(y, y_name, num_outputs, n, x_name=x_name, why=why)

    def component(self, predictive: Distribution):
        """One component of a mixture predictive, in the form `mixture` takes: the class
        probabilities of ``predictive`` (a regression likelihood: its mean and variance)."""
        return predictive.probs

    def stack_components(self, comps: list, concat: bool = False):
        """`component` values stacked along a new leading dimension (``concat``: joined along
        their leading dimension), ``(M, N, ...)``."""
        return torch.cat(comps) if concat else torch.stack(comps)

    def mixture(self, weights: torch.Tensor, comp) -> Distribution:
        """``Σ_m π_m p_m(y | x)`` as a ``torch.distributions`` object: the class probabilities
        averaged with ``weights`` ``(M,)`` (deep ensembles, MoLA eq. 7), clamped to ``[0, 1]``
        (float64 rounding of a saturated softmax can exceed 1 by ~1e-15)."""
        probs = torch.einsum("m,m...->...", weights.to(comp), comp).clamp(0.0, 1.0)
        return self._probs_distribution(probs)

    def _probs_distribution(self, probs: torch.Tensor) -> Distribution:
        raise NotImplementedError

    def predicted_class(self, predictive: Distribution) -> torch.Tensor:
        """The most probable class of each point ``(N,)`` (the first on ties)."""
        return predictive.probs.argmax(-1)

    def mixture_log_prob(self, weights: torch.Tensor, comp, y: torch.Tensor, y_name: str = "y"):
        """``log Σ_m π_m p_m(y_n | x_n)`` ``(N,)`` for targets checked by the caller: the log of
        the mixture probability of each label, clamped at ``1e-12``."""
        raise NotImplementedError

    def mixture_confidence(self, weights: torch.Tensor, comp) -> torch.Tensor | None:
        """The mixture's confidence in its predicted class per point ``(N,)`` (MMC is its mean);
        ``None`` for regression."""
        return self.mixture(weights, comp).probs.max(-1).values

    def predictive_from_samples(self, outputs: torch.Tensor) -> Distribution:
        """The predictive of each draw of the outputs ``(..., N, O)``: batch shape ``(..., N)``
        (``(..., N, O)`` for Gaussian regression), float64. Mixtures over the draws are formed
        by the callers (deep ensembles, SWAG, MoLA's sampling predictive)."""
        out = outputs.detach()
        out = out.unsqueeze(-1) if out.dim() == 1 else out
        self.check_outputs(out)
        return self._predictive_from_samples(out)

    def _predictive_from_samples(self, out: torch.Tensor) -> Distribution:
        raise NotImplementedError

    def predictive_log_prob(self, predictive: Distribution, y: torch.Tensor) -> torch.Tensor:
        """Log density of the targets ``y`` ``(N,)`` under a predictive of this likelihood,
        per point ``(N,)`` (summed over the outputs of one point; probabilities clamped at
        ``1e-12``)."""
        raise NotImplementedError


def output_variances(f_cov: torch.Tensor) -> torch.Tensor:
    """The variances ``(N, O)`` of output covariances ``(N, O, O)`` (or of variances ``(N, O)``
    themselves, `Likelihood.predictive_from_moments`)."""
    return f_cov if f_cov.dim() == 2 else f_cov.diagonal(dim1=-2, dim2=-1)
