"""The GGUF writer for the mixtures of experts (qwen3moe, gpt-oss, Mixtral as llama with experts) and SmolLM3: the
presets carry the published shapes; random files and tiny Hugging Face folders are written with llama.cpp's keys,
names, 3-D expert tensors [experts, out, in] (or Mixtral's older one tensor per expert), its quantizer's type per
tensor (MXFP4 as ggml-org's gpt-oss file, Q4_K_M's rules for experts and for 8-expert models), gpt-oss's gate / up
taken apart from HF's interleaved gate_up_proj; they read back in gguf-py and in kvchat as the folder's model, and,
where llama-cpp-python is importable, llama.cpp gives transformers' logits and greedy token on them."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from kvchat.bench.gguf_hf import write_gguf_from_hf
from kvchat.bench.gguf_writer import PRESETS, bench_model_path, planned_bytes, tensor_type, use_more_bits, write_random_gguf
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.source import read_config
from test_family_forward import exact_attention, load_dense
from test_family_gguf import load_gguf
from tiny_models import tiny_family_dir

# settings that make each tiny folder one llama.cpp reads as the same model (it derives them, a GGUF cannot say
# otherwise): Qwen3-MoE routes every layer and renormalizes; gpt-oss's experts 48 wide (not the hidden 64, so that
# a transposed matrix could not pass) and its own output head, as the real model has
READABLE = {"qwen3_moe": dict(mlp_only_layers=[], norm_topk_prob=True), "mixtral": {},
            "gpt_oss": dict(intermediate_size=48, tie_word_embeddings=False), "smollm3": {}}
ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "gpt_oss": "gpt-oss", "smollm3": "smollm3"}


def _folder(tmp_path: Path, family: str, **more) -> Path:
    return Path(tiny_family_dir(tmp_path / f"tiny-{family.replace('_', '-')}", family, seed=2,
                                **{**READABLE[family], **more}))


def _fields(path: Path) -> dict:
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith(("tokenizer.", "GGUF."))}


def _tensors(path: Path) -> dict:
    return {t.name: t for t in GGUFReader(path).tensors}


def _ids(n: int = 40) -> torch.Tensor:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(3))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.forward(ids, exact_attention(model.config, [layer.sinks for layer in model.layers]), all_logits=True)


# ----------------------------------------------------------------------------------------------- presets

def test_presets_have_the_published_shapes():
    """Each MoE preset is its Hugging Face config.json's numbers (Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b,
    mistralai/Mixtral-8x7B-v0.1)."""
    q, g, m = PRESETS["qwen3-30b-a3b"], PRESETS["gpt-oss-20b"], PRESETS["mixtral-8x7b"]
    assert (q.arch, q.layers, q.hidden, q.heads, q.kv_heads, q.head_dim, q.experts, q.experts_used, q.expert_ffn,
            q.vocab, q.rope_theta, q.context, q.tied) == \
        ("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936, 1e6, 40960, False)
    assert (g.arch, g.layers, g.hidden, g.heads, g.kv_heads, g.head_dim, g.experts, g.experts_used, g.expert_ffn,
            g.vocab, g.window, g.yarn, g.rope_theta, g.context, g.biases, g.sinks, g.tied) == \
        ("gpt-oss", 24, 2880, 64, 8, 64, 32, 4, 2880, 201088, 128, (32.0, 4096), 150000.0, 131072, True, True, False)
    assert (m.arch, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.experts, m.experts_used, m.ffn_exp,
            m.vocab, m.rope_theta, m.context, m.tied) == \
        ("llama", 32, 4096, 32, 8, 128, 8, 2, 14336, 32000, 1e6, 32768, False)


def test_the_mxfp4_gpt_oss_preset_is_the_size_of_ggml_orgs_file():
    """MXFP4 experts, Q8_0 for the other matrices, F32 router, norms, biases and sinks: the tensor bytes of
    ggml-org/gpt-oss-20b-GGUF's gpt-oss-20b-mxfp4.gguf (12.1 GB); the file grows by a layer's bytes per layer."""
    full = planned_bytes("gpt-oss-20b", "MXFP4")
    assert 12.0e9 < full < 12.15e9
    two, three = planned_bytes("gpt-oss-20b", "MXFP4", 2), planned_bytes("gpt-oss-20b", "MXFP4", 3)
    per_layer = three - two
    assert full == two + 22 * per_layer
    experts = 3 * 32 * 2880 * 2880 // 32 * 17               # MXFP4: 17 bytes a block of 32
    attention = (2 * 2880 * 4096 + 2 * 2880 * 512) // 32 * 34                      # Q8_0: 34 bytes a block of 32
    f32 = 32 * 2880 + 32 + 3 * 32 * 2880 + (4096 + 2 * 512 + 2880) + 2 * 2880 + 64  # router, biases, norms, sinks
    assert per_layer == experts + attention + 4 * f32


# ---------------------------------------------------------------------------------------- random files

# the random files' vocabulary: the default tokenizer cut to its first 2,048 tokens. Its whole 49,152 tokens and
# merges took gguf-py's GGUFReader about 2.5 s a file to parse, most of this module's time; the keys, names, shapes
# and types checked here are the same for any vocabulary (the output head's rows are the vocabulary's, checked)
VOCAB = 2048


def _small(name: str, **more):
    """A preset's arch and features at a test's size (rows of 256 for the K-quants)."""
    return replace(PRESETS[name], layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                   vocab=VOCAB, context=4096, **({"experts": 4, "experts_used": 2, "expert_ffn": 256} | more))


def test_random_moe_files_have_llama_cpps_keys_names_and_shapes(tmp_path):
    g = write_random_gguf(tmp_path / "g.gguf", _small("gpt-oss-20b", window=16), "F16")
    f = _fields(g)
    assert f["general.architecture"] == "gpt-oss" and f["general.file_type"] == 1
    assert (f["gpt-oss.expert_count"], f["gpt-oss.expert_used_count"], f["gpt-oss.expert_feed_forward_length"]) == \
        (4, 2, 256)
    assert f["gpt-oss.attention.sliding_window"] == 16 and f["gpt-oss.rope.scaling.type"] == "yarn"
    assert (f["gpt-oss.rope.scaling.factor"], f["gpt-oss.rope.scaling.original_context_length"]) == (32.0, 4096)
    t = _tensors(g)
    shapes = {"blk.1.ffn_gate_exps.weight": [256, 256, 4], "blk.1.ffn_down_exps.weight": [256, 256, 4],
              "blk.1.ffn_gate_exps.bias": [256, 4], "blk.1.ffn_gate_inp.weight": [256, 4], "blk.1.ffn_gate_inp.bias": [4],
              "blk.1.attn_sinks.weight": [4], "blk.1.attn_q.bias": [256], "blk.1.post_attention_norm.weight": [256],
              "output.weight": [256, VOCAB], "token_embd.weight": [256, VOCAB]}
    for name, ggml_shape in shapes.items():
        assert [int(n) for n in t[name].shape] == ggml_shape, name
    assert "blk.0.ffn_norm.weight" not in t and "blk.0.ffn_gate.weight" not in t
    mc = ModelConfig.from_gguf(GGUFFile(g))
    assert [s.window for s in mc.layers] == [16, None] and all(s.sink_logits and s.experts.count == 4 for s in mc.layers)

    q = write_random_gguf(tmp_path / "q.gguf", _small("qwen3-30b-a3b", expert_ffn=128), "F16")
    f, t = _fields(q), _tensors(q)
    assert (f["qwen3moe.expert_count"], f["qwen3moe.expert_feed_forward_length"], f["qwen3moe.feed_forward_length"]) \
        == (4, 128, 256)
    assert [int(n) for n in t["blk.0.ffn_up_exps.weight"].shape] == [256, 128, 4]
    assert [int(n) for n in t["blk.0.ffn_down_exps.weight"].shape] == [128, 256, 4]
    assert "blk.0.attn_k_norm.weight" in t and "blk.0.ffn_gate_inp.bias" not in t

    m = write_random_gguf(tmp_path / "m.gguf", _small("mixtral-8x7b", expert_ffn=None), "F16")
    f = _fields(m)
    assert f["general.architecture"] == "llama" and f["llama.expert_count"] == 4
    assert "llama.expert_feed_forward_length" not in f          # llama.cpp reads feed_forward_length for llama


def test_mxfp4_is_ggml_orgs_mix(tmp_path):
    """MXFP4: 3-D expert tensors MXFP4 (values within a block's step of gguf's own dequantizer), every other matrix
    Q8_0 (token_embd and output too), the router, biases, norms and sinks F32."""
    path = write_random_gguf(tmp_path / "g.gguf", _small("gpt-oss-20b", window=16), "MXFP4")
    t = _tensors(path)
    assert _fields(path)["general.file_type"] == 38        # MOSTLY_MXFP4_MOE
    for name, kind in {"blk.0.ffn_gate_exps.weight": "MXFP4", "blk.0.ffn_up_exps.weight": "MXFP4",
                       "blk.1.ffn_down_exps.weight": "MXFP4", "blk.0.attn_q.weight": "Q8_0",
                       "blk.0.attn_output.weight": "Q8_0", "token_embd.weight": "Q8_0", "output.weight": "Q8_0",
                       "blk.0.ffn_gate_inp.weight": "F32", "blk.0.ffn_gate_exps.bias": "F32",
                       "blk.0.attn_sinks.weight": "F32", "blk.0.attn_norm.weight": "F32"}.items():
        assert t[name].tensor_type.name == kind, name
    w = dequantize(t["blk.0.ffn_gate_exps.weight"].data, t["blk.0.ffn_gate_exps.weight"].tensor_type)
    assert w.shape == (4, 256, 256) and 0.015 < w.std() < 0.025       # random N(0, 0.02), per expert


def test_q4_k_m_follows_llama_cpps_rules_for_experts():
    """ffn_down_exps takes ffn_down's Q6_K in the use_more_bits layers; a model of exactly 8 experts (Mixtral) gets
    attn_k and attn_v in Q8_0 and attn_output in Q5_K; the router stays F32."""
    layers = 32
    for i in range(layers):
        want = "Q6_K" if use_more_bits(i, layers) else "Q4_K"
        assert tensor_type("Q4_K_M", f"blk.{i}.ffn_down_exps.weight", layers, False, 128, stacked=True) == want
        assert tensor_type("Q4_K_M", f"blk.{i}.ffn_down.3.weight", layers, False, 8) == want
        assert tensor_type("Q4_K_M", f"blk.{i}.attn_v.weight", layers, False, 128) == want
        assert tensor_type("Q4_K_M", f"blk.{i}.attn_v.weight", layers, False, 8) == "Q8_0"
    assert tensor_type("Q4_K_M", "blk.0.attn_k.weight", layers, False, 8) == "Q8_0"
    assert tensor_type("Q4_0", "blk.0.attn_k.weight", layers, False, 8) == "Q8_0"
    assert tensor_type("Q4_K_M", "blk.0.attn_output.weight", layers, False, 8) == "Q5_K"
    assert tensor_type("Q4_K_M", "blk.0.attn_output.weight", layers, False, 128) == "Q4_K"
    assert tensor_type("Q4_K_M", "blk.0.ffn_gate_exps.weight", layers, False, 128, stacked=True) == "Q4_K"
    assert tensor_type("Q4_K_M", "blk.0.ffn_gate_inp.weight", layers, False, 8) == "F32"
    assert tensor_type("F16", "blk.0.attn_k.weight", layers, False, 8) == "F16"


def test_mixtrals_older_layout_holds_the_same_experts(tmp_path):
    """per_expert: blk.N.ffn_gate.E.weight [out, in] per expert, holding exactly the stacked file's experts; kvchat
    reads both files as one model with the same logits. Other archs have no such layout."""
    shape = _small("mixtral-8x7b", expert_ffn=None)
    stacked = write_random_gguf(tmp_path / "stacked.gguf", shape, "Q4_0", seed=4)
    split = write_random_gguf(tmp_path / "split.gguf", shape, "Q4_0", seed=4, per_expert=True)
    a, b = _tensors(stacked), _tensors(split)
    assert "blk.0.ffn_gate_exps.weight" not in b and "blk.0.ffn_down.3.weight" in b
    for kind in ("ffn_gate", "ffn_up", "ffn_down"):
        whole = np.asarray(a[f"blk.1.{kind}_exps.weight"].data)
        for e in range(4):
            part = b[f"blk.1.{kind}.{e}.weight"]
            assert [int(n) for n in part.shape] == [int(n) for n in a[f"blk.1.{kind}_exps.weight"].shape[:2]]
            assert np.array_equal(np.asarray(part.data), whole[e]), (kind, e)
    ids = _ids(12)
    assert torch.equal(_logits(load_gguf(stacked), ids), _logits(load_gguf(split), ids))
    with pytest.raises(ValueError, match="Mixtral's older layout"):
        write_random_gguf(tmp_path / "q.gguf", _small("qwen3-30b-a3b"), "Q4_0", per_expert=True)


def test_layers_cut_a_preset_and_name_the_cached_file(tmp_path, monkeypatch):
    """layers=N keeps the first N layers (the block count says so); bench_model_path names the cut file apart."""
    path = write_random_gguf(tmp_path / "cut.gguf", _small("qwen3-30b-a3b"), "Q8_0", layers=1)
    assert _fields(path)["qwen3moe.block_count"] == 1 and "blk.1.attn_q.weight" not in _tensors(path)
    with pytest.raises(ValueError, match="keep 1 to 2"):
        write_random_gguf(tmp_path / "x.gguf", _small("qwen3-30b-a3b"), "Q8_0", layers=3)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    cut = bench_model_path("tiny", "Q8_0", layers=1)
    assert cut.name == "tiny-1L-Q8_0.gguf" and GGUFFile(cut).field("llama.block_count") == 1
    assert bench_model_path("tiny", "Q8_0", layers=2).name == "tiny-Q8_0.gguf"


def test_a_smaller_vocabulary_cuts_the_tokenizer(tmp_path):
    """Mixtral's 32,000 tokens from the default's 49,152: the first 32,000 tokens, the merges among them, and the
    tokenizer still reads text back to itself (kvchat's, and llama.cpp's where importable)."""
    from kvchat.engine.gguf.tokenizer import build
    shape = replace(_small("mixtral-8x7b", expert_ffn=None), layers=1, vocab=32000)
    path = write_random_gguf(tmp_path / "m.gguf", shape, "Q8_0")
    gf = GGUFFile(path)
    tokens, merges = gf.array("tokenizer.ggml.tokens"), gf.array("tokenizer.ggml.merges")
    assert len(tokens) == 32000 == gf.tensors["token_embd.weight"].shape[1] == len(gf.array("tokenizer.ggml.token_type"))
    kept = set(tokens)
    assert 30000 < len(merges) < 48900 and all(m.replace(" ", "", 1) in kept for m in merges)
    text = "Hello! The quick brown fox jumps over the lazy dog."
    ids = build(gf)[0].encode(text).ids
    assert max(ids) < 32000 and build(gf)[0].decode(ids) == text


# -------------------------------------------------------------------------------- Hugging Face folders

@pytest.mark.parametrize("family", list(READABLE))
def test_a_folder_reads_back_as_itself(tmp_path, family):
    """The F32 GGUF of a tiny folder: llama.cpp's arch, expert keys and 3-D tensors; kvchat reads it as the folder's
    description and gives the folder's logits."""
    folder = _folder(tmp_path, family)
    path = write_gguf_from_hf(folder, tmp_path / f"{family}.gguf")
    f, t = _fields(path), _tensors(path)
    arch = ARCH[family]
    assert f["general.architecture"] == arch
    cfg = read_config(folder)
    if family != "smollm3":
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        assert f[f"{arch}.expert_count"] == experts and f[f"{arch}.expert_used_count"] == cfg["num_experts_per_tok"]
        ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        assert [int(n) for n in t["blk.0.ffn_gate_exps.weight"].shape] == [64, ffn, experts]
        assert [int(n) for n in t["blk.0.ffn_down_exps.weight"].shape] == [ffn, 64, experts]
        assert t["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    a, b = ModelConfig.from_gguf(GGUFFile(path)), ModelConfig.from_hf(cfg)
    assert [s.experts for s in a.layers] == [s.experts for s in b.layers]
    assert [(s.window, s.sink_logits, s.rope.scaling, s.qk_norm, s.qkv_bias) for s in a.layers] == \
        [(s.window, s.sink_logits, s.rope.scaling, s.qk_norm, s.qkv_bias) for s in b.layers]
    ids = _ids()
    ours, theirs = _logits(load_gguf(path), ids), _logits(load_dense(str(folder)), ids)
    assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()


def test_gpt_oss_gate_and_up_are_taken_apart_and_turned(tmp_path):
    """HF's gate_up_proj [experts, hidden, 2 x ffn] interleaves gate (even columns) and up (odd): the GGUF holds
    each as [experts, ffn, hidden], down_proj [experts, ffn, hidden] as [experts, hidden, ffn], the sinks and
    biases as they are (read straight from the safetensors here, not through kvchat's loader)."""
    from safetensors.numpy import load_file
    folder = _folder(tmp_path, "gpt_oss")
    path = write_gguf_from_hf(folder, tmp_path / "g.gguf")
    hf = load_file(str(folder / "model.safetensors"))
    t = {name: np.asarray(x.data) for name, x in _tensors(path).items()}
    gate_up, bias = hf["model.layers.1.mlp.experts.gate_up_proj"], hf["model.layers.1.mlp.experts.gate_up_proj_bias"]
    assert gate_up.shape == (4, 64, 96)
    assert np.array_equal(t["blk.1.ffn_gate_exps.weight"], gate_up[..., 0::2].transpose(0, 2, 1))
    assert np.array_equal(t["blk.1.ffn_up_exps.weight"], gate_up[..., 1::2].transpose(0, 2, 1))
    assert np.array_equal(t["blk.1.ffn_gate_exps.bias"], bias[..., 0::2])
    assert np.array_equal(t["blk.1.ffn_up_exps.bias"], bias[..., 1::2])
    assert np.array_equal(t["blk.1.ffn_down_exps.weight"],
                          hf["model.layers.1.mlp.experts.down_proj"].transpose(0, 2, 1))
    assert np.array_equal(t["blk.1.attn_sinks.weight"], hf["model.layers.1.self_attn.sinks"])
    assert np.array_equal(t["blk.1.ffn_gate_inp.bias"], hf["model.layers.1.mlp.router.bias"])
    assert np.array_equal(t["blk.1.post_attention_norm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])


def test_a_tied_gpt_oss_gets_its_output_head_written(tmp_path):
    """llama.cpp reads gpt-oss's output head as a tensor of its own: a tied folder's embedding is written there."""
    folder = _folder(tmp_path, "gpt_oss", tie_word_embeddings=True)
    t = _tensors(write_gguf_from_hf(folder, tmp_path / "g.gguf"))
    assert np.array_equal(np.asarray(t["output.weight"].data), np.asarray(t["token_embd.weight"].data))


def test_mixtral_folder_in_the_older_layout(tmp_path):
    folder = _folder(tmp_path, "mixtral")
    path = write_gguf_from_hf(folder, tmp_path / "m.gguf", "Q8_0", per_expert=True)
    t = _tensors(path)
    assert "blk.0.ffn_up_exps.weight" not in t and [int(n) for n in t["blk.0.ffn_up.3.weight"].shape] == [64, 64]
    merged = write_gguf_from_hf(folder, tmp_path / "merged.gguf", "Q8_0")
    ids = _ids(12)
    assert torch.equal(_logits(load_gguf(path), ids), _logits(load_gguf(merged), ids))


@pytest.mark.parametrize("family, mix", [("qwen3_moe", "MXFP4"), ("gpt_oss", "MXFP4"), ("mixtral", "Q4_K_M")])
def test_quantized_folders_take_the_mix(tmp_path, family, mix):
    folder = _folder(tmp_path, family, **({"intermediate_size": 64} if family == "gpt_oss" else {}))
    t = _tensors(write_gguf_from_hf(folder, tmp_path / f"{family}.gguf", mix))
    kinds = {name: x.tensor_type.name for name, x in t.items()}
    if mix == "MXFP4":
        assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.0.ffn_down_exps.weight"] == "MXFP4"
        assert kinds["blk.0.attn_q.weight"] == "Q8_0"
    else:           # rows of 64: Q4_K's fallback Q5_0; a model of 4 experts keeps attn_k in the base type
        assert kinds["blk.0.ffn_gate_exps.weight"] == "Q5_0" and kinds["blk.1.ffn_down_exps.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32"


@pytest.mark.parametrize("family, setting, match", [
    ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob is False, but llama.cpp derives True"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers is \\[1\\]"),
    ("gpt_oss", dict(swiglu_limit=5.0), "swiglu_limit is 5.0, but llama.cpp derives 7.0"),
    ("gpt_oss", dict(layer_types=["full_attention", "sliding_attention"] * 2), "layer_types"),
    ("smollm3", dict(no_rope_layer_interval=2), "no_rope_layers"),
])
def test_settings_llama_cpp_derives_must_be_its(tmp_path, family, setting, match):
    """A folder whose routing, window pattern, SwiGLU clamp or RoPE-less layers are not the ones llama.cpp derives
    for its arch is refused with the setting named, and no file is left."""
    folder = _folder(tmp_path, family, **setting)
    with pytest.raises(ValueError, match=match):
        write_gguf_from_hf(folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


# ------------------------------------------------------------------------------------------- llama.cpp

def _truncated(folder: Path, tmp_path: Path) -> Path:
    """The folder with YaRN's truncate on: llama.cpp rounds the ramp's ends to whole dimensions (its
    ggml_rope_yarn_corr_dims) whatever gpt-oss's config says (truncate false)."""
    copy = tmp_path / "truncated"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_parameters"]["truncate"] = True
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "smollm3"])
def test_llama_cpp_gives_transformers_logits_and_greedy_token(tmp_path, family):
    """llama.cpp reads our F32 file (its KV cache in F32) as transformers runs the folder: the same logits and the
    same greedy next token. gpt-oss against its folder with YaRN truncated, as llama.cpp computes it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM
    folder = _folder(tmp_path, family)
    path = write_gguf_from_hf(folder, tmp_path / f"{family}.gguf")
    reference = _truncated(folder, tmp_path) if family == "gpt_oss" else folder
    ids = _ids()
    with torch.no_grad():
        expect = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)(ids[None]).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0)      # ggml type 0: F32
    llm.eval(ids.tolist())
    got = np.asarray(llm.scores[:len(ids)], dtype=np.float32)
    assert np.abs(got - expect).max() <= 2e-5 * np.abs(expect).max(), family
    assert int(got[-1].argmax()) == int(expect[-1].argmax())


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"])
@pytest.mark.parametrize("mix", ["MXFP4", "Q4_K_M"])
def test_llama_cpp_runs_the_random_presets(tmp_path, name, mix):
    """The presets' kind of file (small stand-ins: 2 layers, hidden 256, their arch's every feature; 8 experts for
    Mixtral's rules) loads in llama.cpp and gives finite logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    shape = _small(name, window=16) if name == "gpt-oss-20b" else \
        _small(name, experts=8, expert_ffn=None) if name == "mixtral-8x7b" else _small(name)
    path = write_random_gguf(tmp_path / f"{name}.gguf", shape, mix)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval([1, 2, 3, 4, 5])
    assert np.isfinite(np.asarray(llm.scores[:5])).all()


def test_a_decode_tokens_weight_reads_count_its_routed_experts_and_one_embedding_row(tmp_path):
    """Transformer.token_read_bytes (what `bench speed`'s weight read rate divides): a mixture of experts' token reads
    `used` of `count` experts a layer and one row of an untied embedding table, the rest of the resident weights
    whole; a tied dense model reads everything it holds. Checked against the file's own tensor sizes."""
    from kvchat.bench.gguf_writer import ModelShape
    from kvchat.engine import Engine, EngineConfig
    shape = ModelShape("moe", 2, 256, 4, 2, 512, 64, 2048, 1e6, False, arch="qwen3moe", experts=8, experts_used=2,
                       expert_ffn=128)
    path = write_random_gguf(tmp_path / "moe.gguf", shape, "Q8_0")
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    table = sizes["token_embd.weight"]
    model = Engine.load(EngineConfig(model=str(path))).model
    unread = model.weight_bytes() - model.token_read_bytes()
    want = experts * 6 / 8 + table - table / model.config.vocab_size
    assert abs(unread - want) <= 0.01 * want, (unread, want)
    dense = Engine.load(EngineConfig(model=str(write_random_gguf(tmp_path / "tiny.gguf", "tiny", "Q8_0")))).model
    assert dense.table is dense.lm_head and dense.token_read_bytes() == dense.weight_bytes()
