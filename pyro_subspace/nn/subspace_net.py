"""`SubspaceNet`: a Pyro model whose random variables are the subspace coordinates ``t``.

Subspace Inference (Izmailov et al., 2019), eqs. (1)–(3):

    t ~ N(0, prior_scale² I_K)                          site "t" (prior_mean="shift"), or
    t ~ N(t₀, (λ PᵀP)⁻¹), t₀ = −(PᵀP)⁻¹Pᵀŵ              (prior_mean="zero": w ~ N(0, λ⁻¹ I_D)
                                                         restricted to the subspace, λ = 1/σ²)
    w = ŵ + P t                                         (Subspace.weights)
    f_n = net(x_n; w)                                   site "f" (deterministic; when y is None)
    y_n ~ p(y | f_n),  log-likelihood scaled by 1/T     site "obs" in plate "data"

so that the posterior over ``t`` is the tempered posterior ``p(D|t)^{1/T} p(t)`` of eq. (3).
"""

from __future__ import annotations

import warnings

import pyro
import torch
from pyro.distributions import MultivariateNormal, Normal
from pyro.nn import PyroModule
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .. import batch as batching
from .. import validation
from ..data import DataSource, all_finite, as_tensors
from ..flat import FlatNet, eval_mode, per_coordinate, writable_buffers_
from ..likelihoods import Likelihood, check_temperature
from ..subspaces import Subspace
from .evaluator import Evaluator

PRIOR_MEANS = ("shift", "zero")


def release_stale_params(root: PyroModule) -> list[str]:
    """Drop the param-store entries that carry ``root``'s parameter names (e.g.
    ``"likelihood.sigma"``) but another value: another model's, left by an earlier run in
    this session. Inside ``MCMC``, ``SVI`` or ``Predictive`` Pyro would load that value into
    ``root`` (the store wins), so a likelihood ``fit_map`` just trained would be silently
    replaced. Warns naming them; returns the names dropped."""
    store, stale, names = pyro.get_param_store(), [], []
    for prefix, module in root.named_modules():
        for name in getattr(module, "_pyro_params", {}) if isinstance(module, PyroModule) else ():
            full = f"{prefix}.{name}" if prefix else name  # Pyro's name under a root named ""
            if full not in store:
                continue
            mine, theirs = getattr(module, name).detach(), store[full].detach()
            if theirs.shape != mine.shape or not torch.equal(theirs.to(mine), mine):
                stale.append(f"{full!r} = {_short(theirs)} (this model: {_short(mine)})")
                names.append(full)
                del store[full]
    if stale:
        warnings.warn(
            f"{type(root).__name__}: Pyro's param store held {', '.join(stale)} from another "
            "model; dropped, so this model uses its own values (pyro.clear_param_store() "
            "between unrelated models avoids this)",
            UserWarning,
            stacklevel=3,
        )
    return names


