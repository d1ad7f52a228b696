"""The decode driver (engine/runtime/driver.py) is one set of rules for a chat session and for the server's scheduler:
the same seed draws the same tokens through both, a reply ends for the same reasons in both, and a rejected draft
leaves the cache as plain decoding leaves it."""
from __future__ import annotations

import pytest
import torch

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.events import FinishReason, TurnFinished
from kvchat.engine.runtime.driver import Decoder, may_speculate, new_generator, past_context
from kvchat.engine.runtime.speculative import Speculator
from kvchat.engine.serve import batch
from kvchat.engine.serve.scheduler import Finished, Request, Scheduler, SchedulerConfig, TokenOut
from misguided import Misguided

FP32 = CacheConfig(k_format="fp32", v_format="fp32", budget_mb=8)
LOOKUP = SpeculativeConfig("lookup", k=4, ngram_max=3, ngram_min=1, adaptive=False)
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = Engine.load(EngineConfig(model=tiny_llama))
    yield engine
    engine.set_speculative(SpeculativeConfig("off"))


def _session_turn(engine, params: SamplingParams) -> tuple[list[int], list[int], TurnFinished]:
    """(the prompt's token ids, the tokens the turn chose, its TurnFinished) of one turn of a new session."""
    s = engine.new_session(cache=FP32, prefix_cache=False)
    finished = [e for e in s.send(PROMPT, params) if isinstance(e, TurnFinished)][-1]
    prompt = s.token_ids[:s.state.prompt_end]
    chosen = s.token_ids[s.state.prompt_end:]
    s.close()
    return prompt, chosen, finished


def _serve(engine, prompt: list[int], params: SamplingParams, ignore_eos: bool = False) -> tuple[list[int], Finished]:
    """One request through a Scheduler driven by hand: its tokens and its Finished."""
    sched = Scheduler(engine, SchedulerConfig(FP32, 4, prefill_chunk=256))
    out, fin = [], []
    sched.submit(Request(prompt, params, lambda e: out.append(e.token_id) if isinstance(e, TokenOut) else fin.append(e),
                         ignore_eos=ignore_eos))
    for _ in range(500):
        sched.step()
        if fin:
            break
    assert len(fin) == 1 and batch.num_live(engine) == 0
    return out, fin[0]


def test_the_same_seed_draws_the_same_tokens_in_a_session_and_in_the_scheduler(engine):
    """A seeded sampled reply (stop tokens held down, so it runs to its length): the session's tokens and the served
    request's are the same, and a new seed changes them."""
    no_stop = {t: -100.0 for t in engine.stop_ids}
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=1234, max_new_tokens=24, logit_bias=no_stop)
    prompt, chosen, finished = _session_turn(engine, params)
    served, fin = _serve(engine, prompt, params)
    assert finished.finish_reason == fin.reason == FinishReason.LENGTH and len(chosen) == 24
    assert served == chosen
    _, other, _ = _session_turn(engine, SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=99,
                                                       max_new_tokens=24, logit_bias=no_stop))
    assert other != chosen


def test_a_stop_token_ends_the_reply_for_the_same_reason_in_both(engine):
    """A stop token lifted far above the rest: the session and the server both end at once with EOS, the token kept
    out of the reply; a request that ignores EOS goes on to its length."""
    stop = min(engine.stop_ids)
    params = SamplingParams(temperature=0, max_new_tokens=6, logit_bias={stop: 100.0})
    prompt, chosen, finished = _session_turn(engine, params)
    assert finished.finish_reason == FinishReason.EOS and finished.text == "" and chosen == [stop]
    served, fin = _serve(engine, prompt, params)
    assert fin.reason == FinishReason.EOS and served == [] and fin.num_output_tokens == 0
    served, fin = _serve(engine, prompt, params, ignore_eos=True)
    assert fin.reason == FinishReason.LENGTH and served == [stop] * 6


def test_the_finish_rules():
    """EOS before the token counts (and not where EOS is ignored), LENGTH on the reply's last token, no position past
    the context (a window has none)."""
    params = SamplingParams(temperature=0, max_new_tokens=3)
    d = Decoder(params, frozenset({2}))
    assert d.finish(2, 0) == FinishReason.EOS and d.finish(2, 2) == FinishReason.EOS
    assert d.finish(5, 0) is None and d.finish(5, 1) is None and d.finish(5, 2) == FinishReason.LENGTH
    assert Decoder(params, frozenset({2}), ignore_eos=True).finish(2, 0) is None
    assert past_context(10, 10) and not past_context(9, 10) and not past_context(10**9, None)


