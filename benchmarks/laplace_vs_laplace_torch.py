"""Subnetwork Laplace: ours vs laplace-torch; GGN memory vs N; Lanczos top-k vs dense ``eigh``.

(a) Agreement and fit time. On the same MAP networks (MLP, Tanh: diabetes 10→50→50→1
    regression with a Gaussian likelihood, digits 64→64→64→10 classification with a Categorical
    one), the
    same ``K`` subnetwork indices and the same hyper-parameters, fit our `AutoSubspaceLaplace`
    (``prior_mean="zero"``, ``find_map=False``) and laplace-torch's full subnetwork Laplace
    (``Laplace(..., subset_of_weights="subnetwork", hessian_structure="full")``). Both give the
    posterior precision ``Pᵀ G P / (σ² T) + λ I`` over the ``K`` weights (ours puts ``1/σ²``
    into the output Hessian, laplace-torch multiplies ``Σ Jᵀ J`` by ``1/σ²/T`` afterwards) and
    the linearised (GLM) predictive ``N(f(x, ŵ), J_P Σ J_Pᵀ)``, probit-corrected for classes.
    The agreement is checked in float64 (network, data and likelihood cast), the times in
    float32 on one thread (ours then works in float32: float32 products summed in float64 and a
    float32 factorisation; its distance to the float64 fit is printed next to laplace-torch's). laplace-torch runs in its fastest configuration: every backend that
    works (BackPack, curvlinops — whose subnetwork path is ``torch.func.jacrev`` — and ASDL) at
    several DataLoader batch sizes is timed once after a warm-up (screening); the fastest
    configurations then race ours in ``--repeats`` interleaved rounds (best of each).
(b) Peak memory of the subnetwork GGN fit vs ``N`` (digits-shaped MLP 64→64→64→10) at a fixed
    chunk / batch size, one fresh
    subprocess per measurement (peak RSS during the fit minus the RSS just before it, after
    imports, model and data creation; ``tracemalloc`` does not see torch's CPU allocations),
    with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed for every library alike (see `run_worker`).
(c) Top-20 GGN eigenvalues of an MLP with about 10k weights (digits 64→100→30→10, float64):
    dense (explicit per-sample Jacobians → ``G = Σ Jᵀ H J`` → ``torch.linalg.eigh`` and
    ``eigvalsh``) vs our `lanczos_eigh` on `ggn_vector_product`.

(d) K-FAC Laplace (``--parts d``, not in the default run): on the digits MLP 64→128→128→10 and
    a small digits CNN (8×8 images: Conv2d(1, 16, 3, padding 1) → ReLU → Conv2d(16, 32, 3,
    stride 2, padding 1) → ReLU → Flatten → Linear(512, 10)) at their MAPs (full-batch Adam,
    seeded), ``Laplace(..., "kron", structure_options={"conv": ...})`` over the last layer and
    over all weights against laplace-torch's ``KronLLLaplace`` / ``KronLaplace``: agreement in
    float64 with the matching conventions (``BackPackGGN`` ↔ ``conv="backpack"``,
    ``CurvlinopsGGN`` ↔ ``"expand"``; K-FAC eigenvalues, precision on random vectors, GLM logit
    moments, probit probabilities, evidence; as ``tests/test_laplace_kron_vs_laplace_torch``
    checks on small nets) and the time of fit + probit predictive in float32 on one thread
    against laplace-torch's fastest K-FAC configuration (BackPackGGN / CurvlinopsGGN, DataLoader
    batch ``N`` / 128, screened; ours with the convention of that backend), in ``--repeats``
    interleaved rounds (best of each); then the peak RSS of a fresh process per configuration
    (one fit + predictive after the imports, the MAP net and the data) against a baseline
    process that stops before the fit (`kron_worker`; ``--no-kron-memory`` leaves it out).

Conventions (identical for both libraries):

- MAP: `fit_map` (Adam, full batch, fixed seed) with ``weight_decay = λ/N``: the mean loss plus
  ``(λ/N)/2 ‖w‖²`` is ``1/N`` times the negative log joint with the prior ``N(0, λ⁻¹ I)``.
- Regression: the network is trained with a learned ``σ``; then ``σ`` is fixed to the RMS of the
  MAP's training residuals and passed to both (``Gaussian(sigma=σ)``, ``sigma_noise=σ``).
- ``λ`` = ``--prior-precision`` (not rescaled by ``K/D``), temperature ``T = 1``, the posterior
  mean is the MAP (laplace-torch never moves it; ours with ``find_map=False``).
- Predictive variances are the functional ones ``J_P Σ J_Pᵀ`` (laplace-torch's ``f_var``; ours
  with ``include_noise=False``), i.e. without ``σ²``.
- laplace-torch's fit is timed with its posterior covariance (the ``K × K`` factorisation it
  otherwise defers to the first prediction), so both sides end with ``Σ``. Ours, with fewer
  GGN rows ``r = N·O`` than ``K`` (diabetes: 397 < 1000), forms ``Σ`` from the rows by
  Woodbury's identity and leaves the ``K × K`` GGN, precision and factor to first use
  (`infer.laplace.posteriors.full`); the agreement check reads the precision, which forms it. With
  ``r > 2K/3`` (digits) it forms all four in the fit. Classification rows are ``N·(C−1)``
  (the softmax Hessian's rank).

laplace-torch is a comparison only, never a dependency of pyro_subspace. Without it, (a) and (b)
run our side only. It was installed without letting pip touch torch::

    pip install --no-deps laplace-torch asdfghjkl==0.1a4 backpack-for-pytorch \\
        curvlinops-for-pytorch torchmetrics lightning-utilities einops unfoldNd einconv opt-einsum

    python benchmarks/laplace_vs_laplace_torch.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pyro_subspace import SubspaceNet, datasets, fit_map, likelihoods, subspaces
from pyro_subspace.curvature import full_jacobians, ggn_vector_product, lanczos_eigh
from pyro_subspace.curvature.output_hessian import hessian_factor
from pyro_subspace.infer import AutoSubspaceLaplace, linearized_moments, linearized_predictive


def load_laplace():
    """laplace-torch's ``Laplace`` and its version, or ``(None, reason)``."""
    try:
        from importlib.metadata import version

        from laplace import Laplace
    except (ImportError, RuntimeError, OSError, AttributeError) as exc:  # e.g. torchvision's
        return None, f"{type(exc).__name__}: {exc}"
    return Laplace, version("laplace-torch")


# ---------------------------------------------------------------------- (a) the two fits


def mlp(d_in: int, d_out: int, hidden: tuple[int, ...] = (50, 50)) -> nn.Module:
    layers, width = [], d_in
    for h in hidden:
        layers += [nn.Linear(width, h), nn.Tanh()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, d_out))


