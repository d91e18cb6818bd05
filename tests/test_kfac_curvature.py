"""`curvature.kfac`: K-FAC factors of the GGN against brute-force GGNs, laplace-torch's ``Kron``
(BackPack and curvlinops backends), Monte Carlo and itself.

Tolerances (float64): exactness against a brute-force GGN (dense Jacobians from
``torch.autograd.functional.jacobian``) 1e-10 relative to the block's largest entry; laplace-torch
1e-8 relative (an independent implementation, sums in another order); chunkings and data
sources 1e-12; the Monte Carlo Fisher within 5 standard errors of the exact factor, the standard
error estimated from the draws themselves (a 5σ miss of one of the ~100 entries has probability
below 1e-4).
"""

import copy
import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import likelihoods
from pyro_subspace.curvature import KronFactors, kfac
from pyro_subspace.curvature.kfac import conv_patches, expand_patch_gram, reduce_patch_means
from pyro_subspace.flat import FlatNet

F64 = torch.float64


def mlp(sizes, act=nn.Tanh, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers).double()


def cnn(seed=0, classes=3):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, classes)
    ).double()


def exact_ggn(net, lik, x):
    """Brute force ``Σ_n J_nᵀ H_n J_n`` ``(D, D)`` from dense per-point Jacobians."""
    flat = FlatNet(net)
    w = flat.vector()

    def f(v):
        return flat(v, x).reshape(x.shape[0], -1)

    jac = torch.autograd.functional.jacobian(f, w)  # shape: (N, O, D)
    with torch.no_grad():
        h = lik.output_hessian(f(w))
    return torch.einsum("nod,nop,npe->de", jac, h, jac)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def block_of(full, block):
    idx = block.index.to(full.device)
    return full[idx[:, None], idx[None, :]]


# ------------------------------------------------------------------ 1. exactness


@pytest.mark.parametrize("bias", ["separate", "augment"])
@pytest.mark.parametrize("lik_name", ["gaussian", "categorical"])
def test_one_point_each_linear_block_is_the_exact_ggn_block(device, lik_name, bias):
    """With one data point ``J_W = g aᵀ`` per column, so ``G ⊗ A`` is exact."""
    net = mlp([4, 6, 5, 3]).to(device)
    lik = likelihoods.Gaussian(sigma=torch.tensor([0.5, 1.0, 2.0], dtype=F64)) if (
        lik_name == "gaussian"
    ) else likelihoods.Categorical()  # fmt: skip
    lik = lik.to(device)
    x = torch.randn(1, 4, dtype=F64, generator=torch.Generator().manual_seed(1)).to(device)
    factors = kfac(net, lik, x, bias=bias)
    exact = exact_ggn(net, lik, x)
    kinds = {"separate": ["kron", "full"] * 3, "augment": ["kron"] * 3}[bias]
    assert [b.kind for b in factors.blocks] == kinds
    for b in factors.blocks:
        assert b.G.device.type == device.type
        assert rel(b.to_dense(), block_of(exact, b)) < 1e-10, (b.module, b.params)
    assert torch.equal(factors.index.cpu(), torch.arange(exact.shape[0]))


@pytest.mark.parametrize("sigma", [1.0, 0.3])
def test_linear_model_gaussian_is_exact_on_many_points(device, sigma):
    """One Linear layer, Gaussian likelihood: ``G = N I/σ²``, ``A = Σ a aᵀ/N``, so
    ``G ⊗ A = I/σ² ⊗ Σ a aᵀ``: the exact GGN; augmented, with the weight-bias cross terms."""
    torch.manual_seed(0)
    net = nn.Linear(5, 3).double().to(device)
    lik = likelihoods.Gaussian(sigma=sigma).to(device)
    x = torch.randn(30, 5, dtype=F64).to(device)
    exact = exact_ggn(net, lik, x)
    aug = kfac(net, lik, x, bias="augment")
    assert len(aug.blocks) == 1 and aug.blocks[0].augmented
    assert rel(aug.to_dense(), exact) < 1e-10
    sep = kfac(net, lik, x)
    for b in sep.blocks:
        assert rel(b.to_dense(), block_of(exact, b)) < 1e-10
    # the separate blocks leave out exactly the weight-bias cross terms
    mask = torch.zeros_like(exact, dtype=torch.bool)
    for b in sep.blocks:
        idx = b.index.to(device)
        mask[idx[:, None], idx[None, :]] = True
    assert rel(sep.to_dense(), torch.where(mask, exact, 0)) < 1e-10


