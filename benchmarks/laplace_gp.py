"""``hessian_structure="gp"``: ours vs laplace-torch 0.3's ``FunctionalLaplace`` on its
calibration example's setting (a small tanh CNN, 10 classes, ``subset_of_weights="all"``,
``independent_outputs=True``, ``n_subset`` M of N training images, a shuffled loader of batches
of 25, probit predictions of test batches of 25 under ``torch.no_grad()``).

Both compute the same GP (``tests/test_laplace_gp.py``: equal to 1e-9 in float64); the
difference is where the subset's Jacobians ``J_M`` ``(M·C, P)`` live. laplace-torch recomputes
them for every test batch (``K_M*`` by ``_kernel_batch_star`` over the subset loader); ours keeps
them from the fit (`posteriors.FunctionalPosterior`, memory ``8·M·C·P`` bytes), so a prediction
costs the test Jacobians and a triangular solve. The table gives fit and predict times (float32
network, ``torch.set_num_threads(--threads)``), interleaved ``A B A B`` for ``--rounds`` rounds in
one process after a warm-up fit of each (best of each), the ratio laplace-torch / ours, and the largest difference of the
probabilities.

    python benchmarks/laplace_gp.py [--rounds 3] [--threads 1] [--n-train 500] [--n-test 500]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SmallCNN(nn.Module):
    """``CIFAR10Net(use_tanh=True)``'s shape at 1 × 16 × 16: two conv layers, tanh, pooling,
    two linear layers, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Linear(16 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x))


def run(door, model, m, train_loader, test_loader):
    """(fit seconds, predict seconds, probabilities)."""
    start = time.perf_counter()
    la = door(
        model, "classification", subset_of_weights="all", hessian_structure="gp",
        independent_outputs=True, n_subset=m, prior_precision=2.2,
    )  # fmt: skip
    la.fit(train_loader)
    fitted = time.perf_counter()
    with torch.no_grad():
        probs = torch.cat([la(xb) for (xb,) in test_loader])
    return fitted - start, time.perf_counter() - fitted, probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n-train", type=int, default=500)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--subsets", type=int, nargs="+", default=[50, 200])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    from laplace import Laplace as LaplaceTorch

    from pyro_subspace import infer

    torch.manual_seed(0)
    model = SmallCNN()
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.n_train, 1, 16, 16)
    train_loader = DataLoader(
        TensorDataset(x, torch.randint(0, 10, (args.n_train,))), batch_size=25, shuffle=True
    )
    test_loader = DataLoader(TensorDataset(torch.randn(args.n_test, 1, 16, 16)), batch_size=25)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"torch.get_num_threads() = {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"# uptime: {load}")
    print(f"# SmallCNN, P = {n_params} weights, float32, N = {args.n_train} training and "
          f"{args.n_test} test images, batches of 25, independent_outputs=True, "
          f"best of {args.rounds} interleaved rounds")
    print(f"{'M':>5} {'J_M MiB':>8} {'fit ours s':>11} {'fit l-t s':>10} {'ratio':>6} "
          f"{'pred ours s':>12} {'pred l-t s':>11} {'ratio':>6} {'max |dp|':>9}")
    for door in (LaplaceTorch, infer.Laplace):  # warm-up: one-time initialisations (functorch)
        run(door, model, min(args.subsets), train_loader, test_loader)
    for m in args.subsets:
        best = {"ours": [float("inf")] * 2, "lt": [float("inf")] * 2}
        diff = 0.0
        for _ in range(args.rounds):
            probs = {}
            for name, door in (("lt", LaplaceTorch), ("ours", infer.Laplace)):
                fit_s, pred_s, probs[name] = run(door, model, m, train_loader, test_loader)
                best[name] = [min(best[name][0], fit_s), min(best[name][1], pred_s)]
            diff = max(diff, float((probs["ours"] - probs["lt"]).abs().max()))
        (fo, po), (fl, pl) = best["ours"], best["lt"]
        mib = 8 * m * 10 * n_params / 2**20
        print(f"{m:>5} {mib:>8.1f} {fo:>11.3f} {fl:>10.3f} {fl / fo:>6.2f} "
              f"{po:>12.3f} {pl:>11.3f} {pl / po:>6.2f} {diff:>9.1e}")


if __name__ == "__main__":
    main()
