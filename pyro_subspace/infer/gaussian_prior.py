"""Split a Pyro model into a fixed Gaussian prior over its latents and the rest.

Elliptical slice sampling needs the joint density written as ``N(θ | μ, Σ) · L(θ)``. This module
traces the model, checks that every latent site has a Gaussian prior (``Normal`` or
``MultivariateNormal``, possibly wrapped by ``.to_event``/``.expand``) whose parameters do not
change when the other latents change, and returns those priors.
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
    """Check that ``model``'s latents all have fixed Gaussian priors and return them.

    Raises:
        TypeError: naming the first latent site whose prior is not Gaussian, or whose Gaussian
            parameters change when the other latents change (tested by re-running the model
            with every latent shifted).
    """
    with torch.no_grad():
        trace = poutine.trace(model).get_trace(*args, **kwargs)
    sites = [(n, s) for n, s in trace.nodes.items() if is_latent(n, s)]
    for name, site in sites:
        if _base_gaussian(site["fn"]) is None:
            raise TypeError(
                f"site {name!r}: elliptical slice sampling needs a Gaussian prior (Normal or "
                f"MultivariateNormal), got {_describe(site['fn'])}"
            )
        if site["scale"] != 1.0:
            raise TypeError(f"site {name!r}: a latent under poutine.scale is not a Gaussian prior")
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
            raise TypeError(
                f"site {name!r}: its Gaussian prior's parameters depend on other latent sites; "
                "elliptical slice sampling needs a fixed Gaussian prior for every latent"
            )
    return [GaussianSite(n, s["fn"], s["value"].shape) for n, s in sites]


def check_full_data(trace: poutine.Trace) -> None:
    """Raise ``ValueError`` if the traced model subsamples a plate (the likelihood must be exact)."""
    for name, site in trace.nodes.items():
        fn = site.get("fn")
        if isinstance(fn, _Subsample) and (fn.subsample_size or fn.size) < fn.size:
            raise ValueError(
                f"model: plate {name!r} subsamples {site['fn'].subsample_size} of "
                f"{site['fn'].size} points; elliptical slice sampling needs the full "
                "likelihood (call the model without subsample_size)"
            )


def _describe(fn: object) -> str:
    """A distribution's class, with what a wrapper (``to_event``, ``expand``, ``mask``) holds:
    ``Independent(Laplace)``."""
    from pyro.distributions.torch_distribution import ExpandedDistribution, MaskedDistribution

    wrappers = (torch.distributions.Independent, ExpandedDistribution, MaskedDistribution)
    name = type(fn).__name__
    return f"{name}({_describe(fn.base_dist)})" if isinstance(fn, wrappers) else name
