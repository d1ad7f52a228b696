"""gpt-oss's Harmony format: a reply in channels, read from its token ids as it streams.

A Harmony prompt ends with `<|start|>assistant`; the reply goes on with one message or more, each a header (an
optional recipient `to=...`, then `<|channel|>` and the channel's name, maybe `<|constrain|>` and a content type)
and a body after `<|message|>`:

    <|channel|>analysis<|message|>(reasoning)<|end|><|start|>assistant<|channel|>final<|message|>(answer)<|return|>

`<|end|>` ends a message and the model goes on with the next (so it is no stop token here, as in Phi-3's format);
`<|return|>` ends the reply, `<|call|>` ends it at a tool call. The final channel is the answer; analysis (the
chain of thought), commentary (tool calls and their preambles: kvchat offers no tools) and any message with a
recipient are reasoning. A reply with no markers at all is all answer. The markers are special tokens and are
found by id: a user's message holding their text is tokenized as plain text (chat_format.tokenize_pieces), and
so is a reply's own text, so neither can open a channel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvchat.engine.text.detok import StreamDecoder
from kvchat.engine.text.reasoning import REASONING, TEXT

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")
CONSTRAIN = "<|constrain|>"
SEPARATOR = "\n\n"                  # between two messages of the same part (an analysis, a preamble, an analysis)
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w.-]*)")
_PLAIN, _HEADER, _BODY, _OUTSIDE = "plain", "header", "body", "outside"


def special_id(tokenizer, text: str) -> int | None:
    """The id of `text` where the tokenizer holds it as one special token (and reads it as plain text when asked
    to split special tokens), else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        return None
    split = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return ids[0] if list(split) != list(ids) else None


@dataclass(frozen=True, slots=True)
class HarmonyFormat:
    """The Harmony markers' token ids of one vocabulary."""

    start: int
    end: int
    message: int
    channel: int
    ret: int
    call: int
    constrain: int | None = None
    name: str = "harmony"

    @classmethod
    def of(cls, tokenizer) -> "HarmonyFormat | None":
        """The format where every marker is a special token of this vocabulary, else None."""
        ids = [special_id(tokenizer, m) for m in MARKERS]
        if None in ids:
            return None
        return cls(*ids, constrain=special_id(tokenizer, CONSTRAIN))

    @property
    def markers(self) -> frozenset[int]:
        return frozenset(i for i in (self.start, self.end, self.message, self.channel, self.ret, self.call,
                                     self.constrain) if i is not None)

    def stop_ids(self, ids: frozenset[int]) -> frozenset[int]:
        """`<|return|>` and `<|call|>` end a reply; `<|end|>` only ends a message (the final one follows the
        analysis)."""
        return (ids | {self.ret, self.call}) - {self.end}

    def parser(self, tokenizer, resume: list[int] = ()) -> "HarmonyReply":
        return HarmonyReply(self, tokenizer, resume)

    def reply_ids(self, tokenizer, text: str, reasoning: str = "") -> list[int]:
        """A reply's tokens as the model writes them, from its parts (a Continue of a reply whose cache is gone): an
        analysis message and the final one; a reply cut in its analysis (no text yet) ends inside it."""
        def plain(s: str) -> list[int]:
            return tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True)
        if not text and not reasoning:
            return []
        ids: list[int] = []
        if reasoning:
            ids += [self.channel, *plain("analysis"), self.message, *plain(reasoning)]
            if not text:
                return ids
            ids += [self.end, self.start, *plain("assistant")]
        return ids + [self.channel, *plain("final"), self.message, *plain(text)]


