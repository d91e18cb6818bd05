"""`subspaces.kfac_eigen` and `KroneckerSubspace` against independent computations.

- Where K-FAC is exact (one bias-free ``nn.Linear``, a Gaussian likelihood of fixed ``σ``: the
  GGN is ``(N/σ²) I ⊗ A``), the span and eigenvalues equal the brute-force GGN's (``jacrev``
  Jacobians, ``torch.linalg.eigh``); projectors are compared, as eigenvalues repeat.
- K-FAC and EK-FAC eigenpairs equal curvlinops' ``KFACLinearOperator`` and
  ``EKFACLinearOperator`` (type-2): each column ``p_k`` satisfies ``B p_k = s_k p_k`` for their
  operator ``B``, on an MLP and a CNN.
- The stored factors equal the dense basis in every contract method (the contract suite runs
  `KroneckerSubspace` too); persistence, bad arguments before any work, the samplers and the
  Laplace guide on it against the same basis stored densely.
"""

from __future__ import annotations

import pytest
import torch
from pyro.infer import MCMC
from test_persistence import PersistenceContract
from torch import nn

from pyro_subspace import EllipticalSliceSampler, FlatNet, SubspaceNet, likelihoods, subspaces
from pyro_subspace.infer import AutoSubspaceLaplace
from pyro_subspace.subspaces import KroneckerSubspace, Subspace

pytestmark = pytest.mark.usefixtures("one_thread")

EPS = torch.finfo(torch.float64).eps


def brute_force_ggn(net, likelihood, x):
    """``Σ_n J_nᵀ H_n J_n`` ``(D, D)`` from ``jacrev`` Jacobians of every data point."""
    flat = FlatNet(net)
    w = flat.vector()
    jac = torch.func.jacrev(lambda v: flat(v, x))(w).reshape(x.shape[0], -1, w.numel())
    h = likelihood.output_hessian(flat(w, x).detach().reshape(x.shape[0], -1))
    return torch.einsum("nod,nop,npe->de", jac, h, jac)


# ------------------------------------------------------------------ where K-FAC is exact


@pytest.mark.parametrize("eigenvalues", ["kfac", "ekfac"])
def test_exact_kfac_span_and_eigenvalues_equal_the_ggn(eigenvalues):
    gen = torch.Generator().manual_seed(0)
    net = nn.Linear(5, 3, bias=False).double()
    scales = torch.tensor([3.0, 2.0, 1.0, 0.7, 0.4], dtype=torch.float64)
    x = torch.randn(40, 5, generator=gen, dtype=torch.float64) * scales
    lik = likelihoods.Gaussian(0.5)
    ggn = brute_force_ggn(net, lik, x)
    gamma, vecs = torch.linalg.eigh(ggn)
    gamma, vecs = gamma.flip(0), vecs.flip(1)
    k = 6  # the top two eigenvalues of A, each repeated for the 3 outputs
    gap = float(gamma[k - 1] - gamma[k])
    assert gap > 0.1 * float(gamma[0])  # an eigengap, so the top-6 span is well defined
    sub = subspaces.kfac_eigen(net, lik, x, k, eigenvalues=eigenvalues)
    p = sub.dense_basis()
    # Davis–Kahan: the projectors differ by O(ε‖G‖/gap) for eigenvectors found to rounding
    tol = 1e3 * EPS * float(gamma[0]) / gap
    assert torch.allclose(p @ p.T, vecs[:, :k] @ vecs[:, :k].T, atol=tol, rtol=0)
    assert torch.allclose(sub.eigenvalues, gamma[:k], rtol=1e3 * EPS, atol=0)


