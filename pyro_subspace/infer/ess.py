"""Elliptical slice sampling over a Gaussian reference, as a Pyro ``MCMCKernel``.

`EllipticalSliceSampler` wraps the pure transition of `slice_step` (the algorithm, the
multivariate-t reference, the `Reference` contract and its two implementations) in Pyro's
``MCMCKernel`` contract. No step size to tune, no gradients: Subspace Inference (Izmailov et
al., 2019, appendix F) recommends the kernel for the subspace posterior, with ``L`` the tempered
likelihood ``p(D|t)^{1/T}`` of their eq. (3), summed over the full training set in chunks.
Chains of the generalised kernel advance together in a `chain_batch.ChainBatch` (adaptation
of a fitted reference in warm-up) or, with ``reference="auto"``, a `chain_batch.Population`
(Nishihara, Murray & Adams's two-group scheme in two independent populations); `one_process`
keeps Pyro's chains in one process, as those need.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from .. import distributed
from ..diagnostics import check_draws
from ..exceptions import ConvergenceWarning, UnsupportedModelError
from ..validation import positive_int
from .gaussian_prior import (
    GaussianSite,
    gaussian_moments,
    gaussian_priors,
    refuse_subsampling,
)
from .chain_batch import POPULATIONS, REPEATS, ChainBatch, Population
from .slice_step import (  # the core, re-exported: the kernel's public building blocks
    ChainReference,
    PriorReference,
    Reference,
    SliceInfo,
    SliceState,
    elliptical_slice_step,
)

REFERENCES = ("prior", "warmup", "laplace", "auto")
RANDOM_STREAMS = ("global", "chains")
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: chain j's seed is hash of (seed, j)

__all__ = [
    "ChainReference",
    "EllipticalSliceSampler",
    "PriorReference",
    "Reference",
    "SliceInfo",
    "SliceState",
    "elliptical_slice_step",
    "one_process",
]


# --- the Pyro kernel -------------------------------------------------------------------------


class _PriorModel:
    """The Pyro model of the model-free form with ``rng="global"``: one latent site ``"t"``
    under ``prior``. A module-level class (not a closure), so that the kernel pickles: Pyro's
    multiprocessing driver sends it to its workers (``mp_context="spawn"``)."""

    def __init__(self, prior: Any) -> None:
        self.prior = prior

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return pyro.sample("t", self.prior)


class EllipticalSliceSampler(MCMCKernel):
    """Elliptical slice sampling over the prior or a fitted reference, as a Pyro ``MCMCKernel``.

    Use it like ``NUTS``: ``MCMC(EllipticalSliceSampler(model), num_samples, warmup_steps,
    num_chains).run(*args)``. Two configurations of the one kernel (`elliptical_slice_step`):

    - *plain* (``reference="prior"``, no ``df``, ``chains`` or ``seed``; ``rng="global"``):
      Murray et al.'s kernel for any Pyro model whose latents all have fixed Gaussian priors
      (``Normal``/``MultivariateNormal``, ``.to_event`` allowed, parameters not depending on
      other latents, no handler changing their density: a latent under ``poutine.scale`` or
      under ``poutine.mask`` with a mask that is false anywhere is refused); the rest of the
      joint density (observed sites, ``pyro.factor``, tempering by ``poutine.scale`` or masks
      on observations) is ``L(θ)``. A model without latent sites gives empty draws, as with
      HMC/NUTS. One chain at a time, random numbers from torch's global generator
      (`PriorReference`).
    - *generalised* (a fitted ``reference``, ``df``, ``chains`` or ``seed``; ``rng="chains"``):
      over the coordinates ``t`` of a `SubspaceNet`, with a Gaussian or multivariate-t
      reference, chains advanced together in batched likelihood calls, chain ``j`` drawing
      from its own generator seeded from ``seed`` and ``j`` (`ChainReference`).

    A `SubspaceNet` (anything with ``log_likelihood_fn``) has ``L(t) = p(D | w = ŵ + P t)^{1/T}``
    evaluated by its `Evaluator` over the whole training set in chunks of ``chunk_size`` rows
    under ``torch.no_grad()`` (memory bounded by the chunk, not by ``N``; one point ``(K,)`` or
    a batch ``(B, K)`` per call), ignoring the model's ``subsample_size``. Other models are
    traced by Pyro once per evaluation and must not subsample. Like Pyro's HMC, which takes a
    model or a ``potential_fn``, the kernel also takes no model but a ``prior`` (a
    ``Normal``/``MultivariateNormal`` over one latent ``"t"``) and a ``log_likelihood``; then
    ``MCMC.run()`` needs no arguments.

    Args:
        model: a Pyro model (callable) or a `SubspaceNet` (the generalised configuration needs
            a `SubspaceNet`); or None with ``prior`` and ``log_likelihood``.
        chunk_size: rows of data per forward pass for an evaluator likelihood.
        recompute_bn: for a `SubspaceNet` whose network has BatchNorm layers: before each
            likelihood evaluation, recompute the running statistics at the proposed weights from
            the training inputs (cumulative average over the chunks, as drbayes does for CIFAR
            nets), so the sampled density is a fixed function of ``t`` (batched chains are then
            evaluated one point at a time). Doubles the cost of an evaluation; off by default.
            The user's BatchNorm buffers are put back after every evaluation, so they are
            unchanged also when sampling raises or is interrupted (Pyro calls no `cleanup`).
        max_shrinks: bracket shrinkages before a transition gives up and raises
            ``RuntimeError`` (the likelihood is then NaN or flat at ``-inf``).
        reference: where ``(μ, Σ)`` comes from: ``"prior"`` (the prior, never adapted: plain
            ESS), ``"warmup"`` (start from the prior, refit from the warm-up draws),
            ``"laplace"`` (an `AutoSubspaceLaplace` fitted to the data at the first `setup`), a
            fitted `AutoSubspaceLaplace`, a ``Normal``/``MultivariateNormal`` over ``t``, or a
            pair ``(μ (K,), Σ (K, K) or (K,))``, e.g. SWAG moments mapped into the subspace;
            or ``"auto"``, the recommended one at any temperature: Nishihara et al.'s population
            scheme (`chain_batch.Population`) over ``chains=C`` chains in two independent
            populations of two groups (``C`` a multiple of 4; ``4 (K + 2)`` recommended), each
            group's multivariate t fitted to the other group's current states after every
            group update, chains starting at draws of the Laplace fit (a `SubspaceNet`) or of
            the prior (``model=None``). It needs all ``C`` chains in one process: in a worker
            of Pyro's multiprocessing driver it refuses (`one_process` keeps them in this
            one). After the run it checks convergence (`diagnostics.check`).
        df: ``None`` for a Gaussian reference (``reference="auto"``: ``ν`` fitted at every
            update), or the degrees of freedom ``ν > 0`` of a multivariate-t reference
            (``math.inf``: Gaussian; with ``"auto"`` the fixed ``ν`` of every fit).
        adapt: refit ``(μ, Σ)`` from the warm-up draws of the chains advanced together, pooled
            (the later half, at warm-up steps 25, 50, 100, … and at the end of warm-up, once
            the pool holds ≥ 20 K draws). With ``chains=None`` each chain pools its own.
            ``None`` (default): only for ``reference="warmup"``; a fitted reference is kept
            (see the module notes: a refit from a few hundred draws is a worse reference).
            Not applicable to ``reference="auto"`` (it refits throughout; leave ``None``).
        chains: ``None``: every ``MCMC`` chain is sampled on its own; an int ``C``: the kernel
            advances ``C`` chains together; run it with ``MCMC(..., num_chains=C)`` (in one
            process: in a worker of Pyro's multiprocessing driver each chain runs on its own).
            Pyro's sequential driver then replays chain ``c``'s stored trajectory. A run with
            fewer chains leaves the batch's other chains to the next ``setup`` with the same
            argument objects (``MCMC.run`` passes new ones to each run: a new run opens a new
            batch, unless it has no arguments).
        seed: base seed of the chains' generators; ``None`` (and in a worker process of Pyro's
            parallel driver, which seeds each worker): drawn from torch's global generator.
            ``j`` counts the chains this kernel object has started, across ``MCMC`` runs: a
            second run with the same kernel continues with new chains; a new kernel with the
            same ``seed`` repeats the first run.
        rng: ``"global"`` (the plain configuration) or ``"chains"`` (the generalised one);
            ``None``: ``"chains"`` when ``reference``, ``df``, ``chains`` or ``seed`` asks for
            it, else ``"global"``. ``rng="chains"`` with ``reference="prior"`` is plain ESS on
            the per-chain generators.
        repeats: with ``reference="auto"``: steps of a group between refits (default 1: every
            step uses the other group's latest states).
        prior: with ``model=None``: a ``Normal``/``MultivariateNormal`` over ``t``, event ``(K,)``.
        log_likelihood: with ``model=None``: ``log L``; ``t (K,) -> float`` for
            ``rng="global"``, ``(B, K) -> (B,)`` (a batch of points) for ``rng="chains"``.

    Shapes: the latent site ``"t"`` is ``(K,)`` per chain; with ``rng="chains"`` the chains'
    states are ``(C, K)`` and the log-likelihood is called on ``(B, K)``, ``B ≤ C`` open
    brackets. Diagnostics: ``"divergences"`` (always empty: every transition moves),
    ``"acceptance rate"`` (1.0), ``"evaluations per draw"`` (likelihood evaluations of the chain
    per transition) and, with ``rng="chains"``, ``"passes per draw"`` (batched calls per
    transition, ≥ 1). `last_info` is the `SliceInfo` of the latest transition (with
    ``rng="chains"``: of the batch's latest step, all its chains).

    Pyro's MCMC contract, as HMC/NUTS keep it: ``cleanup`` forgets everything of the chain
    (its start, the user's ``initial_params`` included, and its cached state), so a kernel
    reused in a new ``MCMC`` starts afresh; every constructor form pickles (Pyro's
    multiprocessing driver, ``mp_context="spawn"``) when the model or ``log_likelihood`` does
    (a module-level function does, a lambda does not); a model the kernel cannot sample raises
    `UnsupportedModelError` (a ``ValueError`` and a ``TypeError``), a subsampled one
    `SubsamplingError` (a ``NotImplementedError`` and a ``ValueError``), both from
    ``pyro_subspace.exceptions``, before any sampling.

    Under ``torch.distributed`` every rank first takes rank 0's random stream
    (`distributed.share_random_stream`) and the evaluator all-reduces the likelihood, so every
    rank makes the same accept and shrink decisions and returns the same chain.

    Example:
        >>> import pyro.distributions as dist
        >>> from pyro.infer import MCMC
        >>> prior = dist.Normal(torch.zeros(2), 1.0).to_event(1)
        >>> def loglik(t):  # a batch (B, 2) -> (B,)
        ...     return -0.5 * ((t - 1.0) ** 2).sum(-1) / 0.25
        >>> plain = EllipticalSliceSampler(prior=prior, log_likelihood=lambda t: float(loglik(t)))
        >>> fitted = EllipticalSliceSampler(  # a Gaussian reference (μ, diagonal Σ), seeded
        ...     prior=prior, log_likelihood=loglik, reference=(torch.ones(2), 0.2 * torch.ones(2)),
        ...     seed=0)
        >>> for kernel in (plain, fitted):
        ...     mcmc = MCMC(kernel, num_samples=50, warmup_steps=10, disable_progbar=True)
        ...     mcmc.run()
        ...     print(kernel.rng, tuple(mcmc.get_samples()["t"].shape))
        global (50, 2)
        chains (50, 2)
    """

    def __init__(
        self,
        model: Any = None,
        chunk_size: int = 4096,
        recompute_bn: bool = False,
        max_shrinks: int = 200,
        *,
        reference: Any = "prior",
        df: float | None = None,
        adapt: bool | None = None,
        chains: int | None = None,
        seed: int | None = None,
        rng: str | None = None,
        repeats: int | None = None,
        prior: Any = None,
        log_likelihood: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        if isinstance(reference, str) and reference not in REFERENCES:
            raise ValueError(
                f"reference: expected one of {REFERENCES} or a Gaussian, got {reference!r}"
            )
        auto = isinstance(reference, str) and reference == "auto"
        if df is not None and (
            isinstance(df, bool) or not isinstance(df, (int, float)) or not df > 0
        ):
            what = "fitted" if auto else "Gaussian"
            raise ValueError(
                f"df: expected None ({what}) or a positive number (math.inf: Gaussian), got {df!r}"
            )
        if adapt is not None and not isinstance(adapt, bool):
            raise TypeError(f"adapt: expected None, True or False, got {type(adapt).__name__}")
        if chains is not None and (
            isinstance(chains, bool) or not isinstance(chains, int) or chains < 1
        ):
            raise ValueError(f"chains: expected None or a positive int, got {chains!r}")
        if repeats is not None:
            positive_int(repeats, "repeats")
            if not auto:
                raise ValueError(
                    "repeats: steps of a group between two refits of reference='auto'; "
                    f"reference={reference!r} takes none"
                )
        if auto:
            if adapt is not None:
                raise ValueError(
                    "adapt: not applicable with reference='auto', which refits each group's "
                    "t reference from the other group's current states after every group "
                    "update, in warm-up and sampling alike; leave adapt=None"
                )
            size = 2 * POPULATIONS
            if chains is None or chains % size:
                raise ValueError(
                    f"chains: reference='auto' advances {POPULATIONS} independent populations "
                    f"of two groups together: expected a multiple of {size} (recommended "
                    f"{size}(K + 2), groups of K + 2 states), got {chains!r}"
                )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
        positive_int(chunk_size, "chunk_size"), positive_int(max_shrinks, "max_shrinks")
        plain = isinstance(reference, str) and reference == "prior"
        asks_chains = not plain or df is not None or chains is not None or seed is not None
        if rng is None:
            rng = "chains" if asks_chains else "global"
        elif rng not in RANDOM_STREAMS:
            raise ValueError(f"rng: expected one of {RANDOM_STREAMS} or None, got {rng!r}")
        elif rng == "global" and asks_chains:
            raise ValueError(
                "rng: 'global' is plain ESS over the prior; a fitted reference, df, chains or "
                "seed needs rng='chains' (or None)"
            )
        self.rng = rng
        self._user_likelihood = log_likelihood
        if model is None:
            if prior is None or not callable(log_likelihood):
                shape = "t -> float" if rng == "global" else "(B, K) -> (B,)"
                raise TypeError(
                    "model: give a Pyro model or a SubspaceNet, or prior= (a Gaussian over t) "
                    f"and log_likelihood= (a function {shape})"
                )
            if rng == "global":
                model = _PriorModel(prior)

        elif prior is not None or log_likelihood is not None:
            raise ValueError("prior, log_likelihood: give either a model or these, not both")
        elif rng == "global" and not callable(model):
            raise TypeError(f"model: expected a Pyro model (callable), got {type(model).__name__}")
        elif rng == "chains" and not all(hasattr(model, a) for a in ("prior", "log_likelihood_fn")):
            raise UnsupportedModelError(
                f"model: expected a SubspaceNet (prior, log_likelihood_fn), got "
                f"{type(model).__name__}; other Pyro models are sampled with "
                "reference='prior' and no df, chains or seed (rng='global')"
            )
        if reference == "laplace" and model is None:
            raise ValueError("reference: 'laplace' needs a SubspaceNet model")
        if adapt is None:  # refit only a reference that starts as the prior
            adapt = isinstance(reference, str) and reference == "warmup"
        self.model, self.reference, self.df, self.adapt = model, reference, df, adapt
        self.chains, self.seed = chains, seed
        self.repeats = (repeats or REPEATS) if auto else None
        self.chunk_size, self.recompute_bn = chunk_size, bool(recompute_bn)
        self.max_shrinks = max_shrinks
        self._prior = prior if rng == "chains" else None
        self._pid = os.getpid()
        self._chain_count = 0  # chains started by this kernel: the index of the next one
        self._batch: ChainBatch | None = None
        self._laplace_key: tuple | None = None
        self._laplace: tuple | None = None
        self._restore: Callable[[], None] | None = None
        self.transforms: dict = {}
        self.last_info: SliceInfo | None = None
        #: with ``reference="auto"``: the `diagnostics.ConvergenceReport` of the latest run
        self.convergence = None
        self._t = self._evals = 0  # the latest chain's transitions and likelihood evaluations
        self._draw_evals: list[int] = []  # the likelihood evaluations of each transition
        self._chain = 0  # with rng="chains": the latest chain's row in its batch
        self._reset_run()
        super().__init__()

    def _reset_run(self) -> None:
        """Forget every piece of per-chain state (what ``cleanup`` does, as Pyro's HMC/NUTS do
        in theirs): the start (the user's ``initial_params`` too), the cached state and its
        log-likelihood, the likelihood function, the priors and the run's arguments. The
        statistics of the latest chain (`evaluations_per_draw`, `last_info`) stay readable
        until the next ``setup``; a finished batch of ``rng="chains"`` stays for the same
        reason and is never reused."""
        self._initial_params: dict[str, torch.Tensor] | None = None
        self._user_initial = False
        self._warmup_steps = 0
        self._loglik: float | None = None
        self._loglik_fn: Callable | None = None
        self._position: dict[str, torch.Tensor] | None = None  # the state _loglik belongs to
        self._versions: dict[str, int | None] = {}
        self._priors: list[GaussianSite] | None = None
        self._reference: PriorReference | None = None
        self._args: tuple = ()
        self._kwargs: dict = {}
        self._step = 0
        self._ready = False  # setup() done, cleanup() not yet

    def _reset_counters(self) -> None:
        self._t = 0
        self._evals = 0
        self._draw_evals = []
        self.last_info = None

    def __getstate__(self) -> dict:
        """What pickles: the configuration, the chain count and a user's ``initial_params``
        (Pyro's multiprocessing driver sets them before it sends the kernel to a worker); not
        the state of a run (its likelihood closures, open batches, cached data), which a worker
        builds again in its ``setup``."""
        state = self.__dict__.copy()
        for name in ("_loglik_fn", "_position", "_priors", "_reference", "_loglik", "_restore"):
            state[name] = None
        state.update(_args=(), _kwargs={}, _versions={}, _batch=None)
        state.update(_laplace=None, _laplace_key=None, last_info=None, _ready=False)
        return state

    # --- the MCMCKernel contract ------------------------------------------------------------

    @property
    def initial_params(self) -> dict[str, torch.Tensor] | None:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor] | None) -> None:
        self._initial_params = None if params is None else dict(params)
        self._user_initial = params is not None

    def setup(self, warmup_steps: int, *args: Any, **kwargs: Any) -> None:
        """Start a chain: split the model into its Gaussian priors and the likelihood and draw
        the start (``rng="global"``); or open a new batch of ``chains`` chains, or take the next
        chain of the open batch (``rng="chains"``)."""
        refuse_subsampling(kwargs)
        distributed.share_random_stream()
        self._ready = False
        if self.rng == "global":
            self._setup_one(warmup_steps, args, kwargs)
        else:
            self._setup_batch(warmup_steps, args, kwargs)
        self._ready = True

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One transition from ``params`` (``rng="chains"``: chain ``c``'s next state, advancing
        the whole batch when it is the first to ask).

        ``params`` is normally what the previous call returned (Pyro's driver passes it back),
        whose log-likelihood the kernel holds; any other position (a direct caller's, or one a
        ``hook_fn`` changed in place) has its log-likelihood computed first. With
        ``rng="chains"`` a chain can be moved to another position only while no chain of its
        batch has gone past its step (always with ``chains=None``).
        """
        if self.rng == "chains":
            return self._sample_batch(params)
        if not self._ready:
            raise RuntimeError("sample: call setup() first (the MCMC driver does)")
        if not self._priors:  # no latent sites: nothing to move (HMC/NUTS return {} too)
            self._t += 1
            return {}
        if not self._holds(params):
            self._restart_at(params)
        self._t += 1
        state = SliceState(self._position, np.array([self._loglik]))
        state, self.last_info = elliptical_slice_step(
            state,
            self._reference,
            lambda proposal, rows: [self.log_likelihood(proposal)],
            self.max_shrinks,
        )
        self._draw_evals.append(int(self.last_info.shrinks[0]) + 1)
        self._loglik = float(state.log_likelihood[0])
        self._cache_position(state.position)
        return state.position

    def _cache_position(self, position: dict[str, torch.Tensor]) -> None:
        """Remember the state ``self._loglik`` belongs to, with the tensors' version counters
        (an in-place change of a returned tensor is then noticed)."""
        self._position = position
        self._versions = {k: _version(v) for k, v in position.items()}

    def _holds(self, params: Any) -> bool:
        """Whether ``params`` is the cached state (same tensors, unchanged, or equal values)."""
        pos = self._position
        if pos is None or not isinstance(params, dict):
            return False
        for k, v in pos.items():
            p = params.get(k)
            if _version(v) != self._versions.get(k) or not isinstance(p, torch.Tensor):
                return False
            if p is not v and (p.shape != v.shape or not torch.equal(p.to(v), v)):
                return False
        return True

    def _restart_at(self, params: Any) -> dict[str, torch.Tensor]:
        """``params`` as a state of the latent sites, with its log-likelihood computed."""
        if not isinstance(params, dict):
            raise TypeError(
                f"params: expected a dict of the latent sites' values, got {type(params).__name__}"
            )
        names = [s.name for s in self._priors]
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"params: missing values for latent sites {missing}")
        state = {}
        for site in self._priors:
            value = torch.as_tensor(params[site.name]).to(site.mean)
            if tuple(value.shape) != tuple(site.shape):
                raise ValueError(
                    f"params[{site.name!r}]: expected shape {tuple(site.shape)}, got "
                    f"{tuple(value.shape)}"
                )
            state[site.name] = value
        loglik = self.log_likelihood(state)
        if math.isnan(loglik):
            raise ValueError("params: the log-likelihood at the given position is NaN")
        self._loglik = loglik
        self._cache_position(state)
        return state

    def _sample_batch(self, params: Any) -> dict[str, torch.Tensor]:
        batch = self._batch
        if batch is None or not self._ready:
            raise RuntimeError("sample: call setup() first (the MCMC driver does)")
        current = batch.states[self._step][self._chain]
        given = params.get("t") if isinstance(params, dict) else None
        if not isinstance(given, torch.Tensor) or given.shape != current.shape:
            got = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(
                f"params: expected {{'t': a tensor of shape {tuple(current.shape)}}}, got {got}"
            )
        if not torch.equal(given.to(current), current):
            batch.move(self._step, self._chain, given)
        self._step += 1
        while len(batch.states) <= self._step:
            batch.advance()
        self.last_info = batch.info
        self._t += 1
        # a copy: a caller's in-place change must not rewrite the batch's trajectory
        return {"t": batch.states[self._step][self._chain].clone()}

    def logging(self) -> OrderedDict:
        return OrderedDict([("evals/draw", f"{self.evaluations_per_draw:.2f}")])

    def diagnostics(self) -> dict:
        diag = {
            "divergences": [],
            "acceptance rate": 1.0,
            "evaluations per draw": self.evaluations_per_draw,
        }
        if self.rng == "chains":
            b = self._batch
            diag["passes per draw"] = b.passes / max(b.steps, 1)
            kept = slice(b.warmup + 1, self._step + 1)  # the chain's draws after warm-up
            diag["draw evaluations"] = np.array([e[self._chain] for e in b.step_evals[kept]])
            if isinstance(b, Population):  # the ν of the chain's t at every refit, per draw
                diag["reference df"] = b.reference_df(self._chain)
                diag["draw reference df"] = np.array([d[self._chain] for d in b.step_df[kept]])
        else:
            diag["draw evaluations"] = np.array(self._draw_evals[self._warmup_steps :])
        return diag

    def cleanup(self) -> None:
        """End a chain: put the user's BatchNorm buffers back and forget the chain's state
        (`_reset_run`), the user's ``initial_params`` included, so that the next ``setup`` (a
        new chain, or a new ``MCMC`` with this kernel) starts afresh, as Pyro's HMC/NUTS do."""
        if self._restore is not None:
            self._restore()  # the user's BatchNorm buffers
            self._restore = None
        b = self._batch
        if b is not None and b.opened >= b.size:
            if isinstance(b, Population) and not b.checked and self._step > b.warmup:
                b.checked = True  # Pyro's driver calls cleanup twice per chain
                draws = torch.stack(b.states[b.warmup + 1 : self._step + 1], 1)  # (C, n, K)
                self.convergence = check_draws(
                    {"t": draws},
                    populations=b.population,
                    kernel=self,
                )
            b.free()  # the batch is finished
        self._reset_run()

    @property
    def chain_populations(self) -> list[int] | None:
        """With ``reference="auto"``: the population of each chain of the latest batch (chains
        of one population are coupled through their references, populations independent), for
        `diagnostics.check`; else ``None``."""
        b = self._batch
        return list(b.population) if isinstance(b, Population) else None

    @property
    def evaluations_per_draw(self) -> float:
        """Mean number of likelihood evaluations of the current (after a run: the latest) chain
        per transition so far."""
        if self.rng == "chains":
            b = self._batch
            return 0.0 if b is None else float(b.evals[self._chain]) / max(b.steps, 1)
        return self._evals / max(self._t, 1)

    # --- the likelihood ---------------------------------------------------------------------

    def _likelihood(self, args: tuple, kwargs: dict) -> Callable | None:
        """``log L`` of ``{"t": t}``: a float for ``t`` ``(K,)``, float64 ``(B,)`` for a batch
        ``(B, K)`` (a `SubspaceNet`'s `Evaluator`, or the user's function); ``None`` for a Pyro
        model traced by `log_likelihood`. Sets ``self._restore`` (BatchNorm buffers)."""
        self._restore = None
        user = self._user_likelihood
        if user is not None:
            if self.rng == "global":
                return lambda params: float(user(params["t"]))
            return lambda params: torch.as_tensor(user(params["t"])).double()
        if not hasattr(self.model, "log_likelihood_fn"):
            return None
        if self.rng == "chains" and (args[0] if args else kwargs.get("x")) is None:
            return lambda params: 0.0  # no data: the posterior is the prior
        fn, self._restore = self.model.log_likelihood_fn(
            *args, chunk_size=self.chunk_size, recompute_bn=self.recompute_bn, **kwargs
        )
        return fn

    def log_likelihood(self, params: dict[str, torch.Tensor]) -> float:
        """``log L(θ)`` at one point: the tempered full-data log-likelihood of a `SubspaceNet`,
        the user's function, or a Pyro model's log joint minus its Gaussian log prior."""
        fn = self._loglik_fn
        if fn is None and self._batch is not None:  # after a run: the latest batch's data
            fn = self._batch.fn
        if fn is None and self._priors is None:
            raise RuntimeError("log_likelihood: call setup() first (the MCMC driver does)")
        self._evals += 1
        if fn is not None:
            return float(fn(params))
        latent = {s.name for s in self._priors}  # conditioned now, so marked observed: skip by name
        with torch.no_grad():
            conditioned = poutine.condition(self.model, data=params)
            trace = poutine.trace(conditioned).get_trace(*self._args, **self._kwargs)
            value = trace.log_prob_sum(
                site_filter=lambda name, site: (
                    name not in latent and not site["infer"].get("_deterministic")
                )
            )
        return float(value)

    # --- rng="global": one chain over the prior sites of a Pyro model ------------------------

    def _setup_one(self, warmup_steps: int, args: tuple, kwargs: dict) -> None:
        self._reset_counters()
        self._warmup_steps = warmup_steps
        self._args, self._kwargs = args, kwargs
        self._loglik_fn = self._likelihood(args, kwargs)
        if self._loglik_fn is not None and hasattr(self.model, "latent_model"):
            model = self.model.latent_model  # the latent sites alone
        else:
            model = self.model
        self._priors = gaussian_priors(
            model,
            () if model is not self.model else args,
            {} if model is not self.model else kwargs,
        )
        # gaussian_priors traced the model: a plate that subsamples was refused there
        if not self._priors:  # no latent sites: empty draws, as HMC/NUTS give
            self._initial_params = {}
            self._cache_position(self._initial_params)
            return
        self._reference = PriorReference(self._priors)
        if not self._user_initial:
            self._initial_params = {s.name: s.fn.sample() for s in self._priors}
        else:
            missing = {s.name for s in self._priors} - set(self._initial_params)
            if missing:
                raise ValueError(
                    f"initial_params: missing values for latent sites {sorted(missing)}"
                )
            for s in self._priors:
                value = self._initial_params[s.name]
                if tuple(value.shape) != tuple(s.shape):
                    raise ValueError(
                        f"initial_params[{s.name!r}]: expected shape {tuple(s.shape)}, "
                        f"got {tuple(value.shape)}"
                    )
        self._loglik = self.log_likelihood(self._initial_params)
        self._cache_position(self._initial_params)
        self._evals = 0  # count evaluations per transition only
        if not math.isfinite(self._loglik):
            where = "initial_params" if self._user_initial else "model"
            raise ValueError(
                f"{where}: the log-likelihood at the start (a draw from the prior) is "
                f"{self._loglik}; check the data and the network's outputs"
            )

    # --- rng="chains": batches of chains over t, a reference per chain -----------------------

    def _setup_batch(self, warmup_steps: int, args: tuple, kwargs: dict) -> None:
        if self.reference == "auto" and os.getpid() != self._pid:
            cores = max((os.cpu_count() or 2) - 1, 1)
            raise RuntimeError(
                f"reference='auto' advances its chains={self.chains} chains together in one "
                "process (each group's reference is fitted to the other group's current "
                "states), but Pyro's MCMC runs this chain in a worker process of its own (it "
                f"does when num_chains <= os.cpu_count() - 1 = {cores}). "
                "Keep the chains in this process: pass the MCMC to "
                "pyro_subspace.infer.ess.one_process, i.e. one_process(MCMC(kernel, "
                f"num_samples, warmup_steps, num_chains={self.chains})).run(...)"
            )
        size = self.chains if self.chains and os.getpid() == self._pid else 1
        batch = self._batch
        new = (
            batch is None
            or batch.opened >= batch.size
            or not _same(batch.args, args)
            or list(batch.kwargs) != list(kwargs)
            or not _same(tuple(batch.kwargs.values()), tuple(kwargs.values()))
            or batch.warmup != warmup_steps
        )
        if new:
            start = None
            if self._user_initial:
                start = torch.as_tensor(self._initial_params["t"]).double()
                if size > 1 and (start.dim() != 2 or start.shape[0] != size):
                    raise ValueError(
                        f"initial_params: with chains={size} set kernel.initial_params to "
                        f"{{'t': ({size}, K)}} (all chains start at once), got shape "
                        f"{tuple(start.shape)}; MCMC's initial_params needs chains=None"
                    )
            prior = self._prior if self.model is None else self.model.prior()
            self._loglik_fn = fn = self._likelihood(args, kwargs)
            mu, cov = self._initial_reference(prior, args, kwargs)
            first = self._chain_count
            if self.seed is not None and os.getpid() == self._pid:
                seeds = [(self.seed * _MIX + 7919 * (first + j)) % 2**63 for j in range(size)]
            else:
                seeds = torch.randint(0, 2**62, (size,)).tolist()
            loglik = self._batched(fn)
            kind = Population if self.reference == "auto" else ChainBatch
            self._batch = batch = kind(
                self, prior, loglik, mu, cov, seeds, warmup_steps, start, args, kwargs
            )
            batch.fn = fn
            self._chain_count += size
        self._chain = batch.opened
        batch.opened += 1
        self._step = 0
        self._initial_params = {"t": batch.states[0][self._chain].clone()}

    def _batched(self, fn: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        """``(B, K) -> (B,)`` float64 from the likelihood of ``{"t": t}``."""
        if self.recompute_bn and self._user_likelihood is None:  # BatchNorm at each point

            def one_by_one(t: torch.Tensor) -> torch.Tensor:
                values = [float(fn({"t": row})) for row in t]
                return torch.tensor(values, dtype=torch.float64, device=t.device)

            return one_by_one

        def batched(t: torch.Tensor) -> torch.Tensor:
            value = fn({"t": t})
            if not isinstance(value, torch.Tensor):  # no targets: a constant
                return t.new_zeros(t.shape[0], dtype=torch.float64) + value
            return value

        return batched

    def _initial_reference(self, prior: Any, args: tuple, kwargs: dict):
        """``(μ (K,), Σ (K, K))`` float64 of the reference before any adaptation."""
        ref = self.reference
        if isinstance(ref, str):
            if ref not in ("laplace", "auto") or self.model is None:  # "auto": Laplace or prior
                return gaussian_moments(prior)
            # the run's own argument objects, held and compared by identity (an id of a freed
            # object can come back): Pyro's MCMC.run passes the same (detached) tensors to
            # every chain of a run, and new ones to the next run, which therefore fits again
            key = (args, tuple(kwargs), tuple(kwargs.values()))
            old = self._laplace_key
            same = (
                old is not None
                and _same(old[0], args)
                and old[1] == key[1]
                and _same(old[2], key[2])
                and old[3:] == (self.model.temperature, self.model.rank)
            )
            key += (self.model.temperature, self.model.rank)
            if not same:  # fit once per data set, not once per chain
                from .laplace import AutoSubspaceLaplace

                guide = AutoSubspaceLaplace(self.model, chunk_size=min(self.chunk_size, 1024))
                # a reference needs no tight MAP: the sampler is exact for any reference, so
                # the search's ConvergenceWarning (about a fit the user did not ask for) is moot
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ConvergenceWarning)
                    guide.fit(*args, **kwargs, max_iter=100, tol=1e-3)
                self._laplace, self._laplace_key = gaussian_moments(guide), key
            return self._laplace
        return gaussian_moments(ref)


def one_process(mcmc: Any) -> Any:
    """Make Pyro's ``MCMC`` run its chains in this process, one after another.

    ``MCMC(kernel, ..., num_chains=C)`` starts a worker process per chain when the machine has
    more than ``C`` cores; ``EllipticalSliceSampler(reference="auto", chains=C)`` advances its
    ``C`` chains together and needs them in one process (in a worker it refuses). This replaces
    Pyro's multiprocessing runner by its sequential one with the same settings (Pyro's own
    choice on a machine with at most ``C`` cores); an ``MCMC`` already sequential is returned
    as it is. Relies on Pyro's ``MCMC.sampler`` attribute (``_MultiSampler`` and
    ``_UnarySampler``, pyro-ppl 1.8-1.9).

    Args:
        mcmc: a ``pyro.infer.MCMC`` not yet run.

    Returns:
        ``mcmc`` itself, for ``one_process(MCMC(...)).run(*args)``.
    """
    from pyro.infer.mcmc.api import _MultiSampler, _UnarySampler

    sampler = getattr(mcmc, "sampler", None)
    if sampler is None:
        raise TypeError(f"mcmc: expected a pyro.infer.MCMC, got {type(mcmc).__name__}")
    if isinstance(sampler, _MultiSampler):
        # the progress-bar setting went only to the runner's logging thread, which is stopped
        disable_progbar = sampler.log_thread._args[4]
        sampler.terminate()
        mcmc.sampler = _UnarySampler(
            sampler.kernel,
            sampler.num_samples,
            sampler.warmup_steps,
            sampler.num_chains,
            disable_progbar,
            initial_params=sampler.initial_params,
            hook=sampler.hook,
        )
    return mcmc


def _version(t: torch.Tensor) -> int | None:
    """A tensor's version counter (incremented by every in-place change); ``None`` for an
    inference-mode tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _same(a: tuple, b: tuple) -> bool:
    """The same call arguments, by identity (a new ``MCMC.run`` on other data starts a batch)."""
    return len(a) == len(b) and all(u is v for u, v in zip(a, b))
