"""Curvature of a network's loss without dense ``D × D`` matrices.

- `output_hessian`: ``H_n``, the Hessian of ``−log p(y | f)`` in the outputs (Fisher for the
  heteroscedastic Gaussian).
- `ggn_vector_product`: ``G v`` by ``jvp``/``vjp`` (Subnetwork Inference eq. 9);
  `ggn_matrix_product`: ``G V`` for a block of vectors in one batched pass.
- `GGNOperator`: ``G v``/``G V`` at fixed weights with the network's graphs built once (for
  eigensolvers: no primal forward per product).
- `ggn_in_subspace`: ``Pᵀ G P`` for a dense or index `Subspace` (eq. 15).
- `ggn_diagonal`: the exact ``diag(G)`` (diagonal Laplace, section 5).
- `kfac`: K-FAC, Kronecker-factored GGN blocks ``G ⊗ A`` of ``nn.Linear``/``nn.Conv2d`` layers
  and the exact diagonal elsewhere, in one pass over the data (Ritter et al. 2018).
- `subspace_jacobians`, `full_jacobians`: blocks of ``J_n P`` / ``J_n`` for predictives.
- `lanczos_eigh`: top-``k`` eigenpairs of a symmetric operator (Subspace Inference appendix E),
  via ``linear_operator``'s Lanczos; `block_lanczos_eigh`: the block variant on ``G V``;
  `thick_restart_lanczos_eigh`: to a tolerance, in the fewest products (tested every step).
"""

from .jacobians import MAX_JACOBIAN_NUMBERS
from .block_lanczos import block_lanczos_eigh
from .ggn import (
    full_jacobians,
    ggn_diagonal,
    ggn_from_blocks,
    ggn_in_subspace,
    ggn_matrix_product,
    ggn_vector_product,
    gram_from_blocks,
    output_hessian,
    subspace_jacobians,
)
from .ggn_operator import GGNOperator
from .kfac import KronBlock, KronFactors, kfac
from .lanczos import lanczos_eigh
from .thick_lanczos import thick_restart_lanczos_eigh

__all__ = [
    "MAX_JACOBIAN_NUMBERS",
    "GGNOperator",
    "KronBlock",
    "KronFactors",
    "block_lanczos_eigh",
    "full_jacobians",
    "ggn_diagonal",
    "ggn_from_blocks",
    "ggn_in_subspace",
    "ggn_matrix_product",
    "ggn_vector_product",
    "gram_from_blocks",
    "kfac",
    "lanczos_eigh",
    "output_hessian",
    "subspace_jacobians",
    "thick_restart_lanczos_eigh",
]
