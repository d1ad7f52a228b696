"""Model files whose numbers disagree with their tensors, or hold absurd numbers, are refused by every loader
(the torch-free `kvchat chat --prompt`, the engine, `kvchat estimate`, the Models page) before anything is
packed, in one line naming the tensor or the field; the decode kernel refuses a layer table whose widths do
not chain instead of reading past a row."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gguf_mutants as gm
from kvchat.engine import Engine, EngineConfig, ModelLoadError
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.text.tokenizer_cache import gguf_tokenizer, gguf_tokenizer_dir
from kvchat.engine.model.config import ModelConfig
from kvchat.kernels import cpu_lib
from test_gguf_fuzz import Child

pytestmark = pytest.mark.skipif(cpu_lib.library() is None, reason="C kernels unavailable")

ROOT = Path(__file__).resolve().parents[1]
Q, KV = gm.HEADS * gm.HEAD_DIM, gm.KV_HEADS * gm.HEAD_DIM


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checks")
    base = gm.write(folder / "base.gguf")
    gguf_tokenizer(base)
    child = Child()

    def make(name: str, fields=None, tensors=None) -> Path:
        path = gm.write(folder / f"{name}.gguf", fields, tensors)
        target = gguf_tokenizer_dir(path)
        if not target.exists():              # the same tokenizer fields as the base: its cached tokenizer
            shutil.copytree(gguf_tokenizer_dir(base), target)
        return path
    yield make, child
    child.close()


def refused_by_both_paths(child, path: Path, pattern: str) -> None:
    """kvchat chat --prompt through the torch-free path and through the engine: exit 2, one line, nothing printed."""
    for which in ("quick", "engine"):
        got = child.ask(path, which)
        err = got["err"].strip()
        assert got["rc"] == 2 and got["out"] == "" and "\n" not in err and "Traceback" not in err, (which, got)
        assert re.search(pattern, err), (which, err)


# ---- item 5: tensors whose shapes the header does not give -------------------------------------------------

def test_transposed_ffn_down_is_refused_in_a_real_process(files):
    """The file that crashed the torch-free path (SIGSEGV, or glibc's heap check): `python -m cli.main chat --prompt`
    on it, both paths, in their own processes: exit 2 and one line naming the tensor and both shapes."""
    make, _ = files
    path = make("transposed", tensors={"blk.0.ffn_down.weight": (gm.FFN, gm.HIDDEN)})
    for env in ({}, {"KVCHAT_NO_QUICK": "1"}):
        out = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "chat", "--prompt", "Hello", "--temperature", "0",
                              "--max-new-tokens", "4", "--device", "cpu", "--model", str(path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={**os.environ, **env})
        err = out.stderr.strip()
        assert out.returncode == 2 and out.stdout == "" and "\n" not in err, (env, out.returncode, err[-800:])
        assert "blk.0.ffn_down.weight has shape [64, 128], but the model's settings make it [128, 64]" in err


@pytest.mark.parametrize("name, fields, tensors, pattern", [
    ("half-q", None, {"blk.1.attn_q.weight": (Q // 2, gm.HIDDEN)}, r"blk\.1\.attn_q\.weight has shape \[64, 32\].*\[64, 64\]"),
    ("heads-doubled", {"llama.attention.head_count": 2 * gm.HEADS}, None,
     r"llama\.attention\.head_count=4 in heads-doubled\.gguf, but the weights hold 2 heads"),
    ("q-empty", None, {"blk.0.attn_q.weight": (0, gm.HIDDEN)}, r"head_count=2 in q-empty\.gguf, but the weights hold 0 heads"),
    ("layers-3", {"llama.block_count": 3}, None, r"llama\.block_count=3 in layers-3\.gguf, but the weights hold 2 layers"),
    ("layers-1", {"llama.block_count": 1}, None, r"llama\.block_count=1 in layers-1\.gguf, but the weights hold 2 layers"),
    ("hidden-128", {"llama.embedding_length": 128}, None,
     r"token_embd\.weight has shape \[64, 49152\], but the model's settings make it \[128, 49152\] "
     r"\(llama\.embedding_length, token_embd\.weight's rows\)"),
    ("no-ffn-up", None, {"blk.1.ffn_up.weight": None}, r"lacks the tensor blk\.1\.ffn_up\.weight"),
    ("norm-short", None, {"blk.0.ffn_norm.weight": (32,)}, r"blk\.0\.ffn_norm\.weight has shape \[32\].*\[64\]"),
])
def test_shapes_the_header_does_not_give_are_refused(files, name, fields, tensors, pattern):
    """Halved q rows, a doubled head count, an empty attn_q, a wrong block_count or embedding_length, a missing or
    short tensor (garbage with exit 0 before): refused by both paths, naming the tensor or field and the numbers."""
    make, child = files
    refused_by_both_paths(child, make(name, fields, tensors), pattern)


def test_the_kernel_refuses_a_table_whose_widths_do_not_chain(files):
    """decode_layers checks each linear's K (and N) against the running width before it runs: a table with
    ffn_down's K at 64 instead of 128, qkv one head short, or an output gate the projection does not hold fails with
    -3 (ValueError), through the engine's wrapper and through the torch-free path."""
    import torch
    from kvchat.engine.runtime import quick
    from kvchat.kernels import cpu_step
    make, _ = files
    path = make("good")
    engine = Engine.load(EngineConfig(model=str(path)))
    table = engine.model.kernel_layers()
    assert table is not None
    c = engine.model.config
    x = torch.zeros(1, c.hidden_size)
    attend = lambda layer, qkv: torch.zeros(1, c.num_heads, c.head_dim)     # noqa: E731
    cpu_step.decode_layers(table, x, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, [attend])
    for slot, field, value in ((3, "K", 64), (0, "N", Q + KV)):
        bad = type(table).from_buffer_copy(table)
        setattr(bad[1].lin[slot][0], field, value)
        with pytest.raises(ValueError, match="width does not match"):
            cpu_step.decode_layers(bad, x, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, [attend])
    for gate in (c.num_heads * c.head_dim, 8):            # a gate beside q that the qkv rows do not hold
        bad = type(table).from_buffer_copy(table)
        bad[1].gate = gate
        with pytest.raises(ValueError, match="width does not match"):
            cpu_step.decode_layers(bad, x, c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, [attend])
    m = quick.QuickModel(path)
    seq = quick.QuickSequence(m, 8)
    assert np.isfinite(seq.forward([5, 6])).all()
    m.table[0].lin[3][0].K = 64
    with pytest.raises(ValueError, match="widths do not match"):
        seq.forward([7])
    assert seq.length == 2


# ---- item 6: numbers no model has, one line each -------------------------------------------------------------

@pytest.mark.parametrize("name, fields, tensors, pattern", [
    ("heads-0", {"llama.attention.head_count": 0}, None, r"llama\.attention\.head_count=0: it must be a positive whole"),
    ("kv-0", {"llama.attention.head_count_kv": 0}, None, r"head_count_kv=0: it must be a positive whole"),
    ("ragged", None, {"blk.0.ffn_up.weight": (gm.FFN, gm.HIDDEN + 5)},
     r"blk\.0\.ffn_up\.weight has rows of 69 values, not a whole number of Q8_0 blocks of 32"),
    ("layers-1e9", {"llama.block_count": 10**9}, None, r"llama\.block_count=1,000,000,000, past the 1,024 kvchat runs"),
    ("context-huge", {"llama.context_length": 2**25}, None, r"llama\.context_length=33,554,432, past the 16,777,216"),
    ("theta-0", {"llama.rope.freq_base": 0.0}, None, r"llama\.rope\.freq_base=0\.0: it must be a finite number above 0"),
    ("theta-nan", {"llama.rope.freq_base": math.nan}, None, r"llama\.rope\.freq_base=nan: it must be a finite number"),
    ("eps-neg", {"llama.attention.layer_norm_rms_epsilon": -1.0}, None,
     r"layer_norm_rms_epsilon=-1\.0: it must be a finite number above 0"),
    ("heads-text", {"llama.attention.head_count": "two"}, None, r"head_count='two': it must be a positive whole"),
])
def test_absurd_numbers_are_one_line(files, name, fields, tensors, pattern):
    """head_count 0 (a ZeroDivisionError before), a Q8_0 row of 69 values, 10^9 layers (a MemoryError, or the
    estimate growing without end), a context past 2^24, rope freq_base 0 or NaN, eps -1, a head count in text:
    refused by both paths in one line."""
    make, child = files
    refused_by_both_paths(child, make(name, fields, tensors), pattern)


def test_estimate_and_the_models_page_refuse_a_billion_layers_at_once(files):
    """`kvchat estimate` and the Models page's facts on a header of 10^9 layers: refused in well under a second of
    work (they grew 42 MiB/s without end), one line."""
    from kvchat.engine.plan.estimate import model_facts_from
    make, _ = files
    path = make("layers-1e9-est", {"llama.block_count": 10**9})
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="block_count=1,000,000,000"):
        model_facts_from(path)
    assert time.perf_counter() - started < 5
    out = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "estimate", "--model", str(path), "--context", "4096"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = out.stderr.strip()
    assert out.returncode == 2 and "\n" not in err and "past the 1,024 kvchat runs" in err, (out.returncode, err)