HIDDEN = {"diabetes": (50, 50), "digits": (64, 64), "synthetic": (64, 64)}

#: laplace-torch configurations screened for the fastest: (backend name, DataLoader batch size).
LT_CONFIGS = [
    ("BackPackGGN", 32),
    ("BackPackGGN", 128),
    ("BackPackGGN", 512),
    ("CurvlinopsGGN", 16),
    ("CurvlinopsGGN", 32),
    ("CurvlinopsGGN", 64),
    ("AsdlGGN", 32),
    ("AsdlGGN", 128),
]


def lt_backend(name: str):
    import laplace.curvature

    return getattr(laplace.curvature, name)


@dataclass
class Task:
    name: str
    regression: bool
    net: nn.Module  # the MAP network, float32
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    sigma: float | None
    indices: torch.Tensor  # (K,) int64, sorted
    lam: float

    def likelihood(self, dtype: torch.dtype = torch.float32) -> likelihoods.Likelihood:
        lik = (
            likelihoods.Gaussian(sigma=self.sigma) if self.regression else likelihoods.Categorical()
        )
        return lik.to(dtype)

    def cast(
        self, dtype: torch.dtype
    ) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A copy of the network and the data in ``dtype`` (targets stay as they are)."""
        net = mlp(self.x.shape[1], 1 if self.regression else 10, HIDDEN[self.name]).to(dtype)
        net.load_state_dict(self.net.state_dict())
        y = self.y.to(dtype) if self.regression else self.y
        return net.eval(), self.x.to(dtype), y, self.x_test.to(dtype)


def make_task(name: str, k: int, lam: float, quick: bool, seed: int = 0) -> Task:
    torch.manual_seed(seed)
    regression = name == "diabetes"
    data = datasets.diabetes(seed=seed) if regression else datasets.digits(seed=seed)
    x, y, x_test = data.x_train, data.y_train, data.x_test
    if quick and not regression:
        x, y, x_test = x[:400], y[:400], x_test[:100]
    n = x.shape[0]
    net = mlp(x.shape[1], 1 if regression else data.n_classes, HIDDEN[name])
    train_lik = likelihoods.Gaussian() if regression else likelihoods.Categorical()
    epochs = 200 if regression else (100 if quick else 500)  # diabetes: less overfit
    fit_map(
        net,
        train_lik,
        x,
        y,
        epochs=epochs,
        lr=1e-2,
        weight_decay=lam / n,
        seed=seed,
        progress=False,
    )
    net.eval()
    sigma = None
    if regression:
        with torch.no_grad():
            sigma = float((net(x).squeeze(-1) - y).square().mean().sqrt())
    lik = likelihoods.Gaussian(sigma=sigma) if regression else likelihoods.Categorical()
    sub = subspaces.subnetwork(net, k, "diag_laplace", likelihood=lik, x=x, prior_precision=lam)
    return Task(name, regression, net, x, y, x_test, sigma, sub.basis.clone(), lam)


def fit_ours(task: Task, net: nn.Module, x, y, lik, chunk: int) -> AutoSubspaceLaplace:
    sub = subspaces.subnetwork(net, strategy="indices", indices=task.indices)
    model = SubspaceNet(net, sub, lik, prior_scale=task.lam**-0.5)
    guide = AutoSubspaceLaplace(
        model, prior_precision=task.lam, prior_mean="zero", chunk_size=chunk
    )
    return guide.fit(x, y, find_map=False)


def fit_theirs(Laplace, task: Task, net: nn.Module, x, y, batch: int, backend: str | None = None):
    from torch.utils.data import DataLoader, TensorDataset

    kwargs = {} if backend is None else {"backend": lt_backend(backend)}
    la = Laplace(
        net,
        "regression" if task.regression else "classification",
        subset_of_weights="subnetwork",
        hessian_structure="full",
        subnetwork_indices=task.indices.clone(),
        prior_precision=task.lam,
        sigma_noise=task.sigma if task.regression else 1.0,
        temperature=1.0,
        **kwargs,
    )
    targets = y[:, None] if task.regression else y  # laplace-torch: y.ndim == outputs.ndim
    with warnings.catch_warnings():  # BackPack/ASDL hook deprecation notices
        warnings.simplefilter("ignore", (UserWarning, FutureWarning))
        la.fit(DataLoader(TensorDataset(x, targets), batch_size=batch))
        la.posterior_covariance
    return la


def predict_ours(task: Task, guide, x_test):
    """Regression: ``(f_mean, f_var)`` ``(M, 1)``; classes: ``(f_mean, f_cov, probit probs)``."""
    if task.regression:
        pred = linearized_predictive(guide, x_test, include_noise=False)
        return pred.mean, pred.variance
    f_mean, f_cov = linearized_moments(guide, x_test)
    return f_mean, f_cov, linearized_predictive(guide, x_test, link_approx="probit").probs


def predict_theirs(task: Task, la, x_test):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (UserWarning, FutureWarning))
        return _predict_theirs(task, la, x_test)


def _predict_theirs(task: Task, la, x_test):
    if task.regression:
        f_mu, f_var = la(x_test, pred_type="glm")
        return f_mu, f_var[..., 0]
    # The GLM logit moments are laplace-torch's private _glm_predictive_distribution.
    f_mu, f_var = la._glm_predictive_distribution(x_test)
    return f_mu, f_var, la(x_test, pred_type="glm", link_approx="probit")


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a − b| / max |b|`` (for quantities that cross zero: means, logits, precisions)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def rel_elem(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a − b| / |b|`` elementwise (for positive quantities: variances, probabilities)."""
    a, b = a.double(), b.double()
    return float(((a - b).abs() / b.abs()).max())


