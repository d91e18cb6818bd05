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


def refuse_subsampling(kwargs: dict) -> None:
    """A ``ValueError`` for a ``subsample_size`` given to an elliptical slice run (the kernels
    need the full likelihood; it would otherwise be dropped silently)."""
    if kwargs.get("subsample_size") is not None:
        raise ValueError(
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
