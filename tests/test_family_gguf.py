"""The families of issue 23 from GGUF: a tiny Hugging Face folder written by our writer (bench/gguf_writer.py:
write_gguf_from_hf) with llama.cpp's names and metadata reads back as the same description and the same weights,
gives the folder's logits, loads packed, and is refused with one line where llama.cpp would not read it as the
folder's model. Where llama-cpp-python is importable, llama.cpp itself reads our files and agrees.

The forward is driven by test_family_forward's reference attention (exact_attention), the same on both sides."""
from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.bench.gguf_hf import write_gguf_from_hf
from kvchat.bench.gguf_writer import PRESETS, ModelShape, write_random_gguf
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.source import read_config
from kvchat.engine.model.transformer import Transformer
from kvchat.engine.model.weights import from_gguf
from test_family_forward import PROMPT, exact_attention, load_dense
from tiny_models import tiny_family_dir

# a GGUF cannot hold Gemma's query_pre_attn_scalar: llama.cpp derives head_dim (hidden / heads on the 27B models)
CASES = {"qwen3": {}, "gemma2": dict(query_pre_attn_scalar=32), "gemma3": dict(query_pre_attn_scalar=32),
         "phi3": {}, "phi3-longrope": dict(longrope=True), "phi3-window": dict(sliding_window=16)}


def _folder_and_gguf(tmp_path: Path, case: str, qtype: str = "F32", **more) -> tuple[str, Path]:
    # the folder's name becomes general.name: not "phi3...", for which llama.cpp looks up Phi-3's chat tokens
    # (<|end|>) that this tiny vocabulary does not have
    folder = tiny_family_dir(tmp_path / f"tiny-{len(case)}-{qtype}", case.split("-")[0], seed=2,
                             **{**CASES[case], **more})
    return folder, write_gguf_from_hf(folder, tmp_path / f"{case}-{qtype}.gguf", qtype)


def load_gguf(path: Path, weights: str = "dense") -> Transformer:
    """Our Transformer on a GGUF, read as the engine reads one (fp32 on the CPU)."""
    gf = GGUFModel(path)
    return from_gguf(ModelConfig.from_gguf(gf), gf, torch.float32, "cpu", weights)


def _ids() -> torch.Tensor:
    return torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_reads_as_its_folder(tmp_path, case):
    """One description from both sources (eps and LongRoPE's attention factor are float32 in a GGUF), and every
    weight equal: q / k unpermuted where llama.cpp permutes, Gemma's stored 1 + w norms the folder's w + 1."""
    folder, path = _folder_and_gguf(tmp_path, case)
    gf = GGUFModel(path)
    a, b = ModelConfig.from_gguf(gf), ModelConfig.from_hf(read_config(Path(folder)))
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)
    assert [s.query_scale for s in a.layers] == pytest.approx([s.query_scale for s in b.layers], rel=1e-6)
    layers = tuple(replace(s, query_scale=t.query_scale) for s, t in zip(a.layers, b.layers))
    assert replace(a, rms_norm_eps=b.rms_norm_eps, layers=layers) == b
    ours, theirs = load_gguf(path), load_dense(folder)
    for la, lb in zip(ours.layers, theirs.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(la, name).dequantize(), getattr(lb, name).dequantize()), (case, name)
        for x, y in zip(la.norms(), lb.norms()):
            assert torch.equal(x, y), case
        assert len(la.norms()) == len(lb.norms())
    assert torch.equal(ours.norm, theirs.norm)


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_logits_are_the_folders(tmp_path, case):
    """The F32 GGUF through the dense path gives the folder's logits on a prompt three times the window."""
    folder, path = _folder_and_gguf(tmp_path, case)
    ids = _ids()
    ours = load_gguf(path)
    theirs = load_dense(folder)
    a = ours.forward(ids, exact_attention(ours.config), all_logits=True)
    b = theirs.forward(ids, exact_attention(theirs.config), all_logits=True)
    assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item(), case


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("case", ["qwen3", "gemma2", "gemma3", "phi3-longrope"])
def test_packed_gguf_loads_and_runs(tmp_path, case, qtype):
    """The quantized file loads packed (its blocks kept) and runs close to its own dense reading."""
    _, path = _folder_and_gguf(tmp_path, case, qtype)
    ids = _ids()
    packed, dense = load_gguf(path, "auto"), load_gguf(path, "dense")
    assert packed.weights == "gguf" and qtype in packed.quant
    a = packed.forward(ids, exact_attention(packed.config), all_logits=True)
    b = dense.forward(ids, exact_attention(dense.config), all_logits=True)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.9, (case, qtype, agree)
    assert (a - b).abs().max().item() < 0.1 * b.abs().max().item()


