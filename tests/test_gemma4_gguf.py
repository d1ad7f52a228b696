"""Gemma 4 GGUFs (llama.cpp's gemma4) both ways: a tiny transformers folder written by bench/gguf_hf.py as llama.cpp's
converter writes it holds every weight under llama.cpp's name unchanged, and its header reads back (gguf_arch) as the
folder's Gemma4TextConfig; llama.cpp itself (llama-cpp-python, where installed) gives transformers' logits on it; the
random E4B preset's header reads back as the published config, whole and cut.

The tiny folders have every Gemma 4 feature on: sliding and full layers of two head widths, the full ones with
proportional RoPE over a quarter of their dimensions and keys as values (one KV head against the sliding layers' two),
two KV-shared layers (one of each kind), per-layer embeddings, the final soft-cap, and a MoE block beside the MLP."""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.bench.gguf_hf import gemma4_gguf_name, write_gguf_from_hf
from kvchat.bench.gguf_writer import PRESETS, cut_layers, write_random_gguf
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.model import gguf_arch
from tiny_models import build_tokenizer

# llama.cpp's shared layers read the cache of the layer just before them (full) or the one before that (sliding):
# transformers' reading (the last earlier layer of the kind) where the pattern ends sliding, full before them
LAYER_TYPES = ["sliding_attention", "full_attention"] * 3
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
IDS = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(5)).tolist()


def tiny_gemma4_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Gemma4ForCausalLM folder (float32, build_tokenizer's 320 tokens); weights of std 0.2 and every norm,
    scale and layer_scalar in [0.5, 1.5], so that each of them, and w against 1 + w, moves the logits."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    fields = dict(vocab_size=len(tok), vocab_size_per_layer_input=len(tok), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                  num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=LAYER_TYPES,
                  num_kv_shared_layers=2, hidden_size_per_layer_input=16, sliding_window=8,
                  final_logit_softcapping=30.0, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**fields, **overrides})).float()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or name.endswith(("scale", "layer_scalar")):
                p.uniform_(0.5, 1.5)
            elif p.is_floating_point() and "rotary" not in name and "embed_scale" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["dense", "moe"])
def folder(request, tmp_path_factory) -> Path:
    return tiny_gemma4_dir(tmp_path_factory.mktemp(request.param) / "gemma4", seed=1,
                           **(MOE if request.param == "moe" else {}))


@pytest.fixture(scope="module")
def model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def gguf(folder) -> Path:
    return write_gguf_from_hf(folder, folder.parent / "gemma4-F32.gguf", "F32")


def header_config(path: Path) -> dict:
    """The header in config.json's words: GGUFModel.hf_config's Llama fields, then gguf_arch's Gemma 4 ones."""
    gf = GGUFFile(path)
    a = gf.arch
    field = lambda key: gf.field(f"{a}.{key}")  # noqa: E731
    base = {"vocab_size": int(gf.tensors["token_embd.weight"].shape[1]), "hidden_size": field("embedding_length"),
            "num_hidden_layers": field("block_count"), "num_attention_heads": field("attention.head_count"),
            "num_key_value_heads": field("attention.head_count_kv"), "head_dim": field("attention.key_length"),
            "intermediate_size": field("feed_forward_length"), "rope_theta": field("rope.freq_base"),
            "rms_norm_eps": field("attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": field("context_length"),
            "tie_word_embeddings": "output.weight" not in gf.tensors}
    return {**base, **gguf_arch.family_config(gf, base)}


def test_the_header_reads_as_the_folders_config(gguf, model):
    """The header gives Gemma4TextConfig's fields, and a config built from them has the folder's layers: the same
    per-layer head widths and KV heads, RoPE per kind of layer, sharing, per-layer embeddings and experts."""
    from transformers import Gemma4TextConfig
    c, got = model.config, header_config(gguf)
    for key in ("layer_types", "sliding_window", "num_kv_shared_layers", "attention_k_eq_v",
                "hidden_size_per_layer_input", "vocab_size_per_layer_input", "rope_parameters",
                "final_logit_softcapping", "enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size",
                "use_double_wide_mlp", "intermediate_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size", "hidden_activation", "tie_word_embeddings", "max_position_embeddings"):
        assert got[key] == getattr(c, key), key
    assert got["rms_norm_eps"] == pytest.approx(c.rms_norm_eps)
    assert (got["head_dim"], got["num_key_value_heads"], got["global_head_dim"], got["num_global_key_value_heads"]) \
        == (32, 2, 64, 1)
    rebuilt = Gemma4TextConfig(**{k: v for k, v in got.items() if k not in ("rope_theta", "rope_scaling")})
    def layers(config):
        return [(config.per_layer_config[i].head_dim, config.per_layer_config[i].num_key_value_heads) for i in range(6)]
    assert layers(rebuilt) == layers(c) == [(32, 2), (64, 1)] * 3
    assert rebuilt.kv_sharing_modes == c.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]


def _family_registered() -> bool:
    from kvchat.engine.model.families import family_of
    return family_of("gemma4_text") is not None


