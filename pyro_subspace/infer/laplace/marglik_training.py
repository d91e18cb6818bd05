"""Marginal-likelihood training: the network and its prior (and noise) trained together.

Immer, Bauer, Fortuin, Rätsch and Khan (2021), *Scalable marginal likelihood estimation for
model selection in deep learning*, Algorithm 1, with laplace-torch 0.3's signature and
semantics (`marglik_training`): every epoch the network takes one pass of its optimiser on the
log joint ``mean loss + ½ θᵀ diag(δ) θ / (N · c)`` (``δ`` the prior precision expanded to the
weights, ``c = T`` for classification and ``T / 2σ²`` for regression), and every
``marglik_frequency`` epochs after ``n_epochs_burnin`` a Laplace approximation (`Laplace`, K-FAC
by default) is fitted at the current weights and ``log λ`` (and ``log σ``) take
``n_hypersteps`` Adam steps on the negative log evidence. The weights and hyperparameters of
the best evidence are kept, and the Laplace approximation there is returned.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.utils.data import DataLoader

from ... import batch as batching
from ... import validation as ck
from ...data import split_batch
from ...flat import flat_parameters
from .front import Laplace, NetLaplace
from .laplace_torch import enum_value

__all__ = ["marglik_training"]


def marglik_training(
    model: nn.Module,
    train_loader: DataLoader,
    likelihood: str = "classification",
    hessian_structure: str = "kron",
    backend: type | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict | None = None,
    scheduler_cls: type | None = None,
    scheduler_kwargs: dict | None = None,
    n_epochs: int = 300,
    lr_hyp: float = 1e-1,
    prior_structure: str = "layerwise",
    n_epochs_burnin: int = 0,
    n_hypersteps: int = 10,
    marglik_frequency: int = 1,
    prior_prec_init: float = 1.0,
    sigma_noise_init: float = 1.0,
    temperature: float = 1.0,
    fix_sigma_noise: bool = False,
    progress_bar: bool = False,
    enable_backprop: bool = False,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
) -> tuple[NetLaplace, nn.Module, list[float], list[float]]:
    """Train ``model`` and its prior precision (and, for regression, the noise ``σ``) by the
    Laplace evidence: Immer et al. (2021), Algorithm 1, as laplace-torch 0.3 runs it.

    Args:
        model: the network (outputs: logits for classification, means for regression).
        train_loader: a ``DataLoader`` of ``(x, y)`` pairs or dict batches (targets under
            ``dict_key_y``; ``dict_key_x`` is accepted for laplace-torch's signature: the
            rows of a mapping are counted from any of its entries here); ``len(dataset)`` is
            ``N``.
        likelihood: ``"classification"`` or ``"regression"`` (laplace-torch's names or its
            enum members).
        hessian_structure: the Laplace approximation's structure (`Laplace`): ``"kron"``
            (default), ``"full"``, ``"diag"``, ``"lowrank"``.
        backend: laplace-torch's curvature backend class (`Laplace`'s ``backend``): its GGN
            backends are this library's exact GGN.
        optimizer_cls, optimizer_kwargs: the network's optimiser (default Adam; a
            ``weight_decay`` is set to 0 with a warning: the prior is the regulariser).
        scheduler_cls, scheduler_kwargs: an optional scheduler, stepped after every batch.
        n_epochs: epochs of training.
        lr_hyp: Adam's step size on ``log λ`` and ``log σ``.
        prior_structure: ``"scalar"``, ``"layerwise"`` (one ``λ`` per parameter tensor,
            default) or ``"diag"`` (one per weight).
        n_epochs_burnin: epochs before the first evidence step.
        n_hypersteps: Adam steps on the hyperparameters per evidence estimate.
        marglik_frequency: estimate the evidence every this many epochs.
        prior_prec_init: the initial ``λ`` (times ``temperature``, as laplace-torch does).
        sigma_noise_init: the initial ``σ`` (regression).
        temperature: ``T`` of the likelihood.
        fix_sigma_noise: keep ``σ = sigma_noise_init`` (regression).
        progress_bar: accepted (no bar is shown).
        enable_backprop: not supported: ``True`` raises.

    Returns:
        ``(la, model, margliks, losses)``: the `Laplace` approximation at the weights and
        hyperparameters of the best (lowest) negative log evidence, the model holding those
        weights, the negative log evidence after every hyperparameter step, and the mean log
        joint loss of every epoch.
    """
    likelihood = enum_value(likelihood)
    ck.choice(likelihood, "likelihood", ("classification", "regression"))
    prior_structure = ck.choice(enum_value(prior_structure), "prior_structure", ("scalar", "layerwise", "diag"))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(train_loader, DataLoader):
        raise TypeError(f"train_loader: expected a DataLoader, got {type(train_loader).__name__}")
    for name, value in (("n_epochs", n_epochs), ("n_hypersteps", n_hypersteps), ("marglik_frequency", marglik_frequency)):
        ck.positive_int(value, name)
    ck.nonneg_int(n_epochs_burnin, "n_epochs_burnin")
    for name, value in (("lr_hyp", lr_hyp), ("prior_prec_init", prior_prec_init), ("sigma_noise_init", sigma_noise_init), ("temperature", temperature)):
        ck.positive_float(value, name)
    ck.choice(fix_sigma_noise, "fix_sigma_noise", (True, False))
    ck.choice(progress_bar, "progress_bar", (True, False))
    if enable_backprop:
        raise ValueError("enable_backprop: predictions differentiable in the inputs are not available; leave it False")
    optimizer_kwargs = dict(optimizer_kwargs or {})
    if "weight_decay" in optimizer_kwargs:
        import warnings

        warnings.warn("optimizer_kwargs: weight decay is the prior here, optimised by the evidence; set to 0", stacklevel=2)
        optimizer_kwargs["weight_decay"] = 0.0

    params = [p for _, p in flat_parameters(model)]
    if not params:
        raise ValueError("model: no parameter requires grad: nothing to train")
    device, dtype = params[0].device, params[0].dtype
    n = len(train_loader.dataset)  # type: ignore[arg-type]
    sizes = [p.numel() for p in params]
    width = {"scalar": 1, "layerwise": len(params), "diag": sum(sizes)}[prior_structure]
    log_prior_prec = torch.full((width,), math.log(temperature * prior_prec_init), device=device, dtype=dtype)
    log_prior_prec.requires_grad_(True)
    hyperparameters = [log_prior_prec]
    regression = likelihood == "regression"
    if regression:
        log_sigma = torch.full((1,), math.log(sigma_noise_init), device=device, dtype=dtype, requires_grad=True)
        hyperparameters.append(log_sigma)
        criterion = nn.MSELoss(reduction="mean")
    else:
        criterion = nn.CrossEntropyLoss(reduction="mean")
    optimizer = optimizer_cls(model.parameters(), **optimizer_kwargs)
    scheduler = scheduler_cls(optimizer, **(scheduler_kwargs or {})) if scheduler_cls is not None else None
    hyper_optimizer = torch.optim.Adam(hyperparameters, lr=lr_hyp)

    def expanded(prior_prec: torch.Tensor) -> torch.Tensor:
        if prior_structure == "layerwise":
            return torch.cat([value.expand(size) for value, size in zip(prior_prec, sizes)])
        return prior_prec.expand(sum(sizes))

    def laplace(prior_prec, sigma) -> NetLaplace:
        kwargs = {"sigma_noise": float(torch.as_tensor(sigma).detach())} if regression else {}
        la = Laplace(
            model, likelihood, "all", hessian_structure, prior_precision=1.0,
            temperature=temperature, backend=backend, **kwargs,
        )  # fmt: skip
        la.prior_precision = prior_prec.detach()
        return la.fit(train_loader)

    best = (math.inf, None, None, None)
    losses: list[float] = []
    margliks: list[float] = []
    for epoch in range(1, n_epochs + 1):
        epoch_loss = 0.0
        model.train()
        for batch in train_loader:
            x, y = split_batch(batch, dict_key_y)
            x, y = batching.to_device(x, device), y.to(device)
            optimizer.zero_grad()
            sigma = (log_sigma.exp().detach() if not fix_sigma_noise else sigma_noise_init) if regression else 1.0
            factor = temperature / (2 * sigma**2) if regression else temperature
            theta = torch.cat([p.reshape(-1) for p in params])
            delta = expanded(log_prior_prec.exp().detach())
            f = batching.call(model, x)
            loss = criterion(f, y) + (0.5 * (delta * theta) @ theta) / n / factor
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item() * len(y)
            if scheduler is not None:
                scheduler.step()
        model.eval()
        losses.append(epoch_loss / n)
        if epoch % marglik_frequency != 0 or epoch < n_epochs_burnin:
            continue
        sigma = (log_sigma.exp() if not fix_sigma_noise else torch.tensor(sigma_noise_init)) if regression else 1.0
        la = laplace(log_prior_prec.exp(), sigma)
        for _ in range(n_hypersteps):
            hyper_optimizer.zero_grad()
            noise = log_sigma.exp() if regression and not fix_sigma_noise else None
            prior_prec = log_prior_prec.exp()
            marglik = -la.log_marginal_likelihood(expanded_for(la, prior_prec), noise)
            marglik.backward()
            hyper_optimizer.step()
            margliks.append(marglik.item())
        if margliks[-1] < best[0]:  # the hyperparameters this evidence was evaluated at
            sigma = (noise.detach().clone() if noise is not None else torch.tensor(sigma_noise_init)) if regression else 1.0
            best = (margliks[-1], copy.deepcopy(model.state_dict()), prior_prec.detach().clone(), sigma)
    _, state, prior_prec, sigma = best
    if state is not None:
        model.load_state_dict(state)
    else:
        prior_prec = log_prior_prec.exp().detach()
        sigma = (log_sigma.exp().detach() if not fix_sigma_noise else torch.tensor(sigma_noise_init)) if regression else 1.0
    return laplace(prior_prec, sigma), model, margliks, losses


def expanded_for(la: NetLaplace, prior_prec: torch.Tensor) -> torch.Tensor:
    """``λ`` as `NetLaplace.log_marginal_likelihood` takes it: one value, one per parameter
    tensor, or one per weight (its shapes), kept differentiable."""
    return prior_prec.reshape(()) if prior_prec.numel() == 1 else prior_prec
