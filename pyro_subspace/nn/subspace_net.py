"""`SubspaceNet`: a Pyro model whose random variables are the subspace coordinates ``t``.

Subspace Inference (Izmailov et al., 2019), eqs. (1)–(3):

    t ~ N(0, prior_scale² I_K)                          site "t"
    w = ŵ + P t                                         (Subspace.weights)
    f_n = net(x_n; w)                                   site "f" (deterministic)
    y_n ~ p(y | f_n),  log-likelihood scaled by 1/T     site "obs" in plate "data"

so that the posterior over ``t`` is the tempered posterior ``p(D|t)^{1/T} p(t)`` of eq. (3).
"""

from __future__ import annotations

import pyro
import torch
from pyro.distributions import Normal
from pyro.nn import PyroModule
from torch import nn

from ..flat import FlatNet, eval_mode
from ..likelihoods import Likelihood, check_temperature
from ..subspaces import Subspace


class SubspaceNet(PyroModule):
    """A network ``net`` restricted to the subspace ``w = ŵ + P t``, as a Pyro model.

    Args:
        net: a ``torch.nn.Module`` (outputs ``(N, O)`` for inputs ``(N, ...)``). Its own
            parameters are never read or changed by the model; it is evaluated functionally at
            ``subspace.weights(t)`` in eval mode (BatchNorm uses its running statistics;
            the user's train/eval flags are restored afterwards).
        subspace: a `Subspace` with ``D`` equal to the number of weights of ``net``.
        likelihood: a `Likelihood` (`Gaussian`, `Categorical`, `Bernoulli`).
        prior_scale: ``σ`` of the prior ``t ~ N(0, σ² I_K)``; a positive float or a ``(K,)``
            tensor of per-coordinate scales. PCA subspaces use 1 (paper C.2).
        temperature: ``T`` of the tempered likelihood (eq. 3), a positive float, or ``"auto"``
            for ``T = N/K`` (paper 2.4), ``N`` being the number of training points.
        subsample_size: default minibatch size of the ``"data"`` plate (``None``: all data).
            The plate scales the minibatch log-likelihood by ``N/B``.

    Call as ``model(x, y=None, subsample_size=None)`` with ``x`` of shape ``(N, ...)`` and
    ``y`` of shape ``(N,)`` (``(N, 1)`` accepted), or ``(N, O)`` for multi-output regression.
    Sites: ``"t"`` (shape ``(K,)``), ``"f"`` (network outputs ``(N, O)``), ``"obs"`` (``(N,)``).
    Works with ``MCMC(NUTS(model))``, ``HMC``, ``SVI`` with any autoguide, and ``Predictive``
    (also ``parallel=True``: leading sample dimensions of ``t`` are vectorised with ``vmap``).

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 1))
        >>> model = SubspaceNet(net, subspaces.random(net, 5, seed=0), likelihoods.Gaussian(0.1))
        >>> pyro.infer.MCMC(pyro.infer.NUTS(model), num_samples=100).run(x, y)  # doctest: +SKIP
    """

    def __init__(
        self,
        net: nn.Module,
        subspace: Subspace,
        likelihood: Likelihood,
        prior_scale: float | torch.Tensor = 1.0,
        temperature: float | str = 1.0,
        subsample_size: int | None = None,
    ) -> None:
        super().__init__()
        self.flat = FlatNet(net)
        if not isinstance(subspace, Subspace):
            raise TypeError(f"subspace: expected a Subspace, got {type(subspace).__name__}")
        if subspace.dim != self.flat.num_weights:
            raise ValueError(
                f"subspace: has D={subspace.dim} weights but the network has "
                f"{self.flat.num_weights}; build the subspace from this network"
            )
        if not isinstance(likelihood, Likelihood):
            raise TypeError(
                f"likelihood: expected a pyro_subspace Likelihood, got {type(likelihood).__name__}"
            )
        scale = torch.as_tensor(
            prior_scale, dtype=subspace.shift.dtype, device=subspace.shift.device
        )
        if scale.dim() > 1 or (scale.dim() == 1 and scale.shape[0] != subspace.rank):
            raise ValueError(
                f"prior_scale: expected a float or a ({subspace.rank},) tensor, got shape {tuple(scale.shape)}"
            )
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise ValueError(f"prior_scale: expected positive finite values, got {prior_scale!r}")
        if temperature != "auto":
            check_temperature(temperature)
        self.temperature = temperature
        self.subsample_size = _check_subsample(subsample_size)
        self.net = net
        self.subspace = subspace
        self.likelihood = likelihood
        self.register_buffer("prior_scale", scale.expand(subspace.rank).clone())

    @property
    def rank(self) -> int:
        """``K``, the number of coordinates."""
        return self.subspace.rank

    def temperature_for(self, n: int) -> float:
        """The temperature used with ``n`` training points (``N/K`` when ``"auto"``)."""
        return n / self.rank if self.temperature == "auto" else float(self.temperature)

    def prior(self) -> pyro.distributions.Distribution:
        """The prior ``N(0, σ² I_K)`` over ``t``, event shape ``(K,)``."""
        return Normal(torch.zeros_like(self.prior_scale), self.prior_scale).to_event(1)

    def outputs(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Network outputs at ``w = ŵ + P t``.

        Args:
            t: coordinates, shape ``(K,)`` or ``(*batch, K)``.
            x: inputs, shape ``(N, ...)``.

        Returns:
            Shape ``(N, O)`` or ``(*batch, N, O)`` (a 1-D network output gets ``O = 1``).
        """
        w = self.subspace.weights(t)
        # self.flat.net, not self.net: PyroModule turns attribute access to a plain nn.Module
        # into a pyro.module statement, which would register the (unused) weights as params.
        with eval_mode(self.flat.net):
            out = self.flat(w, x)
        return out.unsqueeze(-1) if out.dim() == w.dim() else out

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size: int | None = None
    ) -> torch.Tensor:
        n = check_data(x, y)
        size = _check_subsample(subsample_size) or self.subsample_size
        if size is not None and size > n:
            raise ValueError(f"subsample_size: {size} exceeds the number of data points {n}")
        temperature = self.temperature_for(n)
        t = pyro.sample("t", self.prior())
        if t.dim() > 1 and t.shape[-2] == 1:
            # Vectorised draws (Predictive(parallel=True), vectorised particles) carry a
            # singleton at the data plate's dim -1; the draws live to its left.
            t = t.squeeze(-2)
        with pyro.plate("data", n, subsample_size=size, dim=-1) as idx:
            xb = x if size is None else x[idx]
            yb = y if y is None or size is None else y[idx]
            out = self.outputs(t, xb)
            if yb is not None:
                yb = self.likelihood.validate(out, yb)
            else:
                self.likelihood.check_outputs(out)
            pyro.deterministic("f", out, event_dim=1)
            return self.likelihood.observe(out, yb, temperature)


def _check_inputs(x: torch.Tensor) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"x: expected shape (N, ...) with N >= 1, got {tuple(x.shape)}")
    if x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError("x: contains NaN or inf")
    return x.shape[0]


def check_data(x: torch.Tensor, y: torch.Tensor | None) -> int:
    """Check a model call's inputs ``(N, ...)`` and optional targets (``N`` first); return N."""
    n = _check_inputs(x)
    if y is not None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"y: expected a torch.Tensor or None, got {type(y).__name__}")
        if y.dim() == 0 or y.shape[0] != n:
            raise ValueError(f"y: expected {n} targets to match x, got shape {tuple(y.shape)}")
    return n


def _check_subsample(size: int | None) -> int | None:
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"subsample_size: expected a positive int or None, got {size!r}")
    return size