@pytest.mark.parametrize("conv", ["expand", "reduce", "backpack"])
def test_conv_without_weight_sharing_is_exact_on_one_point(device, conv):
    """A kernel as large as the image has one location (``R = 1``): every convention is the
    exact GGN block on one point, which also checks the unfolding's column order."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(3, 2)).double()
    net = net.to(device)
    lik = likelihoods.Categorical()
    x = torch.randn(1, 2, 4, 4, dtype=F64).to(device)
    exact = exact_ggn(net, lik, x)
    for bias in ("separate", "augment"):
        factors = kfac(net, lik, x, conv=conv, bias=bias)
        for b in factors.blocks:
            assert rel(b.to_dense(), block_of(exact, b)) < 1e-10, (conv, bias, b.params)


# ------------------------------------------------------------------ 2. laplace-torch


def _problem(kind):
    gen = torch.Generator().manual_seed(3)
    n = 23
    if kind == "mlp-regression":
        x = torch.randn(n, 4, generator=gen, dtype=F64)
        return mlp([4, 8, 2]), x, torch.randn(n, 2, generator=gen, dtype=F64), "regression"
    if kind == "mlp-classification":
        x = torch.randn(n, 4, generator=gen, dtype=F64)
        y = torch.randint(0, 3, (n,), generator=gen)
        return mlp([4, 8, 3], nn.ReLU), x, y, "classification"
    x = torch.randn(n, 1, 8, 8, generator=gen, dtype=F64)
    return cnn(), x, torch.randint(0, 3, (n,), generator=gen), "classification"


LAPLACE_CASES = [
    ("mlp-regression", "BackPackGGN", None, "expand"),
    ("mlp-regression", "CurvlinopsGGN", None, "expand"),
    ("mlp-classification", "BackPackGGN", None, "expand"),
    ("mlp-classification", "CurvlinopsGGN", None, "reduce"),  # no weight sharing: all equal
    ("cnn", "BackPackGGN", None, "backpack"),
    ("cnn", "CurvlinopsGGN", "expand", "expand"),
    ("cnn", "CurvlinopsGGN", "reduce", "reduce"),
]


def _laplace_kron(kind, backend_name, approx, batch_size, sigma):
    laplace = pytest.importorskip("laplace", reason="laplace-torch is a comparison only")
    from laplace import curvature

    net, x, y, task = _problem(kind)
    la = laplace.KronLaplace(
        copy.deepcopy(net),  # BackPack extends (hooks) the model it is given
        task,
        sigma_noise=sigma if task == "regression" else 1.0,
        backend=getattr(curvature, backend_name),
        asdl_fisher_kwargs=None if approx is None else {"kfac_approx": approx},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPack's and curvlinops' full-backward-hook notes
        la.fit(DataLoader(TensorDataset(x, y), batch_size=batch_size))
    # laplace-torch's H leaves out 1/σ² (KronLaplace multiplies it in: _H_factor)
    scale = 1.0 / sigma**2 if task == "regression" else 1.0
    return net, x, task, la.H_facs.kfacs, scale


@pytest.mark.parametrize(
    "kind, backend, approx, conv",
    LAPLACE_CASES,
    ids=[f"{k}-{b}{'-' + a if a else ''}-{c}" for k, b, a, c in LAPLACE_CASES],
)
def test_matches_laplace_torch_kron(kind, backend, approx, conv):
    sigma = 0.7
    net, x, task, theirs, scale = _laplace_kron(kind, backend, approx, 23, sigma)
    assert x.shape[0] == 23  # one DataLoader batch of all N points
    # σ as a float64 tensor: a Python float is stored in torch's default dtype (float32)
    sigma64 = torch.tensor(sigma, dtype=F64)
    lik = likelihoods.Gaussian(sigma=sigma64) if task == "regression" else likelihoods.Categorical()
    ours = kfac(net, lik, x, conv=conv)
    assert len(ours.blocks) == len(theirs)  # weight [G, A] and bias [G] per layer, in order
    for b, facs in zip(ours.blocks, theirs):
        if len(facs) == 2:
            assert b.kind == "kron"
            want = torch.kron(facs[0], facs[1]) * scale
            # eigenvalues of a Kronecker product: all products of the factors' eigenvalues (the
            # split of a scalar between the factors differs: laplace-torch's 0.5 for MSE)
            mine = torch.outer(torch.linalg.eigvalsh(b.G), torch.linalg.eigvalsh(b.A))
            theirs_eig = torch.outer(
                torch.linalg.eigvalsh(facs[0]), torch.linalg.eigvalsh(facs[1])
            ) * scale  # fmt: skip
            assert rel(mine.reshape(-1).sort().values, theirs_eig.reshape(-1).sort().values) < 1e-8
        else:
            assert b.kind == "full"
            want = facs[0] * scale
        assert rel(b.to_dense(), want) < 1e-8, (b.params, backend, conv)


def test_laplace_torch_batched_fit_equals_the_full_data_factors():
    """laplace-torch adds ``G_b`` and ``A_b·M_b/N`` batch by batch, factor by factor: for the
    type-2 Fisher that IS the full-data K-FAC (here batches of 5, 5, ..., 3 rows)."""
    net, x, _, theirs, _ = _laplace_kron("cnn", "CurvlinopsGGN", None, 5, 1.0)
    ours = kfac(net, likelihoods.Categorical(), x, conv="expand")
    for b, facs in zip(ours.blocks, theirs):
        want = torch.kron(facs[0], facs[1]) if len(facs) == 2 else facs[0]
        assert rel(b.to_dense(), want) < 1e-8


def test_the_three_conventions_differ_on_a_convolution():
    """With weight sharing ``"backpack"`` is ``R`` times ``"expand"``'s ``A`` with
    ``"reduce"``'s ``G``; the three blocks differ (and coincide for the Linear layer)."""
    net, x, _, _ = _problem("cnn")
    lik = likelihoods.Categorical()
    f = {c: kfac(net, lik, x, conv=c) for c in ("expand", "reduce", "backpack")}
    r = 36  # 6 x 6 output locations
    torch.testing.assert_close(f["backpack"].blocks[0].A, r * f["expand"].blocks[0].A)
    torch.testing.assert_close(f["backpack"].blocks[0].G, f["reduce"].blocks[0].G)
    assert rel(f["expand"].blocks[0].to_dense(), f["reduce"].blocks[0].to_dense()) > 1e-3
    for c in ("reduce", "backpack"):  # the Linear layer after the convolution
        for i in (2, 3):
            torch.testing.assert_close(f[c].blocks[i].to_dense(), f["expand"].blocks[i].to_dense())


class _MeanOverTokens(nn.Module):
    def forward(self, h):
        return h.mean(1)


def _sharing_nets():
    """A Linear on token inputs ``(N, T, in)`` (``R = T``) and strided, padded and dilated
    convolutions (``R`` > 1, zero padding)."""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(0)
    tokens = nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), _MeanOverTokens(), nn.Linear(5, 3)
    ).double()  # fmt: skip
    conv = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Tanh(),
        nn.Conv2d(3, 4, 2, dilation=2, padding=1, bias=False), nn.Tanh(),
        nn.Flatten(), nn.LazyLinear(3),
    ).double()  # fmt: skip
    xc = torch.randn(9, 2, 9, 9, generator=gen, dtype=F64)
    conv(xc)  # materialise the lazy layer
    return {
        "tokens": (tokens, torch.randn(9, 6, 4, generator=gen, dtype=F64)),
        "strided-conv": (conv, xc),
    }


