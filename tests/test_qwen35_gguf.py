"""Qwen3.5 / Qwen3.5-MoE GGUFs (llama.cpp's qwen35 / qwen35moe) both ways: a tiny transformers folder written by
bench/gguf_hf.py as llama.cpp's converter writes it reads back through kvchat's GGUF view as transformers' own
tensors and settings; the random presets' headers read back as the published models' config; kvchat's logits from
the GGUF are transformers'.

llama.cpp itself (llama-cpp-python, not a test dependency) was run by hand on these files: it gives transformers'
logits on the tiny folders' GGUFs and runs the presets. What it needs of the file and transformers does not have
(A = -exp(A_log), 1 + w norms, the value heads tiled, the bare ssm_a, post_attention_norm) is pinned here on the
file's own names, so that a change to the layout fails here and not only in llama.cpp."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.bench.gguf_hf import write_gguf_from_hf
from kvchat.bench.gguf_writer import PRESETS, planned_bytes, tensor_plan, tensor_type, use_more_bits, write_random_gguf
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.model.gguf_view import GGUFModel
from tiny_models import tiny_family_dir

# llama.cpp reads the converter's pattern of full layers (every 4th where config.json names no interval) and one
# head width for keys and values: the tiny folders are written so; 6 value heads over 2 key heads keep the
# converter's value-head reordering in play
LLAMA_CPP_SHAPE = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_value_head_dim=16)
FAMILIES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory) -> Path:
    return Path(tiny_family_dir(tmp_path_factory.mktemp(request.param), request.param, seed=1, **LLAMA_CPP_SHAPE))


@pytest.fixture(scope="module")
def model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _gguf(folder: Path, qtype: str) -> Path:
    path = folder.parent / f"{folder.name}-{qtype}.gguf"
    return path if path.is_file() else write_gguf_from_hf(folder, path, qtype)


def transformers_tensors(model) -> dict[str, torch.Tensor]:
    """Every weight of transformers' model under kvchat's name, as kvchat reads it: A = -exp(A_log), dt_bias as
    dt.bias, the conv [channels, kernel], zero-centred norms as their multiplier 1 + w (linear_attn.norm is a plain
    one), the router as mlp.router, the fused experts' gate | up apart; a tied head is the embedding's."""
    out = {}
    for name, p in model.state_dict().items():
        t = p.detach().float()
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith(".A_log"):
            out[name[:-len("A_log")] + "A.weight"] = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            out[name[:-len("dt_bias")] + "dt.bias"] = t
        elif name.endswith(".conv1d.weight"):
            out[name] = t[:, 0, :]
        elif name.endswith("norm.weight") and ".linear_attn." not in name:
            out[name] = t + 1
        elif name.endswith(".mlp.gate.weight"):
            out[name.replace(".mlp.gate.", ".mlp.router.")] = t
        elif name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[name[:-len("gate_up_proj")] + "gate_proj.weight"] = gate
            out[name[:-len("gate_up_proj")] + "up_proj.weight"] = up
        elif name.endswith(".mlp.experts.down_proj"):
            out[name + ".weight"] = t
        else:
            out[name] = t
    return out


def test_the_header_reads_as_the_folders_config(folder, model):
    """hf_config gives config.json's Qwen3.5 fields: the layer pattern, the Gated DeltaNet's heads and widths, the
    partial rotation, the experts and the shared expert's size."""
    c, got = model.config, GGUFModel(_gguf(folder, "F32")).hf_config()
    assert got["model_type"] == c.model_type
    for key in ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "head_dim", "num_attention_heads",
                "num_key_value_heads", "hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings"):
        assert got[key] == getattr(c, key), key
    assert got["partial_rotary_factor"] == c.rope_parameters["partial_rotary_factor"] == 0.25
    assert got["rope_theta"] == c.rope_parameters["rope_theta"]
    if c.model_type == "qwen3_5_moe_text":
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            assert got[key] == getattr(c, key), key
    else:
        assert got["intermediate_size"] == c.intermediate_size and "num_experts" not in got


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_every_weight_reads_back_as_transformers(folder, model, qtype):
    """Under kvchat's names every tensor has transformers' shape and values: exactly from F32; from Q8_0 within
    its rounding (the value heads are put back in transformers' order after dequantizing)."""
    gf = GGUFModel(_gguf(folder, qtype))
    want = transformers_tensors(model)
    assert gf.hf_shapes() == {name: tuple(t.shape) for name, t in want.items()}
    for name, t in want.items():
        got = torch.from_numpy(np.array(gf.dequantize(name))).reshape(t.shape)
        if qtype == "F32" or gf.type_name(gf.gguf_name(name)) == "F32":
            assert torch.equal(got, t), name
        else:       # Q8_0: each value within half a step of its block's scale (max |w| / 127)
            assert float((got - t).abs().max()) <= float(t.abs().max()) / 127, name


