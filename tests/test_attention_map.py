"""session.attention(): the attention mass the kernels measured, per (layer, head, block) or per token, against
transformers' eager attention probabilities on the same tokens (a full cache, and window + sinks, whose kept tokens
attend as transformers over those tokens alone); every layer kind; the cache's own rules (reset, a live switch)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig
from kvchat.engine.config import ConfigError
from tiny_models import random_ids, tiny_family_dir

FP32 = dict(k_format="fp32", v_format="fp32")


def eager_rows(model, ids: list[int]) -> np.ndarray:
    """transformers' eager attention probabilities of the last token over ids: [layers, heads, len(ids)]."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return np.stack([a[0, :, -1].numpy() for a in out.attentions])


def eager_after_slide(model, ids: list[int], kept: np.ndarray, sinks: int) -> np.ndarray:
    """transformers' eager probabilities of the last token when ids[:-1] were read whole and the cache then kept only
    the positions `kept` (the last token's own among them), the first `sinks` seeing the query at its in-cache
    position (kvchat's window + sinks: their keys turned on by the positions that left) -> per layer [heads, keys]
    (a sliding layer's keys: its own window)."""
    model.set_attn_implementation("eager")
    n = len(ids) - 1
    keep = torch.tensor([k for k in kept if k < n])
    delta = n - len(keep)
    with torch.no_grad():
        past = model(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        types = getattr(model.config, "layer_types", None)
        for i, layer in enumerate(past.layers):
            if types and types[i] == "sliding_attention":      # its own rolling window, as the cache's layer
                continue
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            extra = (types[i],) if types else ()
            cos, sin = model.model.rotary_emb(layer.keys, torch.tensor([[delta]]), *extra)
            k = layer.keys[:, :, :sinks]
            half = k.shape[-1] // 2
            turned = torch.cat((-k[..., half:], k[..., :half]), -1)
            layer.keys[:, :, :sinks] = k * cos[:, None] + turned * sin[:, None]
        out = model(torch.tensor([ids[-1:]]), past_key_values=past, position_ids=torch.tensor([[n]]),
                    output_attentions=True)
    return [a[0, :, -1].numpy() for a in out.attentions]


def read(session, ids: list[int], decodes: list[int]) -> None:
    """A prompt, then one-token decode steps (the decode kernels)."""
    session.append(ids)
    for t in decodes:
        session.append([t])


def check_rows_sum_to_one(m) -> None:
    total = m.mass.sum(-1) + m.sink_mass
    assert np.abs(total[m.attends] - 1).max() < 1e-5
    assert not m.mass[~m.attends].any()


@pytest.mark.parametrize("window", [None, 48])
def test_dense_mass_is_transformers_eager_attention_on_the_default_model(default_engine, hf_default, window):
    """SmolLM2, fp32 cache: the newest token's per-token mass equals transformers' eager probabilities within 1e-4,
    after 70 prompt tokens and 6 decodes; under window 48 + 4 sinks, after a 75-token prompt and the one decode
    that slides the window (transformers' cache cut to the kept positions, the sinks at the query's in-cache
    distance)."""
    cache = CacheConfig(**FP32) if window is None else CacheConfig(**FP32, window=window, sinks=4)
    s = default_engine.new_session(cache=cache)
    s.watch_attention("dense")
    ids = random_ids(default_engine, 76, seed=3)
    cut = 70 if window is None else 75
    read(s, ids[:cut], ids[cut:])
    m = s.attention(weights="dense")
    check_rows_sum_to_one(m)
    assert m.mass.shape == (30, 9, 76) and m.block_size == 1 and m.tokens == tuple(ids)
    kept = np.flatnonzero(m.held.any(0))
    if window is None:
        assert len(kept) == 76
        want = eager_rows(hf_default, ids)
    else:
        assert 4 + window <= len(kept) < 76 and list(kept[:4]) == [0, 1, 2, 3] and kept[4] > 4
        want = np.stack(eager_after_slide(hf_default, ids, kept, 4))
    assert np.abs(m.mass[:, :, kept] - want).max() < 1e-4
    assert not np.delete(m.mass, kept, axis=2).any()          # nothing on what left
    s.close()


def test_blocks_sum_the_dense_tokens_and_prompt_rows_are_observed(default_engine, hf_default):
    """Per block, the sum of the per-token mass; the prompt's map: the mean of its last 32 rows' probabilities."""
    ids = random_ids(default_engine, 60, seed=4)
    dense = default_engine.new_session(cache=CacheConfig(**FP32))
    dense.watch_attention("dense")
    dense.append(ids)
    per_block = dense.attention(weights="blocks")
    blocks = default_engine.new_session(cache=CacheConfig(**FP32))
    blocks.watch_attention()
    blocks.append(ids)
    m = blocks.attention()
    assert m.mass.shape == (30, 9, 4) and list(m.block_positions) == [0, 16, 32, 48]
    assert np.abs(m.mass - per_block.mass).max() < 1e-5
    assert np.abs(m.mass[..., 0] - dense.attention(weights="dense").mass[..., :16].sum(-1)).max() < 1e-5
    hf_default.set_attn_implementation("eager")
    with torch.no_grad():
        att = hf_default(torch.tensor([ids]), output_attentions=True).attentions
    window = np.stack([a[0, :, -32:].mean(1).numpy() for a in att])        # [layers, heads, 60]
    prompt = dense.attention(over="prompt", weights="dense")
    assert prompt.rows == 32 and np.abs(prompt.mass - window).max() < 1e-4
    with pytest.raises(ConfigError, match="watch_attention"):
        blocks.attention(weights="dense")
    for s in (dense, blocks):
        s.close()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tiny_family_dir(tmp_path_factory.mktemp("gemma3"), "gemma3")
    return folder, Engine.load(EngineConfig(model=folder))


@pytest.mark.parametrize("window", [None, 24])
def test_dense_mass_is_transformers_eager_attention_on_a_gemma3_hybrid(gemma3, window):
    """Five sliding layers (window 16) and a global one: a sliding layer holds and weighs only its window; the
    probabilities are transformers' eager ones, with the cache's window + sinks too."""
    from transformers import AutoModelForCausalLM
    folder, engine = gemma3
    cache = CacheConfig(**FP32) if window is None else CacheConfig(**FP32, window=window, sinks=4)
    s = engine.new_session(cache=cache)
    s.watch_attention("dense")
    ids = random_ids(engine, 50, seed=5)
    read(s, ids[:45] if window is None else ids[:49], ids[45:] if window is None else ids[49:])
    m = s.attention(weights="dense")
    check_rows_sum_to_one(m)
    assert m.layer_windows == (16,) * 5 + (None,)
    assert m.held[:5].sum(-1).tolist() == [16] * 5 and m.held[0, -16:].all()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if window is None:
        assert m.held[5].all()
        want = eager_rows(model, ids)
        assert np.abs(m.mass - want).max() < 1e-4
        return s.close()
    kept = np.flatnonzero(m.held[5])
    assert 4 + window <= len(kept) < 50
    want = eager_after_slide(model, ids, kept, 4)
    assert np.abs(m.mass[5][:, kept] - want[5]).max() < 1e-4           # the global layer over what it kept
    assert np.abs(m.mass[:5][..., -16:] - np.stack(want[:5])).max() < 1e-4     # the sliding layers: their window
    s.close()


def test_every_layer_kind_reports_mass(tmp_path):
    """Gemma 4 (layers over another layer's KV), Qwen3.5 (linear-attention layers attend to nothing, said so) and
    gpt-oss (learned sinks: their share apart, each row with it summing to 1) in blocks, int8 pages too."""
    for family in ("gemma4", "qwen3_5", "gpt_oss"):
        engine = Engine.load(EngineConfig(model=tiny_family_dir(tmp_path / family, family)))
        for cache in (CacheConfig(), CacheConfig(k_format="int8", v_format="int8")):
            s = engine.new_session(cache=cache)
            s.watch_attention()
            ids = random_ids(engine, 40, seed=6)
            read(s, ids[:36], ids[36:])
            m = s.attention()
            check_rows_sum_to_one(m)
            if family == "qwen3_5":
                assert m.attends.tolist() == [False, True] * 2
            else:
                assert m.attends.all()
            assert m.sink_mass.all() if family == "gpt_oss" else not m.sink_mass.any()
            s.close()


def test_learned_sinks_take_their_share_apart(tmp_path):
    """gpt-oss (sliding and full layers, learned sink logits): the per-token mass is transformers' eager
    probabilities (the sink's column dropped), the sink's share the rest."""
    from transformers import AutoModelForCausalLM
    folder = tiny_family_dir(tmp_path, "gpt_oss")
    engine = Engine.load(EngineConfig(model=folder))
    s = engine.new_session(cache=CacheConfig(**FP32))
    s.watch_attention("dense")
    ids = random_ids(engine, 30, seed=12)
    read(s, ids[:26], ids[26:])
    m = s.attention(weights="dense")
    want = eager_rows(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), ids)
    assert np.abs(m.mass - want).max() < 1e-4
    assert np.abs(m.sink_mass - (1 - want.sum(-1))).max() < 1e-4 and m.sink_mass.min() > 0
    s.close()


