"""Hugging Face models with a LoRA adapter, fed dict batches as their users hold them.

Tiny float64 configs (no downloads) of GPT-2, BERT and a Llama-shaped model for sequence
classification, each with a peft LoRA adapter on its attention projections (the base frozen;
the adapter and the classification head trainable). The inputs are mappings
``{"input_ids", "attention_mask"}``, right-padded, and the loaders yield dict batches with
``"labels"`` (`batch`, `data.split_batch`). Checked:

- the rule: a mapping reaches the model as keyword arguments, and the ``ModelOutput``'s
  ``logits`` are the outputs (`FlatNet` against the model's own call);
- ``infer.Laplace(..., "all", "full" | "diag")`` over the trainable weights on a dict loader:
  the GGN against brute-force ``jacrev`` Jacobians of each sequence alone (``1e-8``);
- right padding never changes a row's prediction (``≤ 1e-5``), K-FAC and full;
- K-FAC over the adapter against laplace-torch's ``KronLaplace`` (curvlinops backend, its
  ``dict_key_x``/``dict_key_y``; skipped without laplace-torch);
- ``fit_map`` on dict batches trains the adapter and leaves the frozen base as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader

from pyro_subspace import fit_map, infer, likelihoods
from pyro_subspace.flat import FlatNet, flat_parameters

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
N, L, VOCAB, CLASSES, LAM = 8, 6, 30, 3, 0.5
EXACT = 1e-8


def _model(kind: str) -> nn.Module:
    """A tiny sequence classifier of ``kind`` with a LoRA adapter (r = 2), float64, eval mode;
    the adapter's ``B`` drawn (peft starts it at zero) so that its Jacobians are not trivial."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_labels=CLASSES, pad_token_id=0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=16, n_head=2, n_positions=16, bos_token_id=1, eos_token_id=1,
            **common,
        )  # fmt: skip
        base, targets = transformers.GPT2ForSequenceClassification(cfg), ["c_attn"]
    elif kind == "bert":
        cfg = transformers.BertConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, **common,
        )  # fmt: skip
        base, targets = transformers.BertForSequenceClassification(cfg), ["query", "value"]
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, max_position_embeddings=16, bos_token_id=1, eos_token_id=1,
            **common,
        )  # fmt: skip
        base, targets = transformers.LlamaForSequenceClassification(cfg), ["q_proj", "v_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=targets, task_type="SEQ_CLS"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model.to(F64).eval()


def _data(seed: int = 1):
    """``(x, y, rows)``: right-padded ``input_ids``/``attention_mask`` ``(N, L)``, labels, and
    the dict rows a ``DataLoader`` batches."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (N, L), generator=g)
    lengths = torch.tensor([3, 2, 4, L, 5, L, 2, 3])  # batches of 3 padded to 4, 6, 3
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # pad id 0 after each sequence
    y = torch.randint(0, CLASSES, (N,), generator=g)
    x = {"input_ids": ids, "attention_mask": mask}
    rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]} for i in range(N)]
    return x, y, rows


def _row(x: dict, i: int, trim: bool = False) -> dict:
    """Row ``i`` as a batch of one (``trim``: without its padding)."""
    n = int(x["attention_mask"][i].sum()) if trim else x["input_ids"].shape[1]
    return {k: v[i : i + 1, :n] for k, v in x.items()}


def _brute_ggn(model: nn.Module, x: dict) -> torch.Tensor:
    """``Σ_n J_nᵀ H_n J_n`` over the trainable weights, each sequence alone (Categorical)."""
    named = flat_parameters(model)
    params = [p.detach() for _, p in named]
    theta = torch.cat([p.reshape(-1) for p in params])

    def logits(th: torch.Tensor, row: dict) -> torch.Tensor:
        parts = th.split([p.numel() for p in params])
        weights = {n: t.reshape(p.shape) for (n, p), t in zip(named, parts)}
        return functional_call(model, weights, (), row).logits[0]

    ggn = torch.zeros(theta.numel(), theta.numel(), dtype=F64)
    for i in range(N):
        row = _row(x, i)
        j = jacrev(logits)(theta, row)
        p = torch.softmax(logits(theta, row), -1)
        ggn += j.T @ (torch.diag(p) - torch.outer(p, p)) @ j
    return ggn


KINDS = ["gpt2", "bert", "llama"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_mapping_reaches_the_model_as_keywords_and_its_logits_are_the_outputs(kind):
    model = _model(kind)
    x, _, _ = _data()
    flat = FlatNet(model)
    assert flat.num_weights == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        torch.testing.assert_close(flat(flat.vector(), x), model(**x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_full_and_diag_laplace_on_a_dict_loader_equal_the_brute_force_ggn(kind):
    model = _model(kind)
    x, _, rows = _data()
    ggn = _brute_ggn(model, x)
    d = ggn.shape[0]
    loader = DataLoader(rows, batch_size=3)
    full = infer.Laplace(model, likelihoods.Categorical(), "all", "full", prior_precision=LAM)
    full.fit(loader)
    prec = full.posterior_precision - LAM * torch.eye(d, dtype=F64)
    assert float((prec - ggn).abs().max() / ggn.abs().max()) < EXACT
    diag = infer.Laplace(model, likelihoods.Categorical(), "all", "diag", prior_precision=LAM)
    diag.fit(loader)
    assert float((diag.posterior_precision - LAM - ggn.diagonal()).abs().max() / ggn.diagonal().max()) < EXACT


@pytest.mark.parametrize("structure", ["kron", "full"])
@pytest.mark.parametrize("kind", KINDS)
def test_right_padding_never_changes_a_prediction(kind, structure):
    model = _model(kind)
    x, y, _ = _data()
    la = infer.Laplace(model, likelihoods.Categorical(), "all", structure, prior_precision=LAM)
    la.fit(x, y)
    padded = la(x, link_approx="probit")
    for i in range(N):
        alone = la(_row(x, i, trim=True), link_approx="probit")
        torch.testing.assert_close(padded[i : i + 1], alone, rtol=0, atol=1e-5)


class _Logits(nn.Module):
    """laplace-torch's Hugging Face guide: a wrapper returning the logits of a dict batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, data):
        return self.model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits


@pytest.mark.parametrize("kind", KINDS)
def test_kron_over_the_adapter_equals_laplace_torch(kind):
    laplace = pytest.importorskip("laplace", reason="laplace-torch is a comparison only")
    from laplace.curvature import CurvlinopsGGN

    model = _model(kind)
    x, y, rows = _data()
    ours = infer.Laplace(model, likelihoods.Categorical(), "all", "kron", prior_precision=LAM)
    ours.fit(DataLoader(rows, batch_size=N))
    theirs = laplace.Laplace(
        _Logits(copy.deepcopy(model)), "classification", subset_of_weights="all",
        hessian_structure="kron", backend=CurvlinopsGGN, prior_precision=LAM,
    )  # fmt: skip
    theirs.fit(DataLoader(rows, batch_size=N))
    want = theirs.posterior_precision.to_matrix()
    got = ours.guide.posterior.precision()
    assert float((got - want).norm() / want.norm()) < 1e-6


def test_fit_map_trains_the_adapter_on_dict_batches_and_leaves_the_base():
    model = _model("gpt2")
    x, y, rows = _data()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lik = likelihoods.Categorical()
    before = float(nn.functional.cross_entropy(model(**x).logits, y))
    history = fit_map(model, lik, DataLoader(rows, batch_size=4), epochs=20, lr=1e-2, progress=False)
    after = float(nn.functional.cross_entropy(model(**x).logits, y))
    assert after < before and history[-1] < history[0]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    history = fit_map(model, lik, x, y, epochs=3, lr=1e-2, batch_size=4, progress=False)
    assert len(history) == 3


def _pad_to_longest(rows: list[dict]) -> dict:
    """A collate function that pads each batch to its own longest sequence (right padding), as
    Hugging Face's ``DataCollatorWithPadding`` does: batches of different lengths."""
    n = max(int(r["attention_mask"].sum()) for r in rows)
    return {
        "input_ids": torch.stack([r["input_ids"][:n] for r in rows]),
        "attention_mask": torch.stack([r["attention_mask"][:n] for r in rows]),
        "labels": torch.stack([r["labels"] for r in rows]),
    }


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_batches_of_different_padded_lengths_give_the_row_by_row_likelihood(kind):
    """The evaluator behind the samplers and the Laplace evidence takes a loader's batches as
    they come (here padded to 2, 6, ... tokens): ``log p(D | t)`` equals the sum over the
    sequences, each alone and unpadded, at ``w = ŵ + P t``."""
    from pyro_subspace import SubspaceNet, subspaces

    model = _model(kind)
    x, y, rows = _data()
    loader = DataLoader(rows, batch_size=3, collate_fn=_pad_to_longest)
    assert len({b["input_ids"].shape[1] for b in loader}) > 1
    sub = subspaces.random(model, rank=3, seed=0)
    net = SubspaceNet(model, sub, likelihoods.Categorical())
    t = torch.tensor([0.2, -0.1, 0.3], dtype=F64)
    got = net.evaluator(loader).log_likelihood(t)
    FlatNet(model).load_vector(sub.shift + sub.basis @ t)
    with torch.no_grad():
        want = sum(
            float(torch.log_softmax(model(**_row(x, i, trim=True)).logits[0], -1)[y[i]])
            for i in range(N)
        )
    assert abs(got - want) < 1e-10 * abs(want)


class _Conv1DNet(nn.Module):
    """Two of GPT-2's ``Conv1D`` on token inputs ``(N, L, 3)``, or their ``nn.Linear`` twin
    (``W`` transposed): curvlinops takes only the latter."""

    def __init__(self, twin: bool = False) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.embed = nn.Linear(3, 5) if twin else Conv1D(5, 3)
        self.head = nn.Linear(5, CLASSES) if twin else Conv1D(CLASSES, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)).mean(1))


