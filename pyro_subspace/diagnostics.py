"""Convergence diagnostics that speak up: split R-hat and bulk/tail ESS after an MCMC run.

`check(mcmc)` takes any Pyro ``MCMC`` that has run (over a `SubspaceNet` or any model:
`EllipticalSliceSampler`, ``NUTS``, ``HMC``), computes per coordinate of every latent site the
rank-normalised split R-hat (the larger of the bulk and the folded one) and the bulk and tail
effective sample sizes with ArviZ's estimators (``arviz.rhat``, ``arviz.ess``: Vehtari,
Gelman, Simpson, Carpenter & Bürkner 2021, "Rank-normalization, folding, and localization: an
improved R-hat for assessing convergence of MCMC", Bayesian Analysis 16), and emits one
`ConvergenceWarning` naming every coordinate past the thresholds those authors recommend, with
its numbers and what to do:

- R-hat above ``max_rhat = 1.01``;
- a bulk or tail ESS below ``min_ess_per_chain = 100`` per chain (400 for 4 chains);
- divergent transitions after warm-up (``NUTS``/``HMC``: Pyro's ``"divergences"``).

*Coupled chains.* ``EllipticalSliceSampler(reference="auto")`` couples the chains of a
population through the references its groups fit to each other, which can make chains agree
with each other without having explored the posterior. Its chains form two independent
populations; besides the R-hat over the chains, `check` computes the R-hat over the
populations (each population's chains interleaved in time into one sequence: its split halves
are its earlier and later draws) and reports the larger. The kernel runs `check` itself at the
end of such a run (Pyro gives kernels no after-run hook: it runs in the ``cleanup`` that Pyro's
driver calls after the last chain's draws) and keeps the result as ``kernel.convergence``;
every other run is checked by calling `check`. When the populations agree with each other
and the chains do not, the warning says so: chains that switch slowly between parts of the
posterior (the two modes of the toy T = 1, K = 20 row of ``benchmarks/ess_vs_nuts.py``) need
more draws each, not another reference.

`check_draws` does the same for draws held as arrays ``(chains, draws, ...)`` (e.g.
``mcmc.get_samples(group_by_chain=True)``, or chains from `infer.run_chains`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import rng
from .exceptions import ConvergenceWarning

__all__ = ["ConvergenceReport", "check", "check_draws"]

MAX_RHAT = 1.01
MIN_ESS_PER_CHAIN = 100


@dataclass
class ConvergenceReport:
    """What `check` found.

    Attributes:
        rhat: ``{site: (*shape)}`` the rank-normalised split R-hat of each coordinate (with
            populations: the larger of the chains' and the populations' R-hat).
        ess_bulk: ``{site: (*shape)}`` the bulk effective sample size.
        ess_tail: ``{site: (*shape)}`` the tail effective sample size (5 % and 95 % quantiles).
        rhat_populations: ``{site: (*shape)}`` the R-hat across independent populations, or
            ``None`` when the chains form none.
        chains: the number of chains ``C``; ``draws`` the draws per chain.
        divergences: divergent transitions after warm-up, all chains together.
        problems: one line per failed check (empty when the run passed).
    """

    rhat: dict[str, np.ndarray]
    ess_bulk: dict[str, np.ndarray]
    ess_tail: dict[str, np.ndarray]
    rhat_populations: dict[str, np.ndarray] | None
    chains: int
    draws: int
    divergences: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return not self.problems

    @property
    def max_rhat(self) -> float:
        """The largest R-hat over all coordinates (``nan`` if any is not computable)."""
        return _extreme(self.rhat, max)

    @property
    def min_ess_bulk(self) -> float:
        """The smallest bulk ESS over all coordinates."""
        return _extreme(self.ess_bulk, min)

    @property
    def min_ess_tail(self) -> float:
        """The smallest tail ESS over all coordinates."""
        return _extreme(self.ess_tail, min)


def check(
    mcmc: Any,
    *,
    max_rhat: float = MAX_RHAT,
    min_ess_per_chain: float = MIN_ESS_PER_CHAIN,
    warn: bool = True,
) -> ConvergenceReport:
    """Split R-hat and bulk/tail ESS of every coordinate of a run; a `ConvergenceWarning` when
    the run has not converged (module notes).

    Args:
        mcmc: a ``pyro.infer.MCMC`` after ``run``; its kernel may be any (``NUTS``: its
            divergences are counted; `EllipticalSliceSampler` with ``reference="auto"``: R-hat
            also across its independent populations).
        max_rhat: the largest acceptable R-hat.
        min_ess_per_chain: the smallest acceptable bulk and tail ESS, per chain.
        warn: emit the warning (else only return the report).

    Returns:
        A `ConvergenceReport`; ``report.ok`` is False exactly when the warning was emitted.

    Example:
        >>> import pyro.distributions as dist
        >>> from pyro.infer import MCMC
        >>> from pyro_subspace.infer import EllipticalSliceSampler
        >>> prior = dist.Normal(torch.zeros(2), 1.0).to_event(1)
        >>> kernel = EllipticalSliceSampler(prior=prior, log_likelihood=lambda t: 0.0)
        >>> mcmc = MCMC(kernel, num_samples=1000, warmup_steps=50, num_chains=2,
        ...             disable_progbar=True)
        >>> mcmc.run()  # doctest: +SKIP
        >>> report = check(mcmc)  # doctest: +SKIP
    """
    if not hasattr(mcmc, "get_samples") or getattr(mcmc, "_samples", None) is None:
        raise TypeError(
            f"mcmc: expected a pyro.infer.MCMC after run(), got {type(mcmc).__name__}"
            + (" that has not run" if hasattr(mcmc, "get_samples") else "")
        )
    samples = mcmc.get_samples(group_by_chain=True)
    kernel = getattr(mcmc, "kernel", None)
    populations = getattr(kernel, "chain_populations", None)
    chains = next(iter(samples.values())).shape[0] if samples else 0
    if populations is not None and len(populations) != chains:
        populations = None  # a run with fewer chains than the kernel's population
    divergences = 0
    diag = mcmc.diagnostics() if samples else {}
    for per_chain in diag.get("divergences", {}).values():
        divergences += len(per_chain)
    return check_draws(
        samples,
        divergences=divergences,
        populations=populations,
        max_rhat=max_rhat,
        min_ess_per_chain=min_ess_per_chain,
        warn=warn,
        kernel=kernel,
        stacklevel=3,
    )


def check_draws(
    draws: dict[str, Any],
    *,
    divergences: int = 0,
    populations: list[int] | None = None,
    max_rhat: float = MAX_RHAT,
    min_ess_per_chain: float = MIN_ESS_PER_CHAIN,
    warn: bool = True,
    kernel: Any = None,
    stacklevel: int = 2,
) -> ConvergenceReport:
    """`check` on draws ``{site: (chains, draws, *shape)}`` (tensors or arrays).

    Args:
        draws: the draws of each site, grouped by chain.
        divergences: divergent transitions to report.
        populations: ``C`` labels: chain ``c`` belongs to population ``populations[c]``
            (chains of one population are coupled, populations independent); R-hat is then
            also computed across populations (module notes).
        max_rhat, min_ess_per_chain, warn: as in `check`.
        kernel: the kernel that drew them, for the warning's advice (``NUTS``/``HMC``, the
            elliptical slice kernel with ``reference="auto"``, or ``None``: generic).
        stacklevel: of the warning.

    Returns:
        A `ConvergenceReport`.
    """
    if not isinstance(draws, dict):
        raise TypeError(f"draws: expected a dict {{site: (chains, draws, ...)}}, got {draws!r}")
    if not max_rhat > 1:
        raise ValueError(f"max_rhat: expected a number > 1, got {max_rhat!r}")
    if not min_ess_per_chain >= 0:
        raise ValueError(f"min_ess_per_chain: expected a number >= 0, got {min_ess_per_chain!r}")
    arrays = {}
    for name, value in draws.items():
        value = value.detach().cpu().double().numpy() if hasattr(value, "detach") else value
        value = np.asarray(value, dtype=np.float64)
        if value.ndim < 2:
            raise ValueError(
                f"draws[{name!r}]: expected (chains, draws, ...), got shape {value.shape}"
            )
        arrays[name] = value
    shapes = {v.shape[:2] for v in arrays.values()}
    if len(shapes) > 1:
        raise ValueError(f"draws: every site needs the same (chains, draws), got {sorted(shapes)}")
    chains, length = shapes.pop() if shapes else (0, 0)
    if populations is not None:
        populations = list(populations)
        if len(populations) != chains:
            raise ValueError(
                f"populations: expected one label per chain ({chains}), got {len(populations)}"
            )
    az = rng.import_keeping_state("arviz")
    with warnings.catch_warnings():  # ArviZ's own notes on short chains: the report says it
        warnings.simplefilter("ignore")
        data = az.convert_to_dataset(arrays) if arrays else None
        rhat = _per_site(az.rhat(data), arrays) if arrays else {}
        bulk = _per_site(az.ess(data, method="bulk"), arrays) if arrays else {}
        tail = _per_site(az.ess(data, method="tail"), arrays) if arrays else {}
        by_population = None
        labels = sorted(set(populations)) if populations is not None else []
        if len(labels) >= 2:
            pooled = {k: _interleave(v, populations, labels) for k, v in arrays.items()}
            by_population = _per_site(az.rhat(az.convert_to_dataset(pooled)), arrays)
    combined = rhat
    if by_population is not None:
        combined = {k: np.fmax(rhat[k], by_population[k]) for k in rhat}
    report = ConvergenceReport(
        combined, bulk, tail, by_population, chains, length, int(divergences)
    )
    report.problems = _problems(
        report, rhat, max_rhat, min_ess_per_chain * chains, min_ess_per_chain
    )
    if warn and report.problems:
        warnings.warn(_message(report, _advice(kernel)), ConvergenceWarning, stacklevel=stacklevel)
    return report


# --- helpers ---------------------------------------------------------------------------------


def _per_site(dataset: Any, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        k: np.asarray(dataset[k].values, dtype=np.float64).reshape(v.shape[2:])
        for k, v in arrays.items()
    }


def _interleave(values: np.ndarray, populations: list[int], labels: list[int]) -> np.ndarray:
    """``(P, draws · g, ...)``: population ``p``'s chains interleaved step by step (draw ``j``
    of each of its chains, then draw ``j + 1``), so that its sequence runs forward in time.
    Populations of unequal size are cut to the smallest."""
    size = min(populations.count(p) for p in labels)
    out = []
    for p in labels:
        rows = [c for c, q in enumerate(populations) if q == p][:size]
        block = values[rows]  # (g, n, ...)
        out.append(np.swapaxes(block, 0, 1).reshape((-1, *values.shape[2:])))
    return np.stack(out)


def _coordinate(name: str, index: tuple[int, ...]) -> str:
    return name if not index else f"{name}[{', '.join(str(i) for i in index)}]"


def _extreme(values: dict[str, np.ndarray], pick) -> float:
    flat = [float(x) for v in values.values() for x in np.ravel(v)]
    if not flat:
        return math.nan
    if any(math.isnan(x) for x in flat):
        return math.nan
    return pick(flat)


def _problems(report, chain_rhat, max_rhat, min_ess, per_chain) -> list[str]:
    out = []
    for name, values in report.rhat.items():
        for index in np.ndindex(values.shape):
            where = _coordinate(name, index)
            r = float(values[index])
            b, t = float(report.ess_bulk[name][index]), float(report.ess_tail[name][index])
            parts = []
            if not math.isfinite(r) or r > max_rhat:
                detail = f"R-hat {r:.3f} > {max_rhat}"
                if report.rhat_populations is not None:
                    detail += (
                        f" (chains {float(chain_rhat[name][index]):.3f}, across independent "
                        f"populations {float(report.rhat_populations[name][index]):.3f})"
                    )
                parts.append(detail)
            if not math.isfinite(b) or b < min_ess:
                parts.append(f"bulk ESS {b:.0f} < {min_ess:.0f}")
            if not math.isfinite(t) or t < min_ess:
                parts.append(f"tail ESS {t:.0f} < {min_ess:.0f}")
            if parts:
                out.append(f"{where}: " + ", ".join(parts))
    if out:
        out.append(
            f"(thresholds: R-hat <= {max_rhat}, bulk and tail ESS >= {per_chain:g} per chain × "
            f"{report.chains} chains)"
        )
    if report.rhat_populations is not None and _only_chains_disagree(report, chain_rhat, max_rhat):
        out.append(
            f"(the independent populations agree with each other, R-hat across them <= "
            f"{max_rhat}, while single chains do not: chains move slowly between parts of the "
            "posterior, e.g. between modes, which a sharp T = 1 posterior can have; the chains "
            "need more draws each until they agree too)"
        )
    if report.divergences:
        out.append(f"{report.divergences} divergent transitions after warm-up")
    return out


def _only_chains_disagree(report: ConvergenceReport, chain_rhat, max_rhat: float) -> bool:
    """Whether some chains' R-hat exceeds ``max_rhat`` while every R-hat across the
    populations stays within it."""
    chains = _extreme(chain_rhat, max)
    return chains > max_rhat and _extreme(report.rhat_populations, max) <= max_rhat


def _message(report: ConvergenceReport, advice: str | None) -> str:
    coords = [p for p in report.problems if p[0] != "(" and "divergent" not in p]
    notes = [p for p in report.problems if p not in coords]
    if len(coords) > 8:  # the count says the rest
        coords = coords[:8] + [f"... and {len(coords) - 8} more coordinates"]
    what = advice or (
        "run longer (more warmup_steps and num_samples), more chains, or "
        "EllipticalSliceSampler(model, reference='auto', chains=4 (K + 2))"
    )
    if report.divergences:
        what += (
            "; divergences mark regions NUTS/HMC cannot integrate: raise target_accept_prob "
            "(e.g. 0.95), or sample with EllipticalSliceSampler(model, reference='auto', ...)"
        )
    return (
        f"MCMC has not converged ({report.chains} chains × {report.draws} draws): "
        + "; ".join(coords + notes)
        + f". Do not trust its means and intervals yet: {what}."
    )


def _advice(kernel: Any) -> str | None:
    """What to do, for the kernel that ran."""
    if kernel is None:
        return None
    if getattr(kernel, "reference", None) == "auto":
        return (
            "draw more per chain (num_samples) and warm up longer (warmup_steps), or run more "
            "chains (chains=C, groups of C/4 >= K + 2 states)"
        )
    name = type(kernel).__name__
    if name in ("NUTS", "HMC"):
        return (
            f"run {name} longer (warmup_steps, num_samples) or use "
            "EllipticalSliceSampler(model, reference='auto', chains=4 (K + 2))"
        )
    return None
