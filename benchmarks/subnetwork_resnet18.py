"""Subnetwork Inference at the size the paper ran it (Daxberger et al. 2021, section 6.2).

ResNet-18 with the CIFAR stem (3×3 convolution, no max-pool; 11,173,962 weights; BatchNorm)
on CIFAR-shaped synthetic images with learnable structure (`scale.synthetic`: the label is a
function of the mean of one 8×8 patch of the first channel; no downloads), trained briefly by
SGD, then SWA epochs at a constant rate collecting a diagonal SWAG; the subnetwork is the
``K = 42,438`` weights of largest diagonal-SWAG variance (the paper's choice: diagonal Laplace
picks weights of dead ReLUs); a full-covariance linearised Laplace over it in float32 from
``N = 4,500`` images (``N·C = 45,000`` GGN rows, more than ``K``: the GGN is formed, no
Woodbury shortcut); the evidence and the GLM (probit) predictive on 1,000 test images at
``λ = 500``; ``λ`` by a grid on validation data (the paper's protocol, ``λ = 500`` region) and
by the evidence on the same grid (one Cholesky factorisation per ``λ``, whose diagonal gives
the log-determinant: an eigendecomposition of this GGN would cost about thirty of them).

Each step: wall time, in training epochs (one epoch = one SGD pass over the ``N`` training
images), the peak RSS increase over the step and the step's absolute peak RSS (``VmHWM``).
The GGN's cost per further 1,000 images is the fit's time less its factor's (a Cholesky and a
triangular inverse of about the same time: twice the Cholesky timed alone at another ``λ``),
per 1,000 images. Budget: peak RSS ≤ 18 GB.

    python benchmarks/subnetwork_resnet18.py --quick          # K = 1,000, N = 64: a few minutes
    flock /tmp/pyro_subspace_heavy.lock nice python benchmarks/subnetwork_resnet18.py \
        --checkpoint /tmp/resnet18.pt   # hours; run again to resume after the training
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale import PeakMemory, _rss, synthetic  # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18, CIFAR stem (He et al. 2016; the variant of the Subnetwork Inference paper)."""
    layers, cin = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="K = 1,000, N = 64, 32 test images")
    parser.add_argument("--n", type=int, default=None, help="training images (default 4,500)")
    parser.add_argument("--k", type=int, default=None, help="subnetwork size (default 42,438)")
    parser.add_argument("--grid", type=str, default="100,500,2500", help="λ values of the grid")
    parser.add_argument("--epochs", type=int, default=1, help="SGD epochs before SWA")
    parser.add_argument("--swa-epochs", type=int, default=2, help="SWA epochs (diagonal SWAG)")
    parser.add_argument("--checkpoint", type=str, default=None, help=(
        "file: the trained network, its selection and their rows are saved there (and the "
        "fitted guide in FILE.fit, two K x K matrices: 14.4 GB at the paper's K), and read "
        "from them when they exist (the hours-long run resumes after training, or the fit)"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.n or (64 if args.quick else 4500)
    k = args.k or (1000 if args.quick else 42438)
    n_test = 32 if args.quick else 1000
    n_val = 32 if args.quick else 500
    grid = [float(v) for v in args.grid.split(",")]
    epochs, swa_epochs = args.epochs, args.swa_epochs

    from pyro_subspace import SubspaceNet, fit_map, likelihoods, subspaces
    from pyro_subspace.infer import AutoSubspaceLaplace
    from pyro_subspace.metrics import accuracy, calibration_errors, categorical_nll

    print(f"# benchmarks/subnetwork_resnet18.py{' --quick' if args.quick else ''}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")  # fmt: skip
    print(f"# torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"load (uptime): {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")  # fmt: skip
    torch.manual_seed(0)
    net, lik = resnet18(), likelihoods.Categorical()
    x_all, y_all = synthetic(n + n_val + n_test, seed=0)
    x, y = x_all[:n], y_all[:n]
    xv, yv = x_all[n : n + n_val], y_all[n : n + n_val]
    xt, yt = x_all[n + n_val :], y_all[n + n_val :]
    d = sum(p.numel() for p in net.parameters())
    size = 4 * k * k / 1e9
    print(f"# ResNet-18 (CIFAR stem): D = {d:,} weights; N = {n:,} training images "
          f"(N·C = {10 * n:,} GGN rows), {n_val} validation, {n_test} test; K = {k:,} "
          f"(one float32 K x K matrix: {size:.2f} GB); grid λ ∈ {grid}")  # fmt: skip
    print(f"# process baseline RSS before training: {_rss() / 1e9:.2f} GB\n")
    rows = []

    def step(name, fn):
        with PeakMemory() as mem:
            start = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - start
        rows.append([name, seconds, mem.mb / 1e3, mem.hwm_mb / 1e3])
        print(f"{name:<46} {seconds:9.1f} s  +{mem.mb / 1e3:6.2f} GB  peak {mem.hwm_mb / 1e3:6.2f} GB",
              flush=True)  # fmt: skip
        return result

    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        net.load_state_dict(saved["net"])
        net.eval()
        sel = subspaces.subnetwork(net, strategy="indices", indices=saved["indices"])
        rows += saved["rows"]
        print(f"# resumed from {args.checkpoint} (saved {saved['when']}): the training and "
              "selection rows below are that process's")  # fmt: skip
        for name, s, mb, hwm in rows:
            print(f"{name:<46} {s:9.1f} s  +{mb:6.2f} GB  peak {hwm:6.2f} GB")
    else:
        collector = subspaces.SWACollector(net, max_snapshots=swa_epochs + 1)

        def train():
            fit_map(net, lik, x, y, epochs=epochs, batch_size=128, lr=0.05, progress=False,
                    optimizer="sgd", collector=collector, swa_epochs=swa_epochs, swa_lr=0.02)  # fmt: skip

        step(f"train {epochs} + SWA {swa_epochs} epochs (SGD, batch 128)", train)
        net.eval()
        sel = step(f"diagonal-SWAG selection of K = {k:,}", lambda: subspaces.subnetwork(
            net, k, strategy="swag", collector=collector))  # fmt: skip
        if args.checkpoint:
            when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
            torch.save({"net": net.state_dict(), "indices": sel.basis, "rows": rows,
                        "when": when}, args.checkpoint)  # fmt: skip
    epoch = rows[0][1] / (epochs + swa_epochs)
    la = AutoSubspaceLaplace(
        SubspaceNet(net, sel, lik), prior_precision=500.0, hessian_structure="full", chunk_size=32
    )
    fitted = f"{args.checkpoint}.fit" if args.checkpoint else None
    if fitted and os.path.exists(fitted):  # the fitted guide: its GGN and factor (2 K x K)
        saved = torch.load(fitted, mmap=True, weights_only=True)
        la.load_state_dict(saved["guide"])
        rows.append(saved["row"])
        del saved
        print(f"# the fitted guide from {fitted} (its row is that process's)")
    else:
        step("fit: GGN (N·C rows) + Cholesky factor, λ = 500", lambda: la.fit(x, y, find_map=False))
        if fitted:  # the state holds the GGN, the factor and the prior (two K x K matrices)
            torch.save({"guide": la.state_dict(), "row": rows[-1]}, fitted)
    fit_seconds = rows[-1][1]
    evidence = step("evidence at λ = 500 (from the factor)", lambda: float(la.log_marginal_likelihood()))

    def predictive():
        return la.predict(xt, link_approx="probit").probs

    probs = step(f"GLM probit predictive, {n_test} test images", predictive)
    ece, _ = calibration_errors(probs, yt)
    with torch.no_grad():
        map_probs = torch.softmax(net(xt).double(), -1)
    scores = {
        "MAP": (accuracy(map_probs, yt), categorical_nll(map_probs, yt), calibration_errors(map_probs, yt)[0]),
        "Laplace λ = 500": (accuracy(probs, yt), categorical_nll(probs, yt), ece),
    }  # fmt: skip

    def grid_search():
        la.optimize_prior_precision("grid", x_val=xv, y_val=yv, grid=grid)
        return float(la.prior_precision)

    lam_grid = step(f"λ by the grid ({len(grid)} values, {n_val} val. images)", grid_search)
    factor_seconds, evidences = [], {500.0: evidence}
    for lam in grid:
        if lam == 500.0:
            continue
        evidences[lam] = step(f"evidence at λ = {lam:g} (one Cholesky)",
                              lambda lam=lam: float(la.log_marginal_likelihood(lam)))  # fmt: skip
        factor_seconds.append(rows[-1][1])
    lam_ev = max(evidences, key=evidences.get)
    if lam_grid != 500.0:
        la.set_prior_precision(lam_grid)
        probs = step(f"factor + predictive at the grid's λ = {lam_grid:g}", predictive)
        scores[f"Laplace λ = {lam_grid:g} (grid)"] = (
            accuracy(probs, yt), categorical_nll(probs, yt), calibration_errors(probs, yt)[0]
        )  # fmt: skip
    print()
    print(f"{'step':<46} {'s':>9} {'epochs':>8} {'+GB':>7} {'peak GB':>8}")
    for name, s, mb, hwm in rows:
        print(f"{name:<46} {s:9.1f} {s / epoch:8.2f} {mb:7.2f} {hwm:8.2f}")
    print(f"\none training epoch ({n:,} images): {epoch:.1f} s")
    if factor_seconds:
        factor = min(factor_seconds)
        per_k = (fit_seconds - 2 * factor) / n * 1000
        print(f"GGN per further 1,000 images: {per_k:.1f} s ({per_k / epoch:.2f} epochs), "
              f"the fit less twice one Cholesky ({factor:.1f} s) per 1,000 images")  # fmt: skip
    print("evidence by λ: " + ", ".join(f"{lam:g}: {v:.1f}" for lam, v in sorted(evidences.items())))
    print(f"λ by the grid (validation log-likelihood): {lam_grid:g}; by the evidence: {lam_ev:g}")
    peak = max(r[3] for r in rows)
    print(f"peak RSS {peak:.2f} GB (budget 18 GB): {'met' if peak <= 18 else 'MISSED'}\n")
    print(f"{'predictive (test)':<32} {'acc':>6} {'NLL':>7} {'ECE':>6}")
    for name, (acc, nll, e) in scores.items():
        print(f"{name:<32} {acc:6.3f} {nll:7.3f} {e:6.3f}")
    if not all(math.isfinite(v) for v in evidences.values()):
        raise SystemExit("non-finite evidence")


if __name__ == "__main__":
    main()
