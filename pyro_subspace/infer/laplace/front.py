"""laplace-torch-shaped entry points: `Laplace(net, likelihood, subset_of_weights=...,
hessian_structure=...)` and the mean-field `DiagonalLaplace`.

Both return a `NetLaplace`: an object with laplace-torch's names and semantics (``la(x)``
predicts, ``la.fit(train_loader)``, ``la.log_marginal_likelihood(λ, σ)``, ...) that holds the
Pyro guide, an `AutoSubspaceLaplace` on a `SubspaceNet` of the network with the weight prior
``w ~ N(0, λ⁻¹ I)`` (``prior_mean="zero"``, what weight decay trains), as ``la.guide``: so
``fit`` finds ``t* = 0`` when the net is that MAP, and
``Predictive(la.model, guide=la.guide)`` works as in plain Pyro.

laplace-torch's own vocabulary (its likelihood names and enum members, ``backend=`` classes and
their keywords, ``FunctionalLaplace``'s and ``SubnetLaplace``'s keywords, its argument
defaults and shapes) is translated by `laplace_torch`, which both use.
"""

from __future__ import annotations

import math
import warnings

import torch
from pyro.poutine.runtime import am_i_wrapped
from torch import nn

from ... import batch as batching
from ... import validation as ck
from ...data import DICT_KEY_X, DICT_KEY_Y, keyed
from ...flat import FlatNet, flat_parameters
from ...linalg import gaussian_draws
from ...likelihoods import Gaussian, Likelihood, check_likelihood, check_temperature
from ...nn import SubspaceNet
from ...subspaces import IndexSubspace, LastLayerSubspace, Subspace, subnetwork
from ...subspaces.feature_reduction import check_reduction
from ...transaction import transaction
from .guide import AutoSubspaceLaplace
from .laplace_torch import (
    LT_DEFAULT,
    _LT_KEYWORDS,
    _as_scalar,
    _backend_options,
    _check_prediction_keywords,
    _describe,
    _door_likelihood,
    _gp_options,
    _subnetwork_indices,
    _to_net_dtype,
    enum_value,
)
from .predictive import differentiable_moments, joint_moments, linearized_moments, linearized_variances
from .posteriors import check_structure
from .tuning import optimize_prior_precision

SUBSETS = ("all", "last_layer", "subnetwork")
#: `subspaces.subnetwork` keywords that `Laplace` passes on (it sets ``likelihood`` and
#: ``prior_precision`` itself)
SELECTION_KEYWORDS = ("x", "collector", "names", "indices", "seed")


def all_weights(net: nn.Module) -> IndexSubspace:
    """The subspace of every weight that requires grad: ``P = I_D`` as indices ``0 … D−1`` of
    the flat vector (which holds the trainable weights only, `flat.flat_parameters`), shift
    the current weights (never a dense ``(D, D)`` matrix)."""
    w = FlatNet(net).vector()  # a ValueError naming requires_grad when everything is frozen
    return IndexSubspace(w, torch.arange(w.numel(), device=w.device))


