"""Export posterior draws of any Pyro model to ArviZ.

`to_inference_data` builds the groups ``posterior``, ``log_likelihood`` (pointwise, so that
``az.loo``/``az.waic`` work), ``posterior_predictive``, ``observed_data`` and ``sample_stats``
from a finished ``pyro.infer.MCMC`` or from posterior samples plus the model and its data. The
model is re-run once per chunk of draws, vectorised over draws by an outer ``pyro.plate``, as
Pyro's ``Predictive(parallel=True)`` does. ArviZ's ``from_dict`` does the conversion; it exists
in arviz 0.x (keyword groups, returns ``InferenceData``) and 1.x (one dict of groups, returns a
``xarray.DataTree``).

Which log-likelihood: a tempered posterior ``p(t | D) ∝ p(t) Π_n p(y_n | t)^{1/T}`` (eq. 3 of
Subspace Inference) is the posterior of a model whose pointwise log-likelihood is
``log p(y_n | t)/T``; PSIS-LOO reweights the posterior by the inverse of that term, so
``to_inference_data`` exports it by default (``log_likelihood="tempered"``: each observed site's
``log_prob`` times its Pyro scale, i.e. ``1/T``; no minibatch scale, as the model runs on all the
data). ``log_likelihood="untempered"`` exports ``log p(y_n | t)``, the density of a new point;
with ``T != 1`` it does not match the draws, and a warning says so. The choice is stored in the
``log_likelihood`` group's attribute ``"log_likelihood"``. ``az.from_pyro(mcmc)`` (arviz 0.x)
works on a `SubspaceNet` too but always exports the untempered term.

Comparing models with ``T != 1``: on the tempered export ``az.loo``'s importance weights are
right but the ``elpd`` it reports is ``Σ_n log E_loo[p(y_n | t)^{1/T}]``, not a log predictive
density, so it is not comparable across temperatures or with untempered models (a measured
case: ``T = 20`` scored ``−1.6`` against ``−19.8`` for ``T = 1`` while its held-out log
predictive density was ``−30.5`` against ``−19.2``); on the untempered export the density is
right and the weights (``1/p`` instead of ``1/p^{1/T}``) are not. `tempered_loo` uses each
term for its role and returns the LOO result type of its engine, which that engine's
``compare`` takes: arviz 0.x's ``ELPDData`` (``az.psislw``; ``az.compare``) or, on ArviZ 1.x's
engine ``arviz_stats``, ``arviz_stats.ELPDData`` (``arviz_stats.compare``). So that the number
``az.loo`` prints is not taken for it, `to_inference_data` at ``T != 1`` says so once, in a
``UserWarning`` naming `tempered_loo` and in the ``log_likelihood`` group's attribute ``"loo"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.infer import MCMC
from pyro.poutine.subsample_messenger import _Subsample

from . import rng
from .validation import check_int, positive_float, positive_int


def _arviz() -> Any:
    """arviz, imported on first use: ``import pyro_subspace`` does not pay its import (1.2 s and
    135 MiB with xarray, pandas and matplotlib) unless an export or a LOO is asked for."""
    az = globals().get("az")
    if az is None:  # its import (and what it imports) leaves the global generators alone
        az = rng.import_keeping_state("arviz")
        globals()["az"] = az
    return az


def __getattr__(name: str) -> Any:  # ``convert.az``: arviz, imported when first read
    if name == "az":
        return _arviz()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def to_inference_data(
    mcmc: MCMC | None = None,
    *,
    samples: Mapping[str, torch.Tensor] | None = None,
    model: Callable[..., Any] | None = None,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    group_by_chain: bool = False,
    draws_per_chunk: int = 200,
    seed: int | None = None,
    log_likelihood: str = "tempered",
) -> Any:
    """Convert MCMC output or posterior samples to ArviZ data.

    Args:
        mcmc: a ``pyro.infer.MCMC`` after ``run``; its model and run arguments are reused
            unless ``model``/``args``/``kwargs`` are given.
        samples: instead of ``mcmc``: ``{site: (S, *shape)}``, or ``(C, S, *shape)`` with
            ``group_by_chain=True``.
        model, args, kwargs: the model and the arguments it was conditioned with (e.g.
            ``(x_train, y_train)``); required with ``samples``.
        draws_per_chunk: draws evaluated per vectorised model run (bounds memory).
        seed: seeds the posterior predictive draws (as ``pyro.set_rng_seed(seed)`` would, but
            torch's, NumPy's and Python's global generators are afterwards where they were);
            ``None``: they come from the caller's global generators, which they advance.
        log_likelihood: ``"tempered"`` (default): ``log p(y_n | θ)/T``, the term whose product
            with the prior the draws follow, which ``az.loo``/``az.waic`` need; or
            ``"untempered"``: ``log p(y_n | θ)``. Either way, with ``T != 1`` one
            ``UserWarning`` says that ``az.loo`` on the export is not the tempered LOO and
            names `tempered_loo` (which is).

    Returns:
        ``arviz.InferenceData`` (arviz 0.x) or ``xarray.DataTree`` (arviz 1.x) with groups
        posterior ``(chain, draw, ...)``, log_likelihood ``(chain, draw, N)`` per observed site
        (as chosen by ``log_likelihood``; attribute ``"log_likelihood"`` says which, e.g.
        ``"tempered: log p(y_n | theta) / T, T = 2"``; ``"tempered"`` and ``"temperature"``,
        which `tempered_loo` reads; with ``T != 1`` also ``"loo"``: the warning's note that
        ``az.loo`` on it is not the tempered LOO), posterior_predictive (draws of the
        observed sites at the same inputs), observed_data, and sample_stats (``lp``: the model's
        log joint as the sampler saw it, i.e. tempered and plate-scaled; ``diverging`` from MCMC
        diagnostics; after an `EllipticalSliceSampler` run also ``n_evals``, the likelihood
        evaluations of the transition that produced each draw, and with ``reference="auto"``
        ``reference_df``, the ``ν`` of the fitted t reference that transition used, ``inf``
        for a Gaussian), each ``(chain, draw)``.
    """
    kwargs = dict(kwargs or {})
    if log_likelihood not in ("tempered", "untempered"):
        raise ValueError(
            f"log_likelihood: expected 'tempered' or 'untempered', got {log_likelihood!r}"
        )
    if mcmc is not None:
        if samples is not None:
            raise ValueError("samples: give either mcmc or samples, not both")
        if not isinstance(mcmc, MCMC):
            raise TypeError(f"mcmc: expected a pyro.infer.MCMC, got {type(mcmc).__name__}")
        if getattr(mcmc, "_samples", None) is None:
            raise ValueError("mcmc: has no samples yet; call mcmc.run(...) first")
        grouped = mcmc.get_samples(group_by_chain=True)
        model = model if model is not None else mcmc.kernel.model
        if not args and not kwargs:
            args, kwargs = mcmc._args, dict(mcmc._kwargs)
    elif samples is not None:
        if model is None:
            raise ValueError("model: required together with samples")
        grouped = _check_samples(samples, group_by_chain)
    else:
        raise ValueError("mcmc: give an MCMC object or samples=... with model=...")
    positive_int(draws_per_chunk, "draws_per_chunk")
    check_int(seed, "seed", 0, allow_none=True)
    if model is None:
        raise ValueError("model: the MCMC kernel has no model; pass model=")
    n_chains, n_draws = next(iter(grouped.values())).shape[:2]
    flat = {k: v.reshape(n_chains * n_draws, *v.shape[2:]) for k, v in grouped.items()}

    # the model's draws (the trace, the posterior predictive) follow pyro.set_rng_seed(seed);
    # the caller's global generators are left as they were (seed=None: they are advanced)
    latent_model = getattr(model, "latent_model", None)  # a SubspaceNet: no forward pass
    if callable(latent_model) and samples is not None:
        with rng.preserved():  # the prior draw of this check leaves no trace in the streams
            latent = poutine.trace(latent_model).get_trace()
        _check_sample_shapes(flat, latent, latent_only=True)
    with rng.seeded(seed):
        prototype = poutine.trace(model).get_trace(*args, **kwargs)
        observed = [
            name for name, s in prototype.nodes.items() if _is_random(name, s) and s["is_observed"]
        ]
        nesting = max(
            [
                -f.dim
                for s in prototype.nodes.values()
                if s["type"] == "sample"
                for f in s["cond_indep_stack"]
                if f.vectorized
            ]
            + [0]
        )
        _check_sample_shapes(flat, prototype)  # every site and shape, before any model run
        pieces: dict[str, list[torch.Tensor]] = {"lp": []}
        scales: dict[str, float] = {}
        for start in range(0, n_chains * n_draws, draws_per_chunk):
            chunk = {k: v[start : start + draws_per_chunk] for k, v in flat.items()}
            trace = _vectorised_trace(model, chunk, prototype, nesting, args, kwargs)
            s = next(iter(chunk.values())).shape[0]
            lp = torch.zeros(s)
            for name, site in trace.nodes.items():
                if not _is_random(name, site):
                    continue
                site_lp = site["fn"].log_prob(site["value"])
                lp = lp + (site_lp * site["scale"]).reshape(s, -1).sum(-1).detach().cpu()
                if name in observed:
                    shape = prototype.nodes[name]["fn"].batch_shape
                    scale = float(site["scale"])
                    scales[name] = scale
                    ll = site_lp * scale if log_likelihood == "tempered" else site_lp
                    pieces.setdefault(f"ll:{name}", []).append(ll.reshape(s, *shape).detach().cpu())
                    draw = site["fn"].sample().reshape(s, *prototype.nodes[name]["value"].shape)
                    pieces.setdefault(f"pp:{name}", []).append(draw.detach().cpu())
            pieces["lp"].append(lp)

    def group(prefix: str) -> dict[str, np.ndarray]:
        return {
            key[len(prefix) :]: _by_chain(torch.cat(val), n_chains, n_draws)
            for key, val in pieces.items()
            if key.startswith(prefix)
        }

    groups: dict[str, dict[str, np.ndarray]] = {
        "posterior": {k: v.detach().cpu().numpy() for k, v in grouped.items()},
        "log_likelihood": group("ll:"),
        "posterior_predictive": group("pp:"),
        "observed_data": {n: prototype.nodes[n]["value"].detach().cpu().numpy() for n in observed},
        "sample_stats": {"lp": _by_chain(torch.cat(pieces["lp"]), n_chains, n_draws)},
    }
    if mcmc is not None:
        diag = mcmc.diagnostics()
        groups["sample_stats"]["diverging"] = _divergences(diag, n_chains, n_draws)
        groups["sample_stats"].update(_kernel_stats(diag, n_chains, n_draws))
    temps = ", ".join(
        f"T = {1 / v:.6g}" if len(scales) == 1 else f"{k}: T = {1 / v:.6g}"
        for k, v in scales.items()
    )
    tempered_run = any(v != 1.0 for v in scales.values())
    loo_note = (
        f"az.loo on this export is not the tempered LOO ({temps}): its one log-likelihood array "
        "serves as both the importance weight and the predictive density, right for only one "
        "of the two roles; use pyro_subspace.convert.tempered_loo(idata) for PSIS-LOO "
        "comparable across temperatures"
    )
    if tempered_run:  # one warning per export, after all chunks
        untempered = (
            "log_likelihood: exporting untempered log p(y_n | theta) while the draws follow the "
            "tempered posterior; az.loo's importance weights will not match them. "
            if log_likelihood == "untempered"
            else ""
        )
        warnings.warn(f"to_inference_data: {untempered}{loo_note}.", UserWarning, stacklevel=2)
    what = (
        "tempered: log p(y_n | theta) / T"
        if log_likelihood == "tempered"
        else "untempered: log p(y_n | theta)"
    )
    idata = _from_dict(groups)
    if observed:
        attrs = idata["log_likelihood"].attrs
        attrs["log_likelihood"] = f"{what}, {temps}"
        attrs["tempered"] = int(log_likelihood == "tempered")
        if len(set(scales.values())) == 1:  # one temperature: `tempered_loo` reads it
            attrs["temperature"] = 1 / next(iter(scales.values()))
        if tempered_run:
            attrs["loo"] = loo_note
    return idata


def tempered_loo(
    data: Any,
    temperature: float | None = None,
    var_name: str | None = None,
    reff: float | None = None,
    engine: str | None = None,
) -> Any:
    """PSIS-LOO of a tempered posterior: ``elpd = Σ_n log p(y_n | y_{−n})``, a predictive density
    comparable across temperatures and with untempered models (the engine's ``compare`` takes
    the result: ``az.compare`` on arviz 0.x, ``arviz_stats.compare`` on ArviZ 1.x's engine).

    The draws follow ``p_T(t | y) ∝ p(t) Π_n p(y_n | t)^{1/T}`` (Subspace Inference eq. 3), so
    leaving ``y_n`` out reweights draw ``s`` by ``r_sn = p(y_n | t_s)^{−1/T}``; ArviZ's PSIS
    (arviz 0.x's ``az.psislw`` or arviz_stats' ``psislw``) smooths ``log r``, and the
    leave-one-out predictive density averages the *untempered* ``p(y_n | t_s)`` under those
    weights: ``elpd_n = log Σ_s w̃_sn p(y_n | t_s)``. ``az.loo`` has one array for both roles,
    so on either export it is right only at ``T = 1`` (module docstring).

    Args:
        data: ArviZ data with a posterior and a ``log_likelihood`` group: an arviz 0.x
            ``InferenceData`` or an ArviZ 1.x (arviz-base) ``xarray.DataTree``, e.g. from
            `to_inference_data` (tempered or untempered export; its attributes give ``T``).
        temperature: ``T``; default the export's attribute ``"temperature"`` (a
            `to_inference_data` result with one observed site), required otherwise. The
            ``log_likelihood`` group is then read as untempered unless its attribute
            ``"tempered"`` is 1.
        var_name: the observed site; default the group's only variable.
        reff: relative efficiency of the draws for PSIS; default as ``az.loo``: the mean ESS
            of the posterior over the number of draws (1 with one chain).
        engine: whose PSIS and result type: ``"arviz"`` (arviz 0.x), ``"arviz_stats"`` (the
            engine of ArviZ 1.x, package ``arviz-stats``, which also installs beside arviz 0.x),
            or ``None`` (default): arviz 0.x if it is installed, else arviz_stats.

    Returns:
        With ``engine="arviz"``: arviz 0.x's ``ELPDData`` (``az.compare`` takes it) with
        ``pointwise`` entries: ``elpd_loo``, ``se``, ``p_loo`` (``lppd − elpd_loo``),
        ``n_samples``, ``n_data_points``, ``warning`` (a Pareto ``k`` above ArviZ's threshold),
        ``loo_i`` ``(N,)``, ``pareto_k`` ``(N,)``, ``scale="log"``, ``good_k``.
        With ``engine="arviz_stats"``: ``arviz_stats.ELPDData`` (``arviz_stats.compare``, i.e.
        ArviZ 1.x's ``az.compare``, takes it), as ``arviz_stats.loo(..., pointwise=True)``
        returns it: ``elpd``, ``se``, ``p`` (``lppd − elpd``), ``n_samples``,
        ``n_data_points``, ``warning``, ``good_k``, ``elpd_i`` and ``pareto_k`` over the
        observation dimensions of the ``log_likelihood`` variable, ``log_weights`` (the
        smoothed tempered weights). The two types do not mix in one comparison.
    """
    engine = _loo_engine(engine)
    names = _group_names(data)
    if "log_likelihood" not in names or "posterior" not in names:
        raise TypeError(
            f"data: expected ArviZ data with posterior and log_likelihood groups, got "
            f"{type(data).__name__}; convert an MCMC run first: "
            "tempered_loo(to_inference_data(mcmc))"
        )
    if reff is not None:
        reff = positive_float(reff, "reff")
    group = _dataset(data["log_likelihood"])
    names = list(group.data_vars)
    if var_name is None:
        if len(names) != 1:
            raise ValueError(f"var_name: the log_likelihood group has {names}; name one")
        var_name = names[0]
    if var_name not in names:
        raise ValueError(f"var_name: {var_name!r} is not in the log_likelihood group {names}")
    attrs = group.attrs
    if temperature is None:
        if "temperature" not in attrs:
            raise ValueError("temperature: not recorded with the data; pass temperature=T")
        temperature = float(attrs["temperature"])
    temperature = positive_float(temperature, "temperature")
    log_lik = group[var_name].astype(np.float64)  # (chain, draw, *obs)
    if int(attrs.get("tempered", 0)):
        log_lik = log_lik * temperature  # back to log p(y_n | t_s)
    stacked = log_lik.stack(__sample__=("chain", "draw"))
    ll = stacked.values.reshape(-1, stacked.shape[-1])  # (N, S)
    n_points, n_samples = ll.shape
    if n_samples < 2:
        raise ValueError(
            f"data: PSIS-LOO needs at least 2 posterior draws, got {n_samples}; draw more samples"
        )
    if reff is None:
        posterior = _dataset(data["posterior"])
        chains = posterior.sizes.get("chain", 1)
        reff = 1.0
        if chains > 1:
            if engine == "arviz":
                ess = _arviz().ess(posterior, method="mean")
            else:
                import arviz_stats  # noqa: F401  (registers the .azstats accessor)

                ess = posterior.azstats.ess(method="mean")
            reff = float(np.hstack([ess[v].values.ravel() for v in ess.data_vars]).mean())
            reff /= n_samples
    if engine == "arviz_stats":
        return _tempered_loo_arviz_stats(log_lik, var_name, temperature, reff)
    from arviz.stats.stats_utils import ELPDData
    from scipy.special import logsumexp

    log_w, pareto_k = _arviz().psislw(-ll / temperature, reff)
    loo_i = logsumexp(np.asarray(log_w) + ll, axis=-1)
    lppd = float((logsumexp(ll, axis=-1) - np.log(n_samples)).sum())
    elpd = float(loo_i.sum())
    good_k = min(1 - 1 / np.log10(n_samples), 0.7)
    k = np.asarray(pareto_k)
    return ELPDData(
        data=[
            elpd, float((n_points * loo_i.var()) ** 0.5), lppd - elpd, n_samples, n_points,
            bool((k > good_k).any()), _data_array(loo_i, "loo_i"),
            _data_array(k, "pareto_shape"), "log", good_k,
        ],
        index=[
            "elpd_loo", "se", "p_loo", "n_samples", "n_data_points", "warning", "loo_i",
            "pareto_k", "scale", "good_k",
        ],
    )  # fmt: skip


def _tempered_loo_arviz_stats(log_lik: Any, var_name: str, temperature: float, reff: float):
    """``arviz_stats.loo`` on the untempered ``log_lik`` ``(chain, draw, *obs)`` with the PSIS
    weights of the tempered term ``log_lik / T`` (arviz_stats' psislw negates its input)."""
    import arviz_stats
    import xarray as xr

    log_lik = log_lik.rename(var_name)
    log_w, pareto_k = (log_lik / temperature).azstats.psislw(r_eff=reff, dim=["chain", "draw"])
    tree = xr.DataTree.from_dict({"log_likelihood": xr.Dataset({var_name: log_lik})})
    return arviz_stats.loo(
        tree, pointwise=True, var_name=var_name, reff=reff, log_weights=log_w, pareto_k=pareto_k
    )


def _loo_engine(engine: str | None) -> str:
    """``"arviz"`` (arviz 0.x's PSIS) or ``"arviz_stats"``, checked to be importable."""
    if engine not in (None, "arviz", "arviz_stats"):
        raise ValueError(f"engine: expected None, 'arviz' or 'arviz_stats', got {engine!r}")
    az = _arviz()
    arviz0 = int(az.__version__.split(".")[0]) < 1 and hasattr(az, "psislw")
    if engine == "arviz" or (engine is None and arviz0):
        if not arviz0:
            raise ImportError(
                f"tempered_loo: engine='arviz' needs arviz 0.x (az.psislw); arviz "
                f"{az.__version__} is installed: use engine='arviz_stats' (pip install arviz-stats)"
            )
        return "arviz"
    try:
        import arviz_stats  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "tempered_loo: needs a PSIS engine: arviz 0.x (pip install 'arviz<1') or "
            f"arviz_stats (pip install arviz-stats, ArviZ 1.x's engine); arviz {az.__version__} "
            "is installed and arviz_stats cannot be imported"
        ) from err
    return "arviz_stats"


def _group_names(data: Any) -> list[str]:
    """The groups of an arviz 0.x ``InferenceData`` or an ``xarray.DataTree`` (ArviZ 1.x)."""
    groups = getattr(data, "groups", None)
    if callable(groups):  # InferenceData.groups()
        return list(groups())
    children = getattr(data, "children", None)  # DataTree: its child nodes
    return list(children) if isinstance(children, Mapping) else []


def _dataset(group: Any) -> Any:
    """An ``xarray.Dataset`` of a group (a ``DataTree`` node is converted)."""
    import xarray as xr

    return group if isinstance(group, xr.Dataset) else group.to_dataset()


def _check_sample_shapes(flat: dict, trace: poutine.Trace, latent_only: bool = False) -> None:
    """Every sampled site is a site of the model with the model's shape (``latent_only``: only
    the sites ``trace`` has are checked, e.g. a model's latent part traced without data)."""
    for name, value in flat.items():
        site = trace.nodes.get(name)
        if site is None:
            if latent_only:
                continue
            raise ValueError(f"samples: site {name!r} is not a sample site of the model")
        if _is_random(name, site) and tuple(value.shape[1:]) != tuple(site["value"].shape):
            raise ValueError(
                f"samples[{name!r}]: draws of shape {tuple(value.shape[1:])}, but the model's "
                f"site has shape {tuple(site['value'].shape)} (samples of another model, e.g. "
                "another rank K?)"
            )


def _data_array(values: np.ndarray, name: str) -> Any:
    import xarray as xr

    return xr.DataArray(values, dims=("observation",), name=name)


def _check_samples(
    samples: Mapping[str, torch.Tensor], group_by_chain: bool
) -> dict[str, torch.Tensor]:
    if not isinstance(samples, Mapping) or not samples:
        raise TypeError("samples: expected a non-empty dict {site name: tensor}")
    lead = 2 if group_by_chain else 1
    sizes = set()
    for name, value in samples.items():
        if not isinstance(value, torch.Tensor) or value.dim() < lead:
            raise ValueError(
                f"samples[{name!r}]: expected a tensor with {lead} leading sample dims"
            )
        if not torch.isfinite(value).all():
            raise ValueError(f"samples[{name!r}]: contains NaN or inf")
        sizes.add(tuple(value.shape[:lead]))
    if len(sizes) != 1:
        raise ValueError(f"samples: sites disagree on the number of draws: {sorted(sizes)}")
    if group_by_chain:
        return dict(samples)
    return {k: v.unsqueeze(0) for k, v in samples.items()}


def _vectorised_trace(model, chunk, prototype, nesting, args, kwargs) -> poutine.Trace:
    """Trace ``model`` once with the draws in ``chunk`` stacked along a new outer plate."""
    s = next(iter(chunk.values())).shape[0]
    data = {}
    for name, value in chunk.items():
        site = prototype.nodes.get(name)
        if site is None:
            raise ValueError(f"samples: site {name!r} is not a sample site of the model")
        batch_dims = len(site["fn"].batch_shape)
        data[name] = value.reshape(s, *([1] * (nesting - batch_dims)), *site["value"].shape)

    def vectorised(*a, **k):
        with pyro.plate("_draws", s, dim=-nesting - 1):
            return model(*a, **k)

    conditioned = poutine.condition(vectorised, data=data)
    with torch.no_grad():
        return poutine.trace(conditioned).get_trace(*args, **kwargs)


def _is_random(name: str, site: dict) -> bool:
    """A sample site that is not a ``pyro.deterministic`` record, a plate, or our internal plate."""
    return (
        site["type"] == "sample"
        and not name.startswith("_")
        and not site["infer"].get("_deterministic")
        and not isinstance(site["fn"], _Subsample)
    )


def _by_chain(value: torch.Tensor, n_chains: int, n_draws: int) -> np.ndarray:
    return value.reshape(n_chains, n_draws, *value.shape[1:]).numpy()


def _divergences(diag: dict, n_chains: int, n_draws: int) -> np.ndarray:
    diverging = np.zeros((n_chains, n_draws), dtype=bool)
    info = diag.get("divergences", {})
    for chain, idx in info.items():
        c = int(str(chain).split()[-1]) if not isinstance(chain, int) else chain
        diverging[c, list(idx)] = True
    return diverging


#: the per-draw statistics an `EllipticalSliceSampler` reports in ``mcmc.diagnostics()``, and
#: their names in ``sample_stats``
KERNEL_STATS = {"draw evaluations": "n_evals", "draw reference df": "reference_df"}


def _kernel_stats(diag: dict, n_chains: int, n_draws: int) -> dict[str, np.ndarray]:
    """``{name: (chains, draws)}``: the per-draw statistics the kernel reported for every chain
    in ``diag`` (``mcmc.diagnostics()``, `KERNEL_STATS`); a statistic some chain lacks, or with
    another length, is left out."""
    out = {}
    for key, name in KERNEL_STATS.items():
        per_chain = diag.get(key, {})
        rows = [per_chain.get(f"chain {c}") for c in range(n_chains)]
        if all(r is not None and np.shape(r) == (n_draws,) for r in rows):
            out[name] = np.stack([np.asarray(r) for r in rows])
    return out


def _from_dict(groups: dict[str, dict[str, np.ndarray]]) -> Any:
    groups = {name: vals for name, vals in groups.items() if vals}
    az = _arviz()
    if int(az.__version__.split(".")[0]) >= 1:  # arviz 1.x: one dict of groups, a DataTree
        return az.from_dict(groups)
    return az.from_dict(**groups)  # arviz 0.x: groups as keywords, an InferenceData
