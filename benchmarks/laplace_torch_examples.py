"""laplace-torch 0.3's own example scripts and documentation snippets, ported with only the
``from laplace import ...`` line changed, run on laplace-torch and on `pyro_subspace.infer`.

Each port below is the script's code written once, as a function of ``lib``: a namespace with
what the script's ``from laplace import ...`` line imports (``Laplace``, and for the regression
example ``marglik_training``). `LIBS` gives that namespace for laplace-torch itself and for
this library (``from pyro_subspace.infer import Laplace, marglik_training``); the scripts'
*other* laplace-torch imports (``laplace.curvature`` backends, ``laplace.utils.enums``,
``laplace.utils`` subnetwork masks) stay as they are, laplace-torch being installed as a user
porting has it. What changed besides that line, in every port:

- data: seeded synthetic tensors of the script's shapes (fewer rows; CIFAR-10 / FMNIST images
  as ``randn``), no downloads; the regression example's sinusoid is its own synthetic data;
- third-party extras by tiny stand-ins: ``netcal``'s ``ECE`` by `ece` (15 bins, its
  definition), ``datasets.Dataset`` by the tensors it would hold, ``botorch`` by `_Model`,
  `_Posterior`, `branin` and an analytic expected improvement, Hugging Face's pretrained GPT-2
  and tokenizer by a randomly initialised two-layer ``GPT2ForSequenceClassification`` and a
  character tokenizer;
- pretrained networks (WideResNet 16-4, the deepobs CNN) by small CNNs of the same
  input/output shapes, trained here for a few steps; CPU instead of ``.cuda()``;
- epochs and loop lengths are arguments (the scripts' values are the defaults where they run in
  seconds); files (``state_dict.bin``) go to memory; plots are skipped.

Each port returns the numbers the script prints (and a few more it computes: predictive
moments), so a test can compare the two libraries' numbers (`compare`). Run
``python benchmarks/laplace_torch_examples.py`` for the table of `benchmarks/results/
laplace_torch_examples.txt` (needs laplace-torch).
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import time
import warnings
from types import SimpleNamespace

import numpy as np
import torch
import torch.utils.data as data_utils
from torch import nn

#: the scripts' dtype (float32) and the comparison's (float64)
F32, F64 = torch.float32, torch.float64
#: relative agreement asked of the ported scripts' numbers (issue 36)
TOL = {F64: 1e-6, F32: 1e-4}


def lib_laplace_torch() -> SimpleNamespace:
    """``from laplace import Laplace, marglik_training``."""
    from laplace import Laplace, marglik_training

    return SimpleNamespace(Laplace=Laplace, marglik_training=marglik_training, name="laplace-torch")


def lib_ours() -> SimpleNamespace:
    """``from pyro_subspace.infer import Laplace, marglik_training``: the one changed line."""
    from pyro_subspace.infer import Laplace, marglik_training

    return SimpleNamespace(Laplace=Laplace, marglik_training=marglik_training, name="pyro_subspace")


LIBS = {"laplace-torch": lib_laplace_torch, "pyro_subspace": lib_ours}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """The script run with ``dtype`` as torch's default (so its models, data and
    hyperparameters are created in it), restored afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_default_dtype(old)


def ece(probs: np.ndarray, targets: np.ndarray, bins: int = 15) -> float:
    """Stand-in for ``netcal.metrics.ECE(bins).measure``: equal-width confidence bins on
    ``[0, 1]``, ``Σ_b (n_b / N) |acc_b − conf_b|``."""
    conf = probs.max(-1)
    correct = (probs.argmax(-1) == targets).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    idx = np.clip(np.digitize(conf, edges[1:-1], right=True), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += m.mean() * abs(correct[m].mean() - conf[m].mean())
    return float(total)


def reseed(seed: int) -> None:
    """Added to a port where a script draws from torch's global generator after ``la.fit``:
    laplace-torch's ``fit`` advances that generator (every ``iter(loader)`` draws the loader's
    base seed from it), this library's calls leave it as they found it, so without it the two
    runs would predict at different inputs."""
    torch.manual_seed(seed)


def _moments_and_grad(la, x):
    """``la(x)``'s ``(f_mu, f_var)`` and the gradient of their sum in ``x``."""
    f_mu, f_var = la(x)
    (grad,) = torch.autograd.grad(f_mu.sum() + f_var.sum(), x)
    return torch.cat([f_mu.detach().flatten(), f_var.detach().flatten()]), grad


# --------------------------------------------------------------------------- regression


def get_sinusoid_example(n_data=150, sigma_noise=0.3, batch_size=150):
    """``examples/helper/dataloaders.py``'s, as it is (synthetic already)."""
    X_train = (torch.rand(n_data) * 8).unsqueeze(-1)
    y_train = torch.sin(X_train) + torch.randn_like(X_train) * sigma_noise
    train_loader = data_utils.DataLoader(
        data_utils.TensorDataset(X_train, y_train), batch_size=batch_size
    )
    X_test = torch.linspace(-5, 13, 500).unsqueeze(-1)
    return X_train, y_train, train_loader, X_test


def regression_example(lib, n_epochs=1000, n_epochs_marglik=None, n_data=150, n_test=500):
    """``examples/regression_example.py``: MAP by Adam, full Laplace over all weights, the
    hand-written hyperparameter loop on ``log λ, log σ`` (``n_epochs`` Adam steps), a
    ``state_dict`` round trip, marginal and joint predictives, then ``marglik_training``
    (``backend=BackPackGGN``, ``hessian_structure="full"``, ``prior_structure="scalar"``)."""
    from laplace.curvature.backpack import BackPackGGN

    Laplace, marglik_training = lib.Laplace, lib.marglik_training
    n_epochs_marglik = n_epochs if n_epochs_marglik is None else n_epochs_marglik
    out = {}
    torch.manual_seed(711)
    X_train, y_train, train_loader, X_test = get_sinusoid_example(n_data, sigma_noise=0.3)
    X_test = X_test[:: max(1, 500 // n_test)]

    def get_model():
        torch.manual_seed(711)
        return torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))

    model = get_model()
    criterion = torch.nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(n_epochs):
        for X, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(X), y)
            loss.backward()
            optimizer.step()

    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="full")
    la.fit(train_loader)
    log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for i in range(n_epochs):
        hyper_optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        hyper_optimizer.step()
    out["neg_marglik (last step)"] = neg_marglik.detach()

    buffer = io.BytesIO()  # the script's "state_dict.bin"
    torch.save(la.state_dict(), buffer)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="full")
    buffer.seek(0)
    la.load_state_dict(torch.load(buffer))
    out["sigma"] = la.sigma_noise.detach()
    out["prior precision"] = la.prior_precision.detach()

    f_mu, f_var = la(X_test)
    f_mu_joint, f_cov = la(X_test, joint=True)
    assert torch.allclose(f_mu.flatten(), f_mu_joint)
    assert torch.allclose(f_var.flatten(), f_cov.diag())
    out["f_mu"], out["f_var"], out["f_cov (joint)"] = f_mu.detach(), f_var.detach(), f_cov.detach()
    f_sigma = f_var.squeeze().detach().sqrt().cpu().numpy()
    out["pred_std"] = torch.as_tensor(np.sqrt(f_sigma**2 + la.sigma_noise.item() ** 2))

    model = get_model()
    la, model, margliks, losses = marglik_training(
        model=model,
        train_loader=train_loader,
        likelihood="regression",
        hessian_structure="full",
        backend=BackPackGGN,
        n_epochs=n_epochs_marglik,
        optimizer_kwargs={"lr": 1e-2},
        prior_structure="scalar",
    )
    out["marglik_training: sigma"] = la.sigma_noise.detach()
    out["marglik_training: prior precision"] = la.prior_precision.detach()
    out["marglik_training: last marglik"] = torch.as_tensor(margliks[-1])
    out["marglik_training: last loss"] = torch.as_tensor(losses[-1])
    f_mu, f_var = la(X_test)
    out["marglik_training: f_mu"], out["marglik_training: f_var"] = f_mu.detach(), f_var.detach()
    return out



