"""Laplace-LoRA and LoRA-subspace sampling at GPT-2-small scale: time and peak memory.

Issue 35's scale check. A GPT-2-small-shaped sequence classifier built from its config
(``GPT2Config()``: 12 layers, width 768, 124M weights; random weights: nothing is downloaded)
with a 3-class head and a peft LoRA adapter, r = 8 on the attention projections (``c_attn``);
N = 512 sequences of 64 tokens (dict batches ``input_ids``/``attention_mask``/``labels`` of 8
sequences). Each step runs in a forked child process, so its peak RSS above the parent's
(``ru_maxrss`` of the child less the parent's resident size at the fork) is its own:

- one training epoch of the adapter (AdamW, batches of 8): the unit of time;
- one ``torch.no_grad()`` forward pass over the data (batches of 32): the unit of an evaluation;
- K-FAC Laplace over the adapter (``infer.Laplace(model, Categorical(), "all", "kron").fit``),
  type-2 Fisher (3 backward passes a chunk) and the one-sample Monte Carlo Fisher;
- an SWA snapshot's bytes (``SWACollector.deviation_rows`` per row) against the adapter's;
- one elliptical-slice likelihood evaluation in a rank-10 subspace of the adapter
  (``SubspaceNet.evaluator(...).log_likelihood(t)``) against the no-grad forward pass; 20
  draws cost about (evaluations per draw) × that, the evaluations per draw measured on the
  toy problem's kernel (`benchmarks/ess_vs_nuts.py`: 5-8 at T = N/K).

    python benchmarks/hf_lora_scale.py                    # the issue's sizes (an hour or more)
    python benchmarks/hf_lora_scale.py --quick            # 2 layers, N = 64: a smoke run
    python benchmarks/hf_lora_scale.py --n 128 --steps epoch kfac kfac-mc   # fewer rows, steps

``--ess-ratio`` times one ESS likelihood evaluation against the no-grad forward pass in one
process, interleaved (``--rounds`` of each), for their ratio.

``--per-batch`` measures K-FAC's parts in one process instead, interleaved with the training
step (rounds of: one AdamW step on a batch of 8; one K-FAC pass over that batch, type-2 and
MC; the eigendecompositions of one layer's factors as the posterior takes them, a cost that
does not grow with N: ``c_attn``'s LoRA ``B`` output factor 2304 × 2304 and ``A`` input
factor 768 × 768, times the layers, plus the head's 768 × 768), and gives K-FAC in epochs at
the issue's N = 512 as ``(pass per batch · 64 + eigendecompositions) / (step per batch · 64)``:
minutes instead of an hour of the full run, and both timed under the same load. Peaks: run
``--n 8 --steps epoch kfac kfac-mc`` (one batch; the peaks do not grow with N).

Each step's row is printed (and flushed) as soon as it is measured, so a run stopped early
still leaves the rows it finished. ``--n`` takes fewer sequences: the peaks do not depend on
it (every step works in batches of 8 or 32), and K-FAC's eigendecompositions are a fixed cost,
so its time in epochs is then an upper bound of the N = 512 figure.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import resource
import time

import torch
from torch.utils.data import DataLoader

from pyro_subspace import SubspaceNet, infer, likelihoods, subspaces


def build(quick: bool):
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(num_labels=3, pad_token_id=0)
    if quick:
        cfg.n_layer = 2
    base = transformers.GPT2ForSequenceClassification(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, task_type="SEQ_CLS")
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # a trained adapter: B away from its zero start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model.eval()


def data(n: int, length: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50257, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    y = torch.randint(0, 3, (n,), generator=g)
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]} for i in range(n)]
    return {"input_ids": ids, "attention_mask": mask}, y, rows


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def training_step(model, opt, batch: dict) -> None:
    """One AdamW step of the adapter on a dict batch (its ``labels`` popped), in train mode."""
    model.train()
    labels = batch.pop("labels")
    loss = torch.nn.functional.cross_entropy(model(**batch).logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()


#: ``--chunk-size``: rows per K-FAC pass (``infer.Laplace(chunk_size=)``), set in the children
CHUNK = {"rows": 1024}


def _steps(model, x, y, rows, n: int) -> dict:
    """The measured steps, by name: each a callable returning an optional number."""
    lik = likelihoods.Categorical()
    trainable = [q for q in model.parameters() if q.requires_grad]

    def epoch():
        opt = torch.optim.AdamW(trainable, lr=1e-4)
        for batch in DataLoader(rows, batch_size=8):
            training_step(model, opt, batch)

    def forward():
        with torch.no_grad():
            for i in range(0, n, 32):
                model(input_ids=x["input_ids"][i : i + 32], attention_mask=x["attention_mask"][i : i + 32])

    def kfac(fisher: str):
        def fit():
            opts = {"fisher": fisher}
            infer.Laplace(
                model, lik, "all", "kron", structure_options=opts, chunk_size=CHUNK["rows"]
            ).fit(DataLoader(rows, batch_size=8))

        return fit

    def snapshot():
        col = subspaces.SWACollector(model, max_snapshots=2)
        col.collect()
        row = col.deviation_rows[0]
        return row.numel() * row.element_size()

    def ess_eval():
        sub = subspaces.random(model, rank=10, seed=0)
        ev = SubspaceNet(model, sub, lik).evaluator(x, y, chunk_size=32)
        ev.log_likelihood(torch.full((10,), 0.01, dtype=sub.shift.dtype))

    fns = (epoch, forward, kfac("type-2"), kfac("mc"), ess_eval, snapshot)
    return dict(zip(STEPS, fns))


#: the steps' names, in `_steps`' order
STEPS = (
    "one adapter training epoch (AdamW, batch 8)",
    "no-grad forward pass over the data",
    "K-FAC Laplace over the adapter, type-2 (3 classes)",
    "K-FAC Laplace over the adapter, 1-sample MC Fisher",
    "one elliptical-slice likelihood evaluation (rank 10)",
    "snapshot",
)


def _child(name: str, quick: bool, threads: int, n: int, queue, chunk: int = 1024) -> None:
    """One step in a fresh (spawned) process: its time, and its peak RSS above the process's
    resident size once the model and data are built."""
    torch.set_num_threads(threads)
    CHUNK["rows"] = chunk
    model = build(quick)
    x, y, rows = data(n, 32 if quick else 64)
    fn = _steps(model, x, y, rows, len(y))[name]
    base = _rss_mib()
    t = time.perf_counter()
    extra = fn()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    queue.put((seconds, peak - base, extra))


def run(name: str, quick: bool, threads: int, n: int, chunk: int = 1024):
    """``(seconds, peak MiB above the built model, extra)`` of step ``name`` in a spawned child."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, quick, threads, n, queue, chunk))
    proc.start()
    out = queue.get()
    proc.join()
    return out


