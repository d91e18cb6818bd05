"""Bad-input probes of the public API: does every bad argument get a named error before work?

Each probe calls one public entry point with one bad argument (wrong shape, dtype, device-free
type, NaN/inf, empty, out of range, wrong type, unfitted state) and is classified as

- ``named``: a ``ValueError``/``TypeError`` (or a ``RuntimeError`` for "call fit() first"),
  raised from pyro_subspace's own code, whose message starts with the argument's name, with
  **no** forward pass of any network before it (forward pre-hooks count the calls);
- ``after work``: the same, but after at least one forward pass;
- ``silent``: no error at all;
- ``raw``: any other exception (from torch, Pyro, numpy, a wrong name, ...).

Run: ``python benchmarks/probes.py`` (about a minute). Prints one table per entry point and the
totals; the target is 0 silent, 0 raw.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import tempfile
import traceback
import warnings
from collections import Counter, defaultdict

import pyro
import torch
from pyro.infer import HMC, MCMC, NUTS, Predictive
from torch import nn

import pyro_subspace as ps
from pyro_subspace import datasets, infer, likelihoods, subspaces
from pyro_subspace.convert import to_inference_data

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

N = 12
HOOKED: list[nn.Module] = []
CALLS = [0]


def hook(net: nn.Module) -> nn.Module:
    """Count every forward pass of ``net`` (functional calls included)."""
    net.register_forward_pre_hook(lambda *_: CALLS.__setitem__(0, CALLS[0] + 1))
    return net


def reg_net(seed: int = 0, width: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return hook(nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, 1)))


def cls_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return hook(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)))


torch.manual_seed(0)
X = torch.randn(N, 3)
Y = torch.randn(N)
YC = torch.randint(0, 3, (N,))


def bad_x() -> dict[str, object]:
    nan, inf = X.clone(), X.clone()
    nan[2, 1], inf[3, 0] = math.nan, math.inf
    return {
        "x wrong width (N, 2)": X[:, :2],
        "x 1-D (N,)": X[:, 0],
        "x 3-D (N, 1, 3)": X[:, None, :],
        "x float64, net float32": X.double(),
        "x int64": X.long(),
        "x bool": X > 0,
        "x with NaN": nan,
        "x with inf": inf,
        "x empty (0, 3)": X[:0],
        "x a list": X.tolist(),
        "x a numpy array": X.numpy(),
        "x a 0-d tensor": torch.tensor(1.0),
    }


def bad_y_reg() -> dict[str, object]:
    nan = Y.clone()
    nan[0] = math.nan
    return {
        "y wrong length": Y[:-1],
        "y with NaN": nan,
        "y integer (regression)": Y.long(),
        "y (N, 2) for 1 output": torch.randn(N, 2),
        "y a list": Y.tolist(),
        "y a 0-d tensor": torch.tensor(0.5),
    }


def bad_y_cls() -> dict[str, object]:
    return {
        "y wrong length": YC[:-1],
        "y float labels": YC.float() + 0.5,
        "y label out of range": torch.full((N,), 7),
        "y negative label": -torch.ones(N, dtype=torch.long),
        "y a list": YC.tolist(),
        "y (N, 3)": torch.zeros(N, 3, dtype=torch.long),
    }


def classify(fn, arg: str) -> tuple[str, str]:
    """Run one probe; return (class, message)."""
    CALLS[0] = 0
    pyro.clear_param_store()
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            fn()
    except SystemExit as e:  # the CLI: argparse's usage error
        return ("named" if e.code == 2 and CALLS[0] == 0 else "raw"), f"exit {e.code}"
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        origin = frames[-1].filename if frames else ""
        ours = f"{os.sep}pyro_subspace{os.sep}" in origin and "site-packages" not in origin
        msg = str(e).split("\n")[0]
        head = msg.split(":")[0] if ":" in msg else ""
        named = arg in head or (arg in msg and isinstance(e, RuntimeError))
        kind = isinstance(e, (ValueError, TypeError, RuntimeError))
        if ours and named and kind:
            return ("named" if CALLS[0] == 0 else "after work"), f"{type(e).__name__}: {msg}"
        return "raw", f"{type(e).__name__} in {os.path.basename(origin)}: {msg}"
    return "silent", "no error"


# ----------------------------------------------------------------------------- fixtures

PROBES: list[tuple[str, str, str, object]] = []  # (entry point, probe, argument, fn)


def probe(entry: str, what: str, arg: str, fn) -> None:
    PROBES.append((entry, what, arg, fn))


def data_probes(entry: str, call, task: str = "reg", x_only: bool = False) -> None:
    """``call(x, y)`` with each bad x (good y) and each bad y (good x)."""
    y_good = Y if task == "reg" else YC
    for what, x in bad_x().items():
        probe(entry, what, "x", lambda x=x: call(x, y_good))
    if x_only:
        return
    for what, y in (bad_y_reg() if task == "reg" else bad_y_cls()).items():
        probe(entry, what, "y", lambda y=y: call(X, y))


def build() -> None:
    gauss, cat = likelihoods.Gaussian(0.1), likelihoods.Categorical()

    def model_reg():
        net = reg_net()
        return ps.SubspaceNet(net, subspaces.random(net, 2, seed=0), gauss)

    # SubspaceNet as a Pyro model (what SVI and Predictive call)
    m = model_reg()
    data_probes("SubspaceNet(x, y)", lambda x, y: m(x, y))
    probe("SubspaceNet(x, y)", "subsample_size 0", "subsample_size", lambda: m(X, Y, 0))
    probe("SubspaceNet(x, y)", "subsample_size > N", "subsample_size", lambda: m(X, Y, N + 1))
    net = reg_net()
    sub = subspaces.random(net, 2, seed=0)
    for what, kw, arg in [
        ("prior_scale -1", {"prior_scale": -1.0}, "prior_scale"),
        ("prior_scale nan", {"prior_scale": math.nan}, "prior_scale"),
        ("temperature 0", {"temperature": 0}, "temperature"),
        ("temperature 'hot'", {"temperature": "hot"}, "temperature"),
        ("prior_mean 'one'", {"prior_mean": "one"}, "prior_mean"),
        ("subsample_size 0", {"subsample_size": 0}, "subsample_size"),
        ("likelihood a string", {"likelihood": "gaussian"}, "likelihood"),
        (
            "subspace of another net",
            {"subspace": subspaces.random(reg_net(width=5), 2)},
            "subspace",
        ),
    ]:
        kwargs = {"subspace": sub, "likelihood": gauss, **kw}
        probe("SubspaceNet(...)", what, arg, lambda kwargs=kwargs: ps.SubspaceNet(net, **kwargs))

    # fit_map
    def fm(x, y, **kw):
        ps.fit_map(reg_net(), gauss, x, y, **{"epochs": 2, "progress": False, **kw})

    data_probes("fit_map", fm)
    for what, kw, arg in [
        ("epochs -1", {"epochs": -1}, "epochs"),
        ("epochs 2.5", {"epochs": 2.5}, "epochs"),
        ("lr 0", {"lr": 0.0}, "lr"),
        ("lr nan", {"lr": math.nan}, "lr"),
        ("weight_decay nan", {"weight_decay": math.nan}, "weight_decay"),
        ("weight_decay -1", {"weight_decay": -1.0}, "weight_decay"),
        ("batch_size 0", {"batch_size": 0}, "batch_size"),
        ("optimizer 'rmsprop'", {"optimizer": "rmsprop"}, "optimizer"),
        ("swa_lr -1", {"swa_lr": -1.0}, "swa_lr"),
        ("swa_epochs 2 without collector", {"swa_epochs": 2}, "collector"),
    ]:
        probe("fit_map", what, arg, lambda kw=kw: fm(X, Y, **kw))
    probe(
        "fit_map",
        "likelihood None",
        "likelihood",
        lambda: ps.fit_map(reg_net(), None, X, Y, epochs=1, progress=False),
    )
    probe("fit_map", "y None", "y", lambda: ps.fit_map(reg_net(), gauss, X, None, progress=False))

    # fit_curve
    n0 = reg_net(0)
    w0, w1 = ps.FlatNet(n0).vector(), ps.FlatNet(reg_net(1)).vector()
    data_probes(
        "fit_curve",
        lambda x, y: subspaces.fit_curve(n0, gauss, x, y, w0, w1, epochs=1, progress=False),
    )
    probe(
        "fit_curve",
        "w1 wrong length",
        "w1",
        lambda: subspaces.fit_curve(n0, gauss, X, Y, w0, w1[:-1], epochs=1, progress=False),
    )
    probe(
        "fit_curve",
        "epochs 0",
        "epochs",
        lambda: subspaces.fit_curve(n0, gauss, X, Y, w0, w1, epochs=0, progress=False),
    )

    # NUTS / HMC through the model
    def nuts(x, y):
        MCMC(NUTS(model_reg()), num_samples=2, warmup_steps=1, disable_progbar=True).run(x, y)

    data_probes("MCMC(NUTS(SubspaceNet))", nuts)
    probe(
        "MCMC(HMC(SubspaceNet))",
        "x float64",
        "x",
        lambda: MCMC(HMC(model_reg()), num_samples=2, warmup_steps=1, disable_progbar=True).run(
            X.double(), Y
        ),
    )

    # ESS
    def ess(x, y, **kw):
        kernel = infer.EllipticalSliceSampler(model_reg(), **kw)
        MCMC(kernel, num_samples=2, warmup_steps=0, disable_progbar=True).run(x, y)

    data_probes("MCMC(EllipticalSliceSampler)", ess)
    probe(
        "MCMC(EllipticalSliceSampler)",
        "chunk_size 0",
        "chunk_size",
        lambda: ess(X, Y, chunk_size=0),
    )
    probe(
        "MCMC(EllipticalSliceSampler)",
        "max_shrinks -1",
        "max_shrinks",
        lambda: ess(X, Y, max_shrinks=-1),
    )

    def minus_inf_model():
        pyro.sample("t", pyro.distributions.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.factor("lik", torch.tensor(-math.inf))

    probe(
        "MCMC(EllipticalSliceSampler)",
        "-inf likelihood at the start",
        "model",
        lambda: MCMC(
            infer.EllipticalSliceSampler(minus_inf_model), num_samples=2, disable_progbar=True
        ).run(),
    )
    probe(
        "MCMC(EllipticalSliceSampler)",
        "model a string",
        "model",
        lambda: infer.EllipticalSliceSampler("model"),
    )

    # Laplace: the guide and the front door
    def lap_fit(x, y, **kw):
        infer.AutoSubspaceLaplace(model_reg()).fit(x, y, **kw)

    data_probes("AutoSubspaceLaplace.fit", lap_fit)
    probe("AutoSubspaceLaplace.fit", "max_iter 0", "max_iter", lambda: lap_fit(X, Y, max_iter=0))
    probe("AutoSubspaceLaplace.fit", "tol nan", "tol", lambda: lap_fit(X, Y, tol=math.nan))
    probe(
        "AutoSubspaceLaplace.fit",
        "newton_steps -1",
        "newton_steps",
        lambda: lap_fit(X, Y, newton_steps=-1),
    )
    probe(
        "AutoSubspaceLaplace.fit",
        "newton_steps 2.5",
        "newton_steps",
        lambda: lap_fit(X, Y, newton_steps=2.5),
    )
    probe(
        "AutoSubspaceLaplace(...)",
        "hessian_structure 'kron'",
        "hessian_structure",
        lambda: infer.AutoSubspaceLaplace(model_reg(), hessian_structure="kron"),
    )
    probe(
        "AutoSubspaceLaplace(...)",
        "prior_precision -1",
        "prior_precision",
        lambda: infer.AutoSubspaceLaplace(model_reg(), prior_precision=-1.0),
    )
    probe(
        "AutoSubspaceLaplace(...)",
        "model a net",
        "model",
        lambda: infer.AutoSubspaceLaplace(reg_net()),
    )

    data_probes("infer.Laplace(...).fit", lambda x, y: infer.Laplace(reg_net(), gauss, hessian_structure="full").fit(x, y))
    for what, kw, arg in [
        ("prior_precision 0", {"prior_precision": 0.0}, "prior_precision"),
        ("temperature -1", {"temperature": -1.0}, "temperature"),
        ("subset_of_weights 'some'", {"subset_of_weights": "some"}, "subset_of_weights"),
        ("hessian_structure 'kron'", {"hessian_structure": "kron"}, "hessian_structure"),
        ("chunk_size 0", {"chunk_size": 0}, "chunk_size"),
        ("subnetwork without n_params", {"subset_of_weights": "subnetwork"}, "n_params"),
    ]:
        probe("infer.Laplace(...)", what, arg, lambda kw=kw: infer.Laplace(reg_net(), gauss, **kw))
    data_probes(
        "DiagonalLaplace.fit", lambda x, y: infer.DiagonalLaplace(reg_net(), gauss).fit(x, y)
    )

    # predictives of a fitted guide
    fitted = infer.AutoSubspaceLaplace(model_reg()).fit(X, Y)
    data_probes(
        "linearized_predictive", lambda x, y: infer.linearized_predictive(fitted, x), x_only=True
    )
    data_probes("guide.predict", lambda x, y: fitted.predict(x), x_only=True)
    probe(
        "linearized_predictive",
        "unfitted guide",
        "fit",
        lambda: infer.linearized_predictive(infer.AutoSubspaceLaplace(model_reg()), X),
    )
    probe(
        "linearized_predictive",
        "guide an AutoNormal",
        "guide",
        lambda: infer.linearized_predictive(pyro.infer.autoguide.AutoNormal(model_reg()), X),
    )
    probe(
        "linearized_predictive",
        "link_approx 'logit'",
        "link_approx",
        lambda: infer.linearized_predictive(fitted, X, link_approx="logit"),
    )
    probe(
        "linearized_predictive",
        "num_samples 0",
        "num_samples",
        lambda: infer.linearized_predictive(fitted, X, num_samples=0),
    )
    probe(
        "linearized_predictive",
        "chunk_size 0",
        "chunk_size",
        lambda: infer.linearized_predictive(fitted, X, chunk_size=0),
    )
    probe("guide.sample_weights", "num_samples 0", "num_samples", lambda: fitted.sample_weights(0))
    probe(
        "Predictive(model, guide)",
        "x float64",
        "x",
        lambda: Predictive(fitted.model, guide=fitted, num_samples=2)(X.double()),
    )

    # MoLA
    nets_c = [cls_net(0), cls_net(1)]

    def mola(**kw):
        return infer.MixtureOfLaplace(nets_c, cat, **kw)

    data_probes("MixtureOfLaplace.fit", lambda x, y: mola().fit(x, y), task="cls")
    for what, kw, arg in [
        ("temperature 0", {"temperature": 0}, "temperature"),
        ("prior_precision nan", {"prior_precision": math.nan}, "prior_precision"),
        ("weights [1, -1]", {"weights": [1.0, -1.0]}, "weights"),
        ("subset 'all'", {"subset": "all"}, "subset"),
        ("chunk_size 0", {"chunk_size": 0}, "chunk_size"),
    ]:
        probe("MixtureOfLaplace(...)", what, arg, lambda kw=kw: mola(**kw))
    probe("MixtureOfLaplace(...)", "nets empty", "nets", lambda: infer.MixtureOfLaplace([], cat))
    fitted_mola = mola().fit(X, YC)
    data_probes("MixtureOfLaplace.predict", lambda x, y: fitted_mola.predict(x), x_only=True)
    probe("MixtureOfLaplace.predict", "unfitted", "fit", lambda: mola().predict(X))
    probe(
        "MixtureOfLaplace.predict",
        "method 'exact'",
        "method",
        lambda: fitted_mola.predict(X, method="exact"),
    )

    # ensembles and SWAG
    de = infer.DeepEnsemble([reg_net(0), reg_net(1)], gauss)
    data_probes("DeepEnsemble.predict", lambda x, y: de.predict(x), x_only=True)
    data_probes(
        "train_ensemble",
        lambda x, y: infer.train_ensemble(
            reg_net, gauss, x, y, n_members=2, epochs=1, progress=False
        ),
    )
    probe(
        "train_ensemble",
        "n_members 0",
        "n_members",
        lambda: infer.train_ensemble(reg_net, gauss, X, Y, n_members=0, progress=False),
    )
    probe(
        "train_ensemble",
        "seeds [1, 1]",
        "seeds",
        lambda: infer.train_ensemble(reg_net, gauss, X, Y, seeds=[1, 1], progress=False),
    )
    snet = reg_net()
    col = subspaces.SWACollector(snet)
    ps.fit_map(snet, gauss, X, Y, epochs=1, swa_epochs=3, collector=col, progress=False)
    swag = infer.SWAG(col, gauss, num_samples=3)
    data_probes("SWAG.predict", lambda x, y: swag.predict(x), x_only=True)
    probe("SWAG(...)", "scale 0", "scale", lambda: infer.SWAG(col, gauss, scale=0))

    # PatchedNet
    def patched(**kw):
        return ps.PatchedNet(cls_net(), cat, **{"n_components": 2, **kw})

    data_probes(
        "PatchedNet.fit", lambda x, y: patched().fit(x, y, epochs=1, batch_size=4), task="cls"
    )
    pn = patched()
    data_probes("PatchedNet.predictive_mean", lambda x, y: pn.predictive_mean(x, 2), x_only=True)
    for what, kw, arg in [
        ("n_components 1", {"n_components": 1}, "n_components"),
        ("mode 'magic'", {"mode": "magic"}, "mode"),
        ("sigma -1", {"sigma": -1.0}, "sigma"),
        ("drop_prob 1.5", {"mode": "dropout", "drop_prob": 1.5}, "drop_prob"),
        ("temperature 0", {"temperature": 0.0}, "temperature"),
        ("patches ['nope']", {"patches": ["nope"]}, "patches"),
    ]:
        probe("PatchedNet(...)", what, arg, lambda kw=kw: patched(**kw))
    probe("PatchedNet.fit", "epochs 0", "epochs", lambda: patched().fit(X, YC, epochs=0))
    probe("PatchedNet.fit", "method 'sgd'", "method", lambda: patched().fit(X, YC, method="sgd"))

    # subnetwork selection, ggn_eigen, random subspaces
    def sel(x, y=None, **kw):
        return subspaces.subnetwork(reg_net(), 5, "diag_laplace", likelihood=gauss, x=x, **kw)

    data_probes("subnetwork('diag_laplace')", sel, x_only=True)
    net_s = reg_net()
    for what, kw, arg in [
        ("indices []", {"strategy": "indices", "indices": []}, "indices"),
        ("indices duplicated", {"strategy": "indices", "indices": [1, 1, 2]}, "indices"),
        ("indices out of range", {"strategy": "indices", "indices": [0, 10_000]}, "indices"),
        ("indices floats", {"strategy": "indices", "indices": [0.5, 1.5]}, "indices"),
        ("n_params 0", {"strategy": "magnitude", "n_params": 0}, "n_params"),
        ("strategy 'best'", {"strategy": "best", "n_params": 3}, "strategy"),
        (
            "prior_precision -1",
            {"n_params": 3, "likelihood": gauss, "x": X, "prior_precision": -1.0},
            "prior_precision",
        ),
        ("diag_laplace without x", {"n_params": 3, "likelihood": gauss}, "likelihood"),
    ]:
        probe("subnetwork(...)", what, arg, lambda kw=kw: subspaces.subnetwork(net_s, **kw))
    data_probes("ggn_eigen", lambda x, y: subspaces.ggn_eigen(reg_net(), gauss, x, 2), x_only=True)
    probe("ggn_eigen", "rank 0", "rank", lambda: subspaces.ggn_eigen(reg_net(), gauss, X, 0))
    probe("subspaces.random", "rank 0", "rank", lambda: subspaces.random(reg_net(), 0))

    # likelihood constructors
    for what, kw, arg in [
        ("min_scale nan", {"min_scale": math.nan}, "min_scale"),
        ("sigma_init inf", {"sigma_init": math.inf}, "sigma_init"),
        ("sigma -1", {"sigma": -1.0}, "sigma"),
        ("sigma nan", {"sigma": math.nan}, "sigma"),
        ("sigma with heteroscedastic", {"sigma": 0.1, "heteroscedastic": True}, "sigma"),
    ]:
        probe("likelihoods.Gaussian(...)", what, arg, lambda kw=kw: likelihoods.Gaussian(**kw))

    # ---- the classes of the "nothing silent" issue: labels, members, seeds, paths, keywords
    # a chosen method does not use, degenerate work, a last layer that is not the output,
    # ArviZ helpers, streams
    bad_labels = {
        "labels 0.5": YC.double() + 0.5,
        "label out of range": torch.full((N,), 7),
        "negative label": -torch.ones(N, dtype=torch.long),
        "labels one short": YC[:-1],
    }
    for what, yv in bad_labels.items():
        probe(
            "MixtureOfLaplace.optimize_prior_precision", what, "y_val",
            lambda yv=yv: fitted_mola.optimize_prior_precision("grid", x_val=X, y_val=yv),
        )  # fmt: skip
        probe("MixtureOfLaplace.log_prob", what, "y", lambda yv=yv: fitted_mola.log_prob(X, yv))
        de_c = infer.DeepEnsemble([cls_net(0), cls_net(1)], cat)
        probe("DeepEnsemble.log_prob", what, "y", lambda yv=yv, de_c=de_c: de_c.log_prob(X, yv))
        if what != "label out of range":  # from_arrays reads the classes from the labels
            probe(
                "datasets.from_arrays", what, "y",
                lambda yv=yv: datasets.from_arrays(X, yv, task="classification"),
            )  # fmt: skip
        probs = torch.rand(N, 3).softmax(-1)
        probe("metrics.accuracy", what, "y", lambda yv=yv, p=probs: ps.metrics.accuracy(p, yv))
    nan_x, nan_y = X.clone(), Y.clone()
    nan_x[4, 1], nan_y[2] = math.nan, math.inf
    probe("datasets.from_arrays", "x with NaN", "x", lambda: datasets.from_arrays(nan_x, Y))
    probe("datasets.from_arrays", "y with inf", "y", lambda: datasets.from_arrays(X, nan_y))
    wide = hook(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)))
    probe(
        "DeepEnsemble(...)", "members of 3 and 4 outputs", "nets",
        lambda: infer.DeepEnsemble([cls_net(0), wide], cat),
    )  # fmt: skip
    one = cls_net(0)
    probe(
        "train_ensemble", "make_net returns one network", "make_net",
        lambda: infer.train_ensemble(lambda: one, cat, X, YC, n_members=2, epochs=1, progress=False),
    )  # fmt: skip
    probe(
        "run_chains", "seed overflows for chain 1", "seed",
        lambda: infer.run_chains(lambda i: i, 2, seed=2**32 - 1, processes=0),
    )  # fmt: skip
    out_file = os.path.join(tempfile.mkdtemp(), "a_file")
    open(out_file, "w").close()
    probe("CLI fit", "--out an existing file", "--out", lambda: ps.cli.execute(["fit", "--out", out_file]))
    for what, kw, arg in [
        ("n_params without a subnetwork", {"n_params": 5}, "n_params"),
        ("strategy without a subnetwork", {"strategy": "random"}, "strategy"),
    ]:
        probe("infer.Laplace(...)", what, arg, lambda kw=kw: infer.Laplace(cls_net(), cat, **kw))
    la_c = infer.Laplace(cls_net(), cat, hessian_structure="full").fit(X, YC)
    for what, method, kw, arg in [
        ("grid with optimize_sigma", "grid", {"x_val": X, "y_val": YC, "optimize_sigma": True}, "optimize_sigma"),
        ("marglik with max_iter 0", "marglik", {"max_iter": 0}, "max_iter"),
        ("marglik with val_loader", "marglik", {"val_loader": [(X, YC)]}, "val_loader"),
        ("gridsearch with a custom loss", "gridsearch", {"val_loader": [(X, YC)], "loss": abs}, "loss"),
        ("optimize_sigma for a classifier", "marglik", {"optimize_sigma": True}, "optimize_sigma"),
    ]:
        probe(
            "infer.Laplace(...).optimize_prior_precision", what, arg,
            lambda method=method, kw=kw: la_c.optimize_prior_precision(method, **kw),
        )  # fmt: skip
    probe("infer.Laplace(...)(x)", "joint=True", "joint", lambda: la_c(X, joint=True))
    probe("infer.Laplace(...).fit", "override=False", "override", lambda: la_c.fit(X, YC, override=False))
    probe(
        "MixtureOfLaplace.optimize_prior_precision", "marglik with x_val", "x_val",
        lambda: fitted_mola.optimize_prior_precision("marglik", x_val=X, y_val=YC),
    )  # fmt: skip

    def bn_net():
        torch.manual_seed(0)
        return hook(nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)))

    probe(
        "fit_map", "batch_size 1 with BatchNorm (every batch skipped)", "batch_size",
        lambda: ps.fit_map(bn_net(), gauss, X, Y, epochs=2, batch_size=1, progress=False),
    )  # fmt: skip
    still = reg_net()
    still_col = subspaces.SWACollector(still)
    for _ in range(5):
        still_col.collect()
    probe("subspaces.pca", "a trajectory that never moved", "collector", lambda: subspaces.pca(still_col, 2))
    probe("subspaces.pca", "rank='mle', never moved", "collector", lambda: subspaces.pca(still_col, "mle"))
    squashed = hook(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1), nn.Tanh()))
    probe(
        "infer.Laplace(...)", "last layer followed by Tanh", "net",
        lambda: infer.Laplace(squashed, gauss, "last_layer", hessian_structure="full"),
    )  # fmt: skip
    from pyro_subspace.convert import tempered_loo

    mcmc_ran = MCMC(NUTS(model_reg()), num_samples=4, warmup_steps=2, disable_progbar=True)
    mcmc_ran.run(X, Y)
    idata = to_inference_data(mcmc_ran)
    probe("tempered_loo", "the MCMC object, not its export", "data", lambda: tempered_loo(mcmc_ran))
    probe("tempered_loo", "reff 0", "reff", lambda: tempered_loo(idata, reff=0.0))
    probe(
        "to_inference_data", "samples of another K", "samples",
        lambda: to_inference_data(samples={"t": torch.zeros(3, 5)}, model=model_reg(), args=(X, Y)),
    )  # fmt: skip

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(X[0], Y[0])])

    probe("distributed.shard", "a stream without a length", "data", lambda: ps.distributed.shard(Stream()))

    # convert, datasets, CLI
    probe(
        "to_inference_data",
        "MCMC that never ran",
        "mcmc",
        lambda: to_inference_data(MCMC(NUTS(model_reg()), num_samples=2)),
    )
    probe(
        "to_inference_data",
        "draws_per_chunk 0",
        "draws_per_chunk",
        lambda: to_inference_data(
            samples={"t": torch.zeros(3, 2)}, model=model_reg(), args=(X, Y), draws_per_chunk=0
        ),
    )
    tmp = tempfile.mkdtemp()
    csvs = {
        "duplicated column": "a,a,y\n1,2,3\n4,5,6\n",
        "non-numeric cell": "a,b,y\n1,x,3\n4,5,6\n",
        "ragged row": "a,b,y\n1,2\n4,5,6\n",
        "header only": "a,b,y\n",
    }
    for what, text in csvs.items():
        path = os.path.join(tmp, what.replace(" ", "_") + ".csv")
        with open(path, "w") as fh:
            fh.write(text)
        probe("datasets.from_csv", what, "path", lambda path=path: datasets.from_csv(path, "y"))
        probe(
            "CLI --csv",
            what,
            "--csv",
            lambda path=path: ps.cli.execute(
                ["fit", "--dataset", "csv", "--csv", path, "--target", "y", "--no-progress"]
            ),
        )
    path = os.path.join(tmp, "ok.csv")
    with open(path, "w") as fh:
        fh.write("a,b,y\n1,2,3\n4,5,6\n7,8,9\n")
    probe("datasets.from_csv", "target missing", "target", lambda: datasets.from_csv(path, "z"))
    probe(
        "datasets.from_csv",
        "features duplicated",
        "features",
        lambda: datasets.from_csv(path, "y", features=["a", "a"]),
    )
    probe(
        "datasets.from_csv",
        "test_fraction 1.5",
        "test_fraction",
        lambda: datasets.from_csv(path, "y", test_fraction=1.5),
    )
    for flags in (
        ["--prior-scale", "-1"],
        ["--temperature", "-1"],
        ["--rank", "0"],
        ["--swa-lr", "-1"],
        ["--samples", "0"],
        ["--warmup", "-5"],
        ["--weight-decay", "nan"],
        ["--epochs", "-1"],
        ["--seed", "-1"],
        ["--lr", "inf"],
        ["--hidden", "0"],
        ["--max-snapshots", "0"],
    ):
        probe(
            "CLI fit",
            " ".join(flags),
            flags[0],
            lambda flags=flags: ps.cli.execute(["fit", *flags]),
        )
    for flags in (["--drop-prob", "2"], ["--components", "1"], ["--batch-size", "0"]):
        probe(
            "CLI patch",
            " ".join(flags),
            flags[0],
            lambda flags=flags: ps.cli.execute(["patch", *flags]),
        )


def main() -> int:
    import pyro_subspace.cli  # noqa: F401  (ps.cli)

    build()
    rows: dict[str, Counter] = defaultdict(Counter)
    bad: list[str] = []
    for entry, what, arg, fn in PROBES:
        kind, msg = classify(fn, arg)
        rows[entry][kind] += 1
        if kind != "named" or "-v" in sys.argv:
            bad.append(f"  [{kind}] {entry} / {what}: {msg[:160]}")
    cols = ("named", "after work", "silent", "raw")
    width = max(len(e) for e in rows)
    print(f"{'entry point':<{width}}  probes  " + "  ".join(f"{c:>10}" for c in cols))
    total = Counter()
    for entry, c in rows.items():
        total.update(c)
        print(f"{entry:<{width}}  {sum(c.values()):>6}  " + "  ".join(f"{c[k]:>10}" for k in cols))
    print(
        f"{'TOTAL':<{width}}  {sum(total.values()):>6}  "
        + "  ".join(f"{total[k]:>10}" for k in cols)
    )
    print(
        "\nnamed = ValueError/TypeError (RuntimeError for an unfitted object) from pyro_subspace "
        "naming the argument, with 0 forward passes before it"
    )
    if bad:
        print("\nnot named before work:")
        print("\n".join(bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
