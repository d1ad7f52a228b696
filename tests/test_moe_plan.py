"""Mixtures of experts in the planner (`kvchat estimate`, the Models page): every expert is held, so what fits is
planned with all of them, and what one decoded token reads (attention, router, the experts it is routed to, the
output head) is said beside it; the presets count the published totals; gpt-oss's sliding layers stay at their
window in the KV arithmetic."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvchat.cli.terminal import main as cli_main
from kvchat.engine.config import CacheConfig
from kvchat.engine.gguf.file import GGUFFile
from kvchat.engine.kv.layout import conversation_bytes
from kvchat.engine.plan.estimate import estimate, model_facts, model_facts_from, summarize
from kvchat.engine.plan.fit import parameter_counts, resident_bytes
from kvchat.engine.plan.presets import PRESET_CONFIGS, preset
from kvchat.engine.units import GIB

MOE = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b")


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30.53e9, 3.04e9),     # Qwen: "30.5B in total and 3.3B activated" (3.3 counts the embedding)
    ("gpt-oss-20b", 20.91e9, 3.61e9),      # OpenAI's model card: 20.91B total, 3.61B active
    ("mixtral-8x7b", 46.70e9, 12.75e9),    # Mistral: 46.7B total, 12.9B per token (with the embedding)
])
def test_presets_count_the_published_parameters(name, total, active):
    mc = preset(name)
    t, a = parameter_counts(mc)
    assert t == pytest.approx(total, rel=2e-3) and a == pytest.approx(active, rel=2e-3)
    assert all(layer.experts is not None for layer in mc.layers)


def test_dense_presets_count_as_before():
    """A dense model's total is its weights' (the estimate's README numbers); a token reads all but the embedding
    table when the head is its own, everything when tied."""
    t, a = parameter_counts(preset("llama-2-7b"))
    assert t == 6_738_415_616 and a == t - 32000 * 4096 + 4096
    t, a = parameter_counts(preset("smollm2-135m"))
    assert t == a


def test_gpt_oss_preset_is_its_config():
    cfg, mc = PRESET_CONFIGS["gpt-oss-20b"], preset("gpt-oss-20b")
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["sliding_window"], cfg["rope_theta"]) == \
        (32, 4, 128, 150000)
    assert [layer.window for layer in mc.layers] == [128, None] * 12
    assert all(layer.sink_logits and layer.experts.activation == "swiglu_oai" for layer in mc.layers)
    assert mc.layers[0].rope.scaling[:2] == ("yarn", 32.0)


@pytest.mark.parametrize("name", MOE)
def test_the_estimate_holds_every_expert_and_says_what_a_token_reads(name):
    facts = model_facts(name, "Q4_K")
    e = estimate(facts, 4096, formats=("fp16",), memory_bytes=64 * GIB, device="cpu")
    total, active = parameter_counts(facts.config)
    assert e.weight_bytes == facts.weight_bytes == int(total * 144 / 256)
    assert e.active_weight_bytes == int(active * 144 / 256) and e.active_parameters == active
    assert e.rows[0].total_bytes == e.weight_bytes + e.rows[0].kv_bytes        # every expert counts in what fits
    ex = facts.config.layers[0].experts
    assert e.experts == (ex.count, ex.used)
    text = summarize(e)
    assert f"{ex.used} of {ex.count} experts per token" in text and "read per token" in text
    assert f"{active / 1e9:.2f} B parameters read per token" in text


def test_a_dense_estimate_says_nothing_of_experts():
    e = estimate(model_facts("llama-3.1-8b"), 1024, formats=("fp16",), memory_bytes=64 * GIB, device="cpu")
    assert e.experts == () and "experts" not in summarize(e)


def test_gpt_oss_sliding_layers_stay_at_their_window():
    """Of gpt-oss-20b's 24 layers the 12 sliding ones hold at most their 128 tokens (in whole blocks): a token
    past them adds only the 12 global layers' K and V."""
    mc = preset("gpt-oss-20b")
    e = estimate(model_facts("gpt-oss-20b", "MXFP4"), 131072, formats=("fp16",), memory_bytes=64 * GIB,
                 device="cpu", dtype="fp16")
    per_layer_token = 2 * 8 * 64 * 2
    assert e.rows[0].bytes_per_token == 12 * per_layer_token
    cache = CacheConfig(k_format="fp16", v_format="fp16", block_size=16)
    kv = conversation_bytes(mc, cache, 131072, "fp16", "cpu")
    assert e.rows[0].kv_bytes == kv
    assert 12 * 131072 * per_layer_token < kv < 12 * 131072 * per_layer_token + 12 * 256 * per_layer_token
    assert dict(e.layer_windows) == {128: 12, None: 12}


def test_resident_bytes_of_what_a_token_reads_follow_the_weights_form():
    """On a GPU without the Triton kernels the weights load as bf16: what a token reads is then its parameters
    times two, as the whole is; with them, its stored bytes, as on the CPU."""
    mc = preset("qwen3-30b-a3b")
    total, active = parameter_counts(mc)
    assert resident_bytes(mc, 1, "auto", "cuda", "auto", "preset", packed=False) == 2 * total
    assert resident_bytes(mc, 1, "auto", "cuda", "auto", "preset", params=active, packed=False) == 2 * active
    assert resident_bytes(mc, 123, "auto", "cuda", "auto", "preset", params=active, packed=True) == 123
    assert resident_bytes(mc, 123, "auto", "cpu", "auto", "gguf", params=active) == 123


# ------------------------------------------------------------------------------------------------ files

def _moe_gguf(tmp_path: Path, qtype: str = "Q8_0", per_expert: bool = False) -> Path:
    from dataclasses import replace
    from kvchat.bench.gguf_writer import PRESETS, write_random_gguf
    shape = replace(PRESETS["mixtral-8x7b"], layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                    intermediate=256, vocab=None, context=4096, experts=8, experts_used=2)
    return write_random_gguf(tmp_path / f"m-{qtype}-{per_expert}.gguf", shape, qtype, per_expert=per_expert)


@pytest.mark.parametrize("per_expert", [False, True])
def test_a_gguf_reads_its_expert_tensors_at_used_over_count(tmp_path, per_expert):
    """A GGUF's read bytes from its own tensor table: everything but 6 of the 8 experts' tensors and all but one row
    of the embedding table (its output head is its own), in either expert layout."""
    path = _moe_gguf(tmp_path, "Q4_K_M", per_expert)
    gf = GGUFFile(path)
    facts = model_facts_from(path)
    experts = sum(t.n_bytes for n, t in gf.tensors.items() if ".ffn_gate." in n or ".ffn_up." in n
                  or ".ffn_down." in n or "_exps." in n)
    embd = gf.tensors["token_embd.weight"]
    expect = gf.tensor_bytes - experts + experts * 2 // 8 - embd.n_bytes + embd.n_bytes // embd.shape[1]
    assert abs(facts.active_bytes - expect) <= 8 * 2 * 3              # integer division per tensor
    assert facts.weight_bytes == gf.tensor_bytes and facts.parameters == sum(math.prod(t.shape)
                                                                             for t in gf.tensors.values())
    e = estimate(facts, 256, formats=("fp16",), memory_bytes=8 * GIB, device="cpu")
    assert e.experts == (8, 2) and e.active_weight_bytes == facts.active_bytes < e.weight_bytes


def test_a_folder_reads_its_experts_at_used_over_count(tmp_path):
    """A Hugging Face folder's read bytes from its safetensors headers (Qwen3-MoE's per-expert tensors, its dense
    layer whole)."""
    from safetensors import safe_open
    from tiny_models import tiny_family_dir
    folder = Path(tiny_family_dir(tmp_path / "q", "qwen3_moe", tie_word_embeddings=False))
    facts = model_facts_from(folder)
    sizes = {}
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        for name in f.keys():
            sizes[name] = f.get_tensor(name).nbytes
    experts = {n: s for n, s in sizes.items() if ".mlp.experts." in n}
    assert experts and not any(".layers.1.mlp.experts." in n for n in experts)       # layer 1 is dense
    embd = sizes["model.embed_tokens.weight"]
    expect = sum(sizes.values()) - sum(experts.values()) + sum(s * 3 // 8 for s in experts.values()) - embd + embd // 320
    assert facts.active_bytes == expect


def test_the_models_page_entry_says_what_a_token_reads(tmp_path):
    from kvchat.engine.plan.library import describe
    entry = describe("m", _moe_gguf(tmp_path), "Folder", 8 * GIB)
    assert entry.loadable and 0 < entry.active_parameters < entry.parameters
    dense = describe("tiny", _tiny_dense(tmp_path), "Folder", 8 * GIB)
    assert dense.loadable and dense.active_parameters == 0


def _tiny_dense(tmp_path: Path) -> Path:
    from kvchat.bench.gguf_writer import write_random_gguf
    return write_random_gguf(tmp_path / "tiny.gguf", "tiny", "Q8_0")


def test_kvchat_estimate_json_carries_the_experts(capsys):
    assert cli_main(["estimate", "--model", "gpt-oss-20b", "--context", "8192", "--memory-gb", "24",
                     "--weights-type", "Q4_K", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["experts"] == [32, 4] and 0 < out["active_weight_bytes"] < out["weight_bytes"]
    assert out["active_parameters"] == parameter_counts(preset("gpt-oss-20b"))[1]