def test_gemma_norms_are_stored_as_llama_cpp_stores_them(tmp_path):
    """The file holds 1 + w for every Gemma norm (q / k norms included), w for every other family: read raw."""
    folder, path = _folder_and_gguf(tmp_path, "gemma3")
    from kvchat.engine.model.source import load_state_dict
    state = load_state_dict(Path(folder))
    gf = GGUFModel(path)
    for hf, gguf in (("model.layers.0.self_attn.q_norm.weight", "blk.0.attn_q_norm.weight"),
                     ("model.layers.1.post_feedforward_layernorm.weight", "blk.1.post_ffw_norm.weight"),
                     ("model.norm.weight", "output_norm.weight")):
        assert np.array_equal(np.asarray(gf.tensors[gguf].data), state[hf].numpy() + np.float32(1.0)), hf
    folder, path = _folder_and_gguf(tmp_path, "qwen3")
    state, gf = load_state_dict(Path(folder)), GGUFModel(path)
    assert np.array_equal(np.asarray(gf.tensors["blk.0.attn_k_norm.weight"].data),
                          state["model.layers.0.self_attn.k_norm.weight"].numpy())


def test_header_fields_in_config_words(tmp_path):
    """hf_config gives what a config.json of the model says, under its names; key_names name the header's keys."""
    _, path = _folder_and_gguf(tmp_path, "gemma3")
    gf = GGUFModel(path)
    cfg = gf.hf_config()
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] and cfg["sliding_window"] == 16
    assert cfg["rope_parameters"] == {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    assert cfg["query_pre_attn_scalar"] == 32 and cfg["final_logit_softcapping"] is None
    assert gf.key_names()["sliding_window"] == "gemma3.attention.sliding_window"
    _, path = _folder_and_gguf(tmp_path, "gemma2")
    cfg = GGUFModel(path).hf_config()
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    _, path = _folder_and_gguf(tmp_path, "phi3-longrope")
    gf = GGUFModel(path)
    assert {"rope_factors_long.weight", "rope_factors_short.weight", "blk.0.attn_qkv.weight"} <= set(gf.tensors)
    assert gf.tensors["blk.0.ffn_up.weight"].shape == (64, 2 * 128)        # gate and up: 2 x intermediate rows
    rope = gf.hf_config()["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 64


def test_a_setting_llama_cpp_derives_must_be_its(tmp_path):
    """A Gemma folder whose query_pre_attn_scalar is not the one llama.cpp derives cannot be written as a GGUF
    (the file would describe another model): the writer says which setting."""
    folder = tiny_family_dir(tmp_path / "g2", "gemma2")       # query_pre_attn_scalar 24, head_dim 32
    with pytest.raises(ValueError, match="query_pre_attn_scalar is 24, but llama.cpp derives 32 for gemma2"):
        write_gguf_from_hf(folder, tmp_path / "g2.gguf")
    assert not (tmp_path / "g2.gguf").exists()


def _header_only(path: Path, arch: str, extra: dict[str, int]) -> Path:
    """A GGUF of `arch` with extra uint32 keys and one tensor whose data is missing (a truncated file)."""
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()
    kv = [s("general.architecture") + struct.pack("<I", 8) + s(arch)]
    kv += [s(k) + struct.pack("<II", 4, v) for k, v in extra.items()]
    tensor = s("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 64, 320) + struct.pack("<IQ", 0, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv)) + b"".join(kv) + tensor)
    return path


@pytest.mark.parametrize("arch, extra, named", [("qwen2moe", {}, "'qwen2moe'"), ("deepseek2", {}, "'deepseek2'")])
def test_mixture_of_experts_refused_before_the_tensors(tmp_path, arch, extra, named):
    """An MoE GGUF of a family kvchat does not run is refused naming it and the supported list, before any tensor
    is looked at: this file's tensor runs past its end, which would be another message."""
    from kvchat.engine.model.families import supported
    with pytest.raises(ModelLoadError) as info:
        GGUFModel(_header_only(tmp_path / "moe.gguf", arch, extra))
    text = str(info.value)
    assert named in text and "mixture-of-experts" in text and text.endswith(supported())


def test_random_presets_of_the_new_families(tmp_path):
    """The presets have the issue's shapes; files of their kind (small stand-ins here, the default tokenizer's own
    vocabulary) read as the family, with every tensor in place, and load packed."""
    q, g = PRESETS["qwen3-0.6b"], PRESETS["gemma-3-1b"]
    assert (q.arch, q.layers, q.hidden, q.heads, q.kv_heads, q.head_dim, q.intermediate, q.tied, q.rope_theta) == \
        ("qwen3", 28, 1024, 16, 8, 128, 3072, True, 1e6)
    assert (g.arch, g.layers, g.hidden, g.heads, g.kv_heads, g.head_dim, g.intermediate, g.window, g.vocab) == \
        ("gemma3", 26, 1152, 4, 1, 256, 6912, 512, 262144)
    for shape in (replace(q, layers=2, hidden=256, intermediate=512, vocab=None),
                  replace(g, layers=6, hidden=288, intermediate=512, window=8, vocab=None)):
        path = write_random_gguf(tmp_path / f"{shape.arch}.gguf", shape, "Q4_K_M")
        gf = GGUFModel(path)
        mc = ModelConfig.from_gguf(gf)
        assert (mc.model_type, mc.num_layers, mc.head_dim) == ({"qwen3": "qwen3", "gemma3": "gemma3_text"}[shape.arch],
                                                              shape.layers, shape.head_dim)
        assert all(s.qk_norm for s in mc.layers)
        if shape.arch == "gemma3":
            assert [s.window for s in mc.layers] == [8] * 5 + [None]
            # rows of 288 values are not whole Q4_K super-blocks: llama.cpp's fallback types
            assert gf.type_name("blk.0.attn_q.weight") == "Q5_0" and gf.type_name("blk.0.attn_output.weight") == "Q4_K"
        load_gguf(path, "auto")


def test_preset_vocabulary_padded_to_the_real_one(tmp_path):
    """A preset's vocabulary is the real model's: the default tokenizer padded with unused tokens, so the output
    head has the real model's rows and llama.cpp's vocabulary check holds."""
    shape = ModelShape("t", 1, 256, 4, 2, 256, 64, 512, 1e6, True, arch="qwen3", vocab=50000)
    gf = GGUFModel(write_random_gguf(tmp_path / "t.gguf", shape, "Q8_0"))
    tokens = gf.array("tokenizer.ggml.tokens")
    assert len(tokens) == 50000 == gf.tensors["token_embd.weight"].shape[1] and tokens[-1] == f"<unused{50000 - 49152 - 1}>"
    assert len(gf.array("tokenizer.ggml.token_type")) == 50000


def test_unknown_preset_is_named(tmp_path):
    from kvchat.bench.gguf_writer import bench_model_path
    with pytest.raises(ValueError, match="unknown preset 'gemma-9': one of .*gemma-3-1b"):
        bench_model_path("gemma-9", "Q8_0")


@pytest.mark.parametrize("case", ["qwen3", "gemma2", "gemma3", "phi3", "phi3-longrope"])
def test_llama_cpp_reads_our_files_as_we_do(tmp_path, case):
    """llama.cpp's own reading of our F32 GGUFs (names, metadata, Gemma's stored norms, Phi-3's fused tensors and
    rope factors) gives our logits, its KV cache in F32 so that nothing is rounded on its side."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from kvchat.engine.model.spec import Rope
    _, path = _folder_and_gguf(tmp_path, case)
    ids = _ids()
    ours = load_gguf(path)
    config = ours.config
    if case == "phi3-longrope":
        # llama.cpp turns every position with the long factors once its context (padded to 256) passes the
        # original 64; we (as transformers) with the short ones until the positions do: compared on its choice
        long = tuple(GGUFModel(path).hf_config()["rope_parameters"]["long_factor"])
        config = replace(config, layers=tuple(replace(s, rope=Rope(s.rope.theta, ("factors", long), s.rope.dims))
                                              for s in config.layers))
    expect = ours.forward(ids, exact_attention(config), all_logits=True).numpy()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0)      # ggml type 0: F32
    llm.eval(ids.tolist())
    got = np.asarray(llm.scores[:len(ids)], dtype=np.float32)
    # ggml's CPU GELU reads a float16 table: Gemma's MLP is exact to about 1e-3 there, the others to float32
    bound = 1e-3 if case.startswith("gemma") else 1e-5
    assert np.abs(got - expect).max() <= bound * np.abs(expect).max(), case


@pytest.mark.parametrize("case", ["qwen3", "gemma2", "gemma3", "phi3-longrope"])
def test_weight_fidelity_bench_on_family_files(tmp_path, case):
    """bench quality --weight-fidelity on a family's file as on Llama's (test_gguf_weights): requantized by gguf
    into Q4_0 with its metadata kept, the engine's packed decode agrees with its dense fp32 one."""
    from kvchat.bench.weights import checks, fidelity, requantize_gguf
    _, path = _folder_and_gguf(tmp_path, case)
    out = requantize_gguf(path, tmp_path / f"{case}-q4.gguf", "Q4_0")
    gf = GGUFModel(out)
    assert gf.type_name("blk.0.attn_output.weight") == "Q4_0" and gf.hf_config() == GGUFModel(path).hf_config()
    r = fidelity(str(out), _ids()[:32].tolist())
    assert r["top1_agreement"] >= 0.95 and r["mean_kl"] <= 1e-3 and r["kinds"].get("q4"), (case, r)
    assert all(checks({"Q4_0": r}).values()), r


def test_the_gemma2_preset_writes_its_caps_and_windows(tmp_path):
    """gemma-2-2b's shape; a small file of its kind reads as Gemma 2: scores capped at 50 and logits at 30 (the keys
    llama.cpp's converter writes), every other layer sliding, post-norms, the query scale from head_dim."""
    g = PRESETS["gemma-2-2b"]
    assert (g.arch, g.layers, g.hidden, g.heads, g.kv_heads, g.head_dim, g.intermediate, g.window, g.vocab) == \
        ("gemma2", 26, 2304, 8, 4, 256, 9216, 4096, 256000)
    shape = replace(g, layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, window=8, vocab=None)
    path = write_random_gguf(tmp_path / "g2.gguf", shape, "Q4_K_M")
    gf = GGUFModel(path)
    assert gf.fields["gemma2.attn_logit_softcapping"] == 50.0 and gf.fields["gemma2.final_logit_softcapping"] == 30.0
    mc = ModelConfig.from_gguf(gf)
    assert mc.model_type == "gemma2" and mc.final_softcap == 30.0
    assert [s.window for s in mc.layers] == [8, None] * 2 and all(s.attn_softcap == 50.0 and s.post_norms
                                                                    for s in mc.layers)
    assert all(abs(s.query_scale - 64 ** -0.5) < 1e-9 for s in mc.layers)
    load_gguf(path, "auto")
