"""``feature_reduction`` of a last-layer Laplace on sequence features (`subspaces.feature_reduction`).

Checked against independent computations:

- the mask-blind reductions against laplace-torch 0.3's own ``FeatureExtractor`` (exactly), the
  mask-aware ones against their closed forms written out by hand;
- ``infer.Laplace(..., "last_layer", structure, feature_reduction=r)`` against laplace-torch's
  ``Laplace`` with the same arguments on a tiny GPT-2 built from its config (float64, dict
  batches): the GLM predictive's mean and variances and the log evidence, relative ``1e-6``
  (laplace-torch's ``"full"`` last-layer GGN differs from brute-force ``jacrev`` by 3e-8
  relative on these models, ours by 4e-16: ``1e-6`` leaves a 30-fold margin above that), for
  each reduction on a network where it is the network's own pooling, and for laplace-torch's
  Hugging Face recipe under right padding (``"pick_last"`` then reads a padding token:
  the predictive follows laplace-torch, a `ReductionWarning` says so, and the GGN stays the
  network's exact one, checked against ``jacrev``);
- with right padding and the attention mask, ``"pick_last_token"`` and ``"masked_average"``
  give every row the prediction it has alone, unpadded (``≤ 1e-5``; float64 rounding is
  1e-12 here), where ``"pick_last"`` does not (its variances move by more than 1e-3).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader

from pyro_subspace import infer
from pyro_subspace.subspaces import LastLayerSubspace
from pyro_subspace.subspaces.feature_reduction import check_reduction, reduce_features
from pyro_subspace.subspaces.last_layer import ReductionWarning

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
N, L, VOCAB, C, WIDTH, LAM = 12, 6, 30, 3, 16, 0.7
REL = 1e-6  # the module docstring
PADDING = 1e-5  # the bound; float64 rounding is far below it
LENGTHS = [3, 2, 4, L, 5, L, 2, 3, L, 4, 5, 6]


def _config():
    return transformers.GPT2Config(
        n_layer=2, n_embd=WIDTH, n_head=2, n_positions=16, vocab_size=VOCAB, num_labels=C,
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip


class Classifier(nn.Module):
    """A tiny GPT-2 sequence classifier taking one dict argument, as laplace-torch's Hugging
    Face guide wraps one. ``pool``: ``"hf"`` (``GPT2ForSequenceClassification``: the last
    non-padding token's logits), ``"first"`` (the head on every token, position 0 kept),
    ``"mean"`` (the mean over all positions) or ``"masked_mean"`` (over the attended ones)."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.pool = pool
        if pool == "hf":
            self.hf = transformers.GPT2ForSequenceClassification(_config())
        else:
            self.body = transformers.GPT2Model(_config())
            self.head = nn.Linear(WIDTH, C)

    def forward(self, data):
        ids, mask = data["input_ids"], data["attention_mask"]
        if self.pool == "hf":
            return self.hf(input_ids=ids, attention_mask=mask).logits
        z = self.head(self.body(input_ids=ids, attention_mask=mask).last_hidden_state)
        if self.pool == "first":
            return z[:, 0]
        if self.pool == "mean":
            return z.mean(1)
        m = mask.to(z.dtype)[..., None]
        return (z * m).sum(1) / m.sum(1)


def _net(pool: str) -> nn.Module:
    torch.manual_seed(0)
    return Classifier(pool).to(F64).eval()


def _data(padded: bool):
    """``(x, rows)``: ``input_ids``/``attention_mask`` ``(N, L)`` (right-padded with ``padded``)
    and the dict rows (with ``labels``) a ``DataLoader`` batches."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor(LENGTHS if padded else [L] * N)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    ids = torch.randint(2, VOCAB, (N, L), generator=g) * mask  # padding: token 0
    y = torch.randint(0, C, (N,), generator=g)
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]} for i in range(N)]
    return {"input_ids": ids, "attention_mask": mask}, rows


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def _both(pool, reduction, structure, padded):
    """Our fitted Laplace and laplace-torch's on the same network and loader, with the test
    inputs."""
    lt = pytest.importorskip("laplace", reason="laplace-torch is a comparison, not a dependency")
    x, rows = _data(padded)
    net = _net(pool)
    theirs = lt.Laplace(
        net, "classification", subset_of_weights="last_layer", hessian_structure=structure,
        feature_reduction=reduction, prior_precision=LAM,
    )  # fmt: skip
    theirs.fit(DataLoader(rows, batch_size=4))
    ours = infer.Laplace(
        net, "classification", subset_of_weights="last_layer", hessian_structure=structure,
        feature_reduction=reduction, prior_precision=LAM,
    )  # fmt: skip
    ours.fit(DataLoader(rows, batch_size=4))
    return ours, theirs, x, net


# ---------------------------------------------------------------------------- the reductions


@pytest.mark.parametrize("reduction", ["pick_first", "pick_last", "average"])
@pytest.mark.parametrize("shape", [(4, 5, 3), (4, 2, 5, 3)])
def test_reductions_are_laplace_torchs(reduction, shape):
    lt_fe = pytest.importorskip("laplace.utils.feature_extractor")
    h = torch.randn(*shape, dtype=F64)
    model = nn.Sequential(nn.Identity(), nn.Linear(shape[-1], 2)).to(F64)
    extractor = lt_fe.FeatureExtractor(model, last_layer_name="1", feature_reduction=reduction)
    _, theirs = extractor.forward_with_features(h)
    assert torch.equal(reduce_features(h, reduction), theirs)


def test_masked_reductions_closed_form():
    h = torch.arange(2 * 4 * 2, dtype=F64).reshape(2, 4, 2)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])  # right- and left-padded rows
    last = reduce_features(h, "pick_last_token", mask)
    assert torch.equal(last, torch.stack([h[0, 1], h[1, 3]]))
    mean = reduce_features(h, "masked_average", mask)
    assert torch.allclose(mean, torch.stack([h[0, :2].mean(0), h[1, 1:].mean(0)]), rtol=0, atol=1e-15)
    one = reduce_features(h[:1], "pick_last_token", mask[:1])
    assert one.shape == (1, 2)  # one row keeps its batch dimension (laplace-torch squeezes it)
    with pytest.raises(ValueError, match="all zeros"):
        reduce_features(h, "masked_average", torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"needs features \(n, T, P\)"):
        reduce_features(h, "pick_last_token", None)


def test_arguments_are_checked():
    assert check_reduction(None) is None
    lt_fe = pytest.importorskip("laplace.utils.feature_extractor")
    assert check_reduction(lt_fe.FeatureReduction.PICK_LAST) == "pick_last"
    with pytest.raises(ValueError, match="feature_reduction"):
        check_reduction("last")
    net = _net("hf")
    with pytest.raises(ValueError, match="feature_reduction"):
        infer.Laplace(net, "classification", "last_layer", feature_reduction="max")
    with pytest.raises(TypeError, match="feature_reduction: only used with subset_of_weights='last_layer'"):
        infer.Laplace(net, "classification", "all", feature_reduction="pick_last")
    # a mask-aware reduction on inputs without a mask: named before the fit's pass
    sub = LastLayerSubspace(net, feature_reduction="pick_last_token")
    x, _ = _data(False)
    from pyro_subspace.flat import FlatNet

    flat = FlatNet(net)
    with pytest.raises(ValueError, match="feature_reduction: 'pick_last_token' reads the attention mask"):
        sub.closed_form(flat, {"input_ids": x["input_ids"]}, flat.vector())


# ---------------------------------------------------------------------------- vs laplace-torch


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
@pytest.mark.parametrize(
    "pool, reduction", [("hf", "pick_last"), ("first", "pick_first"), ("mean", "average")]
)
def test_matches_laplace_torch(pool, reduction, structure):
    """Each reduction on a network whose own pooling it is (no padding for ``"hf"``)."""
    ours, theirs, x, _ = _both(pool, reduction, structure, padded=False)
    f_mu, f_var = theirs._glm_predictive_distribution(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReductionWarning)  # faithful: no warning
        mean, var = ours._glm_moments(x)
    assert rel(mean, f_mu) < REL and rel(var, f_var) < REL
    assert rel(ours(x), theirs(x)) < REL  # probit probabilities
    for lam in (LAM, 3.0):
        lam_t = torch.tensor([lam], dtype=F64)
        assert rel(ours.log_marginal_likelihood(lam_t), theirs.log_marginal_likelihood(lam_t)) < REL


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_right_padding_pick_last_follows_laplace_torch(structure):
    """laplace-torch's Hugging Face recipe under right padding: ``"pick_last"`` reads padding
    tokens. The predictive follows laplace-torch's (with a warning); the GGN is the network's
    exact one (laplace-torch's default curvlinops backend forms it too)."""
    ours, theirs, x, net = _both("hf", "pick_last", structure, padded=True)
    f_mu, f_var = theirs._glm_predictive_distribution(x)
    with pytest.warns(ReductionWarning, match="pick_last_token"):
        mean, var = ours._glm_moments(x)
    assert rel(mean, f_mu) < REL and rel(var, f_var) < REL
    assert rel(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()) < REL
    if structure != "full":
        return
    weight = net.hf.score.weight.detach()  # brute force: one jacrev per sequence

    def f(wv, xd):
        return functional_call(net, {"hf.score.weight": wv}, (xd,))

    ggn = torch.zeros(weight.numel(), weight.numel(), dtype=F64)
    for i in range(N):
        xi = {k: v[i : i + 1] for k, v in x.items()}
        jac = jacrev(f)(weight, xi).reshape(C, -1)
        p = torch.softmax(f(weight, xi)[0], -1)
        ggn += jac.T @ (torch.diag(p) - p[:, None] * p[None, :]) @ jac
    assert rel(ours.guide.posterior.curvature(), ggn) < 1e-10


# ---------------------------------------------------------------------------- padding


@pytest.mark.parametrize("pool, reduction", [("hf", "pick_last_token"), ("masked_mean", "masked_average")])
def test_padding_never_changes_a_prediction(pool, reduction):
    x, rows = _data(padded=True)
    net = _net(pool)
    la = infer.Laplace(
        net, "classification", "last_layer", "full", feature_reduction=reduction, prior_precision=LAM
    )
    la.fit(DataLoader(rows, batch_size=4))
    extra = {k: torch.cat([v, torch.zeros(N, 3, dtype=v.dtype)], 1) for k, v in x.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReductionWarning)
        mean, var = la._glm_moments(extra)  # every row padded by three more tokens
        for i, n in enumerate(LENGTHS):
            alone = {k: v[i : i + 1, :n] for k, v in x.items()}  # the row unpadded
            m_i, v_i = la._glm_moments(alone)
            assert (mean[i] - m_i[0]).abs().max() <= PADDING
            assert (var[i] - v_i[0]).abs().max() <= PADDING
    # the mask-blind reduction reads padding: the same check fails by far
    blind = infer.Laplace(net, "classification", "last_layer", "full", feature_reduction="pick_last", prior_precision=LAM)
    blind.fit(DataLoader(rows, batch_size=4))
    alone = {k: v[1:2, : LENGTHS[1]] for k, v in x.items()}
    with pytest.warns(ReductionWarning):
        _, var_blind = blind._glm_moments(extra)
        _, var_alone = blind._glm_moments(alone)
    assert (var_blind[1] - var_alone[0]).abs().max() > 1e-3