def test_quantized_pages_measure_what_full_precision_does(default_engine):
    """int8 pages (the C quantized kernel) put their mass where fp32 pages do, within quantization's reach."""
    ids = random_ids(default_engine, 80, seed=7)
    maps = []
    for cache in (CacheConfig(**FP32), CacheConfig(k_format="int8", v_format="int8")):
        s = default_engine.new_session(cache=cache)
        s.watch_attention()
        read(s, ids[:72], ids[72:])
        maps.append(s.attention())
        check_rows_sum_to_one(maps[-1])
        s.close()
    assert np.abs(maps[0].mass - maps[1].mass).max() < 0.05


def test_the_one_call_decode_step_measures_as_the_layer_by_layer_path():
    """The packed default model decodes in one C call (decode_layers); its mass equals the per-layer kernels'."""
    engine = Engine.load(EngineConfig(model="default"))
    ids = random_ids(engine, 40, seed=8)
    maps = []
    for fused in (True, False):
        if not fused:
            engine.model.kernel_layers = lambda: None      # the one-call step declines: layers one by one
        s = engine.new_session()
        s.watch_attention()
        steps = engine.runner.steps
        read(s, ids[:34], ids[34:])
        assert engine.runner.steps == steps + 7
        maps.append(s.attention())
        s.close()
    assert np.array_equal(maps[0].mass, maps[1].mass)