def test_columns_are_orthonormal_and_from_several_layers():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 4)).double()
    with torch.no_grad():  # move the BatchNorm statistics off their defaults
        net(torch.randn(16, 3, dtype=torch.float64))
    net.eval()
    x = torch.randn(30, 3, dtype=torch.float64)
    sub = subspaces.kfac_eigen(net, likelihoods.Categorical(), x, 40)
    p = sub.dense_basis()
    assert torch.allclose(p.T @ p, torch.eye(40, dtype=torch.float64), atol=10 * EPS * 40)
    assert torch.allclose(sub.gram(), p.T @ p, atol=10 * EPS, rtol=0)
    assert (sub.eigenvalues[:-1] >= sub.eigenvalues[1:]).all()
    owners = {int(i) for i in p.abs().sum(1).nonzero()}
    spans = [(0, 18), (18, 24), (24, 30), (30, 36), (36, 60), (60, 64)]
    assert sum(any(a <= i < b for i in owners) for a, b in spans) >= 4  # several blocks
    # memory: the factors (layers' weights are contiguous: no positions stored), never D·K
    assert sub.index.numel() == 0
    widths = sum(int(q + pp) * int(r) for q, pp, r, _ in sub.shapes.tolist())
    assert sub.left.numel() + sub.right.numel() == widths < p.numel() / 4
    # EK-FAC with the BatchNorm's diagonal entries among the candidates: p^T G p by brute force
    for options in ({}, {"fisher": "mc", "mc_samples": 2}):
        ek = subspaces.kfac_eigen(net, likelihoods.Categorical(), x, 20, eigenvalues="ekfac",
                                  candidates=64, **options)  # fmt: skip
        q = ek.dense_basis()
        assert q[24:36].abs().sum() > 0  # BatchNorm entries were chosen
        quotients = torch.einsum("dk,de,ek->k", q, brute_force_ggn(net, likelihoods.Categorical(), x), q)
        assert torch.allclose(ek.eigenvalues, quotients, rtol=1e3 * EPS, atol=1e-12)


# ------------------------------------------------------------------ curvlinops as the oracle


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).double(), (40, 3)


def _cnn():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 2, stride=2), nn.Flatten(),
        nn.Linear(2 * 2 * 2, 4),
    )  # fmt: skip
    return net.double(), (24, 2, 4, 4)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
@pytest.mark.parametrize("eigenvalues", ["kfac", "ekfac"])
def test_eigenpairs_equal_curvlinops(make, eigenvalues, approx):
    curvlinops = pytest.importorskip("curvlinops")
    net, shape = make()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (shape[0],), generator=gen)
    op_class = {"kfac": curvlinops.KFACLinearOperator, "ekfac": curvlinops.EKFACLinearOperator}
    n = shape[0] // 2
    op = op_class[eigenvalues](
        net, nn.CrossEntropyLoss(reduction="sum"), list(net.parameters()),
        [(x[:n], y[:n]), (x[n:], y[n:])], fisher_type="type-2", check_deterministic=False,
        kfac_approx=approx,
    )  # fmt: skip
    k = 10
    sub = subspaces.kfac_eigen(net, likelihoods.Categorical(), x, k, eigenvalues=eigenvalues, conv=approx)
    p = sub.dense_basis()
    bp = op @ p  # curvlinops' (E)KFAC times each column
    scale = float(sub.eigenvalues[0])
    assert torch.allclose(bp, p * sub.eigenvalues, atol=1e4 * EPS * scale, rtol=0)
    # and the columns are its top-k eigenvectors: the operator's dense spectrum
    dense = op @ torch.eye(sub.dim, dtype=torch.float64)
    top = torch.linalg.eigvalsh((dense + dense.T) / 2).flip(0)[:k]
    if eigenvalues == "kfac":  # (EK-FAC's re-estimates need not be its top eigenvalues)
        assert torch.allclose(sub.eigenvalues, top, rtol=0, atol=1e4 * EPS * scale)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_every_candidate_gives_the_top_of_curvlinops_ekfac_spectrum(make, approx):
    """``candidates = D``: every Kronecker direction re-estimated, the top ``K`` kept: the
    eigenpairs are the top of curvlinops' dense EKFAC operator."""
    curvlinops = pytest.importorskip("curvlinops")
    net, shape = make()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (shape[0],), generator=gen)
    op = curvlinops.EKFACLinearOperator(
        net, nn.CrossEntropyLoss(reduction="sum"), list(net.parameters()), [(x, y)],
        fisher_type="type-2", check_deterministic=False, kfac_approx=approx,
    )  # fmt: skip
    k, d = 8, sum(p.numel() for p in net.parameters())
    sub = subspaces.kfac_eigen(
        net, likelihoods.Categorical(), x, k, eigenvalues="ekfac", candidates=d, conv=approx
    )
    dense = op @ torch.eye(d, dtype=torch.float64)
    top = torch.linalg.eigvalsh((dense + dense.T) / 2).flip(0)[:k]
    scale = float(top[0])
    assert torch.allclose(sub.eigenvalues, top, rtol=0, atol=1e4 * EPS * scale)
    p = sub.dense_basis()
    assert torch.allclose(dense @ p, p * sub.eigenvalues, rtol=0, atol=1e4 * EPS * scale)