def best_of(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Best wall time of each function over ``repeats`` interleaved rounds, and its last result.

    One untimed warm-up call each, then rounds that call every function once in turn, so that
    the load of other processes on a shared machine hits all of them alike.
    """
    outs = {key: fn() for key, fn in fns.items()}
    times: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            outs[key] = fn()
            times[key].append(time.perf_counter() - start)
    return {key: min(t) for key, t in times.items()}, outs


def screen(Laplace, task: Task, configs, dtype: torch.dtype = torch.float32) -> dict:
    """laplace-torch fit time (in ``dtype``) per ``(backend, batch)``: one warm-up fit, then one
    timed fit, each on a fresh copy of the network (backends attach hooks to it); a
    configuration that fails maps to its error message instead."""
    out = {}
    for backend, batch in configs:
        net, x, y, _ = task.cast(dtype)
        try:
            fit_theirs(Laplace, task, net, x, y, batch, backend)
            start = time.perf_counter()
            fit_theirs(Laplace, task, net, x, y, batch, backend)
            out[backend, batch] = time.perf_counter() - start
        except Exception as exc:
            out[backend, batch] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
    return out


def part_a(args, Laplace) -> None:
    lam, k, chunk = args.prior_precision, args.subnetwork_size, args.chunk_size
    configs = [(b, n) for b, n in LT_CONFIGS if not args.quick or n == 32]
    tdt = getattr(torch, args.time_dtype)  # the timed fits' dtype (float32 unless asked)
    tname = args.time_dtype
    print("(a) Subnetwork Laplace, full K x K covariance: ours vs laplace-torch")
    print("    MLP (Tanh) diabetes 10-50-50-1, digits 64-64-64-10; K = " + f"{k} weights by")
    print(f"    diag-Laplace selection (same indices for both), lambda = {lam:g}, T = 1; our")
    print(f"    chunk_size = {chunk}.")
    print(f"    Agreement in float64 (laplace-torch's default backend), times in {tname} on one")
    print("    thread: laplace-torch's configurations screened, the two fastest fits then raced")
    print(f"    against ours in {args.repeats} interleaved rounds after a warm-up (best of each),")
    print("    fits and then predictives; the one with the faster fit + predictive is reported.")
    print()
    agree_rows, time_rows, screens = [], [], {}
    for name in ("diabetes", "digits"):
        task = make_task(name, k, lam, args.quick)
        n, d = task.x.shape[0], sum(p.numel() for p in task.net.parameters())
        # --- agreement, float64
        net64, x64, y64, xt64 = task.cast(torch.float64)
        guide = fit_ours(task, net64, x64, y64, task.likelihood(torch.float64), chunk)
        ours = predict_ours(task, guide, xt64)
        row = {"task": name, "N": n, "D": d, "sigma": task.sigma}
        if Laplace is not None:
            net64b = task.cast(torch.float64)[0]
            la = fit_theirs(Laplace, task, net64b, x64, y64, chunk)
            theirs = predict_theirs(task, la, xt64)
            row["precision"] = rel_norm(guide.precision, la.posterior_precision)
            row["mean"] = rel_norm(ours[0], theirs[0])
            row["var"] = rel_elem(ours[1], theirs[1]) if task.regression else None
            if not task.regression:
                row["cov"] = rel_norm(ours[1], theirs[1])
                row["var"] = rel_elem(
                    ours[1].diagonal(dim1=-2, dim2=-1), theirs[1].diagonal(dim1=-2, dim2=-1)
                )
                row["probit"] = rel_elem(ours[2], theirs[2])
        agree_rows.append(row)
        # --- timing, float32 (or --time-dtype)
        lik32 = task.likelihood(tdt)
        net32, x32, y32, xt32 = task.cast(tdt)
        fits = {"ours": partial(fit_ours, task, net32, x32, y32, lik32, chunk)}
        if Laplace is not None:
            screens[name] = screen(Laplace, task, configs, tdt)
            timed = {c: t for c, t in screens[name].items() if isinstance(t, float)}
            for c in sorted(timed, key=timed.get)[:2]:
                lt_net, lt_x, lt_y, _ = task.cast(tdt)
                fits[c] = partial(fit_theirs, Laplace, task, lt_net, lt_x, lt_y, c[1], c[0])
        t_fit, fitted = best_of(fits, args.repeats)
        trow = {"task": name, "N": n, "ours": t_fit["ours"]}
        preds = {"ours": partial(predict_ours, task, fitted["ours"], xt32)}
        for c in (c for c in t_fit if c != "ours"):  # the raced configurations' predictives
            preds[c] = partial(predict_theirs, task, fitted[c], xt32)
        t_pred, pred_out = best_of(preds, args.repeats)
        trow["ours_pred"] = t_pred["ours"]
        if len(fits) > 1:  # laplace-torch's fastest at fit + predictive (a backend's
            # Jacobians also serve its predictive: ASDL's fit can be fast and its predictive slow)
            best = min((c for c in t_fit if c != "ours"), key=lambda c: t_fit[c] + t_pred[c])
            trow["lt"], trow["config"], trow["lt_pred"] = t_fit[best], best, t_pred[best]
            pred_out["lt"] = pred_out[best]
        # float32 rounding: each library's float32 fit against our float64 one (same MAP net)
        var = (lambda p: p[1]) if task.regression else (lambda p: p[1].diagonal(dim1=-2, dim2=-1))
        trow["f32_ours"] = (
            rel_norm(fitted["ours"].covariance, guide.covariance),
            rel_elem(var(pred_out["ours"]), var(ours)),
        )
        if "lt" in pred_out:
            trow["f32_lt"] = (
                rel_norm(fitted[trow["config"]].posterior_covariance, guide.covariance),
                rel_elem(var(pred_out["lt"]), var(ours)),
            )
        time_rows.append(trow)

    def fmt(v) -> str:
        return "-" if v is None else f"{v:.1e}"

    print("    Agreement (float64): largest relative difference, ours vs laplace-torch")
    print("    (precision, means, logit covariances: max|a-b|/max|b|; variances, probit")
    print("    probabilities: max |a-b|/|b| elementwise)")
    head = f"    {'task':<9}{'N':>6}{'D':>6}{'sigma':>8}  {'precision':>9} {'f mean':>8} "
    print(head + f"{'f var':>8} {'f cov':>8} {'probit p':>8}")
    for r in agree_rows:
        sigma = "-" if r["sigma"] is None else f"{r['sigma']:.3f}"
        print(
            f"    {r['task']:<9}{r['N']:>6}{r['D']:>6}{sigma:>8}  {fmt(r.get('precision')):>9} "
            f"{fmt(r.get('mean')):>8} {fmt(r.get('var')):>8} {fmt(r.get('cov')):>8} "
            f"{fmt(r.get('probit')):>8}"
        )
    if Laplace is not None:
        worst = max(
            v
            for r in agree_rows
            for key, v in r.items()
            if key in ("precision", "mean", "var", "cov", "probit") and v is not None
        )
        verdict = "met" if worst < 1e-6 else "MISSED"
        print(f"    worst: {worst:.1e}  (target < 1e-6: {verdict})")
    print()
    if screens:
        print(f"    laplace-torch screening: fit seconds ({tname}, one fit after a warm-up)")
        print(f"    {'backend':<15}{'batch':>6}" + "".join(f"{t:>10}" for t in screens))
        for c in configs:
            cells = [screens[t][c] for t in screens]
            line = f"    {c[0]:<15}{c[1]:>6}"
            line += "".join(
                f"{v:>10.3f}" if isinstance(v, float) else f"{'failed':>10}" for v in cells
            )
            print(line)
        errors = {v for t in screens for v in screens[t].values() if isinstance(v, str)}
        for e in sorted(errors):
            print(f"      failed: {e}")
        print()
    print(f"    Times in seconds ({tname}, one thread; fit = curvature + Sigma: laplace-torch's")
    print("    K x K Cholesky/inverse, ours the same or Woodbury from r = N*O < K GGN rows;")
    print("    predictive = GLM logit moments + probit / GLM mean and variance on the test set)")
    print(
        f"    {'task':<9}{'N':>6}{'ours fit':>9}{'lt fit':>8}{'ratio':>7}"
        f"{'ours pred':>10}{'lt pred':>8}{'ratio':>7}{'fit+pred':>9}   lt configuration"
    )
    for r in time_rows:
        line = f"    {r['task']:<9}{r['N']:>6}{r['ours']:>9.3f}"
        if r.get("lt") is None:
            print(line + f"{'-':>8}{'-':>7}{r['ours_pred']:>10.3f}")
            continue
        both = (r["lt"] + r["lt_pred"]) / (r["ours"] + r["ours_pred"])
        line += f"{r['lt']:>8.3f}{r['lt'] / r['ours']:>6.1f}x{r['ours_pred']:>10.3f}"
        line += f"{r['lt_pred']:>8.3f}{r['lt_pred'] / r['ours_pred']:>6.1f}x{both:>8.1f}x"
        print(line + f"   {r['config'][0]}, batch {r['config'][1]}")
    print(f"    {tname} against our float64 fit (max relative difference: covariance")
    print("    max|a-b|/max|b|, functional variances elementwise)")
    for r in time_rows:
        line = f"    {r['task']:<9} ours cov {r['f32_ours'][0]:.1e} f var {r['f32_ours'][1]:.1e}"
        if "f32_lt" in r:
            line += f"   laplace-torch cov {r['f32_lt'][0]:.1e} f var {r['f32_lt'][1]:.1e}"
        print(line)
    if Laplace is not None and all(r.get("lt") for r in time_rows):
        both = min((r["lt"] + r["lt_pred"]) / (r["ours"] + r["ours_pred"]) for r in time_rows)
        fit = min(r["lt"] / r["ours"] for r in time_rows)
        verdict = "met" if both >= 3 else f"MISSED by {3 / both:.2f}x"
        print(
            f"    fit + predictive against laplace-torch's fastest: >= {both:.1f}x "
            f"(target >= 3x: {verdict}); fit alone >= {fit:.1f}x"
        )
    print()


# ---------------------------------------------------------------------- (b) memory vs N


def memory_worker(kind: str, n: int, chunk: int, k: int, lam: float) -> None:
    """Run in a fresh process: print the peak RSS growth (MB) of one subnetwork GGN fit."""
    torch.manual_seed(0)
    net = mlp(64, 10, HIDDEN["synthetic"]).eval()
    x = torch.randn(n, 64)
    y = torch.randint(0, 10, (n,))
    d = sum(p.numel() for p in net.parameters())
    indices = torch.randperm(d, generator=torch.Generator().manual_seed(0))[:k].sort().values
    task = Task("synthetic", False, net, x, y, x[:1], None, indices, lam)
    Laplace = None
    if kind != "ours":
        Laplace, _ = load_laplace()
    lik = task.likelihood()
    base = reset_peak_rss()
    if kind == "ours":
        fit_ours(task, net, x, y, lik, chunk)
    else:
        backend, batch = kind.split(":")
        fit_theirs(Laplace, task, net, x, y, int(batch), backend)
    print(f"PEAK_MB {(peak_rss() - base) / 2**20:.1f}")


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> int:
    """Reset the peak RSS to the current RSS and return it (bytes).

    Linux: writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM``, so the transient peak
    of the imports does not hide the fit's. Elsewhere: ``ru_maxrss`` (the peak so far).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    current = _status_bytes("VmRSS")
    return current if current is not None else peak_rss()


def peak_rss() -> int:
    """Peak RSS of this process in bytes (``VmHWM``, else ``ru_maxrss``)."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_worker(kind: str, n: int, chunk: int, k: int, lam: float) -> float | None:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--worker-n",
        str(n),
        "--chunk-size",
        str(chunk),
        "--subnetwork-size",
        str(k),
        "--prior-precision",
        str(lam),
    ]
    # A fixed mmap threshold: glibc's dynamic one lets freed Jacobian blocks stay in the heap,
    # whose fragmentation then grows the RSS with the number of chunks (allocator retention, not
    # live tensors: ours measured 261 -> 316 MB for N = 1k -> 16k with it, 241 -> 242 without).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("PEAK_MB"):
            return float(line.split()[1])
    print(f"    worker {kind} N={n} failed: {done.stderr.strip().splitlines()[-1:]}")
    return None


def part_b(args, Laplace) -> None:
    chunk, k = args.chunk_size, args.subnetwork_size
    kinds = ["ours"]
    if Laplace is not None:
        kinds += args.lt_memory[:1] if args.quick else args.lt_memory
    print("(b) Peak memory of the subnetwork GGN fit vs N (digits-shaped MLP 64-64-64-10,")
    print(f"    D = 8970, K = {k} random indices, synthetic inputs, float32). Fresh process per")
    print("    cell; MB = peak RSS during the fit minus the RSS just before it (after imports,")
    print("    model and data creation; Linux VmHWM reset through /proc/self/clear_refs), with")
    print("    MALLOC_MMAP_THRESHOLD_=131072 so glibc returns freed blocks instead of fragmenting.")
    print(f"    ours: chunk_size = {chunk}; laplace-torch: backend with DataLoader batch size.")
    print()
    label = {c: "ours" if c == "ours" else c.replace("GGN", "") for c in kinds}
    print(f"    {'N':>7}" + "".join(f"{label[c]:>16}" for c in kinds))
    rows = []
    for n in args.memory_n:
        cells = [run_worker(c, n, chunk, k, args.prior_precision) for c in kinds]
        rows.append(cells)
        print(f"    {n:>7}" + "".join(f"{'-' if v is None else f'{v:.0f} MB':>16}" for v in cells))
    if len(kinds) > 1 and all(v is not None for v in rows[-1]):
        ours, smallest = rows[-1][0], min(rows[-1][1:])
        verdict = "met" if ours <= smallest else f"MISSED by {ours - smallest:.0f} MB"
        print(
            f"    N = {args.memory_n[-1]}: ours {ours:.0f} MB vs laplace-torch's smallest "
            f"{smallest:.0f} MB (target <=: {verdict})"
        )
    print()


# ---------------------------------------------------------------------- (c) Lanczos vs eigh


def part_c(args) -> None:
    torch.manual_seed(0)
    data = datasets.digits()
    x, y = data.x_train, data.y_train
    hidden = (100, 30)
    if args.quick:
        x, y, hidden = x[:200], y[:200], (20, 10)
    net = mlp(64, 10, hidden)
    lik = likelihoods.Categorical()
    fit_map(
        net,
        lik,
        x,
        y,
        epochs=100 if args.quick else 300,
        lr=1e-2,
        weight_decay=args.prior_precision / x.shape[0],
        seed=0,
        progress=False,
    )
    net = net.double().eval()
    x = x.double()
    d = sum(p.numel() for p in net.parameters())
    n, o, top = x.shape[0], 10, args.top_k
    print(
        f"(c) Top-{top} GGN eigenvalues, MLP 64-{hidden[0]}-{hidden[1]}-10 (D = {d}) at its MAP on"
    )
    print(f"    digits (N = {n}, O = {o}), float64.")

    def build() -> torch.Tensor:
        rows = [
            torch.einsum("noc,nod->ncd", hessian_factor(lik, out), jac).reshape(-1, d)
            for out, jac in full_jacobians(net, x)
        ]  # A = L^T J, shape (N*O, D): the explicit Jacobian, weighted by H = L L^T
        a = torch.cat(rows)
        return a.T @ a

    start = time.perf_counter()
    g = build()
    t_build = time.perf_counter() - start
    start = time.perf_counter()
    values, _ = torch.linalg.eigh(g)
    t_eigh = time.perf_counter() - start
    start = time.perf_counter()
    torch.linalg.eigvalsh(g)
    t_eigvalsh = time.perf_counter() - start
    exact = values.flip(0)[:top]
    del g

    def lanczos():
        return lanczos_eigh(
            lambda v: ggn_vector_product(net, lik, x, v, chunk_size=2048), d, top, seed=0
        )

    times, outs = best_of({"lanczos": lanczos}, args.repeats)
    t_lanczos, (approx, _) = times["lanczos"], outs["lanczos"]
    err = float(((approx - exact).abs() / exact.abs()).max())
    num_iter = min(d, max(2 * top + 20, 3 * top))
    print(f"    dense: build G = J^T H J {t_build:.2f} s (explicit per-sample Jacobians, then")
    print(f"           A^T A), eigh {t_eigh:.2f} s, eigvalsh {t_eigvalsh:.2f} s (each timed once)")
    print(f"    ours:  lanczos_eigh(ggn_vector_product), {num_iter} products, {t_lanczos:.3f} s")
    print(f"           (best of {args.repeats})")
    print(
        f"    max relative error of the top {top} eigenvalues: {err:.1e} (target < 1e-6: "
        f"{'met' if err < 1e-6 else 'MISSED'})"
    )
    print(f"    {'time ratio dense / ours':<34}{'ratio':>9}")
    for label, t in (
        ("eigh only", t_eigh),
        ("build + eigh", t_build + t_eigh),
        ("eigvalsh only", t_eigvalsh),
        ("build + eigvalsh", t_build + t_eigvalsh),
    ):
        print(f"    {label:<34}{t / t_lanczos:>8.0f}x")
    print("    (target >= 100x)")
    print(f"    largest eigenvalue {float(exact[0]):.4f}, {top}-th {float(exact[-1]):.4f}")
    print()


# ---------------------------------------------------------------------- (d) K-FAC Laplace

KRON_HIDDEN = (128, 128)
#: laplace-torch K-FAC configurations screened: (backend, DataLoader batch size; None = all N)
KRON_LT_CONFIGS = [
    ("BackPackGGN", None),
    ("BackPackGGN", 128),
    ("CurvlinopsGGN", None),
    ("CurvlinopsGGN", 128),
]
#: our ``conv`` convention whose K-FAC of a Conv2d is each laplace-torch backend's
#: (`curvature.kfac`, ``tests/test_laplace_kron_vs_laplace_torch.py``); for Linear layers the
#: conventions coincide
KRON_CONV = {"BackPackGGN": "backpack", "CurvlinopsGGN": "expand"}
#: laplace-torch's all-weight GLM predictive on the CNN: test points per call (None: all M at
#: once). CurvlinopsGGN's Jacobians are ``torch.func.jacrev`` of the whole batch's M*C logits, a
#: vmap over M*C cotangents that each carry all M samples' activations, so time and memory grow
#: like M^2: all M = 360 at once went past 18 GB and was killed for memory (24 GB machine);
#: measured 6-9 ms per point at 1-8 points a call, 11 ms at 16, 23 ms at 32, 43 ms at 64.
#: BackPack's per-output batch gradients grow like M (7.7 ms per point at 360, 8.6 at 128).
#: Last layer: laplace-torch's Jacobians are closed-form features (every call takes all M).
CNN_LT_PRED_CHUNK = {"BackPackGGN": None, "CurvlinopsGGN": 8}


def cnn(n_classes: int = 10) -> nn.Module:
    """Digits CNN on 8x8 images: 16 3x3 filters, 32 strided 3x3 filters, Linear 512 -> C."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, n_classes),
    )  # fmt: skip


