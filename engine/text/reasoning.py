"""A reply in two parts: its reasoning (what the model thinks through before it answers) and its text (the answer).

A model whose chat format writes its reasoning apart gets the parser of that format (gpt-oss's Harmony: the
analysis channel, engine/text/harmony.py; a Qwen3 `<think>` block could come here the same way); every other
model's reply is all text, decoded as before (PlainFormat). Parsers read token ids, so a format's markers are
found as the special tokens they are, never in text a user could have typed.

A session keeps a reply's reasoning beside its text (`assistant_message`), and never renders it into a later
prompt: the formats that write reasoning apart drop it from earlier turns (gpt-oss's template writes an analysis
only for a last assistant turn without a generation prompt, which kvchat never renders), and a reasoning text
handed to a template would be written as the template's own text, its special-token strings read as control tokens.
"""
from __future__ import annotations

from typing import Protocol

from kvchat.engine.text.detok import StreamDecoder

TEXT, REASONING = "text", "reasoning"
REASONING_KEY = "reasoning"         # an assistant message's reasoning in Session.messages (absent when it has none)


def assistant_message(text: str, reasoning: str = "") -> dict:
    """A reply as Session.messages holds it: {"role", "content"}, and "reasoning" only when there is some."""
    message = {"role": "assistant", "content": text}
    if reasoning:
        message[REASONING_KEY] = reasoning
    return message


def without_reasoning(message: dict) -> dict:
    """The message as a chat template sees it: its reasoning left out (see the module's docstring)."""
    return {k: v for k, v in message.items() if k != REASONING_KEY}


class ReplyParser(Protocol):
    """A reply's tokens in, its two parts out as they stream."""

    def push(self, token_id: int) -> tuple[str, str]:
        """Add a token; returns (text, reasoning) that is safe to show now (either may be empty)."""

    def flush(self) -> tuple[str, str]:
        """What is left at the end of the turn (bytes that never completed included)."""

    @property
    def text(self) -> str:
        """The answer so far, whole."""

    @property
    def reasoning(self) -> str:
        """The reasoning so far, whole."""


class PlainReply:
    """Every token is the answer's (StreamDecoder), as for every model before reasoning was kept apart."""

    reasoning = ""

    def __init__(self, tokenizer):
        self._stream = StreamDecoder(tokenizer)

    def push(self, token_id: int) -> tuple[str, str]:
        return self._stream.push(token_id), ""

    def flush(self) -> tuple[str, str]:
        return self._stream.flush(), ""

    @property
    def text(self) -> str:
        return self._stream.text()


class PlainFormat:
    """A model whose replies are all answer."""

    name = "plain"

    def parser(self, tokenizer, resume: list[int] = ()) -> PlainReply:
        """A parser for a reply; `resume`: its tokens so far (a Continue), which a plain reply needs not know."""
        return PlainReply(tokenizer)

    def reply_ids(self, tokenizer, text: str, reasoning: str = "") -> list[int]:
        """A reply's tokens as the model would have written them (a Continue of a reply whose cache is gone)."""
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def stop_ids(self, ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end a reply, given the vocabulary's usual ones."""
        return ids


PLAIN = PlainFormat()