def test_the_file_holds_llama_cpps_layout(folder, model):
    """On llama.cpp's own names: A as -exp(A_log) in the bare blk.N.ssm_a, the zero-centred norms as 1 + w and the
    gated one as w, the MLP's pre-norm as post_attention_norm, the value heads tiled (the first of every key
    head, then the second ...) in ssm_a, attn_gate's rows and conv1d's value channels; the keys llama.cpp reads."""
    gf = GGUFFile(_gguf(folder, "F32"))
    c, layer = model.config, model.model.layers[0]
    la = layer.linear_attn
    hk, hv, d = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
    tiled = torch.arange(hv).reshape(hk, hv // hk).T.reshape(-1)       # stored head i * hk + g: transformers' g*r + i
    raw = lambda name: torch.from_numpy(np.array(gf.dequantize(name)))  # noqa: E731
    assert {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.post_attention_norm.weight"} <= set(gf.tensors)
    assert not any(n.startswith("blk.0.ffn_norm") for n in gf.tensors)
    assert torch.equal(raw("blk.0.ssm_a"), (-torch.exp(la.A_log.detach()))[tiled])
    assert torch.equal(raw("blk.0.ssm_dt.bias"), la.dt_bias.detach()[tiled])
    assert torch.equal(raw("blk.0.attn_norm.weight"), layer.input_layernorm.weight.detach() + 1)
    assert torch.equal(raw("blk.0.ssm_norm.weight"), la.norm.weight.detach())
    z = la.in_proj_z.weight.detach().reshape(hv, d, -1)
    assert torch.equal(raw("blk.0.attn_gate.weight"), z[tiled].reshape(hv * d, -1))
    keys = 2 * hk * c.linear_key_head_dim
    conv = la.conv1d.weight.detach()[:, 0, :]
    assert torch.equal(raw("blk.0.ssm_conv1d.weight")[:keys], conv[:keys])
    assert torch.equal(raw("blk.0.ssm_conv1d.weight")[keys:], conv[keys:].reshape(hv, d, -1)[tiled].reshape(hv * d, -1))
    a = gf.arch
    assert gf.fields[f"{a}.full_attention_interval"] == 4 and gf.fields[f"{a}.rope.dimension_count"] == 8
    assert (gf.fields[f"{a}.ssm.group_count"], gf.fields[f"{a}.ssm.time_step_rank"]) == (hk, hv)
    assert (gf.fields[f"{a}.ssm.state_size"], gf.fields[f"{a}.ssm.inner_size"]) == (c.linear_key_head_dim, hv * d)
    assert list(gf.array(f"{a}.rope.dimension_sections")) == [11, 11, 10, 0]


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["linear_attention", "full_attention"] * 2), r"layer_types is .*, but llama\.cpp derives"),
    (dict(linear_value_head_dim=8), r"linear_value_head_dim is 8, but llama\.cpp derives 16 ")])
def test_a_model_llama_cpp_would_read_otherwise_is_refused(tmp_path, change, match):
    """A layer pattern other than the converter's interval, or value heads narrower than the key heads (llama.cpp
    reads one width, ssm.state_size, for both), would describe another model: refused in one line."""
    folder = tiny_family_dir(tmp_path / "f", "qwen3_5", **{**LLAMA_CPP_SHAPE, **change})
    with pytest.raises(ValueError, match=match) as info:
        write_gguf_from_hf(folder, tmp_path / "x.gguf")
    assert "\n" not in str(info.value) and not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("name", ["qwen3.5-9b", "qwen3.5-35b-a3b"])
def test_a_random_preset_reads_back_as_the_published_config(tmp_path, name):
    """A preset cut to 4 layers (as zeros: a sparse file) reads as 3 Gated DeltaNet layers then one full one, with
    the published linear-attention shape; its MTP block stays in the file and out of the layers kvchat runs."""
    path = write_random_gguf(tmp_path / f"{name}.gguf", name, "Q4_K_M", layers=4, weights=False)
    gf = GGUFModel(path)
    cfg = gf.hf_config()
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and cfg["num_hidden_layers"] == 4
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]) == (16, 32, 128, 128, 4)
    assert (cfg["head_dim"], cfg["partial_rotary_factor"], cfg["rope_theta"], cfg["vocab_size"]) == (256, 0.25, 1e7,
                                                                                                     248320)
    if name == "qwen3.5-35b-a3b":
        assert (cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                cfg["shared_expert_intermediate_size"]) == (2048, 256, 8, 512, 512)
        assert f"{gf.arch}.feed_forward_length" not in gf.fields
    else:
        assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["tie_word_embeddings"]) == (4096, 12288, False)
    assert gf.fields[f"{gf.arch}.block_count"] == 5 and "blk.4.nextn.eh_proj.weight" in gf.tensors
    assert max(int(n.split(".")[2]) for n in gf.hf_shapes() if n.startswith("model.layers.")) == 3
    assert path.stat().st_blocks * 512 < 64 * 2**20          # sparse: the weights were not written


