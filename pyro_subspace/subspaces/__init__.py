"""Subspaces ``w = ŵ + P t`` of a network's weight space and the builders that make them.

- `Subspace`: the shift ``ŵ`` (D,) and a basis ``P``; kinds `DenseSubspace`, `IndexSubspace`
  (a subnetwork) and `LastLayerSubspace` (Jacobian from the penultimate features).
- `random`: random unit directions (Subspace Inference C.1).
- `SWACollector` + `pca`: PCA of the SGD trajectory, optionally with Minka's dimension (C.2, D).
- `fit_curve` + `curve`: a Bezier curve between two solutions and its 2-D plane (C.3).
- `subnetwork`: index-basis subspaces chosen by diagonal Laplace, SWAG, magnitude, at random,
  the last layer, names or explicit indices (Subnetwork Inference, sections 4–5).
- `ggn_eigen`: the leading GGN eigenvectors by Lanczos, the basis of a low-rank Laplace.
- `kfac_eigen`: the leading eigenvectors of K-FAC's GGN (optionally EK-FAC's eigenvalues), as a
  `KroneckerSubspace` (columns stored as Kronecker factors), from one K-FAC pass.
"""

from .base import DenseSubspace, IndexSubspace, Subspace
from .curve import bezier, curve, curve_losses, fit_curve
from .frequent_directions import FrequentDirections
from .ggn_eigen import ggn_eigen
from .kfac_eigen import kfac_eigen
from .kronecker import KroneckerSubspace
from .last_layer import LastLayerSubspace, find_last_layer, last_layer_indices
from .pca import SWACollector, minka_dimension, minka_log_evidence, pca
from .random import random
from .subnetwork import STRATEGIES, subnetwork

__all__ = [
    "STRATEGIES",
    "DenseSubspace",
    "FrequentDirections",
    "IndexSubspace",
    "KroneckerSubspace",
    "LastLayerSubspace",
    "SWACollector",
    "Subspace",
    "bezier",
    "curve",
    "curve_losses",
    "find_last_layer",
    "fit_curve",
    "ggn_eigen",
    "kfac_eigen",
    "last_layer_indices",
    "minka_dimension",
    "minka_log_evidence",
    "pca",
    "random",
    "subnetwork",
]
