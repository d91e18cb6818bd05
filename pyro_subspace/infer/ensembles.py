"""Deep ensembles and the mixture-predictive interface shared by ensembles, SWAG and MoLA.

Every predictor here is a *mixture*: ``M`` components with weights ``π_m`` (summing to one), each
with its own predictive distribution. They share one small interface (`MixturePredictor`):

- ``components(x)`` → ``(weights (M,), per-component predictives)``: class probabilities
  ``(M, N, C)`` (`Categorical`), ``P(y = 1)`` ``(M, N)`` (`Bernoulli`), or a pair
  ``(means (M, N, O), variances (M, N, O))`` of Gaussians that include the observation noise
  (`Gaussian` regression; ``O = 1`` for a single output or a heteroscedastic net).
- ``predict(x)`` → the mixture predictive: probabilities ``(N, C)`` / ``(N,)``, or for regression
  the moment-matched ``(mean (N, O), variance (N, O))``.
- ``log_prob(x, y)`` → the log predictive density of each target, ``(N,)``: the log of the
  mixture's probability of ``y_n``, for regression the exact mixture-of-Gaussians density.

All outputs are float64. A deep ensemble (Lakshminarayanan et al., 2017; MoLA eq. 3) has one
component per network, ``π_m = 1/K``; SWAG and MultiSWAG (`swag.py`) one per weight draw;
`MixtureOfLaplace` one per member Laplace approximation (MoLA eqs. 1, 7–9).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import rng, validation
from ..flat import eval_mode
from ..likelihoods import Bernoulli, Likelihood, check_likelihood
from ..subspaces import SWACollector
from ..train import fit_map

__all__ = ["DeepEnsemble", "MixturePredictor", "TrainedEnsemble", "train_ensemble"]


class MixturePredictor:
    """Base class: a predictive that is a weighted mixture of per-component predictives.

    Subclasses set ``self.likelihood`` (the `Likelihood` shared by the components, used to tell
    classification from regression) and implement `components`.
    """

    likelihood: Likelihood
    #: the members' common output width read from their structure (`output_width`), or None
    _out_width: int | None = None

    def components(
        self, x: torch.Tensor, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """Mixture weights ``(M,)`` and per-component predictives (see the module docstring)."""
        raise NotImplementedError

    @property
    def is_regression(self) -> bool:
        """True for a regression likelihood (mixture of Gaussians), False for classification."""
        return self.likelihood.is_regression

    def predict(
        self, x: torch.Tensor, **kwargs: object
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The mixture predictive ``Σ_m π_m p_m(y | x)``.

        Args:
            x: inputs ``(N, ...)``.
            **kwargs: passed to `components` (e.g. ``num_samples``, ``method``).

        Returns:
            Classification: probabilities ``(N, C)`` (`Categorical`) or ``P(y = 1)`` ``(N,)``
            (`Bernoulli`). Regression: the moment-matched Gaussian, ``(mean, variance)``, each
            ``(N, O)``: ``μ = Σ π_m μ_m``, ``σ² = Σ π_m σ_m² + Σ π_m (μ_m − μ)²``.
        """
        weights, comp = self.components(x, **kwargs)
        if self.is_regression:
            means, variances = comp
            w = weights[:, None, None]
            mean = (w * means).sum(0)
            return mean, (w * variances).sum(0) + (w * (means - mean).square()).sum(0)
        # clamp: float64 rounding of Σ π_m p_m can exceed 1 by ~1e-15 at saturated softmaxes
        return torch.einsum("m,m...->...", weights, comp).clamp(0.0, 1.0)

    def log_prob(self, x: torch.Tensor, y: torch.Tensor, **kwargs: object) -> torch.Tensor:
        """Log predictive density ``log Σ_m π_m p_m(y_n | x_n)`` of each target, shape ``(N,)``.

        Regression uses the mixture of Gaussians itself (not its moment match), summed over the
        ``O`` outputs of each point; classification the log mixture probability of the label
        (clamped at ``1e-12``).
        """
        y = self.check_targets(x, y)  # before any forward pass
        weights, comp = self.components(x, **kwargs)
        return self._log_prob_of(weights, comp, y)

    def _log_prob_of(self, weights, comp, y: torch.Tensor, y_name: str = "y") -> torch.Tensor:
        """`log_prob` from ``(weights, comp)`` for targets checked by `check_targets`."""
        log_w = weights.clamp_min(1e-300).log()
        if self.is_regression:
            means, variances = comp
            yy = _targets_like(y, means.shape[1:], y_name)
            log_p = torch.distributions.Normal(means, variances.sqrt()).log_prob(yy).sum(-1)
            return torch.logsumexp(log_w[:, None] + log_p, dim=0)
        probs = torch.einsum("m,m...->...", weights, comp)
        if probs.dim() == 1:  # Bernoulli
            y = validation.check_labels(y, y_name, 2, probs.shape[0])
            p = torch.where(y.to(probs.device).bool(), probs, 1 - probs)
        else:  # the range again, for members whose width their structure did not tell
            y = validation.check_labels(y, y_name, probs.shape[-1], probs.shape[0])
            p = probs.gather(1, y.to(probs.device)[:, None]).squeeze(1)
        return p.clamp_min(1e-12).log()

    def check_targets(
        self, x: object, y: object, x_name: str = "x", y_name: str = "y"
    ) -> torch.Tensor:
        """Check targets ``y`` for inputs ``x`` before any forward pass; return them.

        Classification: `validation.check_labels` (one integer label per row of ``x`` in
        ``[0, C)``, ``C`` the members' output width when their structure tells it, 2 for
        `Bernoulli`; whole-number floats pass, fractions are errors), as int64. Regression: a
        real tensor of finite targets, one (row) per row of ``x``.
        """
        n = validation.check_inputs(None, x, x_name)
        if not self.is_regression:
            c = 2 if isinstance(self.likelihood, Bernoulli) else self._out_width
            return validation.check_labels(y, y_name, c, n, x_name=x_name, why=_why(c, self))
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"{y_name}: expected a torch.Tensor of targets, got {type(y).__name__}")
        if y.is_complex() or y.dtype == torch.bool:
            raise TypeError(f"{y_name}: expected real-valued targets, got dtype {y.dtype}")
        if y.dim() == 0 or y.shape[0] != n:
            raise ValueError(
                f"{y_name}: expected {n} targets, one per row of {x_name}, got shape "
                f"{tuple(y.shape)}"
            )
        validation.check_finite(y, y_name)
        return y


