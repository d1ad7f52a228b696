"""Gemma 4 (issue 40, part two): layers of two head sizes, a proportional partial rope on the global ones, the last
layers reading earlier layers' KV, per-layer input embeddings, a learned output scale per layer and (26B-A4B)
routed experts beside the dense MLP, from
transformers' own Gemma4TextConfig (tests/tiny_models.py: sliding layers of head 16 over a window of 8, global ones
of head 32, twice; layer 4 (sliding) reads the KV of layer 3 right before it, layer 5 (global) that of layer 2).

A layer that shares another's KV holds no bytes (the cache keeps only the layers with their own), and reads its
source's pages in every format without writing them. Each check fails when the thing it names is broken: a shared
layer that attends its own (absent) keys reads zeros, a global layer at the sliding head size does not load, a
proportional rope at the rotated part's exponents moves the logits past the bound."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.kv.layout import conversation_bytes
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.source import locate, transformers_reference
from kvchat.engine.model.spec import Rope
from kvchat.engine.runtime.warm import WarmStore
from tiny_models import read_chunks, tiny_family_dir

FP32 = CacheConfig(k_format="fp32", v_format="fp32")
IDS = torch.randint(3, 320, (60,), generator=torch.Generator().manual_seed(4)).tolist()
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
# keys are values on the global layers (one KV head there, at head 32), and the shared layers' MLP twice as wide
K_EQ_V = dict(attention_k_eq_v=True, num_global_key_value_heads=1, use_double_wide_mlp=True)
# the 26B-A4B's kind: 4 experts (2 used, GELU) beside every layer's dense MLP, each normed, a scaled router
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
VARIANTS = {"plain": {}, "k_eq_v": K_EQ_V, "moe": MOE}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    folder = tiny_family_dir(tmp_path_factory.mktemp(request.param), "gemma4", **VARIANTS[request.param])
    return folder, transformers_reference(locate(folder), torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model):
    return Engine.load(EngineConfig(model=model[0], weights="dense"))


def read(engine, seq, ids, sizes=(20, 1, 1, 9, 1)):
    """tiny_models.read_chunks: prompt chunks past the window, and one-token steps."""
    return read_chunks(engine, seq, ids, sizes)


def want(model) -> torch.Tensor:
    with torch.no_grad():
        return model[1](torch.tensor([IDS])).logits[0].float()


def test_logits_equal_transformers_through_chunks_and_steps(model, engine):
    """fp32 within 1e-3 of transformers' largest logit, prompt chunks and single decode steps alike."""
    ref = want(model)
    s = engine.new_session(cache=FP32)
    got = read(engine, s.seq, IDS)
    assert float((got - ref).abs().max()) <= 1e-3 * float(ref.abs().max())
    engine.runner.cache.check()
    s.close()


def test_the_description_reads_the_config(model, engine):
    c = engine.model.config
    assert c.kv_sources == {4: 3, 5: 2} and c.attention_layers == (0, 1, 2, 3)
    assert [c.layer_head_dim(i) for i in range(6)] == [16, 16, 32, 16, 16, 32]
    assert c.per_layer_input == 8 and c.layers[0].query_scale == 1.0 and c.layers[0].norm_offset == 0.0
    k_eq_v = c.layers[2].value_from_key
    assert c.layer_kv_heads(2) == (1 if k_eq_v else 2) and c.layer_kv_heads(0) == 2
    # proportional: a quarter of the global head's 16 pairs turn, at theta ** (-2i / 32), the rest stand still
    table = c.rope_frequencies(2)
    assert table.shape == (16,) and (table[4:] == 0).all()
    assert table[1] == pytest.approx(1e6 ** (-2 / 32), rel=1e-6)
    assert Rope(1e6, ("proportional", 0.25)).table(32).tolist() == table.tolist()


