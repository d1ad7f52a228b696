"""The second tier for preempted requests (engine/kv/tier.py): a preempted request reads its cache back instead
of its prompt, with the tokens of a request that ran alone, for every cache format; a damaged or missing copy is
read again; the tier's budget, its metrics and its folder."""
from __future__ import annotations

import pytest

from kvchat.engine.config import CacheConfig, SamplingParams
from kvchat.engine.events import FinishReason
from kvchat.engine.serve import batch
from kvchat.engine.serve.scheduler import Finished, Request, Scheduler, SchedulerConfig, TokenOut
from kvchat.engine.kv.tier import PreemptTier

FP32 = CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.125)     # 10 blocks of 16 tokens on the tiny model


def _run(engine, prompts, n, budget_mb, tier_mb, cache=FP32, metrics=None, before_step=None):
    sched = Scheduler(engine, SchedulerConfig(cache.with_(budget_mb=budget_mb), 8, prefill_chunk=32, tier_mb=tier_mb),
                      metrics)
    outs = [([], []) for _ in prompts]
    for (ids, fin), prompt in zip(outs, prompts):
        sched.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=n),
                             lambda e, ids=ids, fin=fin: ids.append(e.token_id) if isinstance(e, TokenOut)
                             else fin.append(e)))
    for _ in range(10_000):
        if before_step:
            before_step(sched)
        sched.step()
        if all(fin for _, fin in outs):
            break
    return sched, outs


PROMPTS = [list(range(5 + i, 45 + i)) for i in range(4)]


@pytest.mark.parametrize("cache", [
    FP32,
    CacheConfig(k_format="int8", v_format="int8", budget_mb=0.125),
    CacheConfig(k_format="int4", v_format="int4", budget_mb=0.125),
    CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.125, window=48, sinks=4),
], ids=["fp32", "int8", "int4", "window-sinks"])
def test_preempted_requests_resume_from_the_tier_with_the_tokens_of_a_solo_run(tiny_engine, cache):
    budget = 0.1 if cache.window else 0.05 if cache.k_format != "fp32" else 0.125
    solo = [_run(tiny_engine, [p], 70, budget, 0, cache)[1][0][0] for p in PROMPTS]
    sched, outs = _run(tiny_engine, PROMPTS, 70, budget, 64, cache)
    assert sched.num_preemptions > 0 and sched.max_usage <= 1.0
    # every preempted request resumed, but for one whose import found no room at admission (then read again)
    assert sched.tier.num_resumed + sched.tier.num_recomputed == sched.num_preemptions
    assert sched.tier.num_resumed >= max(1, sched.num_preemptions - 1) and sched.tier.tokens_resumed > 0
    assert [ids for ids, _ in outs] == solo
    assert all(fin[0].reason in (FinishReason.LENGTH, FinishReason.EOS) for _, fin in outs)
    assert batch.num_live(tiny_engine) == 0 and len(sched.tier) == 0 and sched.tier.nbytes == 0


def test_a_resumed_request_reads_no_prompt_again(tiny_engine):
    """Resuming costs no forward pass over what the cache held: the engine is fed fewer tokens than recomputing."""
    fed = {}
    for tier_mb in (0, 64):
        runner = tiny_engine.runner
        counted = []
        step = runner.step

        def counting(items, **kw):
            counted.append(sum(len(ids) for _, ids in items))
            return step(items, **kw)
        runner.step = counting
        try:
            sched, _ = _run(tiny_engine, PROMPTS, 70, 0.125, tier_mb)
        finally:
            del runner.step
        fed[tier_mb] = sum(counted)
        assert sched.num_preemptions > 0
    assert fed[64] < fed[0]