# --------------------------------------------------------------------------- reward modeling


class SimpleRewardModel(nn.Module):
    """``examples/reward_modeling_example.py``'s: a 3-100-1 scorer applied to ``(B, 2, 3)``
    pairs as ``(2B, 3)`` rows and reshaped back to ``(B, 2)``; ``(B, 3)`` in, ``(B, 1)`` out
    otherwise."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 100), nn.ReLU(), nn.Linear(100, 1))

    def forward(self, x):
        if len(x.shape) == 3:
            batch_size, _, dim = x.shape
            flat_x = x.reshape(-1, dim)
            flat_logits = self.net(flat_x)
            return flat_logits.reshape(batch_size, 2)
        else:
            logits = self.net(x)
            return logits


def reward_modeling_example(lib, n_epochs=10):
    """``examples/reward_modeling_example.py``: ``Laplace(reward_model,
    likelihood="reward_modeling", subset_of_weights="all")`` (K-FAC), fitted on the pairs,
    ``optimize_prior_precision()``, and the scores' ``(mean, var)`` on ``(5, 3)`` inputs.
    ``datasets.Dataset.from_list(...).map(np.stack ...)`` is replaced by the tensors it holds:
    ``x`` ``(10, 2, 3)`` (the script's ``torch.randn(3)`` draws, in order) and ``label``."""
    Laplace = lib.Laplace
    from torch import optim
    from torch.nn import functional as F

    torch.manual_seed(0)
    np.random.seed(0)
    data_dict = [
        {"x0": torch.randn(3), "x1": torch.randn(3), "label": torch.randint(2, size=(1,)).item()}
        for _ in range(10)
    ]
    # the Dataset stand-in: the script's rows stacked as append_x0_x1 and set_format do
    # (Dataset stores the values as float32 lists; set_format(type="torch") returns them so)
    x_all = torch.stack([torch.stack([row["x0"], row["x1"]]) for row in data_dict]).float()
    x_all = x_all.to(torch.get_default_dtype())
    labels = torch.tensor([row["label"] for row in data_dict])
    tensor_dataloader = data_utils.DataLoader(
        data_utils.TensorDataset(x_all, labels), batch_size=3
    )

    reward_model = SimpleRewardModel()
    opt = optim.AdamW(reward_model.parameters(), weight_decay=1e-3)
    for epoch in range(n_epochs):
        for x, y in tensor_dataloader:
            opt.zero_grad()
            out = reward_model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()

    reward_model.eval()
    la = Laplace(reward_model, likelihood="reward_modeling", subset_of_weights="all")
    la.fit(tensor_dataloader)
    la.optimize_prior_precision()

    reseed(1)  # added (`reseed`)
    x_test = torch.randn(5, 3)
    pred_mean, pred_var = la(x_test)
    printed = (
        f"Input shape {tuple(x_test.shape)}, predictive mean of shape "
        + f"{tuple(pred_mean.shape)}, predictive covariance of shape "
        + f"{tuple(pred_var.shape)}"
    )
    return {
        "printed": printed,
        "prior precision": la.prior_precision.detach(),
        "pred_mean": pred_mean.detach(),
        "pred_var": pred_var.detach(),
    }


# --------------------------------------------------------------------------- expectation


def expectation_example(lib, n_epochs=10):
    """``examples/expectation_example.py``: K-FAC over all weights with
    ``enable_backprop=True`` (laplace-torch's enum members as arguments),
    ``optimize_prior_precision(PredType.GLM)``, then Thompson samples and a Monte Carlo
    expected improvement from ``functional_samples`` (glm and nn), differentiated in the
    inputs. Returned: what it prints, ``λ``, and (added) the glm predictive's moments at the
    Thompson sampling inputs with their input gradient. The draws themselves are not compared:
    laplace-torch's glm draws ``f_mu + chol(f_var) ε`` share one ``ε`` ``(O, S)`` across all
    inputs (`laplace.utils.normal_samples`), ours draw it per input, and the nn draws sample
    weights through each library's own factorisation."""
    Laplace = lib.Laplace
    from laplace.utils.enums import HessianStructure, Likelihood, PredType, SubsetOfWeights
    from torch import autograd, optim

    out = {}
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(2, 10), nn.GELU(), nn.Linear(10, 1))
    X, Y = torch.randn(5, 2), torch.randn(5, 1)
    train_loader = data_utils.DataLoader(data_utils.TensorDataset(X, Y), batch_size=3)
    opt = optim.AdamW(model.parameters(), lr=1e-3, weight_decay=5e-4)
    loss_fn = nn.MSELoss()
    for epoch in range(n_epochs):
        model.train()
        for x, y in train_loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()

    la = Laplace(
        model,
        Likelihood.REGRESSION,
        subset_of_weights=SubsetOfWeights.ALL,
        hessian_structure=HessianStructure.KRON,
        enable_backprop=True,
    )
    la.fit(train_loader)
    la.optimize_prior_precision(PredType.GLM)
    out["prior precision"] = la.prior_precision.detach()
    reseed(1)  # added (`reseed`)

    printed = []
    for pred_type in [PredType.GLM, PredType.NN]:
        printed.append(f"Thompson sampling, {pred_type}")
        x_test = torch.randn(10, 2)
        x_test.requires_grad = True
        f_sample = la.functional_samples(x_test, pred_type=pred_type, n_samples=1)
        f_sample = f_sample.squeeze(0)
        printed.append(f"TS shape: {f_sample.shape}, TS requires grad: {f_sample.requires_grad}")
        grad_x = autograd.grad(f_sample.sum(), x_test)[0]
        printed.append(
            f"Grad x_test shape: {grad_x.shape}, Grad x_test vanishing: "
            f"{torch.allclose(grad_x, torch.tensor(0.0))}"
        )
        if pred_type == PredType.GLM:  # added: the moments the glm samples are drawn from
            out["TS glm f_mu, f_var"], out["TS glm d(f_mu + f_var)/dx"] = _moments_and_grad(la, x_test)

    f_best = torch.tensor(0.123)
    for pred_type in [PredType.GLM, PredType.NN]:
        printed.append(f"MC-EI, {pred_type}")
        x_test = torch.randn(10, 2)
        x_test.requires_grad = True
        f_samples = la.functional_samples(x_test, pred_type=pred_type, n_samples=10)
        ei = (f_samples - f_best.reshape(1, 1, 1)).clamp(0.0).mean(0)
        printed.append(f"EI shape: {ei.shape}, EI requires grad: {ei.requires_grad}")
        grad_x = autograd.grad(ei.sum(), x_test)[0]
        printed.append(
            f"Grad x_test shape: {grad_x.shape}, Grad x_test vanishing: "
            f"{torch.allclose(grad_x, torch.tensor(0.0))}"
        )
    out["printed"] = "\n".join(printed)
    return out



# --------------------------------------------------------------------------- README / docs


def _classification_data(n=120, d=20, classes=3, seed=0):
    """Seeded synthetic classification rows: ``x`` ``(n, d)``, ``y`` ``(n,)`` from a random
    linear teacher (the snippets' ``train_loader``, ``val_loader``, ``x``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(torch.get_default_dtype())
    w = torch.randn(d, classes, generator=g).to(x.dtype)
    y = (x @ w + 0.5 * torch.randn(n, classes, generator=g).to(x.dtype)).argmax(-1)
    return x, y


def _train(model, loader, loss_fn, steps=50, lr=1e-2, seed=0):
    """The snippets' "pre-trained model" (``load_map_model()``): Adam on ``loss_fn``."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-3)
    for _ in range(steps):
        for xb, yb in loader:
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
    return model


