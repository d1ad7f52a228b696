"""What a session is made of besides its messages: the model it talks to (ModelInfo) and its conversation's
decode state (SessionState). The replies it kept after a regenerate are engine/runtime/alternatives.py's.

The state is one dataclass the Session owns and hands to its helpers (engine/runtime/warm.py, overflow.py,
session_stats.py): they read and write these fields, never the session's private ones, so what a turn, a restore
and a stats snapshot can change is written down here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvchat.engine.text.reasoning import PLAIN
from kvchat.engine.runtime.turns import TurnTimes


@dataclass(frozen=True)
class ModelInfo:
    """What a session needs to know about the loaded model besides the runner."""

    name: str
    tokenizer: object
    stop_ids: frozenset[int]
    max_context: int
    weight_bytes: int = 0
    weights_label: str = ""
    reply: object = PLAIN               # the format its replies come in (engine.text.reply.reply_format)


@dataclass(eq=False)
class SessionState:
    """One conversation's tokens, its sequence of the KV pool and the counts of its last turn."""

    seq: object                         # its Sequence of the runner's KV pool (engine/kv)
    token_ids: list[int] = field(default_factory=list)  # the conversation as tokens; the cache holds the first
                                        # seq.num_tokens, the rest are pending (fed with the next tokens)
    starts: list[int | None] = field(default_factory=list)  # token index where each message begins (None: unknown)
    prompt_end: int = 0                 # tokens before the last reply: where a regenerate forks
    prompt_logits: torch.Tensor | None = None   # the logits the last reply started from [vocab] (None: read again)
    tier: str = "pool"                  # where the cache is: pool, host (released to host memory), disk (to its
                                        # saved file) or none
    notice: str = ""                    # what the user should know about this turn (a slide, a cache read back)
    turn_times: TurnTimes = field(default_factory=TurnTimes)
    attention_log: object | None = None     # where the cache measures this conversation's attention (None: not
                                        # watched; engine/runtime/session_attention.py)

    @property
    def num_cached(self) -> int:
        """Tokens of token_ids the cache holds."""
        return self.seq.num_tokens

    def forget_prompt(self) -> None:
        """The cache no longer holds what the last reply started from: a regenerate reads its prompt again."""
        self.prompt_logits = None

    def kept_turn(self) -> tuple[int, list[int | None], torch.Tensor | None]:
        """(prompt_end, starts, prompt_logits): what a released cache read back must find again."""
        return self.prompt_end, list(self.starts), self.prompt_logits

    def resume_turn(self, prompt_end: int, starts: list[int | None], logits: torch.Tensor | None) -> None:
        self.prompt_end, self.starts, self.prompt_logits = prompt_end, starts, logits


def state_field(name: str, doc: str = "") -> property:
    """A Session attribute that is its state's field: callers keep `session.token_ids`, the state keeps the value."""
    return property(lambda self: getattr(self.state, name), lambda self, value: setattr(self.state, name, value),
                    doc=doc)