@pytest.mark.parametrize("conv", ["expand", "reduce"])
@pytest.mark.parametrize("kind", ["tokens", "strided-conv"])
def test_weight_sharing_matches_curvlinops(kind, conv):
    """Eschenhagen et al.'s two K-FACs against curvlinops' ``KFACLinearOperator`` directly
    (type-2, ``CrossEntropyLoss(reduction="sum")``): its input and gradient covariances are our
    ``A`` and ``G`` factor by factor."""
    curvlinops = pytest.importorskip("curvlinops", reason="a comparison only")
    net, x = _sharing_nets()[kind]
    y = torch.zeros(len(x), dtype=torch.long)
    for bias in ("separate", "augment"):
        op = curvlinops.KFACLinearOperator(
            net, nn.CrossEntropyLoss(reduction="sum"), list(net.parameters()), [(x, y)],
            fisher_type="type-2", kfac_approx=conv, check_deterministic=False,
            separate_weight_and_bias=bias == "separate",
        )  # fmt: skip
        op.compute_kronecker_factors()
        ours = kfac(net, likelihoods.Categorical(), x, conv=conv, bias=bias, chunk_size=4)
        kron = [b for b in ours.blocks if b.kind == "kron"]
        names = [b.module for b in kron]
        assert names == list(op._input_covariances), names
        for b in kron:
            torch.testing.assert_close(b.A, op._input_covariances[b.module], rtol=1e-10, atol=0)
            torch.testing.assert_close(
                b.G, op._gradient_covariances[b.module], rtol=1e-10, atol=1e-14
            )


