"""K-FAC: Kronecker-factored blocks of a network's GGN (type-2 Fisher), in one pass over the data.

For an ``nn.Linear`` layer ``z = W a + b`` the GGN block of ``W`` is
``Σ_n Σ_c (g_{n,c} g_{n,c}ᵀ) ⊗ (a_n a_nᵀ)`` (row-major ``vec W``), where ``a_n`` is the layer's
input and ``g_{n,c} = J_{z,n}ᵀ L_n[:, c]`` the output-Hessian factor's column ``c``
(``L_n L_nᵀ = H_n``, `Likelihood.hessian_factor`) back-propagated to the layer's output. K-FAC
replaces the sum of Kronecker products by the Kronecker product of sums (Martens & Grosse 2015;
Ritter et al. 2018, eq. 7; Eschenhagen et al. 2023, eq. 6)::

    block(W) ≈ G ⊗ A,   G = Σ_{n,c} g_{n,c} g_{n,c}ᵀ  (out, out),   A = (1/N) Σ_n a_n a_nᵀ  (in, in)

so ``G`` is a sum over the data and ``A`` a mean: the split laplace-torch's ``Kron`` stores
(``[G, A]`` per weight, ``kron(G, A)`` its dense block in ``parameters_to_vector`` order, since
``W`` ``(out, in)`` flattens row-major: entry ``(i, j)`` sits at ``i·in + j``). On one data point,
or for a single linear layer with a likelihood whose ``H_n`` is the same for every point (a
Gaussian of fixed ``σ``), ``G ⊗ A`` is the exact GGN block.

Weight sharing (``nn.Conv2d``: ``R`` output locations per image; an ``nn.Linear`` applied to
inputs ``(N, ..., in)``: ``R`` = the product of the middle dimensions) follows Eschenhagen et al.
(2023, sections 3.1-3.2), chosen by ``conv``:

- ``"expand"`` (Grosse & Martens 2016's KFC): locations are extra data points.
  ``A = (1/(N R)) Σ_{n,r} a_{n,r} a_{n,r}ᵀ``, ``G = Σ_{n,r,c} g_{n,r,c} g_{n,r,c}ᵀ`` (``a_{n,r}``
  the unfolded patch, ``in·kh·kw`` long in ``weight.reshape(out, -1)``'s column order).
  curvlinops' ``KFACLinearOperator(kfac_approx="expand")``: laplace-torch's default
  ``CurvlinopsGGN`` backend.
- ``"reduce"``: the shared dimension is reduced before the outer products.
  ``A = (1/N) Σ_n â_n â_nᵀ`` with ``â_n = (1/R) Σ_r a_{n,r}``, ``G = Σ_{n,c} ĝ_{n,c} ĝ_{n,c}ᵀ``
  with ``ĝ_{n,c} = Σ_r g_{n,r,c}``. curvlinops' ``kfac_approx="reduce"`` (laplace-torch's
  ``CurvlinopsGGN`` with ``asdl_fisher_kwargs={"kfac_approx": "reduce"}``).
- ``"backpack"``: BackPack's KFLR/KFAC for convolutions (laplace-torch's ``BackPackGGN``),
  which is neither of the two: ``G`` as in ``"reduce"`` and ``A = (1/N) Σ_{n,r} a_{n,r} a_{n,r}ᵀ``
  (``R`` times ``"expand"``'s ``A``; BackPack's ``HBPConvNd`` docstring notes the factor ``R``).

GPT-2's ``Conv1D`` (``transformers``: ``z = a W + b`` with ``W`` ``(in, out)``) is a Linear
with its weight transposed: the same factors, its block's rows ``vec Wᵀ`` mapped to the flat
positions of ``W`` (`KronBlock.index`); checked against curvlinops on the ``nn.Linear`` twin.

For layers without weight sharing (an MLP) the three coincide, and equal both laplace-torch
backends. laplace-torch's ``KronLaplace.fit`` accumulates per batch ``G_b`` and
``A_b · M_b/N`` (``A_b`` the batch mean) and adds factor by factor, so for the type-2 Fisher its
``H_facs`` equal these full-data factors for ANY batching (checked in the tests); its ``H``
leaves out ``1/σ²`` for regression (``KronLaplace`` multiplies it in, ``_H_factor``).

Bias: ``bias="separate"`` (laplace-torch, curvlinops ``separate_weight_and_bias=True``) gives
the bias its own block ``G`` (``kind="full"``): the exact GGN block of the bias when there is no
weight sharing (and for ``"reduce"``/``"backpack"``); with ``"expand"`` it is the expand
approximation ``Σ_{n,r,c} g gᵀ``, as in curvlinops. ``bias="augment"``: one block for
``[W | b]``, the bias a column of ones appended to every input (``A`` gains a last row and
column); its dense order is row-major ``vec [W | b]``, mapped to the flat vector by
`KronBlock.index`.

A network that reshapes its batch (pairs ``(B, 2, d) → (2B, d)``, sets, tokens ``(B·L, d)``)
gives a layer more rows than data points, and a layer applied twice sees two inputs: each
call's rows are more rows of the sums, ``A = (1/N) Σ_calls Σ_rows a aᵀ / R`` and
``G = Σ_calls Σ_rows g gᵀ`` (``N`` the data points, once), as curvlinops' hooks accumulate them
(laplace-torch's ``KronLaplace``; `tests/test_reshaping_curvature.py` checks both that and the
per-layer definition formed by brute force).

Every other parameter in scope (BatchNorm, LayerNorm, Embedding, LSTM, a Linear/Conv2d whose
parameters are shared or that the forward does not call, a grouped convolution)
gets the exact GGN diagonal (``kind="diagonal"``): ``Σ_n Σ_c ((L_nᵀ J_n)_{c,d})²`` from per-sample
Jacobians of ``L_nᵀ f(x_n)`` with respect to only those parameters (``vmap`` over rows of
``jacrev``; row by row where ``vmap`` fails), in blocks of at most
``jacobians.SQUARE_SUM_NUMBERS // (C·D_diag)`` rows.

``fisher="mc"`` (laplace-torch's ``stochastic=True``, curvlinops' ``fisher_type="mc"``): the
factor's columns are replaced per point by ``mc_samples`` scores ``∇_f log p(ỹ | f_n) / √M`` with
``ỹ ~ p(y | f_n)`` drawn from the likelihood's distribution, whose expected outer product is the
Fisher ``= H_n`` for every likelihood here; so ``E[G_mc] = G``.

Cost per chunk: one forward pass with hooks (each K-FAC layer's input and output), ``C``
backward passes to the layers' outputs (``C`` = the factor's columns, ``mc_samples`` for
``"mc"``), one ``gᵀg`` per layer and column and one ``aᵀa`` per layer; memory is that of one
forward/backward pass on a chunk plus the unfolded patches of a convolution (computed in
sub-blocks of at most `UNFOLD_NUMBERS` numbers). Sums are added in float64 across chunks (so
they do not depend on the chunk size beyond rounding), then all-reduced over
``torch.distributed`` ranks (`distributed.all_reduce_sum`).

The package, one concept a file (`__init__` re-exports the public names):

- `factors`: the pass, `kfac` (hooks, chunks, the ``C`` backward passes, the reduction over
  ranks) and its tunables `FOLD_BATCHNORM`, `CHANNELS_LAST_ON_CPU`, `PASS_NUMBERS`,
  `MIN_PASS_ROWS` (set them on ``pyro_subspace.curvature.kfac.factors``, which reads them).
- `blocks`: the result types `KronBlock`, `KronFactors` and their assembly from the sums.
- `layers`: which modules get K-FAC and which the exact diagonal, and each K-FAC layer's sums.
- `convolution`: the weight-sharing conventions (``"expand"``, ``"reduce"``, ``"backpack"``):
  unfolded patches, their grams (`UNFOLD_NUMBERS`), the back-propagated columns' grams.
- `fold`: an eval-mode BatchNorm as a scale and shift, and the Conv2d+BatchNorm fold.
- `diagonal`: the exact GGN diagonal of every other covered parameter.
- `mc`: the Monte Carlo Fisher's sampled scores (``fisher="mc"``, `MC_SEED`).

The network's weights, frozen parameters and buffers are checked finite before a pass
(`validation.check_finite_state`, shared with every curvature entry point).
"""

from .blocks import KronBlock, KronFactors
from .convolution import conv_patches, expand_patch_gram, reduce_patch_means
from .factors import BIASES, CONVS, FISHERS, kfac
from .layers import is_conv1d

__all__ = [
    "BIASES",
    "CONVS",
    "FISHERS",
    "KronBlock",
    "KronFactors",
    "conv_patches",
    "reduce_patch_means",
    "expand_patch_gram",
    "is_conv1d",
    "kfac",
]
