"""A GGUF's tokenizer written out with the `tokenizers` library alone (no transformers).

A GGUF carries its tokenizer as llama.cpp metadata: the vocabulary, the merges or the scores, each token's
type, the special token ids, the name of the pre-tokenizer (`tokenizer.ggml.pre`) and the chat template.
This module turns that into the folder engine/text/tokenizer.py:ChatTokenizer reads (tokenizer.json,
tokenizer_config.json, chat_template.jinja), the same tokenizer transformers' GGUF converter builds, for two
kinds of `tokenizer.ggml.model`:

- "gpt2", byte-level BPE: each token spelled in GPT-2's byte alphabet; GPT-2's byte-level split, or for the
  `pre` names below the split regex of that model family followed by a byte-level mapping without its own
  regex; a byte-level decoder; no normalizer.
- "llama", SentencePiece (Llama 2, Mistral, Gemma, Phi-3): BPE with byte fallback (the <0x00>..<0xFF>
  tokens) over the vocabulary as spelled, merged in the order the file's merges give or, where it has none,
  the order its scores imply (Gemma's: the order of the tokens); spaces as "▁" with a leading one before
  the text (Llama, Mistral: Metaspace on the first section; Phi-3: before every text), none for Gemma;
  the decoder turns "▁" back into spaces, reads byte tokens as bytes and (but for Gemma) strips the leading
  space. Like transformers, `tokenizer.ggml.add_space_prefix` is not read; a file without
  `add_bos_token` adds BOS (llama.cpp's default for SentencePiece).

Both: added tokens marked CONTROL (type 3) are special, those marked USER_DEFINED (type 4) are matched
whole but not special, the named special tokens (bos, eos, unk, pad) are special; a post-processor adds
BOS / EOS as the file says. Any other kind (other pre-tokenizers, Unigram "t5", ...) raises NotCovered and
the loader uses transformers' converter. Importing transformers costs seconds on a first start; this takes
a fraction of one (a 256k-token SentencePiece vocabulary: about a second, once, for its merges).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from kvchat.engine.gguf.file import GGUFFile, SkippedArray
from kvchat.engine.errors import ModelLoadError
CONTROL, USER_DEFINED = 3, 4
# The split each family's merges were learned with. None: GPT-2's own (the byte-level pre-tokenizer's regex).
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None, "smollm": None,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
# GPT2Tokenizer's default special token: transformers' converter makes it special when the vocabulary has it
_GPT2_DEFAULT_SPECIAL = "<|endoftext|>"
_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))


class NotCovered(Exception):
    """This GGUF's tokenizer is of a kind built by transformers' converter instead (the message says which)."""


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """GPT-2's printable spelling of each byte value 0..255: printable Latin-1 bytes stand for themselves, the
    others (controls, space, soft hyphen...) take the code points from 256 up, in byte order."""
    keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return tuple(spelled[b] for b in range(256))


def check_covered(gguf: GGUFFile) -> str:
    """The `pre` name of a byte-level BPE tokenizer this module builds, "llama" for a SentencePiece one (whose
    `pre` must be absent or "default"); NotCovered otherwise."""
    model = gguf.fields.get("tokenizer.ggml.model")
    pre = gguf.fields.get("tokenizer.ggml.pre", "default")
    if model == "llama":
        if pre != "default":
            raise NotCovered(f"SentencePiece vocabulary with pre-tokenizer {pre!r}")
        return "llama"
    if model != "gpt2":
        raise NotCovered(f"tokenizer model {model!r} (byte-level BPE, 'gpt2', and SentencePiece, 'llama', are "
                         f"built without transformers)")
    if pre not in PRE_SPLITS:
        raise NotCovered(f"pre-tokenizer {pre!r}")
    return pre


def build(gguf: GGUFFile):
    """(tokenizers.Tokenizer, tokenizer_config dict, chat template or None) of a covered GGUF."""
    from tokenizers import AddedToken, processors

    pre = check_covered(gguf)
    sentencepiece = pre == "llama"
    name = gguf.path.name
    tokens = _strings(gguf, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{name}: the vocabulary (tokenizer.ggml.tokens) is empty: the file is damaged; "
                             f"re-download or re-export it")
    types = gguf.array("tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in gguf.fields else []
    if types and len(types) != len(tokens):
        raise ModelLoadError(f"{name}: {len(types)} token types for {len(tokens)} tokens: the tokenizer metadata "
                             f"is damaged; re-download or re-export the file")

    config = {}
    for key, id_key in _SPECIAL_IDS:
        token_id = gguf.fields.get(f"tokenizer.ggml.{id_key}")
        if token_id is None:
            continue
        if not (isinstance(token_id, int) and 0 <= token_id < len(tokens)):
            raise ModelLoadError(f"{name}: tokenizer.ggml.{id_key} is {token_id!r}, outside the vocabulary of "
                                 f"{len(tokens)} tokens: the file is damaged; re-download or re-export it")
        config[key] = tokens[token_id]

    if sentencepiece:
        tok, vocab, specials = _sentencepiece(gguf, tokens, config.get("unk_token"))
        specials += [t for t, kind in zip(tokens, types) if kind == CONTROL]
    else:
        tok, vocab, letters = _byte_level(gguf, tokens, pre)
        specials = [_GPT2_DEFAULT_SPECIAL] if _GPT2_DEFAULT_SPECIAL in vocab else []
        # a CONTROL token outside the byte alphabet is a mislabel the converter skips (it would grow the vocabulary)
        specials += [t for t, kind in zip(tokens, types) if kind == CONTROL and letters.issuperset(t)]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(specials)])
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in dict.fromkeys(user)])
    named = [t for t in dict.fromkeys(config.values()) if t not in specials and t not in user]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])

    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (older files)
    add_bos = bool(gguf.fields.get("tokenizer.ggml.add_bos_token", sentencepiece)) and "bos_token" in config
    add_eos = bool(gguf.fields.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in config
    single = " ".join(([f"{config['bos_token']}:0"] if add_bos else []) + ["$A:0"]
                      + ([f"{config['eos_token']}:0"] if add_eos else []))
    pair = " ".join([single] + ([f"{config['bos_token']}:1"] if add_bos else []) + ["$B:1"]
                    + ([f"{config['eos_token']}:1"] if add_eos else []))
    used = ([config["bos_token"]] if add_bos else []) + ([config["eos_token"]] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(used)])

    template = gguf.fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{name}: tokenizer.chat_template is not text: the file is damaged")
    return tok, config, template


def _pairs(gguf: GGUFFile, merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for n, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"{gguf.path.name}: merge {n} ({merge!r}) is not two tokens: the tokenizer metadata "
                                 f"is damaged; re-download or re-export the file")
        pairs.append((parts[0], parts[1]))
    return pairs


def _unfit(gguf: GGUFFile, exc: Exception) -> ModelLoadError:
    return ModelLoadError(f"{gguf.path.name}: the merges do not fit the vocabulary ({exc}): the tokenizer metadata "
                          f"is damaged; re-download or re-export the file")


def _byte_level(gguf: GGUFFile, tokens: list[str], pre: str):
    """(tokenizer, its vocabulary, the byte alphabet's letters) of a "gpt2" vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    pairs = _pairs(gguf, _strings(gguf, "tokenizer.ggml.merges"))
    alphabet = byte_alphabet()
    letters = frozenset(alphabet)
    # a token outside the byte alphabet (a special token's plain text) is respelled byte by byte
    vocab = {t if letters.issuperset(t) else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    try:
        tok = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    except Exception as exc:     # a merge naming a token the vocabulary lacks
        raise _unfit(gguf, exc) from exc
    split = PRE_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, vocab, letters


def _sentencepiece(gguf: GGUFFile, tokens: list[str], unk: str | None):
    """(tokenizer, its vocabulary, the special tokens its converter adds first) of a "llama" vocabulary: the
    file's merges where it has them, else those its scores (Gemma: its order) imply."""
    from kvchat.engine.gguf import spm
    arch = str(gguf.arch)
    spelled = spm.respell(tokens, arch)
    if "tokenizer.ggml.merges" in gguf.fields:
        pairs = _pairs(gguf, _strings(gguf, "tokenizer.ggml.merges"))
    else:
        scores = gguf.array("tokenizer.ggml.scores") if "tokenizer.ggml.scores" in gguf.fields else None
        if scores is not None and len(scores) != len(tokens):
            raise ModelLoadError(f"{gguf.path.name}: {len(scores)} token scores for {len(tokens)} tokens: the "
                                 f"tokenizer metadata is damaged; re-download or re-export the file")
        pairs = spm.merges(spelled, scores, arch)
    try:
        tok = spm.build_model(spelled, pairs, arch, unk)
    except Exception as exc:
        raise _unfit(gguf, exc) from exc
    return tok, {t: i for i, t in enumerate(spelled)}, []


def write_folder(gguf: GGUFFile, folder: Path) -> None:
    """Write the tokenizer folder ChatTokenizer reads (what transformers' save_pretrained writes of it)."""
    tok, config, template = build(gguf)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"backend": "tokenizers", **{key: config.get(key) for key, _ in _SPECIAL_IDS},
                "model_max_length": int(1e30),
                "tokenizer_class": "TokenizersBackend"}
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(sorted(settings.items())), indent=2,
                                                             ensure_ascii=False) + "\n", encoding="utf-8")
    if template:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")


def _strings(gguf: GGUFFile, key: str) -> list[str]:
    if key not in gguf.fields:
        raise ModelLoadError(f"{gguf.path.name} lacks the metadata key {key!r}: its tokenizer is incomplete; "
                             f"re-download or re-export the file")
    value = gguf.fields[key]
    if not (isinstance(value, SkippedArray) and value.item_type == 8) and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ModelLoadError(f"{gguf.path.name}: {key!r} is not a list of strings: the file is damaged; "
                             f"re-download or re-export it")
    return gguf.array(key)
