"""laplace-torch's vocabulary, translated: what lets a laplace-torch user's call of `Laplace`
and of the `NetLaplace` it returns work unchanged here.

- its likelihood names ``"classification"``, ``"regression"``, ``"reward_modeling"`` and its
  ``str`` enum members (``Likelihood.CLASSIFICATION``, ``PredType.GLM``, ...: `enum_value`);
- its ``backend=`` classes, ``backend_kwargs`` and ``asdl_fisher_kwargs`` as ``"kron"``'s
  ``structure_options`` (`GGN_BACKENDS`);
- ``FunctionalLaplace``'s keywords (`GP_KEYWORDS`), ``SubnetLaplace``'s ``subnetwork_indices``,
  and its keywords with no counterpart here, refused saying what to do;
- its argument defaults (`LT_DEFAULT`), its ``(1,)`` hyperparameters, its prediction keywords
  and its predictions in the network's dtype.

laplace-torch is never imported: backends are read by their class names, enums by value.
"""

from __future__ import annotations

import enum

import torch

from ... import validation as ck
from ...likelihoods import Categorical, Gaussian, Likelihood, check_likelihood

#: laplace-torch's keywords of ``hessian_structure="gp"`` (``FunctionalLaplace``)
GP_KEYWORDS = ("n_subset", "independent_outputs", "seed")


def _gp_options(structure, subset, options, strategy_kwargs) -> dict | None:
    """``structure_options`` with laplace-torch's ``n_subset``, ``independent_outputs`` and
    ``seed`` of ``hessian_structure="gp"`` moved out of ``strategy_kwargs`` (in place); the
    GP view for ``"all"`` and ``"last_layer"`` only, as laplace-torch's ``FunctionalLaplace``
    and ``FunctionalLLLaplace``. Errors naming the argument, before any work."""
    if structure != "gp":
        for name in ("n_subset", "independent_outputs"):
            if name in strategy_kwargs:
                raise TypeError(
                    f"{name}: only used with hessian_structure='gp' (laplace-torch's "
                    f"FunctionalLaplace), got hessian_structure={structure!r}"
                )
        return options
    if not (isinstance(subset, str) and subset in ("all", "last_layer")):
        raise ValueError(
            f"subset_of_weights: hessian_structure='gp' is the GP view of the Laplace over "
            f"'all' weights or the 'last_layer' (laplace-torch's FunctionalLaplace and "
            f"FunctionalLLLaplace), got {_describe(subset)}; for a subnetwork use 'full' or 'diag'"
        )
    options = {} if options is None else dict(options)
    for name in GP_KEYWORDS:
        if name in strategy_kwargs:
            if name in options:
                raise TypeError(f"{name}: given twice, as a keyword and in structure_options")
            options[name] = strategy_kwargs.pop(name)
    return options or None


def _subnetwork_indices(subset, indices, n_params, strategy) -> tuple[torch.Tensor, bool]:
    """laplace-torch's ``Laplace(..., subset_of_weights="subnetwork",
    subnetwork_indices=idx)``: the flat indices as the subset (``λ`` as given, as there),
    ``(indices, selected=False)``; an error naming the argument where it does not fit."""
    if not (isinstance(subset, str) and subset == "subnetwork"):
        raise TypeError(
            f"subnetwork_indices: only with subset_of_weights='subnetwork' (laplace-torch's "
            f"SubnetLaplace), got subset_of_weights={_describe(subset)}; or pass the flat "
            "indices as subset_of_weights"
        )
    if n_params is not None or strategy is not None:
        raise TypeError(
            "subnetwork_indices: gives the subnetwork itself; leave n_params and strategy out "
            "(they select one)"
        )
    if not isinstance(indices, torch.Tensor):
        raise TypeError(
            f"subnetwork_indices: expected a 1-D integer tensor of flat indices (as "
            f"laplace-torch's SubnetMask.select() returns), got {type(indices).__name__}"
        )
    return indices, False


#: laplace-torch's GGN backends and their ``Conv2d`` convention for K-FAC
GGN_BACKENDS = {"CurvlinopsGGN": "expand", "AsdlGGN": "expand", "BackPackGGN": "backpack"}


def _backend_options(backend, backend_kwargs, asdl_fisher_kwargs, structure, options) -> dict | None:
    """``structure_options`` with what laplace-torch's ``backend``, ``backend_kwargs`` and
    ``asdl_fisher_kwargs`` say (`Laplace`); an error naming the argument for anything this
    library does not compute."""
    options = None if options is None else dict(options)
    given = {}
    if backend is not None:
        name = getattr(backend, "__name__", type(backend).__name__)
        if name.endswith("EF"):
            raise ValueError(
                f"backend: {name} is the empirical Fisher, which this library does not compute; "
                "pass a GGN backend (CurvlinopsGGN, BackPackGGN, AsdlGGN) or leave backend "
                "out: the curvature here is the exact GGN"
            )
        if name not in GGN_BACKENDS:
            raise ValueError(
                f"backend: {name} is not one of laplace-torch's GGN backends "
                f"{tuple(GGN_BACKENDS)} (the Hessian is not computed here); leave backend out: "
                "the curvature here is the exact GGN"
            )
        if structure == "kron":
            given["conv"] = GGN_BACKENDS[name]
    for arg, value, known in (
        ("backend_kwargs", backend_kwargs, {"stochastic"}),
        ("asdl_fisher_kwargs", asdl_fisher_kwargs, {"kfac_approx"}),
    ):
        if value is None:
            continue
        if not isinstance(value, dict) or not set(value) <= known:
            raise TypeError(f"{arg}: only {sorted(known)} is understood here, got {value!r}")
        if structure != "kron":
            raise ValueError(f"{arg}: only for hessian_structure='kron', got {structure!r}")
    if backend_kwargs is not None and backend_kwargs.get("stochastic"):
        given["fisher"] = "mc"
    if asdl_fisher_kwargs is not None and "kfac_approx" in asdl_fisher_kwargs:
        given["conv"] = ck.choice(enum_value(asdl_fisher_kwargs["kfac_approx"]),
                                  "asdl_fisher_kwargs['kfac_approx']", ("expand", "reduce"))
    for key, value in given.items():
        if options is not None and key in options and options[key] != value:
            raise ValueError(
                f"structure_options: {key}={options[key]!r} contradicts the backend's {value!r}"
            )
    return {**given, **(options or {})} or None


