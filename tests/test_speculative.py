"""Speculative decoding (engine/runtime/speculative.py): greedy output equals plain decoding token for token in every
cache format, with a window and sinks, in a hybrid model and in batched serving; the cache afterwards is the one
plain decoding leaves; a failure or a full budget mid-verification leaves the cache as before; sampling keeps the
target distribution."""
from __future__ import annotations

import math

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.config import ConfigError
from kvchat.engine.events import FinishReason, TurnFinished
from kvchat.engine.runtime.speculative import PromptLookup, Speculator, StepCosts, accept
from kvchat.engine.serve.scheduler import Finished, Request, Scheduler, SchedulerConfig, TokenOut
from misguided import Misguided
from tiny_models import tiny_family_dir, tiny_model_dir

OFF = SpeculativeConfig("off")
LOOKUP = SpeculativeConfig("lookup", k=6, ngram_max=3, ngram_min=1, adaptive=False)   # verify every proposal
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)
FP32 = dict(k_format="fp32", v_format="fp32")
MODES = [CacheConfig(**FP32), CacheConfig(), CacheConfig(k_format="int8", v_format="int8"),
         CacheConfig(k_format="fp8", v_format="fp8"), CacheConfig(k_format="int4", v_format="int4"),
         CacheConfig(k_format="int4", v_format="int8", window=48, sinks=4),
         CacheConfig(**FP32, window=40, sinks=4), CacheConfig(k_format="int8", v_format="int8", block_size=8)]
MODE_IDS = ["fp32", "auto", "int8", "fp8", "int4", "int4-int8-window", "fp32-window", "int8-blocks-of-8"]
PROMPT = "def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(EngineConfig(model=tiny_llama))


def turn(engine, spec, cache, prompt=PROMPT, params=GREEDY, turns=2):
    """A session after `turns` greedy turns under `spec`, and the last turn's TurnFinished."""
    s, finished = turns_of(engine, spec, cache, prompt, params, turns)
    return s, finished[-1]




def turns_of(engine, spec, cache, prompt=PROMPT, params=GREEDY, turns=2, misguided=True):
    engine.set_speculative(spec)
    s = engine.new_session(cache=cache, prefix_cache=False)
    if spec.method == "lookup" and misguided:
        s._spec = Speculator(spec, None, engine.model.config.vocab_size)
        s._spec.proposer = Misguided(spec.ngram_max, spec.ngram_min)
    finished = []
    for i in range(turns):
        finished += [e for e in s.send(prompt if i == 0 else "And again, please.", params)
                     if isinstance(e, TurnFinished)]
    return s, finished


@pytest.mark.parametrize("cache", MODES, ids=MODE_IDS)
def test_greedy_speculation_is_plain_decoding_token_for_token(engine, cache):
    """Two turns with and without prompt lookup: the same tokens, the same cache (the next logits are equal bit for
    bit), and the verification both accepted and rejected drafts."""
    plain, _ = turn(engine, OFF, cache, turns=3)
    spec, finished = turns_of(engine, LOOKUP, cache, turns=3)
    assert spec.token_ids == plain.token_ids
    assert spec.seq.num_tokens == plain.seq.num_tokens and spec.seq.evicted == plain.seq.evicted
    stats = [f.stats.spec for f in finished]
    drafted, accepted = sum(st.drafted for st in stats), sum(st.accepted for st in stats)
    assert drafted > 0 and 0 < accepted < drafted, stats
    assert max(st.tokens_per_step for st in stats) > 1.0
    nxt = [5, 6, 7, 8, 9]
    torch.testing.assert_close(spec.append(nxt), plain.append(nxt), atol=0, rtol=0)
    engine.runner.cache.check()
    spec.close()
    plain.close()


