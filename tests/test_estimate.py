"""`kvchat estimate`: the README's worked examples hold exactly, and the estimate is the bytes a loaded engine holds."""
from __future__ import annotations

import itertools
import json

import pytest

from kvchat.cli.terminal import main as cli_main
from kvchat.engine.config import ConfigError
from kvchat.engine.plan.estimate import (FORMATS, GIB, MIB, estimate, largest_context, model_facts, parameter_count)
from kvchat.engine.plan.presets import preset
from kvchat.engine.kv.layout import kv_layout
from kvchat.engine.plan.estimate import cache_for


def test_seven_b_with_32_kv_heads_fp16_is_512_kib_per_token_and_1_gib_for_2048():
    e = estimate(model_facts("llama-2-7b"), 2048, formats=("fp16",), memory_bytes=64 * GIB, device="cpu")
    row = e.rows[0]
    assert (e.num_layers, e.num_kv_heads, e.head_dim) == (32, 32, 128)
    assert row.bytes_per_token == 524_288 == 512 * 1024
    assert row.kv_bytes == 2**30


def test_llama_3_70b_fp16_is_320_kib_per_token():
    for name in ("llama-3-70b", "llama-3.1-70b"):
        row = estimate(model_facts(name), 1024, formats=("fp16",), memory_bytes=256 * GIB, device="cpu").rows[0]
        assert row.bytes_per_token == 327_680 == 320 * 1024
        assert row.kv_bytes == 1024 * 327_680


def test_batch_multiplies_kv_and_total_adds_weights():
    facts = model_facts("llama-3.1-8b", "Q8_0")
    one = estimate(facts, 4096, 1, ("int8",), memory_bytes=64 * GIB, device="cpu").rows[0]
    four = estimate(facts, 4096, 4, ("int8",), memory_bytes=64 * GIB, device="cpu").rows[0]
    assert four.kv_bytes == 4 * one.kv_bytes
    assert four.total_bytes == facts.weight_bytes + four.kv_bytes
    assert facts.weight_bytes == int(facts.parameters * 34 / 32)


@pytest.mark.parametrize("name, published", [
    ("llama-3.1-8b", 8_030_261_248), ("llama-2-7b", 6_738_415_616), ("smollm2-135m", 134_515_008)])
def test_preset_parameter_counts_match_the_published_models(name, published):
    assert parameter_count(preset(name)) == published


def test_default_model_preset_matches_its_gguf_header():
    header, preset = model_facts("default"), model_facts("smollm2-135m")
    assert header.config.num_layers == preset.config.num_layers == 30
    assert (header.config.num_kv_heads, header.config.head_dim) == (3, 64)
    assert header.parameters == preset.parameters
    assert header.weights_label.startswith("Q4_1")


def test_largest_context_is_the_last_token_count_that_fits():
    layout = kv_layout(preset("smollm2-135m"), cache_for("int4"), "fp32", "cpu")
    budget = 37 * MIB
    n = largest_context(layout, budget)
    assert layout.sequence_bytes(n) <= budget < layout.sequence_bytes(n + 1)
    n2 = largest_context(layout, budget, batch=3)
    assert 3 * layout.sequence_bytes(n2) <= budget < 3 * layout.sequence_bytes(n2 + 1)


def test_window_bounds_memory_unless_even_the_window_does_not_fit():
    layout = kv_layout(preset("smollm2-135m"), cache_for("fp16", window=256, sinks=4), "fp32", "cpu")
    assert largest_context(layout, 64 * MIB, 256, 4) is None
    peak = max(layout.sequence_bytes(n, 256, 4) for n in range(1, 600))
    tight = largest_context(layout, peak - 1, 256, 4)
    assert tight is not None
    assert all(layout.sequence_bytes(n, 256, 4) <= peak - 1 for n in range(1, tight + 1))
    assert layout.sequence_bytes(tight + 1, 256, 4) > peak - 1


def test_memory_beside_weights_and_margin_bounds_the_context():
    facts = model_facts("llama-3.1-8b", "Q4_K")
    e = estimate(facts, 8192, formats=("fp16", "int4"), memory_bytes=8 * GIB, device="cpu")
    assert e.kv_room_bytes == 8 * GIB - facts.weight_bytes - e.margin_bytes
    fp16, int4 = e.rows
    assert fp16.bytes_per_token == 131_072
    assert int4.max_context > 2.5 * fp16.max_context
    layout = kv_layout(facts.config, cache_for("int4"), "fp32", "cpu")
    assert int4.max_context == largest_context(layout, e.kv_room_bytes)
    assert fp16.fits == (fp16.kv_bytes <= e.kv_room_bytes)


