# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Bayesian fine-tuning of a transformer: LoRA, Laplace-LoRA and subspace inference
#
# A pretrained transformer fine-tuned with a LoRA adapter is where Bayesian deep learning is
# used today. A LoRA adapter is a subspace of the weights; this tutorial treats it as one:
#
# 1. pretrain a small GPT-2 here as a causal language model on a synthetic language (nothing
#    is downloaded: with a real checkpoint this step is your `from_pretrained` line);
# 2. fine-tune a LoRA adapter (peft) for sequence classification with `fit_map` on the dict
#    batches every Hugging Face user has (`input_ids`, `attention_mask`, `labels`), collecting
#    the adapter's SWA trajectory (the base stays frozen and is never copied: the collector's
#    snapshots are the adapter's size);
# 3. **Laplace-LoRA** (Yang et al. 2024): K-FAC Laplace over the adapter, the prior precision
#    tuned by the evidence, the linearised (GLM) probit predictive;
# 4. **LoRA-subspace inference** (Izmailov et al. 2019 applied to the adapter): PCA of the
#    adapter's SWA trajectory, elliptical slice sampling in it at `T = N/K`, the Bayesian model
#    average;
# 5. **MoLA over three adapters** (Eschenhagen et al. 2021): one Laplace per adapter seed, mixed;
#
# and compares accuracy, NLL and ECE in distribution and under a shift (tokens replaced by
# noise). Run it as a script (`python tutorials/08_lora_transformer.py` or
# `pyro-subspace tutorial 08`); it needs the `[hf]` extra (`pip install pyro-subspace[hf]`);
# `PYRO_SUBSPACE_TINY=1` shrinks every setting for a smoke test.

# %%
import copy
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from pyro.infer import MCMC
from torch.utils.data import DataLoader

try:
    import peft
    import transformers
except ImportError:  # the [hf] extra
    sys.exit("this tutorial needs transformers and peft: pip install pyro-subspace[hf]")

from pyro_subspace import EllipticalSliceSampler, SubspaceNet, fit_map, infer, likelihoods, metrics, subspaces
from pyro_subspace.flat import FlatNet