def test_circular_and_same_padding_equal_padding_the_input_first():
    """``padding_mode="circular"`` and ``padding="same"`` are unfolded like the padded input."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(7, 2, 6, 6, generator=gen, dtype=F64)
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding="same", padding_mode="circular").double()
    head = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(3 * 36, 4)).double()
    plain = nn.Conv2d(2, 3, 3).double()
    plain.load_state_dict(conv.state_dict())
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="circular")
    lik = likelihoods.Categorical()
    for c in ("expand", "reduce", "backpack"):
        got = kfac(nn.Sequential(conv, head), lik, x, conv=c)
        want = kfac(nn.Sequential(plain, head), lik, padded, conv=c)
        for b, w in zip(got.blocks, want.blocks):
            torch.testing.assert_close(b.to_dense(), w.to_dense(), rtol=1e-12, atol=1e-15)


#: every kernel, stride, dilation, padding and padding mode of a Conv2d (the patch tests)
CONV_GEOMETRY = dict(
    k=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    pad=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    mode=st.sampled_from(["zeros", "reflect", "circular"]),
)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(**CONV_GEOMETRY, augment=st.booleans())
def test_the_patch_gram_without_unfolding_equals_the_unfolded_gram(
    k, stride, dilation, pad, mode, augment
):
    """`expand_patch_gram` (row patches, ``kh`` offsets) equals ``UᵀU`` of the unfolded
    patches (``F.unfold``) for every kernel, stride, dilation, padding and padding mode."""
    gen = torch.Generator().manual_seed(sum(k) + 7 * sum(stride) + 3 * sum(pad))
    x = torch.randn(3, 2, 9, 8, generator=gen, dtype=F64)
    conv = nn.Conv2d(2, 1, k, stride, pad, dilation, padding_mode=mode).double()
    rows = conv_patches(conv, x).transpose(1, 2).reshape(-1, 2 * k[0] * k[1])
    if augment:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], 1)
    want = rows.T @ rows
    got = expand_patch_gram(conv, x, augment)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(**CONV_GEOMETRY, channels_last=st.booleans())
def test_the_reduce_patch_means_without_unfolding_equal_the_unfolded_means(
    k, stride, dilation, pad, mode, channels_last
):
    """`reduce_patch_means` (strided sums of the input) equals the mean over the output
    locations of the unfolded patches (``F.unfold``) for every kernel, stride, dilation,
    padding, padding mode and memory format."""
    gen = torch.Generator().manual_seed(sum(k) + 7 * sum(stride) + 3 * sum(pad))
    x = torch.randn(3, 2, 9, 8, generator=gen, dtype=F64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    conv = nn.Conv2d(2, 1, k, stride, pad, dilation, padding_mode=mode).double()
    want = conv_patches(conv, x).mean(2)
    torch.testing.assert_close(reduce_patch_means(conv, x), want, rtol=1e-12, atol=1e-14)


def test_reduce_patch_means_with_string_padding():
    """``padding="same"`` (uneven: kernel 4) and ``"valid"``, as `conv_patches` pads them."""
    x = torch.randn(2, 3, 7, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    for padding, kernel in (("same", 4), ("same", (3, 2)), ("valid", 3)):
        conv = nn.Conv2d(3, 2, kernel, padding=padding).double()
        torch.testing.assert_close(
            reduce_patch_means(conv, x), conv_patches(conv, x).mean(2), rtol=1e-12, atol=1e-14
        )


# ------------------------------------------------------------------ 3. Monte Carlo


MC_LIKELIHOODS = {
    "categorical": (likelihoods.Categorical, 4),
    "gaussian": (lambda: likelihoods.Gaussian(torch.tensor(0.8, dtype=F64)), 4),
    "heteroscedastic": (lambda: likelihoods.Gaussian(heteroscedastic=True), 2),
    "bernoulli": (likelihoods.Bernoulli, 1),
}


@pytest.mark.parametrize("lik_name", list(MC_LIKELIHOODS))
def test_mc_fisher_is_unbiased(lik_name):
    """The mean of ``K = 250`` independent MC factors ``G`` (each of ``M = 8`` draws per point:
    2000 draws) is within 5 standard errors (estimated from the ``K`` values) of the exact
    ``G``; ``A`` does not depend on the draws. The scores' outer products average to the
    Fisher, which is each likelihood's ``H`` (the heteroscedastic Gaussian's is its Fisher)."""
    make, outputs = MC_LIKELIHOODS[lik_name]
    net = mlp([3, 5, outputs])
    lik = make()
    x = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
    exact = kfac(net, lik, x)
    gen = torch.Generator().manual_seed(123)
    draws = [kfac(net, lik, x, fisher="mc", mc_samples=8, generator=gen) for _ in range(250)]
    for i, b in enumerate(exact.blocks):
        gs = torch.stack([d.blocks[i].G for d in draws])  # shape: (K, q, q)
        se = gs.std(0) / len(draws) ** 0.5
        err = (gs.mean(0) - b.G).abs()
        assert (err <= 5 * se + 1e-12 * b.G.abs().max()).all(), (i, float((err / se).max()))
        assert (se > 0).any()
        if b.A is not None:
            torch.testing.assert_close(draws[0].blocks[i].A, b.A, rtol=1e-12, atol=0)


def test_mc_is_reproducible_and_leaves_the_global_generators_alone():
    net = mlp([3, 5, 4])
    x = torch.randn(9, 3, dtype=F64)
    lik = likelihoods.Categorical()
    before = torch.get_rng_state()
    a = kfac(net, lik, x, fisher="mc", generator=7).to_dense()
    b = kfac(net, lik, x, fisher="mc", generator=torch.Generator().manual_seed(7)).to_dense()
    c = kfac(net, lik, x, fisher="mc", generator=8).to_dense()
    d = kfac(net, lik, x, fisher="mc").to_dense()  # the default seeded generator
    e = kfac(net, lik, x, fisher="mc").to_dense()
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, b) and torch.equal(d, e) and not torch.equal(a, c)


# ------------------------------------------------------------------ 4. the contract


@pytest.mark.parametrize("kind", ["mlp", "cnn", "batchnorm"])
def test_chunk_size_and_data_source_do_not_matter(device, kind):
    gen = torch.Generator().manual_seed(4)
    if kind == "cnn":
        net, x = cnn(), torch.randn(17, 1, 8, 8, generator=gen, dtype=F64)
    elif kind == "batchnorm":
        net, x = _bn_net(), torch.randn(17, 4, generator=gen, dtype=F64)
    else:
        net, x = mlp([4, 7, 3]), torch.randn(17, 4, generator=gen, dtype=F64)
    net, x = net.to(device), x.to(device)
    y = torch.zeros(17, dtype=torch.long)
    lik = likelihoods.Categorical()
    for conv in ("expand", "reduce") if kind == "cnn" else ("expand",):
        want = kfac(net, lik, x, conv=conv, chunk_size=17).to_dense()
        for got in (
            kfac(net, lik, x, conv=conv, chunk_size=1),
            kfac(net, lik, x, conv=conv, chunk_size=7),
            kfac(net, lik, TensorDataset(x.cpu(), y), conv=conv, chunk_size=5),
            kfac(net, lik, DataLoader(TensorDataset(x.cpu(), y), batch_size=6), conv=conv),
        ):
            assert got.num_data == 17
            assert rel(got.to_dense(), want) < 1e-12


def _bn_net():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)
    ).double()  # fmt: skip
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net.eval()


def test_batchnorm_parameters_get_the_exact_ggn_diagonal(device):
    net = _bn_net().to(device)
    lik = likelihoods.Categorical()
    x = torch.randn(11, 4, dtype=F64, generator=torch.Generator().manual_seed(5)).to(device)
    factors = kfac(net, lik, x, chunk_size=4)
    kinds = [(b.module, b.kind) for b in factors.blocks]
    assert kinds == [("0", "kron"), ("0", "full"), ("1", "diagonal"), ("3", "kron"), ("3", "full")]
    bn = factors.blocks[2]
    assert bn.params == ("1.weight", "1.bias")
    exact = exact_ggn(net, lik, x)
    assert rel(bn.diagonal, block_of(exact, bn).diagonal()) < 1e-10
    assert torch.equal(factors.index.cpu(), torch.arange(exact.shape[0]))
    # the Kronecker blocks do not depend on whether the BatchNorm is covered
    last = kfac(net, lik, x, modules=[net[3]])
    assert [b.params for b in last.blocks] == [("3.weight",), ("3.bias",)]
    for b, full in zip(last.blocks, factors.blocks[3:]):
        torch.testing.assert_close(b.to_dense(), full.to_dense(), rtol=1e-12, atol=0)
    # diag() is the diagonal of to_dense(), without forming it
    torch.testing.assert_close(factors.diag(), factors.to_dense().diagonal(), rtol=0, atol=0)


def test_modules_by_name_and_frozen_parameters():
    net = mlp([3, 4, 2])
    net[0].bias.requires_grad_(False)
    x = torch.randn(5, 3, dtype=F64)
    lik = likelihoods.Categorical()
    factors = kfac(net, lik, x, modules=["0", "2"])
    assert [b.params for b in factors.blocks] == [("0.weight",), ("2.weight",), ("2.bias",)]
    # positions in the flat vector of the trainable weights: the frozen bias has none
    assert factors.index.tolist() == list(range(12)) + list(range(12, 22))
    assert isinstance(factors, KronFactors) and factors.num_weights == 22


def test_a_layer_called_twice_keeps_kfac_with_both_calls_summed():
    """As curvlinops' hooks (laplace-torch's default backend): each call's rows are more rows
    of ``A`` and ``G`` (tests/test_reshaping_curvature.py checks the factors against their
    per-layer definition and against laplace-torch); no fallback, no warning."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))

    torch.manual_seed(0)
    net = Twice().double()
    x = torch.randn(8, 3, dtype=F64)
    lik = likelihoods.Categorical()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        factors = kfac(net, lik, x, chunk_size=3)
    assert [b.kind for b in factors.blocks] == ["kron", "full", "kron", "full"]
    first = net.inner(x).detach()
    inputs = torch.cat([x, torch.tanh(first)])  # the two calls' inputs
    assert rel(factors.blocks[0].A, inputs.T @ inputs / len(x)) < 1e-12


