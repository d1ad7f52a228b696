"""engine/gguf/tokenizer.py: a GGUF's byte-level BPE tokenizer built with `tokenizers` alone equals the one
transformers' GGUF converter builds (files, ids, text, special tokens, chat rendering), a first start with the
default model never imports transformers, other kinds fall back to transformers, damaged metadata is refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType, GGUFWriter

from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.gguf.tokenizer import PRE_SPLITS, NotCovered, byte_alphabet, check_covered, write_folder
from kvchat.engine.model.source import default_gguf_path
from kvchat.engine.text.tokenizer_cache import _tokenizer_from_gguf, gguf_tokenizer
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.text.tokenizer import ChatTokenizer

ROOT = Path(__file__).resolve().parents[1]

CORPUS = [
    "", "Hi", "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    if x:\n\treturn x ** 2  # comment\n\t\tpass\n",
    "12345678 3.14159 0.5 1,000,000 2024-11-30 x1y22z333",
    "don't I'LL we've SHE'D it's You'RE they'm",
    "🙂👍🏽 emoji 🇫🇷 and CJK: 日本語のテキスト、中文文本。한국어",
    "many     spaces   and\n\n\n\nnewlines \r\n\r\n  \t  end   ",
    " leading space", "trailing space ", "\u00a0\u2003odd spaces\u200b",
    "a<|im_end|>b <|im_start|>user\nx<|endoftext|>", "<|im_start|>", "<|endoftext|><|endoftext|>",
    "<repo_name>kvchat<file_sep>x", "Ünïcödé façade naïve Øre", "x" * 200,
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?\n  Show    work."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b 🙂"},
     {"role": "user", "content": "c <|im_end|> 日本"}],
]


def reference_folder(path: Path, folder: Path):
    """transformers' converter, saved as loader.gguf_tokenizer saved it before: (tokenizer, folder)."""
    tok = _tokenizer_from_gguf(path)
    tok.save_pretrained(str(folder))
    return tok, folder


def ours(path: Path, folder: Path) -> ChatTokenizer:
    write_folder(GGUFFile(path), folder)
    return ChatTokenizer(folder)


def assert_same_files(mine: Path, theirs: Path):
    assert json.loads((mine / "tokenizer.json").read_text()) == json.loads((theirs / "tokenizer.json").read_text())
    assert json.loads((mine / "tokenizer_config.json").read_text()) == \
        json.loads((theirs / "tokenizer_config.json").read_text())
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
    if (theirs / "chat_template.jinja").exists():
        assert (mine / "chat_template.jinja").read_text() == (theirs / "chat_template.jinja").read_text()


def assert_same_behaviour(tok: ChatTokenizer, ref, corpus=CORPUS, chats=CHATS, same_vocab=True):
    for text in corpus:
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == \
                ref.encode(text, add_special_tokens=special), (text, special)
        ids = ref.encode(text, add_special_tokens=True)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text     # byte-level BPE: text comes back
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(tok, name) == getattr(ref, name), name
        assert getattr(tok, name + "_id") == getattr(ref, name + "_id"), name
    assert set(tok.all_special_ids) <= set(ref.all_special_ids)
    if same_vocab:
        assert tok.get_vocab() == ref.get_vocab()
        assert len(tok) == len(ref)
    if ref.chat_template:
        for chat in chats:
            assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
                ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
                ref.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)


# ---- the default model and the tiny random GGUFs (its vocabulary) ---------------------------------------

@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    from kvchat.bench.gguf_writer import write_random_gguf
    folder = tmp_path_factory.mktemp("tiny")
    return [write_random_gguf(folder / f"tiny-{seed}.gguf", "tiny", "Q8_0", seed=seed) for seed in (0, 3)]


@pytest.mark.slow
def test_default_model_equals_transformers(tmp_path):
    path = default_gguf_path()
    assert check_covered(GGUFFile(path)) == "smollm"
    ref, theirs = reference_folder(path, tmp_path / "theirs")
    tok = ours(path, tmp_path / "mine")
    assert_same_files(tmp_path / "mine", theirs)
    assert_same_behaviour(tok, ref)
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.decode(tok.encode("12345678 don't 日本語")) == "12345678 don't 日本語"


def test_tiny_random_ggufs_equal_transformers(tiny_ggufs, tmp_path):
    for n, path in enumerate(tiny_ggufs):
        ref, theirs = reference_folder(path, tmp_path / f"theirs{n}")
        tok = ours(path, tmp_path / f"mine{n}")
        assert_same_files(tmp_path / f"mine{n}", theirs)
        assert_same_behaviour(tok, ref)