TINY = os.environ.get("PYRO_SUBSPACE_TINY") == "1"
OUT = Path(os.environ.get("PYRO_SUBSPACE_OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
VOCAB, CLASSES, PAD = 24, 3, 0
N_TRAIN, N_TEST = (96, 60) if TINY else (600, 600)
PRETRAIN_STEPS, EPOCHS, SWA_EPOCHS = (30, 4, 3) if TINY else (400, 30, 10)
DRAWS, WARMUP, RANK = (8, 4, 2) if TINY else (200, 50, 5)
torch.manual_seed(0)

# %% [markdown]
# ## A synthetic language
# Each class speaks its own first-order Markov chain over the tokens `1 … 23` (transition
# rows drawn from a Dirichlet); sentences have 6 to 14 tokens and are right-padded with token
# 0. The shift replaces 30% of the tokens by uniformly random ones.

# %%
gen = torch.Generator().manual_seed(0)
transitions = torch.distributions.Dirichlet(torch.full((VOCAB - 1,), 0.3)).sample((CLASSES, VOCAB - 1))


def sentences(n: int, seed: int, noise: float = 0.0):
    """``(x, y)``: ``x = {"input_ids", "attention_mask"}`` ``(n, 14)`` right-padded, ``y`` ``(n,)``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    lengths = torch.randint(6, 15, (n,), generator=g)
    ids = torch.zeros(n, 14, dtype=torch.long)
    for i in range(n):
        tok = int(torch.randint(0, VOCAB - 1, (), generator=g))
        for j in range(int(lengths[i])):
            if noise and float(torch.rand((), generator=g)) < noise:
                tok = int(torch.randint(0, VOCAB - 1, (), generator=g))
            ids[i, j] = tok + 1
            tok = int(torch.multinomial(transitions[y[i], tok], 1, generator=g))
    mask = (ids != PAD).long()
    return {"input_ids": ids, "attention_mask": mask}, y


x_train, y_train = sentences(N_TRAIN, 1)
x_test, y_test = sentences(N_TEST, 2)
x_shift, y_shift = sentences(N_TEST, 3, noise=0.3)


def rows(x: dict, y: torch.Tensor) -> list[dict]:
    """Dict rows for a DataLoader: its batches are the dicts a Hugging Face collator gives."""
    return [{**{k: v[i] for k, v in x.items()}, "labels": y[i]} for i in range(len(y))]


train_loader = DataLoader(rows(x_train, y_train), batch_size=32, shuffle=True, generator=gen)

# %% [markdown]
# ## Pretraining (your `from_pretrained`)
# A 2-layer GPT-2 of width 32 learns the language as a causal LM: next-token prediction on
# sentences of every class. A plain PyTorch loop.

# %%
config = transformers.GPT2Config(
    vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, num_labels=CLASSES,
    pad_token_id=PAD, bos_token_id=PAD, eos_token_id=PAD,
)  # fmt: skip
lm = transformers.GPT2LMHeadModel(config)
opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
corpus, _ = sentences(4 * N_TRAIN, 4)
lm.train()
for step in range(PRETRAIN_STEPS):
    idx = torch.randint(0, len(corpus["input_ids"]), (32,), generator=gen)
    batch = {k: v[idx] for k, v in corpus.items()}
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss = lm(**batch, labels=labels).loss
    opt.zero_grad(), loss.backward(), opt.step()
print(f"pretraining: next-token loss {loss.item():.3f} after {PRETRAIN_STEPS} steps")


def lora_classifier(seed: int) -> torch.nn.Module:
    """The pretrained transformer with a classification head and a fresh LoRA adapter (r = 4
    on the attention projections): only the adapter and the head train."""
    torch.manual_seed(seed)
    clf = transformers.GPT2ForSequenceClassification(config)
    clf.transformer.load_state_dict(lm.transformer.state_dict())
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="SEQ_CLS"
    )  # GPT-2's c_attn is a Conv1D: fan_in_fan_out
    return peft.get_peft_model(clf, lora)


# %% [markdown]
# ## LoRA fine-tuning: the MAP, and the adapter's SWA trajectory
# `fit_map` takes the dict loader as it is; `SWACollector` and every subspace refer to the
# flat vector of the *trainable* weights, so a snapshot is the adapter (and head), not the
# model.

# %%
model = lora_classifier(0)
lik = likelihoods.Categorical()
swa = subspaces.SWACollector(model, max_snapshots=20)
fit_map(model, lik, train_loader, epochs=EPOCHS, lr=3e-3, weight_decay=1e-4)
fit_map(model, lik, train_loader, epochs=0, swa_epochs=SWA_EPOCHS, swa_lr=1e-3, collector=swa)
trainable = FlatNet(model).num_weights
total = sum(p.numel() for p in model.parameters())
print(f"adapter + head: {trainable} of {total} weights; a snapshot holds {swa.deviation_rows.shape[1]}")
model.eval()


def scores(name: str, probs_in: torch.Tensor, probs_shift: torch.Tensor) -> dict:
    row = {"method": name}
    for tag, probs, y in (("in", probs_in, y_test), ("shift", probs_shift, y_shift)):
        row[f"acc_{tag}"] = metrics.accuracy(probs, y)
        row[f"nll_{tag}"] = metrics.categorical_nll(probs, y)
        row[f"ece_{tag}"] = metrics.calibration_errors(probs, y, n_bins=10, min_count=0)[0]
    return row


with torch.no_grad():
    results = [scores("MAP", model(**x_test).logits.softmax(-1), model(**x_shift).logits.softmax(-1))]

# %% [markdown]
# ## Laplace-LoRA: K-FAC over the adapter, λ by the evidence
# `"all"` is every weight with `requires_grad`: the adapter and the head. The network's LoRA
# layers are `nn.Linear` on `(N, L, ·)` token inputs (K-FAC's *expand* convention, as
# laplace-torch's curvlinops backend computes it).

# %%
la = infer.Laplace(model, lik, "all", "kron")
la.fit(train_loader)
la.optimize_prior_precision(method="marglik")
print(f"Laplace-LoRA: λ = {float(la.prior_precision):.3g}, log evidence {float(la.log_marginal_likelihood()):.1f}")
results.append(scores("Laplace-LoRA", la(x_test), la(x_shift)))

# %% [markdown]
# ## Subspace inference in the adapter's trajectory
# PCA of the SWA snapshots (rank 5), elliptical slice sampling of the coordinates `t` at the
# temperature `T = N/K` of the Subspace Inference paper, and the Bayesian model average of the
# draws' predictions.

# %%
sub = subspaces.pca(swa, rank=RANK)
bayes = SubspaceNet(model, sub, lik, temperature="auto")
mcmc = MCMC(EllipticalSliceSampler(bayes), num_samples=DRAWS, warmup_steps=WARMUP, disable_progbar=True)
mcmc.run(x_train, y_train)
t = mcmc.get_samples()["t"]
with torch.no_grad():
    bma_in = bayes.outputs(t, x_test).softmax(-1).mean(0)
    bma_shift = bayes.outputs(t, x_shift).softmax(-1).mean(0)
results.append(scores("LoRA subspace ESS", bma_in, bma_shift))

# %% [markdown]
# ## MoLA over three adapters
# Three adapters from different seeds, trained one after the other on the *same* base (the
# frozen transformer is never copied: three members cost three adapters), each with its K-FAC
# Laplace over the adapter, mixed with equal weights (the paper's mixture probit predictive).

# %%
flat = FlatNet(model)
adapters = [flat.vector()]  # seed 0: the adapter trained above
for seed in (1, 2):
    flat.load_vector(FlatNet(lora_classifier(seed)).vector())  # a fresh adapter and head
    fit_map(model, lik, train_loader, epochs=EPOCHS, lr=3e-3, weight_decay=1e-4)
    adapters.append(flat.vector())
flat.load_vector(adapters[0])
model.eval()
mola = infer.MixtureOfLaplace.from_adapters(model, adapters, lik, hessian_structure="kron")
mola.fit(train_loader)
results.append(scores("MoLA (3 adapters)", mola.predict(x_test).probs, mola.predict(x_shift).probs))

# %%
keys = ["acc_in", "nll_in", "ece_in", "acc_shift", "nll_shift", "ece_shift"]
print(f"{'method':<20}" + "".join(f"{k:>11}" for k in keys))
for row in results:
    print(f"{row['method']:<20}" + "".join(f"{row[k]:>11.3f}" for k in keys))

fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
for ax, metric in zip(axes, ("nll", "ece")):
    names = [r["method"] for r in results]
    for i, tag in enumerate(("in", "shift")):
        ax.bar([j + 0.4 * i for j in range(len(names))], [r[f"{metric}_{tag}"] for r in results], 0.4, label=tag)
    ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20, fontsize=7)
    ax.set_title(metric.upper())
axes[0].legend()
fig.tight_layout()
fig.savefig(OUT / "lora_transformer.png", dpi=100)