def test_a_layer_the_forward_does_not_call_gets_its_zero_diagonal():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(3, 2), nn.Linear(3, 3)

        def forward(self, x):
            return self.used(x)

    net = Unused().double()
    with pytest.warns(UserWarning, match="'spare' gets the exact GGN diagonal.*not called"):
        factors = kfac(net, likelihoods.Categorical(), torch.randn(5, 3, dtype=F64))
    assert [b.kind for b in factors.blocks] == ["kron", "full", "diagonal"]
    assert torch.equal(factors.blocks[2].diagonal, torch.zeros(12, dtype=F64))


def test_float32_network_gives_float32_factors():
    net64 = mlp([4, 6, 3])
    x = torch.randn(40, 4, dtype=F64)
    lik = likelihoods.Categorical()
    want = kfac(net64, lik, x).to_dense()
    got = kfac(copy.deepcopy(net64).float(), lik, x.float())
    assert got.blocks[0].G.dtype == torch.float32
    assert rel(got.to_dense().double(), want) < 1e-5
    assert kfac(copy.deepcopy(net64).float(), lik, x.float(), dtype=F64).blocks[0].A.dtype == F64


def test_the_global_generator_is_untouched():
    net = mlp([4, 6, 3])
    x = torch.randn(12, 4, dtype=F64)
    y = torch.randint(0, 3, (12,))
    before = torch.get_rng_state()
    kfac(net, likelihoods.Categorical(), x)
    kfac(
        net, likelihoods.Categorical(), DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True)
    )
    kfac(net, likelihoods.Categorical(), x, fisher="mc", mc_samples=3)
    assert torch.equal(torch.get_rng_state(), before)


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


BAD = [
    ({"net": "not a net"}, TypeError, "net"),
    ({"likelihood": "classification"}, TypeError, "likelihood"),
    ({"x": [[1.0, 2.0, 3.0]]}, TypeError, "x"),
    ({"x": torch.full((4, 3), float("nan"), dtype=F64)}, ValueError, "x"),
    ({"x": torch.randn(0, 3, dtype=F64)}, ValueError, "x"),
    ({"y": torch.zeros(3)}, ValueError, "y"),
    ({"fisher": "empirical"}, ValueError, "fisher"),
    ({"conv": "mean"}, ValueError, "conv"),
    ({"bias": "drop"}, ValueError, "bias"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"mc_samples": 0, "fisher": "mc"}, ValueError, "mc_samples"),
    ({"mc_samples": 3}, ValueError, "mc_samples"),
    ({"fisher": "mc", "generator": "seed"}, TypeError, "generator"),
    ({"modules": [nn.Linear(3, 2)]}, ValueError, "modules"),
    ({"modules": ["nope"]}, ValueError, "modules"),
    ({"modules": []}, ValueError, "modules"),
    ({"dtype": torch.int64}, TypeError, "dtype"),
]


@pytest.mark.parametrize(
    "change, error, name", BAD, ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(BAD)]
)
def test_bad_arguments_are_named_before_any_work(change, error, name):
    net = _Counting()
    args = {"net": net, "likelihood": likelihoods.Categorical(), "x": torch.randn(4, 3, dtype=F64)}
    args.update(change)
    kwargs = {k: v for k, v in args.items() if k not in ("net", "likelihood", "x", "y")}
    with pytest.raises(error, match=f"^{name}:"):
        kfac(args["net"], args["likelihood"], args["x"], args.get("y"), **kwargs)
    assert net.calls == 0


def test_frozen_network_has_nothing_to_cover():
    net = mlp([3, 2]).requires_grad_(False)
    with pytest.raises(ValueError, match="^modules: no parameters"):
        kfac(net, likelihoods.Categorical(), torch.randn(2, 3, dtype=F64))


# ------------------------------------------------------------------ torch.distributed


def _distributed_job(rank):
    from pyro_subspace.distributed import shard

    net, x, lik = _distributed_problem()
    data = TensorDataset(x, torch.zeros(len(x)))
    from torch.utils.data.distributed import DistributedSampler

    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    return {
        "tensor": kfac(net, lik, shard(x), chunk_size=5, conv="reduce").to_dense(),
        "loader": kfac(net, lik, loader, conv="reduce").to_dense(),
        "n": torch.tensor(kfac(net, lik, shard(x)).num_data),
    }


def _distributed_problem():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the same initial weights in every process
    net = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 16, 3)
    ).double().eval()  # fmt: skip
    return net, torch.randn(24, 1, 6, 6, generator=gen, dtype=F64), likelihoods.Categorical()


def test_two_ranks_equal_one_process(tmp_path):
    from test_distributed import join_distributed, start_distributed

    path = tmp_path / "rank0.pt"
    ctx = start_distributed(path, job=_distributed_job)
    try:
        net, x, lik = _distributed_problem()
        want = kfac(net, lik, x, conv="reduce").to_dense()
    finally:
        join_distributed(ctx)
    got = torch.load(path, weights_only=True)
    assert int(got["n"]) == 24
    assert rel(got["tensor"], want) < 1e-10
    assert rel(got["loader"], want) < 1e-10


