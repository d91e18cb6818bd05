"""Where a `PatchedNet` SVI step spends its time beyond a vanilla step (issue 13).

The pieces a ``Trace_ELBO`` step over the per-tensor sites pays per step, each timed alone
(best of rounds, one thread) next to its whole-tensor replacement in `nn.patch_flat`, on the
benchmark net 64-128-BN-ReLU-128-BN-ReLU-10 with BatchNorm and the output layer patched (K = 5,
``sigma=0``):

- the assignment draw (``Categorical.sample`` is ``torch.multinomial``) and its ``log_prob``,
- the prior ``log_prob`` over all ``D`` weights (forward and backward),
- the ``Delta`` guide's ``log_prob`` (compares ``D`` numbers),
- one ``pyro.param`` statement per mean tensor, and Adam over each tensor,
- the per-slot selection of the drawn components,
- Pyro's own floor: an SVI step of a one-site model with one parameter.

    python benchmarks/profile_patched_step.py [--mode emp|ecmp]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks.protocols import bn_mlp
from pyro_subspace import PatchedNet, likelihoods
from pyro_subspace.nn import patch_flat, patch_svi


def _best(fn, number: int = 200, repeat: int = 7) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def pieces(mode: str) -> list[tuple[str, float, float]]:
    """(piece, µs per-tensor sites, µs whole-tensor) for one step's pieces."""
    pyro.clear_param_store()
    model = PatchedNet(bn_mlp(64, 10, seed=0), likelihoods.Categorical(), mode=mode, sigma=0.0)
    lay = patch_flat.layout(model)
    flat = patch_flat.flat_means(model)
    k, a, d = model.n_components, lay.num_assignments, model.num_weights
    probs = torch.full((k,), 1.0 / k)
    cat = dist.Categorical(probs=probs).expand([a]).to_event(1)
    uni = lay.assignment_law(flat)
    z = uni.sample()
    w = torch.randn(d, requires_grad=True)
    normal = dist.Normal(torch.zeros(()), torch.ones(d)).to_event(1)
    prior = patch_flat.FlatNormalPrior(1.0, d, flat)
    params = [model._parameters[s.key] for s in model.slots]
    for p in params:
        p.grad = torch.randn_like(p)
    flat.grad = torch.randn_like(flat)
    adam_each = torch.optim.Adam(params, lr=1e-3)
    adam_flat = torch.optim.Adam([flat], lr=1e-3)
    zs = lay.split_assignments(z)

    def per_slot_select():
        loc = torch.cat(
            [model.family.select(s, p, zs, ()).reshape(-1) for s, p in zip(model.slots, params)]
        )
        loc.sum().backward()

    def params_traced():
        with pyro.poutine.trace(param_only=True), model._pyro_context:
            for s in model.slots:
                getattr(model, s.key)

    def flat_traced():
        with pyro.poutine.trace(param_only=True):
            patch_svi._flat_param(model)

    loc = flat.index_select(0, lay.base)
    rows = [
        (f"assignment draw (A = {a})", _best(cat.sample), _best(uni.sample)),
        (
            "assignment log_prob, model + guide",
            2 * _best(lambda: cat.log_prob(z)),
            2 * _best(lambda: uni.log_prob(z)),
        ),
        (
            f"prior log_prob fwd+bwd (D = {d})",
            _best(lambda: normal.log_prob(w).backward()),
            _best(lambda: prior.log_prob(w).backward()),
        ),
        (
            "Delta guide log_prob",
            _best(lambda: dist.Delta(loc, event_dim=1).log_prob(loc)),
            _best(lambda: patch_flat.PointMass(loc).log_prob(loc)),
        ),
        (f"pyro.param statements ({len(params)} vs 1)", _best(params_traced), _best(flat_traced)),
        (
            f"Adam step ({len(params)} tensors vs 1 flat)",
            _best(adam_each.step),
            _best(adam_flat.step),
        ),
        (
            "select drawn means fwd+bwd",
            _best(per_slot_select),
            _best(lambda: lay.select(flat, z).sum().backward()),
        ),
    ]
    return rows


def pyro_floor() -> float:
    """µs of an SVI(Trace_ELBO) step of a model with one latent (10,), one param, 128 obs."""
    pyro.clear_param_store()
    x = torch.randn(128)

    def model(x):
        w = pyro.sample("w", dist.Normal(torch.zeros(()), 1.0).expand([10]).to_event(1))
        with pyro.plate("data", 128, subsample=torch.arange(128)):
            pyro.sample("obs", dist.Normal(w.sum(), 1.0), obs=x)

    def guide(x):
        pyro.sample("w", dist.Delta(pyro.param("loc", torch.zeros(10)), event_dim=1))

    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), pyro.infer.Trace_ELBO())
    with pyro.validation_enabled(False):
        return _best(lambda: svi.step(x))


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="ecmp", choices=("emp", "ecmp"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = [f"{'piece (' + args.mode + ')':<44}{'per-tensor us':>15}{'whole us':>10}"]
    for name, old, new in pieces(args.mode):
        lines.append(f"{name:<44}{old:>15.1f}{new:>10.1f}")
    lines.append(f"{'Pyro floor: SVI step, 1 latent, 1 param':<44}{pyro_floor():>15.1f}")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
