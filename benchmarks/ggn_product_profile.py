"""Where an eigensolver's time goes: the cost of one GGN-vector product, by implementation.

On the two problems of ``lanczos_vs_arpack.py`` (diabetes MLP, D = 3151, N = 397; digits MLP,
D = 9840, N = 1437; float64, one thread), per product (a block of ``b`` counts ``b``):

- ``ggn_vector_product`` as it is (one forward pass with dual-number weights, one backward) and
  as it was (``jvp``, then ``vjp``: the primal forward twice);
- ``ggn_matrix_product(b)``, ``b`` = 1 … 20 (``vmap`` over tangents and cotangents);
- ``GGNOperator`` (the graphs of ``f`` and of ``u ↦ Jᵀu`` built once, then two backward passes
  per product; batched with ``is_grads_batched``): its build time and memory;
- ``torch.func.linearize`` (tracing once, then the traced ``jvp`` and a kept ``vjp`` pullback);
- a hand-written product for these Tanh MLPs (`GemmProduct`: the activations kept, then four
  matrix multiplies per layer and nothing else; checked against `GGNOperator` to 1e-12), on one
  vector and on blocks, with its rate in GFLOP/s beside that of one large float64 GEMM.

The last table bounds what batching can buy an eigensolver on the same product: the best
per-vector speed-up of a block over one vector of the SAME implementation (the autograd operator
and the GEMM-only product), since a solver handed the single-vector product (ARPACK) gets that
implementation too.

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


class GemmProduct:
    """``V ↦ G V`` for ``nn.Sequential(Linear, Tanh, ..., Linear)``, Gaussian or Categorical:
    activations and output Hessians kept, then per layer four matrix multiplies (tangent of
    the layer's input and of its weights forward, weight gradient and input gradient backward)
    for all ``b`` vectors at once. The least work a GGN product can do here."""

    def __init__(self, net, lik, x) -> None:
        self.linears = [m for m in net if isinstance(m, torch.nn.Linear)]
        self.acts, self.slopes, a = [x], [], x
        with torch.no_grad():
            for i, lin in enumerate(self.linears):
                a = lin(a)
                if i < len(self.linears) - 1:
                    a = torch.tanh(a)
                    self.slopes.append(1 - a * a)
                    self.acts.append(a)
            self.out = a
            self.hess = output_hessian(lik, a)  # (N, C, C)
        self.flops = sum(  # per vector: 4 multiplies per layer, 2 in the first (no input tangent)
            (2 if i == 0 else 4) * 2 * x.shape[0] * lin.in_features * lin.out_features
            for i, lin in enumerate(self.linears)
        )

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        b, n = v.shape[1], self.acts[0].shape[0]
        pieces, at = [], 0
        for lin in self.linears:  # (b, out, in) and (b, out) views of V's columns
            o, i = lin.out_features, lin.in_features
            pieces.append((v[at : at + o * i].T.reshape(b, o, i), v[at + o * i : at + o * i + o].T))
            at += o * i + o
        dz = None
        for li, (lin, (dw, db)) in enumerate(zip(self.linears, pieces)):
            z = (self.acts[li] @ dw.reshape(-1, lin.in_features).T).reshape(n, b, -1)
            z = z.transpose(0, 1) + db[:, None, :]
            if dz is not None:  # the input's tangent through the weights
                z += (dz.reshape(b * n, -1) @ lin.weight.T).reshape(b, n, -1)
            dz = z * self.slopes[li] if li < len(self.slopes) else z
        delta = torch.einsum("ncd,bnd->bnc", self.hess, dz)
        grads = []
        for li in range(len(self.linears) - 1, -1, -1):
            lin = self.linears[li]
            gw = (delta.transpose(1, 2).reshape(-1, n) @ self.acts[li]).reshape(b, -1)
            grads.append(torch.cat([gw, delta.sum(1)], 1))
            if li:
                delta = (delta.reshape(b * n, -1) @ lin.weight).reshape(b, n, -1) * self.slopes[
                    li - 1
                ]
        return torch.cat(grads[::-1], 1).T


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
    gemm = GemmProduct(net, lik, x)
    check = vs[4]
    err = (gemm(check) - op.matmat(check)).abs().max() / op.matmat(check).abs().max()
    assert err < 1e-12, f"GemmProduct disagrees with GGNOperator: {err:.1e}"
    for b in BLOCKS:
        runs[(f"ggn_matrix_product b={b}", b)] = lambda b=b: ggn_matrix_product(net, lik, x, vs[b])
        runs[(f"GGNOperator.matmat b={b}", b)] = lambda b=b: op.matmat(vs[b])
        runs[(f"GemmProduct b={b}", b)] = lambda b=b: gemm(vs[b])
    big = torch.randn(1500, 1500, dtype=torch.float64, generator=gen)
    runs[("one 1500x1500 float64 GEMM", 0)] = lambda: big @ big
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
    print(
        f"{'what':<42}{'ms per call':>12}{'ms per vector':>15}{'vs ggn_vector_product':>23}"
        f"{'GFLOP/s':>9}"
    )
    for (what, b), t in best.items():
        per = t / b if b else float("nan")
        rel = f"{single / per:>22.2f}x" if b else f"{'':>23}"
        rate = gemm.flops / per if what.startswith("Gemm") else float("nan")
        rate = 2 * 1500**3 / t if what.startswith("one 1500") else rate
        print(f"{what:<42}{t * 1e3:>12.2f}{per * 1e3:>15.2f}{rel}{rate / 1e9:>9.1f}")
    print("batching bound (best per-vector time of a block / time of one vector, same product):")
    for impl, one in (("GGNOperator.matmat", "GGNOperator.matvec"), ("GemmProduct", "GemmProduct")):
        per = {b: best[(f"{impl} b={b}", b)] / b for b in BLOCKS if b > 1}
        b = min(per, key=per.get)
        base = best[(one, 1)] if impl != one else best[(f"{one} b=1", 1)]
        print(f"  {impl:<20} best at b={b}: {base / per[b]:.2f}x cheaper per vector")


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
