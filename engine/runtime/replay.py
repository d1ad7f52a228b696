"""A conversation replayed under another cache mode: its tokens teacher-forced through a session under the mode it
ran in (the baseline) and one under the other mode, in lockstep, and for each reply the top-1 agreement of the two
greedy choices, KL(baseline || replay) and the first token where the greedy choice would have differed.

The app replays its open chat in its engine thread (app/bridge/attention_work.py); `kvchat replay` replays a saved
chat or a text file. Both sessions are the replay's own, closed in the end however it ends: the chat is never touched.
A text's figures are `kvchat bench quality`'s (engine/runtime/fidelity.py) on the same tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.kv.layout import MIB, kv_layout
from kvchat.engine.runtime.fidelity import Cancelled
from kvchat.engine.text.chat_format import tokenize_pieces


@dataclass(frozen=True)
class ReplyReplay:
    index: int                  # the reply's index in the conversation's messages
    start: int                  # its tokens [start, end) in the conversation's token ids
    end: int
    tokens: int                 # positions compared: the predictions of its tokens
    top1: float                 # where the replay's greedy choice is the baseline's
    kl: float                   # mean KL(baseline || replay), nats
    first_divergence: int | None    # the first token j whose greedy choice (at j - 1) differs; None: none
    expected: int | None        # the baseline's greedy token there
    replayed: int | None        # the replay's


@dataclass(frozen=True)
class ReplayResult:
    mode: str
    baseline: str
    tokens: int
    top1: float
    kl: float
    first_divergence: int | None
    expected: int | None
    replayed: int | None
    replies: tuple[ReplyReplay, ...]
    seconds: float
    kv_bytes: int               # what the replay's session held at the end
    baseline_kv_bytes: int


def check_replay_room(engine, baseline: CacheConfig, mode: CacheConfig, num_tokens: int) -> None:
    """A ConfigError saying what to change when the model's context or the engine's KV budget cannot take both
    sessions over num_tokens tokens (before anything runs)."""
    if num_tokens < 2:
        raise ConfigError("there is nothing to replay: the conversation has fewer than 2 tokens")
    config = engine.model.config
    for name, cache in (("the chat's own mode", baseline), ("the replayed mode", mode)):
        if cache.window is None and num_tokens > config.max_position_embeddings:
            raise ConfigError(f"{num_tokens:,} tokens are past the model's {config.max_position_embeddings:,}-token "
                              f"context under {name} ({cache.label()}): give it a window, or replay a shorter chat")
    need = sum(_held_bytes(engine, c, num_tokens) for c in (baseline, mode))
    if need > engine.budget_mb * MIB:
        raise ConfigError(f"the KV budget ({engine.budget_mb:g} MiB) cannot hold the replay, which keeps the "
                          f"{num_tokens:,} tokens twice ({need / MIB:.1f} MiB): raise the budget, or replay under a "
                          f"window")


def _held_bytes(engine, cache: CacheConfig, n: int) -> int:
    layout = kv_layout(engine.model.config, cache.with_(window=None), engine.dtype_name, str(engine.device))
    held = n if cache.window is None else min(n, cache.window + cache.sinks + 2 * layout.block_size)
    return layout.sequence_bytes(held) + layout.block_bytes


def replay(engine, ids: list[int], mode: CacheConfig, baseline: CacheConfig,
           replies: list[tuple[int, int, int]] | None = None, should_stop: Callable[[], bool] | None = None,
           progress: Callable[[int, int], None] | None = None, step: int = 1) -> ReplayResult:
    """ids: the conversation's tokens; replies: (message index, start, end) of its replies (None: every position
    is compared, as for a text). should_stop() is asked between steps and raises fidelity.Cancelled; progress(done,
    total) follows each step. The logits at position p predict token p + 1."""
    ids = [int(t) for t in ids]
    check_replay_room(engine, baseline, mode, len(ids))
    started = time.perf_counter()
    budget = engine.budget_mb
    base = engine.new_session(cache=baseline.with_(budget_mb=budget))
    other = None
    try:
        other = engine.new_session(cache=mode.with_(budget_mb=budget))
        agree, kl, greedy = _lockstep(base, other, ids, step, should_stop, progress)
        result = _result(agree, kl, greedy, len(ids), replies, baseline, mode)
        return ReplayResult(**result, seconds=time.perf_counter() - started, kv_bytes=other.stats().kv_bytes,
                            baseline_kv_bytes=base.stats().kv_bytes)
    finally:
        for session in (base, other):
            if session is not None:
                session.close()


def _lockstep(base, other, ids, step, should_stop, progress) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: the two greedy choices agree [n] bool, KL [n], the greedy choices [2, n] (baseline, replay)."""
    agree, kl, greedy = [], [], []
    n = len(ids)
    for i in range(0, n, step):
        if should_stop is not None and should_stop():
            raise Cancelled
        chunk = ids[i:i + step]
        b = torch.log_softmax(base.append(chunk).float(), -1)
        r = torch.log_softmax(other.append(chunk).float(), -1)
        gb, gr = b.argmax(-1), r.argmax(-1)
        agree.append(gb == gr)
        kl.append((b.exp() * (b - r)).sum(-1))
        greedy.append(torch.stack((gb, gr)))
        if progress is not None:
            progress(i + len(chunk), n)
    return torch.cat(agree), torch.cat(kl), torch.cat(greedy, 1)


