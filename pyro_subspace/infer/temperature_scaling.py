"""Temperature scaling (Guo et al., 2017): post-hoc calibration of a trained classifier.

One scalar ``T > 0`` divides the logits ``z = f(x)`` of a trained network,

    p_T(y = c | x) = softmax(z / T)_c,                                          (Guo et al. §4.2)

and is fitted on held-out data as the minimiser of the validation negative log-likelihood

    T* = argmin_T NLL_val(T),   NLL_val(T) = (1/N) Σ_n [logsumexp(z_n / T) − z_{n, y_n} / T].

The network's weights, its predicted classes and hence its accuracy are unchanged; only the
confidence moves (``T > 1`` softens an overconfident network). It is the cheapest post-hoc
baseline of the calibration literature, and the "SWA-Temp" rows of Subspace Inference's
Tables 8–9 are this rule applied to an SWA solution.

The minimisation is exact and deterministic: with ``β = 1/T`` the objective is convex,
``NLL'(β) = (1/N) Σ_n (E_{p_n}[z_n] − z_{n, y_n})``,
``NLL''(β) = (1/N) Σ_n Var_{p_n}[z_n] ≥ 0`` (``p_n = softmax(β z_n)``), so its minimiser on
``[1/T_max, 1/T_min]`` is the root of a monotone function, found by Newton's method safeguarded
by a geometric bisection bracket, on float64 logits computed once. Binary classification
(`Bernoulli`, one logit ``z``) is the same problem on the two logits ``(0, z)``:
``sigmoid(z / T)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from .. import validation
from ..data import DataSource, as_tensors
from ..exceptions import ConvergenceWarning
from ..flat import eval_mode
from ..likelihoods import Bernoulli, Categorical, Likelihood, check_likelihood
from .ensembles import MixturePredictor, check_inputs, member_predictives, output_width

__all__ = ["TemperatureScaling"]

#: the default search interval of ``T``
BOUNDS = (1e-3, 1e3)
#: Newton/bisection steps at most; each halves the bracket in log β at worst, so 200 steps
#: reach float64 resolution from any bracket of positive floats
MAX_STEPS = 200


class TemperatureScaling(MixturePredictor, nn.Module):
    """A trained classifier with its logits divided by one fitted temperature ``T`` (Guo et al.).

    ``predict(x)`` is ``Categorical(softmax(z / T))`` with ``z = net(x)`` ``(N, C)``
    (`Bernoulli`: ``P(y = 1) = sigmoid(z / T)``, ``z`` ``(N, 1)``); ``T`` is fitted by `fit` on
    validation data as ``T* = argmin_T NLL_val(T)`` (module docstring). Shares the interface of
    the package's predictors (`MixturePredictor`): one component of weight 1.

    Args:
        net: the trained network (its weights are not changed; it is evaluated in eval mode).
        likelihood: `Categorical` (default) or `Bernoulli`; temperature scaling is for
            classification, so a regression likelihood is a ``ValueError``.
        chunk_size: rows per forward pass.

    Attributes:
        temperature: ``T`` as a 0-d float64 buffer; NaN until `fit` (or `load_state_dict`).
        nll_before, nll_after: the validation NLL at ``T = 1`` and at ``T*`` (after `fit`).

    Persistence: an ``nn.Module`` whose state is ``temperature``, the network's parameters and
    buffers (``net.*``) and the likelihood's; ``TemperatureScaling(new_net).load_state_dict(sd)``
    (also from ``torch.load(path, weights_only=True)``) restores a fitted one.

    Example:
        >>> x, y = torch.randn(80, 3), torch.randint(0, 3, (80,))
        >>> net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 3))
        >>> _ = fit_map(net, Categorical(), x[:60], y[:60], epochs=20, progress=False)
        >>> ts = TemperatureScaling(net).fit(x[60:], y[60:])      # T* on held-out data
        >>> probs = ts.predict(x[:4]).probs                      # softmax(net(x) / T*), (4, 3)
        >>> bool(ts.nll_after <= ts.nll_before)
        True
    """

    def __init__(
        self, net: nn.Module, likelihood: Likelihood | None = None, chunk_size: int = 4096
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        likelihood = Categorical() if likelihood is None else check_likelihood(likelihood)
        if not isinstance(likelihood, (Categorical, Bernoulli)):  # outputs that are logits
            raise ValueError(
                f"likelihood: temperature scaling calibrates classifiers (Categorical or "
                f"Bernoulli), got {type(likelihood).__name__}"
            )
        validation.positive_int(chunk_size, "chunk_size")
        out_width = output_width([net], "net")
        super().__init__()
        self.net = net
        self.likelihood = likelihood
        self.chunk_size = chunk_size
        self._out_width = out_width
        spec = validation.net_spec(net)
        device = spec.device if spec.device is not None else torch.device("cpu")
        self.register_buffer(
            "temperature", torch.tensor(math.nan, dtype=torch.float64, device=device)
        )
        self.nll_before: float | None = None
        self.nll_after: float | None = None

    # ------------------------------------------------------------------ fitting

    def fit(
        self,
        x_val: torch.Tensor | TorchDataset | DataLoader,
        y_val: torch.Tensor | None = None,
        bounds: Sequence[float] = BOUNDS,
    ) -> TemperatureScaling:
        """Fit ``T`` by minimising the validation NLL; returns ``self``.

        Args:
            x_val: validation inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)``
                pairs (read once), never the training data the network was fitted to.
            y_val: labels ``(N,)`` in ``[0, C)`` (omitted with a Dataset or DataLoader).
            bounds: ``(T_min, T_max)``, ``0 < T_min < T_max``: the interval searched. When the
                NLL keeps decreasing up to a bound (e.g. every validation point classified
                correctly, where ``T → 0`` is optimal) ``T`` is set to that bound with a
                `ConvergenceWarning`.

        The logits are computed once in float64, the 1-D problem is solved to float64
        resolution (module docstring), and only then is ``temperature`` written: a failure
        leaves the object as it was.
        """
        t_min, t_max = _check_bounds(bounds)
        if isinstance(x_val, (TorchDataset, DataLoader)):
            if y_val is not None:
                raise ValueError(
                    "y_val: give either a Dataset/DataLoader or (x_val, y_val), not both"
                )
            validation.check_data(self.net, x_val, None, self.likelihood, x_name="x_val")
            x_val, y_val = as_tensors(x_val)
        elif y_val is None:
            raise ValueError("y_val: the validation labels are required with tensor inputs")
        validation.check_data(
            self.net, x_val, y_val, self.likelihood, x_name="x_val", y_name="y_val",
            require_y=True,
        )  # fmt: skip
        y = self.check_targets(x_val, y_val, "x_val", "y_val")  # int64 labels (N,)
        logits = self._logits(x_val)  # shape: (N, O), float64
        if logits.shape[-1] == 1:  # Bernoulli: softmax over (0, z) is (1 − σ(z), σ(z))
            logits = torch.cat([torch.zeros_like(logits), logits], -1)
        elif logits.shape[-1] <= int(y.max()):
            raise ValueError(
                f"y_val: label {int(y.max())} is outside the network's {logits.shape[-1]} classes"
            )
        y = y.to(logits.device)
        beta, at_bound = _minimise(logits, y, 1.0 / t_max, 1.0 / t_min)
        nll_before = float(_nll(logits, y, 1.0))
        nll_after = float(_nll(logits, y, beta))
        if at_bound is not None:
            why = {
                "T_min": "the network separates the validation classes, so T -> 0 is optimal",
                "T_max": "the network is no better than uniform there, so T -> inf is optimal",
            }[at_bound]
            warnings.warn(
                f"temperature: the validation NLL decreases all the way to {at_bound} = "
                f"{1.0 / beta:.3g} ({why}); T is set to that bound. Widen bounds, or check the "
                "network and the validation data",
                ConvergenceWarning,
                stacklevel=2,
            )
        # all or nothing: the state is written only here, after every check and computation
        self.temperature.fill_(1.0 / beta)
        self.nll_before, self.nll_after = nll_before, nll_after
        return self

    # ------------------------------------------------------------------ prediction

    def _check_fitted(self) -> float:
        t = float(self.temperature)
        if not math.isfinite(t):
            raise RuntimeError("TemperatureScaling: call fit(x_val, y_val) first")
        return t

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The network's outputs ``(N, O)`` in float64, chunk by chunk, in eval mode."""
        outs = []
        with torch.no_grad(), eval_mode(self.net):
            for xc in DataSource(x, chunk_size=self.chunk_size).inputs():
                out = self.net(xc)
                outs.append(out.unsqueeze(-1) if out.dim() == 1 else out)
        out = torch.cat(outs).double()
        self.likelihood.check_outputs(out)
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The scaled logits ``z / T`` ``(N, O)``, float64."""
        t = self._check_fitted()
        check_inputs(x, nets=[self.net])
        return self._logits(x) / t

    def components(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight ``(1,)`` and the one component's predictive: ``softmax(z / T)`` ``(1, N, C)``
        (`Bernoulli`: ``sigmoid(z / T)`` ``(1, N)``), float64 (`MixturePredictor`)."""
        scaled = self.logits(x)
        weights = torch.ones(1, dtype=torch.float64, device=scaled.device)
        return weights, member_predictives([self.likelihood], [scaled], "net")


