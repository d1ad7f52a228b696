"""The cached GGUF tokenizer without transformers: same ids, text and chat rendering; a warm start never imports it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_cache import seeded
from kvchat.engine.model.source import default_gguf_path

from kvchat.engine.text.tokenizer_cache import gguf_tokenizer, gguf_tokenizer_dir
from kvchat.engine.text.tokenizer import ChatTokenizer

TEXTS = ["Hi", "", " leading and trailing  ", "Hello, world!\n\nTwo lines\tand a tab.",
         "日本語 🙂 Ünïcödé", "a<|im_end|>b <|im_start|>user\nx", "<|endoftext|>", "x" * 300,
         "def f(x):\n    return x ** 2  # comment", "123 4567 89.01", "\u00a0\u2003spaces\u200b"]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c <|im_end|>"}],
    [{"role": "user", "content": "x", "name": None}],
]


@pytest.fixture(scope="module")
def cached_default(tmp_path_factory):
    """The default model's tokenizer written to a fresh cache (the first-start path), and its folder."""
    before = os.environ.get("KVCHAT_CACHE_DIR")
    os.environ["KVCHAT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        tok = gguf_tokenizer(default_gguf_path())
        yield tok, gguf_tokenizer_dir(default_gguf_path())
    finally:
        if before is None:
            del os.environ["KVCHAT_CACHE_DIR"]
        else:
            os.environ["KVCHAT_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def reference(cached_default):
    """transformers' tokenizer over the same cached files (what kvchat used before)."""
    from transformers import PreTrainedTokenizerFast
    folder = cached_default[1]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if config.get(k)}
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                   chat_template=(folder / "chat_template.jinja").read_text(), **specials)


def test_first_and_warm_start_give_one_class(cached_default):
    tok, folder = cached_default
    assert isinstance(tok, ChatTokenizer)
    assert isinstance(gguf_tokenizer(default_gguf_path()), ChatTokenizer)
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(cached_default, reference, text):
    tok = cached_default[0]
    for special in (False, True):
        for split in (False, True):
            assert tok.encode(text, add_special_tokens=special, split_special_tokens=split) == \
                reference.encode(text, add_special_tokens=special, split_special_tokens=split), (special, split)
    ids = reference.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) == \
            reference.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_split_special_tokens_reads_them_as_text(cached_default):
    tok = cached_default[0]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok.eos_token_id]
    assert len(tok.encode("<|im_end|>", add_special_tokens=False, split_special_tokens=True)) > 1
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok.eos_token_id]   # not sticky


