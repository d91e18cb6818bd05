"""Lanczos top-k GGN eigenpairs and a subnetwork Laplace on the CNN of `scale.py`, on a GPU.

Without a CUDA device it says so and exits 0. With one, it times the same steps on the CPU
(one thread) and on the GPU, interleaved CPU GPU CPU GPU, best of the rounds, and checks that
the two devices agree (eigenvalues, posterior covariance) to float32 rounding.

    python benchmarks/gpu.py [--rounds 2] [--n 256] [--width 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(device: str, n: int, width: int):
    from scale import resnet, synthetic

    from pyro_subspace import SubspaceNet, likelihoods, subspaces
    from pyro_subspace.infer import AutoSubspaceLaplace

    torch.manual_seed(0)
    net = resnet(width).to(device).eval()
    x, y = synthetic(n)
    x, y = x.to(device), y.to(device)
    lik = likelihoods.Categorical()
    start = time.perf_counter()
    eig = subspaces.ggn_eigen(net, lik, x, 20, chunk_size=128)
    sub = subspaces.subnetwork(net, 2000, strategy="magnitude")
    guide = AutoSubspaceLaplace(SubspaceNet(net, sub, lik), chunk_size=64).fit(x, y, find_map=False)
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start, eig.eigenvalues.cpu(), guide.covariance.cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--width", type=int, default=48)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; nothing to run.")
        return 0
    torch.set_num_threads(1)
    times = {"cpu": [], "cuda": []}
    results = {}
    for _ in range(args.rounds):
        for device in ("cpu", "cuda"):
            seconds, values, cov = run(device, args.n, args.width)
            times[device].append(seconds)
            results[device] = (values, cov)
    agree = float((results["cpu"][0] - results["cuda"][0]).abs().max() / results["cpu"][0].max())
    print(f"| device | best time (s) | Lanczos top-20 + subnetwork Laplace (N = {args.n}) |")
    print("|---|---|---|")
    for device, ts in times.items():
        print(f"| {device} | {min(ts):.2f} | speed-up {min(times['cpu']) / min(ts):.2f} |")
    print(f"eigenvalues agree to {agree:.1e} relative ({torch.cuda.get_device_name()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
