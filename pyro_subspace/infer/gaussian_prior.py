"""Split a Pyro model into a fixed Gaussian prior over its latents and the rest.

Elliptical slice sampling needs the joint density written as ``N(θ | μ, Σ) · L(θ)``. This module
traces the model, checks that it does not subsample, that every latent site has a Gaussian prior
(``Normal`` or ``MultivariateNormal``, possibly wrapped by ``.to_event``/``.expand``) whose
log-density no handler changes (a trace records every handler's effect on a site's density as
its ``scale`` and ``mask``: ``poutine.scale``, ``poutine.mask``, a subsampled plate) and whose
parameters do not change when the other latents change, and returns those priors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pyro import poutine
from pyro.distributions import Independent, MultivariateNormal, Normal
from pyro.distributions.torch_distribution import ExpandedDistribution
from pyro.poutine.subsample_messenger import _Subsample

from ..exceptions import SubsamplingError, UnsupportedModelError


@dataclass
class GaussianSite:
    """One latent site's prior: its mean and zero-mean prior draws, both of shape ``shape``."""

    name: str
    fn: Any  # the site's distribution, as traced
    shape: torch.Size

    def __post_init__(self) -> None:
        base = _base_gaussian(self.fn)
        self.mean = self.fn.mean.expand(self.shape)
        if isinstance(base, MultivariateNormal):
            self._tril = base.scale_tril.expand(*self.shape, self.shape[-1])
            self._std = None
        else:
            self._std = base.scale.expand(self.shape)

    def centred_draw(self) -> torch.Tensor:
        """``ν ~ N(0, Σ)``: a prior draw minus the prior mean (no distribution object per draw)."""
        eps = torch.randn(self.shape, dtype=self.mean.dtype, device=self.mean.device)
        if self._std is not None:
            return self._std * eps
        return (self._tril @ eps.unsqueeze(-1)).squeeze(-1)