@pytest.mark.skipif(not _family_registered(), reason="kvchat's Gemma 4 family (model_type gemma4_text) is not "
                    "registered in engine/model/families.py yet")
def test_the_model_view_reads_the_same_config(gguf):
    """GGUFModel.hf_config (its Llama fields, then gguf_arch's) gives the header's Gemma 4 fields above, the base's
    head width, KV heads and MLP width replaced by the sliding layers' own."""
    from kvchat.engine.model.gguf_view import GGUFModel
    got, want = GGUFModel(gguf).hf_config(), header_config(gguf)
    assert got["model_type"] == "gemma4_text" and {k: got[k] for k in want} == want


def test_the_file_holds_llama_cpps_layout(gguf, model):
    """Every weight is stored unchanged (norms as w: Gemma4RMSNorm multiplies by w) under llama.cpp's name; the full
    layers have no attn_v (keys are values), the shared ones no k / v; rope_freqs turns the first quarter of the full
    layers' pairs; the per-layer keys are the header's arrays."""
    gf = GGUFFile(gguf)
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    names = {gemma4_gguf_name(n): n for n in state}
    assert set(gf.tensors) == set(names) | {gguf_arch.GEMMA4_ROPE_FREQS}
    for gname, name in names.items():
        assert torch.equal(torch.from_numpy(np.array(gf.dequantize(gname))).reshape(state[name].shape),
                           state[name].float()), name
    assert {"blk.0.attn_v.weight", "blk.1.attn_k.weight"} <= set(gf.tensors)
    assert not {"blk.1.attn_v.weight", "blk.4.attn_k.weight", "blk.5.attn_k.weight"} & set(gf.tensors)
    freqs = np.array(gf.dequantize(gguf_arch.GEMMA4_ROPE_FREQS))
    assert list(freqs) == [1.0] * 8 + [gguf_arch.GEMMA4_UNROTATED] * 24
    a, f = gf.arch, gf.fields
    assert f[f"{a}.attention.head_count_kv"] == [2, 1] * 3 and f[f"{a}.attention.sliding_window_pattern"] == [1, 0] * 3
    assert (f[f"{a}.attention.key_length"], f[f"{a}.attention.key_length_swa"]) == (64, 32)
    assert (f[f"{a}.rope.dimension_count"], f[f"{a}.rope.dimension_count_swa"]) == (64, 32)
    assert (f[f"{a}.rope.freq_base"], f[f"{a}.rope.freq_base_swa"]) == (1e6, 1e4)
    assert (f[f"{a}.attention.shared_kv_layers"], f[f"{a}.embedding_length_per_layer_input"]) == (2, 16)


@contextlib.contextmanager
def ggml_gelu(model):
    """transformers' GELU as llama.cpp's CPU one computes it: read from a table of fp16 values at the fp16-rounded
    input, 0 below -10 and x above 10 (ggml's GGML_GELU_FP16)."""
    class Gelu(torch.nn.Module):
        def forward(self, x):
            y = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
            return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))
    gelu = Gelu()
    owners = [m for m in model.modules() if hasattr(m, "act_fn")]
    kept = [m.act_fn for m in owners]
    for m in owners:
        m.act_fn = gelu
    try:
        yield
    finally:
        for m, act in zip(owners, kept):
            m.act_fn = act


