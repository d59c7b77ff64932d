"""Choosing the next token on the model's device: only the chosen id crosses to the host.

The same rule as the llama.cpp backends: the repeat penalty over the last REPEAT_LAST_N tokens
(prompt included), then greedy at temperature 0, else temperature → top-k → top-p → min-p and
a draw from a generator seeded per request.
"""

from __future__ import annotations

import torch


def penalized(logits: torch.Tensor, recent: torch.Tensor | None, request) -> torch.Tensor:
    """logits [V] after the repeat penalty over recent tokens."""
    if request.repeat_penalty != 1.0 and recent is not None and recent.numel():
        seen = torch.unique(recent)
        values = logits.index_select(0, seen)
        logits = logits.index_copy(0, seen, torch.where(values > 0, values / request.repeat_penalty,
                                                         values * request.repeat_penalty))
    return logits


def probabilities(logits: torch.Tensor, recent: torch.Tensor | None, request) -> torch.Tensor:
    """The distribution [V] a sampled token is drawn from (temperature > 0): penalty, temperature,
    top-k, top-p, min-p, normalized. Speculation's rejection rule compares these."""
    logits = penalized(logits, recent, request) / request.temperature
    if request.top_k > 0:
        kth = torch.topk(logits, min(request.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if 0 < request.top_p < 1:
        ordered, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(ordered, 0) - ordered >= request.top_p
        probs = probs.index_fill(0, order[drop], 0.0)
    if request.min_p > 0:
        probs = probs.masked_fill(probs < request.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def pick(logits: torch.Tensor, recent: torch.Tensor | None, request, generator: torch.Generator | None) -> torch.Tensor:
    """The next token (a 0-dim tensor on logits' device) from logits [V] float32.

    recent: the last tokens [≤ 64] on the same device, for the repeat penalty.
    """
    if request.temperature == 0:
        return torch.argmax(penalized(logits, recent, request))
    return torch.multinomial(probabilities(logits, recent, request), 1, generator=generator)[0]
