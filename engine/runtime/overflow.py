"""What a session does when the KV budget or the model's context runs out: refuse up front what cannot fit
(overflow="stop"), slide into a window (overflow="slide"), and say in the user's words what to change."""
from __future__ import annotations

from kvchat.engine.kv.layout import WindowGeometry, window_peak_bytes
from kvchat.engine.units import MIB


class BudgetFull(RuntimeError):
    """The next tokens do not fit in the KV budget; the message says what to do."""


def fits(session, num_new: int) -> bool:
    """Could num_new more tokens fit, counting what releasing idle conversations would free?"""
    seq = session.seq
    return session.runner.bytes_needed(seq, num_new) <= session.runner.room_bytes({seq.seq_id})


def cache_words(session) -> str:
    return session.cache_config.label().replace("auto", session.seq.layout.full_dtype)


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
    if session.seq.num_tokens:
        advice.insert(0, "reset the session")
    else:                   # nothing held: the message alone is too big
        advice.insert(0, "shorten the message")
    return (f"The KV budget ({budget:g} MiB, {cache_words(session)}) is full: {session.seq.tokens_held:,} tokens "
            f"are held and {num_new:,} more were needed, but only {session.tokens_left():,} fit. To go on: "
            f"{', '.join(advice)}, or raise the budget in Settings.")


def slide_to_fit(session) -> None:
    c = session.cache_config
    # the window and one prompt chunk in flight share what the budget holds beside the sink blocks
    seq = session.seq
    # a hybrid model's windowed groups keep their peak beside it; the first group's blocks share the rest
    others = sum(window_peak_bytes(m.layout, m.geometry) for m in seq.groups[1:])
    budget_blocks = seq.layout.budget_blocks(session.runner.budget_bytes - others)
    window = WindowGeometry.of(c).sliding_window_for(budget_blocks)
    if window < c.block_size:
        raise BudgetFull(f"The KV budget ({session.runner.budget_bytes / MIB:g} MiB) is too small even for "
                         f"a sliding window: raise it.")
    session.set_cache(c.with_(window=window))
    session.notice = f"The budget filled: the cache now slides, keeping the newest {window} tokens and {c.sinks} sinks."


def check_whole_fits(session, num_new: int) -> None:
    """With overflow="stop" and no window, refuse up front what cannot fit, so nothing is half-read."""
    c = session.cache_config
    if c.window is None and c.overflow == "stop" and not fits(session, num_new):
        raise BudgetFull(budget_message(session, num_new))


def past_context(session, num_new: int) -> bool:
    """Would num_new more tokens pass the model's context? A window re-positions, so it never does."""
    return session.cache_config.window is None and session.seq.num_tokens + num_new > session.info.max_context


def context_message(session, num_new: int) -> str:
    limit = session.info.max_context
    if not session.seq.num_tokens:
        advice = "shorten the message, or set a sliding window in Settings (a window bounds the cache)"
    elif session.cache_config.overflow == "slide":
        advice = "shorten the message, or set a window in Settings (the window then bounds the cache)"
    else:
        advice = "switch the cache to a sliding window with sinks in Settings to keep going, or start a new chat"
    return (f"The conversation would pass {session.info.name}'s context of {limit:,} tokens "
            f"({session.seq.num_tokens:,} held, {num_new:,} more needed): {advice}.")