def test_shared_layers_hold_no_bytes(model, engine):
    """Layers 4 and 5 read layers 3 and 2: they hold nothing, the global layers hold twice a sliding layer's bytes
    per token (before the window), and the forecast is what the cache holds."""
    s = engine.new_session(cache=FP32)
    s.append(IDS[:16])
    per_layer = engine.runner.layer_bytes(s.seq)
    assert per_layer[4] == per_layer[5] == (0, 0)
    bs, kv_heads = FP32.block_size, engine.model.config.layer_kv_heads(2)
    assert per_layer[3] == (bs * 2 * 16 * 4,) * 2 and per_layer[2] == (bs * kv_heads * 32 * 4,) * 2
    assert engine.runner.conversation_bytes(s.seq) == conversation_bytes(engine.model.config, FP32, 16)
    stats = s.stats()
    assert [layer.kv_source for layer in stats.layers] == [None, None, None, None, 3, 2]
    s.close()


@pytest.mark.parametrize("cache", [CacheConfig(), CacheConfig(k_format="int8", v_format="int8"),
                                   CacheConfig(k_format="int4", v_format="int4", window=24, sinks=4)],
                         ids=["bf16", "int8", "int4-window"])
def test_every_page_format_reads_the_shared_layers(model, engine, cache):
    """The shared layers read their sources' pages in every format (rotated full pages, quantized pages rotated as
    read, a window with sinks): the logits stay near fp32's (transformers', or the same window's in fp32), and a
    shared layer reading zeros instead would not."""
    if engine.model.config.layers[0].experts is not None:
        pytest.skip("random routers flip experts on near ties: a format's small error is not bounded through them")
    if cache.window is None:
        ref = want(model)
    else:
        s = engine.new_session(cache=FP32.with_(window=cache.window, sinks=cache.sinks))
        ref = read(engine, s.seq, IDS)
        s.close()
    s = engine.new_session(cache=cache)
    got = read(engine, s.seq, IDS)
    err = float((got - ref).abs().max()) / float(ref.abs().max())
    assert err < (0.15 if cache.k_format == "int4" else 0.05), err
    engine.runner.cache.check()
    s.close()


def test_a_reply_regenerates_and_restores_the_same(engine, tmp_path):
    """Greedy replies equal after regenerate, and after a saved cache is read back into a new session."""
    engine._warm_store = WarmStore(tmp_path / "kv")
    try:
        s = engine.new_session(cache=FP32)
        first = s.reply("Hello there, how are you?", GREEDY)
        again = list(s.regenerate(GREEDY))[-1].text
        assert again == first
        engine.keep_warm(s, "m")
        assert engine.save_warm(s) > 0
        s2 = engine.new_session(cache=FP32, history=list(s.messages))
        engine.keep_warm(s2, "m")
        engine.restore_warm(s2)
        assert s2.seq.num_tokens == s.seq.num_tokens
        assert s2.reply("And then?", GREEDY) == s.reply("And then?", GREEDY)
        for x in (s, s2):
            x.close()
    finally:
        engine._warm_store = None


