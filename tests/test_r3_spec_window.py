"""Prompt lookup on a windowed cache (issue 37 item 13): a rejected draft is taken back on every KV group, whether the
window has filled yet or not, so a reply running well past the window speculates and equals plain decoding (a
tiny Gemma-3-shaped model with a 32-token sliding window, in a session and through `kvchat serve`; a plain llama
under the user's window and sinks). The tiny models soon repeat one token, which prompt lookup guesses every time:
its guesses are spoiled now and then so that verifications reject drafts too."""
from __future__ import annotations

import httpx
import pytest

from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from kvchat.engine.events import FinishReason, TurnFinished
from kvchat.engine.runtime import speculative
from kvchat.engine.serve.server import ServeConfig, Server
from misguided import Misguided
from tiny_models import tiny_family_dir

WINDOW = 32
OFF = SpeculativeConfig("off")
LOOKUP = SpeculativeConfig("lookup", k=6, ngram_max=3, ngram_min=1, adaptive=False)   # verify every proposal
FP32 = CacheConfig(k_format="fp32", v_format="fp32")
PROMPT = "The fox."        # shorter than the window: drafts are rejected before it fills
REPLY = SamplingParams(temperature=0.0, max_new_tokens=5 * WINDOW)




@pytest.fixture(autouse=True)
def misguided(monkeypatch):
    """Every speculation the engine makes here (a session's or a server request's) proposes with Misguided."""
    monkeypatch.setattr(speculative, "PromptLookup", Misguided)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Five sliding layers (window 32) and a global one: two KV groups."""
    return Engine.load(EngineConfig(model=tiny_family_dir(tmp_path_factory.mktemp("gemma3"), "gemma3",
                                                          sliding_window=WINDOW)))


def reply(engine, spec: SpeculativeConfig, cache: CacheConfig, turns: int = 2):
    """A session after `turns` greedy turns under `spec`, and each turn's TurnFinished."""
    engine.set_speculative(spec)
    s = engine.new_session(cache=cache, prefix_cache=False)
    finished = []
    for i in range(turns):
        finished += [e for e in s.send(PROMPT if i == 0 else "Again.", REPLY) if isinstance(e, TurnFinished)]
    engine.set_speculative(OFF)
    return s, finished


def assert_plain(engine, cache: CacheConfig) -> None:
    plain, _ = reply(engine, OFF, cache)
    spec, finished = reply(engine, LOOKUP, cache)
    assert [f.finish_reason for f in finished] == [FinishReason.LENGTH] * 2, [f.message for f in finished]
    assert spec.token_ids == plain.token_ids
    assert [m.evicted for m in spec.seq.members] == [m.evicted for m in plain.seq.members]
    assert max(m.evicted for m in spec.seq.members) > 0             # the window slid, several times
    stats = [f.stats.spec for f in finished]
    drafted, accepted = sum(st.drafted for st in stats), sum(st.accepted for st in stats)
    assert 0 < accepted < drafted, stats                            # drafts kept and drafts taken back
    engine.runner.cache.check()
    assert spec.append([5, 6, 7]).equal(plain.append([5, 6, 7]))    # the same cache: the next logits bit for bit
    spec.close()
    plain.close()


@pytest.mark.parametrize("cache", [FP32, CacheConfig(k_format="int8", v_format="int8")], ids=["fp32", "int8"])
def test_a_hybrid_reply_past_the_sliding_window_speculates_as_plain_decoding(gemma3, cache):
    """Rejected drafts are taken back before the sliding window fills and after it moved: the turns finish, token
    for token plain decoding's."""
    assert_plain(gemma3, cache)


def test_rejected_drafts_are_taken_back_on_every_group_before_the_window_fills(gemma3):
    """A verification of the tokens before the sliding group's first W - 1: every draft can be taken back."""
    runner = gemma3.runner
    s = gemma3.new_session(cache=FP32)
    s.append(list(range(5, 15)))
    room = runner.draft_room(s.seq, 6)
    assert room == 6
    runner.step([(s.seq, [20] + [21] * room)], decode=[True])
    runner.truncate(s.seq, room)
    assert [m.num_tokens for m in s.seq.members] == [11, 11]
    runner.cache.check()
    s.close()


def test_the_server_answers_a_hybrid_reply_past_the_window_as_without_speculation(gemma3):
    """`kvchat serve` with prompt lookup on: 200 and the text of the same request with speculation off."""
    server = Server(gemma3, ServeConfig(port=0, model_id="tiny", max_num_seqs=4, prefill_chunk=64),
                    FP32.with_(budget_mb=16))
    server.start()
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8] * 3, "temperature": 0, "max_tokens": 5 * WINDOW}
        answers = {}
        for spec in (OFF, LOOKUP):
            gemma3.set_speculative(spec)
            r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers[spec.method] = r.json()["choices"][0]
        assert answers["lookup"] == answers["off"]
        assert answers["off"]["finish_reason"] == "length"
    finally:
        gemma3.set_speculative(OFF)
        server.stop()


@pytest.mark.parametrize("cache", [CacheConfig(k_format="fp32", v_format="fp32", window=24, sinks=4),
                                   CacheConfig(k_format="int8", v_format="int8", window=32, sinks=4, block_size=8)],
                         ids=["fp32-24-4", "int8-32-4-blocks-of-8"])
def test_a_user_window_reply_past_the_window_speculates_as_plain_decoding(tiny_engine, cache):
    """A plain llama under the user's window and sinks (StreamingLLM): the same tokens with prompt lookup."""
    assert_plain(tiny_engine, cache)