def is_latent(name: str, site: dict) -> bool:
    """A sample site that the model draws (not observed, deterministic, or a plate index)."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not site["infer"].get("_deterministic")
        and not isinstance(site["fn"], _Subsample)
    )


def _base_gaussian(fn: Any) -> Any | None:
    """The Normal/MultivariateNormal under ``Independent``/expand wrappers, or ``None``."""
    while True:
        if isinstance(fn, (Normal, MultivariateNormal)):
            return fn
        if not isinstance(fn, (Independent, ExpandedDistribution)):
            return None
        fn = fn.base_dist


def _parameters(fn: Any) -> list[torch.Tensor]:
    base = _base_gaussian(fn)
    if isinstance(base, MultivariateNormal):
        return [base.loc, base.scale_tril]
    return [base.loc, base.scale]


def gaussian_priors(model: Callable, args: tuple, kwargs: dict) -> list[GaussianSite]:
    """Check that ``model``'s latents all have fixed Gaussian priors and return them (an empty
    list for a model without latent sample sites).

    Raises:
        SubsamplingError: the model subsamples a plate (checked first: a latent in a subsampled
            plate is also scaled by it).
        UnsupportedModelError: (a ``ValueError`` and a ``TypeError``) naming the first latent
            site whose prior is not Gaussian, whose log-density a handler changes
            (``poutine.scale``, ``poutine.mask`` with a mask that is not all true), or whose
            Gaussian parameters change when the other latents change (tested by re-running the
            model with every latent shifted).
    """
    with torch.no_grad():
        trace = poutine.trace(model).get_trace(*args, **kwargs)
    check_full_data(trace)
    sites = [(n, s) for n, s in trace.nodes.items() if is_latent(n, s)]
    for name, site in sites:
        if _base_gaussian(site["fn"]) is None:
            raise UnsupportedModelError(
                f"site {name!r}: elliptical slice sampling needs a Gaussian prior (Normal or "
                f"MultivariateNormal), got {_describe(site['fn'])}"
            )
        check_unchanged_density(name, site)
    if not sites:
        return []
    shifted = {n: s["value"] + 1.0 for n, s in sites}
    with torch.no_grad():
        trace2 = poutine.trace(poutine.condition(model, data=shifted)).get_trace(*args, **kwargs)
    for name, site in sites:
        other = trace2.nodes.get(name)
        same = other is not None and all(
            a.shape == b.shape and torch.equal(a, b)
            for a, b in zip(_parameters(site["fn"]), _parameters(other["fn"]))
        )
        if not same:
            raise UnsupportedModelError(
                f"site {name!r}: its Gaussian prior's parameters depend on other latent sites; "
                "elliptical slice sampling needs a fixed Gaussian prior for every latent"
            )
    return [GaussianSite(n, s["fn"], s["value"].shape) for n, s in sites]


def check_unchanged_density(name: str, site: dict) -> None:
    """Raise `UnsupportedModelError` if a handler changed the traced latent site's log-density.

    A trace holds every handler's effect on a site's log-density in two fields, which
    ``Trace.compute_log_prob`` applies (``pyro.poutine.util.scale_and_mask``): ``scale``
    (``poutine.scale``, a subsampled plate) and ``mask`` (``poutine.mask``, ``obs_mask``'s
    unobserved half). A scale other than 1 tempers the prior; a mask that is false anywhere
    leaves those elements without a prior density (an improper flat prior): neither is the
    Gaussian prior elliptical slice sampling moves under. An all-true mask changes nothing.
    """
    scale = site["scale"]
    if not bool(torch.all(torch.as_tensor(scale) == 1.0)):
        raise UnsupportedModelError(
            f"site {name!r}: a latent under poutine.scale (scale {_show(scale)}) is not a "
            "Gaussian prior; elliptical slice sampling needs the prior's own density"
        )
    mask = site["mask"]
    if mask is not None and not bool(torch.all(torch.as_tensor(mask))):
        which = "mask=False" if not bool(torch.any(torch.as_tensor(mask))) else "a partial mask"
        raise UnsupportedModelError(
            f"site {name!r}: a latent under poutine.mask ({which}) has no prior density where "
            "it is masked out, so it has no Gaussian prior; elliptical slice sampling needs "
            "every latent's full Gaussian prior (move the mask to the observation sites)"
        )


def _show(value: object) -> str:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{float(value):g}"


def check_full_data(trace: poutine.Trace) -> None:
    """Raise `SubsamplingError` (a ``NotImplementedError`` and a ``ValueError``) if the traced
    model subsamples a plate, by ``subsample_size`` or by given ``subsample`` indices (the
    likelihood must be exact)."""
    for name, site in trace.nodes.items():
        fn = site.get("fn")
        if isinstance(fn, _Subsample) and fn.size >= 0:
            taken = len(site["value"]) if site["value"] is not None else fn.size
            if taken < fn.size:
                raise SubsamplingError(
                    f"model: plate {name!r} subsamples {taken} of {fn.size} points; elliptical "
                    "slice sampling needs the full likelihood (call the model without "
                    "subsample_size or subsample)"
                )


def _describe(fn: object) -> str:
    """A distribution's class, with what a wrapper (``to_event``, ``expand``, ``mask``) holds:
    ``Independent(Laplace)``."""
    from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution

    wrappers = (torch.distributions.Independent, ExpandedDistribution, MaskedDistribution)
    name = type(fn).__name__
    return f"{name}({_describe(fn.base_dist)})" if isinstance(fn, wrappers) else name


def refuse_subsampling(kwargs: dict) -> None:
    """A `SubsamplingError` (a ``NotImplementedError`` and a ``ValueError``) for a
    ``subsample_size`` given to an elliptical slice run (the kernels need the full likelihood;
    it would otherwise be dropped silently)."""
    if kwargs.get("subsample_size") is not None:
        raise SubsamplingError(
            "subsample_size: elliptical slice sampling needs the full likelihood; call "
            "mcmc.run(x, y) without it (a SubspaceNet's own subsample_size is for SVI)"
        )


def gaussian_moments(ref: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(μ (K,), Σ (K, K))`` float64 of a Gaussian reference given in any accepted form."""
    if isinstance(ref, tuple) and len(ref) == 2:
        mu, cov = (torch.as_tensor(v, dtype=torch.float64) for v in ref)
    elif hasattr(ref, "loc") and hasattr(ref, "covariance") and hasattr(ref, "fitted"):
        if not ref.fitted:
            raise ValueError("reference: the Laplace guide is not fitted; call fit(x, y) first")
        mu, cov = ref.loc.double(), ref.posterior.covariance().double()
    else:
        base = ref
        while isinstance(base, (Independent, ExpandedDistribution)):
            base = base.base_dist
        if not isinstance(base, (Normal, MultivariateNormal)) or ref.event_shape.numel() == 0:
            raise TypeError(
                "reference: expected 'warmup', 'laplace', 'prior', a fitted AutoSubspaceLaplace, "
                "a Normal/MultivariateNormal over t or a (loc, covariance) pair, got "
                f"{type(ref).__name__}"
            )
        mu = ref.mean.double().reshape(-1)
        if isinstance(base, MultivariateNormal):
            cov = base.covariance_matrix.double()
        else:
            cov = ref.variance.double().reshape(-1)
    if mu.dim() != 1 or cov.shape not in ((mu.shape[0],), (mu.shape[0], mu.shape[0])):
        raise ValueError(
            f"reference: expected loc (K,) and covariance (K, K) or (K,), got {tuple(mu.shape)} "
            f"and {tuple(cov.shape)}"
        )
    cov = torch.diag(cov) if cov.dim() == 1 else (cov + cov.T) / 2
    return mu, cov
