"""A causal language model as a classifier of its next token: the outputs at the last position.

Laplace-LoRA (Yang et al. 2024, section 3) and laplace-torch's language-model example put a
Laplace approximation on a causal LM's prediction of one token (the next word, or the answer
of a multiple-choice question): the likelihood is categorical over the logits at the last
position of each prompt, optionally restricted to the answer tokens (``"A"``, ``"B"``, ...).
`LastToken` wraps such a model so that its output is exactly that ``(N, V)`` (or ``(N, C)``)
tensor, and every door of this library (Laplace, K-FAC, the samplers, ``fit_map``) sees an
ordinary classifier: with `likelihoods.Categorical` it is the causal-LM likelihood
``log p(y_n | x_n) = log softmax(f(x_n))[y_n]``, ``f(x_n)`` the logits at the last attended
position of sequence ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import batch as batching


class LastToken(nn.Module):
    """The logits of a causal LM at each sequence's last attended position.

    Args:
        model: a causal language model called as ``model(input_ids=..., attention_mask=...,
            **kwargs)``, returning logits ``(N, L, V)`` (a tensor, a tuple or a
            ``ModelOutput``: `batch.output`), e.g. a Hugging Face ``*ForCausalLM`` with or
            without a peft adapter. Its parameters are this module's (``model.`` prefix),
            frozen ones included.
        answer_tokens: token ids ``(C,)`` to keep (Laplace-LoRA's multiple-choice answers:
            a categorical over them), or ``None``: all ``V``.

    ``forward(input_ids (N, L), attention_mask (N, L) = None, **kwargs) -> (N, V | C)``: the
    position of row ``n`` is ``attention_mask[n].sum() − 1`` with right padding (the mask's
    last one with left padding: ``L − 1``), ``L − 1`` without a mask. Padding never changes a
    row's outputs where the model masks attention (causal attention needs no more).
    """

    def __init__(self, model: nn.Module, answer_tokens: Sequence[int] | torch.Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        if answer_tokens is not None:
            answer_tokens = torch.as_tensor(answer_tokens)
            if answer_tokens.dim() != 1 or answer_tokens.numel() < 2 or answer_tokens.is_floating_point():
                raise ValueError(
                    f"answer_tokens: expected two or more integer token ids (C,), got {answer_tokens!r}"
                )
            if answer_tokens.unique().numel() != answer_tokens.numel():
                raise ValueError("answer_tokens: the token ids must be distinct")
            self.register_buffer("answer_tokens", answer_tokens.long(), persistent=False)
        else:
            self.answer_tokens = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        logits = batching.output(self.model(input_ids=input_ids, **kwargs))  # (N, L, V)
        if logits.dim() != 3:
            raise ValueError(
                f"model: expected logits (N, L, V) of a causal language model, got {tuple(logits.shape)}"
            )
        n, length = logits.shape[:2]
        if attention_mask is None:
            last = torch.full((n,), length - 1, device=logits.device)
        else:  # the last attended position: right padding (sum − 1) or left padding (L − 1)
            positions = torch.arange(length, device=logits.device).expand(n, length)
            last = torch.where(attention_mask.bool(), positions, -1).amax(1)
        out = logits[torch.arange(n, device=logits.device), last]  # (N, V)
        if self.answer_tokens is not None:
            out = out.index_select(1, self.answer_tokens)
        return out