#: the architectures of (d), untrained
KRON_BUILD = {"MLP": partial(mlp, 64, 10, KRON_HIDDEN), "CNN": cnn}
KRON_LABEL = {
    "MLP": "digits MLP (Tanh) 64-128-128-10",
    "CNN": "digits CNN 1x8x8 -Conv2d(1,16,3,p1)-ReLU-Conv2d(16,32,3,s2,p1)-ReLU-Linear(512,10)",
}


@dataclass
class KronTask:
    name: str  # "MLP" / "CNN" (`KRON_BUILD`)
    net: nn.Module  # the MAP network, float32
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def copy(self, dtype: torch.dtype) -> nn.Module:
        """A fresh copy of the MAP net in ``dtype`` (BackPack extends the model it is given)."""
        out = KRON_BUILD[self.name]().to(dtype)
        out.load_state_dict(self.net.state_dict())
        return out.eval()

    @property
    def convs(self) -> tuple[str, ...]:
        """Our conv conventions timed: the MLP has no Conv2d (all the same: 'backpack', as
        before the CNN), the CNN each backend's (`KRON_CONV`)."""
        return ("backpack",) if self.name == "MLP" else tuple(KRON_CONV.values())

    def lt_chunk(self, backend: str, subset: str) -> int | None:
        """Test points per laplace-torch predictive call (`CNN_LT_PRED_CHUNK`)."""
        if self.name != "CNN" or subset != "all":
            return None
        return CNN_LT_PRED_CHUNK[backend]