def test_no_quantized_block_ever_holds_a_rejected_token(engine):
    """int4 with blocks of 8: every verification stays inside the block its first token goes to, so no block is
    quantized holding a draft; the quantized pages then equal plain decoding's, code for code."""
    cache = CacheConfig(k_format="int4", v_format="int4", block_size=8)
    plain, _ = turn(engine, OFF, cache, turns=1)
    spec, _ = turn(engine, LOOKUP, cache, turns=1)
    assert spec.token_ids == plain.token_ids
    for (pk, pv), (sk, sv) in zip(plain.components, spec.components):
        for pc, sc in ((pk, sk), (pv, sv)):
            for name in ("data", "scale"):
                full = plain.seq.seq_len // 8     # the first block is the full-precision head, the last the tail
                a = pc.pages[name][plain.seq.block_table[1:full]]
                b = sc.pages[name][spec.seq.block_table[1:full]]
                assert torch.equal(a, b), name
    spec.close()
    plain.close()


def test_a_draft_room_keeps_drafts_inside_the_block_and_the_window(engine):
    runner = engine.runner
    s = engine.new_session(cache=CacheConfig(k_format="int8", v_format="int8"))
    s.append(list(range(5, 15)))                      # 10 tokens: the next goes to slot 10 of a block of 16
    assert runner.draft_room(s.seq, 32) == 16 - 2 - 10
    s.append([20, 21, 22, 23, 24])                   # slot 15 next: it completes the block, no draft may follow
    assert runner.draft_room(s.seq, 32) == 0
    full = engine.new_session(cache=CacheConfig(**FP32))
    full.append(list(range(5, 15)))
    assert runner.draft_room(full.seq, 7) == 7       # full precision: anything can be taken back
    w = engine.new_session(cache=CacheConfig(**FP32, window=32, sinks=4))
    w.append(list(range(5, 5 + 40)))
    room = runner.draft_room(w.seq, 32)
    g, m = w.seq.geometry, w.seq
    for k in range(room + 1):        # no row of a verification of `room` drafts moves the window
        assert not g.num_to_evict(m.num_tokens + 1 + k, m.evicted, m.layout.blocks_for(m.seq_len + 1 + k))
    for x in (s, full, w):
        x.close()


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_a_hybrid_model_speculates_exactly(tmp_path, family):
    """Gemma-3-shaped: five sliding layers (window 16) and a global one, two KV groups; Gemma-2-shaped: sliding and
    global layers alternating, soft-capped (those layers attend through torch, row by row)."""
    eng = Engine.load(EngineConfig(model=tiny_family_dir(tmp_path / family, family)))
    for cache in (CacheConfig(**FP32), CacheConfig(k_format="int8", v_format="int8")):
        plain, _ = turn(eng, OFF, cache)
        spec, finished = turn(eng, LOOKUP, cache)
        assert len(spec.seq.members) == 2
        assert spec.token_ids == plain.token_ids
        assert finished.stats.spec.drafted > 0
        torch.testing.assert_close(spec.append([5, 6, 7]), plain.append([5, 6, 7]), atol=0, rtol=0)
        eng.runner.cache.check()


def test_a_failure_mid_verification_leaves_the_cache_as_before(engine):
    """An exception inside a verification step's forward: the conversation holds what it held before the step, and
    the next logits equal a twin's that never tried."""
    cache = CacheConfig(k_format="int8", v_format="int8")
    s, twin = engine.new_session(cache=cache), engine.new_session(cache=cache)
    ids = list(range(5, 45))
    s.append(ids)
    twin.append(ids)
    model = engine.runner.model
    forward = model.forward

    def failing(*a, **k):
        raise RuntimeError("boom")

    model.forward = failing
    decode = model.forward_decode
    model.forward_decode = lambda *a, **k: failing()
    try:
        with pytest.raises(RuntimeError):
            engine.runner.step([(s.seq, [50, 51, 52, 53])], decode=[True])
    finally:
        model.forward, model.forward_decode = forward, decode
    engine.runner.cache.check()
    assert s.seq.num_tokens == twin.seq.num_tokens
    torch.testing.assert_close(s.append([60, 61]), twin.append([60, 61]), atol=0, rtol=0)


def test_a_budget_too_small_for_the_drafts_falls_back_to_plain_steps(engine):
    """A budget with room for the reply's own blocks but not for a verification's: the reply is plain decoding's."""
    cache = CacheConfig(**FP32, budget_mb=0.5)
    plain, _ = turn(engine, OFF, cache, turns=1, params=SamplingParams(temperature=0, max_new_tokens=40))
    plain_ids = list(plain.token_ids)
    plain.close()
    spec, finished = turn(engine, LOOKUP, cache, turns=1, params=SamplingParams(temperature=0, max_new_tokens=40))
    assert spec.token_ids == plain_ids
    engine.runner.cache.check()
    spec.close()
    engine.set_speculative(OFF)
    engine.new_session(cache=CacheConfig(**FP32))          # the budget back to the default