def test_ekfac_eigenvalues_are_rayleigh_quotients_of_the_exact_ggn():
    net, shape = _mlp()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lik = likelihoods.Categorical()
    sub = subspaces.kfac_eigen(net, lik, x, 8, eigenvalues="ekfac")
    p = sub.dense_basis()
    quotients = torch.einsum("dk,de,ek->k", p, brute_force_ggn(net, lik, x), p)
    assert torch.allclose(sub.eigenvalues, quotients, rtol=1e3 * EPS, atol=0)
    assert (sub.eigenvalues[:-1] >= sub.eigenvalues[1:]).all()
    kfac = subspaces.kfac_eigen(net, lik, x, 8)  # the same span, reordered
    q = kfac.dense_basis()
    assert torch.allclose(p @ p.T, q @ q.T, atol=1e3 * EPS)


def test_weights_argument_is_used_and_the_network_left_as_it_was():
    net, shape = _mlp()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    lik = likelihoods.Categorical()
    before = FlatNet(net).vector().clone()
    other = before + 0.3 * torch.randn(before.shape, generator=torch.Generator().manual_seed(5),
                                       dtype=torch.float64)  # fmt: skip
    sub = subspaces.kfac_eigen(net, lik, x, 5, w=other)
    assert torch.equal(FlatNet(net).vector(), before)
    assert torch.equal(sub.shift, other)
    moved = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    FlatNet(moved).load_vector(other)
    expected = subspaces.kfac_eigen(moved, lik, x, 5)
    assert torch.allclose(sub.eigenvalues, expected.eigenvalues, rtol=1e-12)


# ------------------------------------------------------------------ bad input, before any work


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rank": 0}, ValueError, "rank"),
        ({"rank": 9}, ValueError, r"rank: expected an int in \[1, 8\]"),
        ({"rank": 2.0}, TypeError, "rank"),
        ({"rank": True}, TypeError, "rank"),
        ({"rank": 2, "eigenvalues": "exact"}, ValueError, "eigenvalues"),
        ({"rank": 2, "conv": "bad"}, ValueError, "conv"),
        ({"rank": 2, "fisher": "empirical"}, ValueError, "fisher"),
        ({"rank": 2, "mc_samples": 2}, ValueError, "mc_samples"),
        ({"rank": 2, "candidates": 4}, ValueError, "candidates: only"),
        ({"rank": 3, "candidates": 2, "eigenvalues": "ekfac"}, ValueError, "candidates"),
        ({"rank": 2, "chunk_size": 0}, ValueError, "chunk_size"),
        ({"rank": 2, "w": torch.zeros(7, dtype=torch.float64)}, ValueError, "w"),
    ],
)
def test_bad_arguments_are_refused_before_any_pass(kwargs, error, match):
    net = _Counting()
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(error, match=match):
        subspaces.kfac_eigen(net, likelihoods.Categorical(), x, **kwargs)
    assert net.calls == 0