@pytest.mark.parametrize("kind", ["transformers", "gguf"])
def test_encoding_on_many_threads_reads_each_text_as_asked(cached_default, tmp_path, kind):
    """The server encodes on several threads: one thread's split_special_tokens must not leak into another's
    encode. transformers sets the flag on the shared Rust tokenizer and encodes with the GIL released: unguarded,
    about half of these encodes came back with the other thread's reading (and a load test's template lost its
    <|im_start|> tokens)."""
    import threading
    if kind == "transformers":
        from tiny_models import build_tokenizer
        from kvchat.engine.text.tokenizer_cache import load_tokenizer
        build_tokenizer(tmp_path)
        tok = load_tokenizer(tmp_path)
    else:
        tok = cached_default[0]
    text = "user says <|im_end|> then more words " * 4
    want = {split: tok.encode(text, add_special_tokens=False, split_special_tokens=split) for split in (False, True)}
    assert want[False] != want[True]
    wrong = []

    def encode_many(split: bool):
        for _ in range(500):
            if tok.encode(text, add_special_tokens=False, split_special_tokens=split) != want[split]:
                wrong.append(split)
    threads = [threading.Thread(target=encode_many, args=(i % 2 == 1,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_transformers(cached_default, reference, chat):
    tok = cached_default[0]
    for gen in (False, True):
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == \
            reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
        reference.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)


def test_special_tokens_and_vocab_match_transformers(cached_default, reference):
    tok = cached_default[0]
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(reference, name)
        assert getattr(tok, name + "_id") == getattr(reference, name + "_id")
    assert tok.get_vocab() == reference.get_vocab() and len(tok) == len(reference)
    assert sorted(tok.all_special_ids) == sorted(reference.all_special_ids)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == \
        reference.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert tok.special_tokens_map == reference.special_tokens_map


def test_template_is_sandboxed(tmp_path, cached_default):
    """A chat template cannot reach Python internals, and raise_exception gives the template's message."""
    import jinja2
    folder = tmp_path / "t"
    folder.mkdir()
    src = cached_default[1]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((src / name).read_bytes())
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    (folder / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    (folder / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        ChatTokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}")
    assert ChatTokenizer(folder).apply_chat_template([{"role": "user", "content": "é"}], tokenize=False) == '"é"'

    class Path2(type(tmp_path)):       # an object whose methods write files: the template sees only its type name
        pass
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}|{{ m.n }}{% endfor %}")
    out = ChatTokenizer(folder).apply_chat_template([{"role": "user", "content": Path2(tmp_path), "n": True}],
                                                    tokenize=False)
    assert out == "<Path2>|True"


@pytest.mark.slow
def test_warm_one_shot_chat_never_imports_transformers(tmp_path):
    """`kvchat chat --prompt` with the tokenizer cached answers without importing transformers (a second of
    start-up), Qt, triton or gguf and without running a compiler; the first start does not import transformers
    either (engine/gguf/tokenizer.py writes the default model's tokenizer)."""
    # the main kernels the session built, as a first start leaves them (the first start here would compile them
    # again); anything else either start builds is still built by them, and the warm one must run no compiler
    env = dict(os.environ, KVCHAT_CACHE_DIR=str(seeded(tmp_path, ("cpu_quant",))))
    probe = ("import sys, runpy; sys.argv = ['kvchat', 'chat', '--prompt', 'Hi', '--max-new-tokens', '1'];\n"
             "import subprocess; calls = []; real = subprocess.run\n"
             "subprocess.run = lambda *a, **k: (calls.append(a), real(*a, **k))[1]\n"
             "from kvchat.cli.terminal import main; rc = main(sys.argv[1:])\n"
             "print('\\nMODULES', 'transformers' in sys.modules, 'PySide6' in sys.modules, 'triton' in sys.modules,"
             " 'gguf' in sys.modules,"
             " 'CALLS', len(calls))")
    runs = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, warm = (r.stdout.rsplit("MODULES", 1)[1].split() for r in runs)
    assert first[0] == "False"                                  # the first start converts the tokenizer without it
    assert warm == ["False", "False", "False", "False", "CALLS", "0"], warm


@pytest.mark.parametrize("d", [0.0123, 9000.0, -30000.0, 6e-8])
def test_q4_0_scales_kept_as_stored_unless_the_zero_overflows(d):
    """Q4_0's scales stay float16 as the file holds them; where -8 * d leaves float16's range both widen to float32.
    Either way scale * q + zero is gguf's own dequantization exactly."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from kvchat.engine.gguf.blocks import q4_blocks
    rng = np.random.default_rng(0)
    blocks = np.zeros((3, 2, 18), dtype=np.uint8)
    blocks[..., :2] = np.full((3, 2), d, dtype=np.float16)[..., None].view(np.uint8)
    blocks[..., 2:] = rng.integers(0, 256, (3, 2, 16))
    data = blocks.reshape(3, 36)
    codes, grid = q4_blocks("Q4_0", data)
    overflow = abs(np.float16(d)) * 8 > 65504
    assert grid["scale"].dtype == (np.float32 if overflow else np.float16) == grid["zero"].dtype
    g = codes.reshape(3, 2, 16)
    q = np.concatenate((g & 15, g >> 4), -1).astype(np.float32)
    ours = q * grid["scale"].astype(np.float32)[..., None] + grid["zero"].astype(np.float32)[..., None]
    ref = np.asarray(dequantize(data, GGMLQuantizationType.Q4_0), dtype=np.float32).reshape(3, 2, 32)
    assert np.array_equal(ours, ref)


def test_ggml_type_table_matches_gguf():
    """The header reader's own table of ggml types agrees with gguf's, for every id gguf knows."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from kvchat.engine.gguf.file import ggml_type
    for qtype in GGMLQuantizationType:
        assert ggml_type(qtype.value) == (qtype.name, *GGML_QUANT_SIZES[qtype])
