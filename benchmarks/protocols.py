"""The Ensemble Model Patching classification protocol, shared by tutorial 04 and
``benchmarks/patches_digits.py`` (the ``pyro-subspace patch`` command runs the same recipe with
these settings as its flags' defaults; ``tests/test_benchmarks_protocols.py`` checks they agree).

A BatchNorm MLP (``in-128-BN-ReLU-128-BN-ReLU-out``) trained with Adam on its default settings
(``lr = 1e-3``), as the paper trains every model (section 5), with the same Gaussian prior
``N(0, τ⁻¹ I)`` for all methods:

- ``vanilla``: MAP, `fit_map` with weight decay ``τ/N`` (the prior as L2), one forward pass;
- ``dropout`` / ``dropconnect``: `PatchedNet` with the zero component (MC dropout, Table 1);
- ``emp`` / ``ecmp``: `PatchedNet` on BN + output layer, ``K`` components (eqs. 5, 6);
- ``ensemble``: `PatchedNet(mode="ensemble")`, ``K`` whole networks (Table 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyro
import torch
from torch import nn

from pyro_subspace import PatchedNet, fit_map, likelihoods
from pyro_subspace.datasets import Dataset

METHODS = ("vanilla", "dropout", "dropconnect", "emp", "ecmp", "ensemble")


def bn_mlp(n_in: int, n_out: int, hidden: int = 128, seed: int = 0) -> nn.Sequential:
    """``n_in-hidden-BN-ReLU-hidden-BN-ReLU-n_out`` with PyTorch's default init under ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(n_in, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_out),
        )


@dataclass
class TrainedMethod:
    """A trained method: ``model`` is the net (vanilla) or a `PatchedNet` (in eval mode)."""

    name: str
    model: nn.Module
    seconds: float  # CPU seconds (time.process_time) of training
    overhead: float  # parameter overhead in percent

    @torch.no_grad()
    def probs(self, x: torch.Tensor, num_samples: int = 100) -> torch.Tensor:
        """Predictive class probabilities ``(N, C)``: ``S = num_samples`` draws (eq. 22), or
        the single softmax of the vanilla net."""
        if isinstance(self.model, PatchedNet):
            return self.model.predictive_mean(x, num_samples)
        return self.model(x).softmax(-1)


def train_method(
    name: str,
    data: Dataset,
    *,
    epochs: int = 200,
    batch_size: int = 128,
    prior_precision: float = 1.0,
    n_components: int = 5,
    drop_prob: float = 0.1,
    seed: int = 0,
    svi: bool = False,
    hidden: int = 128,
    sigma: float = 0.0,
) -> TrainedMethod:
    """Train method ``name`` (one of `METHODS`) on a classification `Dataset`.

    Args:
        name: the method; data: from `datasets.digits` (or any classification split).
        epochs, batch_size: Adam (``lr = 1e-3``) epochs and minibatch size, for every method.
        prior_precision: ``τ``; vanilla uses weight decay ``τ/N``.
        n_components: ``K`` for emp, ecmp, ensemble; drop_prob: for dropout/dropconnect.
        seed: network initialisation, shuffling and the Monte Carlo draws.
        svi: train `PatchedNet` methods with Pyro's ``SVI``/``Trace_ELBO`` instead of the
            equivalent plain-torch loss (`PatchedNet.fit`).
        hidden: width of the two hidden layers.
        sigma: ``σ`` of the components; 0 is the limit ``σ → 0`` (the paper fixes ``σ`` to
            "machine epsilon"), which draws no weight noise.

    Returns:
        A `TrainedMethod` with the model in eval mode.
    """
    if name not in METHODS:
        raise ValueError(f"name: expected one of {METHODS}, got {name!r}")
    if data.task != "classification":
        raise ValueError(f"data: expected a classification dataset, got task {data.task!r}")
    net = bn_mlp(data.n_features, int(data.n_classes), hidden=hidden, seed=seed)
    lik = likelihoods.Categorical()
    n = data.n_train
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()
    if name == "vanilla":
        t0 = time.process_time()
        fit_map(
            net,
            lik,
            data.x_train,
            data.y_train,
            epochs=epochs,
            lr=1e-3,
            weight_decay=prior_precision / n,
            batch_size=batch_size,
            seed=seed,
            progress=False,
        )
        seconds = time.process_time() - t0
        return TrainedMethod(name, net.eval(), seconds, 0.0)
    model = PatchedNet(
        net,
        lik,
        mode=name,
        n_components=n_components,
        prior_precision=prior_precision,
        drop_prob=drop_prob,
        sigma=sigma,
        seed=seed,
    )
    t0 = time.process_time()
    model.fit(
        data.x_train,
        data.y_train,
        epochs=epochs,
        lr=1e-3,
        batch_size=batch_size,
        method="svi" if svi else "torch",
        seed=seed,
    )
    seconds = time.process_time() - t0
    return TrainedMethod(name, model.eval(), seconds, model.overhead)