@pytest.mark.parametrize("conv", ["expand", "reduce"])
def test_conv1d_kfac_equals_curvlinops_on_the_linear_twin(conv):
    curvlinops = pytest.importorskip("curvlinops", reason="curvlinops is a comparison only")
    from pyro_subspace.curvature import kfac

    torch.manual_seed(0)
    net, twin = _Conv1DNet().to(F64), _Conv1DNet(twin=True).to(F64)
    with torch.no_grad():
        for a, b in ((net.embed, twin.embed), (net.head, twin.head)):
            b.weight.copy_(a.weight.T), b.bias.copy_(a.bias)
    x = torch.randn(9, 4, 3, dtype=F64)
    y = torch.randint(0, CLASSES, (9,))
    ours = kfac(net, likelihoods.Categorical(), x, conv=conv)
    assert [b.kind for b in ours.blocks] == ["kron", "full", "kron", "full"]  # no fallback
    theirs = curvlinops.KFACLinearOperator(
        twin, nn.CrossEntropyLoss(reduction="sum"), list(twin.parameters()), [(x, y)],
        fisher_type="type-2", kfac_approx=conv, separate_weight_and_bias=True,
        check_deterministic=False,
    )  # fmt: skip
    d = sum(p.numel() for p in twin.parameters())
    want = theirs @ torch.eye(d, dtype=F64)
    # the twin's order: W (out, in) row-major; ours: Conv1D's W (in, out) row-major
    perm = torch.cat([
        torch.arange(15).reshape(3, 5).T.reshape(-1), 15 + torch.arange(5),
        20 + torch.arange(5 * CLASSES).reshape(5, CLASSES).T.reshape(-1), 20 + 5 * CLASSES + torch.arange(CLASSES),
    ])  # fmt: skip
    got = ours.to_dense()[perm][:, perm]
    assert float((got - want).norm() / want.norm()) < 1e-6


