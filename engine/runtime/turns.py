"""One turn at a time in a conversation, and none after it is closed.

A turn (send, regenerate, continue_reply) is a generator that the caller drives. While it streams it owns
the conversation: a second turn is refused (SessionBusy), and a reset, rewind or close between two of its
events ends it as a Stop would (its reply so far joins the messages), so it never decodes on from a cache
that was freed or cut under it. Its stream then closes with one TurnFinished saying why.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator

from kvchat.engine.text.chat_format import clean_text
from kvchat.engine.text.reasoning import REASONING_KEY
from kvchat.engine.config import ConfigError, SamplingParams
from kvchat.engine.events import FinishReason, SpecStats, StatsSnapshot, TokenDelta, TurnFinished
from kvchat.engine.runtime.sampling import check_logit_bias


class SessionBusy(ConfigError):
    """A turn is streaming in this conversation; another cannot start until it ends."""


class SessionClosed(ConfigError):
    """The conversation was closed: it holds no cache and takes no more turns."""


ENDED_BY = {
    "reset": "The conversation was reset during the reply: the reply stops here and its cache was freed.",
    "rewind": "The conversation was rewound during the reply: the reply stops here.",
    "close": "The conversation was closed during the reply.",
}


@dataclass(slots=True)
class TurnTimes:
    """The last turn's counts and times, as stats() reports them; filled in while the turn streams."""

    reused: int = 0                     # prompt tokens found in the prefix cache
    prefill_tokens: int = 0             # prompt tokens the turn read (only the new ones)
    prefill_s: float = 0.0
    ttft_s: float = 0.0                 # time to the first sampled token
    decode_tokens: int = 0              # tokens decoded after the first
    decode_s: float = 0.0               # time since the first; live while the turn streams
    spec: SpecStats | None = None       # speculative decoding's counts (None: off)
    state_reread: int = 0               # tokens read again to bring a recurrent state back to a position (Session._take_back)

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


@dataclass
class LiveTurn:
    inner: Iterator             # the turn's own generator
    ended: str = ""             # a key of ENDED_BY once something ended it between two of its events
    text: str = ""              # the reply when it was ended
    reasoning: str = ""         # and its reasoning
    stats: StatsSnapshot | None = None


class TurnGuard:
    def __init__(self):
        self.live: LiveTurn | None = None
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise SessionClosed("this conversation was closed and holds no cache: start a new session to go on")

    def check_idle(self) -> None:
        self.check_open()
        if self.live is not None:
            raise SessionBusy("a reply is still streaming in this conversation: let it finish or stop it first")

    def inside_turn(self) -> bool:
        """Called by the live turn's own code (a regenerate reading its prompt again, a reset of its cache)?"""
        return self.live is not None and bool(self.live.inner.gi_running)

    def stream(self, inner: Iterator) -> Iterator[TokenDelta | TurnFinished]:
        self.check_idle()
        turn = self.live = LiveTurn(inner)
        try:
            for event in inner:
                if isinstance(event, TurnFinished) and self.live is turn:
                    self.live = None        # the turn is over: what follows its TurnFinished changes nothing
                yield event
                if turn.ended:
                    yield TurnFinished(turn.text, FinishReason.STOPPED, ENDED_BY[turn.ended], turn.stats,
                                       turn.reasoning)
                    return
        finally:
            inner.close()
            if self.live is turn:
                self.live = None

    def end(self, session, why: str) -> None:
        """Stop the live turn where it waits, as a Stop would: its reply so far joins session.messages."""
        turn = self.live
        if turn is None or self.inside_turn():
            return
        self.live = None
        turn.inner.close()
        last = session.messages[-1] if session.messages else None
        reply = last if last is not None and last["role"] == "assistant" else {}
        turn.text, turn.reasoning = reply.get("content", ""), reply.get(REASONING_KEY, "")
        turn.stats = session.stats()
        turn.ended = why


def turn(method):
    """Decorates a Session's turn method: its stream holds the session until it ends."""
    @functools.wraps(method)
    def start(self, *args, **kwargs):
        inner = method(self, *args, **kwargs)
        if self._guard.inside_turn():
            return inner
        self._guard.check_idle()
        return self._guard.stream(inner)
    return start


def checked_text(value, what: str) -> str:
    if not isinstance(value, str):
        hint = ": decode it first" if isinstance(value, (bytes, bytearray)) else ""
        raise ConfigError(f"{what} must be text (a str), not {type(value).__name__}{hint}")
    return clean_text(value)


def checked_history(history) -> list[dict]:
    """Copies of the messages a session starts from, each {'role': str, 'content': str} (a reply's 'reasoning' too)."""
    messages = []
    for i, m in enumerate(history or ()):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"history message {i} is not {{'role': 'user' or 'assistant', 'content': text}}: "
                              f"fix or drop it")
        message = dict(m, content=clean_text(m["content"]))
        if isinstance(m.get(REASONING_KEY), str):       # a reply's reasoning (engine/text/reasoning.py)
            message[REASONING_KEY] = clean_text(m[REASONING_KEY])
        messages.append(message)
    return messages


def checked_params(params, vocab: int) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"sampling settings must be a SamplingParams, not {type(params).__name__}")
    check_logit_bias(params, vocab)
    return params