#: an argument left at laplace-torch's default (`NetLaplace.optimize_prior_precision`)
LT_DEFAULT = object()

#: laplace-torch's likelihood names
LIKELIHOOD_NAMES = ("classification", "regression", "reward_modeling")


def _door_likelihood(
    likelihood: object, sigma_noise: object, dtype: torch.dtype
) -> tuple[Likelihood, bool]:
    """``(likelihood object, reward modeling?)`` from a `Likelihood` or laplace-torch's name
    (or its ``Likelihood`` enum member, by value); ``sigma_noise`` checked against it and, as
    laplace-torch keeps it, in the network's ``dtype`` (a float64 network's ``σ = 0.8`` is
    float64's 0.8, not float32's)."""
    name = enum_value(likelihood)
    if isinstance(name, str):
        if name not in LIKELIHOOD_NAMES:
            raise ValueError(
                f"likelihood: expected a Likelihood (likelihoods.Categorical(), Gaussian(), "
                f"Bernoulli()) or one of laplace-torch's names {LIKELIHOOD_NAMES}, got {name!r}"
            )
        if sigma_noise is not None and name != "regression":
            raise ValueError(
                f"sigma_noise: only for likelihood='regression' (the Gaussian noise), got "
                f"likelihood={name!r}; leave it out"
            )
        if name == "regression":
            sigma = 1.0 if sigma_noise is None else float(_as_scalar(sigma_noise, "sigma_noise"))
            sigma = torch.tensor(ck.positive_float(sigma, "sigma_noise"), dtype=dtype)
            return Gaussian(sigma=sigma), False
        return Categorical(), name == "reward_modeling"
    check_likelihood(likelihood)
    if sigma_noise is not None and not likelihood.noise_scale_tunable:
        raise ValueError(
            f"sigma_noise: only for a Gaussian likelihood with one noise scale, got "
            f"{type(likelihood).__name__}; leave it out"
        )
    return likelihood, False


def enum_value(value: object) -> object:
    """laplace-torch's ``str`` enum members (``Likelihood.CLASSIFICATION``, ``PredType.GLM``,
    ...) as their values, without importing laplace-torch; anything else unchanged."""
    if isinstance(value, enum.Enum) and isinstance(value.value, str):
        return value.value
    return value


def _to_net_dtype(out, dtype: torch.dtype):
    """laplace-torch returns its predictions in the network's dtype."""
    if isinstance(out, tuple):
        return tuple(o.to(dtype) for o in out)
    return out.to(dtype)


def _as_scalar(value: object, name: str) -> torch.Tensor | float:
    """A number or a one-element tensor (laplace-torch's ``(1,)`` hyperparameters) as a 0-d
    tensor (graph kept) or a float, positive and finite."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{name}: expected one positive number, got shape {tuple(value.shape)}")
        if not bool(torch.isfinite(value.detach()).all()) or float(value.detach()) <= 0:
            raise ValueError(f"{name}: expected a positive finite value, got {float(value)}")
        return value.reshape(()).double()
    return ck.positive_float(value, name)


def _check_prediction_keywords(pred_type, joint, n_samples, diagonal_output, generator, fitting):
    ck.choice(pred_type, "pred_type", ("glm", "nn"))
    if joint:
        raise ValueError("joint: only la(x, joint=True) takes it; leave it out here")
    if fitting:
        raise ValueError("fitting: laplace-torch's internal flag; leave it False")
    ck.positive_int(n_samples, "n_samples")
    ck.choice(diagonal_output, "diagonal_output", (True, False))
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {generator!r}")


def _describe(subset: object) -> str:
    if isinstance(subset, str):
        return repr(subset)
    return f"a {type(subset).__name__}"


#: laplace-torch keywords with no counterpart here, and what to do instead
_LT_KEYWORDS = {
    "prior_mean": "the prior is N(0, 1/prior_precision I) on the weights (what weight "
    "decay trains); for another prior build AutoSubspaceLaplace(SubspaceNet(...), prior_mean=)",
    "temperature_scaling": "pass temperature=T",
}


__all__ = [
    "GGN_BACKENDS",
    "GP_KEYWORDS",
    "LIKELIHOOD_NAMES",
    "LT_DEFAULT",
    "enum_value",
]