def test_a_fully_trainable_gpt2_keeps_kfac_on_every_conv1d():
    from pyro_subspace.curvature import kfac

    model = _model("gpt2").get_base_model()
    model.requires_grad_(True)
    x, _, _ = _data()
    factors = kfac(model, likelihoods.Categorical(), x)
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    kinds: dict[str, list[str]] = {}
    for b in factors.blocks:
        kinds.setdefault(b.module, []).append(b.kind)
    assert all(kinds[name] == ["kron", "full"] for name in conv1d)  # weight, bias


def _causal_lm(kind: str) -> nn.Module:
    """A tiny causal LM of ``kind`` with a LoRA adapter, float64, eval mode."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB, bos_token_id=1,
            eos_token_id=1, pad_token_id=0,
        )  # fmt: skip
        base, targets = transformers.GPT2LMHeadModel(cfg), ["c_attn"]
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, max_position_embeddings=16, vocab_size=VOCAB, bos_token_id=1,
            eos_token_id=1, pad_token_id=0,
        )  # fmt: skip
        base, targets = transformers.LlamaForCausalLM(cfg), ["q_proj", "v_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=targets, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model.to(F64).eval()


@pytest.mark.parametrize("answers", [None, [5, 7, 11]])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_causal_lm_likelihood_is_the_last_tokens_categorical(kind, answers):
    """`LastToken` + `Categorical`: ``log p(y | x)`` and the GGN of the adapter against each
    sequence run alone and unpadded, its logits at the last token (restricted to the answer
    tokens) by hand."""
    from pyro_subspace import SubspaceNet, subspaces
    from pyro_subspace.nn import LastToken

    lm = _causal_lm(kind)
    net = LastToken(lm, answers)
    x, _, _ = _data()
    classes = VOCAB if answers is None else len(answers)
    y = torch.randint(0, classes, (N,), generator=torch.Generator().manual_seed(3))

    def by_hand(row: dict) -> torch.Tensor:
        logits = lm(**row).logits[0, -1]
        return logits if answers is None else logits[answers]

    with torch.no_grad():
        want = sum(float(torch.log_softmax(by_hand(_row(x, i, trim=True)), -1)[y[i]]) for i in range(N))
    sub = subspaces.random(net, rank=2, seed=0)
    got = SubspaceNet(net, sub, likelihoods.Categorical()).evaluator(x, y).log_likelihood(torch.zeros(2, dtype=F64))
    assert abs(got - want) < 1e-10 * abs(want)
    # the Laplace GGN over the adapter (full) against brute-force Jacobians of each sequence
    named = flat_parameters(net)
    params = [p.detach() for _, p in named]
    theta = torch.cat([p.reshape(-1) for p in params])

    def logits_at(th, row):
        parts = th.split([p.numel() for p in params])
        return functional_call(net, {n: t.reshape(p.shape) for (n, p), t in zip(named, parts)}, (), row)[0]

    ggn = torch.zeros(theta.numel(), theta.numel(), dtype=F64)
    for i in range(N):
        row = _row(x, i, trim=True)
        j = jacrev(logits_at)(theta, row)
        p = torch.softmax(logits_at(theta, row), -1)
        ggn += j.T @ (torch.diag(p) - torch.outer(p, p)) @ j
    la = infer.Laplace(net, likelihoods.Categorical(), "all", "full", prior_precision=LAM).fit(x, y)
    prec = la.posterior_precision - LAM * torch.eye(theta.numel(), dtype=F64)
    assert float((prec - ggn).abs().max() / ggn.abs().max()) < EXACT


def test_dict_key_y_names_the_targets_of_a_dict_loader():
    """laplace-torch's ``Laplace(..., dict_key_x=, dict_key_y=)``: batches whose targets are
    under another key give the same fit as the default ``"labels"``."""
    model = _model("gpt2")
    x, y, rows = _data()
    renamed = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "target": r["labels"]} for r in rows]
    default = infer.Laplace(model, "classification", "all", "full", prior_precision=LAM).fit(DataLoader(rows, batch_size=3))
    keyed = infer.Laplace(model, "classification", "all", "full", prior_precision=LAM, dict_key_x="input_ids", dict_key_y="target")
    keyed.fit(DataLoader(renamed, batch_size=3))
    torch.testing.assert_close(keyed.posterior_precision, default.posterior_precision, rtol=0, atol=0)
    torch.testing.assert_close(keyed.log_marginal_likelihood(), default.log_marginal_likelihood())
    with pytest.raises(ValueError, match="dict_key_y="):
        infer.Laplace(model, "classification", "all", "full").fit(DataLoader(renamed, batch_size=3))


def test_mola_over_adapters_shares_one_base_and_equals_mola_over_copies():
    """`MixtureOfLaplace.from_adapters`: three LoRA adapters of one GPT-2 give the mixture of
    three deep copies (one adapter each) to rounding, holding one model and three adapters."""
    from pyro_subspace.infer import MixtureOfLaplace
    from pyro_subspace.infer.laplace import all_weights

    model = _model("gpt2")
    x, y, _ = _data()
    flat = FlatNet(model)
    adapters = []
    for seed in range(3):
        torch.manual_seed(seed)
        adapters.append(flat.vector() + 0.05 * torch.randn(flat.num_weights, dtype=F64))
    copies = []
    for w in adapters:
        member = copy.deepcopy(model)
        FlatNet(member).load_vector(w)
        copies.append(member)
    w0 = flat.vector()
    shared = MixtureOfLaplace.from_adapters(model, adapters, likelihoods.Categorical(), hessian_structure="kron").fit(x, y)
    separate = MixtureOfLaplace(copies, likelihoods.Categorical(), subset=all_weights, hessian_structure="kron").fit(x, y)
    torch.testing.assert_close(shared.predict(x).probs, separate.predict(x).probs, rtol=1e-9, atol=1e-12)
    assert torch.equal(flat.vector(), w0)  # the shared network's weights are put back
    assert {id(m.flat.net) for m, _ in shared.members} == {id(model)}
    assert all(m.subspace.shift.numel() == flat.num_weights for m, _ in shared.members)


def test_a_peft_wrapper_without_task_type_is_looked_through():
    """peft's ``PeftModel`` (no task type) has ``forward(*args, **kwargs)`` and passes both on:
    around a user's ``forward(self, data)`` (laplace-torch's Hugging Face guide) the mapping
    goes in as one argument, around a Hugging Face model as keywords (`batch.as_keywords`)."""
    from pyro_subspace import batch

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf_model = _model("gpt2").get_base_model()

        def forward(self, data):
            return self.hf_model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits

    x, _, _ = _data()
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"])
    for inner, keywords in ((Wrapper(), False), (_model("gpt2").get_base_model(), True)):
        wrapped = peft.get_peft_model(inner, lora).to(F64).eval()
        assert batch.as_keywords(wrapped, x) is keywords
        direct = wrapped(**x) if keywords else wrapped(x)
        assert torch.equal(batch.call(wrapped, x), batch.output(direct))
