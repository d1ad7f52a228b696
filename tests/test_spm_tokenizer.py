"""engine/gguf/tokenizer.py on SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`): Llama 2 / Mistral,
Gemma and Phi-3 style files, built with `tokenizers` alone, encode and decode as transformers' own GGUF converter
(AutoTokenizer.from_pretrained(folder, gguf_file=...)) over text with CJK, emoji, digits, leading and double
spaces, newlines, special-token strings and characters the vocabulary lacks (byte fallback).

The vocabularies are made here: a BPE trained with `tokenizers` over a small corpus, laid out as each family's
file is (special tokens, the 256 byte tokens <0x00>..<0xFF>, pieces by score), written by our GGUF writer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFValueType as T

from kvchat.bench.gguf_writer import atomic_writer
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.gguf.tokenizer import check_covered, write_folder
from kvchat.engine.text.tokenizer import ChatTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"
TRAINING = ["The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, numbers 2024 and 12345.",
            "  leading spaces and  double   spaces\nnew lines\n\nand tabs\t.", "日本語 and 中文 text, ünïcödé",
            "def add(a, b):\n    return a + b\n", "the cache holds keys and values for every token"] * 4
CORPUS = ["", "Hi", "Hello world!", " Hello", "  two leading", "double  space and   three",
          "new\nline\n\nand\r\n crlf", "\ttab and trailing  ", "digits 0 12 345 6789 3.14159",
          "日本語のテキスト、中文文本。한국어", "emoji 🙂👍🏽🇫🇷 not in the vocabulary", "ünïcödé façade naïve",
          "<s>user</s> text <start_of_turn>model\n<end_of_turn> <|user|>q<|end|>", "x" * 120, "   "]


def spm_vocab(family: str) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """(tokens, scores, types, special ids) of a SentencePiece vocabulary in `family`'s layout."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    tok.train_from_iterator(TRAINING, trainers.BpeTrainer(vocab_size=420, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    made = ["".join(m if isinstance(m, list) else m.split(" ")) for m in model["merges"]]
    chars = [t for t in model["vocab"] if len(t) == 1]
    if family == "gemma":
        head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN), ("<mask>", CONTROL),
                ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
        ids = dict(bos=2, eos=1, unk=3, pad=0)
    else:
        head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
        ids = dict(bos=1, eos=2, unk=0)
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in head] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = list(dict.fromkeys(made + chars))
    if family == "gemma":     # Gemma's file stores a token of two or more spaces as real spaces
        pieces = [SPACE * 2, SPACE * 3] + [p for p in pieces if p.strip(SPACE) or p == SPACE]
    for rank, piece in enumerate(pieces):
        if piece not in tokens:
            spaces = family == "gemma" and len(piece) > 1 and not piece.strip(SPACE)
            tokens.append(" " * len(piece) if spaces else piece)
            types.append(NORMAL)
            scores.append(-float(rank) if len(piece) > 1 else -1e6 - rank)
    if family == "phi3":      # Phi-3's chat tokens follow the pieces: one control, two user-defined
        for t, kind in (("<|end|>", CONTROL), ("<|user|>", USER_DEFINED), ("<|assistant|>", USER_DEFINED)):
            tokens.append(t)
            types.append(kind)
            scores.append(0.0)
    return tokens, scores, types, ids


def write_vocab_gguf(path: Path, arch: str, family: str, add_bos: bool | None = True, add_eos: bool = False,
                     template: str | None = None) -> Path:
    """A GGUF of `arch` holding only a SentencePiece tokenizer (what the tokenizer reads of a model file)."""
    tokens, scores, types, ids = spm_vocab(family)
    with atomic_writer(path, arch) as w:
        w.add_key_value("tokenizer.ggml.model", "llama", T.STRING)
        w.add_key_value("tokenizer.ggml.tokens", tokens, T.ARRAY, T.STRING)
        w.add_key_value("tokenizer.ggml.scores", scores, T.ARRAY, T.FLOAT32)
        w.add_key_value("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32)
        for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                          ("pad", "padding_token_id")):
            if name in ids:
                w.add_key_value(f"tokenizer.ggml.{key}", ids[name], T.UINT32)
        if add_bos is not None:
            w.add_key_value("tokenizer.ggml.add_bos_token", add_bos, T.BOOL)
        w.add_key_value("tokenizer.ggml.add_eos_token", add_eos, T.BOOL)
        w.add_key_value("tokenizer.ggml.add_space_prefix", family != "gemma", T.BOOL)
        if template:
            w.add_key_value("tokenizer.chat_template", template, T.STRING)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return path


def both(path: Path, tmp_path: Path):
    """(ours, transformers') tokenizers of one file."""
    from transformers import AutoTokenizer
    write_folder(GGUFFile(path), tmp_path / "ours")
    return ChatTokenizer(tmp_path / "ours"), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