@dataclass
class TrainedEnsemble:
    """What `train_ensemble` returns.

    Attributes:
        nets: the ``K`` trained networks (MAP estimates), one per seed.
        likelihoods: the likelihood of each member (copies when it has learnable parameters,
            e.g. a learned Gaussian noise scale; otherwise the same object ``K`` times).
        collectors: ``K`` `SWACollector` s (``collector=True``), else ``None``. Each was filled by a
            constant-learning-rate SGD phase started from a *copy* of the member's MAP network
            (its ``collector.flat.net``), so ``nets`` stay the MAP solutions.
        losses: the training-loss history of each member (`fit_map`'s return value).
        seeds: the seed of each member (initialisation and minibatch order).
    """

    nets: list[nn.Module]
    likelihoods: list[Likelihood]
    collectors: list[SWACollector] | None
    losses: list[list[float]]
    seeds: list[int]


def train_ensemble(
    make_net: Callable[[], nn.Module],
    likelihood: Likelihood,
    x: torch.Tensor,
    y: torch.Tensor,
    n_members: int = 5,
    seeds: Sequence[int] | None = None,
    progress: bool = True,
    collector: bool = False,
    swa_epochs: int = 20,
    swa_lr: float | None = None,
    max_snapshots: int = 20,
    **fit_map_kwargs: object,
) -> TrainedEnsemble:
    """Train ``K`` networks independently from different seeds (a deep ensemble, MoLA eq. 3).

    For each seed ``s``: ``torch.manual_seed(s)``, ``net = make_net()`` (a fresh random
    initialisation), then `fit_map` with ``seed=s`` (minibatch order) and ``fit_map_kwargs``.
    The seeding is local to the call: torch's global generators (CPU and CUDA) are afterwards
    where the caller left them, so the members depend on their seeds only and the caller's
    later draws on the caller's own seed only (NumPy's and Python's generators are not seeded).
    With ``collector=True`` a copy of each trained net then runs ``swa_epochs`` of constant-rate
    SGD (`fit_map` with ``epochs=0``) collecting SWAG statistics in a `SWACollector`, the
    MultiSWAG recipe (Wilson & Izmailov, 2020): SWAG around each independently trained mode.

    Args:
        make_net: a function of no arguments returning a new network.
        likelihood: the `Likelihood` (deep-copied per member if it has trainable parameters).
        x, y: training data ``(N, ...)``, ``(N,)``.
        n_members: ``K`` (ignored when ``seeds`` is given: ``K = len(seeds)``).
        seeds: distinct integer seeds, default ``0 … K−1``.
        progress: one ``tqdm`` bar over the members.
        collector: also collect SWAG statistics (see above).
        swa_epochs, swa_lr, max_snapshots: the SWA phase (``swa_epochs >= 2``).
        **fit_map_kwargs: ``epochs``, ``lr``, ``weight_decay``, ``batch_size``, ``optimizer``,
            ``momentum`` of `fit_map`; ``weight_decay``, ``batch_size`` and ``momentum`` also apply
            to the SWA phase.

    Returns:
        A `TrainedEnsemble`.
    """
    if not callable(make_net):
        raise TypeError(f"make_net: expected a callable returning a network, got {make_net!r}")
    check_likelihood(likelihood)
    validation.check_data(None, x, y, require_y=True)
    validation.check_int(max_snapshots, "max_snapshots", 2)
    validation.positive_float(swa_lr, "swa_lr", allow_none=True)
    if seeds is None:
        validation.positive_int(n_members, "n_members")
        seeds = list(range(n_members))
    else:
        seeds = list(seeds)
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
            raise ValueError(f"seeds: expected a non-empty list of ints, got {seeds!r}")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds: expected distinct seeds, got {seeds!r}")
    if collector:  # SWAG needs at least two snapshots
        validation.check_int(swa_epochs, "swa_epochs", 2)
    for key in ("collector", "swa_epochs", "swa_lr", "seed", "progress"):
        if key in fit_map_kwargs:
            raise TypeError(f"{key}: set by train_ensemble itself; not a fit_map_kwargs entry")
    learnable = any(p.requires_grad for p in likelihood.parameters())
    swa_keys = ("weight_decay", "batch_size", "momentum")
    swa_kwargs = {k: v for k, v in fit_map_kwargs.items() if k in swa_keys}
    # every member is built before any is trained, so that a make_net returning one network
    # (or networks sharing parameters) is an error before any work; each member's draws from
    # torch's global generator (initialisation, then dropout and the rest of training) follow
    # torch.manual_seed(s) as one stream, and the caller's generators are left as they were
    built = []
    for s in seeds:
        with rng.seeded(s, numpy=False, python=False):
            net = make_net()
            if not isinstance(net, nn.Module):
                raise TypeError(f"make_net: returned {type(net).__name__}, not a torch.nn.Module")
            built.append((net, rng.get_state(numpy=False, python=False)))
    _check_distinct_members([net for net, _ in built])
    nets, liks, cols, losses = [], [], [], []
    for s, (net, state) in zip(tqdm(seeds, desc="ensemble", disable=not progress, leave=False), built):
        with rng.seeded(s, numpy=False, python=False):
            rng.set_state(state)  # where make_net left the member's stream
            lik = copy.deepcopy(likelihood) if learnable else likelihood
            history = fit_map(net, lik, x, y, seed=s, progress=False, **fit_map_kwargs)
            if collector:
                swag_net = copy.deepcopy(net)
                col = SWACollector(swag_net, max_snapshots=max_snapshots)
                lr = fit_map_kwargs.get("lr", 1e-2) if swa_lr is None else swa_lr
                history = history + fit_map(
                    swag_net, lik, x, y, epochs=0, swa_epochs=swa_epochs, swa_lr=lr,
                    collector=col, seed=s, progress=False, **swa_kwargs,
                )  # fmt: skip
                cols.append(col)
        nets.append(net)
        liks.append(lik)
        losses.append(history)
    return TrainedEnsemble(nets, liks, cols if collector else None, losses, seeds)