def kron_epochs(name: str, quick: bool) -> int:
    """Full-batch Adam steps to the MAP of (d)'s ``name`` net."""
    return (100 if quick else 500) if name == "MLP" else (60 if quick else 300)


def make_kron_task(name: str, lam: float, quick: bool, seed: int = 0) -> KronTask:
    """The digits net ``name`` at its MAP (float32; full-batch Adam, weight decay ``λ/N``,
    seeded) and the data (the CNN's as ``(N, 1, 8, 8)`` images of the standardised pixels)."""
    torch.manual_seed(seed)
    data = datasets.digits(seed=seed)
    x, y, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    if name == "CNN":
        x, x_test = x.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8)
    if quick:
        x, y, x_test, y_test = x[:400], y[:400], x_test[:100], y_test[:100]
    net = KRON_BUILD[name]()
    epochs = kron_epochs(name, quick)
    fit_map(
        net,
        likelihoods.Categorical(),
        x,
        y,
        epochs=epochs,
        lr=1e-2,
        weight_decay=lam / x.shape[0],
        seed=seed,
        progress=False,
    )
    return KronTask(name, net.eval(), x, y, x_test, y_test)


def fit_ours_kron(net, x, y, subset: str, lam: float, conv: str):
    from pyro_subspace.infer import Laplace as OurLaplace

    la = OurLaplace(
        net, likelihoods.Categorical(), subset, "kron", prior_precision=lam,
        structure_options={"conv": conv},
    )  # fmt: skip
    return la.fit(x, y)


