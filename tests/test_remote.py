"""RemoteEngine against `kvchat serve` on loopback: chat, Stop, errors, stats from /metrics; the engine Protocol."""
import time

from dataclasses import replace

import pytest

from kvchat.engine import CacheConfig, EngineConfig, SamplingParams, TokenDelta, TurnFinished
from kvchat.engine.api import LOCAL, REMOTE, ChatEngine, ChatSession, capabilities_of
from kvchat.engine.config import ConfigError
from kvchat.engine.serve.remote import RemoteEngine, RemoteError
from kvchat.engine.serve import batch
from kvchat.engine.serve.server import ServeConfig, Server
from fakes import FakeEngine

CACHE = CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.5)
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


@pytest.fixture(scope="module")
def server(tiny_engine):
    srv = Server(tiny_engine, ServeConfig(port=0, model_id="tiny", api_key="k3y"), CACHE)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def remote(server):
    return RemoteEngine.connect(server.base_url.removesuffix("/v1"), api_key="k3y")


def test_remote_chat_equals_the_local_session_and_keeps_history(remote, tiny_engine):
    """The model comes from /v1/models; a greedy turn equals the local one; turn 2 carries the history."""
    assert remote.model_name == "tiny" and remote.models == ["tiny"]
    session = remote.new_session(system_prompt="Be brief.")
    events = list(session.send("Hello! How are you?", GREEDY))
    local = tiny_engine.new_session(system_prompt="Be brief.", cache=CACHE)
    expected = local.reply("Hello! How are you?", GREEDY)
    assert isinstance(events[-1], TurnFinished) and events[-1].text == expected
    assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == expected
    assert events[-1].finish_reason in ("eos", "length")
    second = list(session.send("And again?", GREEDY))[-1]
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert second.stats.prefill_tokens > events[-1].stats.prefill_tokens   # the history went along


def test_remote_stop_closes_the_stream_and_the_server_frees_the_blocks(remote, tiny_engine):
    seen = []
    params = SamplingParams(temperature=1.0, max_new_tokens=3000, seed=5)
    for event in remote.new_session().send("def add(a, b):", params, should_stop=lambda: len(seen) >= 3):
        seen.append(event)
    assert seen[-1].finish_reason == "stopped"
    deadline = time.monotonic() + 5
    while batch.num_live(tiny_engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batch.num_live(tiny_engine) == 0


def test_remote_stats_come_from_the_stream_and_the_servers_metrics(remote):
    session = remote.new_session()
    finished = list(session.send("The quick brown fox", SamplingParams(temperature=0.8, seed=2, max_new_tokens=24)))[-1]
    s = finished.stats
    assert s.server is not None and s.server.kv_usage is not None and 0.0 <= s.server.kv_usage <= 1.0
    deadline = time.monotonic() + 5      # the server counts the request done just after its last chunk
    while session.stats().server.requests_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert session.stats().server.requests_running == 0 and session.stats().server.requests_waiting == 0
    assert s.ttft_s > 0 and s.prefill_tokens > 0 and s.layers == ()
    if finished.stats.tokens_in_context - s.prefill_tokens > 2:
        assert s.decode_tok_s > 0


def test_remote_errors_say_what_to_check(server, remote):
    with pytest.raises(RemoteError, match="API key"):
        RemoteEngine.connect(server.base_url, api_key="wrong")
    with pytest.raises(RemoteError, match="serves: tiny"):
        RemoteEngine.connect(server.base_url, api_key="k3y", model="llama-70b")
    with pytest.raises(RemoteError, match="cannot reach"):
        RemoteEngine.connect("http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="http"):
        RemoteEngine.connect("localhost:8000")
    with pytest.raises(ConfigError, match="remote server"):
        remote.new_session().set_cache(CacheConfig(k_format="int8"))
    too_long = " ".join(["fox"] * 3000)
    finished = list(remote.new_session().send(too_long, GREEDY))[-1]
    assert finished.finish_reason == "context" and "context length" in finished.message


def test_local_remote_and_fake_engines_share_one_protocol(remote, tiny_engine):
    fake = FakeEngine(EngineConfig())
    # the fake runs locally but keeps no caches on disk, does not speculate and has no prompt precision to set
    fake_caps = replace(LOCAL, saves_caches=False, speculative=False, prefill_precision=False,
                        decode_precision=False)
    for engine, caps in ((tiny_engine, LOCAL), (remote, REMOTE), (fake, fake_caps)):
        assert isinstance(engine, ChatEngine)
        assert isinstance(engine.new_session(), ChatSession)
        assert capabilities_of(engine) == caps


def test_remote_stats_show_the_servers_draft_acceptance(remote, tiny_engine):
    """A server that verified drafts (vLLM's vllm:spec_decode_* counters): the share accepted reaches the session's
    stats."""
    from kvchat.engine.config import SpeculativeConfig
    before = tiny_engine.speculative
    tiny_engine.set_speculative(SpeculativeConfig("lookup", k=4, ngram_min=1, adaptive=False))
    try:
        session = remote.new_session()
        list(session.send("the cat sat on the mat, the cat sat on the mat, the cat sat on the mat",
                          SamplingParams(temperature=0, max_new_tokens=24)))
        remote.refresh_metrics()
        rate = session.stats().server.spec_acceptance
        assert rate is not None and 0.0 <= rate <= 1.0
    finally:
        tiny_engine.set_speculative(before)
