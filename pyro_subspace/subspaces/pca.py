"""PCA subspaces of the SGD trajectory (Subspace Inference, appendix C.2, Algorithm 2, appendix D).

`SWACollector` keeps the running mean of the weights (the SWA solution ``ŵ``) and the last ``M``
deviations from it while the user's own training loop runs SGD at a high constant learning rate.
`pca` turns them into a `Subspace` whose basis columns are the principal directions scaled by
their singular values, so that the prior ``t ~ N(0, I_K)`` reproduces the covariance of the
collected iterates in those directions: the subspace model then induces a low-rank SWAG prior.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import nn

from .. import rng
from ..validation import check_int
from ..flat import FlatNet, check_saved_length, flush_subnormal_
from .base import Subspace
from .frequent_directions import FrequentDirections


class SWACollector(nn.Module):
    """Collects SWA statistics along a training trajectory (paper Algorithm 2).

    Call `collect` once per epoch (or every ``c`` steps) of constant-learning-rate SGD. The
    collector only collects: the running mean ``w̄``, the running second moment ``E[w²]`` and the
    deviations ``D̂``. `pca` turns them into a subspace; `pyro_subspace.infer.SWAG` samples the
    SWAG Gaussian (Maddox et al., 2019) from them.

    Args:
        net: the network being trained; its parameters are read, never written. It is *not* a
            submodule: the collector's ``state_dict`` holds only the statistics.
        max_snapshots: ``M``, how many of the most recent deviations ``w_i − w̄`` to keep
            (the paper uses 20). Memory is ``M·D`` numbers, allocated up front.
        method: ``"last"`` keeps the last ``M`` deviations (Algorithm 2);
            ``"frequent_directions"`` keeps an ``ℓ``-row frequent-directions sketch of *all*
            deviations (Ghashami et al., 2016; paper C.2), so the trajectory can be arbitrarily
            long in ``ℓ·D`` memory, with ``‖AᵀA − BᵀB‖₂ ≤ ‖A‖_F²/ℓ``.
        rank: ``ℓ`` for ``method="frequent_directions"`` (required there, unused otherwise).

    Attributes:
        n_collected: number of snapshots averaged into `mean`.

    Persistence: the statistics are buffers (``running_mean``, ``running_sq_mean``,
    ``num_collected`` and ``deviation_rows`` ``(M, D)``, a ring of the last ``M`` deviations; or
    the sketch's buffers under ``sketch.``), so a collector moves with ``.to(device)`` and
    round-trips through ``state_dict`` / ``torch.load(weights_only=True)`` into a collector built
    with the same ``max_snapshots``, ``method`` and ``rank`` on a network of the same size;
    collecting then continues as if uninterrupted.
    """

    running_mean: torch.Tensor
    running_sq_mean: torch.Tensor
    num_collected: torch.Tensor

    def __init__(
        self, net: nn.Module, max_snapshots: int = 20, method: str = "last", rank: int | None = None
    ) -> None:
        super().__init__()
        if (
            isinstance(max_snapshots, bool)
            or not isinstance(max_snapshots, int)
            or max_snapshots < 2
        ):
            raise ValueError(f"max_snapshots: expected an int >= 2, got {max_snapshots!r}")
        if method not in ("last", "frequent_directions"):
            raise ValueError(f"method: expected 'last' or 'frequent_directions', got {method!r}")
        if method == "frequent_directions" and (
            isinstance(rank, bool) or not isinstance(rank, int) or rank < 1
        ):
            raise ValueError(
                f"rank: frequent directions needs the sketch size ℓ >= 1, got {rank!r}"
            )
        self.flat = FlatNet(net)  # a plain object: the network stays out of this module
        self.method = method
        self.max_snapshots = max_snapshots
        w = self.flat.vector()
        self.register_buffer("running_mean", torch.zeros_like(w))  # shape: (D,)
        self.register_buffer("running_sq_mean", torch.zeros_like(w))  # shape: (D,)
        self.register_buffer("num_collected", torch.zeros((), dtype=torch.long, device=w.device))
        self.sketch: FrequentDirections | None = None
        if method == "frequent_directions":
            self.sketch = FrequentDirections(w.numel(), rank, dtype=w.dtype, device=w.device)
        else:
            # slot i % M holds the i-th deviation (a ring); `deviations` reads them oldest first
            self.register_buffer("deviation_rows", w.new_zeros(max_snapshots, w.numel()))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # type: ignore[override]
        want = self.running_mean.shape[0]
        check_saved_length("state_dict", state_dict.get(prefix + "running_mean"), want)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def n_collected(self) -> int:
        """Number of snapshots averaged into `mean`."""
        return int(self.num_collected)

    def collect(self) -> None:
        """Add the network's current weights ``w_i``: update the running mean and second moment,
        and store the deviation ``w_i − w̄`` (dropping the oldest beyond ``M``)."""
        w = self.flat.vector()
        if not torch.isfinite(w).all():
            raise ValueError("collect: the network's weights contain NaN or inf; training diverged")
        flush_subnormal_(w)  # a copy: the statistics stay free of slow subnormal floats
        n = self.n_collected
        if n == 0:
            self.running_mean.copy_(w)
            self.running_sq_mean.copy_(w.square())
        else:
            self.running_mean.mul_(n / (n + 1)).add_(w, alpha=1 / (n + 1))
            self.running_sq_mean.mul_(n / (n + 1)).add_(w.square(), alpha=1 / (n + 1))
        flush_subnormal_(self.running_mean, self.running_sq_mean)
        self.num_collected += 1
        if self.sketch is not None:
            self.sketch.append(w - self.running_mean)
        else:
            self.deviation_rows[n % self.max_snapshots] = w - self.running_mean

    def _require(self, what: str) -> None:
        if self.n_collected == 0:
            raise RuntimeError(f"{what}: no snapshots yet; call collect() during training first")

    @property
    def mean(self) -> torch.Tensor:
        """The SWA solution ``w̄``, the mean of the collected weights, shape ``(D,)``."""
        self._require("mean")
        return self.running_mean.clone()

    @property
    def variance(self) -> torch.Tensor:
        """Diagonal SWAG variance ``E[w²] − w̄²`` (clamped at 0), shape ``(D,)``."""
        self._require("variance")
        return (self.running_sq_mean - self.running_mean.square()).clamp_min(0.0)

    @property
    def deviations(self) -> torch.Tensor:
        """The stored deviations ``w_i − w̄`` as rows, oldest first, shape ``(M, D)`` with
        ``M <= max_snapshots`` (``method="last"``), or the frequent-directions sketch of all of
        them (``M <= ℓ``)."""
        self._require("deviations")
        m = self.num_snapshots
        if self.sketch is not None:
            return self.sketch.sketch[:m]
        first = (self.n_collected - m) % self.max_snapshots
        order = (torch.arange(m, device=self.deviation_rows.device) + first) % self.max_snapshots
        return self.deviation_rows[order]

    def covariance_factor(self) -> torch.Tensor:
        """Rows ``A`` with ``AᵀA`` ≈ the trajectory covariance, shape ``(M, D)``.

        ``D̂/sqrt(M − 1)`` for the last ``M`` deviations; ``B/sqrt(n − 1)`` for a sketch ``B`` of
        all ``n`` deviations.
        """
        count = self.n_collected if self.sketch is not None else self.num_snapshots
        if count < 2:
            raise ValueError(f"collector: needs at least 2 snapshots, {count} collected")
        return self.deviations / math.sqrt(count - 1)

    @property
    def num_snapshots(self) -> int:
        """``M``, the number of deviation rows currently stored (at most ``ℓ`` for a sketch)."""
        if self.sketch is not None:
            return min(self.n_collected, self.sketch.ell)
        return min(self.n_collected, self.max_snapshots)

    def extra_repr(self) -> str:
        return f"D={self.flat.num_weights}, method={self.method!r}, collected={self.n_collected}"


def minka_log_evidence(
    spectrum: np.ndarray | torch.Tensor, rank: int, n_samples: int, n_features: int | None = None
) -> float:
    """Minka's (2001) Laplace approximation to the PCA evidence ``log p(D | k)`` (paper D, eqs 5–6).

    Args:
        spectrum: covariance eigenvalues in decreasing order, shape ``(L,)``.
        rank: candidate dimension ``k``, ``1 <= k < min(L, n_features)``.
        n_samples: ``N``, the number of samples the spectrum was estimated from.
        n_features: ambient dimension ``d`` (default ``L``); eigenvalues beyond ``L`` are zero.

    Returns:
        The log evidence up to a constant independent of ``k``.
    """
    lam = np.asarray(spectrum, dtype=np.float64)
    d = lam.shape[0] if n_features is None else int(n_features)
    k = int(rank)
    if not 1 <= k < min(lam.shape[0], d):
        raise ValueError(f"rank: expected 1 <= rank < {min(lam.shape[0], d)}, got {rank}")
    if lam[k - 1] <= 0:
        return -math.inf
    n = float(n_samples)
    eps = 1e-15
    v = max(eps, lam[k:].sum() / (d - k))  # eq. (4)
    from scipy.special import gammaln  # SciPy on first use

    i = np.arange(1, k + 1)
    log_pu = -k * math.log(2.0) + np.sum(
        gammaln((d - i + 1) / 2.0) - math.log(math.pi) * (d - i + 1) / 2.0
    )
    log_pl = -n / 2.0 * np.sum(np.log(lam[:k]))
    log_pv = -n * (d - k) / 2.0 * math.log(v)
    m = d * k - k * (k + 1) / 2.0
    log_pp = math.log(2.0 * math.pi) * (m + k) / 2.0
    lam_hat = lam.copy()
    lam_hat[k:] = v
    # log|A_z| = sum_{i<=k} sum_{j>i} log[(1/λ̂_j − 1/λ̂_i)(λ_i − λ_j) N]
    li, lj = lam[:k, None], lam[None, :]
    hi, hj = lam_hat[:k, None], lam_hat[None, :]
    upper = np.arange(lam.shape[0])[None, :] > np.arange(k)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.log((li - lj) * (1.0 / hj - 1.0 / hi)) + math.log(n)
    log_az = np.sum(np.where(upper, terms, 0.0))
    n_zero = d - lam.shape[0]  # eigenvalues beyond the stored spectrum are exactly zero
    if n_zero > 0:
        log_az += n_zero * np.sum(np.log(lam[:k] * (1.0 / v - 1.0 / lam[:k])) + math.log(n))
    return float(log_pu + log_pl + log_pv + log_pp - log_az / 2.0 - k * math.log(n) / 2.0)


def minka_dimension(
    spectrum: np.ndarray | torch.Tensor, n_samples: int, n_features: int | None = None
) -> int:
    """The ``k`` maximising `minka_log_evidence` over ``1 <= k < min(L, d)`` (paper appendix D)."""
    lam = np.asarray(spectrum, dtype=np.float64)
    d = lam.shape[0] if n_features is None else int(n_features)
    top = min(lam.shape[0], d)
    if top < 2:
        raise ValueError(f"spectrum: need at least 2 eigenvalues to choose a dimension, got {top}")
    scores = [minka_log_evidence(lam, k, n_samples, d) for k in range(1, top)]
    return int(np.argmax(scores)) + 1


def rounding_floor(collector: SWACollector) -> float:
    """The singular value below which a direction of ``covariance_factor`` is rounding noise:
    the running mean and the deviations carry a relative error of about ``eps`` of the
    collector's dtype per update, so a trajectory that never moved gives rows of norm about
    ``eps·‖w̄‖``; ``64·eps·‖w̄‖`` leaves a margin (any real SGD step is far above it)."""
    mean = collector.running_mean
    return 64 * torch.finfo(mean.dtype).eps * float(mean.double().norm())


def _check_moved(top: float, floor: float) -> None:
    if top <= floor:
        raise ValueError(
            "collector: the collected weights did not move (the deviations are rounding noise "
            f"of the running mean: largest singular value {top:.3g} <= {floor:.3g}); train with "
            "a learning rate > 0 between collect() calls (swa_lr, swa_epochs)"
        )


#: float64 numbers of one column block of the deviations in `_gram_svd` (64 MiB)
GRAM_BLOCK_NUMBERS = 2**23
#: scikit-learn's ``randomized_svd`` default oversampling: its sketch has ``rank + 10`` columns
RANDOMIZED_OVERSAMPLES = 10


def _gram_svd(dev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The thin SVD of ``dev`` ``(M, D)``, ``M ≪ D``, through its ``(M, M)`` Gram matrix:
    singular values ``s`` ``(M,)`` descending and left vectors ``U`` ``(M, M)``, float64, each
    column signed so that its largest entry in absolute value is positive (scikit-learn's
    ``randomized_svd`` convention for a wide matrix). ``dev dev^T`` is summed over column blocks
    of `GRAM_BLOCK_NUMBERS` in float64: no ``(M, D)`` float64 copy, nor the ``(D, rank + 10)``
    float64 sketches of ``randomized_svd`` (about 10 GB at ResNet-18's 11.2M weights)."""
    m, d = dev.shape
    step = max(1, GRAM_BLOCK_NUMBERS // m)
    gram = torch.zeros(m, m, dtype=torch.float64, device=dev.device)
    for start in range(0, d, step):
        block = dev[:, start : start + step].double()
        gram.addmm_(block, block.T)
    e, u = torch.linalg.eigh(gram)
    e, u = e.flip(0), u.flip(1)
    u = u * torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
    return e.clamp_min(0.0).sqrt(), u


def _scaled_right_vectors(dev: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``V S = dev^T U`` ``(D, k)`` in ``dev``'s dtype for left vectors ``U`` ``(M, k)``,
    block by block in float64."""
    m, d = dev.shape
    step = max(1, GRAM_BLOCK_NUMBERS // max(m, u.shape[1]))
    out = torch.empty(d, u.shape[1], dtype=dev.dtype, device=dev.device)
    for start in range(0, d, step):
        out[start : start + step] = (dev[:, start : start + step].double().T @ u).to(dev.dtype)
    return out


def pca(collector: SWACollector, rank: int | str, seed: int | None = 0) -> Subspace:
    """The PCA subspace of the SGD trajectory (paper C.2, Algorithm 2).

    The deviations ``D̂`` (``M × D``) are divided by ``sqrt(M − 1)``; scikit-learn's
    ``randomized_svd`` (Halko et al., 2011) gives ``D̂/sqrt(M−1) ≈ U S Vᵀ`` and the basis is
    ``P = V S`` (``D × K``), so that ``t ~ N(0, I_K)`` gives ``P t`` the covariance ``V S² Vᵀ`` of the
    collected deviations in the top-``K`` directions (a low-rank SWAG). The shift is the SWA mean.
    Where ``M <= K + 10`` (the sketch's columns span all ``M`` snapshots, so the randomized SVD is
    exact) and for ``rank="mle"``, the same SVD is taken exactly from the ``(M, M)`` Gram matrix
    of the deviations (`_gram_svd`: ``O(M²D)`` time, no float64 copy of the ``(M, D)`` deviations:
    at ResNet-18's 11.2M weights and ``K = 20`` about 1 GB instead of 10), with
    ``randomized_svd``'s sign convention; ``seed`` then plays no part.

    Args:
        collector: a `SWACollector` with at least 2 snapshots.
        rank: ``K <= M``, or ``"mle"`` to choose ``K`` by Minka's criterion (paper D) from the
            exact spectrum of ``D̂ᵀD̂/(M−1)``. With ``D ≫ M`` only ``L <= M`` eigenvalues are
            non-zero; the ambient dimension is taken to be ``L`` (the span of the snapshots),
            because with ``d = D`` the noise estimate ``v̂`` collapses and the criterion cannot
            reduce the dimension (the failure the paper reports in appendix D).
        seed: random state of ``randomized_svd`` (``None``: drawn from torch's global
            generator, so ``torch.manual_seed`` alone makes the basis reproducible).

    Returns:
        A dense `Subspace` with shift ``(D,)`` and basis ``(D, K)``.
    """
    if not isinstance(collector, SWACollector):
        raise TypeError(f"collector: expected a SWACollector, got {type(collector).__name__}")
    m = collector.num_snapshots
    if m < 2:
        raise ValueError(f"collector: PCA needs at least 2 snapshots, {m} collected")
    dev = collector.covariance_factor()  # shape: (M, D)
    n_samples = collector.n_collected if collector.method == "frequent_directions" else m
    floor = rounding_floor(collector)
    if rank == "mle":
        s, u = _gram_svd(dev)
        _check_moved(float(s[0]), floor)
        spectrum = s.square().numpy(force=True)
        nonzero = int((s > floor).sum())  # directions above the running mean's rounding
        if nonzero < 2:
            raise ValueError(
                f"collector: the trajectory spans {nonzero} direction(s); need >= 2 for rank='mle'"
            )
        k = minka_dimension(spectrum[:nonzero], n_samples=n_samples, n_features=nonzero)
        basis = _scaled_right_vectors(dev, u[:, :k])
    else:
        check_int(rank, "rank", 1)
        if rank > m:
            raise ValueError(
                f"rank: {rank} is larger than the number of collected snapshots M={m}; "
                f"collect more snapshots or use rank <= {m}"
            )
        if seed is None:  # one draw from torch's global generator (torch.manual_seed controls it)
            seed = int(torch.randint(0, 2**31 - 1, ()))
        if m <= rank + RANDOMIZED_OVERSAMPLES:  # the sketch spans every snapshot: exact
            s, u = _gram_svd(dev)
            s, u = s[:rank], u[:, :rank]
            _check_moved(float(s[0]), floor)
            basis = _scaled_right_vectors(dev, u)
        else:
            extmath = rng.import_keeping_state("sklearn.utils.extmath")  # on first use
            dense = dev.numpy(force=True).astype(np.float64)
            _, s, vt = extmath.randomized_svd(dense, rank, random_state=seed)
            s = torch.from_numpy(s)
            _check_moved(float(s[0]), floor)
            basis = torch.as_tensor(vt.T * s.numpy(), dtype=dev.dtype, device=dev.device)
        moved = int((s > floor).sum())
        if moved < rank:
            warnings.warn(
                f"pca: the trajectory moved in {moved} direction(s) only; the other "
                f"{rank - moved} of rank={rank} are rounding noise of the running mean. Use "
                f"rank <= {moved} (or rank='mle'), or collect along a longer SGD run",
                UserWarning,
                stacklevel=2,
            )
    return Subspace(collector.mean, basis)
