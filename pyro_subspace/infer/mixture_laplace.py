"""Mixtures of Laplace approximations over an ensemble (MoLA; Eschenhagen et al., 2021).

Given ``K`` independently trained networks ``θ_MAP^(k)`` (a deep ensemble, eq. 3), MoLA fits a
Laplace approximation ``N(μ^(k), Σ^(k))`` around each, over a subspace of its weights (the last
layer by default: LLLA), and combines them into the mixture posterior

    p_MoLA(w | D) = Σ_k π^(k) N(w | μ^(k), Σ^(k))                                   (eq. 7)

whose linearised outputs are the Gaussian mixture ``Σ_k π^(k) N(f | m^(k), C^(k))`` (eq. 8). For
the last layer the linearisation is exact. Classification uses the mixture of multi-class probit
approximations (eqs. 1 / 9, with eq. 6 per component)

    p(y = c | x) ≈ Σ_k π^(k) softmax(z^(k))_c,   z^(k)_i = m^(k)_i / √(1 + π/8 · C^(k)_ii),

or Monte Carlo; regression the mixture of the members' Gaussian predictives (density), or its
moment match. Each member is a `SubspaceNet` with an `AutoSubspaceLaplace` guide, so any subspace
builder can replace the last layer (MoLA B.2: "a Laplace approximation over a subset of the
weights"). With one network this is the last-layer Laplace approximation (`LastLayerLaplace`).

Mixture weights are uniform (what the paper uses in all experiments) or, as the experiment the
paper describes in B.2 / E.1, proportional to each member's Laplace evidence
``p(D | M_k)`` (``weights="evidence"``: the softmax of the members' log-evidences). The paper
argues that members differing only in their initialisation are the same model, so these weights
should be uniform, and reports that the evidences "only vary minimally" (B.2); with this
library's evidences the softmax can still be far from uniform when the log-evidences differ by a
few nats, which is why uniform is the default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from .. import batch as batching
from .. import validation
from ..flat import FlatNet, eval_mode
from ..likelihoods import Likelihood, check_temperature
from ..nn import SubspaceNet
from ..subspaces import IndexSubspace, Subspace, subnetwork
from ..transaction import transaction
from .ensembles import (
    MixturePredictor,
    _check_likelihoods,
    _check_nets,
    check_inputs,
    member_predictives,
    output_width,
)
from .laplace import AutoSubspaceLaplace, check_grid, linearized_moments
from .laplace.posteriors import check_structure
from .laplace.tuning import grid_covariances, grid_scores, select_on_grid

__all__ = ["LastLayerLaplace", "MixtureOfLaplace"]

WEIGHTS = ("uniform", "evidence")
METHODS = ("auto", "probit", "mc", "closed_form", "sample")


class MixtureOfLaplace(MixturePredictor):
    """MoLA: one Laplace approximation per trained network, combined as a mixture (eq. 7).

    Args:
        nets: ``K >= 1`` trained networks (MAP estimates, e.g. `train_ensemble(...).nets`); their
            current weights are the shifts ``ŵ^(k)``.
        likelihood: one `Likelihood` or a list of ``K``.
        subset: which weights get a Laplace approximation: ``"last_layer"`` (LLLA, every
            parameter of the last module that has parameters), a function ``net -> Subspace``
            (any builder, e.g. ``lambda n: subspaces.subnetwork(n, 200, "magnitude")``), or a
            list of ``K`` `Subspace` s.
        weights: ``"uniform"`` (``π^(k) = 1/K``), ``"evidence"`` (``π^(k) ∝`` the member's
            Laplace marginal likelihood, set by `fit`; the paper's E.1 experiment), or ``K``
            non-negative numbers (normalised).
        prior_precision: ``λ > 0`` of the Gaussian weight prior, shared by the members (the
            paper's choice). With weight decay ``wd`` on the mean loss of ``N`` points, the
            training prior is ``λ = N·wd``; post-hoc tuning: `optimize_prior_precision`.
        prior_mean: ``"zero"`` (the prior ``N(0, λ⁻¹ I)`` on the weights themselves, whose MAP
            the networks are, so ``μ^(k) = ŵ^(k)``) or ``"shift"`` (centred at ``ŵ^(k)``); see
            `AutoSubspaceLaplace`.
        temperature: ``T`` of the likelihood (1: the ordinary posterior).
        chunk_size: rows of data per Jacobian block.
        hessian_structure: each member's posterior (`AutoSubspaceLaplace`): ``"kron"`` is the
            paper's K-FAC (App. B.2, Algorithm 1), ``"full"`` the exact last-layer GGN,
            ``"auto"`` (default) ``"full"`` while its ``(K, K)`` buffers fit
            `posteriors.AUTO_BUDGET_BYTES` (a last layer of ``K ≤ 2896`` weights) and
            ``"kron"`` above (``members[k][1].structure_choice`` says which and why); also
            ``"diag"``, ``"lowrank"``.
        structure_options: the structure's options (`posteriors.OPTIONS`).

    After `fit`: ``members`` (list of ``(SubspaceNet, AutoSubspaceLaplace)``), ``weights``
    ``(K,)`` float64, ``log_evidences`` ``(K,)``.

    Example:
        >>> x, y = torch.randn(60, 3), torch.randint(0, 2, (60,))
        >>> def make_net():
        ...     return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> ens = train_ensemble(make_net, Categorical(), x, y, n_members=2, epochs=5,
        ...                      progress=False)
        >>> mola = MixtureOfLaplace(ens.nets, Categorical(), prior_precision=1.0).fit(x, y)
        >>> probs = mola.predict(x[:4])                  # mixture probit, eq. (1)
        >>> probs_mc = mola.predict(x[:4], method="mc", num_samples=100)
    """

    def __init__(
        self,
        nets: Sequence[nn.Module],
        likelihood: Likelihood | Sequence[Likelihood],
        subset: str | Callable[[nn.Module], Subspace] | Sequence[Subspace] = "last_layer",
        weights: str | Sequence[float] | torch.Tensor = "uniform",
        prior_precision: float = 1.0,
        prior_mean: str = "zero",
        temperature: float = 1.0,
        chunk_size: int = 1024,
        hessian_structure: str = "auto",
        structure_options: dict | None = None,
    ) -> None:
        self.nets = _check_nets(nets)
        self._out_width = output_width(self.nets, "nets")  # one output space
        k = len(self.nets)
        self.likelihoods = _check_likelihoods(likelihood, k)
        self.likelihood = self.likelihoods[0]
        if isinstance(subset, str):
            if subset != "last_layer":
                raise ValueError(
                    f"subset: expected 'last_layer', a function net -> Subspace or a list of "
                    f"{k} Subspaces, got {subset!r}"
                )
        elif not callable(subset):
            subs = list(subset) if isinstance(subset, Sequence) else None
            if subs is None or len(subs) != k or not all(isinstance(s, Subspace) for s in subs):
                raise ValueError(f"subset: expected a list of {k} Subspaces, got {subset!r}")
        if isinstance(weights, str):
            if weights not in WEIGHTS:
                raise ValueError(
                    f"weights: expected one of {WEIGHTS} or K numbers, got {weights!r}"
                )
            fixed = None
        else:
            fixed = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
            if fixed.numel() != k or not bool(torch.isfinite(fixed).all()):
                raise ValueError(f"weights: expected {k} finite numbers, got {weights!r}")
            if bool((fixed < 0).any()) or not float(fixed.sum()) > 0:
                raise ValueError(
                    f"weights: expected non-negative weights with a positive sum, got {weights!r}"
                )
        prior_precision = float(validation.prior_precision(prior_precision, 1))
        if prior_mean not in ("zero", "shift"):
            raise ValueError(f"prior_mean: expected 'zero' or 'shift', got {prior_mean!r}")
        check_temperature(temperature), validation.positive_int(chunk_size, "chunk_size")
        check_structure(hessian_structure, None, structure_options)
        self.hessian_structure, self.structure_options = hessian_structure, structure_options
        self.subset = subset
        self.weight_rule = "fixed" if fixed is not None else weights
        self.weights = (
            fixed / fixed.sum()
            if fixed is not None
            else torch.full((k,), 1.0 / k, dtype=torch.float64)
        )
        #: the ``λ`` shared by the members (constructor, grid methods); ``None`` after
        #: ``optimize_prior_precision("marglik")``, which gives each its own
        #: (`member_prior_precisions`)
        self.prior_precision: float | None = float(prior_precision)
        self._initial_prior_precision = self.prior_precision
        self.prior_mean = prior_mean
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.members: list[tuple[SubspaceNet, AutoSubspaceLaplace]] = []
        self.log_evidences: torch.Tensor | None = None

    @classmethod
    def from_adapters(
        cls, net: nn.Module, adapters: Sequence[torch.Tensor], likelihood: Likelihood, **kwargs: object
    ) -> MixtureOfLaplace:
        """MoLA over ``K`` adapters of one network (LoRA seeds on one frozen base): member
        ``k``'s Laplace is over all the trainable weights (the adapter and any trainable head)
        at ``adapters[k]``, its flat trainable weights ``(D,)`` (``FlatNet(net).vector()``
        after training seed ``k``). The network is shared: ``K`` members cost ``K`` adapters,
        not ``K`` models (each member's curvature and predictions load its adapter into the
        network and put the network's weights back). ``kwargs``: the constructor's (not
        ``subset``)."""
        if "subset" in kwargs:
            raise TypeError("subset: from_adapters puts each member on all the trainable weights; leave it out")
        flat = FlatNet(net)
        if isinstance(adapters, torch.Tensor) or not isinstance(adapters, Sequence) or not adapters:
            raise TypeError("adapters: expected a non-empty list of flat trainable weight vectors (D,)")
        for i, w in enumerate(adapters):
            flat.check_weights(w, f"adapters[{i}]", batched=False)
        index = torch.arange(flat.num_weights)
        subs = [IndexSubspace(w.detach().to(flat.vector()), index.to(w.device)) for w in adapters]
        return cls([net] * len(adapters), likelihood, subset=subs, **kwargs)

    # ------------------------------------------------------------------ fitting

    def _subspace(self, i: int, net: nn.Module) -> Subspace:
        if self.subset == "last_layer":
            return subnetwork(net, strategy="last_layer")
        if callable(self.subset):
            sub = self.subset(net)
            if not isinstance(sub, Subspace):
                raise TypeError(
                    f"subset: the function returned {type(sub).__name__}, not a Subspace"
                )
            return sub
        return self.subset[i]

    def fit(
        self,
        x: torch.Tensor | TorchDataset | DataLoader,
        y: torch.Tensor | None = None,
        find_map: bool = False,
    ) -> MixtureOfLaplace:
        """Fit the ``K`` Laplace approximations (GGN at each network's weights); returns ``self``.

        Args:
            x: training inputs ``(N, ...)``, a `datasets.Dataset` (its training split), or a
                ``torch.utils.data.Dataset``/``DataLoader`` of ``(x, y)`` pairs (streamed).
            y: targets ``(N,)`` (omitted with a Dataset or DataLoader).
            find_map: refine each member's mode in its subspace by Gauss–Newton first
                (`AutoSubspaceLaplace.fit`); ``False`` keeps ``μ^(k) = ŵ^(k)``, right when the
                networks were trained to the MAP of the same prior (weight decay ``λ/N``).
        """
        if hasattr(x, "x_train") and hasattr(x, "y_train"):  # a datasets.Dataset
            if y is not None:
                raise ValueError("y: give either a Dataset or (x, y), not both")
            x, y = x.x_train, x.y_train
        if isinstance(x, (TorchDataset, DataLoader)):  # streamed (x, y) pairs
            if y is not None:
                raise ValueError("y: give either a Dataset/DataLoader or (x, y), not both")
        elif y is None:
            raise ValueError("y: the training targets are required with tensor inputs")
        else:
            for net, lik in zip(self.nets, self.likelihoods):  # every member, before any work
                validation.check_data(net, x, y, lik, require_y=True)
        # all or nothing: the new members are built aside and swapped in at the end, so an
        # interrupted or failed refit leaves the mixture as it was (never part-fitted)
        members = []
        # after "marglik": a refit starts from the shared λ
        lam = self._initial_prior_precision if self.prior_precision is None else self.prior_precision
        for i, (net, lik) in enumerate(zip(self.nets, self.likelihoods)):
            sub = self._subspace(i, net)
            model = SubspaceNet(
                net, sub, lik, prior_scale=1.0,
                temperature=self.temperature, prior_mean=self.prior_mean,
            )  # fmt: skip
            model.set_prior_precision(lam)
            # float64 posteriors: last layers are small (no speed to gain from float32), and
            # the evidence weights and the far-away bound (mola_bound) use their extremes
            guide = AutoSubspaceLaplace(
                model, chunk_size=self.chunk_size, dtype=torch.float64,
                hessian_structure=self.hessian_structure, structure_options=self.structure_options,
            )  # fmt: skip
            guide.fit(x, y, find_map=find_map)
            members.append((model, guide))
        log_evidences, weights = self._weights_of(members)
        self.members, self.prior_precision = members, lam
        self.log_evidences, self.weights = log_evidences, weights
        return self

    @property
    def member_prior_precisions(self) -> torch.Tensor:
        """Each fitted member's ``λ`` ``(M,)``, float64 (equal unless tuned by ``"marglik"``)."""
        self._check_fitted()
        return torch.stack([g.prior_precision.double().mean().cpu() for _, g in self.members])

    def _weights_of(self, members: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The members' log evidences ``(M,)`` and the mixture weights they give."""
        log_evidences = torch.stack(
            [guide.log_marginal_likelihood().detach() for _, guide in members]
        ).double()
        weights = self.weights
        if self.weight_rule == "evidence":  # uniform prior over members: eq. (13) of E.1
            weights = torch.softmax(log_evidences, 0)
        return log_evidences, weights

    def _update_weights(self) -> None:
        self.log_evidences, self.weights = self._weights_of(self.members)

    def _check_fitted(self) -> None:
        if not self.members:
            raise RuntimeError(f"{type(self).__name__}: call fit(x, y) first")

    def optimize_prior_precision(
        self,
        method: str = "grid",
        x_val: torch.Tensor | None = None,
        y_val: torch.Tensor | None = None,
        grid: torch.Tensor | None = None,
        threshold: float | None = None,
        margin: float | None = None,
    ) -> MixtureOfLaplace:
        """Tune the prior precision after fitting (MoLA B.2, "post-hoc tuning"); returns ``self``.

        One ``λ`` shared by all members (the paper's assumption) for the grid methods; the grid
        (default ``10^-4 … 10^4``, 33 values) is searched with the Jacobians of the validation
        inputs computed once per member, each ``λ`` costing ``K`` small inverses.

        - ``"grid"``: the ``λ`` maximising the mixture's probit (regression: mixture-density)
          log-likelihood of ``(x_val, y_val)``.
        - ``"confidence"`` (classification; the paper's Appendix F): the *smallest* ``λ`` whose
          mean validation confidence (MMC) reaches ``threshold``, by default "slightly below
          the accuracy of MAP": the validation accuracy of the members' deep ensemble minus
          ``margin``. If no ``λ`` reaches it, the largest.
        - ``"marglik"``: each member maximises its own Laplace evidence
          (`AutoSubspaceLaplace.optimize_prior_precision`), so the ``λ`` differ.

        ``margin`` defaults to ``0.01``. A keyword the method does not use (validation data
        for ``"marglik"``, ``threshold``/``margin`` outside ``"confidence"``) is a
        ``TypeError``. All or nothing: an interrupted tuning leaves every member as it was.

        Evidence-based mixture weights are recomputed afterwards. After a grid method,
        ``grid_scores`` ``(G, 2)`` holds the validation log-likelihood and MMC of each ``λ``.
        """
        given = {"x_val": x_val, "y_val": y_val, "grid": grid, "threshold": threshold, "margin": margin}
        unused = {"marglik": set(given), "grid": {"threshold", "margin"}, "confidence": set()}
        for name in sorted(unused.get(method, ())):
            if given[name] is not None:  # nothing accepted and then ignored
                raise TypeError(f"{name}: not used by method={method!r}; leave it out")
        margin = 0.01 if margin is None else margin
        self._check_fitted()
        members = [m for pair in self.members for m in pair]
        with transaction(self, *members):  # all or nothing, the members' λ and Σ included
            return self._optimize_prior_precision(method, x_val, y_val, grid, threshold, margin)

    def _optimize_prior_precision(self, method, x_val, y_val, grid, threshold, margin):
        if method == "marglik":
            for _, guide in self.members:
                guide.optimize_prior_precision("marglik")
            self.prior_precision = None  # no longer shared: `member_prior_precisions`
            self._update_weights()
            return self
        if method not in ("grid", "confidence"):
            raise ValueError(f"method: expected 'grid', 'confidence' or 'marglik', got {method!r}")
        if x_val is None or y_val is None:
            raise ValueError(f"x_val, y_val: the {method!r} method needs validation data")
        check_inputs(x_val, "x_val", nets=self.nets)
        y_val = self.check_targets(x_val, y_val, "x_val", "y_val")  # labels: before any work
        grid = check_grid(grid)
        lik = self.likelihood
        if method == "confidence":
            if "probit" not in lik.link_approxes:  # the rule reads the probit's confidence
                raise ValueError("method: 'confidence' is for classification")
            if threshold is None:
                outs = [model.outputs(guide.loc, x_val).detach() for model, guide in self.members]
                comp = member_predictives(self.likelihoods, outs)
                ens = lik.mixture(self.weights.to(x_val.device), comp)
                hits = lik.predicted_class(ens) == y_val.reshape(-1).to(ens.probs.device).long()
                threshold = float(hits.double().mean()) - margin
            grid = grid.sort().values
        scores = self._grid_scores(x_val, y_val, grid)
        best = select_on_grid(grid, scores, threshold if method == "confidence" else None)
        if method == "confidence":
            self.confidence_threshold = float(threshold)
        for _, guide in self.members:  # the model's prior and Σ
            guide.set_prior_precision(best)
        self.prior_precision = float(best)
        self.grid_scores = scores
        self._update_weights()
        return self

    def _grid_scores(self, x: torch.Tensor, y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """Validation log-likelihood and MMC (classification; else NaN) per ``λ``, ``(G, 2)``:
        the one grid scorer (`tuning.grid_scores`) on the members' linearised outputs, each
        from one eigendecomposition for the whole grid (`tuning.grid_covariances`)."""
        members = []
        for model, guide in self.members:
            f_mean, f_cov = grid_covariances(guide, x, self.chunk_size)
            members.append((model.likelihood, f_mean, f_cov))
        weights = self.weights.to(members[0][1].device)  # the members' device
        return grid_scores(members, weights, self.likelihood, y, grid)

    # ------------------------------------------------------------------ prediction

    def components(
        self,
        x: torch.Tensor,
        method: str = "auto",
        num_samples: int = 1000,
        seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """Mixture weights and per-component predictives (`MixturePredictor`).

        Args:
            x: inputs ``(N, ...)``.
            method: ``"probit"`` (classification default): eq. (6) per member, ``K``
                components; ``"closed_form"`` (regression default): each member's linearised
                Gaussian ``N(m^(k), C^(k) + σ²)``, ``K`` components; ``"mc"``
                (classification): per member the average of ``softmax(f)`` over
                ``num_samples`` draws ``f ~ N(m^(k), C^(k))``, ``K`` components;
                ``"sample"``: ``num_samples`` weight draws per member pushed through the
                network (eq. 4, no linearisation), ``K·S`` components of weight ``π^(k)/S``.
            num_samples, seed: Monte Carlo draws (member ``k`` uses ``seed + k``).

        Returns:
            ``(weights, comp)`` as in the module docstring of `ensembles`.
        """
        self._check_fitted()
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        check_inputs(x, nets=self.nets)
        lik = self.likelihood
        if method == "auto":
            method = lik.link_approxes[0]  # closed_form (regression), probit (classification)
        usable = tuple(m for m in METHODS if m in lik.link_approxes) + ("sample",)
        if method not in usable:
            raise ValueError(
                f"method: a {type(lik).__name__} likelihood uses {usable}, got {method!r}"
            )
        if method == "sample":
            outs, weights = [], []
            for k, (model, guide) in enumerate(self.members):
                w = guide.sample_weights(num_samples, seed=seed + k)
                with torch.no_grad(), eval_mode(model.flat.net):
                    out = model.flat(w.to(model.subspace.shift), x)
                outs.append(out)
                weights.append(self.weights[k].expand(num_samples) / num_samples)
            return torch.cat(weights).to(batching.device_of(x)), member_predictives(self.likelihoods, outs)
        comps = []
        for k, (model, guide) in enumerate(self.members):
            f_mean, f_cov = self._moments(k, x, diagonal=method != "mc")
            if method == "mc":
                gen = torch.Generator(device=f_mean.device).manual_seed(seed + k)
                dist = model.likelihood.predictive_from_moments(
                    f_mean, f_cov, "mc", num_samples, gen
                )
                comps.append(model.likelihood.component(dist))
            else:
                comps.append(_from_moments(model.likelihood, f_mean, f_cov))
        return self.weights.to(batching.device_of(x)), self.likelihood.stack_components(comps)

    def logit_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output mixture of eq. (8): means ``(K, N, O)`` and covariances ``(K, N, O, O)``."""
        self._check_fitted()
        check_inputs(x, nets=self.nets)
        moments = [self._moments(k, x) for k in range(len(self.members))]
        return torch.stack([m for m, _ in moments]), torch.stack([c for _, c in moments])

    def _moments(
        self, k: int, x: torch.Tensor, diagonal: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Member ``k``'s Gaussian over the outputs, ``(N, O)`` and ``(N, O, O)``, float64
        (`linearized_moments`: for the last layer from the penultimate features in one forward
        pass, MoLA A.2). ``diagonal=True`` may fill only the variances ``C_cc``."""
        _, guide = self.members[k]
        return linearized_moments(guide, x, diagonal=diagonal)


class LastLayerLaplace(MixtureOfLaplace):
    """The last-layer Laplace approximation (LLLA; Kristiadi et al., 2020; MoLA A.2) of one network.

    Exactly `MixtureOfLaplace` with ``K = 1``: ``N(vec(W_MAP), (H_W + λI)⁻¹)`` over the last
    layer, the probit predictive of eq. (6). Same arguments (``subset`` etc.) with one ``net``.
    """

    def __init__(self, net: nn.Module, likelihood: Likelihood, **kwargs: object) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        super().__init__([net], likelihood, **kwargs)


def _from_moments(lik: Likelihood, f_mean: torch.Tensor, f_cov: torch.Tensor):
    """One component's predictive from its Gaussian outputs ``(N, O)``, ``(N, O, O)``, in the
    form `Likelihood.mixture` takes (`Likelihood.component`)."""
    return lik.component(lik.predictive_from_moments(f_mean, f_cov, "auto"))
