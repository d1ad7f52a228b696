"""Keep what matters, fetch what is needed (issue 42): importance eviction (CacheConfig.eviction="importance") and
query-aware retrieval (CacheConfig.retrieval_blocks), on tiny random-weight models through the real engine."""
from __future__ import annotations

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.config import ConfigError
from kvchat.engine.kv import importance
from kvchat.engine.kv.attention_log import AttentionLog
from kvchat.engine.kv.layout import kv_layout
from kvchat.engine.model.rope import rotate
from kvchat.engine.runtime import speculative
from kvchat.engine.runtime.retrieval import BlockChooser
from misguided import Misguided
from tiny_models import tiny_family_dir

FP32 = dict(k_format="fp32", v_format="fp32")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)


def ids_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 200, (n,), generator=g).tolist()


def feed(session, ids: list[int]) -> torch.Tensor:
    """The prompt, then its last 24 tokens one at a time (decode steps); the last logits."""
    session.append(ids[:-24])
    for t in ids[-24:]:
        out = session.append([t])
    return out[-1]


# ---- settings ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(eviction="importance"), "give a window"),
    (dict(eviction="importance", window=32), "too small"),
    (dict(eviction="oldest", window=64), "choose 'window'"),
    (dict(retrieval_blocks=0), "whole number from 1"),
    (dict(retrieval_blocks=2.5), "whole number from 1"),
    (dict(retrieval_blocks=8, window=256), "takes no window"),
    (dict(retrieval_blocks=8, overflow="slide"), "overflow='stop'"),
])
def test_impossible_settings_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ConfigError) as err:
        CacheConfig(**kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_labels_and_summary_bytes_are_counted(tiny_engine):
    assert "by attention" in CacheConfig(window=64, eviction="importance").label()
    assert "reading 8 blocks" in CacheConfig(retrieval_blocks=8).label()
    model = tiny_engine.runner.model.config
    plain, fetched = kv_layout(model, CacheConfig()), kv_layout(model, CacheConfig(retrieval_blocks=8))
    # bf16 max and min per KV head and channel, every layer, in every block's bytes
    assert fetched.block_bytes - plain.block_bytes == model.num_layers * 2 * model.num_kv_heads * model.head_dim * 2
    s = tiny_engine.new_session(cache=CacheConfig(retrieval_blocks=2))
    s.append(ids_of(100))
    assert tiny_engine.runner.cache.held_bytes >= 7 * fetched.block_bytes
    tiny_engine.runner.cache.check()
    s.close()


# ---- importance ----------------------------------------------------------------------------------------------------

def test_choose_keeps_sinks_newest_and_the_most_attended():
    table = list(range(10))
    scores = torch.tensor([9, 0.5, 0.1, 0.9, 0.2, 0.3, 0.0, 0.8, 0.0, 0.0])
    assert importance.choose(table, 1, 2, 3, scores) == [2, 4, 6]
    assert importance.choose(table, 1, 2, 3, None) == [1, 2, 3]           # nothing measured: the oldest
    table[2] = None
    assert importance.choose(table, 1, 2, 2, scores) == [4, 6]            # a block already gone is not chosen


def test_block_scores_take_the_best_head_of_the_groups_layers():
    log = AttentionLog(num_layers=2, num_heads=2, block_size=4, weights="dense")
    rows, _ = log.begin(0, 1, 12, True, 0)             # one decode row over 12 tokens: 3 blocks, then the sink
    rows[0, 0, 0, :12] = torch.tensor([.1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, .0])
    rows[0, 1, 1, 5] = 0.7                             # layer 1, head 1 needs block 1
    scores = importance.block_scores(log, (), 3, 12)
    assert torch.allclose(scores, torch.tensor([.1, .7, 0]))
    assert torch.allclose(importance.block_scores(log, (0,), 3, 12), torch.tensor([.1, 0, 0]))


def test_a_block_the_reply_wrote_is_judged_by_the_rows_that_saw_it():
    """Reply rows for tokens 2..5 over blocks of 4: block 0 is seen by all four rows, block 1 (opened at token 4) by
    the last two. A block's score is its mean over the rows that could see it; a mean over all rows would halve
    block 1's and let the reply's own newest text go first."""
    log = AttentionLog(num_layers=1, num_heads=1, block_size=4, weights="blocks")
    for t in range(2, 6):
        rows, _ = log.begin(t, 1, t + 1, True, t)
        rows[0, 0, 0, 0] = 1.0 if t < 4 else 0.5
        if t >= 4:
            rows[0, 0, 0, 1] = 0.5
    fair = importance.block_scores(log, (), 2, 6)
    assert fair[0] == pytest.approx(3.0 / 4)
    assert fair[1] == pytest.approx(1.0 / 2)
    plain, rows = log.over_reply(6)                    # the Attention page's mean row stays over all rows
    assert rows == 4 and plain[0, 0, 1] == pytest.approx(1.0 / 4)


def test_importance_holds_its_window_and_keeps_positions(tiny_engine):
    """Blocks leave by attention and the held tokens keep their positions: every logit equals a full cache from which
    the same blocks are dropped by hand after the same steps."""
    cfg = CacheConfig(window=64, sinks=4, eviction="importance", **FP32)
    s = tiny_engine.new_session(cache=cfg)
    ref = tiny_engine.new_session(cache=CacheConfig(**FP32))
    cache, ids = tiny_engine.runner.cache, ids_of(300)
    steps = [ids[i:i + 64] for i in range(0, 256, 64)] + [[t] for t in ids[256:]]
    for chunk in steps:
        got, want = s.append(chunk)[-1], ref.append(chunk)[-1]
        assert torch.allclose(got, want, atol=1e-5)
        for i, b in enumerate(s.seq.table):
            if b is None and ref.seq.table[i] is not None:
                cache.drop(ref.seq, i)
    seq = s.seq
    holes = [i for i, b in enumerate(seq.table) if b is None]
    assert seq.table[0] is not None and seq.table[-1] is not None and seq.table[-2] is not None
    assert len(seq.block_table) <= cfg.window // 16 + 2 and holes
    assert holes != list(range(1, 1 + len(holes))), "attention chose other blocks than the oldest"
    cache.check()
    for x in (s, ref):
        x.close()


def test_a_prompt_is_judged_once_it_is_read_whole(tiny_engine):
    """A prompt longer than the window is read in window-sized steps, and blocks leave only after its last one, by
    its last 32 rows (SnapKV: the question at the end chooses what the text keeps): the blocks dropped are exactly
    those the choice names over the whole prompt's table, scored from a full cache's window over the same prompt."""
    ids = ids_of(300, seed=21)
    s = tiny_engine.new_session(cache=CacheConfig(window=64, sinks=4, eviction="importance", **FP32),
                                prefix_cache=False)
    s.append(ids)
    ref = tiny_engine.new_session(cache=CacheConfig(**FP32), prefix_cache=False)
    ref.watch_attention("blocks")
    ref.append(ids)
    log = tiny_engine.runner.cache.attention_log(ref.seq)
    table = list(ref.seq.table)
    g = s.seq.geometry
    n = g.num_to_evict(300, 0, len(table))
    scores = importance.block_scores(log, (), len(table), 300)
    want = importance.choose(table, g.sink_blocks, g.newest_blocks, n, scores)
    assert [i for i, b in enumerate(s.seq.table) if b is None] == want
    s.close()
    ref.close()


def test_a_budget_short_of_the_whole_prompt_lets_blocks_go_as_it_reads(small_pool):
    """Where the budget cannot hold the prompt whole, blocks go by the scores so far as the prompt is read (the
    answer is as good as those scores), rather than the prompt being refused."""
    cfg = CacheConfig(window=64, sinks=4, eviction="importance", budget_mb=TIER_BUDGET_MB, **FP32)
    s = small_pool.new_session(cache=cfg, prefix_cache=False)
    assert torch.isfinite(s.append(ids_of(600, seed=22))[-1]).all()
    assert len(s.seq.block_table) <= s.seq.geometry.limit_blocks
    small_pool.runner.cache.check()
    s.close()


def test_importance_runs_every_format_and_survives_a_switch(tiny_engine):
    ids = ids_of(260, seed=1)
    for fmt in ("int8", "int4", "fp8"):
        s = tiny_engine.new_session(cache=CacheConfig(window=64, eviction="importance", k_format=fmt, v_format=fmt))
        assert torch.isfinite(feed(s, ids)).all()
        assert s.seq.evicted
        s.close()
    s = tiny_engine.new_session(cache=CacheConfig(window=64, eviction="importance", **FP32))
    feed(s, ids)
    held = [b is None for b in s.seq.table]
    with pytest.raises(ConfigError, match="sliding window cannot take it over"):
        s.set_cache(CacheConfig(window=64, **FP32))
    s.set_cache(CacheConfig(window=64, eviction="importance", k_format="int8", v_format="int8"))
    assert [b is None for b in s.seq.table] == held            # the blocks that left stay where they were
    s.set_cache(CacheConfig(**FP32))                            # no window: the held ones stay, nothing more goes
    assert torch.isfinite(s.append([7])[-1]).all()
    tiny_engine.runner.cache.check()
    s.close()


def test_importance_without_a_watch_measures_on_its_own(tiny_engine):
    s = tiny_engine.new_session(cache=CacheConfig(window=64, eviction="importance", **FP32))
    s.watch_attention(None)
    feed(s, ids_of(200, seed=2))
    assert s.seq.evicted and tiny_engine.runner.cache.attention_log(s.seq) is not None
    s.close()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return Engine.load(EngineConfig(model=tiny_family_dir(tmp_path_factory.mktemp("gemma3"), "gemma3",
                                                          sliding_window=32)))


def test_a_hybrid_models_sliding_layers_keep_their_rule(gemma3):
    s = gemma3.new_session(cache=CacheConfig(window=64, eviction="importance", **FP32))
    assert torch.isfinite(feed(s, ids_of(260, seed=3))).all()
    full, sliding = s.seq.members
    assert full.geometry.by_importance and not sliding.geometry.by_importance
    holes = [i for i, b in enumerate(sliding.table) if b is None]
    assert holes == list(range(len(holes))) and holes          # its own window: the oldest go
    gemma3.runner.cache.check()
    s.close()


@pytest.mark.parametrize("cache", [CacheConfig(window=64, eviction="importance", **FP32),
                                   CacheConfig(retrieval_blocks=2, **FP32)], ids=["importance", "retrieval"])
def test_speculation_equals_plain_decoding(tiny_engine, monkeypatch, cache):
    monkeypatch.setattr(speculative, "PromptLookup", Misguided)
    out = {}
    for name, spec in (("plain", SpeculativeConfig("off")),
                       ("spec", SpeculativeConfig("lookup", k=6, ngram_max=3, ngram_min=1, adaptive=False))):
        tiny_engine.set_speculative(spec)
        s = tiny_engine.new_session(cache=cache, prefix_cache=False)
        s.reply(tiny_engine.tokenizer.decode(ids_of(150, seed=4)), SamplingParams(temperature=0.0,
                                                                                  max_new_tokens=120))
        out[name] = (list(s.token_ids), [b is None for b in s.seq.table])
        s.close()
    tiny_engine.set_speculative(SpeculativeConfig("off"))
    assert out["spec"] == out["plain"]


# ---- retrieval -----------------------------------------------------------------------------------------------------

def test_quest_bound_is_an_upper_bound():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(20, 16, 2, 8, generator=g)             # 20 blocks of 16 keys, 2 KV heads, dim 8
    summary = torch.cat((keys.amax(1), keys.amin(1)), -1)     # [20, 2, 16]
    q = torch.randn(4, 8, generator=g)                        # 4 query heads: 2 per KV head
    signed = torch.cat((q.clamp(min=0), q.clamp(max=0)), -1).view(2, 2, 16)
    bound = torch.einsum("hgd,nhd->hgn", signed, summary)
    true = torch.einsum("hgd,nkhd->hgnk", q.view(2, 2, 8), keys).amax(-1)
    assert (bound >= true - 1e-5).all()
    rel = BlockChooser._bounds(summary, q)
    assert rel.shape == (20,) and float(rel.max()) == 0.0


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_retrieval_reading_every_block_is_exact_and_fewer_read_close(tiny_engine, fmt):
    ids = ids_of(300, seed=5)
    kv = dict(k_format=fmt, v_format=fmt)
    want = feed(tiny_engine.new_session(cache=CacheConfig(**kv)), ids)
    all_read = feed(tiny_engine.new_session(cache=CacheConfig(retrieval_blocks=64, **kv)), ids)
    assert torch.equal(all_read, want)
    s = tiny_engine.new_session(cache=CacheConfig(retrieval_blocks=4, **kv))
    few = feed(s, ids)
    chooser = tiny_engine.runner.last_chooser
    layers = tiny_engine.runner.model.config.num_layers
    assert chooser.held_blocks == 19 * layers and chooser.read_blocks == (1 + 4 + 2) * layers
    assert not torch.equal(few, want) and torch.isfinite(few).all()
    assert s.seq.evicted == 0                                   # every block stays
    tiny_engine.runner.cache.check()


def test_retrieval_reads_the_blocks_a_query_matches(tiny_engine):
    """Rows whose keys match the query best are the ones read: the chosen rows' attention mass is most of the full
    cache's (the mass the kernels measure)."""
    ids = ids_of(400, seed=6)
    s = tiny_engine.new_session(cache=CacheConfig(retrieval_blocks=6, **FP32))
    s.watch_attention("blocks")
    feed(s, ids)
    m = s.attention(over="newest")
    assert m is not None
    per_layer = m.mass[..., :-1].sum(-1)       # the mass on the blocks read, per layer and head: the rest is 0
    assert torch.all(torch.as_tensor(per_layer) > 0.5)
    s.close()


def test_cli_takes_the_options():
    import argparse

    from kvchat.cli.options import add_cache_arguments, cache_config
    p = argparse.ArgumentParser()
    add_cache_arguments(p)
    assert cache_config(p.parse_args(["--window", "512", "--eviction", "importance"])).eviction == "importance"
    assert cache_config(p.parse_args(["--retrieval-blocks", "64"])).retrieval_blocks == 64
    with pytest.raises(ConfigError, match="takes no window"):
        cache_config(p.parse_args(["--retrieval-blocks", "64", "--window", "512"]))
    # `kvchat chat --prompt` with either option takes the engine's path, which checks them (the torch-free one-shot
    # path has neither: it once answered --retrieval-blocks 0 and a window-less --eviction importance as if unasked)
    from kvchat.cli.terminal import build_parser
    from kvchat.engine.runtime import quick
    for extra in (["--retrieval-blocks", "0"], ["--eviction", "importance"], ["--retrieval-blocks", "8"]):
        assert not quick.covers(build_parser().parse_args(["chat", "--prompt", "hi", "--device", "cpu", *extra]))
    assert quick.covers(build_parser().parse_args(["chat", "--prompt", "hi", "--device", "cpu"]))


def choose_blocks_ref(q, cos, sin, summary, ids, k):
    """The torch reference of choose_blocks: (indices ascending, scores)."""
    hq, d = q.shape
    hkv = summary.shape[1]
    r = rotate(q.float()[None], cos[None].float(), sin[None].float())[0].view(hkv, hq // hkv, d)
    signed = torch.cat((r.clamp(min=0), r.clamp(max=0)), -1)
    bound = torch.bmm(signed, summary[ids].float().permute(1, 2, 0))
    scores = (bound - bound.amax(-1, keepdim=True)).flatten(0, 1).amax(0)
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:k]
    return torch.tensor(sorted(order)), scores


def test_the_c_choice_equals_its_torch_reference():
    from kvchat.kernels import cpu_quant
    from kvchat.engine.model.rope import rope_cos_sin
    if not cpu_quant.available():
        pytest.skip("no C kernels here")
    g = torch.Generator().manual_seed(1)
    for hq, hkv, d, n, k in ((9, 3, 64, 437, 64), (6, 2, 16, 20, 4), (8, 8, 128, 100, 99), (4, 1, 32, 3, 1)):
        q = torch.randn(hq, d, generator=g)
        cos, sin = rope_cos_sin(torch.tensor([1234]), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
        summary = torch.randn(n + 9, hkv, 2 * d, generator=g).bfloat16()
        ids = torch.randperm(n + 9, generator=g)[:n]
        out, scores = torch.empty(k, dtype=torch.int32), torch.empty(n)
        got = cpu_quant.choose_blocks(q, cos[0], sin[0], summary, ids, k, out, scores)
        want, want_scores = choose_blocks_ref(q, cos[0], sin[0], summary, ids, k)
        assert torch.equal(got.long(), want)
        assert torch.allclose(scores, want_scores, atol=1e-4)


def test_the_stats_show_what_a_token_read_and_the_summaries(tiny_engine):
    s = tiny_engine.new_session(cache=CacheConfig(retrieval_blocks=4, **FP32))
    feed(s, ids_of(300, seed=7))
    snap = s.stats()
    assert snap.blocks_read == (7, 19)
    assert snap.summary_bytes == tiny_engine.runner.layout(s.cache_config).summary_bytes * 19
    s.close()
    s = tiny_engine.new_session(cache=CacheConfig(**FP32))
    feed(s, ids_of(100, seed=7))
    assert s.stats().blocks_read == (0, 0) and s.stats().summary_bytes == 0
    s.close()


@pytest.mark.parametrize("cache", [CacheConfig(window=64, eviction="importance", **FP32),
                                   CacheConfig(window=64, eviction="importance", k_format="int8", v_format="int8"),
                                   CacheConfig(retrieval_blocks=3, **FP32)], ids=["importance", "importance-int8",
                                                                                 "retrieval"])
def test_a_saved_cache_reads_back_the_same(tiny_engine, tmp_path, cache):
    from kvchat.engine.runtime.warm import WarmStore
    tiny_engine._warm_store = WarmStore(tmp_path / "kv")
    try:
        s = tiny_engine.new_session(cache=cache)
        s.reply(tiny_engine.tokenizer.decode(ids_of(200, seed=8)), GREEDY)
        holes = [b is None for b in s.seq.table]
        assert any(holes) == (cache.window is not None)
        tiny_engine.keep_warm(s, "m")
        assert tiny_engine.save_warm(s) > 0
        s2 = tiny_engine.new_session(cache=cache, history=list(s.messages))
        tiny_engine.keep_warm(s2, "m")
        tiny_engine.restore_warm(s2)
        assert [b is None for b in s2.seq.table] == holes and s2.seq.num_tokens == s.seq.num_tokens
        assert s2.reply("And then?", GREEDY) == s.reply("And then?", GREEDY)
        tiny_engine.runner.cache.check()
        for x in (s, s2):
            x.close()
    finally:
        tiny_engine._warm_store = None


# ---- the second tier: blocks past the budget on disk ---------------------------------------------------------------

TIER_BUDGET_MB = 0.25           # 20 blocks of the tiny model: its 200-token prompt fits, its 250-token reply spills


@pytest.fixture
def small_pool(tiny_engine):
    yield tiny_engine
    tiny_engine.runner.set_budget(CacheConfig().budget_mb)


def spilled(engine, k: int, prompt: list[int], reply: int, budget_mb: float = TIER_BUDGET_MB):
    """A retrieval session: the prompt read, then `reply` tokens fed one at a time; (session, the logits of each)."""
    s = engine.new_session(cache=CacheConfig(retrieval_blocks=k, budget_mb=budget_mb, **FP32), prefix_cache=False)
    s.append(prompt)
    return s, [s.append([t])[-1] for t in ids_of(reply, seed=11)]


def test_past_the_budget_blocks_go_to_disk_and_come_back(small_pool):
    """The tier is out of sight: a reply past the budget reads what the same mode reads with the whole cache in
    memory (the same blocks chosen, those on disk read back), token for token."""
    engine, prompt = small_pool, ids_of(200, seed=10)
    s, got = spilled(engine, 6, prompt, 250)
    cache = engine.runner.cache
    tier = cache.tier_of(s.seq)
    assert tier is not None and len(tier.records) > 5 and tier.path.exists()
    assert cache.held_bytes <= cache.budget_bytes
    cache.check()
    snap = s.stats()
    assert snap.blocks_on_disk == len(tier.records) and snap.tier_fetches[0] > 0
    assert snap.tokens_evicted == 0             # on disk is not gone: the held tokens and those on disk are all of it
    assert snap.tokens_held + 16 * snap.blocks_on_disk == 450
    assert snap.tokens_left == s.info.max_context - 450      # past the budget is the disk's: the context binds
    assert snap.blocks_read == (1 + 6 + 2, 450 // 16 + 1)
    s2, want = spilled(engine, 6, prompt, 250, budget_mb=64)
    assert cache.tier_of(s2.seq) is None
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ConfigError, match="on disk"):
        s.set_cache(CacheConfig(**FP32))
    from kvchat.engine.kv.saved import CacheFileError
    with pytest.raises(CacheFileError, match="on disk"):
        engine.runner.export_kv(s.seq)
    folder = tier.path.parent
    s.close()
    s2.close()
    assert not folder.exists() and cache.tier_of(s.seq) is None
    cache.check()


def test_the_attention_map_marks_the_blocks_on_disk(small_pool):
    """The Attention page's map says which columns are on disk: exactly the tier's blocks; a layer's column there is
    held only where that layer fetched it back for the newest token, and coloured apart from a block in memory not
    read."""
    import numpy as np

    from kvchat.app.dashboard.attention_data import DISK_RGB, LEFT_RGB, Scale, colours
    s = small_pool.new_session(cache=CacheConfig(retrieval_blocks=6, budget_mb=TIER_BUDGET_MB, **FP32),
                               prefix_cache=False)
    s.watch_attention("blocks")
    s.append(ids_of(200, seed=10))
    for t in ids_of(250, seed=11):
        s.append([t])
    tier = small_pool.runner.cache.tier_of(s.seq)
    m = s.attention(over="newest")
    read = s.stats().blocks_read[0]
    assert all(int(m.held[layer].sum()) <= read for layer in range(m.num_layers))    # held: the blocks it read
    assert m.on_disk is not None and set(np.flatnonzero(m.on_disk)) == set(tier.records)
    fetched = m.held[:, m.on_disk]
    assert fetched.any() and not fetched.all()         # some layers read some disk blocks back, not all of them
    rgb = colours(m.layer_mass(), m.held, m.attends, Scale(-4, 0), m.on_disk)[..., :3]
    layer, col = [int(x) for x in np.argwhere(~m.held & m.on_disk[None, :])[0]]
    assert tuple(rgb[layer, col]) == DISK_RGB
    spots = np.argwhere(~m.held & ~m.on_disk[None, :])
    if len(spots):
        assert tuple(rgb[spots[0][0], spots[0][1]]) == LEFT_RGB
    s.close()


@pytest.mark.parametrize("fault", ["gone", "damaged"])
def test_a_tier_file_gone_or_damaged_falls_back_to_memory(small_pool, fault):
    s, _ = spilled(small_pool, 4, ids_of(200, seed=12), 250)
    tier = small_pool.runner.cache.tier_of(s.seq)
    tier.forget_cached()
    if fault == "gone":
        tier._file.close()
        tier.path.unlink()
    else:
        with open(tier.path, "r+b") as f:
            f.write(b"\xff" * 4096)
    out = s.append([9])[-1]
    assert torch.isfinite(out).all() and tier.failed
    snap = s.stats()
    assert "blocks in memory" in snap.notice
    assert snap.blocks_on_disk == 0 and snap.tokens_evicted == 16 * len(tier.records)   # now they are gone
    assert torch.isfinite(s.append([10])[-1]).all()            # and it goes on
    s.close()


def test_a_first_prompt_past_the_budget_spills_from_an_empty_pool(small_pool):
    """A fresh session whose first prompt alone is past the budget: the first spill comes while the pool may hold no
    pages (the tier sizes a block from the page shape), the prompt is read in smaller steps with the blocks read
    moving to disk between them, and the reply goes on from the tier. (A prompt step reads the blocks in memory
    only: docs/limits.md.)"""
    prompt = ids_of(420, seed=14)
    s = small_pool.new_session(cache=CacheConfig(retrieval_blocks=6, budget_mb=TIER_BUDGET_MB, **FP32),
                               prefix_cache=False)
    assert torch.isfinite(s.append(prompt)[-1]).all()
    for t in ids_of(20, seed=15):
        assert torch.isfinite(s.append([t])[-1]).all()
    cache = small_pool.runner.cache
    tier = cache.tier_of(s.seq)
    assert tier is not None and len(tier.records) > 0 and cache.held_bytes <= cache.budget_bytes
    snap = s.stats()
    assert snap.tokens_held + 16 * snap.blocks_on_disk == 440 and snap.tokens_evicted == 0
    cache.check()
    s.close()


def test_quantized_retrieval_past_the_budget_stops_as_before(small_pool):
    from kvchat.engine.kv.manager import NoFreeBlocks
    from kvchat.engine.runtime.overflow import BudgetFull
    s = small_pool.new_session(cache=CacheConfig(retrieval_blocks=4, budget_mb=0.2, k_format="int8",
                                                 v_format="int8"), prefix_cache=False)
    with pytest.raises((BudgetFull, NoFreeBlocks)):
        for t in ids_of(900, seed=13):
            s.append([t])
    assert small_pool.runner.cache.tier_of(s.seq) is None
    s.close()
