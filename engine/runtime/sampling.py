"""Next-token choice: greedy, temperature, top-k, top-p, repetition penalty."""
from __future__ import annotations

import torch

from engine.config import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, recent_ids: list[int], generator: torch.Generator | None) -> int:
    """logits: [vocab] float32 -> token id."""
    if params.repetition_penalty != 1.0 and recent_ids:
        ids = torch.tensor(sorted(set(recent_ids)), dtype=torch.long, device=logits.device)
        picked = logits[ids]
        # as in CTRL / transformers: shrink positive logits, push negative ones further down
        logits = logits.clone()
        logits[ids] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > params.top_p   # keep the smallest set reaching top_p
        sorted_logits[drop] = float("-inf")
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