def Laplace(
    net: nn.Module,
    likelihood: Likelihood | str,
    subset_of_weights: str | torch.Tensor | Subspace = "last_layer",
    hessian_structure: str | None = None,
    prior_precision: float = 1.0,
    temperature: float = 1.0,
    n_params: int | None = None,
    strategy: str | None = None,
    chunk_size: int = 1024,
    rank: int | None = None,
    rescale_prior: bool | None = None,
    damping: bool = False,
    structure_options: dict | None = None,
    sigma_noise: float | None = None,
    backend: type | None = None,
    backend_kwargs: dict | None = None,
    asdl_fisher_kwargs: dict | None = None,
    dict_key_x: str = DICT_KEY_X,
    dict_key_y: str = DICT_KEY_Y,
    enable_backprop: bool = False,
    feature_reduction: str | None = None,
    **strategy_kwargs: object,
) -> NetLaplace:
    """A linearised Laplace approximation of ``net`` at its current weights (the MAP).

    Args:
        net: the trained network.
        likelihood: `Gaussian`, `Categorical`, `Bernoulli` (or your own `Likelihood`), or
            laplace-torch's names (its ``Likelihood`` enum members are taken by value):
            ``"classification"`` (`Categorical`), ``"regression"`` (`Gaussian` with
            ``sigma_noise``, default 1) and ``"reward_modeling"``: a Bradley–Terry reward
            model, fitted as classification over the pairs' ``(B, 2)`` scores and predicting
            as regression (``la(x)`` returns the scores' ``(f_mu, f_var)``), as laplace-torch
            0.3 does.
        sigma_noise: laplace-torch's ``sigma_noise`` at construction: the Gaussian
            likelihood's ``σ`` (only for regression).
        backend: a laplace-torch curvature backend class, read by its name (laplace-torch is
            not imported): its GGN backends (``CurvlinopsGGN``, ``BackPackGGN``, ``AsdlGGN``)
            all mean the exact GGN here (full, diag, low rank; ``J`` by autodiff), and for
            ``"kron"`` their ``Conv2d`` convention: ``CurvlinopsGGN`` and ``AsdlGGN``
            ``conv="expand"``, ``BackPackGGN`` ``conv="backpack"`` (`curvature.kfac`); an
            empirical-Fisher (``*EF``) or Hessian backend is refused, saying so.
        backend_kwargs: laplace-torch's; ``{"stochastic": True}`` is the Monte Carlo Fisher
            of ``"kron"`` (``structure_options={"fisher": "mc"}``); nothing else is accepted.
        asdl_fisher_kwargs: laplace-torch's; ``{"kfac_approx": "expand" | "reduce"}`` is
            ``"kron"``'s ``conv``.
        dict_key_x, dict_key_y: laplace-torch's keys of a loader's dict batches: the targets
            are ``batch[dict_key_y]`` and the inputs every other entry (passed to the network
            by `batch`'s rule); ``dict_key_x`` names the entry whose rows laplace-torch counts
            (here any entry's: they share their first dimension).
        feature_reduction: laplace-torch's, only with ``"last_layer"``: a last layer that sees
            a sequence ``(N, T, P)`` per data point (a transformer's head) gets the closed-form
            Jacobian from one feature row per point: ``"pick_first"``, ``"pick_last"``,
            ``"average"`` as laplace-torch 0.3 defines them (blind to the attention mask: its
            numbers), or ``"pick_last_token"``/``"masked_average"``, which read
            ``x["attention_mask"]`` so that padding never changes a row's prediction
            (`subspaces.feature_reduction`, `LastLayerSubspace`). ``None``: the network's
            exact Jacobian.
        enable_backprop: laplace-torch's: the GLM predictive's moments (and ``la(x)``,
            `functional_samples`) differentiable in the inputs, for Bayesian optimisation
            (`predictive.differentiable_moments`: ``J`` by ``torch.func``, the dense ``Σ``).
        subset_of_weights: ``"last_layer"`` (`LastLayerSubspace` for a final ``nn.Linear``),
            ``"all"`` (every weight that requires grad: frozen parameters keep their values,
            as in laplace-torch), ``"subnetwork"`` (``n_params`` weights chosen by
            `subspaces.subnetwork` with ``strategy`` and ``strategy_kwargs``), a 1-D tensor of
            flat indices, or any `Subspace`.
        hessian_structure: ``"full"``, ``"diag"``, ``"lowrank"`` (the top-``rank`` GGN
            eigenpairs by Lanczos plus the prior ``λ I`` as the isotropic remainder) or
            ``"kron"`` (K-FAC, for ``"last_layer"``, ``"all"`` and any subset made of whole
            parameter tensors, `posteriors.KronPosterior`). ``None``: laplace-torch's defaults,
            ``"kron"`` for ``"last_layer"`` and ``"all"``, ``"full"`` for a subnetwork, flat
            indices or a `Subspace` (Subnetwork Inference's method; laplace-torch's
            ``SubnetLaplace`` has no K-FAC). ``la.hessian_structure`` says which.
            ``"gp"`` (``"all"`` or ``"last_layer"`` only): the GP view on a subset of the data,
            laplace-torch's ``FunctionalLaplace``/``FunctionalLLLaplace`` (Immer et al. 2021,
            `posteriors.FunctionalPosterior`), with its keywords ``n_subset`` (``M``, default
            all ``N`` points), ``independent_outputs`` (default ``False``) and ``seed`` (of the
            subset, default 0: the same subset as laplace-torch's for the same seed); it
            predicts with ``pred_type="gp"`` (or ``"glm"``, the same predictive).
        n_params: ``K``, how many weights ``"subnetwork"`` selects (required there; an error
            with any other ``subset_of_weights``). laplace-torch's ``subnetwork_indices=``
            (flat indices, e.g. from its ``SubnetMask.select()``) with ``"subnetwork"`` gives
            the subnetwork itself: the same as passing the indices as ``subset_of_weights``.
        strategy: `subspaces.subnetwork`'s selection, only with ``"subnetwork"``:
            ``"magnitude"`` (default: needs no data), ``"diag_laplace"`` (Subnetwork Inference eq. 23: the
            largest marginal variances ``1 / (diag(G) + λ)`` under a diagonal Laplace with
            this ``likelihood`` and ``prior_precision``; pass the training inputs ``x=``),
            ``"random"``, ... (`subspaces.subnetwork`).
        strategy_kwargs: `subspaces.subnetwork`'s other keywords (`SELECTION_KEYWORDS`), only
            with ``"subnetwork"``; any other keyword is a ``TypeError`` (laplace-torch's
            ``prior_mean``, ``temperature_scaling`` say what to do instead).
        chunk_size: rows per Jacobian block of the fit.
        rank: ``k`` of ``"lowrank"``, ``1 <= k <= K`` (default ``min(K, 10)``); an error with
            another structure.
        prior_precision: ``λ`` of the weight prior ``N(0, λ⁻¹ I)``.
        rescale_prior: give the ``K`` weights the precision ``λ_S = λ·K/D`` (Subnetwork
            Inference, section 4 after eq. 15 and appendix C: the prior of a ``K``-weight
            subnetwork); default ``True`` for ``"subnetwork"`` (the paper's method) and
            ``False`` otherwise (laplace-torch's convention, also for flat indices). A later
            ``optimize_prior_precision`` tunes the precision in use.
        temperature: ``T`` of the likelihood.
        damping: laplace-torch's ``KronLaplace`` keyword: ``False`` only (laplace-torch 0.3
            drops ``damping=True`` when it forms the posterior precision, so a ported script
            meant the undamped posterior; ``True`` raises saying so). Ritter et al.'s damped
            factors are ``structure_options={"damping": "ritter"}``.
        structure_options: the structure's options (`posteriors.OPTIONS`; for ``"kron"``:
            ``fisher`` ``"type-2"``/``"mc"``, ``conv`` ``"expand"``/``"reduce"``/``"backpack"``,
            ``bias`` ``"separate"``/``"augment"``, `posteriors.KronPosterior`).

    Returns:
        An unfitted `NetLaplace` (an `AutoSubspaceLaplace` whose ``fit`` takes the network's
        weights as the MAP, as laplace-torch does): call ``.fit(x, y)`` (or a Dataset / DataLoader),
        then ``.optimize_prior_precision("marglik" | "grid", ...)`` and
        ``.predict(x, link_approx="probit" | "mc")``.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    floats = [p.dtype for p in net.parameters() if p.is_floating_point()]
    dtype = floats[0] if floats else torch.get_default_dtype()
    likelihood, reward_modeling = _door_likelihood(likelihood, sigma_noise, dtype)
    prior_precision = float(ck.prior_precision(prior_precision, 1))
    check_temperature(temperature)
    if hessian_structure is None:  # laplace-torch's default where K-FAC applies
        whole = isinstance(subset_of_weights, str) and subset_of_weights in ("last_layer", "all")
        hessian_structure = "kron" if whole else "full"
    ck.choice(damping, "damping", (True, False))
    if damping:  # never accepted and then ignored, nor silently a different posterior
        raise ValueError(
            "damping: laplace-torch 0.3's KronLaplace(damping=True) keeps the undamped posterior "
            "(KronDecomposed.__mul__ drops the flag when the Hessian factor is applied), so its "
            "scripts get hessian_structure='kron' without damping here too; for Ritter et al.'s "
            "damped factors pass structure_options={'damping': 'ritter'}"
        )
    structure_options = _gp_options(
        hessian_structure, subset_of_weights, structure_options, strategy_kwargs
    )
    structure_options = _backend_options(
        backend, backend_kwargs, asdl_fisher_kwargs, hessian_structure, structure_options
    )
    check_structure(hessian_structure, rank, structure_options)
    ck.positive_int(chunk_size, "chunk_size")
    selected = isinstance(subset_of_weights, str) and subset_of_weights == "subnetwork"
    if "subnetwork_indices" in strategy_kwargs:  # laplace-torch's SubnetLaplace: flat indices
        subset_of_weights, selected = _subnetwork_indices(
            subset_of_weights, strategy_kwargs.pop("subnetwork_indices"), n_params, strategy
        )
    if rescale_prior is not None:
        ck.choice(rescale_prior, "rescale_prior", (True, False))
    for name, value in (("n_params", n_params), ("strategy", strategy)):
        if value is not None and not selected:  # nothing is accepted and then ignored
            raise TypeError(
                f"{name}: only used with subset_of_weights='subnetwork' (got "
                f"subset_of_weights={_describe(subset_of_weights)}); leave it out, or select a "
                "subnetwork"
            )
    strategy = "magnitude" if strategy is None else strategy
    if check_reduction(feature_reduction) is not None and not (
        isinstance(subset_of_weights, str) and subset_of_weights == "last_layer"
    ):  # laplace-torch's other Laplace classes refuse it too
        raise TypeError(
            f"feature_reduction: only used with subset_of_weights='last_layer' (got "
            f"{_describe(subset_of_weights)}); leave it out"
        )
    for name in strategy_kwargs:  # nothing is accepted and then ignored
        if name in _LT_KEYWORDS:
            raise TypeError(f"{name}: not an argument of Laplace here: {_LT_KEYWORDS[name]}")
        if not selected or name not in SELECTION_KEYWORDS:
            raise TypeError(
                f"{name}: unexpected keyword; besides its own arguments Laplace takes only "
                f"subspaces.subnetwork's {SELECTION_KEYWORDS}, with subset_of_weights='subnetwork'"
            )
    if isinstance(subset_of_weights, Subspace):
        sub = subset_of_weights
    elif isinstance(subset_of_weights, torch.Tensor):
        if subset_of_weights.is_floating_point() or subset_of_weights.is_complex():
            raise TypeError(
                f"subset_of_weights: a tensor here is flat indices of the weights, an integer "
                f"tensor (K,); got dtype {subset_of_weights.dtype} (call .long() on indices; a "
                "dense basis is a Subspace: subspaces.Subspace(shift, basis))"
            )
        if subset_of_weights.dim() != 1:
            raise ValueError(
                f"subset_of_weights: flat indices must be 1-D (K,), got shape "
                f"{tuple(subset_of_weights.shape)}"
            )
        w = FlatNet(net).vector()
        sub = Subspace(w, subset_of_weights.to(w.device))
    elif subset_of_weights == "all":
        sub = all_weights(net)
    elif subset_of_weights == "last_layer" and feature_reduction is not None:
        sub = LastLayerSubspace(net, feature_reduction=feature_reduction)
    elif subset_of_weights == "last_layer":
        sub = subnetwork(net, strategy="last_layer")
    elif subset_of_weights == "subnetwork":
        if n_params is None:
            raise ValueError(
                "n_params: subset_of_weights='subnetwork' needs n_params=K, how many weights "
                "to select (e.g. n_params=1000), or pass their flat indices as subset_of_weights"
            )
        kwargs = dict(strategy_kwargs)
        if strategy == "diag_laplace":  # the fit's own likelihood and λ score the weights
            if kwargs.get("x") is None:
                raise ValueError(
                    "x: strategy='diag_laplace' scores weights by the GGN diagonal on the "
                    "training inputs: pass them, Laplace(..., strategy='diag_laplace', x=x_train)"
                )
            kwargs.update(likelihood=likelihood, prior_precision=float(prior_precision))
        sub = subnetwork(net, n_params, strategy=strategy, **kwargs)
    else:
        raise ValueError(
            f"subset_of_weights: expected one of {SUBSETS}, flat indices or a Subspace, "
            f"got {subset_of_weights!r}"
        )
    model = SubspaceNet(
        net, sub, likelihood, prior_scale=1.0,
        temperature=check_temperature(temperature), prior_mean="zero",
    )  # fmt: skip
    if selected if rescale_prior is None else rescale_prior:  # λ_S = λ·K/D
        prior_precision = prior_precision * sub.rank / sub.dim
    model.set_prior_precision(prior_precision)
    guide = AutoSubspaceLaplace(
        model, hessian_structure=hessian_structure, chunk_size=chunk_size, rank=rank,
        structure_options=structure_options,
    )  # fmt: skip
    for name, key in (("dict_key_x", dict_key_x), ("dict_key_y", dict_key_y)):
        if not isinstance(key, str):
            raise TypeError(f"{name}: expected a str, got {type(key).__name__}")
    la = NetLaplace(guide, subset_of_weights, reward_modeling=reward_modeling)
    la.dict_key_y = dict_key_y
    la.enable_backprop = bool(ck.choice(enable_backprop, "enable_backprop", (True, False)))
    if sigma_noise is not None:
        la.sigma_noise = sigma_noise  # a Gaussian likelihood object given with sigma_noise too
    return la


class NetLaplace(nn.Module):
    """What `Laplace` returns: a laplace-torch-shaped Laplace approximation that holds the Pyro
    guide as ``la.guide``.

    laplace-torch's names behave as they do there (laplace-torch 0.3):

    - ``la.fit(x, y)`` / ``la.fit(train_loader)``: the GGN at the network's weights *now* (a
      checkpoint loaded after `Laplace` was built is the one fitted; the subset's indices are
      those chosen at construction);
    - ``la(x, pred_type="glm"|"nn", link_approx="probit"|"mc"|"bridge"|"bridge_norm",
      n_samples=100, diagonal_output=False, generator=None)``: regression
      ``(f_mu (N, O), f_var (N, O, O))`` (``(N, O)`` with ``diagonal_output`` or
      ``pred_type="nn"``), the function-space variance *without* ``σ²`` as in laplace-torch
      (add ``la.sigma_noise**2`` for the predictive); classification the probabilities
      ``(N, C)`` (MoLA eq. 6 for the probit, Hobbhahn et al. 2022 for the bridge);
    - ``la.predictive_samples(x, pred_type, n_samples, diagonal_output, generator)``:
      ``(S, N, O)`` draws of the outputs (classification: their softmax);
    - ``la.sample(n_samples, generator)``: weight draws ``(S, K)`` of the last layer for
      ``"last_layer"`` (laplace-torch's ``LLLaplace``), else ``(S, D)`` of all weights with the
      subset drawn and the rest at the MAP;
    - ``la.prior_precision`` and ``la.sigma_noise`` (settable; the model's prior and the
      Gaussian likelihood own them); ``la.log_marginal_likelihood(prior_precision,
      sigma_noise)`` evaluates the evidence at the given (differentiable) values and writes them
      back as laplace-torch does, lazily: ``Σ`` is re-formed once, at the next use, not on every
      call of a hyperparameter loop;
    - ``la.optimize_prior_precision(pred_type, method="marglik"|"gridsearch", ...)`` with
      laplace-torch 0.3's signature (`optimize_prior_precision`);
    - ``posterior_precision``, ``posterior_covariance``, ``posterior_variance``,
      ``n_params``, ``state_dict``.

    ``la.guide`` is the `AutoSubspaceLaplace` (a Pyro autoguide):
    ``Predictive(la.model, guide=la.guide)``. ``la.predict(x, link_approx=...)`` returns the
    linearised predictive as a ``torch.distributions`` object (with ``σ²`` for regression).
    The guide's fitted state and evidence (``loc``, ``covariance``, ``structure``,
    ``fitted``, ...) are readable here too (`GUIDE_ATTRIBUTES`).

    Args:
        guide: the unfitted guide over the model's subspace.
        subset: what `Laplace` was given as ``subset_of_weights`` (``"last_layer"`` changes
            what `sample` returns).
    """

    def __init__(
        self, guide: AutoSubspaceLaplace, subset: object = "all", reward_modeling: bool = False
    ) -> None:
        super().__init__()
        if not isinstance(guide, AutoSubspaceLaplace):
            raise TypeError(f"guide: expected an AutoSubspaceLaplace, got {type(guide).__name__}")
        self._modules["guide"] = guide
        self._modules["model"] = guide.model
        self.last_layer = isinstance(subset, str) and subset == "last_layer"
        #: laplace-torch's ``"reward_modeling"``: fitted as classification, predicts as regression
        self.reward_modeling = bool(reward_modeling)
        self.__dict__["_pending"] = {}  # hyperparameters written back lazily

    # ------------------------------------------------------------------ the guide

    @property
    def guide(self) -> AutoSubspaceLaplace:
        """The Pyro guide, with any hyperparameters written back by `log_marginal_likelihood`
        applied first."""
        self._flush()
        return self._modules["guide"]

    @property
    def laplace_guide(self) -> AutoSubspaceLaplace:
        """`guide` (the protocol by which `linearized_moments` and the tuners accept this
        object)."""
        return self.guide

    def __getattr__(self, name: str):
        if name in GUIDE_ATTRIBUTES:
            return getattr(self.guide, name)
        return super().__getattr__(name)

    def _flush(self) -> None:
        pending = self.__dict__.get("_pending")
        if not pending:
            return
        guide = self._modules["guide"]
        self.__dict__["_pending"] = {}
        if "sigma" in pending:
            guide.set_sigma(pending["sigma"])
        if "prior_precision" in pending:
            guide.set_prior_precision(pending["prior_precision"])

    def forward(
        self,
        x: torch.Tensor,
        pred_type: str = "glm",
        joint: bool = False,
        link_approx: str = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
    ):
        """laplace-torch's prediction (class docstring): ``(f_mu, f_var)`` for regression,
        probabilities ``(N, C)`` for classification."""
        if am_i_wrapped():  # Pyro's Predictive(model, guide=la) would sample the prior
            raise TypeError(
                "la: called inside a Pyro handler (Predictive, SVI): this object predicts; the "
                "Pyro guide is la.guide, e.g. Predictive(la.model, guide=la.guide)"
            )
        pred_type, link_approx = self._pred_type(pred_type), enum_value(link_approx)
        _check_prediction_keywords(pred_type, False, n_samples, diagonal_output, generator, fitting)
        lik, dtype = self.model.likelihood, self.model.subspace.shift.dtype
        regression = self.reward_modeling or lik.noise_scale_tunable or isinstance(lik, Gaussian)
        ck.choice(joint, "joint", (True, False))
        if joint:  # laplace-torch: the GP-form joint predictive, regression and glm only
            if not regression or pred_type != "glm":
                raise ValueError(
                    "joint: the joint predictive N([f(x_1), ...], Cov[f(x_1), ...]) is for "
                    "regression with pred_type='glm' (laplace-torch ignores it otherwise); "
                    "leave joint=False"
                )
            f_mu, f_cov = self._glm_moments(x, joint=True)
            return _to_net_dtype((f_mu, f_cov), dtype)
        if self.reward_modeling:  # fitted as classification, predicts the scores as regression
            regression = Gaussian()  # its glm and nn outputs: the moments, without σ²
            if pred_type == "nn":
                out = regression.sample_prediction(self._nn_samples(x, n_samples, generator))
            else:
                f_mu, f_var = self._glm_moments(x)
                out = regression.glm_prediction(f_mu, f_var, "auto", diagonal_output=diagonal_output)
            return _to_net_dtype(out, dtype)
        if pred_type == "nn":  # shape: (S, N, O)
            out = lik.sample_prediction(self._nn_samples(x, n_samples, generator))
        else:
            glm_link = link_approx if link_approx in lik.link_approxes else "auto"
            backprop = self.__dict__.get("enable_backprop", False)
            if glm_link == "probit" and batching.rows_or_none(x) and not backprop:
                # the variances alone ((N, C), never (N, C, C)), chunk by chunk: beside the
                # result, memory of one chunk's float64 moments (a 1000-class last layer on
                # 10,000 inputs: not five (N, C) float64 temporaries at once)
                parts = [
                    _to_net_dtype(
                        lik.glm_prediction(*linearized_variances(self.guide, xc), "probit"),
                        dtype,
                    )
                    for xc in batching.split(x, self.guide.chunk_size)
                ]
                return _cat_rows(parts)
            f_mu, f_var = self._glm_moments(x)
            out = lik.glm_prediction(
                f_mu, f_var, link_approx, n_samples, generator, diagonal_output
            )
        return _to_net_dtype(out, dtype)

    def predictive_samples(
        self,
        x: torch.Tensor,
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``(S, N, O)`` draws of the outputs from the linearised (``"glm"``) or the network's
        (``"nn"``: weights drawn, network run) predictive; classification: their softmax
        ``(S, N, C)``. ``diagonal_output``: glm draws with independent outputs."""
        samples = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator)
        if self.reward_modeling:  # predicts the scores as regression
            return samples
        out = self.model.likelihood.predictive_samples(samples.double())
        return _to_net_dtype(out, self.model.subspace.shift.dtype)

    def functional_samples(
        self,
        x: torch.Tensor,
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's ``functional_samples``: ``(S, N, O)`` draws of the network's outputs
        ``f`` (before any link), from the linearised predictive ``N(f(x), J Σ Jᵀ)`` per point
        (``"glm"``; ``diagonal_output``: independent outputs) or at weight draws ``ŵ + P t``
        (``"nn"``); for Thompson sampling or any expectation over ``f``."""
        pred_type = self._pred_type(pred_type)
        _check_prediction_keywords(pred_type, False, n_samples, diagonal_output, generator, False)
        if pred_type == "nn":
            samples = self._nn_samples(x, n_samples, generator)
        else:
            f_mu, f_var = self._glm_moments(x)
            if diagonal_output:
                f_var = torch.diag_embed(f_var.diagonal(dim1=-2, dim2=-1))
            samples = gaussian_draws(f_mu, f_var, n_samples, generator)
        return _to_net_dtype(samples, self.model.subspace.shift.dtype)

    def _pred_type(self, pred_type: object) -> object:
        """``pred_type`` by value; laplace-torch's ``"gp"`` (the only one of its
        ``FunctionalLaplace``) is the linearised predictive of ``hessian_structure="gp"``,
        ``"glm"`` here (the GP's predictive is the GLM's: `posteriors.FunctionalPosterior`)."""
        pred_type = enum_value(pred_type)
        if pred_type == "gp":
            structure = self._modules["guide"].hessian_structure
            if structure != "gp":
                raise ValueError(
                    f"pred_type: 'gp' is the predictive of hessian_structure='gp'; this Laplace "
                    f"has {structure!r}: pass 'glm' (the linearised predictive) or 'nn'"
                )
            return "glm"
        return pred_type

    def _glm_moments(self, x, joint: bool = False):
        """The linearised predictive's moments (`linearized_moments`, `joint_moments`), or
        with ``enable_backprop`` their differentiable form (`differentiable_moments`)."""
        if self.__dict__.get("enable_backprop", False):
            return differentiable_moments(self.guide, x, joint)
        return joint_moments(self.guide, x) if joint else linearized_moments(self.guide, x)

    def _nn_samples(self, x, n_samples: int, generator) -> torch.Tensor:
        """Outputs ``(S, N, O)`` of the network at ``S`` weight draws."""
        guide = self.guide
        self.model.check_data(x)
        t = guide.draw_latent(n_samples, generator).detach()
        # one batched evaluation of the S weight draws; with enable_backprop differentiable in
        # the inputs (laplace-torch's nn functional samples are)
        with torch.set_grad_enabled(self.__dict__.get("enable_backprop", False)):
            return self.model.outputs(t, x).double()

    # ------------------------------------------------------------------ fitting and tuning

    def fit(
        self,
        x: object,
        y: torch.Tensor | None = None,
        *,
        override: bool = True,
        progress_bar: bool = False,
        find_map: bool = False,
        **kwargs: object,
    ) -> NetLaplace:
        """`AutoSubspaceLaplace.fit` at the network's weights *now* (as laplace-torch reads
        them at ``fit``); ``x`` a tensor (with ``y``), a ``Dataset`` or laplace-torch's
        ``train_loader``. ``override=False`` (laplace-torch's incremental fit) is refused;
        ``progress_bar`` is accepted for compatibility (the fit shows none). ``find_map=True``
        searches the MAP of this posterior in the subset instead of keeping the weights. All or
        nothing: an interrupted or failed fit leaves the object as it was."""
        if override is not True:
            raise ValueError(
                "override: only override=True (a new fit); laplace-torch's incremental "
                "fit(override=False) is not supported: fit on all the data at once"
            )
        ck.choice(progress_bar, "progress_bar", (True, False))
        self._flush()
        x = keyed(x, self.__dict__.get("dict_key_y", DICT_KEY_Y))  # laplace-torch's dict_key_y
        self._fit_at_current_weights(x, y, find_map=find_map, **kwargs)
        return self

    def _fit_at_current_weights(self, x, y, **kwargs) -> None:
        guide, model = self._modules["guide"], self.model
        # one snapshot for the new shift and the fit together (the guide's own `fit` would
        # take a second one): an interrupted or failed fit leaves both as they were
        with transaction(guide, model, on_overflow=guide._mark_unfitted):
            w = FlatNet(model.net).vector().detach()
            shift = model.subspace.shift
            if w.shape != shift.shape:
                raise ValueError(
                    f"net: has {w.numel()} weights now but {shift.numel()} when Laplace was "
                    "built: build Laplace again for the new architecture"
                )
            if not torch.equal(w.to(shift), shift):
                model.subspace.shift.copy_(w)
                model.set_prior(model.prior_mean)  # t₀ = Pᵀ(0 − ŵ) follows the new shift
            AutoSubspaceLaplace.fit.__wrapped__(guide, x, y, **kwargs)  # inside this snapshot

    def optimize_prior_precision(
        self,
        pred_type: str = "glm",
        method: str = "marglik",
        n_steps: int | None = LT_DEFAULT,
        lr: float | None = LT_DEFAULT,
        init_prior_prec: float | torch.Tensor | None = LT_DEFAULT,
        prior_structure: str | None = None,
        val_loader: object = None,
        loss: object = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: str = "probit",
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
        **ours: object,
    ) -> NetLaplace:
        """Tune ``λ`` with laplace-torch 0.3's signature (``pred_type`` first, then ``method``;
        its ``PredType``/``TuningMethod``/``PriorStructure``/``LinkApprox`` members are taken by
        value), or our keywords (`tuning`). A first positional argument that names a tuning
        method (``"marglik"``, ``"gridsearch"``, ``"grid"``: this door's former order) is taken
        as ``method``, with a ``DeprecationWarning``, for one release.

        - ``method="marglik"``: the Laplace evidence by laplace-torch's schedule: ``λ`` set to
          ``init_prior_prec`` (default 1, as there: the current ``λ`` is not the start), then
          ``n_steps`` Adam steps of size ``lr`` on ``log λ`` (defaults 100 and 0.1), so a
          ported script gets laplace-torch's ``λ``. ``n_steps=None``: L-BFGS to convergence
          instead (from the current ``λ``, or ``init_prior_prec`` where given).
          ``prior_structure``: ``"scalar"`` (default), ``"layerwise"`` (one ``λ`` per parameter
          tensor of the subset) or ``"diag"`` (one per weight). ``pred_type``, ``link_approx``
          and ``n_samples`` are the grid's, unused here as in laplace-torch.
        - ``method="gridsearch"`` (or ``"grid"``): the ``λ`` on
          ``logspace(log_prior_prec_min, log_prior_prec_max, grid_size)`` (or ``grid=``) with
          the best validation log-likelihood of ``val_loader`` (or ``x_val``, ``y_val``), i.e.
          laplace-torch's default NLL loss, with the linearised predictive (``pred_type="glm"``;
          the probit for classification). One ``λ`` (``prior_structure="scalar"``).
        - ``init_prior_prec``: the starting ``λ`` (set before the search; unset, 1 for the
          Adam schedule and the current ``λ`` otherwise).
        - ``verbose`` prints the ``λ`` found; ``progress_bar`` is accepted (no bar is shown).

        A keyword the method cannot honour (a custom ``loss``, ``pred_type="nn"`` or a
        non-probit ``link_approx`` for the grid, a structured prior for the grid) is an error
        saying what to do.
        """
        pred_type, method = self._pred_type(pred_type), enum_value(method)
        link_approx, prior_structure = enum_value(link_approx), enum_value(prior_structure)
        if pred_type in ("marglik", "gridsearch", "grid"):  # the former order: method first
            warnings.warn(
                f"optimize_prior_precision({pred_type!r}): the first argument is pred_type, as "
                f"in laplace-torch; pass the tuning method by keyword, method={pred_type!r} "
                "(read as the method for now)",
                DeprecationWarning,
                stacklevel=2,
            )
            pred_type, method = "glm", pred_type
        ck.choice(verbose, "verbose", (True, False))
        ck.choice(progress_bar, "progress_bar", (True, False))
        ck.choice(pred_type, "pred_type", ("glm", "nn"))
        ck.positive_int(n_samples, "n_samples")
        structure = "scalar" if prior_structure is None else prior_structure
        ck.choice(structure, "prior_structure", ("scalar", "layerwise", "diag"))
        if method == "gridsearch":
            method = "grid"
        if method not in ("marglik", "grid"):
            raise ValueError(
                f"method: expected 'marglik' or 'gridsearch' (or 'grid'), got {method!r}"
            )
        if loss is not None:
            raise ValueError(
                "loss: the grid is scored by the validation log-likelihood (laplace-torch's "
                "default NLL); a custom loss is not supported: leave it out"
            )
        if method == "grid":
            if pred_type != "glm":
                raise ValueError(
                    "pred_type: the grid is scored with the linearised predictive ('glm'); "
                    "leave pred_type='glm'"
                )
            if link_approx not in ("probit", "auto", "closed_form"):
                raise ValueError(
                    f"link_approx: the grid is scored with the probit (regression: the closed "
                    f"form), got {link_approx!r}: leave link_approx='probit'"
                )
            if structure != "scalar":
                raise ValueError(
                    f"prior_structure: the grid search tunes one λ; for {structure!r} use "
                    "method='marglik'"
                )
            if (n_steps is not LT_DEFAULT and n_steps is not None) or (
                lr is not LT_DEFAULT and lr is not None
            ):
                raise TypeError("n_steps, lr: the evidence search's (method='marglik'); leave them out")
            if init_prior_prec is LT_DEFAULT:  # unused by the grid, as in laplace-torch
                init_prior_prec = None
            if val_loader is not None:
                if "x_val" in ours:
                    raise TypeError("val_loader: give x_val (and y_val) or val_loader, not both")
                ours["x_val"] = val_loader
            if "grid" not in ours:
                ck.check_int(grid_size, "grid_size", 1)
                lo = float(log_prior_prec_min)
                hi = float(log_prior_prec_max)
                if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
                    raise ValueError(
                        "log_prior_prec_min, log_prior_prec_max: expected finite numbers, "
                        f"min <= max, got {log_prior_prec_min!r}, {log_prior_prec_max!r}"
                    )
                ours["grid"] = torch.logspace(lo, hi, grid_size, dtype=torch.float64)
        else:
            if val_loader is not None:
                raise TypeError("val_loader: the grid search's (method='gridsearch'); leave it out")
            if structure != "scalar":
                groups = self.parameter_groups()
                ours["groups"] = (
                    groups.sizes_index() if structure == "layerwise" else torch.arange(self.model.rank)
                )
            if n_steps is not None:  # laplace-torch's schedule, from its init_prior_prec
                n_steps = 100 if n_steps is LT_DEFAULT else n_steps
                ours["adam"] = (n_steps, 0.1 if lr is LT_DEFAULT or lr is None else lr)
                init_prior_prec = 1.0 if init_prior_prec is LT_DEFAULT else init_prior_prec
            else:  # L-BFGS to convergence (ours); lr is Adam's
                if lr is not LT_DEFAULT and lr is not None:
                    raise TypeError("lr: Adam's step size; with n_steps=None (L-BFGS) leave it out")
                init_prior_prec = None if init_prior_prec is LT_DEFAULT else init_prior_prec
        self._flush()
        guide = self._modules["guide"]
        # all or nothing: a tuning that fails (a bad grid, an interruption) leaves the prior
        # as it was, init_prior_prec included
        with transaction(guide, self.model, on_overflow=guide._mark_unfitted):
            if init_prior_prec is not None:
                self.prior_precision = init_prior_prec
            optimize_prior_precision(guide, method, **ours)
        if verbose:
            print(f"Optimized prior precision is {self.prior_precision}.")
        return self

    def log_marginal_likelihood(
        self,
        prior_precision: float | torch.Tensor | None = None,
        sigma_noise: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The Laplace evidence at ``prior_precision`` and ``sigma_noise`` (the current values
        where ``None``), differentiable in both; the values given are written back (as
        laplace-torch does) and ``Σ`` is re-formed from them at its next use. ``λ``: a number,
        a ``(1,)`` or 0-d tensor, one value per parameter tensor of the subset (laplace-torch's
        ``"layerwise"``) or one per weight ``(K,)``."""
        guide = self._modules["guide"]
        pending = self.__dict__["_pending"]
        lam = prior_precision if prior_precision is not None else pending.get("prior_precision")
        sigma = sigma_noise if sigma_noise is not None else pending.get("sigma")
        if lam is not None:
            lam = self._prior_vector(lam, differentiable=True)
        if sigma is not None:
            sigma = _as_scalar(sigma, "sigma_noise")
            if not guide.likelihood.noise_scale_tunable:
                raise ValueError(
                    "sigma_noise: only a Gaussian likelihood with one noise scale has one "
                    "(classification: leave it out)"
                )
        value = guide.log_marginal_likelihood(lam, sigma)
        if prior_precision is not None:
            pending["prior_precision"] = lam.detach().clone()
        if sigma_noise is not None:
            pending["sigma"] = float(sigma.detach()) if isinstance(sigma, torch.Tensor) else sigma
        return value

    def _prior_vector(self, value: object, differentiable: bool = False) -> torch.Tensor:
        """``λ`` as the model takes it: a 0-d tensor (one value) or ``(K,)`` (per weight), from
        a number, a ``(1,)``/0-d tensor, one value per parameter tensor of the subset, or
        ``(K,)``; positive and finite (checked on the values, the graph kept)."""
        k = self.model.rank
        groups = self.parameter_groups()
        if isinstance(value, torch.Tensor):
            lam = value if differentiable else value.detach()
            lam = lam.to(dtype=torch.float64, device=self.model.prior_loc.device)
        else:
            lam = torch.tensor(ck.positive_float(value, "prior_precision"), dtype=torch.float64)
        if lam.dim() > 1:
            raise ValueError(f"prior_precision: expected a number or a 1-D tensor, got {tuple(lam.shape)}")
        if not bool(torch.isfinite(lam.detach()).all()) or bool((lam.detach() <= 0).any()):
            raise ValueError(f"prior_precision: expected positive finite values, got {lam.detach()}")
        if lam.dim() == 0 or lam.numel() == 1:
            return lam.reshape(())
        if lam.numel() == len(groups) and lam.numel() != k:
            return lam[groups.sizes_index()]
        if lam.numel() == k:
            return lam
        raise ValueError(
            f"prior_precision: expected 1 value, {len(groups)} (one per parameter tensor of the "
            f"subset: {groups.names}) or {k} (one per weight), got {lam.numel()}"
        )

    def parameter_groups(self) -> ParameterGroups:
        """The parameter tensors the subset's weights belong to (laplace-torch's layerwise
        prior has one ``λ`` per such tensor)."""
        return ParameterGroups(self.model)

    # ------------------------------------------------------------------ hyperparameters

    @property
    def prior_precision(self) -> torch.Tensor:
        """``λ`` in laplace-torch's shapes: ``(1,)`` when shared by all weights, one value per
        parameter tensor of the subset when it is constant within each (a layerwise prior),
        else ``(K,)`` (the model's prior, or the value `log_marginal_likelihood` wrote back);
        setting it (a number or any of these shapes) re-forms ``Σ``."""
        pending = self.__dict__["_pending"].get("prior_precision")
        lam = pending.clone() if pending is not None else self._modules["guide"].prior_precision
        if lam.dim() == 0:
            return lam.reshape(1)
        if not isinstance(self.model.subspace, IndexSubspace):
            return lam
        index = self.parameter_groups().sizes_index().to(lam.device)
        first = torch.zeros(int(index.max()) + 1, dtype=torch.long, device=lam.device)
        first.scatter_reduce_(0, index, torch.arange(len(index), device=lam.device), "amin", include_self=False)
        per_group = lam[first]
        return per_group if torch.equal(per_group[index], lam) else lam

    @prior_precision.setter
    def prior_precision(self, value: float | torch.Tensor) -> None:
        lam = self._prior_vector(value)
        self.__dict__["_pending"].pop("prior_precision", None)
        self._flush()
        guide = self._modules["guide"]
        if guide.fitted:
            guide.set_prior_precision(lam)
        else:
            guide.model.set_prior_precision(lam)

    @property
    def sigma_noise(self) -> torch.Tensor:
        """The Gaussian likelihood's noise ``σ`` (0-d); settable (the curvature and ``Σ``
        follow, ``G ∝ 1/σ²``). Classification: 1, as in laplace-torch."""
        pending = self.__dict__["_pending"].get("sigma")
        if pending is not None:
            return torch.tensor(pending, dtype=torch.float64)
        lik = self.model.likelihood
        if not lik.noise_scale_tunable:
            return torch.tensor(1.0, dtype=torch.float64)
        return lik.sigma.detach().clone()

    @sigma_noise.setter
    def sigma_noise(self, value: float | torch.Tensor) -> None:
        guide = self._modules["guide"]
        if not guide.likelihood.noise_scale_tunable:
            raise ValueError(
                "sigma_noise: only a Gaussian likelihood with one noise scale has one; give the "
                "noise to the likelihood, likelihoods.Gaussian(sigma=...)"
            )
        sigma = float(_as_scalar(value, "sigma_noise"))
        self.__dict__["_pending"].pop("sigma", None)
        self._flush()
        if guide.fitted:
            guide.set_sigma(sigma)
        else:
            lik = guide.likelihood
            lik.sigma = torch.full_like(lik.sigma.detach(), ck.positive_float(sigma, "sigma_noise"))

    # ------------------------------------------------------------------ the posterior

    def predict(
        self,
        x: torch.Tensor,
        link_approx: str = "auto",
        pred_type: str = "glm",
        n_samples: int | None = None,
        **kwargs: object,
    ):
        """The linearised predictive as a ``torch.distributions`` object
        (`AutoSubspaceLaplace.predict`; regression: ``J Σ Jᵀ + σ²``); ``pred_type`` only
        ``"glm"``; ``n_samples``: laplace-torch's name of ``num_samples``."""
        if self._pred_type(pred_type) != "glm":
            raise ValueError(
                f"pred_type: only 'glm' (the linearised predictive), got {pred_type!r}; for "
                "laplace-torch's 'nn' call la(x, pred_type='nn') or la.predictive_samples"
            )
        if n_samples is not None:
            if "num_samples" in kwargs:
                raise TypeError("n_samples: give num_samples or n_samples, not both")
            kwargs["num_samples"] = n_samples
        return self.guide.predict(x, link_approx, **kwargs)

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None):
        """laplace-torch's ``sample``: weight draws, ``(S, K)`` of the last layer for
        ``subset_of_weights="last_layer"``, else ``(S, D)`` of all weights (the subset drawn
        from ``N(ŵ_S, Σ)``, the rest at the MAP); ``generator`` seeds them (``None``: torch's
        global generator)."""
        ck.positive_int(n_samples, "n_samples")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {generator!r}")
        guide = self.guide
        w = self.model.subspace.weights(guide.draw_latent(n_samples, generator))
        if self.last_layer:
            return w[:, self.model.subspace.basis]
        return w

    @property
    def n_params(self) -> int:
        """laplace-torch's ``n_params``: the network's trainable weights ``D`` for ``"all"``, a
        ``"subnetwork"`` or flat indices (as its ``SubnetLaplace`` counts them; the ``K`` with
        a posterior are `n_params_subnet`), the last layer's weights for ``"last_layer"``, and
        ``K`` for any other `Subspace`."""
        sub = self.model.subspace
        if isinstance(sub, IndexSubspace) and not isinstance(sub, LastLayerSubspace):
            return sub.dim
        return sub.rank

    @property
    def n_params_subnet(self) -> int:
        """``K``, the number of weights with a posterior (laplace-torch's ``SubnetLaplace``)."""
        return self.model.rank

    @property
    def posterior_precision(self):
        """``Σ⁻¹`` in the structure's own form, as laplace-torch returns it
        (`Posterior.posterior_precision`): ``(K, K)`` full, ``(K,)`` diag, ``((U, l/T), p)``
        lowrank."""
        self.guide._check_fitted()
        return self.guide.posterior.posterior_precision()

    @property
    def posterior_covariance(self) -> torch.Tensor:
        """``Σ`` ``(K, K)`` (the diag structure's as a diagonal matrix)."""
        self.guide._check_fitted()
        return self.guide.posterior.covariance()

    @property
    def posterior_variance(self) -> torch.Tensor:
        """The marginal variances ``diag(Σ)`` ``(K,)``, any structure."""
        self.guide._check_fitted()
        return self.guide.posterior.marginal_variance()

    def functional_variance(self, Js: torch.Tensor) -> torch.Tensor:
        """laplace-torch's ``functional_variance``: ``J Σ Jᵀ`` ``(N, O, O)`` float64 for
        Jacobians ``Js`` ``(N, O, K)`` in the subset's coordinates (the last layer's weights
        then its bias for ``"last_layer"``, all trainable weights for ``"all"``, laplace-torch's
        order); for ``hessian_structure="gp"`` the GP's posterior covariance
        ``K** − K*M (K_MM + Λ⁻¹)⁻¹ K_M*`` (`posteriors.FunctionalPosterior`)."""
        self.guide._check_fitted()
        js = self._jacobian_argument(Js)
        return self.guide.posterior.functional_covariance(js).double()

    def functional_covariance(self, Js: torch.Tensor) -> torch.Tensor:
        """laplace-torch's ``functional_covariance``: the joint ``J Σ Jᵀ`` ``(N·O, N·O)``
        float64 over all rows of ``Js`` ``(N, O, K)`` (or ``(N·O, K)``)."""
        self.guide._check_fitted()
        js = self._jacobian_argument(Js, joint=True)
        return self.guide.posterior.functional_covariance(js.reshape(1, -1, js.shape[-1]))[0].double()

    def _jacobian_argument(self, Js: object, joint: bool = False) -> torch.Tensor:
        k = self.model.rank
        shapes = "(N, O, K) or (N·O, K)" if joint else "(N, O, K)"
        if not isinstance(Js, torch.Tensor) or not Js.is_floating_point():
            raise TypeError(f"Js: expected a float tensor {shapes}, got {type(Js).__name__}")
        if Js.shape[-1] != k or Js.dim() not in ((2, 3) if joint else (3,)):
            raise ValueError(f"Js: expected {shapes} with K = {k}, got shape {tuple(Js.shape)}")
        return Js.detach().clone()  # a posterior may overwrite its argument (BLAS trmm)

    # ------------------------------------------------------------------ persistence

    def state_dict(self, *args: object, **kwargs: object):
        self._flush()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state saved from this object (keys ``guide.*`` and ``model.*``). A state
        saved before this object held its guide (the guide's buffers alone, no prefix) is
        refused, saying what to do."""
        self.__dict__["_pending"] = {}
        if state_dict and not any(k.startswith(("guide.", "model.")) for k in state_dict):
            raise ValueError(
                "state_dict: holds a Laplace guide's buffers alone (saved before infer.Laplace "
                "held its guide as la.guide, or from la.guide): load it with "
                "la.guide.load_state_dict(state) and the model's with "
                "la.model.load_state_dict(model_state); save both with la.state_dict() from now"
            )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


#: the guide's attributes readable on `NetLaplace` (fitted state, evidence and diagnostics)
GUIDE_ATTRIBUTES = frozenset(
    {
        "loc", "covariance", "scale_tril", "precision", "ggn", "posterior", "fitted",
        "temperature", "num_data", "map_log_likelihood", "fit_statistics", "grid_scores",
        "hessian_structure", "chunk_size", "prior_loc", "prior_precision_matrix",
        "sample_weights", "draw_latent", "get_posterior", "set_sigma", "set_prior_precision",
        "likelihood", "posterior_prior_precision", "posterior_sigma",
    }
)  # fmt: skip


class ParameterGroups:
    """The parameter tensors that a subset's weights belong to, in ``net.parameters()`` order:
    ``names`` and, per coordinate of the subset, its group (`sizes_index`)."""

    def __init__(self, model: SubspaceNet) -> None:
        sub = model.subspace
        if not isinstance(sub, IndexSubspace):
            raise ValueError(
                "prior_precision: a prior per parameter tensor needs a subset of weights "
                f"(an index subspace), not a {type(sub).__name__}"
            )
        owner, names, at = [], [], 0
        for name, p in flat_parameters(model.flat.net):
            owner.append(torch.full((p.numel(),), len(names)))
            names.append(name)
            at += p.numel()
        flat_owner = torch.cat(owner)[sub.basis.cpu()]
        used = torch.unique(flat_owner)  # sorted: net.parameters() order
        self.names = [names[int(i)] for i in used]
        self._index = torch.searchsorted(used, flat_owner)

    def __len__(self) -> int:
        return len(self.names)

    def sizes_index(self) -> torch.Tensor:
        """``(K,)``: the group of each coordinate."""
        return self._index


def _cat_rows(parts: list):
    """Predictions of consecutive chunks of rows as one: tensors, or tuples of tensors."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(cols) for cols in zip(*parts))
    return torch.cat(parts)


class DiagonalLaplace(NetLaplace):
    """The diagonal (mean-field) linearised Laplace over all ``D`` weights: a baseline.

    ``q(w) = N(ŵ, diag(1 / (g/T + λ)))`` with ``g = diag(G)`` the exact GGN diagonal and the
    prior ``N(0, λ⁻¹ I)`` (Subnetwork Inference sections 6.1–6.2; its selection strategy uses
    the same variances, eq. 23): the diagonal structure on the all-weights subspace.

    Args:
        net: the network at its MAP ``ŵ``.
        likelihood: a `Likelihood`.
        prior_precision: ``λ > 0``.
        temperature: ``T > 0``.
        chunk_size: rows per Jacobian block (``None``: by the memory budget).
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        prior_precision: float = 1.0,
        temperature: float = 1.0,
        chunk_size: int | None = None,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        check_likelihood(likelihood)
        prior_precision = float(ck.prior_precision(prior_precision, 1))
        model = SubspaceNet(
            net, all_weights(net), likelihood, prior_scale=1.0,
            temperature=check_temperature(temperature), prior_mean="zero",
        )  # fmt: skip
        model.set_prior_precision(prior_precision)
        guide = AutoSubspaceLaplace(model, hessian_structure="diag", chunk_size=chunk_size or 1024)
        super().__init__(guide, "all")

    def optimize_prior_precision(self, *args: object, **kwargs: object) -> DiagonalLaplace:
        """``optimize_prior_precision(x_val, y_val, grid=None)``: the grid method (validation
        log-likelihood); or the keyword form of `NetLaplace.optimize_prior_precision`."""
        if args and isinstance(args[0], torch.Tensor):
            x_val, y_val, *rest = args
            kwargs.update(x_val=x_val, y_val=y_val, grid=rest[0] if rest else kwargs.get("grid"))
            args = ("grid",)
        return super().optimize_prior_precision(*args, **kwargs)

    @property
    def variance(self) -> torch.Tensor:
        """Marginal variances ``1 / (g/T + λ)`` ``(D,)``."""
        self.guide._check_fitted()
        return self.guide.posterior.marginal_variance()

    @property
    def ggn_diagonal(self) -> torch.Tensor:
        """``diag(G)`` ``(D,)`` (untempered)."""
        return self.guide.posterior.curvature().diagonal()

    @property
    def weights(self) -> torch.Tensor:
        return self.model.subspace.shift

    def moments(self, x: torch.Tensor, chunk_size: int | None = None):
        """``f(x, ŵ)`` ``(N, O)`` and ``J diag(v) Jᵀ`` ``(N, O, O)``, float64."""
        return linearized_moments(self, x, chunk_size=chunk_size)


__all__ = [
    "SUBSETS",
    "DiagonalLaplace",
    "Laplace",
    "LastLayerSubspace",
    "NetLaplace",
    "all_weights",
]