def _check_bounds(bounds: object) -> tuple[float, float]:
    if isinstance(bounds, (str, bytes)) or not isinstance(bounds, Sequence) or len(bounds) != 2:
        raise TypeError(f"bounds: expected a pair (T_min, T_max), got {bounds!r}")
    lo = validation.positive_float(bounds[0], "bounds")
    hi = validation.positive_float(bounds[1], "bounds")
    if not lo < hi:
        raise ValueError(f"bounds: expected 0 < T_min < T_max, got {tuple(bounds)!r}")
    return lo, hi


def _nll(z: torch.Tensor, y: torch.Tensor, beta: float) -> torch.Tensor:
    """``(1/N) Σ_n [logsumexp(β z_n) − β z_{n, y_n}]``, the validation NLL at ``T = 1/β``."""
    zb = beta * z
    return (zb.logsumexp(-1) - zb.gather(-1, y[:, None]).squeeze(-1)).mean()


def _derivatives(z: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[float, float]:
    """``NLL'(β)`` and ``NLL''(β)``: the mean over points of ``E_p[z] − z_y`` and ``Var_p[z]``,
    ``p = softmax(β z)``."""
    p = (beta * z).softmax(-1)
    mean = (p * z).sum(-1)  # shape: (N,)
    var = (p * (z - mean[:, None]) ** 2).sum(-1)
    grad = (mean - z.gather(-1, y[:, None]).squeeze(-1)).mean()
    return float(grad), float(var.mean())


def _minimise(
    z: torch.Tensor, y: torch.Tensor, lo: float, hi: float
) -> tuple[float, str | None]:
    """The minimiser ``β*`` of the convex ``NLL(β)`` on ``[lo, hi]``, and which bound of ``T``
    it sits at (``"T_max"``: ``β = lo``; ``"T_min"``: ``β = hi``; ``None`` inside).

    Newton steps on the monotone ``NLL'``, each kept inside the bracket ``[lo, hi]`` that holds
    the root (a step leaving it is replaced by the bracket's geometric midpoint), until the step
    or the bracket is at float64 resolution.
    """
    g_lo, _ = _derivatives(z, y, lo)
    g_hi, _ = _derivatives(z, y, hi)
    if g_lo >= 0 and g_hi <= 0:  # flat: every row's logits equal, every T alike
        return min(max(1.0, lo), hi), None
    if g_lo >= 0:  # increasing on the whole interval: the largest T
        return lo, "T_max"
    if g_hi <= 0:  # decreasing on the whole interval: the smallest T
        return hi, "T_min"
    beta = min(max(1.0, lo), hi)  # start at T = 1, the network as trained
    for _ in range(MAX_STEPS):
        g, h = _derivatives(z, y, beta)
        if g == 0.0:
            return beta, None
        if g < 0:
            lo = beta
        else:
            hi = beta
        newton = beta - g / h if h > 0 else math.nan
        nxt = newton if lo < newton < hi else math.sqrt(lo * hi)
        if abs(nxt - beta) <= 4 * torch.finfo(torch.float64).eps * beta or hi - lo <= (
            4 * torch.finfo(torch.float64).eps * hi
        ):
            return nxt, None
        beta = nxt
    return beta, None