def test_cli_json_and_table(capsys):
    assert cli_main(["estimate", "--model", "llama-2-7b", "--context", "2048", "--format", "fp16,int4/int8",
                     "--memory-gb", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["format"] for r in out["rows"]] == ["fp16", "int4/int8"]
    assert out["rows"][0]["kv_bytes"] == 2**30 and out["memory_bytes"] == 16 * GIB
    assert cli_main(["estimate", "--model", "mistral-7b-v0.3", "--context", "32768", "--memory-gb", "24"]) == 0
    table = capsys.readouterr().out
    assert all(f in table for f in FORMATS) and "largest context" in table


def test_cli_bad_input_says_what_to_do(capsys, tmp_path):
    assert cli_main(["estimate", "--model", str(tmp_path / "nope.gguf"), "--context", "10"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["estimate", "--model", "llama-2-7b", "--context", "10", "--format", "int3"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert cli_main(["estimate", "--model", "llama-2-7b", "--context", "10", "--fp-layers", "99"]) == 2
    assert "do not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        estimate(model_facts("llama-2-7b"), 0, memory_bytes=GIB)


def test_hf_folder_reads_config_and_safetensors_headers(tiny_llama):
    facts = model_facts(tiny_llama)
    assert facts.source == "safetensors"
    assert facts.parameters == parameter_count(facts.config)
    assert facts.weights_label == "f32"


# --- the estimate is what the engine holds, to the byte ------------------------------------------------

EQUALITY_FORMATS = (*FORMATS, "int4/int8", "auto")
BLOCK_SIZES = (1, 5, 16)
WINDOWS = (None, 32)
TOKENS = (45, 100)


def _cases():
    for fmt, bs, window, n in itertools.product(EQUALITY_FORMATS, BLOCK_SIZES, WINDOWS, TOKENS):
        yield pytest.param(fmt, bs, window, n, id=f"{fmt}-bs{bs}-w{window}-n{n}")


@pytest.mark.parametrize("fmt, block_size, window, num_tokens", list(_cases()))
def test_estimate_equals_engine_bytes(tiny_engine, tiny_llama, fmt, block_size, window, num_tokens):
    from tiny_models import random_ids
    session = tiny_engine.new_session(cache=cache_for(fmt, block_size, window, sinks=4))
    session.append(random_ids(tiny_engine, num_tokens))
    row = estimate(model_facts(tiny_llama), num_tokens, formats=(fmt,), block_size=block_size, window=window,
                   sinks=4, memory_bytes=GIB, device=str(tiny_engine.device)).rows[0]
    assert row.kv_bytes == session.stats().kv_bytes


# --- one planner: the estimate, the loader's fit check and the loaded weights agree -------------------------

def _fit_check_agrees(monkeypatch, facts, stored_dtype=""):
    from kvchat.engine.errors import ModelLoadError
    from kvchat.engine.plan import fit
    plenty = estimate(facts, 1, formats=("int8",), memory_bytes=64 * GIB, device="cpu")
    assert plenty.margin_bytes == fit.margin_for(64 * GIB) == fit.RUNTIME_BYTES + int(fit.FREE_SHARE * 64 * GIB)
    assert plenty.weight_bytes + plenty.margin_bytes == fit.load_need(
        facts.config, facts.weight_bytes, "auto", "cpu", 64 * GIB, source=facts.source, stored_dtype=stored_dtype)
    # memory just short of the weights and the reserve: the estimate leaves no room and the loader refuses
    short = plenty.weight_bytes + fit.RUNTIME_BYTES
    starved = estimate(facts, 1, formats=("int8",), memory_bytes=short, device="cpu")
    assert starved.kv_room_bytes == 0 and not starved.rows[0].fits
    checks = {}
    for memory in (short, 64 * GIB):
        monkeypatch.setattr(fit, "available_bytes", lambda device, memory=memory: memory)
        try:
            fit.check_fits(facts.config, facts.weight_bytes, "auto", "cpu", facts.name, source=facts.source,
                           stored_dtype=stored_dtype)
            checks[memory] = True
        except ModelLoadError:
            checks[memory] = False
    assert checks == {short: False, 64 * GIB: True}


def test_estimate_and_fit_check_agree_for_the_default_model(monkeypatch):
    facts = model_facts("default")
    assert estimate(facts, 1, formats=("int8",), memory_bytes=GIB, device="cpu").weight_bytes == facts.weight_bytes
    _fit_check_agrees(monkeypatch, facts)


def test_estimate_and_fit_check_agree_for_a_folder_and_hold_what_the_engine_loads(monkeypatch, tiny_engine,
                                                                                     tiny_llama):
    facts = model_facts(tiny_llama)
    _fit_check_agrees(monkeypatch, facts, facts.weights_label)
    # an f32 folder on the CPU is held at 4 B a weight, as the engine holds it
    e = estimate(facts, 1, formats=("int8",), memory_bytes=GIB, device="cpu")
    assert e.weight_bytes == 4 * facts.parameters == tiny_engine.weight_bytes


def test_fit_check_knows_what_each_weights_choice_holds():
    from kvchat.engine.plan.fit import resident_bytes
    mc = preset("smollm2-135m")
    params, packed = parameter_count(mc), 80 * MIB
    assert resident_bytes(mc, packed, "auto", "cpu") == packed                   # a GGUF kept packed
    assert resident_bytes(mc, packed, "dense", "cpu") == 4 * params              # fp32 reference
    assert resident_bytes(mc, packed, "auto", "cuda", packed=True) == packed     # packed for the Triton kernels
    assert resident_bytes(mc, packed, "auto", "cuda", packed=False) == 2 * params  # bf16 on a GPU without them
    assert resident_bytes(mc, packed, "int8", "cpu") == params
    assert resident_bytes(mc, 2 * params, "auto", "cpu", source="safetensors", stored_dtype="bf16") == 2 * params
    assert resident_bytes(mc, 4 * params, "auto", "cpu", "bf16", "safetensors", "f32") == 2 * params