def test_model_config_refuses_absurd_numbers_however_it_is_built():
    """The caps hold for a ModelConfig built directly too (the estimate's presets): the field and the number."""
    good = dict(model_type="llama", vocab_size=320, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=32, intermediate_size=128, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=(),
                max_position_embeddings=256, tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False)
    ModelConfig(**good)
    for key, value, words in (("num_layers", 1025, "num_hidden_layers=1,025"), ("num_kv_heads", 0, "num_key_value_heads=0"),
                              ("head_dim", 2048, "head_dim=2,048"), ("rms_norm_eps", math.inf, "rms_norm_eps=inf"),
                              ("rope_theta", -1.0, "rope_theta=-1.0")):
        with pytest.raises(ModelLoadError, match=words):
            ModelConfig(**{**good, key: value})


def test_a_real_model_is_within_the_limits():
    """The default model's header passes every check, its shapes included."""
    from kvchat.engine.model.source import default_gguf_path
    mc = ModelConfig.from_gguf(GGUFFile(default_gguf_path()))
    assert (mc.num_layers, mc.hidden_size, mc.vocab_size) == (30, 576, 49152)


# ---- config.json against the safetensors ---------------------------------------------------------------------

@pytest.mark.parametrize("key, value, pattern", [
    ("hidden_size", 192, r"model\.embed_tokens\.weight has shape \[\d+, 96\], but the model's settings make it "
                         r"\[\d+, 192\] \(vocab_size, hidden_size\)"),
    ("intermediate_size", 256, r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 96\].*\[256, 96\]"),
    ("vocab_size", 49152, r"model\.embed_tokens\.weight has shape \[\d+, 96\].*\[49152, 96\]"),
    ("rope_theta", 0, r"config\.json has rope_theta=0: it must be a finite number above 0"),
    ("rms_norm_eps", -1, r"config\.json has rms_norm_eps=-1: it must be a finite number above 0"),
])
def test_config_json_that_disagrees_with_its_weights_is_refused_at_load(tiny_llama, tmp_path, key, value, pattern):
    """hidden / intermediate / vocab in config.json that the safetensors do not have (loaded before, then an IndexError
    from torch on a large token id), and an impossible rope theta or eps: refused at load, one line."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters")
    if key == "rope_theta" and isinstance(rope, dict):        # newer transformers keep it there
        rope[key] = value
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ModelLoadError, match=pattern) as info:
        Engine.load(EngineConfig(model=str(folder)))
    assert "\n" not in str(info.value)
