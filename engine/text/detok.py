"""Incremental detokenization that never emits half of a multi-byte character."""
from __future__ import annotations


class StreamDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add a token; return the new text that is safe to show (may be empty)."""
        self.ids.append(token_id)
        now = self.text()
        # a trailing U+FFFD is a character whose bytes have not all arrived yet
        if now.endswith("\ufffd") or len(now) <= len(self.emitted) or not now.startswith(self.emitted):
            return ""
        delta = now[len(self.emitted):]
        self.emitted = now
        return delta

    def flush(self) -> str:
        """Whatever is left at the end of the turn (bytes that never completed included)."""
        now = self.text()
        delta = now[len(self.emitted):] if now.startswith(self.emitted) else ""
        self.emitted = now
        return delta