def load_map_model(d=20, classes=3):
    """Stand-in for the README's ``load_map_model()``: a 20-30-3 MLP trained on
    `_classification_data`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, 30), nn.Tanh(), nn.Linear(30, classes))
    x, y = _classification_data(d=d, classes=classes)
    loader = data_utils.DataLoader(data_utils.TensorDataset(x, y), batch_size=40)
    return _train(model, loader, nn.CrossEntropyLoss()).eval()


def readme_quickstart(lib):
    """README "Simple usage" (docs "Quickstart"): diagonal Laplace over all weights, ``λ`` by
    ``"gridsearch"`` on a validation loader with the glm probit, then
    ``la(x, pred_type="glm", link_approx="probit")``."""
    Laplace = lib.Laplace
    model = load_map_model()
    x_tr, y_tr = _classification_data(seed=0)
    x_val, y_val = _classification_data(n=60, seed=1)
    train_loader = data_utils.DataLoader(data_utils.TensorDataset(x_tr, y_tr), batch_size=40)
    val_loader = data_utils.DataLoader(data_utils.TensorDataset(x_val, y_val), batch_size=40)
    x, _ = _classification_data(n=16, seed=2)

    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(train_loader)
    la.optimize_prior_precision(
        method="gridsearch", pred_type="glm", link_approx="probit", val_loader=val_loader
    )
    pred = la(x, pred_type="glm", link_approx="probit")
    return {"prior precision": la.prior_precision.detach(), "pred": pred.detach()}


def load_model(d=3):
    """Stand-in for the docs' ``load_model()`` (regression): a 3-20-20-1 MLP trained on
    ``y = sin(x₁) + cos(x₂) x₃ + 0.1 ε``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 1))
    x, y = _regression_data()
    loader = data_utils.DataLoader(data_utils.TensorDataset(x, y), batch_size=32)
    return _train(model, loader, nn.MSELoss())


