"""A cached GGUF tokenizer and chat template, served by `tokenizers` and jinja2 alone.

Importing transformers costs about a second of start-up and ~20 MiB; once a GGUF's tokenizer is in
the cache (loader.gguf_tokenizer writes it the first time: gguf/tokenizer.py for byte-level BPE,
transformers' converter for other kinds), this class
reads it back without it. It answers the part of transformers' tokenizer API kvchat uses, with the
same results: `encode` (add_special_tokens, split_special_tokens), `decode`, `apply_chat_template`
(rendered as transformers renders it, by engine/text/chat_template.py under a time and size limit: a sandboxed,
immutable jinja2 environment with trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`
and a `tojson` that leaves non-ASCII as it is; the special tokens are template variables), the special tokens
and their ids, the vocabulary.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTokenizer:
    encodes_continuations = True       # encode(..., continuation=True): see encode
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._cont = None          # the tokenizer for continuations, made on first use (see _continuing)
        self._added = None
        # encode_special_tokens is state of the Rust tokenizer, not an argument: the server encodes on several
        # threads at once, and a template's <|im_start|> encoded while another thread had the flag set for a
        # user's text came out as plain-text pieces (seen as one stream of a load test differing from its solo run)
        self._encoding = threading.Lock()
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.special_tokens_map = {k: _token_text(config[k]) for k in SPECIAL_NAMES if config.get(k)}
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text(encoding="utf-8") if template.is_file() else config.get("chat_template")
        self.name_or_path = str(folder)

    # ---- special tokens ------------------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self._tok.token_to_id(text)

    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    unk_token = property(lambda self: self.special_tokens_map.get("unk_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def all_special_ids(self) -> list[int]:
        ids = [self._special_id(n) for n in SPECIAL_NAMES]
        return list(dict.fromkeys(i for i in ids if i is not None))

    # ---- vocabulary ----------------------------------------------------------------------------

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (added tokens included), or None."""
        return self._tok.token_to_id(token)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    # ---- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False,
               continuation: bool = False) -> list[int]:
        """split_special_tokens=True reads a special token's text inside `text` as plain text. continuation=True:
        `text` continues text already encoded (a piece of a rendered chat), so a SentencePiece tokenizer adds no
        leading "▁" of its own: encoded piece by piece, a chat reads as the whole text would, with no space added
        before each message."""
        if continuation and add_special_tokens:
            raise ValueError("a continuation lies inside a text: it takes no BOS / EOS (add_special_tokens=False)")
        with self._encoding:
            return self._encode(text, add_special_tokens, split_special_tokens, continuation)

    def _encode(self, text: str, add_special_tokens: bool, split_special_tokens: bool, continuation: bool) -> list[int]:
        self._tok.encode_special_tokens = bool(split_special_tokens)
        if not continuation or self._continuing() is self._tok:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # only the text before its first added token continues the earlier text: what follows an added token is
        # a section of its own, encoded as in the whole text (Phi-3's normalizer gives each such section its "▁")
        whole = self._tok.encode(text, add_special_tokens=False)
        added = self._added_ids()
        first = next((n for n, i in enumerate(whole.ids) if i in added), None)
        cut = len(text) if first is None else whole.offsets[first][0]
        self._cont.encode_special_tokens = bool(split_special_tokens)
        ids = self._cont.encode(text[:cut], add_special_tokens=False).ids
        if cut < len(text):
            ids += self._tok.encode(text[cut:], add_special_tokens=False).ids
        return ids

    def _added_ids(self) -> frozenset[int]:
        if self._added is None:
            self._added = frozenset(self._tok.get_added_tokens_decoder())
        return self._added

    def _continuing(self):
        """The tokenizer without the leading "▁" SentencePiece adds to a text (Metaspace's prepend, Phi-3's Prepend
        normalizer); itself where it adds none (byte-level BPE, Gemma)."""
        if self._cont is None:
            from tokenizers import Tokenizer
            spec = json.loads(self._tok.to_str())
            pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
            changed = False
            if pre.get("type") == "Metaspace" and pre.get("prepend_scheme") != "never":
                pre["prepend_scheme"], changed = "never", True
            if norm.get("type") == "Sequence":
                kept = [n for n in norm["normalizers"] if n.get("type") != "Prepend"]
                changed |= len(kept) != len(norm["normalizers"])
                norm["normalizers"] = kept
            self._cont = Tokenizer.from_str(json.dumps(spec)) if changed else self._tok
        return self._cont

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        # clean_up_tokenization_spaces is a WordPiece fix-up that transformers itself skips for BPE (every
        # GGUF tokenizer here is BPE, SentencePiece ones included): accepted, never applied
        if isinstance(ids, int):
            ids = [ids]
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat template -------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            tools=None, documents=None, **kwargs):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        from kvchat.engine.text.chat_template import render       # jinja2 is imported on the first render, not at start
        rendered = render(self.chat_template, conversation, add_generation_prompt, tools=tools, documents=documents,
                          **{**self.special_tokens_map, **kwargs})
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered


def _token_text(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)