def test_a_stop_mid_reply_leaves_the_cache_as_plain_decoding_leaves_it(engine):
    cache = CacheConfig(**FP32)
    for spec_config in (OFF, LOOKUP):
        engine.set_speculative(spec_config)
        s = engine.new_session(cache=cache, prefix_cache=False)
        seen = []
        events = list(s.send(PROMPT, SamplingParams(temperature=0, max_new_tokens=60),
                             should_stop=lambda: len(seen.append(1) or seen) > 20))
        assert events[-1].finish_reason == FinishReason.STOPPED
        assert s.seq.num_tokens == len(s.token_ids)       # the last token was fed, nothing more
        s.close()


def test_the_default_model_is_its_own_draft():
    """The loaded GGUF as its own draft: greedy output is plain decoding's, and the draft (plain decode steps of the
    same model) agrees with the verification on nearly every token."""
    eng = Engine.load(EngineConfig())
    prompt = "Write a haiku about the sea."
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain, _ = turn(eng, OFF, CacheConfig(), prompt=prompt, params=params, turns=1)
    spec, finished = turn(eng, SpeculativeConfig("draft", k=4, draft_model="self", adaptive=False), CacheConfig(), prompt=prompt,
                          params=params, turns=1)
    assert spec.token_ids == plain.token_ids
    st = finished.stats.spec
    assert st.method == "draft" and st.drafted > 0 and st.acceptance_rate > 0.9, st
    spec.close()                 # its draft sequence goes with it
    assert all(not s.closed for s in eng.runner.cache.sequences())
    eng.runner.cache.check()


def test_a_tiny_random_draft_model_sharing_the_tokenizer(engine, tmp_path):
    """A smaller random model with the same tokenizer proposes; its guesses are mostly wrong, and the output is
    still plain decoding's."""
    draft = tiny_model_dir(tmp_path / "draft", hidden=32, heads=2, kv_heads=1, layers=1, seed=7, max_positions=4096)
    plain, _ = turn(engine, OFF, CacheConfig(**FP32))
    spec, finished = turn(engine, SpeculativeConfig("draft", k=3, draft_model=draft, adaptive=False), CacheConfig(**FP32))
    assert spec.token_ids == plain.token_ids
    assert finished.stats.spec.drafted > 0 and engine.draft_engine is not None
    engine.set_speculative(OFF)
    spec.close()


def test_a_draft_with_another_tokenizer_is_refused_and_nothing_changes(tmp_path):
    eng = Engine.load(EngineConfig())
    other = tiny_model_dir(tmp_path / "other", hidden=32, heads=2, kv_heads=1, layers=1)
    before = eng.speculative
    with pytest.raises(ConfigError, match="tokenizer"):
        eng.set_speculative(SpeculativeConfig("draft", draft_model=other))
    assert eng.speculative == before


@pytest.mark.parametrize("bad", [dict(method="ngram"), dict(k=0), dict(k=99), dict(ngram_min=4, ngram_max=3),
                                 dict(method="draft"), dict(adaptive="yes")])
def test_impossible_settings_say_what_to_change(bad):
    with pytest.raises(ConfigError):
        SpeculativeConfig(**bad)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    look = PromptLookup(3, 1)
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert look.propose(ids, 2) == [4, 5]
    ids = ids + [7, 8, 1, 2, 3]                     # the later match wins
    assert look.propose(ids, 3) == [7, 8, 1]
    assert look.propose([1, 2, 3, 4, 5], 4) == []   # cut and changed: the index starts over, nothing repeats
    assert look.propose([6, 6, 6], 2) == [6]       # a run proposes itself
    assert look.propose([5, 6, 7], 0) == []


