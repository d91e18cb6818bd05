"""Float32 subnetwork Laplace (issue 13): float32 Jacobian products summed in float64 (`gram`),
the in-place LAPACK posterior (`linalg.posterior_factors_`), the guide's ``dtype`` buffers and
their fallback to float64, all against dense float64 linear algebra."""

import copy

import pytest
import torch
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces
from pyro_subspace.curvature import gram
from pyro_subspace.linalg import posterior_factors_, reverse_, symmetrize_
from pyro_subspace.infer import AutoSubspaceLaplace, linearized_moments

pytestmark = pytest.mark.usefixtures("one_thread")


def spd(k: int, cond: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
    values = torch.logspace(0, torch.tensor(cond).log10().item(), k, dtype=torch.float64)
    p = q @ torch.diag(values) @ q.T
    return (p + p.T) / 2


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("k", [64, 131])
def test_posterior_factors_against_the_dense_inverse(dtype, tol, k):
    p = spd(k, 100.0)
    prec, scale, cov = p.to(dtype), torch.empty(k, k, dtype=dtype), torch.empty(k, k, dtype=dtype)
    assert posterior_factors_(prec, scale, cov)
    want = torch.linalg.inv(p)
    assert (cov.double() - want).abs().max() <= tol * want.abs().max()
    assert torch.equal(cov, cov.T)
    assert torch.equal(scale, scale.tril())
    assert (scale.double() @ scale.double().T - want).abs().max() <= tol * want.abs().max()
    assert torch.equal(prec, p.to(dtype))  # the precision is left alone


def test_posterior_factors_refuse_what_float32_cannot_hold():
    k = 80
    bufs = [torch.empty(k, k) for _ in range(2)]
    assert not posterior_factors_(spd(k, 1e8).float(), *bufs)  # evidently ill-conditioned
    indefinite = spd(k, 10.0) - 2 * torch.eye(k, dtype=torch.float64)
    assert not posterior_factors_(indefinite.float(), *bufs)
    assert posterior_factors_(spd(k, 1e8), *[b.double() for b in bufs])  # float64 takes it


def test_symmetrize_and_reverse_in_place():
    a = torch.randn(9, 9)
    for upper, want in ((None, (a + a.T) / 2), (True, a.triu() + a.triu(1).T),
                        (False, a.tril() + a.tril(-1).T)):  # fmt: skip
        b = a.clone()
        assert symmetrize_(b, upper, block=4) is b
        assert torch.allclose(b, want, rtol=0, atol=1e-7) and torch.equal(b, b.T)
    b = a.clone()
    assert torch.equal(reverse_(b, block=7), a.flip(0, 1))


def test_float32_blocks_are_summed_in_float64(monkeypatch):
    """A large first block then many small ones: a float32 running sum loses the small ones
    (spacing 8 at 1e8), the float64 sum of the flushed float32 parts keeps them."""
    k = 64
    big = torch.full((1, 1, k), 1e4)
    small = [torch.ones(10, 1, k) for _ in range(200)]
    blocks = [big, *small]
    want = 1e8 + 2000.0
    monkeypatch.setattr(gram, "FLUSH_ROWS", 10)
    got = gram.gram_from_blocks(iter([(None, b) for b in blocks]), dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, got.T)
    assert (got - want).abs().max() == 0
    monkeypatch.setattr(gram, "FLUSH_ROWS", 10**9)  # one float32 sum: the test can fail
    plain = gram.gram_from_blocks(iter([(None, b) for b in blocks]), dtype=torch.float64)
    assert (plain - want).abs().max() > 100


@pytest.mark.parametrize("stage", [4, 20, 256])  # small blocks staged into one product
@pytest.mark.parametrize("flush", [7, 10**9])
def test_gram_of_float32_blocks_against_float64(monkeypatch, flush, stage):
    monkeypatch.setattr(gram, "FLUSH_ROWS", flush)
    monkeypatch.setattr(gram, "STAGE_ROWS", stage)
    gen = torch.Generator().manual_seed(1)
    blocks = [torch.randn(n, 3, 70, generator=gen) for n in (5, 9, 2, 11)]
    want = sum(torch.einsum("nck,ncj->kj", b.double(), b.double()) for b in blocks)
    for dtype in (None, torch.float32, torch.float64):
        got = gram.gram_from_blocks(iter([(None, b) for b in blocks]), dtype=dtype)
        assert got.dtype == (dtype or torch.float32) and torch.equal(got, got.T)
        assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


def setup(k=70, n=40, lam=1.0, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(n, 3), torch.randint(0, 4, (n,))
    d = sum(p.numel() for p in net.parameters())
    idx = torch.randperm(d, generator=torch.Generator().manual_seed(seed))[:k]

    def guide(dtype=None):
        sub = subspaces.subnetwork(net, strategy="indices", indices=idx)
        model = SubspaceNet(net, sub, likelihoods.Categorical(), prior_scale=lam**-0.5)
        la = AutoSubspaceLaplace(model, prior_precision=lam, prior_mean="zero", dtype=dtype)
        return la

    return guide, x, y


def test_float32_guide_against_a_float64_one():
    make, x, y = setup()
    la32, la64 = make(), make(torch.float64)
    assert la32.covariance.stride() == (0, 0)  # unfitted: zeros without memory
    la32.fit(x, y, find_map=False), la64.fit(x, y, find_map=False)
    for name in ("ggn", "precision", "covariance", "scale_tril"):
        a, b = getattr(la32, name), getattr(la64, name)
        assert a.dtype == torch.float32 and b.dtype == torch.float64
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), name
    assert torch.equal(la32.covariance, la32.covariance.T)
    c32 = linearized_moments(la32, x[:9])[1]
    c64 = linearized_moments(la64, x[:9])[1]
    assert c32.dtype == torch.float64
    assert (c32 - c64).abs().max() <= 1e-5 * c64.abs().max()
    draws = la32.sample_weights(3, seed=0)
    assert draws.shape[0] == 3 and torch.isfinite(draws).all()
    assert la32.get_posterior().scale_tril.dtype == torch.float64


def test_float32_guide_state_dict_round_trip(tmp_path):
    make, x, y = setup()
    fitted = make().fit(x, y, find_map=False)
    fresh = make()
    fresh.load_state_dict(make().state_dict())  # unfitted into unfitted
    fresh.load_state_dict(fitted.state_dict())
    assert torch.equal(fresh.covariance, fitted.covariance)
    assert torch.equal(linearized_moments(fresh, x[:5])[1], linearized_moments(fitted, x[:5])[1])
    # through a file, as a user saves it: torch.load(weights_only=True) into an unfitted guide
    torch.save(fitted.state_dict(), tmp_path / "guide.pt")
    loaded = make()
    loaded.load_state_dict(torch.load(tmp_path / "guide.pt", weights_only=True))
    assert loaded.covariance.dtype == torch.float32
    assert torch.equal(loaded.covariance, fitted.covariance)
    assert torch.equal(linearized_moments(loaded, x[:5])[1], linearized_moments(fitted, x[:5])[1])


def brute_force_ggn(net, idx, x):
    """``Σ_n J_nᵀ (diag(p) − p pᵀ) J_n`` over the weights ``idx`` of a float64 copy of ``net``,
    with the Jacobian from ``torch.autograd.functional.jacobian``."""
    net64 = copy.deepcopy(net).double()
    names = [n for n, _ in net64.named_parameters()]
    shapes = [p.shape for p in net64.parameters()]
    flat = nn.utils.parameters_to_vector(net64.parameters()).detach()

    def f(t):
        w = flat.index_put((idx,), flat[idx] + t)
        parts = torch.split(w, [s.numel() for s in shapes])
        params = {n: v.view(s) for n, v, s in zip(names, parts, shapes, strict=True)}
        return torch.func.functional_call(net64, params, x.double())

    t0 = torch.zeros(len(idx), dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(f, t0)  # shape: (N, O, K)
    p = f(t0).softmax(-1)
    h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("nok,nop,npl->kl", jac, h, jac)


def test_float32_small_prior_is_factorised_in_float64():
    """``λ = 1e-6`` with a rank-deficient GGN (N·(O−1) = 30 < K = 70). The fit takes Woodbury's
    route from the 30 GGN rows (`FullStructure.posterior_from_root_`), in float64 because
    float32 would cancel ``I − BᵀB`` (``κ ≈ 1e9``): the GGN's null space then keeps exactly
    ``1/λ``, so ``Σ`` matches the float64 inverse of a brute-force float64 GGN plus ``λ I``.
    Without the rows (a re-tuned curvature) the precision is formed again from the stored
    float32 curvature and factorised in float64: ``Σ`` is then the float64 inverse of the
    stored curvature plus ``λ I`` (float32 rounds the prior away, or nearly)."""
    make, x, y = setup(n=10, lam=1e-6)
    la = make().fit(x, y, find_map=False)
    assert la.covariance.dtype == torch.float32
    k = la.ggn.shape[0]
    eye = torch.eye(k, dtype=torch.float64)
    net, idx = la.model.flat.net, la.model.subspace.basis
    want = torch.linalg.inv(brute_force_ggn(net, idx, x) + 1e-6 * eye)
    assert (la.covariance.double() - want).abs().max() <= 1e-5 * want.abs().max()
    with torch.no_grad():  # a curvature changed in place (as a re-tuned noise scale does) no
        la.ggn.mul_(1.0)  # longer matches the kept rows: the dense route
    la.set_prior_precision(1e-6)
    want = torch.linalg.inv(la.ggn.double() + 1e-6 * eye)
    assert (la.covariance.double() - want).abs().max() <= 1e-5 * want.abs().max()