def interleaved(parts: dict, rounds: int) -> dict[str, float]:
    """Each of ``parts`` (name -> callable) once a round, in order, ``rounds`` times (A B A B);
    prints and returns each one's median seconds."""
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"{'part (median of ' + str(rounds) + ' interleaved rounds)':54s} {'seconds':>8s}  all rounds")
    for k, v in times.items():
        print(f"{k:54s} {med[k]:8.1f}  {' '.join(f'{t:.1f}' for t in v)}")
    return med


def per_batch(quick: bool, n: int, rounds: int) -> None:
    """K-FAC's parts against the training step, interleaved in this process (module
    docstring): median seconds of each part, then K-FAC in epochs at ``n`` sequences."""
    from pyro_subspace.curvature.kfac import kfac

    model = build(quick)
    _, _, rows = data(8, 32 if quick else 64)
    lik = likelihoods.Categorical()
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.0)  # lr 0: every round sees the same weights

    def step():
        training_step(model, opt, dict(next(iter(DataLoader(rows, batch_size=8)))))

    def kfac_pass(fisher):
        return lambda: kfac(model, lik, DataLoader(rows, batch_size=8), fisher=fisher, dtype=torch.float64)

    from pyro_subspace.infer.laplace.posteriors.kron import _eigh

    layers = sum(1 for name, _ in model.named_modules() if name.endswith("c_attn.lora_B.default"))
    g = torch.Generator().manual_seed(0)
    spd = {m: (lambda v: v @ v.T)(torch.randn(m, 2 * m, generator=g, dtype=torch.float64)) for m in (2304, 768)}

    from pyro_subspace.threads import num_threads

    def eigen():  # one layer's two large factors as KronPosterior decomposes them (its threads)
        with num_threads():
            for m in (2304, 768):
                _eigh(spd[m].clone())

    parts = {
        "training step (batch of 8)": step,
        "K-FAC pass, type-2 (batch of 8)": kfac_pass("type-2"),
        "K-FAC pass, MC (batch of 8)": kfac_pass("mc"),
        "eigendecompositions of one layer (2304², 768²)": eigen,
    }
    med = interleaved(parts, rounds)
    batches = n / 8
    step_t = med["training step (batch of 8)"]
    eig = med["eigendecompositions of one layer (2304², 768²)"] * (layers + 1)  # + the head's A
    for label, fisher in (("type-2", "type-2"), ("MC", "mc")):
        name = "type-2" if fisher == "type-2" else "MC"
        pass_t = med[f"K-FAC pass, {name} (batch of 8)"]
        epochs = (pass_t * batches + eig) / (step_t * batches)
        print(
            f"K-FAC Laplace, {label}, at N = {n}: ({pass_t:.1f} s x {batches:.0f} + {eig:.1f} s "
            f"eigendecompositions) / ({step_t:.1f} s x {batches:.0f}) = {epochs:.2f} epochs"
        )