def test_the_published_multimodal_folder_and_bad_settings(model, tmp_path):
    """Gemma 4's checkpoints are multimodal (model_type gemma4, text_config, model.language_model.* beside the
    vision and audio towers): read as the language model. Settings that cannot hold are one-line errors."""
    from safetensors.torch import load_file, save_file
    folder = Path(model[0])
    text = json.loads((folder / "config.json").read_text())
    out = tmp_path / "mm"
    shutil.copytree(folder, out)
    (out / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text}))
    state = load_file(str(folder / "model.safetensors"))
    moved = {"model.language_model." + k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    moved["model.vision_tower.patch.weight"] = torch.zeros(2, 2)
    (out / "model.safetensors").unlink()
    save_file(moved, str(out / "model.safetensors"))
    e = Engine.load(EngineConfig(model=str(out), weights="dense"))
    s = e.new_session(cache=FP32)
    assert torch.allclose(s.append(IDS[:20])[-1], want(model)[19], atol=1e-3 * float(want(model).abs().max()))
    s.close()
    for bad, match in (({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),
                       ({"num_kv_shared_layers": 5}, "earlier layer of its kind"),
                       ({"per_layer_config": {"2": {"head_dim": 33}}}, "head_dim"),
                       ({"rope_parameters": {**text["rope_parameters"], "full_attention": {
                           "rope_type": "proportional", "partial_rotary_factor": 2.0, "rope_theta": 1e6}}},
                        "partial_rotary_factor"),
                       ({**MOE, "top_k_experts": 5}, "only 4 experts")):
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_hf({**text, **bad})


@pytest.mark.parametrize("cache", [FP32, CacheConfig(k_format="int8", v_format="int8")], ids=["fp32", "int8"])
def test_the_c_decode_read_of_a_shared_layer_is_the_stored_read(model, engine, cache, monkeypatch):
    """A shared layer's one-token decode goes through the C attention of its source's pages (full pages: given the
    source's k and v, which it writes again unchanged; quantized pages: read in place, the new row the source's
    own); each step's logits equal those of the same step with every shared read in torch (attend_stored), across
    block boundaries."""
    from kvchat.engine.runtime import backends
    if engine.model.config.layers[0].experts is not None or engine.model.config.layers[2].value_from_key:
        pytest.skip("the plain variant covers the read; the others add nothing to it")
    s, t = engine.new_session(cache=cache), engine.new_session(cache=cache)
    s.append(IDS[:14])
    t.append(IDS[:14])
    kinds = backends.FullPagesC, backends.QuantPagesC
    for tok in IDS[14:35]:                  # across the block boundary at 16 and 32
        fast = s.append([tok])
        monkeypatch.setattr(backends, "FullPagesC", type("Off", (), {}))     # no backend is one: torch reads
        monkeypatch.setattr(backends, "QuantPagesC", type("Off", (), {}))
        slow = t.append([tok])
        monkeypatch.setattr(backends, "FullPagesC", kinds[0])
        monkeypatch.setattr(backends, "QuantPagesC", kinds[1])
        assert torch.allclose(fast, slow, atol=1e-4, rtol=0), float((fast - slow).abs().max())
    s.close()
    t.close()


def test_full_precision_for_a_layer_without_kv_names_its_source(engine):
    from kvchat.engine.config import ConfigError
    with pytest.raises(ConfigError, match="layer 4 reads layer 3's K and V"):
        engine.new_session(cache=CacheConfig(k_format="int8", v_format="int8", full_precision_layers=(4,)))


def test_the_planner_counts_every_parameter(model, engine):
    """plan.fit counts what transformers holds: both head sizes, no k / v in the shared layers, the per-layer
    embeddings, each layer's scalar, experts beside the dense MLP."""
    from kvchat.engine.plan.fit import parameter_counts
    ref = model[1]
    held = sum(p.numel() for p in ref.parameters()) + sum(
        b.numel() for name, b in ref.named_buffers() if name.endswith("layer_scalar"))
    assert parameter_counts(engine.model.config)[0] == held


def test_the_e4b_estimate_counts_only_the_layers_holding_kv():
    """gemma-4-e4b: 7.46 B parameters (llama.cpp says the same of the file), 24 layers with their own KV of which 4
    global; a token adds 4 layers x 2 (K, V) x 2 heads x 512 x 2 bytes in bf16 once the windows are full."""
    from kvchat.engine.plan.estimate import estimate, summarize
    from kvchat.engine.plan.estimate import model_facts
    e = estimate(model_facts("gemma-4-e4b"), context=8192, formats=("bf16",), memory_bytes=64 << 30)
    assert round(e.parameters / 1e9, 2) == 7.46 and e.shared_kv_layers == 18
    assert dict(e.layer_windows) == {512: 20, None: 4} and e.other_heads == ((2, 512),)
    assert e.rows[0].bytes_per_token == 4 * 2 * 2 * 512 * 2
    assert "20 sliding 512 + 4 global + 18 sharing KV" in summarize(e)