class HarmonyReply:
    """One reply's parts as its tokens stream (engine.text.reasoning.ReplyParser). `resume`: the reply's tokens so
    far (a Continue): read first, so the parser goes on in the message the reply was cut in; `text` and `reasoning`
    then hold only what came after them."""

    def __init__(self, fmt: HarmonyFormat, tokenizer, resume: list[int] = ()):
        self._fmt = fmt
        self._tokenizer = tokenizer
        self._where = _PLAIN        # no header yet: a reply without markers is all answer
        self._part = TEXT
        self._header: list[int] = []
        self._run = StreamDecoder(tokenizer)        # the current message's body
        self._run_shown = False                     # some of its text went out
        self._runs: dict[str, list[str]] = {TEXT: [], REASONING: []}     # earlier bodies' text, by part
        self._base = {TEXT: "", REASONING: ""}
        for token_id in resume:
            self.push(token_id)
        self._base = {TEXT: self._whole(TEXT), REASONING: self._whole(REASONING)}

    # ---- the parts ----------------------------------------------------------------------------

    def _whole(self, part: str) -> str:
        runs = list(self._runs[part])
        if self._where in (_PLAIN, _BODY) and self._part == part:
            runs.append(self._run.text())
        return SEPARATOR.join(r for r in runs if r)

    @property
    def text(self) -> str:
        return self._whole(TEXT)[len(self._base[TEXT]):]

    @property
    def reasoning(self) -> str:
        return self._whole(REASONING)[len(self._base[REASONING]):]

    def _out(self, delta: str) -> tuple[str, str]:
        if delta and not self._run_shown:
            self._run_shown = True
            if any(self._runs[self._part]):
                delta = SEPARATOR + delta       # a body's first text, after an earlier body of the same part
        return (delta, "") if self._part == TEXT else ("", delta)

    def _end_body(self) -> tuple[str, str]:
        """The current body ends (a marker came): its last bytes go out and its text is kept."""
        if self._where not in (_PLAIN, _BODY):
            return "", ""
        out = self._out(self._run.flush())
        self._runs[self._part].append(self._run.text())
        self._run, self._run_shown = StreamDecoder(self._tokenizer), False
        return out

    # ---- tokens -------------------------------------------------------------------------------

    def push(self, token_id: int) -> tuple[str, str]:
        f = self._fmt
        if token_id not in f.markers:
            if self._where in (_PLAIN, _BODY):
                return self._out(self._run.push(token_id))
            self._where = _HEADER           # text outside a message: a header (dropped unless a body follows)
            self._header.append(token_id)
            return "", ""
        if token_id == f.constrain or (token_id == f.channel and self._where == _HEADER):
            if self._where == _HEADER:      # <|constrain|> means nothing outside a header
                self._header.append(token_id)
            return "", ""
        out = self._end_body()
        if token_id == f.start:
            self._where, self._header = _HEADER, []
        elif token_id == f.channel:         # at the reply's start, or after an end without a start
            self._where, self._header = _HEADER, [token_id]
        elif token_id == f.message:
            self._part = self._part_of(self._header if self._where == _HEADER else [])
            self._where, self._header = _BODY, []
        else:                               # end, return, call: the message is over
            self._where = _OUTSIDE
        return out

    def flush(self) -> tuple[str, str]:
        if self._where not in (_PLAIN, _BODY):
            return "", ""
        return self._out(self._run.flush())

    def _part_of(self, header: list[int]) -> str:
        """The part a message's body belongs to, from its header (model-written framing, never shown): the final
        channel without a recipient is the answer; so is a header with no channel, so that nothing meant to be
        read is hidden; every other channel, and any message to a recipient (a tool call), is reasoning."""
        names = {self._fmt.channel: "<|channel|>", self._fmt.constrain: "<|constrain|>"}
        pieces, run = [], []
        for i in header + [None]:
            if i is None or i in names:
                if run:
                    pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                if i is not None:
                    pieces.append(names[i])
            else:
                run.append(i)
        text = "".join(pieces)
        if "to=" in text:
            return REASONING
        channel = _CHANNEL.search(text)
        return TEXT if channel is None or channel.group(1) in ("final", "") else REASONING
