"""The replies a user regenerated away from (Session.alternatives): each keeps its own sequence, forked from the
prompt's blocks, until a new message, an edit or a reset drops it, so that switching back reads nothing again.

The functions take the session's runner, its SessionState and its list of alternatives: a swap moves a reply's
sequence and token ids between the state and the list, and nothing else of the session changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvchat.engine.text.reasoning import REASONING_KEY, assistant_message


@dataclass
class Alternative:
    """A reply the user regenerated away from, kept with its cache until the budget needs the room."""

    text: str
    seq: object
    token_ids: list[int] = field(default_factory=list)
    reasoning: str = ""


def fork(runner, state, alternatives: list[Alternative], old: dict) -> int:
    """The reply `old` (its message) is kept with its sequence; the state goes on from a fork of it at the prompt's
    end. Returns the prompt tokens the fork shares exactly (the rest are read again)."""
    child, shared = runner.fork(state.seq, state.prompt_end)
    alternatives.append(Alternative(old["content"], state.seq, list(state.token_ids), old.get(REASONING_KEY, "")))
    state.seq = child
    state.token_ids = state.token_ids[:state.prompt_end]
    return shared


def texts(alternatives: list[Alternative], old: dict | None = None) -> list[tuple[str, str]]:
    """(text, reasoning) of each kept reply, and of `old` after them: what survives a prompt read again."""
    kept = [(alt.text, alt.reasoning) for alt in alternatives]
    return kept + [(old["content"], old.get(REASONING_KEY, ""))] if old is not None else kept


def without_caches(kept: list[tuple[str, str]]) -> list[Alternative]:
    return [Alternative(text, None, reasoning=reasoning) for text, reasoning in kept]


def swap(runner, state, alternatives: list[Alternative], messages: list[dict], index: int, cache) -> None:
    """The last reply and alternative `index` trade places, with their caches where the alternative's is still
    held; else both caches go and the chat is read again from a new sequence of `cache`."""
    alt = alternatives[index]
    last = messages[-1]
    current = Alternative(last["content"], state.seq, list(state.token_ids), last.get(REASONING_KEY, ""))
    messages[-1] = assistant_message(alt.text, alt.reasoning)
    if alt.seq is not None and not alt.seq.released and alt.seq.num_tokens:
        state.seq, state.token_ids = alt.seq, list(alt.token_ids)
    else:
        for seq in (alt.seq, current.seq):
            if seq is not None:
                runner.close(seq)
        current.seq, current.token_ids = None, []
        state.seq, state.token_ids = runner.new_sequence(cache), []
    alternatives[index] = current
    if state.attention_log is not None:     # what it measured was the other reply's
        state.attention_log.clear()


def drop_caches(runner, alternatives: list[Alternative], current_seq) -> int:
    """Close the sequences of the kept replies (their text stays); returns the bytes freed."""
    freed = 0
    for alt in alternatives:
        if alt.seq is not None and alt.seq is not current_seq:
            freed += runner.free(alt.seq)
            runner.close(alt.seq)
        alt.seq, alt.token_ids = None, []
    return freed