def _check_distinct_members(nets: list[nn.Module]) -> None:
    """Members are distinct networks: no network twice, no parameter shared between two (an
    "ensemble" of one network trained K times is not an ensemble)."""
    owner: dict[int, int] = {}
    for i, net in enumerate(nets):
        for p in net.parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                raise ValueError(
                    f"make_net: members {j} and {i} share parameters (make_net returned the same "
                    "network, or networks sharing layers): return a new network on every call"
                )


class DeepEnsemble(MixturePredictor):
    """A deep ensemble: the uniform mixture of the members' predictives (MoLA eq. 3).

    ``p_DE(y | x) = 1/K Σ_k p(y | x, θ_MAP^(k))``; for regression each member contributes the
    Gaussian ``N(f_k(x), σ_k²(x))`` (mean and noise of its likelihood), and `predict` returns
    the moment-matched Gaussian, `log_prob` the mixture density.

    Args:
        nets: ``K >= 1`` trained networks with the same output width.
        likelihood: one `Likelihood` for all, or a list of ``K`` (one per member, e.g. from
            `TrainedEnsemble.likelihoods` when the noise scale was learned).

    Example:
        >>> x, y = torch.randn(60, 3), torch.randint(0, 2, (60,))
        >>> def make_net():
        ...     return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> ens = train_ensemble(make_net, Categorical(), x, y, n_members=3, epochs=5,
        ...                      progress=False)
        >>> probs = DeepEnsemble(ens.nets, Categorical()).predict(x[:4])
    """

    def __init__(
        self, nets: Sequence[nn.Module], likelihood: Likelihood | Sequence[Likelihood]
    ) -> None:
        self.nets = _check_nets(nets)
        self._out_width = output_width(self.nets, "nets")
        self.likelihoods = _check_likelihoods(likelihood, len(self.nets))
        self.likelihood = self.likelihoods[0]

    def components(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """Uniform weights ``(K,)`` and each member's predictive (module docstring)."""
        check_inputs(x, nets=self.nets)
        outs = []
        with torch.no_grad():
            for net in self.nets:
                with eval_mode(net):
                    outs.append(net(x))
        return _uniform(len(outs), x), member_predictives(self.likelihoods, outs)


def output_width(nets: Sequence[nn.Module], name: str = "nets") -> int | None:
    """The output width ``O`` the members share, read from their structure (`validation.net_spec`,
    no forward pass); ``None`` when no member's structure tells it. Members whose widths differ
    are a ``ValueError`` naming ``name``: a mixture needs one output space."""
    widths = [(i, validation.net_spec(net).out_width) for i, net in enumerate(nets)]
    known = [(i, w) for i, w in widths if w is not None]
    for i, w in known[1:]:
        if w != known[0][1]:
            raise ValueError(
                f"{name}: member {i} gives {w} output(s) but member {known[0][0]} gives "
                f"{known[0][1]}; the members of a mixture need the same output width"
            )
    return known[0][1] if known else None


def _why(c: int | None, predictor: object) -> str:
    if c is None:
        return ""
    if isinstance(getattr(predictor, "likelihood", None), Bernoulli):
        return " (Bernoulli targets must be 0 or 1)"
    return f" for members with {c} outputs"


def member_predictives(
    likelihoods: Sequence[Likelihood], outputs: Sequence[torch.Tensor], name: str = "nets"
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-component predictives from network outputs.

    Args:
        likelihoods: one `Likelihood` per entry of ``outputs`` (all of the same kind).
        outputs: network outputs, each ``(..., N, O)``; leading dimensions (draws) are flattened
            into the component dimension. Outputs of different widths (members whose structure
            did not tell it, `output_width`) are a ``ValueError`` naming ``name``.

    Returns:
        Probabilities ``(M, N, C)`` / ``(M, N)``, or ``(means, variances)`` ``(M, N, O)`` each,
        float64, ``M`` the total number of output rows.
    """
    comps, first = [], None
    for i, (lik, out) in enumerate(zip(likelihoods, outputs)):
        out = out.detach()
        out = out.unsqueeze(-1) if out.dim() == 1 else out
        first = out.shape[-2:] if first is None else first
        if out.shape[-2:] != first:
            raise ValueError(
                f"{name}: member {i} gives outputs of shape (N, O) = {tuple(out.shape[-2:])} but "
                f"member 0 gives {tuple(first)}; the members of a mixture need the same output "
                "width"
            )
        dist = lik.predictive_from_samples(out.reshape(-1, *out.shape[-2:]))
        comps.append((dist.mean, dist.variance) if lik.is_regression else dist.probs)
    if likelihoods[0].is_regression:
        return torch.cat([c[0] for c in comps]), torch.cat([c[1] for c in comps])
    return torch.cat(comps)


def check_inputs(x: object, name: str = "x", nets: Sequence[nn.Module] = ()) -> int:
    """Raise unless ``x`` is a finite tensor ``(N, ...)``, ``N >= 1``, that every network in
    ``nets`` takes (width, dtype, device: `validation.check_inputs`); return N."""
    n = validation.check_inputs(None, x, name)
    for net in nets:
        validation.check_inputs(net, x, name)
    return n


def _check_nets(nets: object) -> list[nn.Module]:
    if isinstance(nets, nn.Module) or not isinstance(nets, Sequence) or len(nets) == 0:
        raise TypeError(f"nets: expected a non-empty list of torch.nn.Module, got {nets!r}")
    for i, net in enumerate(nets):
        if not isinstance(net, nn.Module):
            raise TypeError(f"nets: entry {i} is {type(net).__name__}, not a torch.nn.Module")
    return list(nets)


def _check_likelihoods(likelihood: object, k: int) -> list[Likelihood]:
    liks = list(likelihood) if isinstance(likelihood, (list, tuple)) else [likelihood] * k
    if len(liks) != k:
        raise ValueError(f"likelihood: expected one likelihood or a list of {k}, got {len(liks)}")
    for lik in liks:
        check_likelihood(lik)
    if len({type(lik) for lik in liks}) > 1:
        raise ValueError("likelihood: all members need the same kind of likelihood")
    return liks


def _uniform(m: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((m,), 1.0 / m, dtype=torch.float64, device=like.device)


def _targets_like(y: object, shape: torch.Size, name: str = "y") -> torch.Tensor:
    """Regression targets as ``(N, O)`` float64 for component means of shape ``(N, O)``."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(y).__name__}")
    n, o = shape
    if y.numel() != n * o or y.shape[0] != n:
        raise ValueError(f"{name}: expected {n} targets with {o} output(s), got {tuple(y.shape)}")
    return y.reshape(n, o).double()
