"""``fisher="mc"``: the back-propagated columns as sampled scores ``∇_f log p(ỹ | f_n) / √M``,
``ỹ ~ p(y | f_n)`` (laplace-torch's ``stochastic=True``), drawn from a generator of their own."""

from __future__ import annotations

import math

import torch
from torch.distributions import Bernoulli, Categorical, Independent, Normal

from ... import distributed, rng
from ...validation import check_int

#: Seed of the generator ``fisher="mc"`` uses when none is given (plus the process's rank).
MC_SEED = 0


def _check_generator(generator: object, device: torch.device) -> torch.Generator:
    """The generator for ``fisher="mc"``: the given one, one seeded with an int, or one
    seeded with ``MC_SEED + rank``."""
    if isinstance(generator, torch.Generator):
        return generator
    if generator is None:
        return torch.Generator(device=device).manual_seed(MC_SEED + distributed.world()[0])
    if isinstance(generator, bool) or not isinstance(generator, int):
        raise TypeError(
            f"generator: expected a torch.Generator, an int seed or None, got "
            f"{type(generator).__name__}"
        )
    check_int(generator, "generator", 0, 2**63 - 1)
    return torch.Generator(device=device).manual_seed(generator)


def _draw(dist, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """One draw of ``dist`` from ``generator``: Normal, Categorical and Bernoulli (wrapped in
    ``Independent`` or not) by ``randn``/``multinomial``/``bernoulli`` with the generator; any
    other distribution by its own ``sample()`` inside `rng.preserved` after seeding torch's
    global generator from ``generator`` (so the caller's global stream does not move)."""
    base = dist
    while isinstance(base, Independent):
        base = base.base_dist
    gd = generator.device
    if isinstance(base, Normal):
        loc, scale = base.loc, base.scale
        eps = torch.randn(loc.shape, generator=generator, dtype=loc.dtype, device=gd)
        return loc + scale * eps.to(device)
    if isinstance(base, Categorical):
        probs = base.probs
        k = probs.shape[-1]
        idx = torch.multinomial(probs.reshape(-1, k).to(gd), 1, generator=generator)
        return idx.reshape(probs.shape[:-1]).to(device)
    if isinstance(base, Bernoulli):
        return torch.bernoulli(base.probs.to(gd), generator=generator).to(device)
    seed = int(torch.randint(2**62, (), generator=generator, device=gd))
    with rng.preserved(numpy=False, python=False):
        torch.manual_seed(seed)
        return dist.sample()


def _mc_factor(likelihood, out2: torch.Tensor, m: int, generator) -> torch.Tensor:
    """``(n, O, M)`` scores ``∇_f log p(ỹ | f_n) / √M``, ``ỹ ~ p(y | f_n)``: ``E[s sᵀ]`` is the
    Fisher, the likelihood's ``H_n``."""
    likelihood.check_curvature_outputs(out2)
    cols = []
    for _ in range(m):
        with torch.no_grad():
            ys = _draw(likelihood.distribution(out2), generator, out2.device)
        f = out2.detach().requires_grad_(True)
        (score,) = torch.autograd.grad(likelihood.log_prob_prepared(f, ys).sum(), f)
        cols.append(score)
    return torch.stack(cols, -1).div_(math.sqrt(m))