CASES = {"llama-2": ("llama", "llama"), "mistral": ("mistral", "llama"), "gemma-3": ("gemma3", "gemma"),
         "gemma-2": ("gemma2", "gemma"), "phi-3": ("phi3", "phi3")}


@pytest.mark.parametrize("case", list(CASES))
def test_sentencepiece_vocabularies_encode_and_decode_as_transformers(tmp_path, case):
    arch, family = CASES[case]
    (tmp_path / "file").mkdir()
    path = write_vocab_gguf(tmp_path / "file" / f"{case}.gguf", arch, family)
    assert check_covered(GGUFFile(path)) == "llama"
    mine, ref = both(path, tmp_path)
    byte_pieces = 0
    for text in CORPUS:
        for special in (True, False):
            ids = mine.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (case, text, special)
        byte_pieces += sum(1 for t in mine.convert_ids_to_tokens(ids) if t.startswith("<0x"))
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (case, text)
    assert byte_pieces > 20           # the corpus reached the byte fallback (emoji, CJK the pieces lack)
    assert mine.encode("Hi")[0] == mine.bos_token_id == ref.bos_token_id
    assert (mine.bos_token, mine.eos_token, mine.unk_token) == (ref.bos_token, ref.eos_token, ref.unk_token)


def test_flags_and_leading_spaces_follow_the_file(tmp_path):
    """add_bos_token false adds none, absent adds BOS (llama.cpp's default for SentencePiece), add_eos_token adds
    EOS; Llama's text gets a leading "▁" unless it starts with a space, Phi-3's one before its own spaces, Gemma's
    none."""
    (tmp_path / "f").mkdir()
    for n, (add_bos, add_eos) in enumerate(((False, False), (None, True))):
        path = write_vocab_gguf(tmp_path / "f" / f"flags{n}.gguf", "llama", "llama", add_bos=add_bos, add_eos=add_eos)
        mine, ref = both(path, tmp_path / f"f{n}")
        ids = mine.encode("Hello world")
        assert ids == ref.encode("Hello world")
        assert (ids[0] == mine.bos_token_id) == (add_bos is None) and (ids[-1] == mine.eos_token_id) == add_eos
    pieces = {}
    for arch, family in (("llama", "llama"), ("phi3", "phi3"), ("gemma3", "gemma")):
        path = write_vocab_gguf(tmp_path / "f" / f"{arch}.gguf", arch, family, add_bos=False)
        mine, _ = both(path, tmp_path / arch)
        pieces[arch] = "".join(mine.convert_ids_to_tokens(mine.encode("  hi")))
    assert pieces == {"llama": SPACE * 2 + "hi", "phi3": SPACE * 3 + "hi", "gemma3": SPACE * 2 + "hi"}
    path = write_vocab_gguf(tmp_path / "f" / "llama-lead.gguf", "llama", "llama", add_bos=False)
    mine, ref = both(path, tmp_path / "lead")
    assert "".join(mine.convert_ids_to_tokens(mine.encode("hi"))) == SPACE + "hi"
    assert mine.decode(mine.encode("hi  there")) == ref.decode(ref.encode("hi  there")) == "hi  there"


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
                  "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
LLAMA2_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}"
PHI3_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@pytest.mark.parametrize("arch, family, template, turn", [
    ("gemma3", "gemma", GEMMA_TEMPLATE, "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"),
    ("phi3", "phi3", PHI3_TEMPLATE, "<|user|>\nHi there<|end|>\n<|assistant|>\n"),
    ("llama", "llama", LLAMA2_TEMPLATE, "<s>[INST] Hi there [/INST]")])
def test_the_loader_builds_it_without_transformers_and_reads_the_template(tmp_path, monkeypatch, arch, family,
                                                                          template, turn):
    """gguf_tokenizer builds a SentencePiece file's tokenizer itself (transformers' converter is never called) and
    the file's chat template renders its own turns, the turn tokens encoded whole as the converter does."""
    import kvchat.engine.text.tokenizer_cache as cache
    from kvchat.engine.text.chat_format import encode_conversation, tokenize_pieces
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_tokenizer_from_gguf", lambda p: pytest.fail("transformers' converter was used"))
    (tmp_path / "f").mkdir()
    path = write_vocab_gguf(tmp_path / "f" / f"{arch}.gguf", arch, family, template=template)
    tok = cache.gguf_tokenizer(path)
    text, pieces = encode_conversation(tok, None, [{"role": "user", "content": "Hi there"}])
    assert text == turn
    ids = tokenize_pieces(tok, pieces)
    _, ref = both(path, tmp_path)
    # piece by piece, no "▁" is added before the message: the text reads back as transformers' whole-text tokens do
    assert tok.decode(ids) == ref.decode(ref.encode(text, add_special_tokens=False))
    end = {"gemma": "<end_of_turn>", "phi3": "<|end|>", "llama": "<s>"}[family]
    assert tok.token_to_id(end) in ids