@pytest.mark.parametrize("norm", ["batchnorm2d", "groupnorm"])
def test_normalisation_layers_of_a_cnn_get_the_exact_ggn_diagonal(norm, device):
    """A BatchNorm2d (closed form from its running statistics) and a GroupNorm (the generic
    per-sample pull-back through the module) between convolutions: their blocks are the exact
    GGN diagonal (brute-force Jacobians)."""
    torch.manual_seed(4)
    layer = nn.BatchNorm2d(3) if norm == "batchnorm2d" else nn.GroupNorm(1, 3)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), layer, nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3))
    net = net.double()
    if norm == "batchnorm2d":
        net.train()
        net(torch.randn(32, 1, 6, 6, dtype=F64))  # running statistics away from 0 and 1
    net = net.eval().to(device)
    lik = likelihoods.Categorical()
    x = torch.randn(9, 1, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(6)).to(device)
    factors = kfac(net, lik, x, chunk_size=4)
    block = next(b for b in factors.blocks if b.kind == "diagonal")
    assert block.params == ("1.weight", "1.bias")
    exact = exact_ggn(net, lik, x)
    assert rel(block.diagonal, block_of(exact, block).diagonal()) < 1e-10


def _image_body(seed=0, act=nn.Tanh):
    """A CNN on images ``(N, 2, 8, 8)``: padded and strided convolutions, the first followed by
    an eval-mode BatchNorm (folded into it after the first chunk), a Linear head."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), act(),
        nn.Conv2d(4, 3, 3, stride=2), act(), nn.Flatten(), nn.Linear(3 * 3 * 3, 3),
    ).double().eval()  # fmt: skip
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    return net


def test_the_channels_last_pass_gives_the_nchw_factors_and_leaves_the_inputs_alone(monkeypatch):
    """On CPU the expand K-FAC pass of a CNN runs on channels-last copies of the input chunks
    (`kfac.factors.CHANNELS_LAST_ON_CPU`): the same factors as the NCHW pass (float64: rounding),
    a BatchNorm's diagonal included, and the user's inputs and weights keep their layout."""
    import importlib

    kfac_module = importlib.import_module("pyro_subspace.curvature.kfac.factors")
    net = _image_body(0, nn.ReLU)
    x = torch.randn(9, 2, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    lik = likelihoods.Categorical()
    factors, layouts = {}, {}
    for flag in (False, True):
        monkeypatch.setattr(kfac_module, "CHANNELS_LAST_ON_CPU", flag)
        seen = []  # the layout the second convolution receives in the chunks' passes
        hook = net[3].register_forward_pre_hook(  # (a one-row probe sizes the passes first)
            lambda m, inp: seen.append(inp[0].is_contiguous(memory_format=torch.channels_last))
            if inp[0].shape[0] > 1
            else None
        )
        factors[flag] = kfac(net, lik, x, chunk_size=4)
        hook.remove()
        layouts[flag] = set(seen)
    assert layouts == {False: {False}, True: {True}}  # the flag switches the pass's layout
    dense = {flag: f.to_dense() for flag, f in factors.items()}
    torch.testing.assert_close(dense[True], dense[False], rtol=1e-12, atol=0)
    assert x.is_contiguous() and all(p.is_contiguous() for p in net.parameters())


# ------------------------------------------------------------------ inputs the network shapes


class _ViewsItsInput(nn.Module):
    """The image body on whatever rows it is given, shaped by ``x.view(len(x), 2, 8, 8)``."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x.view(x.shape[0], 2, 8, 8))


class _ViewFlatten(nn.Module):
    """``h.view(len(h), -1)``: what a user writes instead of ``nn.Flatten``."""

    def forward(self, h):
        return h.view(h.shape[0], -1)