def test_a_damaged_copy_is_read_again_and_loses_nothing(tiny_engine):
    """Every kept file damaged while its request waits: each is recomputed, the tokens still equal solo runs."""
    solo = [_run(tiny_engine, [p], 70, 0.125, 0)[1][0][0] for p in PROMPTS]

    damaged = set()

    def damage(sched):
        for kept in sched.tier._kept.values():
            if kept.path is not None and kept.path.exists() and kept.path not in damaged:
                damaged.add(kept.path)
                data = bytearray(kept.path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                kept.path.write_bytes(bytes(data))
    sched, outs = _run(tiny_engine, PROMPTS, 70, 0.125, 64, before_step=damage)
    assert sched.num_preemptions > 0 and sched.tier.num_resumed == 0
    assert sched.tier.num_recomputed == sched.num_preemptions
    assert [ids for ids, _ in outs] == solo


def test_a_tier_too_small_recomputes(tiny_engine):
    sched, _ = _run(tiny_engine, PROMPTS, 70, 0.125, 0.001)        # 1 KiB: no request's cache fits
    assert sched.num_preemptions > 0 and sched.tier.num_resumed == 0 and sched.tier.num_kept == 0


def test_the_tier_metrics_and_folder(tiny_engine):
    from kvchat.engine.serve.metrics import ServeMetrics
    metrics = ServeMetrics(tiny_engine, "tiny")
    seen = []
    sched, outs = _run(tiny_engine, PROMPTS, 70, 0.125, 64, metrics=metrics,
                       before_step=lambda s: seen.append((len(s.tier), s.tier.nbytes)))
    text = metrics.exposition().decode()
    resumed = sched.tier.num_resumed
    assert resumed > 0
    assert f'kvchat_preemptions_resumed_total{{engine="0",model_name="tiny"}} {float(resumed)}' in text
    assert 'kvchat_preemptions_recomputed_total{engine="0",model_name="tiny"} 0.0' in text
    assert f'kvchat_preemption_resumed_tokens_total{{engine="0",model_name="tiny"}} {float(sched.tier.tokens_resumed)}' \
        in text
    assert max(b for _, b in seen) > 0
    folder = sched.tier._folder
    assert folder is not None and folder.is_dir() and not any(folder.iterdir())
    assert (folder.stat().st_mode & 0o077) == 0            # private to this user
    sched.shutdown()
    assert not folder.exists()


def test_host_tier_keeps_tensors_in_memory():
    import torch
    tier = PreemptTier(1, "host")
    t = {"g0.l0.k.data": torch.arange(64, dtype=torch.float32)}
    assert tier.put("r1", [{"num_tokens": 3}], t, 3) and tier.nbytes == 256 and tier._folder is None
    assert not tier.put("r2", [{"num_tokens": 3}], {"x": torch.zeros(2**20)}, 3)      # 4 MiB > 1 MiB
    tokens, groups, got = tier.take("r1")
    assert tokens == 3 and torch.equal(got["g0.l0.k.data"], t["g0.l0.k.data"]) and tier.take("r1") is None
    with pytest.raises(ValueError):
        PreemptTier(1, "gpu")


def test_serve_config_refuses_a_bad_tier():
    from kvchat.engine.config import ConfigError
    from kvchat.engine.serve.server import ServeConfig
    for bad in (-1, float("nan"), 2**21):
        with pytest.raises(ConfigError, match="--preempt-tier-mb"):
            ServeConfig(preempt_tier_mb=bad)
    assert isinstance(Finished(FinishReason.EOS), Finished)


def test_a_hybrid_model_resumes_both_groups(tmp_path):
    """A Gemma-3-shaped model (sliding and global layers, two KV groups): preempted requests resume every group,
    the sliding one past its window, with the tokens of solo runs."""
    from kvchat.engine import Engine, EngineConfig
    from tiny_models import tiny_family_dir
    engine = Engine.load(EngineConfig(model=tiny_family_dir(tmp_path, "gemma3")))
    prompts = [list(range(5 + i, 25 + i)) for i in range(3)]
    solo = [_run(engine, [p], 900, 0.7, 0)[1][0][0] for p in prompts]
    sched, outs = _run(engine, prompts, 900, 0.7, 64)        # three replies of 900 tokens outgrow the global layer
    assert sched.num_preemptions > 0 and sched.tier.num_resumed > 0
    assert [ids for ids, _ in outs] == solo