def fit_theirs_kron(net, x, y, subset: str, lam: float, backend: str, batch: int | None):
    import laplace
    from torch.utils.data import DataLoader, TensorDataset

    cls = laplace.KronLaplace if subset == "all" else laplace.KronLLLaplace
    la = cls(net, "classification", prior_precision=lam, backend=lt_backend(backend))
    with warnings.catch_warnings():  # BackPack's / curvlinops' backward-hook notices
        warnings.simplefilter("ignore", (UserWarning, FutureWarning))
        la.fit(DataLoader(TensorDataset(x, y), batch_size=batch or len(x)))
    return la


def predict_kron(la, x_test, chunk: int | None = None):
    """Probit probabilities ``(M, C)`` (either library's ``la(x, link_approx="probit")``), in
    calls of ``chunk`` test points (``None``: one call)."""
    parts = [x_test] if chunk is None else x_test.split(chunk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (UserWarning, FutureWarning))
        return torch.cat([la(part, pred_type="glm", link_approx="probit") for part in parts])


def glm_theirs(la, x_test, chunk: int | None = None):
    """laplace-torch's GLM logit mean and covariance (its ``_glm_predictive_distribution``)."""
    parts = [x_test] if chunk is None else x_test.split(chunk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (UserWarning, FutureWarning))
        outs = [la._glm_predictive_distribution(part) for part in parts]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def fit_and_predict_ours(task: KronTask, subset: str, lam: float, conv: str):
    """Ours, timed: a float32 copy of the MAP net, `Laplace(..., "kron")` fit, probit."""
    la = fit_ours_kron(task.copy(torch.float32), task.x, task.y, subset, lam, conv)
    return predict_kron(la, task.x_test)


def fit_and_predict_theirs(task: KronTask, subset: str, lam: float, config):
    """laplace-torch, timed: a float32 copy (BackPack extends the model it gets), fit, probit."""
    backend, batch = config
    la = fit_theirs_kron(task.copy(torch.float32), task.x, task.y, subset, lam, backend, batch)
    return predict_kron(la, task.x_test, task.lt_chunk(backend, subset))