def test_seeding_and_who_speculates():
    """Greedy draws nothing; a seed repeats its draws; a seeded sample never speculates (its draws must repeat)."""
    assert new_generator(SamplingParams(temperature=0)) is None
    a, b = (new_generator(SamplingParams(temperature=0.7, seed=5)) for _ in range(2))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert may_speculate(SamplingParams(temperature=0)) and may_speculate(SamplingParams(temperature=0.7))
    assert not may_speculate(SamplingParams(temperature=0.7, seed=5))
    assert may_speculate(SamplingParams(temperature=0, seed=5))


def test_a_rejected_draft_is_taken_back_and_the_cache_is_plain_decodings(engine):
    """verify_alone with drafts that are all wrong: one token chosen (the one plain decoding picks), every draft taken
    back, and the next step's logits equal plain decoding's bit for bit."""
    runner = engine.runner
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_new_tokens=8)

    plain = runner.new_sequence(FP32)
    logits = runner.step([(plain, ids)])[0][-1]
    want = int(logits.argmax())
    plain_next = runner.step([(plain, [want])])[0][-1]
    after, vocab = int(plain_next.argmax()), engine.model.config.vocab_size

    class Wrong:
        """Drafts that start with a token plain decoding does not choose: all four are rejected."""

        def propose(self, ids, most):
            return [(after + 1 + i) % vocab for i in range(most)]

        def close(self):
            pass

    spec = Speculator(LOOKUP, None, engine.model.config.vocab_size)
    spec.proposer = Wrong()
    decoder = Decoder(params, engine.stop_ids, spec=spec)
    seq = runner.new_sequence(FP32)
    runner.step([(seq, ids)])
    first = decoder.sample(logits, ids, [])
    assert first == want
    chosen = decoder.verify_alone(runner, seq, ids + [first], [first], room=4)
    assert chosen is not None and len(chosen) == 1
    assert seq.num_tokens == len(ids) + 1               # the next token stays; the four drafts are gone
    assert spec.drafted == 4 and spec.accepted == 0
    second = runner.step([(seq, chosen)])[0][-1]
    assert chosen == [after]
    assert torch.equal(second, runner.step([(plain, [after])])[0][-1])
    runner.close(seq)
    runner.close(plain)


def test_a_misguided_speculation_gives_plain_tokens_in_the_session_and_in_the_scheduler(engine, monkeypatch):
    """Greedy with prompt lookup whose every other proposal is wrong, through both drivers: the tokens plain decoding
    gives, drafts both accepted and rejected."""
    params = SamplingParams(temperature=0, max_new_tokens=32)
    engine.set_speculative(SpeculativeConfig("off"))
    prompt, plain, _ = _session_turn(engine, params)
    served_plain, _ = _serve(engine, prompt, params)
    assert served_plain == plain

    engine.set_speculative(LOOKUP)
    s = engine.new_session(cache=FP32, prefix_cache=False)
    s._spec = Speculator(LOOKUP, None, engine.model.config.vocab_size)
    s._spec.proposer = Misguided(LOOKUP.ngram_max, LOOKUP.ngram_min)
    finished = [e for e in s.send(PROMPT, params) if isinstance(e, TurnFinished)][-1]
    assert s.token_ids[s.state.prompt_end:] == plain
    assert finished.stats.spec.drafted > finished.stats.spec.accepted > 0
    s.close()

    made = []

    def misguided(engine_, cache=None):
        spec = Speculator(LOOKUP, None, engine.model.config.vocab_size)
        spec.proposer = Misguided(LOOKUP.ngram_max, LOOKUP.ngram_min)
        made.append(spec)
        return spec

    monkeypatch.setattr(batch, "speculator", misguided)
    served, fin = _serve(engine, prompt, params)
    assert served == plain and fin.reason == FinishReason.LENGTH
    assert made and made[0].drafted > made[0].accepted > 0
    engine.set_speculative(SpeculativeConfig("off"))