def test_batched_serving_speculates_and_gives_each_request_its_plain_tokens(engine):
    """Four requests at once through the scheduler, with and without prompt lookup: the same tokens each; the metrics
    count drafts under vLLM's names."""
    from kvchat.engine.serve.metrics import ServeMetrics
    cache = CacheConfig(**FP32, block_size=8)
    prompts = [list(range(5, 25)) * 2, [7, 8, 9, 10] * 6, list(range(30, 70)), [11, 12, 13] * 9]

    def serve(spec):
        engine.set_speculative(spec)
        metrics = ServeMetrics(engine, f"tiny-{spec.method}")
        sched = Scheduler(engine, SchedulerConfig(cache, 4, prefill_chunk=16), metrics)
        outs = {i: [] for i in range(len(prompts))}
        done = set()
        for i, p in enumerate(prompts):
            def emit(e, i=i):
                if isinstance(e, TokenOut):
                    outs[i].append(e.token_id)
                elif isinstance(e, Finished):
                    done.add(i)
            sched.submit(Request(p, SamplingParams(temperature=0, max_new_tokens=30), emit))
        for _ in range(400):
            sched.step()
            if len(done) == len(prompts):
                break
        assert len(done) == len(prompts)
        return outs, metrics

    plain, _ = serve(OFF)
    spec, metrics = serve(LOOKUP)
    assert spec == plain
    value = metrics.registry.get_sample_value
    labels = {"model_name": "tiny-lookup", "engine": "0"}
    drafted = value("vllm:spec_decode_num_draft_tokens_total", labels)
    accepted = value("vllm:spec_decode_num_accepted_tokens_total", labels)
    assert value("vllm:spec_decode_num_drafts_total", labels) > 0 and drafted > 0 and 0 < accepted <= drafted
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", dict(labels, position="0")) > 0
    engine.set_speculative(OFF)
    engine.runner.cache.check()


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    """Pearson's chi-square against probs at the 0.1% level (cells with expected >= 5; the rest pooled)."""
    expected = probs * n
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum().view(1)))
    exp = torch.cat((expected[big], expected[~big].sum().view(1)))
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the 99.9% point of chi-square with dof degrees of freedom
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < limit


def test_sampling_with_rejection_keeps_the_target_distribution():
    """The acceptance rule over a tiny vocabulary: the first token follows row 0's distribution whatever the draft,
    and, given that the first draft was taken, the second follows row 1's (temperature, top-k, repetition penalty)."""
    g = torch.Generator().manual_seed(0)
    vocab = 12
    rows = torch.randn(3, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8, repetition_penalty=1.3)
    from kvchat.engine.runtime.sampling import distribution
    recent = [3, 4]
    drafts = [int(rows[0].argmax()), 5]
    p0 = distribution(rows[0], params, recent)
    p1 = distribution(rows[1], params, recent + drafts[:1])
    n = 20000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    took_first = 0
    for _ in range(n):
        taken, after = accept(rows, drafts, params, recent, g)
        out = drafts[:taken] + [after]
        first[out[0]] += 1
        if taken >= 1:
            took_first += 1
            second[out[1]] += 1
    assert _chi2_ok(first, p0, n)
    assert abs(took_first / n - float(p0[drafts[0]])) < 0.02
    assert _chi2_ok(second, p1, took_first)


def test_greedy_acceptance_takes_exactly_the_argmax_run():
    rows = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 4, 9, 1]):
        rows[i, t] = 5.0
    greedy = SamplingParams(temperature=0)
    assert accept(rows, [3, 4, 9], greedy, [], None) == (3, 1)     # all taken, then the bonus token
    assert accept(rows, [3, 7, 9], greedy, [], None) == (1, 4)     # the second rejected: row 1's own choice
    assert accept(rows, [2], greedy, [], None) == (0, 3)


def test_adaptive_drafts_follow_acceptance_and_what_a_row_costs():
    """The number proposed maximises expected tokens per time: none while guesses fail or rows are dear, many while
    they are taken and rows are cheap; an unverified proposal that would have been right brings drafting back."""
    costs = StepCosts()
    spec = Speculator(SpeculativeConfig("lookup", k=8, ngram_min=1), costs=costs)
    for _ in range(10):
        costs.plain(0.010)
        costs.verified(5, 0.010 + 4 * 0.0005)          # a row costs 5% of a step
    for _ in range(6):
        spec.record(4, 4)
    assert spec.worth(8) == 8
    for _ in range(10):
        costs.verified(5, 0.010 + 4 * 0.008)           # 80%: only near-certain runs pay
    for _ in range(8):
        spec.record(4, 0)
    assert spec.worth(8) == 0
    ids = [1, 2, 3, 1, 2]
    assert spec.propose(ids, 8) == []                  # not worth verifying; kept as a shadow guess (3)
    before = spec.acceptance
    spec.propose(ids + [3], 8)                         # the guess was right: the estimate rises
    assert spec.acceptance > before