def kron_agreement(ours, theirs, x_test, chunk: int | None = None) -> dict:
    """Largest relative differences (float64): K-FAC eigenvalues per block, the posterior
    precision on random vectors, the GLM logit mean / covariance / variances, the probit
    probabilities and the log marginal likelihood."""
    post, k = ours.guide.posterior, theirs.n_params
    eig = []
    for block, ls in zip(post.blocks(), theirs.H.eigenvalues, strict=True):
        mine = torch.outer(block["gvals"], block["avals"]).reshape(-1).sort().values
        want = ls[0] if len(ls) == 1 else torch.outer(ls[0], ls[1]).reshape(-1)
        eig.append(rel_norm(mine, want.sort().values))
    v = torch.randn(4, k, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    t_mu, t_cov = glm_theirs(theirs, x_test, chunk)
    o_mu, o_cov = linearized_moments(ours, x_test)
    diag = lambda c: c.diagonal(dim1=-2, dim2=-1)  # noqa: E731
    if hasattr(post, "apply_precision"):  # Σ⁻¹ v, Σ v block by block (no dense matrix)
        prec_v, cov_v = post.apply_precision(v), post.apply_covariance(v)
    else:  # the earlier private name
        prec_v, cov_v = post._apply(v, 1.0), post._apply(v, -1.0)
    return {
        "eigenvalues": max(eig),
        "precision v": rel_norm(prec_v, theirs.posterior_precision.bmm(v, 1)),
        "covariance v": rel_norm(cov_v, theirs.posterior_precision.bmm(v, -1)),
        "f mean": rel_norm(o_mu, t_mu),
        "f cov": rel_norm(o_cov, t_cov),
        "f var": rel_elem(diag(o_cov), diag(t_cov)),
        "probit": rel_elem(predict_kron(ours, x_test), predict_kron(theirs, x_test, chunk)),
        "lml": rel_norm(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()),
    }


def kron_worker(spec: str, path: str, lam: float) -> None:
    """Run in a fresh process: one fit + probit predictive of (d) (or nothing: ``baseline``),
    then print the process's peak RSS. ``spec``: ``TASK:baseline``, ``TASK:SUBSET:ours:CONV``
    or ``TASK:SUBSET:lt:BACKEND:BATCH`` (``BATCH`` ``N`` = all). Every mode imports both
    libraries (laplace-torch with its BackPack and curvlinops backends) and loads the MAP net
    and the data saved by the parent (no training here), so only the fit differs."""
    import laplace.curvature  # noqa: F401  (BackPack, curvlinops, ASDL)

    from pyro_subspace.infer import Laplace as _OurLaplace  # noqa: F401

    blob = torch.load(path, weights_only=True)
    parts = spec.split(":")
    name = parts[0]
    net = KRON_BUILD[name]()
    net.load_state_dict(blob["state"])
    task = KronTask(name, net.eval(), blob["x"], blob["y"], blob["x_test"], blob["y_test"])
    if parts[1] != "baseline":
        subset, who = parts[1], parts[2]
        if who == "ours":
            out = fit_and_predict_ours(task, subset, lam, parts[3])
        else:
            batch = None if parts[4] == "N" else int(parts[4])
            out = fit_and_predict_theirs(task, subset, lam, (parts[3], batch))
        assert out.shape == (len(task.x_test), 10)
    else:
        task.copy(torch.float32)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    print(f"KRON_PEAK {peak_rss() / 2**20:.1f} {maxrss / 1024:.1f}")


def run_kron_worker(spec: str, path: str, lam: float) -> tuple[float, float] | None:
    """Peak RSS (VmHWM, ru_maxrss; MiB) of a fresh `kron_worker` process, with glibc's
    ``MALLOC_MMAP_THRESHOLD_`` fixed as in (b) (for every configuration alike)."""
    cmd = [sys.executable, __file__, "--kron-worker", spec, "--kron-file", path]
    cmd += ["--prior-precision", str(lam)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("KRON_PEAK"):
            return float(line.split()[1]), float(line.split()[2])
    print(f"    worker {spec} failed: {done.stderr.strip().splitlines()[-1:]}")
    return None


def kron_memory(args, tasks: dict, chosen: dict) -> None:
    """Peak RSS of fresh processes, each one configuration of (d) (`kron_worker`)."""
    import tempfile

    lam = args.prior_precision
    print("    Peak memory: peak RSS (VmHWM, MiB) of a FRESH process per cell that imports torch,")
    print("    pyro_subspace and laplace-torch (with BackPack and curvlinops), loads the MAP net")
    print("    and the data (saved by this process; no training), then runs ONE fit + probit")
    print("    predictive of the configuration timed above (no warm-up); 'baseline' is the same")
    print("    process without the fit. MALLOC_MMAP_THRESHOLD_=131072 for all, as in (b).")
    head = f"    {'task':<5}{'subset':<12}{'baseline':>9}{'ours':>8}{'lt':>8}"
    print(head + f"{'ours-base':>10}{'lt-base':>9}{'lt/ours':>8}   ours conv / lt configuration")
    with tempfile.TemporaryDirectory() as tmp:
        for name, task in tasks.items():
            path = os.path.join(tmp, f"{name}.pt")
            torch.save(
                {"state": task.net.state_dict(), "x": task.x, "y": task.y,
                 "x_test": task.x_test, "y_test": task.y_test},
                path,
            )  # fmt: skip
            base = run_kron_worker(f"{name}:baseline", path, lam)
            for subset in ("last_layer", "all"):
                if (name, subset) not in chosen:
                    continue
                conv, config = chosen[name, subset]
                ours = run_kron_worker(f"{name}:{subset}:ours:{conv}", path, lam)
                lt = None
                if config is not None:
                    batch = config[1] or "N"
                    lt = run_kron_worker(f"{name}:{subset}:lt:{config[0]}:{batch}", path, lam)
                line = f"    {name:<5}{subset:<12}"
                line += f"{base[0]:>9.0f}" if base else f"{'-':>9}"
                line += f"{ours[0]:>8.0f}" if ours else f"{'-':>8}"
                line += f"{lt[0]:>8.0f}" if lt else f"{'-':>8}"
                if base and ours:
                    line += f"{ours[0] - base[0]:>10.0f}"
                else:
                    line += f"{'-':>10}"
                if base and lt:
                    line += f"{lt[0] - base[0]:>9.0f}"
                    if ours and ours[0] > base[0]:
                        line += f"{(lt[0] - base[0]) / (ours[0] - base[0]):>7.1f}x"
                    else:
                        line += f"{'-':>8}"
                else:
                    line += f"{'-':>9}{'-':>8}"
                desc = f"{conv}"
                if config is not None:
                    desc += f" / {config[0]}, batch {config[1] or 'N'}"
                    chunk = task.lt_chunk(config[0], subset)
                    if chunk:
                        desc += f", predictive {chunk} points a call"
                print(line + f"   {desc}")
    print("    (ours-base, lt-base: the fit's increment over the baseline; lt/ours their ratio)")
    print()


def part_d(args, Laplace) -> None:
    lam = args.prior_precision
    names = ("MLP", "CNN")
    tasks = {name: make_kron_task(name, lam, args.quick) for name in names}
    print("(d) K-FAC Laplace (hessian_structure='kron'): ours vs laplace-torch's KronLaplace /")
    print(f"    KronLLLaplace, type-2 Fisher (GGN), lambda = {lam:g}, at the MAP (full-batch Adam,")
    steps = ", ".join(f"{name} {kron_epochs(name, args.quick)} steps" for name in names)
    print(f"    weight decay lambda/N, seeded: {steps}) of")
    for name, task in tasks.items():
        d = sum(p.numel() for p in task.net.parameters())
        d_ll = sum(p.numel() for p in list(task.net.children())[-1].parameters())
        with torch.no_grad():
            acc = float((task.net(task.x_test).argmax(-1) == task.y_test).float().mean())
        print(f"    {name}: {KRON_LABEL[name]},")
        print(
            f"         D = {d} (last layer {d_ll}), N = {task.x.shape[0]}, "
            f"{task.x_test.shape[0]} test points, MAP test accuracy {acc:.3f}"
        )
    print("    Agreement in float64 with the matching conventions (BackPackGGN <-> our")
    print("    conv='backpack', CurvlinopsGGN <-> 'expand'; the MLP has no Conv2d: BackPack only).")
    print("    Times in float32 on one thread: fit + probit predictive, laplace-torch's")
    print("    configurations screened (one timed run after a warm-up), its fastest then raced")
    print(f"    against ours in {args.repeats} interleaved rounds after a warm-up (best of each).")
    print()
    subsets = ("last_layer", "all")
    if Laplace is not None:
        pairs = {"MLP": [("BackPackGGN", "backpack")], "CNN": list(KRON_CONV.items())}
        agree = {}
        for name, task in tasks.items():
            net64, x64, xt64 = task.copy(torch.float64), task.x.double(), task.x_test.double()
            for backend, conv in pairs[name]:
                for subset in subsets:
                    ours = fit_ours_kron(net64, x64, task.y, subset, lam, conv)
                    theirs = fit_theirs_kron(
                        task.copy(torch.float64), x64, task.y, subset, lam, backend, None
                    )
                    chunk = task.lt_chunk(backend, subset)
                    agree[name, backend, conv, subset] = kron_agreement(ours, theirs, xt64, chunk)
                    del ours, theirs
        keys = list(next(iter(agree.values())))
        print("    Agreement (float64): largest relative difference, ours vs laplace-torch")
        print("    (max|a-b|/max|b|; f var and probit p elementwise max |a-b|/|b|)")
        head = f"    {'task':<5}{'lt backend / ours':<25}{'subset':<11}"
        short = {"eigenvalues": "eigvals", "precision v": "prec v", "covariance v": "cov v"}
        print(head + "".join(f"{short.get(k, k):>9}" for k in keys))
        for (name, backend, conv, subset), row in agree.items():
            line = f"    {name:<5}{backend + ' / ' + conv:<25}{subset:<11}"
            print(line + "".join(f"{row[k]:>9.1e}" for k in keys))
        worst = max(v for row in agree.values() for v in row.values())
        print(f"    worst: {worst:.1e}  (target < 1e-6: {'met' if worst < 1e-6 else 'MISSED'})")
        print()
    rows, chosen = [], {}
    for name, task in tasks.items():
        for subset in subsets:
            runs = {
                ("ours", conv): partial(fit_and_predict_ours, task, subset, lam, conv)
                for conv in task.convs
            }
            screen_times = {}
            if Laplace is not None:
                for config in KRON_LT_CONFIGS:
                    run = partial(fit_and_predict_theirs, task, subset, lam, config)
                    try:
                        run()  # warm-up
                        start = time.perf_counter()
                        run()
                        screen_times[config] = time.perf_counter() - start
                    except Exception as exc:
                        screen_times[config] = f"{type(exc).__name__}: {exc}"[:80]
                timed = {c: t for c, t in screen_times.items() if isinstance(t, float)}
                if timed:
                    best = min(timed, key=timed.get)
                    runs["lt"] = partial(fit_and_predict_theirs, task, subset, lam, best)
            times, outs = best_of(runs, args.repeats)
            # ours with the convention of laplace-torch's fastest backend (the MLP: 'backpack')
            conv = task.convs[0]
            if "lt" in times and KRON_CONV[best[0]] in task.convs:
                conv = KRON_CONV[best[0]]
            row = {"task": name, "subset": subset, "ours": times["ours", conv], "conv": conv}
            row["screen"] = screen_times
            others = [c for c in task.convs if c != conv]
            if others:
                row["other"] = (others[0], times["ours", others[0]])
            if "lt" in times:
                row.update(lt=times["lt"], config=best)
                row["probit f32"] = rel_elem(outs["ours", conv], outs["lt"])
            chosen[name, subset] = (conv, best if "lt" in times else None)
            rows.append(row)
    if Laplace is not None:
        print("    laplace-torch screening: fit + probit predictive seconds (float32)")
        cols = [f"{r['task']} {r['subset'].replace('last_layer', 'last')}" for r in rows]
        print(f"    {'backend':<15}{'batch':>6}" + "".join(f"{c:>10}" for c in cols))
        for backend, batch in KRON_LT_CONFIGS:
            line = f"    {backend:<15}{str(batch or 'N'):>6}"
            for r in rows:
                t = r["screen"][backend, batch]
                line += f"{t:>10.3f}" if isinstance(t, float) else f"{'failed':>10}"
            print(line)
        errors = {t for r in rows for t in r["screen"].values() if isinstance(t, str)}
        for e in sorted(errors):
            print(f"      failed: {e}")
        chunk = CNN_LT_PRED_CHUNK["CurvlinopsGGN"]
        print(f"      (CNN all, CurvlinopsGGN: its predictive in calls of {chunk} test points; all")
        print("      at once needs > 18 GB: see CNN_LT_PRED_CHUNK)")
        print()
    print(f"    Times in seconds (float32, one thread, best of {args.repeats} interleaved rounds):")
    print("    fit + probit predictive on the test set; ours chunk_size 1024 with the conv")
    print("    convention of laplace-torch's fastest backend (the other convention's time beside)")
    head = f"    {'task':<5}{'subset':<12}{'ours':>7}{'lt':>8}{'lt/ours':>8}  {'ours conv':<10}"
    print(head + f"{'other conv':>18}{'probit diff':>12}   lt configuration")
    for r in rows:
        line = f"    {r['task']:<5}{r['subset']:<12}{r['ours']:>7.3f}"
        if "lt" not in r:
            print(line + f"{'-':>8}{'-':>8}  {r['conv']:<10}")
            continue
        backend, batch = r["config"]
        line += f"{r['lt']:>8.3f}{r['lt'] / r['ours']:>7.1f}x  {r['conv']:<10}"
        other = f"{r['other'][0]} {r['other'][1]:.3f}" if "other" in r else "-"
        line += f"{other:>18}{r['probit f32']:>12.1e}"
        print(line + f"   {backend}, batch {batch or 'N'}")
    print("    (probit diff: max |ours - lt| / lt of the float32 probabilities)")
    print()
    if args.kron_memory:
        kron_memory(args, tasks, chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (< 1 minute)")
    parser.add_argument("--subnetwork-size", type=int, default=None, help="K (default 1000)")
    parser.add_argument("--prior-precision", type=float, default=1.0, help="lambda")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument(
        "--lt-memory",
        nargs="*",
        default=["CurvlinopsGGN:32", "CurvlinopsGGN:16", "BackPackGGN:32", "AsdlGGN:32"],
        help="laplace-torch backend:batch configurations measured in (b)",
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--memory-n", type=int, nargs="*", default=None)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument(
        "--time-dtype",
        choices=("float32", "float64"),
        default="float32",
        help="dtype of (a)'s timed fits and predictives, both libraries (agreement: float64)",
    )
    parser.add_argument(
        "--parts", default="abc", help="sections to run: a, b, c (default) and d (K-FAC Laplace)"
    )
    parser.add_argument(
        "--no-kron-memory",
        dest="kron_memory",
        action="store_false",
        help="(d) without its peak-memory table (fresh processes)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kron-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kron-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-n", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread for both libraries (SciPy's BLAS follows torch's)
    if args.subnetwork_size is None:
        args.subnetwork_size = 300 if args.quick else 1000
    if args.kron_worker is not None:
        kron_worker(args.kron_worker, args.kron_file, args.prior_precision)
        return
    if args.worker is not None:
        memory_worker(
            args.worker, args.worker_n, args.chunk_size, args.subnetwork_size, args.prior_precision
        )
        return
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.memory_n is None:
        args.memory_n = [250, 1000] if args.quick else [1000, 4000, 16000]
    Laplace, info = load_laplace()
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}; ",
        end="",
    )
    if Laplace is None:
        print(f"laplace-torch NOT available ({info}):")
        print("  running our side only. Install it with --no-deps (see this file's docstring).")
    else:
        print(f"laplace-torch {info}")
    print()
    if "a" in args.parts:
        part_a(args, Laplace)
    if "b" in args.parts:
        part_b(args, Laplace)
    if "c" in args.parts:
        part_c(args)
    if "d" in args.parts:
        part_d(args, Laplace)


if __name__ == "__main__":
    main()