def _shaped_nets():
    """``{name: (net, its inputs)}`` of networks that shape their inputs into the images of
    `_image_body` (the same modules), with the images ``(9, 2, 8, 8)`` they all equal."""
    body = _image_body()
    x = torch.randn(9, 2, 8, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    viewed = nn.Sequential(*body[:5], _ViewFlatten(), body[6])
    return x, body, {
        "flat rows, nn.Unflatten": (nn.Sequential(nn.Unflatten(1, (2, 8, 8)), body), x.flatten(1)),
        "rank 3, viewed": (_ViewsItsInput(body), x.reshape(9, 2, 64)),
        "rank 5, viewed": (_ViewsItsInput(body), x.reshape(9, 1, 2, 8, 8)),
        "conv outputs viewed": (viewed, x),
    }


@pytest.mark.parametrize("conv", ["expand", "reduce", "backpack"])
@pytest.mark.parametrize("name", list(_shaped_nets()[2]))
def test_a_cnn_that_shapes_its_inputs_gets_the_factors_of_its_images(name, conv):
    """A CNN fed flat rows it unflattens (scikit-learn's digits), inputs of rank 3 or 5 it
    views as images, or images whose convolutions' outputs it flattens with ``.view`` (not
    possible on the channels-last layout the pass prefers on CPU, so it keeps the user's
    there): no crash, no layer demoted to a diagonal, and the factors of the same modules fed
    the images directly (the channels-last pass on CPU)."""
    x, body, nets = _shaped_nets()
    net, inputs = nets[name]
    before = inputs.clone()
    lik = likelihoods.Categorical()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "gets the exact GGN diagonal instead of K-FAC"
        got = kfac(net, lik, inputs, conv=conv, chunk_size=4)
    want = kfac(body, lik, x, conv=conv, chunk_size=4)
    kinds = ["kron", "full", "diagonal", "kron", "full", "kron", "full"]
    assert [b.kind for b in got.blocks] == [b.kind for b in want.blocks] == kinds
    for b, w in zip(got.blocks, want.blocks):
        assert torch.equal(b.index, w.index)
        for f in ("G", "A", "diagonal"):
            if getattr(w, f) is not None:
                assert rel(getattr(b, f), getattr(w, f)) < 1e-12, (b.module, f)
    assert torch.equal(inputs, before) and inputs.is_contiguous()


class _RefusesItsInput(nn.Module):
    """A CNN whose forward raises an error of its own."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3).double()

    def forward(self, x):
        raise RuntimeError("the network's own error")


def test_the_network_s_own_error_is_not_taken_for_the_layout_s():
    """The pass tries the channels-last layout and falls back to the user's when the network
    raises: an error the network raises in its own layout too still reaches the caller."""
    x = torch.randn(3, 2, 5, 5, dtype=F64)
    with pytest.raises(RuntimeError, match="the network's own error"):
        kfac(_RefusesItsInput(), likelihoods.Categorical(), x)


class _Decoder(nn.Module):
    """A Linear whose output is viewed as images for the convolutions: ``(N, 5) → (N, 2, 8, 8)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(5, 2 * 8 * 8).double()
        self.body = nn.Sequential(*(m for m in _image_body(4) if not isinstance(m, nn.BatchNorm2d)))

    def forward(self, x):
        return self.body(torch.tanh(self.inp(x)).view(x.shape[0], 2, 8, 8))


class _ChannelsAsImages(nn.Module):
    """Each input channel viewed as an image of its own, ``(N, 2, 8, 8) → (2N, 1, 8, 8)``: a
    convolution with twice as many rows as data points, joined again for the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.conv = nn.Conv2d(1, 3, 3).double()
        self.head = nn.Linear(2 * 3 * 6 * 6, 3).double()

    def forward(self, x):
        h = torch.tanh(self.conv(x.view(-1, 1, 8, 8)))
        return self.head(h.reshape(x.shape[0], -1))


@pytest.mark.parametrize("make, shape", [(_Decoder, (9, 5)), (_ChannelsAsImages, (9, 2, 8, 8))])
def test_a_conv2d_fed_by_a_reshape_matches_curvlinops(make, shape):
    """A Conv2d fed by a reshape in the middle of the network (a Linear's output viewed as
    images; a 4-D input viewed as more images than data points): the expand factors equal
    curvlinops' ``KFACLinearOperator`` (type-2, summed cross-entropy), factor by factor."""
    curvlinops = pytest.importorskip("curvlinops", reason="a comparison only")
    net = make()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    y = torch.zeros(shape[0], dtype=torch.long)
    op = curvlinops.KFACLinearOperator(
        net, nn.CrossEntropyLoss(reduction="sum"), list(net.parameters()), [(x, y)],
        fisher_type="type-2", kfac_approx="expand", check_deterministic=False,
    )  # fmt: skip
    op.compute_kronecker_factors()
    ours = kfac(net, likelihoods.Categorical(), x, chunk_size=4)
    kron = [b for b in ours.blocks if b.kind == "kron"]
    assert [b.module for b in kron] == list(op._input_covariances)
    for b in kron:
        torch.testing.assert_close(b.A, op._input_covariances[b.module], rtol=1e-10, atol=0)
        torch.testing.assert_close(b.G, op._gradient_covariances[b.module], rtol=1e-10, atol=1e-14)


class _SequenceFirst(nn.Module):
    """A LayerNorm on the sequence-first layout ``(L, N, d)`` of inputs ``(N, L, d)`` (as
    ``nn.TransformerEncoderLayer(batch_first=False)`` wants them): its rows are positions, each
    mixing every data point, whatever their number."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.norm, self.head = nn.LayerNorm(3).double(), nn.Linear(12, 2).double()
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.norm(x.transpose(0, 1)).transpose(0, 1)
        return self.head(torch.tanh(h).reshape(x.shape[0], -1))


@pytest.mark.parametrize("n, chunk", [(4, 4), (5, 4), (8, 4)])
def test_a_module_whose_rows_are_not_data_points_gets_the_exact_diagonal(n, chunk):
    """The per-sample pull-back through a diagonal module alone assumes its input's rows are
    the data points; a LayerNorm on sequence-first rows (``L = 4`` positions) has as many rows
    as a chunk of 4 points, yet each row mixes them: its block is still the exact GGN diagonal
    (brute-force Jacobians), also for the chunks after the first."""
    net = _SequenceFirst()
    x = torch.randn(n, 4, 3, generator=torch.Generator().manual_seed(n), dtype=F64)
    lik = likelihoods.Categorical()
    factors = kfac(net, lik, x, chunk_size=chunk)
    block = next(b for b in factors.blocks if b.kind == "diagonal")
    assert block.params == ("norm.weight", "norm.bias")
    exact = exact_ggn(net, lik, x)
    assert rel(block.diagonal, block_of(exact, block).diagonal()) < 1e-10

class _Branchy(nn.Module):
    """Conv+BatchNorm pairs to fold (with and without a convolution bias, stride 2, the first
    layer, whose input needs no gradient) and pairs not to fold: a BatchNorm without affine
    parameters (not in the pass), a convolution whose output a residual sum also uses, one with
    reflect padding, and a BatchNorm after a ReLU."""

    def __init__(self):
        super().__init__()
        self.c0, self.b0 = nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.c1, self.b1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False)
        self.c2, self.b2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)  # c2 also residual
        self.c3 = nn.Conv2d(4, 5, 3, stride=2, padding=1, padding_mode="reflect")
        self.b3 = nn.BatchNorm2d(5)
        self.c4, self.b4 = nn.Conv2d(5, 3, 1, stride=2, bias=False), nn.BatchNorm2d(3)
        self.b5 = nn.BatchNorm2d(3)  # after a ReLU: no convolution to fold into
        self.head = nn.Linear(3 * 2 * 2, 3)

    def forward(self, x):
        h = torch.relu(self.b0(self.c0(x)))
        h = torch.relu(self.b1(self.c1(h)))
        z = self.c2(h)
        h = torch.relu(self.b2(z) + z)
        h = torch.relu(self.b3(self.c3(h)))
        h = self.b5(torch.relu(self.b4(self.c4(h))))
        return self.head(h.flatten(1))


def test_folded_conv_batchnorm_pairs_give_the_unfolded_factors(monkeypatch, device):
    """After the first chunk, each Conv2d whose output only an eval-mode BatchNorm uses runs as
    one function with the folded weight (`kfac.factors.FOLD_BATCHNORM`, `_FoldedConvBN`):
    exactly the pairs that qualify are folded, the factors (the BatchNorm diagonals and the
    convolutions' G included) equal the unfolded pass's and the exact GGN diagonal of the
    BatchNorms, and the modules are left without the temporary forwards, also when the pass
    fails."""
    import importlib

    kfac_module = importlib.import_module("pyro_subspace.curvature.kfac.factors")
    torch.manual_seed(0)
    net = _Branchy().double().eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                if m.affine:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)
    net = net.to(device)
    x = torch.randn(10, 2, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(3)).to(device)
    lik = likelihoods.Categorical()
    found = []
    pairs = kfac_module._fold_pairs
    monkeypatch.setattr(
        kfac_module, "_fold_pairs", lambda *a: found.append(sorted(pairs(*a))) or pairs(*a)
    )
    factors = {}
    for flag in (False, True):
        monkeypatch.setattr(kfac_module, "FOLD_BATCHNORM", flag)
        factors[flag] = kfac(net, lik, x, chunk_size=3)  # 4 chunks: 3 of them folded
    assert found == [["c0", "c4"]]
    # a hook of the user's on a convolution or its BatchNorm keeps that pair unfolded
    handle = net.b4.register_forward_hook(lambda m, i, o: None)
    monkeypatch.setattr(kfac_module, "FOLD_BATCHNORM", True)
    hooked = kfac(net, lik, x, chunk_size=3)
    handle.remove()
    assert found[-1] == ["c0"]
    torch.testing.assert_close(hooked.to_dense(), factors[True].to_dense(), rtol=1e-12, atol=0)
    dense = {flag: f.to_dense() for flag, f in factors.items()}
    torch.testing.assert_close(dense[True], dense[False], rtol=1e-12, atol=0)
    exact = exact_ggn(net, lik, x)
    for b in factors[True].blocks:
        if b.kind == "diagonal":
            assert rel(b.diagonal, block_of(exact, b).diagonal()) < 1e-10
    assert all("forward" not in vars(m) for m in net.modules())
    # a failure inside a folded pass leaves the modules as they were
    head = net.head.forward

    def failing(h):
        if "forward" in vars(net.c0):  # the fold is installed: this pass is a folded one
            raise RuntimeError("failed in a folded pass")
        return head(h)

    monkeypatch.setattr(net.head, "forward", failing)
    with pytest.raises(RuntimeError, match="folded pass"):
        kfac(net, lik, x, chunk_size=3)
    assert all("forward" not in vars(m) for m in net.modules() if m is not net.head)


def _pass_rows(net, loader, **kw):
    rows = []
    factors = kfac(net, likelihoods.Categorical(), loader, on_outputs=lambda o, y: rows.append(len(o)), **kw)
    return rows, factors


def test_passes_shrink_where_the_factor_sums_outweigh_a_training_steps_graph():
    """A layer of 600 outputs sums 600² float64 numbers (2.9 MB) beside a graph of a few kB a
    row: passes of a quarter of the loader's batch of 8, where a small convolution on 16 × 16
    images (sums of 10² + 2² numbers, a graph of kilobytes a row) keeps the batch whole; the
    factors do not depend on it (equal to one pass over everything)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 4, dtype=torch.double), torch.randint(0, 3, (32,))
    wide = nn.Sequential(nn.Linear(4, 600), nn.Tanh(), nn.Linear(600, 3)).double()
    rows, factors = _pass_rows(wide, DataLoader(TensorDataset(x, y), batch_size=8))
    assert rows == [2] * 16
    whole = kfac(wide, likelihoods.Categorical(), x, chunk_size=32)
    torch.testing.assert_close(factors.to_dense(), whole.to_dense(), rtol=1e-12, atol=1e-12)
    rows = []  # tensors: passes of chunk_size rows, as asked (no training step to stay under)
    kfac(wide, likelihoods.Categorical(), x, chunk_size=8, on_outputs=lambda o, _: rows.append(len(o)))
    assert rows == [8] * 4
    images = torch.randn(32, 1, 16, 16, dtype=torch.double)
    conv = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    ).double()
    assert _pass_rows(conv, DataLoader(TensorDataset(images, y), batch_size=8))[0] == [8] * 4


def test_the_memory_rule_counts_the_sums_kfac_allocates():
    """`_sums_bytes` from the planned layers equals the bytes of the float64 ``A`` and ``G``
    sums the pass ends with (an augmented bias, and GPT-2's transposed Conv1D)."""
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    from pyro_subspace.curvature.kfac import factors as kf
    from pyro_subspace.curvature.kfac.layers import _plan

    torch.manual_seed(0)
    x = torch.randn(10, 4, dtype=torch.double)
    nets = [
        nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3)),
        nn.Sequential(Conv1D(7, 4), nn.Tanh(), nn.Linear(7, 3)),  # Conv1D(nf=out, nx=in)
    ]
    for net, augment in itertools.product(nets, (False, True)):
        net = net.double()
        predicted = kf._sums_bytes(_plan(net, [net], augment)[0])
        ended = []
        real = kf._assemble

        def spy(net_, layers, *args, ended=ended, real=real):
            ended.extend(layers)
            return real(net_, layers, *args)

        kf._assemble = spy
        try:
            kfac(net, likelihoods.Categorical(), x, bias="augment" if augment else "separate")
        finally:
            kf._assemble = real
        held = sum(8 * (lay.A.numel() + lay.G.numel()) for lay in ended)
        assert held == predicted
