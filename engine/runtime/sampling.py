"""Next-token choice: repetition penalty, then greedy, or temperature, top-k, top-p and a draw.

Written twice, side by side: `sample` over torch (the engine's steps) and `sample_numpy` for the torch-free
one-shot path (engine/runtime/quick.py, which must not import torch: 2 s). Both take their settings
through the same helpers in the same order, and tests/test_families.py holds that they choose the same
token wherever the choice needs no random draw (greedy, top-k 1, a top-p that keeps one token). The
draws themselves differ (torch's generator against numpy's), which is why a seeded sample is the engine's
alone (quick.covers).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvchat.engine.config import SamplingParams

if TYPE_CHECKING:
    import torch


def penalized_ids(params: SamplingParams, recent_ids: list[int]) -> list[int]:
    """The ids the repetition penalty applies to, each once, in order; [] when it is off."""
    return sorted(set(recent_ids)) if params.repetition_penalty != 1.0 and recent_ids else []


def kept_top_k(params: SamplingParams, vocab: int) -> int:
    """How many tokens top-k keeps (0: top-k is off)."""
    return min(params.top_k, vocab) if params.top_k else 0


def sample(logits: "torch.Tensor", params: SamplingParams, recent_ids: list[int],
           generator: "torch.Generator | None") -> int:
    """logits: [vocab] float32 -> token id."""
    import torch         # here, so that the one-shot path can import this module without torch
    logits = processed(logits, params, recent_ids)
    if params.greedy:
        return int(logits.argmax())
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def distribution(logits: "torch.Tensor", params: SamplingParams, recent_ids: list[int]) -> "torch.Tensor":
    """The probabilities sample() draws from, [vocab] (greedy: all on its one choice); speculative decoding's
    acceptance rule reads them."""
    import torch
    logits = processed(logits, params, recent_ids)
    if params.greedy:
        return torch.zeros_like(logits).index_fill_(0, logits.argmax().view(1), 1.0)
    return logits.softmax(-1)


def processed(logits: "torch.Tensor", params: SamplingParams, recent_ids: list[int]) -> "torch.Tensor":
    """The logits after the repetition penalty and, when sampling, the temperature, top-k and top-p (dropped tokens
    at -inf)."""
    import torch
    ids = penalized_ids(params, recent_ids)
    if ids:
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        picked = logits[index]
        # as in CTRL / transformers: shrink positive logits, push negative ones further down
        logits = logits.clone()
        logits[index] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if params.greedy:
        return logits
    logits = logits / params.temperature
    k = kept_top_k(params, logits.shape[-1])
    if k:
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > params.top_p   # keep the smallest set reaching top_p
        sorted_logits[drop] = float("-inf")
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample_numpy(logits: np.ndarray, params: SamplingParams, recent_ids: list[int], rng: np.random.Generator) -> int:
    """sample() over numpy: logits [vocab] float32 -> token id."""
    ids = penalized_ids(params, recent_ids)
    if ids:
        index = np.array(ids)
        picked = logits[index]
        logits = logits.copy()
        logits[index] = np.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if params.greedy:
        return int(np.argmax(logits))
    logits = logits.astype(np.float64) / params.temperature
    k = kept_top_k(params, logits.size)
    if k:
        kth = np.partition(logits, -k)[-k]
        logits = np.where(logits < kth, -np.inf, logits)
    if params.top_p < 1.0:
        order = np.argsort(-logits, kind="stable")
        ranked = logits[order]
        p = np.exp(ranked - ranked[0])
        p /= p.sum()
        ranked[np.cumsum(p) - p > params.top_p] = -np.inf     # keep the smallest set reaching top_p
        logits = np.full_like(logits, -np.inf)
        logits[order] = ranked
    p = np.exp(logits - logits.max())
    return int(rng.choice(p.size, p=p / p.sum()))