def _short(value: torch.Tensor) -> str:
    return f"{float(value):.4g}" if value.numel() == 1 else f"a {tuple(value.shape)} tensor"


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
        prior_mean: ``"shift"`` (the prior above, centred at the shift ``ŵ``) or ``"zero"``: the
            weight prior ``w ~ N(0, σ² I_D)`` of Subnetwork Inference and MoLA (weight decay),
            restricted to the subspace: ``t ~ N(t₀, σ² (PᵀP)⁻¹)`` with ``t₀ = −(PᵀP)⁻¹Pᵀŵ``
            (for a subnetwork ``t₀ = −ŵ_S``); needs a scalar ``prior_scale``. MCMC, SVI and the
            Laplace guides all target the posterior under this one prior.
        temperature: ``T`` of the tempered likelihood (eq. 3), a positive float, or ``"auto"``
            for ``T = N/K`` (paper 2.4), ``N`` being the number of training points.
        subsample_size: default minibatch size of the ``"data"`` plate (``None``: all data).
            The plate scales the minibatch log-likelihood by ``N/B``.

    Call as ``model(x, y=None, subsample_size=None)`` with ``x`` of shape ``(N, ...)`` and
    ``y`` of shape ``(N,)`` (``(N, 1)`` accepted), or ``(N, O)`` for multi-output regression.
    Sites: ``"t"`` (shape ``(K,)``), ``"f"`` (network outputs ``(N, O)``; recorded only for
    prediction, i.e. when ``y`` is None, so that conditioned traces have one observed site and
    ``az.from_pyro(mcmc)`` exports only ``"obs"`` as a log-likelihood), ``"obs"`` (``(N,)``).
    ``az.from_pyro`` exports the untempered ``log p(y_n | t)``; `convert.to_inference_data`
    exports the tempered one that matches the posterior (see there).
    Works with ``MCMC(NUTS(model))``, ``HMC``, ``SVI`` with any autoguide, and ``Predictive``
    (also ``parallel=True``: leading sample dimensions of ``t`` are vectorised with ``vmap``).

    Example:
        >>> x = torch.linspace(-1, 1, 30).unsqueeze(-1)
        >>> y = torch.sin(3 * x[:, 0])
        >>> net = nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 1))
        >>> model = SubspaceNet(net, subspaces.random(net, 5, seed=0), likelihoods.Gaussian(0.1))
        >>> kernel = infer.EllipticalSliceSampler(model)  # or pyro.infer.NUTS(model)
        >>> mcmc = pyro.infer.MCMC(kernel, num_samples=20, warmup_steps=10, disable_progbar=True)
        >>> mcmc.run(x, y)
        >>> t = mcmc.get_samples()["t"]
        >>> t.shape
        torch.Size([20, 5])
        >>> pyro.infer.Predictive(model, {"t": t})(x)["f"].shape  # outputs at each draw
        torch.Size([20, 30, 1])
    """

    def __init__(
        self,
        net: nn.Module,
        subspace: Subspace,
        likelihood: Likelihood,
        prior_scale: float | torch.Tensor = 1.0,
        temperature: float | str = 1.0,
        subsample_size: int | None = None,
        prior_mean: str = "shift",
    ) -> None:
        super().__init__()
        if prior_mean not in PRIOR_MEANS:
            raise ValueError(f"prior_mean: expected one of {PRIOR_MEANS}, got {prior_mean!r}")
        self.flat = FlatNet(net)
        if not isinstance(subspace, Subspace):
            raise TypeError(f"subspace: expected a Subspace, got {type(subspace).__name__}")
        if subspace.dim != self.flat.num_weights:
            raise ValueError(
                f"subspace: has D={subspace.dim} weights but the network has "
                f"{self.flat.num_weights}; build the subspace from this network"
            )
        net_dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), None)
        if net_dtype is not None and subspace.shift.dtype != net_dtype:
            raise TypeError(
                f"subspace: is {subspace.shift.dtype} but the network is {net_dtype} (converted "
                f"after the subspace was built?): call subspace.to({net_dtype}) or build the "
                "subspace from the converted network"
            )
        if not isinstance(likelihood, Likelihood):
            raise TypeError(
                f"likelihood: expected a pyro_subspace Likelihood, got {type(likelihood).__name__}"
            )
        if not isinstance(prior_scale, torch.Tensor):
            validation.positive_float(prior_scale, "prior_scale")
        elif not prior_scale.is_floating_point():
            raise TypeError(f"prior_scale: expected a float tensor, got dtype {prior_scale.dtype}")
        scale = torch.as_tensor(
            prior_scale, dtype=subspace.shift.dtype, device=subspace.shift.device
        )
        if scale.dim() > 1 or (scale.dim() == 1 and scale.shape[0] != subspace.rank):
            raise ValueError(
                f"prior_scale: expected a float or a ({subspace.rank},) tensor, got shape {tuple(scale.shape)}"
            )
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise ValueError(f"prior_scale: expected positive finite values, got {prior_scale!r}")
        if isinstance(temperature, str) and temperature != "auto":
            raise ValueError(f"temperature: expected a number > 0 or 'auto', got {temperature!r}")
        if temperature != "auto":
            check_temperature(temperature)
        self.temperature = temperature
        self.subsample_size = _check_subsample(subsample_size)
        self.net = net
        self.subspace = subspace
        self.likelihood = likelihood
        if prior_mean == "zero" and scale.dim() == 1 and not bool((scale == scale[0]).all()):
            raise ValueError(
                "prior_scale: prior_mean='zero' needs one scalar scale for all weights"
            )
        self.register_buffer("prior_scale", per_coordinate(scale, subspace.rank))
        # λ in float64, the source of truth for the Laplace guides (exact, whatever the net's dtype)
        lam = torch.as_tensor(prior_scale, dtype=torch.float64, device=scale.device)
        self.register_buffer("_prior_precision", per_coordinate(lam.square().reciprocal(), subspace.rank))
        k = subspace.rank
        #: ``t₀`` ``(K,)`` and ``PᵀP`` ``(K, K)`` float64; an empty ``prior_gram`` stands for
        #: ``I`` (``prior_mean="shift"`` or a subnetwork), never materialised.
        self.register_buffer("prior_loc", per_coordinate(torch.zeros((), dtype=torch.float64, device=scale.device), k))
        self.register_buffer("prior_gram", torch.zeros(0, dtype=torch.float64, device=scale.device))
        self.set_prior(prior_mean)
        release_stale_params(self)

    def set_prior(
        self, prior_mean: str, prior_precision: float | torch.Tensor | None = None
    ) -> None:
        """Set the prior's centre (``"shift"``/``"zero"``) and optionally ``λ``, in place."""
        if prior_mean not in PRIOR_MEANS:
            raise ValueError(f"prior_mean: expected one of {PRIOR_MEANS}, got {prior_mean!r}")
        sub, k = self.subspace, self.rank
        self.prior_mean = prior_mean
        zero = prior_mean == "zero"
        gram = sub.gram() if zero and not sub.gram_is_identity else self.prior_loc.new_zeros(0)
        self.prior_gram = gram
        self.prior_loc = per_coordinate(sub.origin() if zero else self.prior_loc.new_zeros(()), k)
        self._gram_is_identity = gram.numel() == 0
        if prior_precision is not None:
            self.set_prior_precision(prior_precision)
        elif prior_mean == "zero" and not bool((self.prior_scale == self.prior_scale[0]).all()):
            raise ValueError(
                "prior_scale: prior_mean='zero' needs one scalar scale for all weights"
            )

    @property
    def rank(self) -> int:
        """``K``, the number of coordinates."""
        return self.subspace.rank

    def temperature_for(self, n: int) -> float:
        """The temperature used with ``n`` training points (``N/K`` when ``"auto"``)."""
        return n / self.rank if self.temperature == "auto" else float(self.temperature)

    def prior(self) -> pyro.distributions.Distribution:
        """The prior over ``t``, event shape ``(K,)``: ``N(0, σ² I_K)`` or, with
        ``prior_mean="zero"``, ``N(t₀, σ² (PᵀP)⁻¹)``."""
        dtype = self.prior_scale.dtype
        loc = self.prior_loc.to(dtype)
        if self._gram_is_identity:
            return Normal(loc, self.prior_scale).to_event(1)
        precision = self.prior_gram.to(dtype) / self.prior_scale[0].square()
        return MultivariateNormal(loc, precision_matrix=precision)

    def prior_gram_matrix(self) -> torch.Tensor:
        """``PᵀP`` ``(K, K)`` of the prior (``I`` unless ``prior_mean="zero"`` on a dense basis)."""
        if self._gram_is_identity:
            return torch.eye(self.rank, dtype=torch.float64, device=self.prior_loc.device)
        return self.prior_gram

    def prior_gram_diagonal(self) -> torch.Tensor:
        """The diagonal ``(K,)`` of `prior_gram_matrix`, without forming it."""
        if self._gram_is_identity:
            return torch.ones(self.rank, dtype=torch.float64, device=self.prior_loc.device)
        return self.prior_gram.diagonal()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        gram = state_dict.get(prefix + "prior_gram")
        if gram is not None and gram.shape != self.prior_gram.shape:
            self.prior_gram = torch.empty_like(gram)
        writable_buffers_(self, ("prior_scale", "_prior_precision", "prior_loc"))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._gram_is_identity = self.prior_gram.numel() == 0

    @property
    def prior_precision(self) -> torch.Tensor:
        """``λ = 1/σ²``, ``(K,)`` float64 (the prior precision matrix is ``λ PᵀP``)."""
        return self._prior_precision

    def set_prior_precision(self, prior_precision: float | torch.Tensor) -> None:
        """Set ``λ`` (a positive float or ``(K,)``; scalar with ``prior_mean="zero"``) in place:
        every method using this model then targets the posterior under the new prior."""
        lam = validation.prior_precision(prior_precision, self.rank)
        uniform = lam.dim() == 0 or bool((lam == lam[0]).all())
        if self.prior_mean == "zero" and not self._gram_is_identity and not uniform:
            raise ValueError(
                "prior_precision: prior_mean='zero' on a dense basis needs one scalar λ (the "
                "prior's precision is λ PᵀP); per-weight λ needs an index subspace"
            )
        lam = lam.to(self._prior_precision)  # one number held when λ is (`per_coordinate`)
        self._prior_precision = per_coordinate(lam, self.rank)
        self.prior_scale = per_coordinate(lam.rsqrt().to(self.prior_scale), self.rank)

    def latent_model(self) -> torch.Tensor:
        """The model's latent sites alone (``"t"`` from `prior`), without data: the prototype
        that guides read their sites from."""
        return pyro.sample("t", self.prior())

    def evaluator(
        self,
        x: object,
        y: torch.Tensor | None = None,
        chunk_size: int = 4096,
        recompute_bn: bool = False,
    ) -> Evaluator:
        """The full-data `Evaluator` over ``(x, y)`` tensors, a ``Dataset`` or a ``DataLoader``."""
        self.check_data(x, y)
        return Evaluator(self, DataSource(x, y, chunk_size), recompute_bn=recompute_bn)

    def log_likelihood_fn(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        subsample_size: int | None = None,
        *,
        chunk_size: int = 4096,
        recompute_bn: bool = False,
    ):
        """For a likelihood-only kernel (elliptical slice): given this model's call arguments,
        ``(fn, restore)`` with ``fn({"t": t}) -> log p(D | t)/T`` over the whole data set in
        chunks (``subsample_size`` ignored) and ``restore()`` putting back BatchNorm buffers."""
        if isinstance(x, (Dataset, DataLoader)):  # streamed (x, y) pairs
            ev = self.evaluator(x, y, chunk_size, recompute_bn)
            return (lambda params: ev.log_likelihood(params["t"])), ev.restore
        self.check_data(x, y)
        if y is None:  # no observations: the posterior is the prior
            return (lambda params: 0.0), (lambda: None)
        ev = self.evaluator(x, y, chunk_size, recompute_bn)
        return (lambda params: ev.log_likelihood(params["t"])), ev.restore

    def check_data(
        self, x: object, y: object = None, x_name: str = "x", y_name: str = "y"
    ) -> int:
        """Check inputs ``(N, ...)`` and targets against the network, the subspace's dtype and
        the likelihood before any evaluation (`validation.check_data`; messages name
        ``x_name``/``y_name``, the caller's arguments); return ``N``."""
        return validation.check_data(
            self.flat.net, x, y, self.likelihood, dtype=self.subspace.shift.dtype,
            x_name=x_name, y_name=y_name,
        )  # fmt: skip

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
        if self.flat.mode_free:  # nothing to switch (and the switch costs a small net dearly)
            out = self.flat(w, x)
        else:
            with eval_mode(self.flat.net):
                out = self.flat(w, x)
        return out.unsqueeze(-1) if out.dim() == w.dim() else out

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size: int | None = None
    ) -> torch.Tensor:
        """Run the model: sample ``t``, evaluate the network at ``w = ŵ + P t``, observe ``y``.

        Args:
            x: inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)`` (read into
                memory in its order on every call: a trace observes all rows; the elliptical
                slice kernels and the Laplace guides stream it instead).
            y: targets ``(N,)`` (``(N, 1)`` accepted; ``(N, O)`` for multi-output regression),
                or ``None`` to predict: ``"obs"`` is then sampled from ``p(y | f)``.
            subsample_size: minibatch size ``B`` of the ``"data"`` plate for this call
                (default: the constructor's; ``None``: all ``N`` points). The minibatch
                log-likelihood is scaled by ``N/B`` and by ``1/T`` (eq. 3).

        Returns:
            The ``"obs"`` value: ``y`` (subsampled like the plate) when given, else a draw
            ``(N,)`` (``(B,)`` with subsampling; leading sample dims under vectorised plates).

        Sites: ``"t"`` ``(K,)``; ``"f"`` (deterministic outputs ``(N, O)``, only when ``y`` is
        ``None``); ``"obs"`` in plate ``"data"``.
        """
        n = self.check_data(x, y)
        x, y = as_tensors(x, y)  # a Dataset / DataLoader: the trace observes every row
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
            xb = x if size is None else batching.take(x, idx)
            yb = y if y is None or size is None else y[idx]
            out = self.outputs(t, xb)
            if yb is not None:
                yb = self.likelihood.validate(out, yb)
            else:
                self.likelihood.check_outputs(out)
            if yb is None:  # a prediction: record the outputs (not an observation, see above)
                pyro.deterministic("f", out, event_dim=1)
            return self.likelihood.observe(out, yb, temperature)


def _check_inputs(x: torch.Tensor) -> int:
    if batching.is_mapping(x):
        return validation.check_inputs(None, x, "x")  # each entry: rows, NaN
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"x: expected a torch.Tensor or a mapping of tensors, got {type(x).__name__}"
        )
    if x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"x: expected shape (N, ...) with N >= 1, got {tuple(x.shape)}")
    if not all_finite(x):  # in blocks: memory bounded, not a copy of x
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
    return validation.positive_int(size, "subsample_size", allow_none=True)
