"""What the engine thread tells the window about where attention goes and about a replay of the open chat.

Frozen dataclasses, as every event: an AttentionMap is the engine's own frozen map (numpy arrays nobody writes to
after it is made), the rest are plain values.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.config import CacheConfig
from kvchat.engine.runtime.attention_map import AttentionMap

# why a chat has no map to draw
REMOTE, UNSUPPORTED, EMPTY = "remote", "unsupported", "empty"


@dataclass(frozen=True, eq=False)
class AttentionShown:
    """The open chat's attention after its last turn: over its newest token and over its last reply."""

    conversation_id: int | None
    newest: AttentionMap | None
    reply: AttentionMap | None
    newest_texts: tuple[str, ...] = ()     # per column of `newest`: the words its tokens make, short
    reply_texts: tuple[str, ...] = ()      # the same for `reply`
    roles: tuple[str, ...] = ()            # the role of each of the session's messages (message_starts' order)
    missing: str = ""                      # REMOTE, UNSUPPORTED or EMPTY when there is no map; "" when there is

    def of(self, over: str) -> tuple[AttentionMap | None, tuple[str, ...]]:
        return (self.reply, self.reply_texts) if over == "reply" else (self.newest, self.newest_texts)


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    done: int
    total: int


@dataclass(frozen=True, slots=True)
class ReplyMark:
    """One reply of a replayed chat: how it fared under the mode, and where (if anywhere) the mode first chose
    another token than the one the chat holds."""

    index: int                          # its place in the session's messages (the chat's user and assistant ones)
    start: int                          # its tokens: [start, end)
    end: int
    tokens: int                         # tokens compared
    top1: float                         # 0.0-1.0: the mode's top choice agreed with the baseline's
    kl: float                           # nats per token
    first_divergence: int | None        # token index (of the whole chat) where the mode first chose otherwise
    offset: int | None = None           # that token's first character in the message's text (None: not placed)
    length: int = 0                     # its characters there
    expected: str = ""                  # the token the chat holds there
    replayed: str = ""                  # the token the mode would have chosen


@dataclass(frozen=True, slots=True)
class ReplayShown:
    conversation_id: int | None
    mode: CacheConfig
    baseline: CacheConfig
    tokens: int
    top1: float
    kl: float
    first_divergence: int | None
    replies: tuple[ReplyMark, ...]
    seconds: float
    kv_bytes: int = 0
    baseline_kv_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ReplayFailed:
    """Nothing to show: the replay could not start (error: why, e.g. the budget) or was stopped (cancelled)."""

    conversation_id: int | None
    error: str = ""
    cancelled: bool = False
