"""Where an eigensolver's time goes: the cost of one GGN-vector product, by implementation.

On the two problems of ``lanczos_vs_arpack.py`` (diabetes MLP, D = 3151, N = 397; digits MLP,
D = 9840, N = 1437; float64, one thread), per product (a block of ``b`` counts ``b``):

- ``ggn_vector_product`` as it is (one forward pass with dual-number weights, one backward) and
  as it was (``jvp``, then ``vjp``: the primal forward twice);
- ``ggn_matrix_product(b)``, ``b`` = 1 … 20 (``vmap`` over tangents and cotangents);
- ``GGNOperator`` (the graphs of ``f`` and of ``u ↦ Jᵀu`` built once, then two backward passes
  per product; batched with ``is_grads_batched``): its build time and memory;
- ``torch.func.linearize`` (tracing once, then the traced ``jvp`` and a kept ``vjp`` pullback).

Times are the best of ``--repeats`` interleaved rounds (every variant once per round).

    python benchmarks/ggn_product_profile.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from lanczos_vs_arpack import problem
from torch.func import linearize, vjp

from pyro_subspace.curvature import GGNOperator, ggn_matrix_product, ggn_vector_product
from pyro_subspace.curvature import ggn as ggn_module
from pyro_subspace.curvature.output_hessian import output_hessian
from pyro_subspace.flat import FlatNet

BLOCKS = (1, 2, 4, 8, 10, 16, 20)


def profile(name: str, repeats: int, quick: bool) -> None:
    label, net, lik, x, _ = problem(name, quick)
    flat = FlatNet(net, batch_strategy="loop")
    w = flat.vector()
    d = w.numel()
    gen = torch.Generator().manual_seed(0)
    vs = {b: torch.randn(d, b, dtype=torch.float64, generator=gen) for b in BLOCKS}
    v = vs[1][:, 0]

    def old_product(v=v):
        ggn_module._NO_DUAL.add(net)  # force the jvp-then-vjp path
        try:
            return ggn_vector_product(net, lik, x, v)
        finally:
            ggn_module._NO_DUAL.discard(net)

    op = GGNOperator(net, lik, x)
    f = lambda wv: flat(wv, x)
    out, pullback = vjp(f, w)
    _, jvp_fn = linearize(f, w)
    hess = output_hessian(lik, out.reshape(out.shape[0], -1))

    def linearized(v=v):
        jv = jvp_fn(v).reshape(hess.shape[0], -1)
        return pullback(torch.einsum("nop,np->no", hess, jv).reshape(out.shape))[0]

    runs = {
        ("ggn_vector_product (dual-number pass)", 1): lambda: ggn_vector_product(net, lik, x, v),
        ("ggn_vector_product, old: jvp then vjp", 1): old_product,
        ("GGNOperator build (graphs of f, Jᵀu)", 0): lambda: GGNOperator(net, lik, x),
        ("GGNOperator.matvec", 1): lambda: op.matvec(v),
        ("linearize build (trace)", 0): lambda: linearize(f, w),
        ("linearized jvp + kept vjp", 1): linearized,
    }
    for b in BLOCKS:
        runs[(f"ggn_matrix_product b={b}", b)] = lambda b=b: ggn_matrix_product(net, lik, x, vs[b])
        runs[(f"GGNOperator.matmat b={b}", b)] = lambda b=b: op.matmat(vs[b])
    best = {}
    for r in range(repeats + 1):  # round 0 warms up
        for key, run in runs.items():
            t0 = time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            if r > 0:
                best[key] = min(best.get(key, float("inf")), dt)
    single = best[("ggn_vector_product (dual-number pass)", 1)]
    print(
        f"\n{label}; GGNOperator caches {op.cached_bytes / 2**20:.1f} MiB of saved "
        f"tensors ({op.cached_rows}/{op.total_rows} rows)"
    )
    print(f"{'what':<42}{'ms per call':>12}{'ms per vector':>15}{'vs ggn_vector_product':>23}")
    for (what, b), t in best.items():
        per = t / b if b else float("nan")
        rel = f"{single / per:>22.2f}x" if b else f"{'':>23}"
        print(f"{what:<42}{t * 1e3:>12.2f}{per * 1e3:>15.2f}{rel}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"# load average at start: {os.getloadavg()[0]:.2f}")
    for name in ("diabetes", "digits"):
        profile(name, args.repeats, args.quick)
    print(f"\n# load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