@pytest.mark.parametrize("name, params, low, high", [("qwen3.5-9b", 8.95e9, 5.0, 5.6),
                                                      ("qwen3.5-35b-a3b", 34.7e9, 19.5, 21.0)])
def test_the_presets_have_the_published_size(name, params, low, high):
    """The layers' and embeddings' parameters (the MTP block aside) are the published count within 1%, and the
    Q4_K_M file is the size of llama.cpp's (GiB)."""
    shape = PRESETS[name]
    plan = tensor_plan(shape, "F32", shape.vocab)
    count = sum(int(np.prod(dims)) for _, n, dims, _, _ in plan if not n.startswith(f"blk.{shape.layers}."))
    assert abs(count - params) <= 0.01 * params
    assert low <= planned_bytes(name, "Q4_K_M") / 2**30 <= high


def test_q4_k_m_follows_llama_cpps_rules_for_the_new_tensors():
    """llama.cpp's quantizer: the fused attn_qkv is attn_v-like (Q6_K in the use_more_bits layers, counted over
    every block), conv1d and the shared expert's one-row gate stay F32 (as do the bare ssm_a and the dt bias), the
    shared expert's down takes ffn_down's rule, the other new matrices the mix's base type."""
    blocks = 41
    for i in range(blocks):
        want = "Q6_K" if use_more_bits(i, blocks) else "Q4_K"
        assert tensor_type("Q4_K_M", f"blk.{i}.attn_qkv.weight", blocks, False, 256) == want
        assert tensor_type("Q4_K_M", f"blk.{i}.ffn_down_shexp.weight", blocks, False, 256) == want
    for name in ("ssm_conv1d.weight", "ffn_gate_inp_shexp.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight"):
        assert tensor_type("Q4_K_M", f"blk.0.{name}", blocks, False, 256) == "F32", name
    for name in ("attn_gate", "ssm_alpha", "ssm_beta", "ssm_out", "ffn_gate_shexp", "ffn_up_shexp", "nextn.eh_proj"):
        assert tensor_type("Q4_K_M", f"blk.0.{name}.weight", blocks, False, 256) == "Q4_K", name
        assert tensor_type("Q8_0", f"blk.0.{name}.weight", blocks, False, 256) == "Q8_0", name


def _family_runs() -> bool:
    from kvchat.engine.model.families import family_of
    return family_of("qwen3_5_text") is not None and family_of("qwen3_5_moe_text") is not None


_NOT_REGISTERED = pytest.mark.skipif(not _family_runs(), reason="kvchat's Qwen3.5 family (model_type qwen3_5_text / "
                                     "qwen3_5_moe_text) is not registered in engine/model/families.py yet")
IDS = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def _engine_logits(path: Path, weights: str) -> torch.Tensor:
    """All logits of IDS from the engine on a GGUF: a prompt chunk of 30, then single decode steps (fp32 pages; the
    packed weights' prompt rows in fp32, exact over their dequantized values)."""
    from kvchat.engine import CacheConfig, Engine, EngineConfig
    engine = Engine.load(EngineConfig(model=str(path), weights=weights, prefill="fp32"))
    s = engine.new_session(cache=CacheConfig(k_format="fp32", v_format="fp32"))
    out = torch.cat([engine.runner.step([(s.seq, IDS[:30])], all_logits=True)[0]] +
                    [engine.runner.step([(s.seq, [t])], all_logits=True)[0] for t in IDS[30:]])
    s.close()
    return out


@_NOT_REGISTERED
def test_kvchat_gives_transformers_logits_from_the_gguf(folder, model):
    """The engine on the F32 GGUF (dense: the view's tensors) gives transformers' logits within 1e-3 of the largest,
    over a prompt chunk and decode steps."""
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].float()
    got = _engine_logits(_gguf(folder, "F32"), "dense")
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())


@_NOT_REGISTERED
def test_the_packed_gguf_runs_as_its_dense_reading(folder):
    """The Q8_0 file loaded packed (its blocks kept, so the linear layers' rows and out_proj's columns come in the
    file's tiled value-head order: gguf_arch.value_head_order) gives its dense reading's logits within 1e-3 of the
    largest (fp32 prompt rows, int16 decode activations)."""
    path = _gguf(folder, "Q8_0")
    a, b = _engine_logits(path, "auto"), _engine_logits(path, "dense")
    assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())