def _regression_data(n=96, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(torch.get_default_dtype())
    y = torch.sin(x[:, :1]) + torch.cos(x[:, 1:2]) * x[:, 2:] + 0.1 * torch.randn(n, 1, generator=g).to(x.dtype)
    return x, y


def docs_marginal_likelihood(lib, n_steps=100):
    """docs "Marginal likelihood": the library default, last-layer K-FAC
    (``Laplace(model, likelihood="regression")``), ``ml = la.log_marginal_likelihood(prior_prec,
    obs_noise); ml.backward()``, then the regression example's hyperparameter loop (Adam on
    ``log λ, log σ``, ``n_steps`` steps) on it."""
    Laplace = lib.Laplace
    model = load_model()
    x, y = _regression_data()
    train_loader = data_utils.DataLoader(data_utils.TensorDataset(x, y), batch_size=32)
    out = {}

    la = Laplace(model, likelihood="regression")
    la.fit(train_loader)
    prior_prec = torch.tensor(0.7, requires_grad=True)
    obs_noise = torch.tensor(0.3, requires_grad=True)
    ml = la.log_marginal_likelihood(prior_prec, obs_noise)
    ml.backward()
    out["ml"], out["d ml / d prior_prec"], out["d ml / d obs_noise"] = ml.detach(), prior_prec.grad, obs_noise.grad

    log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for i in range(n_steps):
        hyper_optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        hyper_optimizer.step()
    out["loop: sigma"] = la.sigma_noise.detach()
    out["loop: prior precision"] = la.prior_precision.detach()
    out["loop: neg_marglik"] = neg_marglik.detach()
    out["la(x_test)"] = torch.cat([m.detach().flatten() for m in la(x[:8])])
    return out


class _SubnetModel(nn.Module):
    """A network with modules named ``layer.1`` and ``layer.3`` (the subnetwork snippet's
    `ModuleNameSubnetMask` names) and more than 2021 weights (its largest index)."""

    def __init__(self, d=20, classes=3):
        super().__init__()
        self.layer = nn.Sequential(
            nn.Flatten(), nn.Linear(d, 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, classes)
        )

    def forward(self, x):
        return self.layer(x)


def docs_subnetwork(lib):
    """docs "Subnetwork Laplace": subnetwork indices from ``LargestMagnitudeSubnetMask``
    (128), ``ModuleNameSubnetMask`` and by hand, then ``Laplace(model, "classification",
    subset_of_weights="subnetwork", hessian_structure="full",
    subnetwork_indices=subnetwork_indices)`` and ``la.fit(train_loader)``. Returned (the snippet
    prints nothing): ``n_params``, the posterior covariance and (added) the probit predictive,
    also for the 128 largest-magnitude weights."""
    Laplace = lib.Laplace
    torch.manual_seed(0)
    model = _SubnetModel()
    x_tr, y_tr = _classification_data()
    train_loader = data_utils.DataLoader(data_utils.TensorDataset(x_tr, y_tr), batch_size=40)
    model = _train(model, train_loader, nn.CrossEntropyLoss(), steps=30).eval()
    out = {}

    from laplace.utils import LargestMagnitudeSubnetMask

    subnetwork_mask = LargestMagnitudeSubnetMask(model, n_params_subnet=128)
    subnetwork_indices = subnetwork_mask.select()
    largest = subnetwork_indices  # added: fitted below too

    from laplace.utils import ModuleNameSubnetMask

    subnetwork_mask = ModuleNameSubnetMask(model, module_names=["layer.1", "layer.3"])
    subnetwork_mask.select()
    subnetwork_indices = subnetwork_mask.indices
    out["ModuleNameSubnetMask size"] = torch.tensor(float(subnetwork_indices.numel()))

    subnetwork_indices = torch.tensor([0, 4, 11, 42, 123, 2021])

    la = Laplace(model, "classification", subset_of_weights="subnetwork",
                 hessian_structure="full", subnetwork_indices=subnetwork_indices)  # fmt: skip
    la.fit(train_loader)
    out["n_params"] = torch.tensor(float(la.n_params))
    out["posterior covariance"] = la.posterior_covariance.detach()
    out["la(x)"] = la(x_tr[:8]).detach()

    la = Laplace(model, "classification", subset_of_weights="subnetwork",
                 hessian_structure="full", subnetwork_indices=largest)  # fmt: skip
    la.fit(train_loader)
    out["128 largest: posterior covariance"] = la.posterior_covariance.detach()
    out["128 largest: la(x)"] = la(x_tr[:8]).detach()
    return out



# --------------------------------------------------------------------------- calibration


class WideResNetStandIn(nn.Module):
    """Stand-in for the calibration example's pretrained WideResNet 16-4 on CIFAR-10: images
    ``(N, 3, 32, 32)`` → 10 logits through a convolution, batch norm (eval mode) and a final
    ``nn.Linear(128, 10)`` (the last layer the example's Laplace sees)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten()
        )
        self.fc = nn.Linear(8 * 16, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


def _images(n, channels, pixels, classes, seed):
    """Seeded synthetic images ``(n, channels, pixels, pixels)`` whose class shifts the mean
    of one channel's quadrant, and their labels ``(n,)``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (n,), generator=g)
    x = torch.randn(n, channels, pixels, pixels, generator=g)
    half = pixels // 2
    for c in range(classes):  # a class-dependent brightness pattern
        rows = y == c
        x[rows, c % channels, (c // 2 % 2) * half :, (c % 2) * half :] += 1.5
    return x.to(torch.get_default_dtype()), y


def _pretrain(model, x, y, steps, seed):
    """The examples' pretrained checkpoints: here ``steps`` full-batch Adam steps."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def calibration_example(lib, n_train=128, n_test=100, pretrain_steps=30):
    """``examples/calibration_example.py``: MAP accuracy, ECE and NLL on the test set, then
    ``Laplace(model, "classification", subset_of_weights="last_layer",
    hessian_structure="kron")``, ``fit``, ``optimize_prior_precision(method="marglik")`` and the
    same metrics of ``la(x)`` (the probit). CIFAR-10 loaders: synthetic images, the train
    loader one batch of 128 (shuffled, as the script's: one batch keeps K-FAC's per-batch sums
    the same whatever the order), the test loader batches of 100."""
    Laplace = lib.Laplace
    import torch.distributions as dists

    np.random.seed(7777)
    torch.manual_seed(7777)
    x_tr, y_tr = _images(n_train, 3, 32, 10, seed=1)
    x_te, y_te = _images(n_test, 3, 32, 10, seed=2)
    train_loader = data_utils.DataLoader(data_utils.TensorDataset(x_tr, y_tr), batch_size=128, shuffle=True)
    test_loader = data_utils.DataLoader(data_utils.TensorDataset(x_te, y_te), batch_size=100)
    targets = torch.cat([y for x, y in test_loader], dim=0).cpu()

    torch.manual_seed(0)
    model = _pretrain(WideResNetStandIn(num_classes=10), x_tr, y_tr, pretrain_steps, seed=0).eval()

    @torch.no_grad()
    def predict(dataloader, model, laplace=False):
        py = []
        for x, _ in dataloader:
            if laplace:
                py.append(model(x))
            else:
                py.append(torch.softmax(model(x), dim=-1))
        return torch.cat(py).cpu()

    out, printed = {}, []
    probs_map = predict(test_loader, model, laplace=False)
    acc_map = (probs_map.argmax(-1) == targets).float().mean()
    ece_map = ece(probs_map.numpy(), targets.numpy(), bins=15)
    nll_map = -dists.Categorical(probs_map).log_prob(targets).mean()
    printed.append(f"[MAP] Acc.: {acc_map:.1%}; ECE: {ece_map:.1%}; NLL: {nll_map:.3}")

    la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="kron")
    la.fit(train_loader)
    la.optimize_prior_precision(method="marglik")

    probs_laplace = predict(test_loader, la, laplace=True)
    acc_laplace = (probs_laplace.argmax(-1) == targets).float().mean()
    ece_laplace = ece(probs_laplace.numpy(), targets.numpy(), bins=15)
    nll_laplace = -dists.Categorical(probs_laplace).log_prob(targets).mean()
    printed.append(f"[Laplace] Acc.: {acc_laplace:.1%}; ECE: {ece_laplace:.1%}; NLL: {nll_laplace:.3}")
    out.update({
        "printed": "\n".join(printed), "prior precision": la.prior_precision.detach(),
        "Laplace acc": acc_laplace, "Laplace ECE": torch.tensor(ece_laplace),
        "Laplace NLL": nll_laplace, "probs_laplace": probs_laplace,
    })  # fmt: skip
    return out


class CIFAR10NetStandIn(nn.Sequential):
    """Stand-in for ``examples/helper/util_gp.py``'s ``CIFAR10Net`` (deepobs' 3c3d, 1.4M
    weights, on FMNIST with ``use_tanh=True``): two convolutions with max pooling and two tanh
    dense layers, ``(N, 1, 28, 28)`` → 10 logits, Xavier initialised as there."""

    def __init__(self, in_channels=1, n_out=10, use_tanh=True):
        super().__init__()
        activ = nn.Tanh if use_tanh else nn.ReLU
        self.add_module("conv1", nn.Conv2d(in_channels, 4, 5))
        self.add_module("relu1", nn.ReLU())
        self.add_module("maxpool1", nn.MaxPool2d(3, 3))
        self.add_module("flatten", nn.Flatten())
        self.add_module("dense1", nn.Linear(4 * 8 * 8, 16))
        self.add_module("relu4", activ())
        self.add_module("dense3", nn.Linear(16, n_out))
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.constant_(module.bias, 0.0)
                (nn.init.xavier_normal_ if isinstance(module, nn.Conv2d) else nn.init.xavier_uniform_)(module.weight)


def calibration_gp_example(lib, n_train=100, n_test=50, ms=(50, 100), pretrain_steps=30):
    """``examples/calibration_gp_example.py``: MAP metrics, then for each ``m``
    ``Laplace(model, "classification", subset_of_weights="all", hessian_structure="gp",
    independent_outputs=True, n_subset=m, prior_precision=prior_precision)``, ``fit`` and the
    metrics of ``la(x)``. FMNIST: synthetic ``(1, 28, 28)`` images; the checkpoint's ``delta``:
    a fixed ``prior_precision`` of 2.2e2 / N (its file name's 2.2e+02, per data point); ``m``
    ``{50, 100}`` of 100 training points (the script: 50 … 1600 of 60,000)."""
    Laplace = lib.Laplace
    import torch.distributions as dists

    np.random.seed(7777)
    torch.manual_seed(7777)
    BATCH_SIZE = 25
    x_tr, y_tr = _images(n_train, 1, 28, 10, seed=3)
    x_te, y_te = _images(n_test, 1, 28, 10, seed=4)
    train_loader = data_utils.DataLoader(data_utils.TensorDataset(x_tr, y_tr), batch_size=BATCH_SIZE, shuffle=True)
    test_loader = data_utils.DataLoader(data_utils.TensorDataset(x_te, y_te), batch_size=BATCH_SIZE, shuffle=False)
    targets = torch.cat([y for x, y in test_loader], dim=0).cpu()
    torch.manual_seed(0)
    model = _pretrain(CIFAR10NetStandIn(1, 10, use_tanh=True), x_tr, y_tr, pretrain_steps, seed=0)
    prior_precision = 2.2e2 / n_train

    @torch.no_grad()
    def predict(dataloader, model, laplace=False):
        py = []
        for x, _ in dataloader:
            if laplace:
                py.append(model(x))
            else:
                py.append(torch.softmax(model(x), dim=-1))
        return torch.cat(py).cpu()

    out, printed = {}, []
    probs_map = predict(test_loader, model, laplace=False)
    acc_map = (probs_map.argmax(-1) == targets).float().mean()
    ece_map = ece(probs_map.numpy(), targets.numpy(), bins=15)
    nll_map = -dists.Categorical(probs_map).log_prob(targets).mean()
    printed.append(f"[MAP] Acc.: {acc_map:.1%}; ECE: {ece_map:.1%}; NLL: {nll_map:.3}")
    for m in ms:
        printed.append(f"Fitting Laplace-GP for m={m}")
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure="gp",
            independent_outputs=True,
            n_subset=m,
            prior_precision=prior_precision,
        )
        la.fit(train_loader)
        probs_laplace = predict(test_loader, la, laplace=True)
        acc_laplace = (probs_laplace.argmax(-1) == targets).float().mean()
        ece_laplace = ece(probs_laplace.numpy(), targets.numpy(), bins=15)
        nll_laplace = -dists.Categorical(probs_laplace).log_prob(targets).mean()
        printed.append(f"[Laplace] Acc.: {acc_laplace:.1%}; ECE: {ece_laplace:.1%}; NLL: {nll_laplace:.3}")
        out[f"m={m}: NLL"], out[f"m={m}: probs"] = nll_laplace, probs_laplace
    out["printed"] = "\n".join(printed)
    return out



# --------------------------------------------------------------------------- Bayesian optimisation


class _Model(nn.Module):
    """Stand-in for ``botorch.models.model.Model`` (what ``LaplaceBNN`` subclasses)."""


class _Posterior:
    """Stand-in for ``botorch.posteriors.gpytorch.GPyTorchPosterior``: holds the
    ``gpytorch`` ``MultivariateNormal``; ``mean``, ``variance``."""

    def __init__(self, distribution):
        self.distribution = distribution
        self.mean = distribution.mean.unsqueeze(-1)
        self.variance = distribution.variance.unsqueeze(-1)


def branin(x):
    """Stand-in for ``botorch.test_functions.Branin()`` (its definition, minimum 0.397887)."""
    x1, x2 = x[..., 0], x[..., 1]
    a, b, c, r, s, t = 1.0, 5.1 / (4 * math.pi**2), 5 / math.pi, 6.0, 10.0, 1 / (8 * math.pi)
    return a * (x2 - b * x1**2 + c * x1 - r) ** 2 + s * (1 - t) * torch.cos(x1) + s


def expected_improvement(model, X, best_f):
    """Stand-in for botorch's analytic ``ExpectedImprovement(model, best_f, maximize=False)``:
    ``X`` ``(B, 1, d)`` → ``σ (u Φ(u) + φ(u))``, ``u = (best_f − μ) / σ``."""
    post = model.posterior(X)
    mean, sigma = post.mean.squeeze(-1).squeeze(-1), post.variance.squeeze(-1).squeeze(-1).clamp_min(1e-12).sqrt()
    u = (best_f - mean) / sigma
    normal = torch.distributions.Normal(torch.zeros_like(u), torch.ones_like(u))
    return sigma * (u * normal.cdf(u) + normal.log_prob(u).exp())


def optimize_acqf(acq_f, bounds, q, num_restarts, raw_samples, steps=5, lr=0.1):
    """Stand-in for ``botorch.optim.optimize_acqf`` (q = 1): the best of ``raw_samples``
    uniform candidates, then ``steps`` Adam steps of gradient ascent on the acquisition, inside
    ``bounds`` (the gradient flows through ``la(x, joint=True)``: ``enable_backprop``)."""
    lo, hi = bounds[0], bounds[1]
    X = lo + (hi - lo) * torch.rand(raw_samples, 1, bounds.shape[1])
    with torch.no_grad():
        best = acq_f(X).argmax()
    x = X[best : best + 1].clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        (-acq_f(x).sum()).backward()
        opt.step()
        with torch.no_grad():
            x.copy_(torch.maximum(torch.minimum(x, hi), lo))
    with torch.no_grad():
        val = acq_f(x)
    return x.detach().reshape(q, -1), val


def bayesopt_example(lib, n_epochs=1000, exp_len=2, n_test=1000):
    """``examples/bayesopt_example.py``'s ``LaplaceBNN`` (a 2-50-50-1 network trained by Adam,
    then ``Laplace(..., "regression", subset_of_weights="all", hessian_structure="kron",
    enable_backprop=True)``, ``optimize_prior_precision(n_steps=50)``, the joint predictive
    ``la(X, joint=True)`` as a botorch posterior) and its main loop on Branin with EI
    (``exp_len`` steps; the script: 500), the BNN-LA model only. botorch by stand-ins
    (`_Model`, `_Posterior`, `branin`, `expected_improvement`, `optimize_acqf`); test points
    ``n_test`` (the script: 10,000). Returned: the test MSE after each step (what the progress
    bar prints), the proposals and their values, the EI and its input gradient at fixed
    points."""
    Laplace = lib.Laplace
    from typing import Any, List, Optional

    from gpytorch import distributions as gdists
    from torch import distributions as dists
    from torch import optim
    from torch.nn import functional as F

    class LaplaceBNN(_Model):
        def __init__(self, train_X, train_Y, bnn=None, likelihood="regression", batch_size=1024):
            super().__init__()
            self.train_X = train_X
            self.train_Y = train_Y
            self.likelihood = likelihood
            self.batch_size = batch_size
            self.nn = nn.Sequential(
                nn.Linear(train_X.shape[-1], 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(),
                nn.Linear(50, train_Y.shape[-1]),
            )  # fmt: skip
            self.bnn = bnn
            if self.bnn is None:
                self._train_model(self._get_train_loader())

        def posterior(self, X, output_indices: Optional[List[int]] = None, observation_noise=False,
                      posterior_transform=None, **kwargs: Any):  # fmt: skip
            B, Q, D = X.shape
            X = X.reshape(B * Q, D)
            mean_y, cov_y = self._get_prediction(X, use_test_loader=False)
            K = self.num_outputs
            mean_y = mean_y.reshape(B, Q * K)
            cov_y += 1e-4 * torch.eye(B * Q * K)
            cov_y = cov_y.reshape(B, Q, K, B, Q, K)
            cov_y = torch.einsum("bqkbrl->bqkrl", cov_y)
            cov_y = cov_y.reshape(B, Q * K, Q * K)
            dist = gdists.MultivariateNormal(mean_y, covariance_matrix=cov_y)
            post_pred = _Posterior(dist)
            if posterior_transform is not None:
                return posterior_transform(post_pred)
            return post_pred

        def condition_on_observations(self, X, Y, **kwargs: Any):
            self.train_X = torch.cat([self.train_X, X], dim=0)
            self.train_Y = torch.cat([self.train_Y, Y], dim=0)
            train_loader = self._get_train_loader()
            self._train_model(train_loader)
            reseed(200)  # added (`reseed`): the new model's network is initialised after the fit
            return LaplaceBNN(self.train_X, self.train_Y, self.bnn, self.likelihood, self.batch_size)

        @property
        def num_outputs(self) -> int:
            return self.train_Y.shape[-1]

        def _train_model(self, train_loader):
            optimizer = optim.Adam(self.nn.parameters(), lr=1e-1, weight_decay=1e-3)
            scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, n_epochs * len(train_loader))
            loss_func = nn.MSELoss()
            for i in range(n_epochs):
                for x, y in train_loader:
                    optimizer.zero_grad()
                    output = self.nn(x)
                    loss = loss_func(output, y)
                    loss.backward()
                    optimizer.step()
                    scheduler.step()
            self.nn.eval()
            self.bnn = Laplace(
                self.nn, self.likelihood, subset_of_weights="all", hessian_structure="kron",
                enable_backprop=True,
            )  # fmt: skip
            self.bnn.fit(train_loader)
            self.bnn.optimize_prior_precision(n_steps=50)

        def _get_prediction(self, test_x, joint=True, use_test_loader=False):
            if not use_test_loader:
                mean_y, cov_y = self.bnn(test_x, joint=True)
            else:
                test_loader = data_utils.DataLoader(
                    data_utils.TensorDataset(test_x, torch.zeros_like(test_x)), batch_size=256
                )
                mean_y, cov_y = [], []
                for x_batch, _ in test_loader:
                    _mean_y, _cov_y = self.bnn(x_batch, joint=joint)
                    mean_y.append(_mean_y)
                    cov_y.append(_cov_y)
                mean_y = torch.cat(mean_y, dim=0).squeeze()
                cov_y = torch.cat(cov_y, dim=0).squeeze()
            return mean_y, cov_y

        def _get_train_loader(self):
            return data_utils.DataLoader(
                data_utils.TensorDataset(self.train_X, self.train_Y), batch_size=self.batch_size, shuffle=True
            )

    # __main__ with --test_func branin --acqf EI --randseed 1
    randseed = 1
    np.random.seed(randseed)
    torch.set_default_dtype(torch.float64)  # the script's own: restored by `default_dtype`
    torch.manual_seed(randseed)
    true_f = branin
    bounds = torch.tensor([[-5, 10], [0, 15]]).T.double()
    train_data_points = 20
    train_x = torch.cat([dists.Uniform(*bounds.T[i]).sample((train_data_points, 1)) for i in range(2)], dim=1)
    train_y = true_f(train_x).reshape(-1, 1)
    test_x = torch.cat([dists.Uniform(*bounds.T[i]).sample((n_test, 1)) for i in range(2)], dim=1)
    test_y = true_f(test_x)
    models = {"BNN-LA": LaplaceBNN(train_x, train_y)}

    def evaluate_model(model_name, model):
        pred, _ = model._get_prediction(test_x, use_test_loader=True, joint=False)
        return F.mse_loss(pred, test_y).squeeze().item()

    out = {}
    for model_name, model in models.items():
        np.random.seed(randseed)
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(randseed)
        best_y = train_y.min().item()
        mse, proposals = [evaluate_model(model_name, model)], []
        probe = torch.tensor([[[0.0, 5.0]], [[5.0, 5.0]], [[-3.0, 12.0]]], requires_grad=True)  # added
        ei = expected_improvement(model, probe, best_y)
        (grad,) = torch.autograd.grad(ei.sum(), probe)
        out["EI at 3 points"], out["d EI / dx"] = ei.detach(), grad
        for i in range(exp_len):
            reseed(100 + i)  # added (`reseed`)
            acq_f = lambda X: expected_improvement(model, X, best_y)  # noqa: E731
            new_x, val = optimize_acqf(acq_f, bounds=bounds, q=1, num_restarts=10, raw_samples=20)
            if len(new_x.shape) == 1:
                new_x = new_x.unsqueeze(0)
            new_y = true_f(new_x).unsqueeze(-1)
            model = model.condition_on_observations(new_x, new_y)
            if new_y.min().item() <= best_y:
                best_y = new_y.min().item()
            proposals.append(torch.cat([new_x.flatten(), new_y.flatten(), val.flatten()]))
            mse.append(evaluate_model(model_name, model))
        out["MSE after each step"] = torch.tensor(mse)
        out["proposals (x, f(x), EI)"] = torch.stack(proposals)
        out["best f(x)"] = torch.tensor(best_y)
    return out


# --------------------------------------------------------------------------- Hugging Face


class CharTokenizer:
    """Stand-in for ``GPT2Tokenizer.from_pretrained("gpt2")`` (no download): characters to ids
    ``ord(c) % 63``, ``eos_token_id`` 63; ``tokenizer(text)`` gives ``input_ids`` and
    ``attention_mask``."""

    eos_token_id = 63
    pad_token_id = None

    def __call__(self, text):
        ids = [ord(c) % 63 for c in text]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


def collate_with_padding(tokenizer):
    """Stand-in for ``DataCollatorWithPadding(tokenizer)``: right-pads ``input_ids`` with the
    pad id and ``attention_mask`` with 0 to the longest row, renames ``label`` to ``labels``
    and returns a ``BatchEncoding`` (a ``UserDict``, as Hugging Face's)."""
    from transformers import BatchEncoding

    def collate(rows):
        length = max(len(r["input_ids"]) for r in rows)
        pad = lambda v, fill: list(v) + [fill] * (length - len(v))  # noqa: E731
        return BatchEncoding({
            "input_ids": torch.tensor([pad(r["input_ids"], tokenizer.pad_token_id) for r in rows]),
            "attention_mask": torch.tensor([pad(r["attention_mask"], 0) for r in rows]),
            "labels": torch.tensor([r["label"] for r in rows]),
        })  # fmt: skip

    return collate


def tiny_gpt2_config():
    """Stand-in for ``GPT2Config.from_pretrained("gpt2")``: two layers, width 16."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=2, n_head=2)


def huggingface_example(lib, lora_structure="kron", lora_backend=None):
    """``examples/huggingface_example.py`` (and the docs' "Laplace on LLMs"): a GPT-2 sequence
    classifier behind a dict-input wrapper; last-layer Laplace (``"full"``,
    ``feature_reduction="pick_last"``), Laplace over the grad-enabled ``score`` head
    (``"all"``, ``"diag"``), each with ``optimize_prior_precision()``, and an unfitted LoRA
    Laplace's prediction (the script: ``"kron"``; the docs: ``"diag"`` with ``AsdlGGN``,
    ``lora_structure``/``lora_backend``). Pretrained GPT-2 and its tokenizer by a seeded
    two-layer ``GPT2ForSequenceClassification`` and `CharTokenizer`; ``datasets.Dataset`` by
    the rows it holds; `collate_with_padding`."""
    Laplace = lib.Laplace
    from collections import UserDict
    from collections.abc import MutableMapping

    from peft import LoraConfig, get_peft_model
    from transformers import GPT2ForSequenceClassification

    torch.manual_seed(0)
    np.random.seed(0)
    tokenizer = CharTokenizer()
    tokenizer.pad_token_id = tokenizer.eos_token_id
    data = [
        {"text": "Today is hot, but I will manage!!!!", "label": 1},
        {"text": "Tomorrow is cold", "label": 0},
        {"text": "Carpe diem", "label": 1},
        {"text": "Tempus fugit", "label": 1},
    ]
    dataset = [dict(tokenizer(row["text"]), label=row["label"]) for row in data]
    dataloader = data_utils.DataLoader(dataset, batch_size=100, collate_fn=collate_with_padding(tokenizer))
    data = next(iter(dataloader))
    printed = [f"Huggingface data defaults to UserDict, which is a MutableMapping? {isinstance(data, UserDict)}"]
    for k, v in data.items():
        printed.append(f"{k} {v.shape}")

    class MyGPT2(nn.Module):
        def __init__(self, tokenizer) -> None:
            super().__init__()
            config = tiny_gpt2_config()
            config.pad_token_id = tokenizer.pad_token_id
            config.num_labels = 2
            torch.manual_seed(0)  # added: from_pretrained's weights are the same every time
            self.hf_model = GPT2ForSequenceClassification(config).to(torch.get_default_dtype())

        def forward(self, data: MutableMapping) -> torch.Tensor:
            device = next(self.parameters()).device
            input_ids = data["input_ids"].to(device)
            attn_mask = data["attention_mask"].to(device)
            output_dict = self.hf_model(input_ids=input_ids, attention_mask=attn_mask)
            return output_dict.logits

    out = {}
    model = MyGPT2(tokenizer)
    model.eval()
    la = Laplace(model, likelihood="classification", subset_of_weights="last_layer",
                 hessian_structure="full", feature_reduction="pick_last")  # fmt: skip
    la.fit(dataloader)
    la.optimize_prior_precision()
    X_test = next(iter(dataloader))
    pred = la(X_test)
    printed.append(f"[Last-layer Laplace] The predictive tensor is of shape: {pred.shape}.")
    out["last layer: prior precision"], out["last layer: la(X_test)"] = la.prior_precision.detach(), pred
    del model, la

    model = MyGPT2(tokenizer)
    model.eval()
    for p in model.hf_model.parameters():
        p.requires_grad = False
    for p in model.hf_model.score.parameters():
        p.requires_grad = True
    la = Laplace(model, likelihood="classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(dataloader)
    la.optimize_prior_precision()
    X_test = next(iter(dataloader))
    pred = la(X_test)
    printed.append(f"[Subnetwork Laplace] The predictive tensor is of shape: {pred.shape}.")
    out["score head: prior precision"], out["score head: la(X_test)"] = la.prior_precision.detach(), pred
    del model, la

    def get_lora_model():
        model = MyGPT2(tokenizer)
        config = LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.1, bias="none")
        lora_model = get_peft_model(model, config)
        return lora_model

    lora_model = get_lora_model()
    lora_model.eval()
    kwargs = {} if lora_backend is None else {"backend": lora_backend}
    lora_la = Laplace(lora_model, likelihood="classification", subset_of_weights="all",
                      hessian_structure=lora_structure, **kwargs)  # fmt: skip
    X_test = next(iter(dataloader))
    try:  # added: laplace-torch 0.3 refuses to predict before fit (its script stops here)
        pred = lora_la(X_test)
        printed.append(f"[LoRA-LLM] The predictive tensor is of shape: {pred.shape}.")
        out["LoRA, unfitted: lora_la(X_test)"] = "predicted"
    except Exception as error:  # noqa: BLE001
        out["LoRA, unfitted: lora_la(X_test)"] = "refused: not fitted" if "fit" in str(error) else repr(error)
    out["printed"] = "\n".join(printed)
    return out


# --------------------------------------------------------------------------- comparison


def run(port, dtype: torch.dtype, **kwargs) -> dict[str, dict]:
    """``port`` run once per library (laplace-torch first) with ``dtype`` as the default."""
    results = {}
    for name, lib in LIBS.items():
        with default_dtype(dtype):
            results[name] = port(lib(), **kwargs)
    return results


def rel_diff(ours, theirs) -> float:
    """``max |ours − theirs| / max |theirs|`` (numbers, tensors or arrays; equal strings and
    booleans 0, different ones inf)."""
    if isinstance(theirs, (str, bool, tuple)):
        return 0.0 if ours == theirs else math.inf
    a = torch.as_tensor(ours).double()
    b = torch.as_tensor(theirs).double()
    if a.shape != b.shape:
        return math.inf
    scale = b.abs().max()
    diff = (a - b).abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def compare(results: dict[str, dict]) -> dict[str, float]:
    """Per number of the script, our relative difference from laplace-torch's."""
    theirs, ours = results["laplace-torch"], results["pyro_subspace"]
    if set(theirs) != set(ours):
        raise AssertionError(f"the ports returned different numbers: {set(theirs) ^ set(ours)}")
    return {key: rel_diff(ours[key], theirs[key]) for key in theirs}


# --------------------------------------------------------------------------- the table

#: (row, port, dtype, keyword arguments, the headline number, numbers not compared and why)
ROWS = [
    ("regression_example", regression_example, F64, {"n_epochs_marglik": 200}, "prior precision", {}),
    ("regression_example", regression_example, F32, {"n_epochs_marglik": 200}, "prior precision", {}),
    ("reward_modeling_example", reward_modeling_example, F64, {}, "pred_var", {}),
    ("reward_modeling_example", reward_modeling_example, F32, {}, "pred_var", {}),
    ("calibration_example", calibration_example, F64, {}, "Laplace NLL", {}),
    ("calibration_example", calibration_example, F32, {}, "Laplace NLL", {}),
    ("calibration_gp_example", calibration_gp_example, F64, {"n_train": 200, "ms": (50, 200)}, "m=50: NLL", {}),
    ("calibration_gp_example", calibration_gp_example, F32, {"n_train": 200, "ms": (50, 200)}, "m=50: NLL", {}),
    ("bayesopt_example", bayesopt_example, F64, {"exp_len": 3}, "EI at 3 points", {}),
    ("expectation_example", expectation_example, F64, {}, "prior precision", {}),
    ("expectation_example", expectation_example, F32, {}, "prior precision", {}),
    ("huggingface_example", huggingface_example, F64, {}, "last layer: la(X_test)", {}),
    ("huggingface_example", huggingface_example, F32, {}, "last layer: la(X_test)", {}),
    ("README quick start", readme_quickstart, F64, {}, "pred", {}),
    ("README quick start", readme_quickstart, F32, {}, "pred", {}),
    ("docs marginal likelihood (LL K-FAC)", docs_marginal_likelihood, F64, {}, "ml", {
        "d ml / d obs_noise": "laplace-torch's K-FAC evidence drops the log-det's sigma-dependence",
        "loop: sigma": "its loop follows that gradient", "loop: prior precision": "",
        "loop: neg_marglik": "", "la(x_test)": ""}),
    ("docs marginal likelihood (LL K-FAC)", docs_marginal_likelihood, F32, {}, "ml", {
        "d ml / d obs_noise": "as in float64", "loop: sigma": "", "loop: prior precision": "",
        "loop: neg_marglik": "", "la(x_test)": ""}),
    ("docs subnetwork", docs_subnetwork, F64, {}, "posterior covariance", {}),
    ("docs subnetwork", docs_subnetwork, F32, {}, "posterior covariance", {}),
]


def marglik_regression(lib, n_epochs=1000, backend=None):
    """The regression example's ``marglik_training`` call alone, in its float32, with its
    settings (data, seed 711, full, BackPackGGN, lr 1e-2, scalar prior): final ``σ``, ``λ``,
    last evidence and loss (issue 36 (b)). ``backend``: another laplace-torch backend class
    than the script's ``BackPackGGN``."""
    from laplace.curvature.backpack import BackPackGGN

    backend = backend or BackPackGGN

    torch.manual_seed(711)
    _, _, train_loader, _ = get_sinusoid_example(sigma_noise=0.3)
    torch.manual_seed(711)
    model = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    la, model, margliks, losses = lib.marglik_training(
        model=model, train_loader=train_loader, likelihood="regression", hessian_structure="full",
        backend=backend, n_epochs=n_epochs, optimizer_kwargs={"lr": 1e-2}, prior_structure="scalar",
    )  # fmt: skip
    return {
        "sigma": la.sigma_noise.detach(), "prior precision": la.prior_precision.detach(),
        "last marglik": torch.as_tensor(margliks[-1]), "last loss": torch.as_tensor(losses[-1]),
    }  # fmt: skip


def regression_map(n_epochs: int):
    """The regression example's float32 MAP (its data, seeds, network and Adam loop):
    ``(net, x, y)``."""
    with default_dtype(F32):
        torch.manual_seed(711)
        x, y, _, _ = get_sinusoid_example(150, 0.3)
        torch.manual_seed(711)
        net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(n_epochs):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    return net, x, y


def hyper_loop(la, dtype, n_steps):
    """The regression example's loop on ``log λ, log σ`` (Adam, lr 0.1); returns ``(λ, σ)``."""
    log_prior = torch.ones(1, dtype=dtype, requires_grad=True)
    log_sigma = torch.ones(1, dtype=dtype, requires_grad=True)
    opt = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(n_steps):
        opt.zero_grad()
        (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).backward()
        opt.step()
    return float(log_prior.exp()), float(log_sigma.exp())


def float32_spread(n_epochs: int = 300, n_steps: int = 300) -> list[tuple[str, float, float]]:
    """How far float32 rounding alone moves the regression example's tuned ``(λ, σ)``: on one
    float32 MAP, laplace-torch's full Laplace fitted with the same GGN summed in other orders
    (batch sizes 150, 50, 1; BackPack and curvlinops backends) and ours, each tuned by the
    example's loop; rows ``(name, λ, σ)``, the first laplace-torch in float64 on the same
    weights (the exact value up to 1e-13)."""
    import copy

    import laplace
    from laplace.curvature import BackPackGGN, CurvlinopsGGN

    from pyro_subspace.infer import Laplace

    net, x, y = regression_map(n_epochs)

    def loader(batch_size, dtype=F32):
        data = data_utils.TensorDataset(x.to(dtype), y.to(dtype))
        return data_utils.DataLoader(data, batch_size=batch_size)

    rows = []
    with default_dtype(F64):
        la = laplace.Laplace(copy.deepcopy(net).double(), "regression", subset_of_weights="all", hessian_structure="full")
        la.fit(loader(150, F64))
        rows.append(("laplace-torch float64, batch 150", *hyper_loop(la, F64, n_steps)))
    for backend, batch_size in [(BackPackGGN, 150), (BackPackGGN, 50), (BackPackGGN, 1), (CurvlinopsGGN, 150)]:
        la = laplace.Laplace(net, "regression", subset_of_weights="all", hessian_structure="full", backend=backend)
        la.fit(loader(batch_size))
        rows.append((f"laplace-torch float32, {backend.__name__}, batch {batch_size}", *hyper_loop(la, F32, n_steps)))
    la = Laplace(net, "regression", subset_of_weights="all", hessian_structure="full").fit(loader(150))
    rows.append(("pyro_subspace float32, batch 150", *hyper_loop(la, F32, n_steps)))
    return rows


def _headline(value) -> str:
    if isinstance(value, str):
        return value.splitlines()[0][:28]
    v = torch.as_tensor(value).double().flatten()
    return f"{float(v[0]):.6g}" + (f" (+{v.numel() - 1})" if v.numel() > 1 else "")


def main(argv=None) -> int:
    """Print the table of `benchmarks/results/laplace_torch_examples.txt`: per script and
    dtype, its headline number on both libraries, the largest relative difference over every
    number it prints or computes (those not compared, and why, below the table) and the
    status against issue 36's tolerance (1e-6 float64, 1e-4 float32)."""
    import argparse
    import platform
    import subprocess

    import laplace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="rows whose script name contains this")
    parser.add_argument("--marglik-epochs", type=int, default=None,
                        help="only the regression example's marglik_training, N epochs")  # fmt: skip
    parser.add_argument("--float64", dest="dtype", action="store_const", const=F64, default=F32,
                        help="--marglik-epochs in float64 (default: the script's float32)")  # fmt: skip
    parser.add_argument("--float32-spread", action="store_true",
                        help="only the regression example's float32 lambda under other summation orders")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.float32_spread:
        print(f"# the regression example's tuned lambda and sigma in float32 under other summation orders "
              f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 1 thread; uptime: "
              f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()})")  # fmt: skip
        rows = float32_spread()
        base = rows[1]  # laplace-torch's default: BackPack, the script's batch of 150
        print(f"{'run':52s} {'lambda':>10s} {'sigma':>10s} {'lambda vs default':>18s} {'lambda vs float64':>18s}")
        for name, lam, sigma in rows:
            print(f"{name:52s} {lam:10.6f} {sigma:10.6f} {abs(lam / base[1] - 1):18.1e} {abs(lam / rows[0][1] - 1):18.1e}")
        if args.marglik_epochs:  # and marglik_training's final values under another backend
            from laplace.curvature import CurvlinopsGGN

            print(f"\n# marglik_training, float32, {args.marglik_epochs} epochs: laplace-torch with the "
                  "script's BackPackGGN and with CurvlinopsGGN (the same GGN summed in another order), ours")  # fmt: skip
            with default_dtype(F32):
                runs = {
                    "laplace-torch, BackPackGGN": marglik_regression(lib_laplace_torch(), args.marglik_epochs),
                    "laplace-torch, CurvlinopsGGN": marglik_regression(
                        lib_laplace_torch(), args.marglik_epochs, CurvlinopsGGN),
                    "pyro_subspace": marglik_regression(lib_ours(), args.marglik_epochs),
                }  # fmt: skip
            ref = runs["laplace-torch, BackPackGGN"]
            for name, res in runs.items():
                print(f"{name:30s} " + "  ".join(
                    f"{k} {float(v):.6g} ({rel_diff(v, ref[k]):.1e})" for k, v in res.items()))  # fmt: skip
        return 0
    if args.marglik_epochs:
        start = time.perf_counter()
        results = run(marglik_regression, args.dtype, n_epochs=args.marglik_epochs)
        print(f"# regression_example's marglik_training, {str(args.dtype)[6:]}, {args.marglik_epochs} epochs "
              f"({time.perf_counter() - start:.0f} s, uptime: "
              f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()})")  # fmt: skip
        for key, diff in compare(results).items():
            print(f"{key:18s} ours {float(results['pyro_subspace'][key]):.6g}  laplace-torch "
                  f"{float(results['laplace-torch'][key]):.6g}  rel diff {diff:.1e}")  # fmt: skip
        return 0
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# laplace-torch's examples through pyro_subspace.infer.Laplace ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print(f"# torch {torch.__version__}, laplace-torch {getattr(laplace, '__version__', '0.3')}, "
          f"torch.get_num_threads() = {torch.get_num_threads()}, {platform.machine()}; uptime: {load}")
    print("# each script run twice in one process (laplace-torch, then ours), the scripts' settings")
    print("# (the regression example's marglik_training 200 epochs of its 1000, so the table runs")
    print("# in minutes; bayesopt 3 BO steps of 500 on 1000 test points of 10,000; calibration_gp")
    print("# m = 50, 200 of 200 points) (python benchmarks/laplace_torch_examples.py)")
    print()
    head = f"{'script':38s} {'dtype':7s} {'number':24s} {'ours':>22s} {'laplace-torch':>22s} {'max rel diff':>12s}  status"
    print(head)
    print("-" * len(head))
    notes = []
    worst = 0.0
    for name, port, dtype, kwargs, key, skipped in ROWS:
        if args.only and args.only not in name:
            continue
        start = time.perf_counter()
        try:
            results = run(port, dtype, **kwargs)
        except Exception as error:  # noqa: BLE001
            print(f"{name:38s} {str(dtype)[6:]:7s} {'':24s} {'':>22s} {'':>22s} {'':>12s}  FAILS: {error!r}"[:220])
            continue
        diffs = compare(results)
        compared = {k: v for k, v in diffs.items() if k not in skipped}
        diff = max(compared.values())
        tol = TOL[dtype]
        status = "agrees" if diff <= tol else "differs"
        if name == "regression_example" and dtype == F32 and diff > tol:
            status = "float32 rounding (note 1)"
        worst = max(worst, diff) if status == "agrees" else worst
        print(f"{name:38s} {str(dtype)[6:]:7s} {key[:24]:24s} {_headline(results['pyro_subspace'][key]):>22s} "
              f"{_headline(results['laplace-torch'][key]):>22s} {diff:12.1e}  {status} "
              f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
        for k, why in skipped.items():
            if why:
                notes.append(f"{name} ({str(dtype)[6:]}): '{k}' not compared, rel diff {diffs[k]:.1e}: {why}")
        if status != "agrees":
            for k, v in diffs.items():
                if v > tol:
                    notes.append(f"{name} ({str(dtype)[6:]}): '{k}' rel diff {v:.1e}")
    print()
    print("# note 1: the float32 regression example cannot agree to 1e-4 with any implementation that")
    print("# does not reproduce laplace-torch's float32 rounding: its full GGN (151 weights) has most of")
    print("# its spectrum near 0, where float32 sums err by ~eps*||G||; laplace-torch's own float32")
    print("# lambda is 2.3e-3 from its float64 lambda on the same weights and 7.5e-3 from itself when only")
    print("# its batch size changes (--float32-spread) (ours 3.1e-3 from float64; the test")
    print("# test_float32_curvature_and_evidence_as_accurate_as_laplace_torch checks ours is as")
    print("# accurate); marglik_training's final sigma, lambda, evidence within 1e-2 at 200 epochs")
    print("# (issue 36 (b)); at the script's 1000: --marglik-epochs 1000, below.")
    print("# The loop on the docs' K-FAC (rows 'docs marginal likelihood') is not compared: laplace-torch's")
    print("# K-FAC evidence is not differentiated in sigma through its log-determinant (autograd -273.3,")
    print("# its own central difference -230.3; ours -230.3), so its loop follows another gradient.")
    for n in notes:
        print("#", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
