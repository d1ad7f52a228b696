"""How a session's tokens go into its cache, and what it does when the KV budget or the model's context runs out:
read in prefill chunks, refuse up front what cannot fit (overflow="stop"), slide into a window mid-read
(overflow="slide"), and say in the user's words what to change."""
from __future__ import annotations

from typing import Callable, Generator

import torch

from kvchat.engine.config import ConfigError
from kvchat.engine.events import PrefillProgress
from kvchat.engine.kv.layout import WindowGeometry, window_peak_bytes
from kvchat.engine.kv.manager import NoFreeBlocks
from kvchat.engine.units import MIB


class BudgetFull(RuntimeError):
    """The next tokens do not fit in the KV budget; the message says what to do."""


class Stopped(Exception):
    """The user stopped the turn while its prompt was being read."""


def feed(session, ids: list[int], all_logits: bool) -> torch.Tensor:
    """Run ids through the model in chunks; each chunk joins the cache or, on any error, leaves it untouched."""
    reading = read(session, ids, all_logits)
    while True:
        try:
            next(reading)
        except StopIteration as done:
            return done.value


def read(session, ids: list[int], all_logits: bool,
         should_stop: Callable[[], bool] | None = None) -> Generator[PrefillProgress, None, torch.Tensor]:
    """feed for a turn's prompt: after each chunk of a prompt longer than one it says how far it got, so a long paste
    shows progress instead of seconds of nothing; returns the logits as feed does ([T, vocab] or the last [1, vocab]).
    A full budget slides into a window where the overflow policy says so, else raises BudgetFull.

    A model with a recurrent state has chunks end at state_cuts' block boundaries too: the runner keeps the state
    where a step ends at one, for conversations reading the same tokens (KVCache.publish_state), and the one where
    the newest message begins stays kept."""
    cuts, keep_at = state_cuts(session, len(ids))
    outs = []
    i = 0
    smaller = len(ids)             # retrieval past the budget: steps shrunk so blocks can move to disk between them
    while i < len(ids):
        if should_stop is not None and i and should_stop():
            raise Stopped()
        chunk = min(smaller, WindowGeometry.of(session.cache_config).prefill_chunk())   # a slide changes it
        end = min([i + chunk] + [c for c in cuts if c > i])
        part = ids[i:end]
        seq = session.state.seq
        try:
            (logits,) = session.runner.step([(seq, part)], all_logits=all_logits,
                                            reading=frozenset({seq.seq_id}) if end < len(ids) else frozenset())
        except NoFreeBlocks:
            c = session.cache_config
            if c.overflow == "slide" and c.window is None:
                slide_to_fit(session)
                continue
            if session.runner.settle(seq):      # kept by attention: the budget cannot hold the prompt whole
                continue
            bs = session.seq.block_size
            if len(part) > bs and session.runner.cache.can_spill(session.seq):
                smaller = max(bs, len(part) // 2 // bs * bs)
                continue
            raise BudgetFull(budget_message(session, len(ids) - i)) from None
        i += len(part)
        if keep_at and i == keep_at:
            session.runner.cache.publish_state(session.state.seq, keep=True)
        outs.append(logits)
        if len(outs) > 1 or i < len(ids):      # a prompt of more than one chunk
            yield PrefillProgress(i, len(ids))
    # one chunk (every decode step): its logits as the step gave them; a copy costs a thread team after the step's
    # own (0.03 ms usually, up to 8 ms where torch's threads wait behind the kernels' spinning ones)
    return torch.cat(outs) if all_logits and len(outs) > 1 else outs[-1]


def state_cuts(session, prompt_len: int) -> tuple[tuple[int, ...], int]:
    """A prompt over a recurrent state is read in steps that end at two block boundaries, where the runner keeps the
    state for conversations reading the same tokens (KVCache.publish_state): the last one before the newest message
    begins (a shared system prompt, a resent history; kept), and the last one inside the prompt. -> (cuts, the kept
    one), relative to the prompt; ((), 0) for other models."""
    if session.runner.state_layout is None:
        return (), 0
    bs, start = session.seq.block_size, session._cached
    end = start + prompt_len
    message = (session._message_start or 0) // bs * bs
    keep = message - start if start < message < end else 0
    return tuple(sorted({c - start for c in (message, end // bs * bs) if start < c < end})), keep


def fits(session, num_new: int) -> bool:
    """Could num_new more tokens fit, counting what releasing idle conversations would free?"""
    seq = session.state.seq
    return session.runner.bytes_needed(seq, num_new) <= session.runner.room_bytes({seq.seq_id})


def cache_words(session) -> str:
    return session.cache_config.label().replace("auto", session.state.seq.layout.full_dtype)


def budget_message(session, num_new: int) -> str:
    c = session.cache_config
    budget = session.runner.budget_bytes / MIB
    if c.window is not None:
        return (f"The KV budget ({budget:g} MiB) cannot hold a window of {c.window:,} tokens plus {c.sinks} sinks "
                f"in {cache_words(session)} while taking {num_new:,} new tokens: lower the window, choose a smaller "
                f"format, or raise the budget in Settings.")
    formats = {c.k_format, c.v_format}
    smaller = None if formats == {"int4"} else "int4" if formats <= {"int8", "fp8", "int4"} else "int8 or int4"
    advice = ["switch to a sliding window"]
    if smaller:
        advice.append(f"choose a smaller format ({smaller})")
    if session.state.seq.num_tokens:
        advice.insert(0, "reset the session")
    else:                   # nothing held: the message alone is too big
        advice.insert(0, "shorten the message")
    return (f"The KV budget ({budget:g} MiB, {cache_words(session)}) is full: {session.state.seq.tokens_held:,} tokens "
            f"are held and {num_new:,} more were needed, but only {session.tokens_left():,} fit. To go on: "
            f"{', '.join(advice)}, or raise the budget in Settings.")


def slide_to_fit(session) -> None:
    c = session.cache_config
    # the window and one prompt chunk in flight share what the budget holds beside the sink blocks
    seq = session.state.seq
    # a hybrid model's windowed groups keep their peak beside it; the first group's blocks share the rest
    others = sum(window_peak_bytes(m.layout, m.geometry) for m in seq.groups[1:])
    budget_blocks = seq.layout.budget_blocks(session.runner.budget_bytes - others)
    window = WindowGeometry.of(c).sliding_window_for(budget_blocks)
    if window < c.block_size:
        raise BudgetFull(f"The KV budget ({session.runner.budget_bytes / MIB:g} MiB) is too small even for "
                         f"a sliding window: raise it.")
    session.set_cache(c.with_(window=window))
    session.state.notice = (f"The budget filled: the cache now slides, keeping the newest {window} tokens and "
                            f"{c.sinks} sinks.")


def check_whole_fits(session, num_new: int) -> None:
    """With overflow="stop" and no window, refuse up front what cannot fit, so nothing is half-read."""
    c = session.cache_config
    if c.window is None and c.overflow == "stop" and not fits(session, num_new) \
            and not session.runner.cache.can_spill(session.state.seq):      # retrieval moves blocks to disk
        raise BudgetFull(budget_message(session, num_new))


def context_limit(session) -> int | None:
    """The positions the model's context has for this conversation; None under a window, which re-positions."""
    return session.info.max_context if session.cache_config.window is None else None


def past_context(session, num_new: int) -> bool:
    """Would num_new more tokens pass the model's context? A window re-positions, so it never does."""
    limit = context_limit(session)
    return limit is not None and session.state.num_cached + num_new > limit


def context_message(session, num_new: int) -> str:
    limit = session.info.max_context
    if not session.state.seq.num_tokens:
        advice = "shorten the message, or set a sliding window in Settings (a window bounds the cache)"
    elif session.cache_config.overflow == "slide":
        advice = "shorten the message, or set a window in Settings (the window then bounds the cache)"
    else:
        advice = "switch the cache to a sliding window with sinks in Settings to keep going, or start a new chat"
    return (f"The conversation would pass {session.info.name}'s context of {limit:,} tokens "
            f"({session.state.seq.num_tokens:,} held, {num_new:,} more needed): {advice}.")


def take_back(session, n: int) -> bool:
    """The cache gives back its last n tokens; False where it cannot exactly (a quantized block, a window). A
    recurrent state without a snapshot exactly there returns to its latest snapshot before it and reads the few
    tokens between again (the KV of those tokens is taken back with it, so the two stay one)."""
    if n <= 0:
        return True
    runner, seq = session.runner, session.state.seq
    try:
        runner.truncate(seq, n)
        return True
    except ConfigError:
        pass
    cached = session.state.num_cached
    target = cached - n
    back = runner.state_return(seq, target)
    if back is None:
        return False
    try:
        runner.truncate(seq, cached - back)
        if target > back:
            feed(session, session.state.token_ids[back:target], all_logits=False)
    except (ConfigError, BudgetFull):
        return False
    session.state.turn_times.state_reread += target - back
    return True
