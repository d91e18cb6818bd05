"""Deep ensembles and the mixture-predictive interface shared by ensembles, SWAG and MoLA.

Every predictor here is a *mixture*: ``M`` components with weights ``π_m`` (summing to one), each
with its own predictive distribution. They share one small interface (`MixturePredictor`):

- ``components(x)`` → ``(weights (M,), per-component predictives)``: class probabilities
  ``(M, N, C)`` (`Categorical`), ``P(y = 1)`` ``(M, N)`` (`Bernoulli`), or a pair
  ``(means (M, N, O), variances (M, N, O))`` of Gaussians that include the observation noise
  (`Gaussian` regression; ``O = 1`` for a single output or a heteroscedastic net).
- ``predict(x)`` → the mixture predictive as a ``torch.distributions`` object
  (`Likelihood.mixture`): a ``Categorical`` over the averaged probabilities ``(N, C)`` (a
  ``Bernoulli``, ``(N,)``), or for regression the mixture of the components' Gaussians
  (``MixtureSameFamily``, batch ``(N,)``, event ``(O,)``), whose ``.mean`` and ``.variance`` are
  the moment match.
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
from ..likelihoods import Likelihood, check_likelihood
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

    def predict(self, x: torch.Tensor, **kwargs: object) -> torch.distributions.Distribution:
        """The mixture predictive ``Σ_m π_m p_m(y | x)`` as a ``torch.distributions`` object
        (`Likelihood.mixture`).

        Args:
            x: inputs ``(N, ...)``.
            **kwargs: passed to `components` (e.g. ``num_samples``, ``method``).

        Returns:
            Classification: a ``Categorical`` with ``.probs`` ``(N, C)`` (a ``Bernoulli`` with
            ``P(y = 1)`` ``(N,)``). Regression: the mixture of the components' Gaussians
            (``MixtureSameFamily``, batch ``(N,)``, event ``(O,)``): ``.mean`` ``Σ π_m μ_m``,
            ``.variance`` ``Σ π_m σ_m² + Σ π_m (μ_m − μ)²``, ``.log_prob`` the mixture density.
            The components themselves: `components`.
        """
        weights, comp = self.components(x, **kwargs)
        return self.likelihood.mixture(weights, comp)

    def log_prob(self, x: torch.Tensor, y: torch.Tensor, **kwargs: object) -> torch.Tensor:
        """Log predictive density ``log Σ_m π_m p_m(y_n | x_n)`` of each target, shape ``(N,)``.

        Regression uses the mixture of Gaussians itself (not its moment match), the ``O``
        outputs of each point jointly; classification the log mixture probability of the label
        (clamped at ``1e-12``).
        """
        y = self.check_targets(x, y)  # before any forward pass
        weights, comp = self.components(x, **kwargs)
        return self.likelihood.mixture_log_prob(weights, comp, y)

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
        return self.likelihood.check_targets(y, n, self._out_width, y_name, x_name)


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
        >>> probs = DeepEnsemble(ens.nets, Categorical()).predict(x[:4]).probs
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
        comps.append(lik.component(dist))
    return likelihoods[0].stack_components(comps, concat=True)


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


