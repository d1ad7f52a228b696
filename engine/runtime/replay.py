"""A conversation replayed under another cache mode: its tokens teacher-forced through a session under the mode it
ran in (the baseline) and one under the other mode, in lockstep, and for each reply the top-1 agreement of the two
greedy choices, KL(baseline || replay) and the first token where the greedy choice would have differed.

The lockstep run and its per-position tallies are fidelity.teacher_force's, so a text's figures are
`kvchat bench quality`'s on the same tokens. The app replays its open chat in its engine thread
(app/bridge/attention_work.py); `kvchat replay` replays a saved chat or a text file. Both sessions are the replay's
own, closed however it ends: the chat is never touched, and the room check counts what the open chats hold.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.kv.layout import MIB, check_cache_for_model
from kvchat.engine.runtime.fidelity import Tally, teacher_force
from kvchat.engine.text.chat_format import encode_conversation, tokenize_pieces


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
    mode: str                   # the replayed mode's label
    baseline: str               # the baseline's
    tokens: int                 # positions compared: the replies', or every one of a text
    top1: float
    kl: float
    first_divergence: int | None
    replies: tuple[ReplyReplay, ...]    # () for a text
    seconds: float
    kv_bytes: int               # what the replay's session held at the end
    baseline_kv_bytes: int
    expected: int | None = None     # the greedy tokens at first_divergence (a text has no reply to carry them)
    replayed: int | None = None


def check_replay_room(engine, baseline: CacheConfig, mode: CacheConfig, num_tokens: int) -> None:
    """A ConfigError saying what to change when the model's context or the engine's KV budget cannot take both
    sessions over num_tokens tokens, beside what the open conversations hold (the replay must not release them)."""
    if num_tokens < 2:
        raise ConfigError("there is nothing to replay: it takes at least 2 tokens")
    model, budget = engine.model.config, engine.budget_mb
    need = 0
    for name, cache in (("the baseline", baseline), ("the replayed mode", mode)):
        cache = cache.with_(budget_mb=budget)
        try:        # the engine's own check: a window past the context, a budget without room for one block
            layout = check_cache_for_model(cache, model, engine.dtype_name, str(engine.device))
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        if cache.window is None and num_tokens > model.max_position_embeddings:
            raise ConfigError(f"{num_tokens:,} tokens are past the model's {model.max_position_embeddings:,}-token "
                              f"context under {name} ({cache.label()}): give it a window, or replay fewer tokens")
        # a step may take one block more than the steady state, and a quantized layout keeps its sides
        need += layout.sequence_bytes(num_tokens, cache.window, cache.sinks) + layout.block_bytes + layout.fixed_bytes
    runner = engine.runner
    room = runner.room_bytes({c.seq_id for c in runner.sequences()})
    if need > room:
        held = runner.budget_bytes - room
        beside = f" beside the {held / MIB:.1f} MiB the open chats hold" if held > 0 else ""
        raise ConfigError(f"the KV budget ({budget:g} MiB) cannot hold the replay{beside}: it keeps the "
                          f"{num_tokens:,} tokens twice ({need / MIB:.1f} MiB); raise the budget, or replay under a "
                          f"window")


def replay(engine, ids: list[int], mode: CacheConfig, baseline: CacheConfig,
           replies: list[tuple[int, int, int]] | None = None, should_stop: Callable[[], bool] | None = None,
           progress: Callable[[int, int], None] | None = None, step: int = 1) -> ReplayResult:
    """ids: the conversation's tokens; replies: (message index, start, end) of its replies (None: every position
    is compared, as for a text). should_stop() is asked between steps and raises fidelity.Cancelled; progress(done,
    total) follows each step. The logits at position p predict token p + 1.

    A reply is cut to the tokens given, and a reply left empty is left out; the tokens after the last reply are
    not read. A ConfigError (check_replay_room) comes before anything runs."""
    ids = [int(t) for t in ids]
    spans = _spans(replies, len(ids))
    if not spans:
        raise ConfigError(f"none of the replies lies within the {len(ids):,} tokens given: there is nothing to compare")
    if replies is not None:
        ids = ids[:max(end for _, _, end in spans)]
    check_replay_room(engine, baseline, mode, len(ids))
    started = time.perf_counter()
    run = teacher_force(engine, ids, {"replay": mode}, baseline, step=step, should_stop=should_stop,
                        progress=progress)
    tally = run.tallies["replay"]
    per = [_reply(run.base, tally, *span) for span in spans]
    positions = [p for _, start, end in spans for p in range(start - 1, end - 1)]
    first = next((r for r in per if r.first_divergence is not None), None)
    return ReplayResult(mode=mode.label(), baseline=baseline.label(), tokens=len(positions),
                        top1=sum(tally.top1[p] for p in positions) / len(positions),
                        kl=sum(tally.kl[p] for p in positions) / len(positions),
                        first_divergence=None if first is None else first.first_divergence,
                        replies=() if replies is None else tuple(per), seconds=time.perf_counter() - started,
                        kv_bytes=run.kv_bytes["replay"], baseline_kv_bytes=run.baseline_kv_bytes,
                        expected=None if first is None else first.expected,
                        replayed=None if first is None else first.replayed)


def _spans(replies, n: int) -> list[tuple[int, int, int]]:
    """The ranges compared: each reply's within the n tokens (token 0 has no prediction), or for a text every
    position, the last one's prediction (of the token after it) included."""
    if replies is None:
        return [(-1, 1, n + 1)] if n else []
    spans = [(int(i), max(1, int(s)), min(int(e), n)) for i, s, e in replies]
    return [span for span in spans if span[1] < span[2]]


def _reply(base: Tally, tally: Tally, index: int, start: int, end: int) -> ReplyReplay:
    """One reply's figures: the predictions of its tokens start..end-1 sit at positions start-1..end-2."""
    agree, kl = tally.top1[start - 1:end - 1], tally.kl[start - 1:end - 1]
    p = next((start - 1 + k for k, same in enumerate(agree) if not same), None)
    where = (None, None, None) if p is None else (p + 1, base.greedy[p], tally.greedy[p])
    return ReplyReplay(index, start, end, len(agree), sum(agree) / len(agree), sum(kl) / len(kl), *where)


def conversation_tokens(engine, system_prompt: str | None,
                        messages: list[dict]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """A saved chat as a session renders it (its chat template, message contents as plain text): its tokens, and
    (message index, start, end) of each assistant reply: its content, and the end-of-turn token after it, which the
    model chose too."""
    info = engine.info
    _, pieces = encode_conversation(info.tokenizer, system_prompt or None, messages, where=info.name)
    starts: list[int | None] = []
    ids = tokenize_pieces(info.tokenizer, pieces, 0, starts)
    ends = starts[1:] + [len(ids)]
    replies, at = [], 0
    for index, message in enumerate(messages):
        # a template may move a content (Mistral's system prompt) and drops an empty one: find each in order
        piece = next((k for k in range(at, len(pieces)) if pieces[k] == (message["content"], True)), None)
        if piece is None:
            continue
        at = piece + 1
        if message["role"] == "assistant":
            end = ends[piece] + int(ends[piece] < len(ids) and ids[ends[piece]] in info.stop_ids)
            replies.append((index, starts[piece], end))
    return ids, replies