def test_constructor_refuses_overlapping_blocks_and_bad_columns():
    one = torch.ones(1, 1)
    with pytest.raises(ValueError, match="distinct"):
        KroneckerSubspace(torch.zeros(4), [(torch.tensor([1]), one, one)] * 2)
    with pytest.raises(ValueError, match="q·p = 2"):
        KroneckerSubspace(torch.zeros(4), [(torch.tensor([1]), torch.ones(2, 1), one)])
    with pytest.raises(ValueError, match="columns"):
        KroneckerSubspace(torch.zeros(4), [(torch.tensor([1]), one, one)], columns=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        KroneckerSubspace(torch.zeros(4), [(torch.tensor([4]), one, one)])


# ------------------------------------------------------------------ persistence


def _hand_built(seed: int, k: int = 3) -> KroneckerSubspace:
    """Two blocks, one at scattered positions, factors not orthonormal."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [
        (torch.arange(6), torch.randn(2, 2, generator=gen), torch.randn(3, 2, generator=gen)),
        (torch.tensor([11, 7, 9, 6]), torch.randn(4, k - 2, generator=gen),
         torch.randn(1, k - 2, generator=gen)),
    ]  # fmt: skip
    cols = torch.randperm(k, generator=gen)
    return KroneckerSubspace(torch.randn(12, generator=gen), blocks, columns=cols)


class TestKroneckerSubspacePersistence(PersistenceContract):
    def fitted(self):
        return _hand_built(0)

    def fresh(self):
        return _hand_built(1, k=4)  # another rank: the state's shapes are taken

    def outputs(self, sub):
        t = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -0.25]])
        return sub.weights(t), sub.transpose_apply(torch.arange(12.0)), sub.gram(), sub.kind


def test_save_and_load_round_trip(tmp_path):
    net, shape = _mlp()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    sub = subspaces.kfac_eigen(net, likelihoods.Categorical(), x, 7, eigenvalues="ekfac")
    sub.save(tmp_path / "sub.pt")
    back = KroneckerSubspace.load(tmp_path / "sub.pt")
    assert torch.equal(back.dense_basis(), sub.dense_basis())
    assert torch.equal(back.eigenvalues, sub.eigenvalues) and torch.equal(back.shift, sub.shift)
    with pytest.raises(ValueError, match="state_dict"):  # another network's subspace
        _hand_built(0).load_state_dict(sub.state_dict())


# ------------------------------------------------------------------ every consumer takes it


def _problem():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(30, 2, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (30,), generator=gen)
    sub = subspaces.kfac_eigen(net, likelihoods.Categorical(), x, 4)
    return net, x, y, sub, Subspace(sub.shift, sub.dense_basis())


def test_laplace_guide_equals_the_dense_basis():
    net, x, y, sub, dense = _problem()
    fits = [
        AutoSubspaceLaplace(SubspaceNet(net, s, likelihoods.Categorical()), prior_precision=2.0)
        .fit(x, y, find_map=False)
        for s in (sub, dense)
    ]  # fmt: skip
    assert torch.allclose(fits[0].covariance, fits[1].covariance, rtol=1e-10)
    assert torch.allclose(fits[0].ggn, fits[1].ggn, rtol=1e-10, atol=1e-12)


def test_elliptical_slice_draws_equal_the_dense_basis():
    net, x, y, sub, dense = _problem()
    draws = []
    for s in (sub, dense):
        model = SubspaceNet(net, s, likelihoods.Categorical(), prior_scale=1.0)
        torch.manual_seed(3)
        mcmc = MCMC(EllipticalSliceSampler(model), num_samples=30, warmup_steps=5,
                    disable_progbar=True)  # fmt: skip
        mcmc.run(x, y)
        draws.append(mcmc.get_samples()["t"])
    # the same random numbers and log-likelihoods equal to rounding: the same chain
    assert torch.allclose(draws[0], draws[1], rtol=1e-9, atol=1e-12)


def test_jacobian_blocks_in_groups_of_columns_equal_one_group(monkeypatch):
    from pyro_subspace.subspaces import kronecker

    net, x, _, sub, dense = _problem()
    flat = FlatNet(net)
    w = sub.shift
    whole = list(dense.jacobian_blocks(flat, x, w, 7))
    monkeypatch.setattr(kronecker, "TANGENT_NUMBERS", 2 * sub.dim)  # 2 columns a pass
    grouped = list(sub.jacobian_blocks(flat, x, w, 7))
    assert len(grouped) == len(whole) == 5
    for (o1, j1), (o2, j2) in zip(grouped, whole):
        assert torch.allclose(o1, o2, rtol=1e-14) and torch.allclose(j1, j2, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "options",
    [{}, {"fisher": "mc", "mc_samples": 3}, {"bias": "augment"}, {"conv": "reduce"}],
    ids=["type-2", "mc", "augment", "reduce"],
)
def test_eigenvalues_are_the_top_of_the_assembled_kfac_matrix(options):
    """Selection across blocks: the eigenvalues equal the top of ``eigvalsh`` of the dense
    block-diagonal K-FAC matrix (`KronFactors.to_dense`), and each column is its eigenvector."""
    from pyro_subspace.curvature import kfac

    net, shape = _cnn()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    lik = likelihoods.Categorical()
    k = 12
    options = {"conv": "expand"} | options  # (kfac_eigen's "auto" would take "reduce" here)
    sub = subspaces.kfac_eigen(net, lik, x, k, **options)
    factors = kfac(net, lik, x, **options)
    dense = factors.to_dense()
    assert torch.equal(factors.index, torch.arange(sub.dim))  # every weight is covered
    top = torch.linalg.eigvalsh(dense).flip(0)[:k]
    scale = float(top[0])
    assert torch.allclose(sub.eigenvalues, top, rtol=0, atol=1e3 * EPS * scale)
    p = sub.dense_basis()
    assert torch.allclose(dense @ p, p * sub.eigenvalues, rtol=0, atol=1e3 * EPS * scale)


def test_auto_weight_sharing_is_reduce_for_one_row_a_point_and_expand_for_rows_per_token():
    """``conv="auto"``: a CNN classifier (one output row per image: its locations pooled before
    the likelihood) gets K-FAC-reduce, the subspace of ``conv="reduce"``; a network that gives
    one output row per token (``(B, L, d) → (B·L, O)``) gets K-FAC-expand."""
    from pyro_subspace.subspaces.kfac_eigen import weight_sharing

    net, shape = _cnn()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert weight_sharing(net, x) == "reduce"
    lik = likelihoods.Categorical()
    auto, reduce = (subspaces.kfac_eigen(net, lik, x, 6, conv=c) for c in ("auto", "reduce"))
    expand = subspaces.kfac_eigen(net, lik, x, 6, conv="expand")
    assert torch.equal(auto.eigenvalues, reduce.eigenvalues)
    assert not torch.allclose(auto.eigenvalues, expand.eigenvalues)  # the choice matters here
    torch.manual_seed(0)
    conv1d = nn.Conv1d(3, 4, 1).double()

    class PerToken(nn.Module):  # (B, L, 3) → (B·L, 4): a tagger's logits, one row per token
        def forward(self, z):
            return conv1d(z.transpose(1, 2)).transpose(1, 2).reshape(-1, 4)

    tokens = torch.randn(5, 7, 3, dtype=torch.float64)
    assert weight_sharing(PerToken(), tokens) == "expand"
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x, torch.zeros(shape[0], dtype=torch.long)), batch_size=5)
    assert weight_sharing(net, loader) == "reduce"

    class Keyed(nn.Module):  # dict batches (keyword inputs), one row per point or per token
        def __init__(self, per_token):
            super().__init__()
            self.per_token = per_token

        def forward(self, tokens):
            out = conv1d(tokens.transpose(1, 2)).transpose(1, 2)  # shape: (B, L, 4)
            return out.reshape(-1, 4) if self.per_token else out.mean(1)

    batch = {"tokens": tokens}
    assert weight_sharing(Keyed(True), batch) == "expand"
    assert weight_sharing(Keyed(False), batch) == "reduce"


# ------------------------------------------------------------------ networks that reshape their batch


@pytest.mark.parametrize("name", ["pairs", "sets", "tokens", "twice", "conv_pairs"])
def test_networks_that_reshape_their_batch(name):
    """Pairs, sets, tokens, a layer applied twice, a Conv2d on reshaped rows: the columns are
    eigenvectors of the per-layer K-FAC definition (`test_reshaping_curvature._layer_factors`,
    formed by brute force), the top ones, and EK-FAC's eigenvalues are the brute-force GGN's
    Rayleigh quotients ``pᵀ G p`` of each data point's Jacobian."""
    from test_reshaping_curvature import _ggn, _layer_factors, _problem

    net, x, _, _ = _problem(name)
    d = sum(p.numel() for p in net.parameters())
    expected, offsets, start = torch.zeros(d, d, dtype=torch.float64), {}, 0
    for pname, p in net.named_parameters():
        offsets[pname] = (start, start + p.numel())
        start += p.numel()
    for layer, (a, g) in _layer_factors(net, x).items():
        (w0, w1), (b0, b1) = offsets[f"{layer}.weight"], offsets[f"{layer}.bias"]
        expected[w0:w1, w0:w1] = torch.kron(g.contiguous(), a.contiguous())
        expected[b0:b1, b0:b1] = g
    k = 5
    lik = likelihoods.Categorical()
    sub = subspaces.kfac_eigen(net, lik, x, k, conv="expand")  # the definition's convention
    p = sub.dense_basis()
    scale = float(sub.eigenvalues[0])
    top = torch.linalg.eigvalsh(expected).flip(0)[:k]
    assert torch.allclose(sub.eigenvalues, top, rtol=0, atol=1e4 * EPS * scale)
    assert torch.allclose(expected @ p, p * sub.eigenvalues, rtol=0, atol=1e4 * EPS * scale)
    ek = subspaces.kfac_eigen(net, lik, x, k, eigenvalues="ekfac", conv="expand")
    q = ek.dense_basis()
    quotients = torch.einsum("dk,de,ek->k", q, _ggn(net, x), q)
    assert torch.allclose(ek.eigenvalues, quotients, rtol=1e3 * EPS, atol=1e3 * EPS * scale)


def test_a_dataloader_gives_the_tensors_subspace():
    from torch.utils.data import DataLoader, TensorDataset

    net, shape = _mlp()
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (shape[0],), generator=gen)
    lik = likelihoods.Categorical()
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    for ev in ("kfac", "ekfac"):
        a = subspaces.kfac_eigen(net, lik, x, 6, eigenvalues=ev)
        b = subspaces.kfac_eigen(net, lik, loader, 6, eigenvalues=ev)
        assert torch.allclose(a.eigenvalues, b.eigenvalues, rtol=1e3 * EPS)
        pa, pb = a.dense_basis(), b.dense_basis()
        assert torch.allclose(pa @ pa.T, pb @ pb.T, atol=1e-9)


