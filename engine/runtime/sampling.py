"""Next-token choice: logit bias and penalties, then greedy, or temperature, top-k, top-p and a draw.

Written twice, side by side: `sample` over torch (the engine's steps) and `sample_numpy` for the torch-free
one-shot path (engine/runtime/quick.py, which must not import torch: 2 s). Both take their settings
through the same helpers in the same order, and tests/test_families.py holds that they choose the same
token wherever the choice needs no random draw (greedy, top-k 1, a top-p that keeps one token). The
draws themselves differ (torch's generator against numpy's), which is why a seeded sample is the engine's
alone (quick.covers).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvchat.engine.config import ConfigError, SamplingParams
from kvchat.engine.errors import UserError

if TYPE_CHECKING:
    import torch

RECENT = 1024           # the ids the penalties look at: the conversation's last ones, the reply's last ones

NON_FINITE_MESSAGE = ("The model's output holds NaN or infinite numbers, so no next token can be chosen: its weights "
                      "are broken, or overflow in this precision. Load it in fp32 (dtype fp32), or use another model "
                      "file.")


class NonFiniteLogits(UserError):
    """The logits to choose from hold NaN or infinity: a model's fault, not the settings' (they are bounded)."""


def penalized_ids(params: SamplingParams, recent_ids: Sequence[int]) -> list[int]:
    """The ids the repetition penalty applies to, each once, in order; [] when it is off."""
    return sorted(set(recent_ids)) if params.repetition_penalty != 1.0 and recent_ids else []


def generated_penalties(params: SamplingParams, generated: Sequence[int]) -> tuple[list[int], list[float]]:
    """The ids the presence and frequency penalties apply to (those of the reply's last RECENT tokens), each once,
    in order, and what each one's logit loses: presence + frequency x times generated."""
    if not (params.presence_penalty or params.frequency_penalty) or not generated:
        return [], []
    counts = Counter(generated[-RECENT:])
    ids = sorted(counts)
    return ids, [params.presence_penalty + params.frequency_penalty * counts[i] for i in ids]


def kept_top_k(params: SamplingParams, vocab: int) -> int:
    """How many tokens top-k keeps (0: top-k is off)."""
    return min(params.top_k, vocab) if params.top_k else 0


def check_logit_bias(params: SamplingParams, vocab: int) -> None:
    """A bias for an id past the vocabulary is refused with the id named (the server and a session check first)."""
    past = [i for i, _ in params.logit_bias if i >= vocab]
    if past:
        raise ConfigError(f"logit_bias: token id {past[0]} is outside the vocabulary (0-{vocab - 1})")


def sample(logits: "torch.Tensor", params: SamplingParams, recent_ids: Sequence[int],
           generator: "torch.Generator | None", generated: Sequence[int] = ()) -> int:
    """logits: [vocab] float32 -> token id. generated: the reply's tokens so far (presence and frequency penalties)."""
    import torch         # here, so that the one-shot path can import this module without torch
    logits = processed(logits, params, recent_ids, generated)
    if params.greedy:
        return greedy_id(logits)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_id(logits: "torch.Tensor") -> int:
    """The greedy pick of logits [vocab]: the first largest, as torch.argmax picks it, in C on the CPU where the
    kernels are built (a fifth of torch's time over a 256,000-token vocabulary)."""
    from kvchat.kernels import cpu_quant
    i = cpu_quant.argmax(logits)
    return int(logits.argmax()) if i is None else i


def distribution(logits: "torch.Tensor", params: SamplingParams, recent_ids: Sequence[int],
                 generated: Sequence[int] = ()) -> "torch.Tensor":
    """The probabilities sample() draws from, [vocab] (greedy: all on its one choice); speculative decoding's
    acceptance rule reads them."""
    import torch
    logits = processed(logits, params, recent_ids, generated)
    if params.greedy:
        return torch.zeros_like(logits).index_fill_(0, logits.argmax().view(1), 1.0)
    return logits.softmax(-1)


def processed(logits: "torch.Tensor", params: SamplingParams, recent_ids: Sequence[int],
              generated: Sequence[int] = ()) -> "torch.Tensor":
    """The logits after the logit bias, the repetition, presence and frequency penalties and, when sampling, the
    temperature, top-k and top-p (dropped tokens at -inf). Logits that are not all finite raise NonFiniteLogits."""
    import torch
    if not bool(torch.isfinite(logits).all()):     # one check a step: argmax of NaN picks a token, softmax raises
        raise NonFiniteLogits(NON_FINITE_MESSAGE)
    if params.logit_bias:
        check_logit_bias(params, logits.shape[-1])
        ids, bias = zip(*params.logit_bias)
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        logits = logits.index_add(0, index, torch.tensor(bias, dtype=logits.dtype, device=logits.device))
    ids = penalized_ids(params, recent_ids)
    if ids:
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        picked = logits[index]
        # as in CTRL / transformers: shrink positive logits, push negative ones further down
        logits = logits.clone()
        logits[index] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    ids, losses = generated_penalties(params, generated)
    if ids:
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        logits = logits.index_add(0, index, -torch.tensor(losses, dtype=logits.dtype, device=logits.device))
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


def sample_numpy(logits: np.ndarray, params: SamplingParams, recent_ids: Sequence[int], rng: np.random.Generator,
                 generated: Sequence[int] = ()) -> int:
    """sample() over numpy: logits [vocab] float32 -> token id."""
    if not np.isfinite(logits).all():
        raise NonFiniteLogits(NON_FINITE_MESSAGE)
    if params.logit_bias:
        check_logit_bias(params, logits.size)
        ids, bias = zip(*params.logit_bias)
        logits = logits.copy()
        logits[np.array(ids)] += np.array(bias, dtype=logits.dtype)
    ids = penalized_ids(params, recent_ids)
    if ids:
        index = np.array(ids)
        picked = logits[index]
        logits = logits.copy()
        logits[index] = np.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    ids, losses = generated_penalties(params, generated)
    if ids:
        logits = logits.copy()
        logits[np.array(ids)] -= np.array(losses, dtype=logits.dtype)
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