def ess_against_forward(quick: bool, n: int, rounds: int) -> None:
    """One elliptical-slice likelihood evaluation against one no-grad forward pass over the
    same ``n`` sequences, interleaved in this process (A B A B, ``rounds`` each): the median
    of each and their ratio, the issue's ``<= 1.2`` target (both run ``_steps``' code)."""
    model = build(quick)
    x, y, rows = data(n, 32 if quick else 64)
    forward = _steps(model, x, y, rows, n)[STEPS[1]]
    sub = subspaces.random(model, rank=10, seed=0)  # built once, as a sampler does
    ev = SubspaceNet(model, sub, likelihoods.Categorical()).evaluator(x, y, chunk_size=32)
    coords = torch.full((10,), 0.01, dtype=sub.shift.dtype)
    forward(), ev.log_likelihood(coords)  # first calls: one-time costs out of the rounds
    parts = {
        "no-grad forward pass over the data": forward,
        "one ESS likelihood evaluation (rank 10)": lambda: ev.log_likelihood(coords),
    }
    med = interleaved(parts, rounds)
    fw, ess = med["no-grad forward pass over the data"], med["one ESS likelihood evaluation (rank 10)"]
    print(f"one ESS likelihood evaluation / no-grad forward pass: {ess / fw:.2f} (target <= 1.2)")


#: ``--steps`` names, in the order they run (the unit, the targets, then the rest)
SHORT = {
    "epoch": STEPS[0],
    "kfac": STEPS[2],
    "kfac-mc": STEPS[3],
    "forward": STEPS[1],
    "ess": STEPS[4],
    "snapshot": STEPS[5],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n", type=int, default=None, help="sequences (default 512; --quick 64)")
    p.add_argument("--steps", nargs="+", choices=list(SHORT), default=list(SHORT))
    p.add_argument("--per-batch", action="store_true", help="K-FAC's parts, interleaved")
    p.add_argument(
        "--ess-ratio", action="store_true",
        help="one ESS likelihood evaluation against a no-grad forward pass, interleaved",
    )  # fmt: skip
    p.add_argument(
        "--chunk-size", type=int, default=1024,
        help="rows per K-FAC pass (Laplace's chunk_size): 2 keeps the pass's graph small",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = args.n or (64 if args.quick else 512)
    length = 32 if args.quick else 64
    model_name = f"GPT-2 {'(2 layers)' if args.quick else 'small'} + LoRA r = 8"
    stamp = (
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, threads "
        f"{torch.get_num_threads()}, load at start {os.getloadavg()[0]:.2f}"
    )
    interleaved_modes = {  # one process, parts interleaved: (header, run)
        "ess_ratio": (
            f"# one ESS evaluation against a no-grad forward pass, {model_name}, N = {n} "
            f"sequences of {length} tokens, {stamp}",
            lambda: ess_against_forward(args.quick, n, args.rounds),
        ),
        "per_batch": (
            f"# K-FAC's parts on {model_name}, {stamp}",
            lambda: per_batch(args.quick, n, args.rounds),
        ),
    }
    for flag, (header, measure) in interleaved_modes.items():
        if getattr(args, flag):
            print(header)
            measure()
            print(f"load at the end {os.getloadavg()[0]:.2f}")
            return
    model = build(args.quick)
    trainable = [q for q in model.parameters() if q.requires_grad]
    adapter_bytes = sum(q.numel() * q.element_size() for q in trainable)
    total = sum(q.numel() for q in model.parameters())
    del model
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"# Laplace-LoRA at GPT-2-small scale, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"threads {torch.get_num_threads()}, load at start {load}"
    )
    print(
        f"GPT-2 {'(2 layers)' if args.quick else 'small'}: {total:,} weights, LoRA r = 8 on c_attn + "
        f"3-class head: {adapter_bytes // 4:,} trainable weights; N = {n} sequences of {length} "
        f"tokens; K-FAC passes of at most {args.chunk_size} sequences; each step in a fresh "
        "process (peak RSS above the built model)\n"
    )
    print(f"{'step':54s} {'seconds':>8s} {'epochs':>7s} {'peak MiB':>9s} {'/ train peak':>12s} {'load':>5s}", flush=True)
    ep = ep_peak = None
    results = {}
    for short in [k for k in SHORT if k in args.steps]:
        name = SHORT[short]
        sec, peak, extra = run(name, args.quick, args.threads, n, args.chunk_size)
        results[short] = (sec, peak, extra)
        load = os.getloadavg()[0]
        if short == "snapshot":
            print(f"SWA snapshot: {extra:,} bytes; the adapter + head: {adapter_bytes:,} bytes", flush=True)
            continue
        if short == "epoch":
            ep, ep_peak = sec, peak
        ratio = f"{sec / ep:7.2f}" if ep else f"{'-':>7s}"
        mem = f"{peak / ep_peak:12.2f}" if ep_peak else f"{'-':>12s}"
        print(f"{name:54s} {sec:8.1f} {ratio} {peak:9.0f} {mem} {load:5.1f}", flush=True)
    if "ess" in results and "forward" in results:
        ess, fw = results["ess"][0], results["forward"][0]
        print(f"\none ESS likelihood evaluation / no-grad forward pass: {ess / fw:.2f} (target <= 1.2)")
        print(f"20 ESS draws at 5-8 evaluations each: about {100 * ess:.0f}-{160 * ess:.0f} s")


if __name__ == "__main__":
    main()