def test_sampling_over_a_tiny_models_verification_keeps_its_distribution(engine):
    """The same rule over a real verification step of the tiny model (its rows after a context and two drafts, the
    drafts then taken back): the first token follows the model's own sampling distribution after the context."""
    from kvchat.engine.runtime.sampling import distribution
    s = engine.new_session(cache=CacheConfig(**FP32))
    context = list(range(5, 40))
    s.append(context)
    nxt, drafts = 41, [42, 43]
    (rows,) = engine.runner.step([(s.seq, [nxt] + drafts)], decode=[True])
    engine.runner.truncate(s.seq, 3)
    params = SamplingParams(temperature=1.5, top_k=20)        # flat enough that both branches happen
    recent = context + [nxt]
    rows = rows.cpu()
    drafts = [int(rows[0].argsort(descending=True)[1]), int(rows[1].argmax())]   # a likely but not certain guess
    p0 = distribution(rows[0], params, recent)
    g = torch.Generator().manual_seed(1)
    n = 8000
    first = torch.zeros(rows.shape[1])
    for _ in range(n):
        taken, after = accept(rows, drafts, params, recent, g)
        first[(drafts[:taken] + [after])[0]] += 1
    assert 0.02 < float(p0[drafts[0]]) < 0.98
    assert _chi2_ok(first, p0, n)
    assert s.seq.num_tokens == len(context)
    s.close()


def test_a_self_draft_never_releases_the_conversation_it_drafts_for(engine):
    """The loaded model as its own draft under a budget that holds one copy of the chat but not two: the draft's
    steps may not take the conversation's blocks; they give up (plain steps) and the reply is plain decoding's."""
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain, _ = turn(engine, OFF, CacheConfig(**FP32), turns=1, params=params)
    plain_ids = list(plain.token_ids)
    held = engine.runner.conversation_bytes(plain.seq)
    plain.close()
    engine.clear_prefix_cache()          # else the draft shares the chat's blocks through the prefix cache
    block = plain.seq.layout.block_bytes
    cache = CacheConfig(**FP32, budget_mb=(held + 2 * block) / 2**20)     # the chat and two blocks more
    engine.set_speculative(OFF)
    plain, _ = turn(engine, OFF, cache, turns=1, params=params)           # it fits alone
    assert plain.token_ids == plain_ids
    plain.close()
    engine.clear_prefix_cache()
    spec, finished = turn(engine, SpeculativeConfig("draft", k=3, draft_model="self", adaptive=False, ngram_min=1),
                          cache, turns=1, params=params)
    assert spec.token_ids == plain_ids and not spec.seq.released and not spec.notice
    assert finished.stats.spec.drafted > 0          # the draft ran while it had room
    engine.runner.cache.check()
    spec.close()
    engine.set_speculative(OFF)
    engine.new_session(cache=CacheConfig(**FP32))          # the budget back to the default


def test_a_seeded_sample_repeats_whatever_speculation_decides(engine):
    """Sampling with a seed decodes plainly (whether drafts pay is timed, and verified drafts take other random
    draws): the same seed gives the same reply with speculation on or off."""
    params = SamplingParams(temperature=0.9, seed=11, max_new_tokens=40)
    replies = []
    for spec in (OFF, LOOKUP, SpeculativeConfig("lookup")):
        engine.set_speculative(spec)
        s = engine.new_session(cache=CacheConfig(**FP32), prefix_cache=False)
        finished = [e for e in s.send(PROMPT, params) if isinstance(e, TurnFinished)][-1]
        replies.append(list(s.token_ids))
        assert finished.stats.spec is None
        s.close()
    assert replies[0] == replies[1] == replies[2]
    engine.set_speculative(OFF)