def _cnn_reflect():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=2, dilation=2, padding_mode="reflect"), nn.ReLU(inplace=True),
        nn.Conv2d(3, 2, 2, stride=2), nn.Flatten(), nn.Linear(2 * 2 * 2, 4),
    )  # fmt: skip
    return net.double(), (24, 2, 4, 4)


@pytest.mark.parametrize(
    "make, options",
    [(_cnn, {}), (_cnn, {"bias": "augment"}), (_cnn_reflect, {}), (_mlp, {"bias": "augment"})],
    ids=["cnn", "cnn-augment", "reflect-dilated-inplace", "mlp-augment"],
)
def test_ekfac_one_pass_equals_the_brute_force_quotients(make, options, monkeypatch):
    """The hooked pass (inputs projected by a convolution with ``u`` as kernel, columns by
    ``v``) gives ``pᵀ G p`` of the brute-force GGN, without forward-mode products."""
    from pyro_subspace.subspaces import ekfac

    def no_jvp(*args, **kwargs):
        raise AssertionError("the forward-mode fallback ran")

    monkeypatch.setattr(ekfac, "ggn_in_subspace", no_jvp)
    net, shape = make()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    lik = likelihoods.Categorical()
    d = sum(p.numel() for p in net.parameters())
    sub = subspaces.kfac_eigen(net, lik, x, 10, eigenvalues="ekfac", candidates=min(30, d),
                               chunk_size=7, **options)  # fmt: skip
    p = sub.dense_basis()
    quotients = torch.einsum("dk,de,ek->k", p, brute_force_ggn(net, lik, x), p)
    scale = float(quotients.max())
    assert torch.allclose(sub.eigenvalues, quotients, rtol=1e3 * EPS, atol=1e3 * EPS * scale)
    assert (sub.eigenvalues[:-1] >= sub.eigenvalues[1:]).all()


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_laplace_front_door_equals_the_dense_basis(structure):
    from pyro_subspace import infer

    net, x, y, sub, dense = _problem()
    fits = []
    for s in (sub, dense):
        la = infer.Laplace(net, likelihoods.Categorical(), s, structure, prior_precision=1.0)
        la.fit(x, y)
        fits.append(la)
    a, b = fits
    assert torch.allclose(a.posterior_precision, b.posterior_precision, rtol=1e-10, atol=1e-12)
    assert torch.allclose(a(x[:5], link_approx="probit"), b(x[:5], link_approx="probit"),
                          rtol=1e-10, atol=1e-12)  # fmt: skip
    assert float(a.log_marginal_likelihood()) == pytest.approx(float(b.log_marginal_likelihood()),
                                                               rel=1e-10)  # fmt: skip