def test_byte_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    assert byte_alphabet() == tuple(bytes_to_unicode()[b] for b in range(256))
    assert len(set(byte_alphabet())) == 256


# ---- other pre-tokenizers and flags: metadata-only GGUFs with the default vocabulary ---------------------

_TYPES = {str: GGUFValueType.STRING, bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32}


@pytest.fixture(scope="module")
def vocab_fields():
    """The default model's tokenizer.* metadata, in full."""
    g = GGUFFile(default_gguf_path())
    out = {}
    for key, value in g.fields.items():
        if key.startswith("tokenizer."):
            out[key] = g.array(key) if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                               "tokenizer.ggml.token_type") else value
    return out


def metadata_gguf(path: Path, fields: dict, **changes) -> Path:
    """A GGUF with only metadata: `fields` with `changes` (a value of None drops the key; dots as __)."""
    fields = dict(fields)
    for key, value in changes.items():
        key = "tokenizer." + key.replace("__", ".")
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value
    writer = GGUFWriter(path, "llama")
    for key, value in fields.items():
        if key == "tokenizer.ggml.token_type":
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.INT32)
        elif isinstance(value, list):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.STRING)
        else:
            writer.add_key_value(key, value, _TYPES[type(value)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


# one pre name per split family, and the flags transformers turns into a post-processor
VARIANTS = {
    "llama-bpe+bos": dict(ggml__pre="llama-bpe", ggml__add_bos_token=True),
    "qwen2": dict(ggml__pre="qwen2"),
    "gpt2+bos+eos": dict(ggml__pre="gpt2", ggml__add_bos_token=True, ggml__add_eos_token=True),
    "default, no pre, no pad, no template": dict(ggml__pre=None, ggml__padding_token_id=None, chat_template=None),
    "user-defined and unmarked specials": dict(ggml__pre="llama3"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_equal_transformers(name, vocab_fields, tmp_path):
    changes = dict(VARIANTS[name])
    if name.startswith("user-defined"):
        types = list(vocab_fields["tokenizer.ggml.token_type"])
        tokens = vocab_fields["tokenizer.ggml.tokens"]
        for i in (5, 6):              # <file_sep>, <filename>: whole-matched, not special
            types[i] = 4
        types[1] = 1                  # <|im_start|> unmarked, yet the bos token: special all the same
        types[tokens.index("Ġhello")] = 4
        changes["ggml__token_type"] = types
    path = metadata_gguf(tmp_path / "v.gguf", vocab_fields, **changes)
    ref, theirs = reference_folder(path, tmp_path / "theirs")
    tok = ours(path, tmp_path / "mine")
    assert_same_files(tmp_path / "mine", theirs)
    assert_same_behaviour(tok, ref, CORPUS + [" hello hello", "<file_sep>"])
    if "bos" in name:
        assert tok.encode("Hi")[0] == tok.bos_token_id
        assert tok.encode("Hi", add_special_tokens=False)[0] != tok.bos_token_id


def test_no_token_beyond_the_vocabulary(vocab_fields, tmp_path):
    """The one deliberate difference: without "<|endoftext|>" in the vocabulary (Llama 3 has <|end_of_text|>),
    transformers' converter still adds it, as an id past the model's embedding rows; here it stays plain text."""
    tokens = list(vocab_fields["tokenizer.ggml.tokens"])
    tokens[0] = "<|eot|>"
    path = metadata_gguf(tmp_path / "l3.gguf", vocab_fields, ggml__tokens=tokens, ggml__pre="llama-bpe")
    ref, _ = reference_folder(path, tmp_path / "theirs")
    tok = ours(path, tmp_path / "mine")
    assert len(ref) == len(tokens) + 1 and ref.convert_tokens_to_ids("<|endoftext|>") == len(tokens)
    assert len(tok) == len(tokens) and tok.token_to_id("<|endoftext|>") is None
    assert max(tok.encode("a<|endoftext|>b")) < len(tokens)
    assert tok.decode(tok.encode("a<|endoftext|>b")) == "a<|endoftext|>b"
    assert_same_behaviour(tok, ref, [t for t in CORPUS if "<|endoftext|>" not in t], same_vocab=False)


def test_split_regexes_are_transformers(vocab_fields):
    """Each covered pre name splits as transformers' converter splits it (GPT-2's own split where it has none)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    for pre, split in PRE_SPLITS.items():
        assert GGUF_PRE_TOKENIZER_SPLITS.get(pre) == split, pre


def test_splits_differ_by_family(vocab_fields, tmp_path):
    """The families split where their regexes differ: GPT-2 keeps a digit run whole and reads only lower-case
    contractions, Llama 3 groups digits by three, Qwen2 takes them one by one."""
    from tokenizers import Tokenizer

    def pieces(pre, text):
        path = metadata_gguf(tmp_path / f"{pre}.gguf", vocab_fields, ggml__pre=pre)
        write_folder(GGUFFile(path), tmp_path / pre)
        split = Tokenizer.from_file(str(tmp_path / pre / "tokenizer.json")).pre_tokenizer.pre_tokenize_str(text)
        return [piece for piece, _ in split]
    assert pieces("smollm", "12345678 I'LL") == ["12345678", "ĠI", "'", "LL"]
    assert pieces("llama-bpe", "12345678 I'LL") == ["123", "456", "78", "ĠI", "'LL"]
    assert pieces("qwen2", "12345678 I'LL") == list("12345678") + ["ĠI", "'LL"]


# ---- what falls back, what is refused -----------------------------------------------------------------------

def test_uncovered_kinds_fall_back_to_transformers(vocab_fields, tmp_path, monkeypatch):
    import kvchat.engine.text.tokenizer_cache as loader
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    real = loader._tokenizer_from_gguf
    for pre in ("tekken", "some-future-model"):
        path = metadata_gguf(tmp_path / f"{pre}.gguf", vocab_fields, ggml__pre=pre)
        with pytest.raises(NotCovered, match=pre):
            check_covered(GGUFFile(path))
        calls = []
        monkeypatch.setattr(loader, "_tokenizer_from_gguf", lambda p: calls.append(p) or real(p))
        tok = gguf_tokenizer(path)
        assert calls == [path]
        assert_same_behaviour(tok, real(path), CORPUS[:6], CHATS[:1])
    path = metadata_gguf(tmp_path / "t5.gguf", vocab_fields, ggml__model="t5")      # Unigram: transformers builds it
    with pytest.raises(NotCovered, match="'t5'"):
        check_covered(GGUFFile(path))
    path = metadata_gguf(tmp_path / "spm.gguf", vocab_fields, ggml__model="llama")   # SentencePiece, a BPE split
    with pytest.raises(NotCovered, match="SentencePiece vocabulary with pre-tokenizer 'smollm'"):
        check_covered(GGUFFile(path))


@pytest.mark.parametrize("changes, message", [
    (dict(ggml__merges=None), "lacks the metadata key 'tokenizer.ggml.merges'"),
    (dict(ggml__tokens=None), "lacks the metadata key 'tokenizer.ggml.tokens'"),
    (dict(ggml__merges=["Ġ t", "no such pair"]), "merge 1 .* is not two tokens"),
    (dict(ggml__merges=["Ġ t", "zzzq qqqz"]), "merges do not fit the vocabulary"),
    (dict(ggml__eos_token_id=10 ** 6), "eos_token_id is 1000000, outside the vocabulary of 49152 tokens"),
    (dict(ggml__token_type=[1, 3, 3]), "3 token types for 49152 tokens"),
])
def test_damaged_metadata_is_a_clear_error(changes, message, vocab_fields, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = metadata_gguf(tmp_path / "bad.gguf", vocab_fields, **changes)
    with pytest.raises(ModelLoadError, match=message) as err:
        gguf_tokenizer(path)
    assert "bad.gguf" in str(err.value) and "re-download or re-export" in str(err.value)
    assert not list((tmp_path / "cache").rglob("tokenizer.json"))      # nothing half-written is cached


# ---- a first start never imports transformers ---------------------------------------------------------------

@pytest.mark.slow
def test_first_start_with_default_model_does_not_import_transformers(tmp_path):
    code = ("import sys, time\n"
            "from kvchat.engine.model.source import locate\n"
            "from kvchat.engine.text.tokenizer_cache import gguf_tokenizer, gguf_tokenizer_dir\n"
            "path = locate('default').path\n"
            "assert not gguf_tokenizer_dir(path).exists()\n"
            "tok = gguf_tokenizer(path)\n"
            "assert gguf_tokenizer_dir(path).is_dir()\n"
            "assert tok.encode('<|im_start|>user', add_special_tokens=False)[0] == 1\n"
            "print(sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.')))\n")
    env = dict(os.environ, KVCHAT_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