def test_llama_cpp_gives_transformers_logits(gguf, model):
    """llama.cpp (F32 tensors, F32 KV cache) gives transformers' logits over 20 tokens, past the window of 8, within
    5e-3 of the largest. Its GELU is the one step not in f32 (a table of fp16 values: alone it moves these logits by
    up to 1e-2 of the largest); with transformers' GELU rounded as ggml rounds it, what is left is the two sides'
    f32 rounding and fp16 ties amplified by six random layers and the routing (seen 1e-4 to 2.4e-3 of the largest
    over seeds 0-2, 8e-4 at most for this seed), while a wrong transform (norms as 1 + w, rope_freqs all ones, a
    scale lost) moves them by a large part of their size (rope_freqs all ones: 60%)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    with torch.no_grad(), ggml_gelu(model):
        want = model(torch.tensor([IDS])).logits[0].float().numpy()
    llm = llama_cpp.Llama(str(gguf), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    try:
        llm.eval(IDS)
        got = np.array(llm.scores[:len(IDS)])
    finally:
        llm.close()
    assert float(np.abs(got - want).max()) <= 5e-3 * float(np.abs(want).max())


@pytest.mark.parametrize("change, match", [
    (dict(final_logit_softcapping=None), r"final_logit_softcapping is None, but llama\.cpp's gemma4 reads 30\.0"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention",
                       "sliding_attention", "full_attention"]), r"KV-shared full_attention layers' source layer is 2"),
    (dict(per_layer_config=None, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=False),
     r"the full layers' KV heads is 2, but llama\.cpp's gemma4 reads 1 ")])
def test_a_model_llama_cpp_would_read_otherwise_is_refused(folder, tmp_path, change, match):
    """No soft-cap (the converter writes no key, and llama.cpp then caps at 30), shared layers whose source is not
    the layer llama.cpp takes (first shared - 1 for full, - 2 for sliding), or a published config's
    num_global_key_value_heads where transformers reads it not (keys not values) would describe another model."""
    copy = Path(shutil.copytree(folder, tmp_path / "f"))
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=match) as info:
        write_gguf_from_hf(copy, tmp_path / "x.gguf")
    assert "\n" not in str(info.value) and not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("layers", [None, 8])
def test_the_e4b_preset_reads_back_as_the_published_config(tmp_path, layers):
    """The random E4B (as zeros: a sparse file) reads as google/gemma-4-E4B's text config; cut to 8 layers it keeps
    the pattern, the last layer full and one KV-shared layer of each kind after a sliding then a full one."""
    path = write_random_gguf(tmp_path / "e4b.gguf", "gemma-4-e4b", "Q4_K_M", layers=layers, weights=False)
    cfg = header_config(path)
    n = layers or 42
    types = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    assert cfg["layer_types"] == types and cfg["num_kv_shared_layers"] == (2 if layers else 18)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["global_head_dim"]) == (2560, 10240, 8, 2, 256, 512)
    assert (cfg["attention_k_eq_v"], cfg["num_global_key_value_heads"], cfg["use_double_wide_mlp"],
            cfg["enable_moe_block"]) == (False, None, False, False)
    assert (cfg["hidden_size_per_layer_input"], cfg["vocab_size"], cfg["vocab_size_per_layer_input"]) == (256, 262144,
                                                                                                          262144)
    assert (cfg["sliding_window"], cfg["final_logit_softcapping"], cfg["max_position_embeddings"],
            cfg["tie_word_embeddings"]) == (512, 30.0, 131072, True)
    assert cfg["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    assert path.stat().st_blocks * 512 < 64 * 2**20          # sparse: the weights were not written


def test_the_26b_a4b_preset_reads_back_as_the_published_config(tmp_path):
    """The random 26B-A4B (zeros, sparse) reads as google/gemma-4-26B-A4B's text config: 128 experts of 704 (8 used)
    beside a dense MLP of 2,112 in every layer, global layers of 2 KV heads of 512 whose keys are their values."""
    path = write_random_gguf(tmp_path / "a4b.gguf", "gemma-4-26b-a4b", "Q4_K_M", weights=False)
    cfg = header_config(path)
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 5
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["global_head_dim"]) == (2816, 2112, 16, 8, 256, 512)
    assert (cfg["attention_k_eq_v"], cfg["num_global_key_value_heads"], cfg["num_kv_shared_layers"],
            cfg["hidden_size_per_layer_input"]) == (True, 2, 0, 0)
    assert (cfg["enable_moe_block"], cfg["num_experts"], cfg["top_k_experts"], cfg["moe_intermediate_size"]) == (
        True, 128, 8, 704)
    assert (cfg["sliding_window"], cfg["final_logit_softcapping"]) == (1024, 30.0)


def test_a_cut_too_short_for_both_shared_kinds_is_refused():
    """Seven layers end full, full: no sliding layer can be shared after a full one, as llama.cpp reads them."""
    with pytest.raises(ValueError, match="keep 8 layers at least"):
        cut_layers(PRESETS["gemma-4-e4b"], 7)


def test_kvchat_reads_the_gguf_as_transformers_runs_the_folder(folder, model, gguf):
    """kvchat's engine on the written file: F32 within 1e-3 of transformers' largest logit over a prompt chunk and
    decode steps; every tensor llama.cpp names differently (layer_output_scale, ffn_down_exps.scale, the PLE tensors,
    the experts' fused gate | up) read into its place. A Q8_0 file read packed equals the same file dequantized
    (prompt rows in fp32): the packed path cuts the fused experts as the dense one does. (Quantized against
    transformers is no test here: six random layers of std 0.2 amplify Q8_0's rounding to several percent, in
    llama.cpp as in kvchat.)"""
    from kvchat.engine import CacheConfig, Engine, EngineConfig
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].float()
    fp32 = CacheConfig(k_format="fp32", v_format="fp32")

    def run(path, **kw):
        engine = Engine.load(EngineConfig(model=str(path), **kw))
        s = engine.new_session(cache=fp32)
        out = torch.cat([engine.runner.step([(s.seq, IDS[:12])], all_logits=True)[0]] +
                        [engine.runner.step([(s.seq, [t])], all_logits=True)[0] for t in IDS[12:]])
        s.close()
        return out

    got = run(gguf, weights="dense")
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
    q8 = folder.parent / "gemma4-Q8_0.gguf"
    if not q8.exists():
        write_gguf_from_hf(folder, q8, "Q8_0")
    dense, packed = run(q8, weights="dense"), run(q8, prefill="fp32")
    assert float((packed - dense).abs().max()) <= 2e-3 * float(dense.abs().max())