def test_the_log_follows_the_conversation(default_engine):
    """Not watched: None, nothing measured. A reset forgets; a live switch keeps watching; stopping frees."""
    s = default_engine.new_session()
    s.append(random_ids(default_engine, 20))
    assert s.attention() is None
    s.watch_attention()
    assert s.attention() is None                   # nothing read since
    s.append(random_ids(default_engine, 3, seed=1))
    assert s.attention().mass.shape[-1] == 2
    s.reset()
    assert s.attention() is None
    s.append(random_ids(default_engine, 20, seed=2))
    s.set_cache(CacheConfig(k_format="int8", v_format="int8"))
    s.append([5])
    assert s.attention().tokens[-1] == 5
    over = s.attention(over="reply")
    assert over.rows == 1
    s.watch_attention(None)
    assert s.attention() is None and default_engine.runner.cache.attention_log(s.seq) is None
    with pytest.raises(ConfigError):
        s.watch_attention("sparse")
    s.close()


def test_a_long_map_is_bucketed(default_engine):
    """Past max_columns the columns are summed in runs: rows still sum to 1, positions ascend from 0."""
    s = default_engine.new_session()
    s.watch_attention()
    s.append(random_ids(default_engine, 300, seed=9))
    m = s.attention(max_columns=5)
    assert m.num_columns == 5 and m.block_positions[0] == 0 and (np.diff(m.block_positions) > 0).all()
    check_rows_sum_to_one(m)
    assert m.column_of(299) == 4
    s.close()


def test_speculation_measures_what_plain_decoding_does(default_engine):
    """Prompt lookup verifies drafts several rows a step and takes the rejected back: the newest token's map and the
    reply's are plain decoding's."""
    from kvchat.engine import SamplingParams
    from kvchat.engine.config import SpeculativeConfig
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3
    maps = {}
    try:
        for method in ("off", "lookup"):
            default_engine.set_speculative(SpeculativeConfig(method))
            s = default_engine.new_session(cache=CacheConfig(**FP32))
            s.watch_attention()
            s.reply(text, SamplingParams(temperature=0.0, max_new_tokens=30))
            maps[method] = (s.token_ids[:], s.attention(), s.attention(over="reply"), s.stats().spec)
            s.close()
    finally:
        default_engine.set_speculative(SpeculativeConfig("off"))
    (ids, newest, reply, _), (ids2, newest2, reply2, spec) = maps["off"], maps["lookup"]
    assert spec.accepted > 5 and ids == ids2 and reply.rows == reply2.rows
    assert np.abs(newest.mass - newest2.mass).max() < 1e-5 and np.abs(reply.mass - reply2.mass).max() < 1e-5


def test_choosing_another_reply_forgets_what_the_last_one_measured(default_engine):
    """Regenerate, then select the first reply again: the map is not the other branch's; the next step measures."""
    from kvchat.engine import SamplingParams
    s = default_engine.new_session()
    s.watch_attention()
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    s.reply("Hello there", params)
    for _ in s.regenerate(SamplingParams(temperature=1.0, max_new_tokens=5, seed=4)):
        pass
    s.select_alternative(0)
    assert s.attention() is None
    s.append([7])
    m = s.attention()
    assert m.tokens == tuple(s.token_ids) and m.mass.shape[-1] == -(-len(s.token_ids) // 16)
    assert default_engine.runner.cache.attention_log(s.alternatives[0].seq) is None      # one log, one conversation
    s.close()