def _result(agree, kl, greedy, n: int, replies, baseline: CacheConfig, mode: CacheConfig) -> dict:
    spans = [(None, 1, n + 1)] if replies is None else [(i, s, e) for i, s, e in replies if 0 < s < e <= n]
    per = []
    for index, start, end in spans:          # the predictions of tokens start..end-1 sit at start-1..end-2
        a, k = agree[start - 1:end - 1], kl[start - 1:end - 1]
        miss = (~a).nonzero()
        p = int(miss[0]) + start - 1 if len(miss) else None
        per.append(ReplyReplay(-1 if index is None else index, start, min(end, n), len(a), float(a.float().mean()),
                               float(k.mean()), None if p is None else p + 1,
                               None if p is None else int(greedy[0, p]), None if p is None else int(greedy[1, p])))
    positions = torch.cat([agree[s - 1:e - 1] for _, s, e in spans]) if spans else agree[:0]
    first = next((r for r in per if r.first_divergence is not None), None)
    total = sum(r.tokens for r in per)
    return dict(mode=mode.label(), baseline=baseline.label(), tokens=total,
                top1=float(positions.float().mean()) if total else 1.0,
                kl=sum(r.kl * r.tokens for r in per) / total if total else 0.0,
                first_divergence=None if first is None else first.first_divergence,
                expected=None if first is None else first.expected,
                replayed=None if first is None else first.replayed,
                replies=() if replies is None else tuple(per))


def conversation_tokens(engine, system_prompt: str | None, messages: list[dict]) -> tuple[list[int],
                                                                                         list[tuple[int, int, int]]]:
    """A saved chat as the engine reads it: its tokens (the chat template's rendering) and (message index, start,
    end) of each assistant reply's content."""
    session = engine.new_session(system_prompt=system_prompt or None)
    try:
        _, pieces = session.encode_conversation(messages)
    finally:
        session.close()
    starts: list[int | None] = []
    ids = tokenize_pieces(engine.tokenizer, pieces, 0, starts)
    content = [i for i, (_, is_content) in enumerate(pieces) if is_content]
    content = content[len(content) - len(messages):]        # a system prompt's piece comes first
    replies = []
    for index, (message, piece) in enumerate(zip(messages, content)):
        if message["role"] != "assistant" or starts[piece] is None:
            continue
        end = next((s for s in starts[piece + 1:] if s is not None), len(ids))
        replies.append((index, starts[piece], end))
    return ids, replies
