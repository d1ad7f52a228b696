"""`kvchat serve`: the OpenAI wire format through the official client, errors, metrics, batching, load."""
import json
import time

import httpx
import openai
import pytest

from kvchat.engine import CacheConfig, SamplingParams
from kvchat.bench.serve import make_specs, measure, scrape
from kvchat.engine.config import ConfigError
from kvchat.engine.events import FinishReason
from kvchat.engine.serve import batch
from kvchat.engine.serve.protocol import StopMatcher
from kvchat.engine.serve.scheduler import Finished, Request, Scheduler, SchedulerConfig, TokenOut
from kvchat.engine.serve.server import ServeConfig, Server

# tiny_engine: 3 layers x 2 kv heads x 16 dims, fp32: 768 B a token, 12 KiB a block of 16
SERVE_CACHE = CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.125)    # 10 blocks, 160 tokens
GREEDY = dict(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def server(tiny_engine):
    srv = Server(tiny_engine, ServeConfig(port=0, model_id="tiny", max_num_seqs=8, prefill_chunk=64), SERVE_CACHE)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _root(server) -> str:
    return server.base_url.removesuffix("/v1")


def _wait_idle(engine, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while batch.num_live(engine) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_openai_client_chat_matches_a_session_and_streams_the_same(server, client, tiny_engine):
    """Chat through the openai client equals Session.send on the same chat template; stream == non-stream."""
    messages = [{"role": "user", "content": "Hello! How are you?"}]
    assert [m.id for m in client.models.list()] == ["tiny"]
    full = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    session = tiny_engine.new_session(cache=SERVE_CACHE.with_(budget_mb=4))
    expected = session.reply("Hello! How are you?", SamplingParams(temperature=0, max_new_tokens=12))
    assert full.choices[0].message.content == expected
    assert full.usage.prompt_tokens == len(session.token_ids) - full.usage.completion_tokens - \
        (full.choices[0].finish_reason == "stop")
    text, usage, finish = "", None, None
    for event in client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY):
        if event.usage:
            usage = event.usage
        if event.choices:
            text += event.choices[0].delta.content or ""
            finish = event.choices[0].finish_reason or finish
    assert text == expected and finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_completions_stream_is_server_sent_events_ending_in_done(server, client):
    """/v1/completions over raw SSE: data lines, the same text as the client's non-stream answer, then [DONE]."""
    ids = [5, 17, 42, 99, 7]
    full = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    with httpx.stream("POST", server.base_url + "/completions", json={"model": "tiny", "prompt": ids, "stream": True,
                                                                      **GREEDY}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == full.choices[0].finish_reason


def test_stop_strings_cut_the_text_and_end_the_request(server, client):
    """A stop string taken from the greedy reply ends it there, with finish_reason stop, streamed or not."""
    messages = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=30)
    text = whole.choices[0].message.content      # a random model: mostly stray bytes, some letters
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    cut = text[:text.find(stop)]
    got = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=30, stop=[stop])
    assert got.choices[0].message.content == cut and got.choices[0].finish_reason == "stop"
    streamed = "".join(e.choices[0].delta.content or "" for e in client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=30, stop=stop, stream=True) if e.choices)
    assert streamed == cut


def test_stop_matcher_holds_back_a_possible_stop_prefix():
    m = StopMatcher(("END",))
    assert m.push("abc E") == "abc"        # the last len("END") - 1 characters might start END
    assert m.push("N") == " "
    assert m.push("Dx") == "" and m.stopped
    assert m.text == "abc " and m.flush() == ""


def test_errors_are_openai_error_objects_with_status_codes(server, client):
    """Bad JSON 400, unknown model 404, too long 400 context_length_exceeded, over the KV budget 400, bad n 400."""
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * 100, max_tokens=4096)
    assert e.value.code == "context_length_exceeded" and "4096" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * 400, max_tokens=4)    # 160 tokens fit the budget
    assert e.value.code == "context_length_exceeded" and "MiB" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
    assert e.value.param == "n"
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "tiny", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.base_url + "/completions", json={"model": "tiny", "prompt": [5], "ignore_eos": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


def test_shutdown_cancels_requests_with_an_error(tiny_engine):
    """A request still running when the server stops ends with a 503 'cancelled' error, not silence."""
    srv = Server(tiny_engine, ServeConfig(port=0, model_id="tiny"), SERVE_CACHE)
    srv.start()
    events = []
    with httpx.stream("POST", srv.base_url + "/completions",
                      json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 150, "temperature": 0.9, "seed": 1,
                            "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    srv.scheduler.shutdown()
    srv.stop()
    assert events[-1].get("error", {}).get("code") == "cancelled" or events[-1]["choices"][0]["finish_reason"]
    assert batch.num_live(tiny_engine) == 0


def test_api_key_required_off_loopback_and_checked_as_bearer(tiny_engine):
    with pytest.raises(ConfigError, match="API key"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", api_key="k")             # allowed with a key
    srv = Server(tiny_engine, ServeConfig(port=0, api_key="sekret", model_id="tiny"), SERVE_CACHE)
    url = srv.start()
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in openai.OpenAI(base_url=url, api_key="sekret").models.list()] == ["tiny"]
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200    # probes need no key
    finally:
        srv.stop()


def test_metrics_use_vllm_names_and_count_tokens(server, client):
    """/metrics: vLLM's names and types; generation tokens grow by exactly what the responses report."""
    before = scrape(server.base_url)
    r = client.completions.create(model="tiny", prompt=[9, 8, 7, 6], **GREEDY)
    text = httpx.get(_root(server) + "/metrics").text
    after = scrape(server.base_url)
    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prompt_tokens_total", "counter"),
                       ("vllm:generation_tokens_total", "counter"), ("vllm:prefix_cache_queries_total", "counter"),
                       ("vllm:prefix_cache_hits_total", "counter"), ("vllm:time_to_first_token_seconds", "histogram"),
                       ("kvchat_kv_bytes", "gauge")]:
        assert f"# TYPE {name} {kind}" in text, name
    assert 'model_name="tiny"' in text and 'kvchat_kv_bytes{component="k",format="fp32",layer="0"' in text
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == r.usage.completion_tokens
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 4
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1


def test_client_disconnect_frees_blocks_at_once(server, tiny_engine):
    """Closing a stream midway aborts the request: its blocks are back within a step, not at max_tokens."""
    before = scrape(server.base_url)
    body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 3000, "temperature": 1.0, "seed": 3,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                assert batch.num_live(tiny_engine) == 1
                break
    _wait_idle(tiny_engine)
    after = scrape(server.base_url)
    assert batch.num_live(tiny_engine) == 0 and batch.num_free_blocks(tiny_engine) == server.scheduler.num_blocks
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 500


def _run_scheduler(engine, prompts, max_tokens, budget_mb, max_num_seqs=8, tier_mb=0, cache=SERVE_CACHE, metrics=None):
    """Drive a Scheduler by hand (no thread, no HTTP); returns each request's token ids and finish."""
    sched = Scheduler(engine, SchedulerConfig(cache.with_(budget_mb=budget_mb), max_num_seqs, prefill_chunk=32,
                                              tier_mb=tier_mb), metrics)
    outs = [([], []) for _ in prompts]
    for (ids, fin), prompt, n in zip(outs, prompts, max_tokens):
        sched.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=n),
                             lambda e, ids=ids, fin=fin: ids.append(e.token_id) if isinstance(e, TokenOut)
                             else fin.append(e)))
    for _ in range(10_000):
        sched.step()
        if all(fin for _, fin in outs):
            break
    return sched, outs


def test_scheduler_preempts_the_newest_and_recomputes_the_same_tokens(tiny_engine):
    """A pool too small for all four, no tier: the newest are preempted and re-prefilled, tokens equal solo runs."""
    prompts = [list(range(5 + i, 45 + i)) for i in range(4)]
    solo = [_run_scheduler(tiny_engine, [p], [70], 0.125)[1][0][0] for p in prompts]
    sched, outs = _run_scheduler(tiny_engine, prompts, [70] * 4, 0.125)    # 4 x 110 tokens > 160 in the budget
    assert sched.num_preemptions > 0 and sched.max_usage <= 1.0
    assert sched.tier.num_resumed == 0 and sched.tier.num_recomputed == sched.num_preemptions
    assert [ids for ids, _ in outs] == solo
    assert all(isinstance(fin[0], Finished) and fin[0].reason in (FinishReason.LENGTH, FinishReason.EOS) for _, fin in outs)
    assert batch.num_live(tiny_engine) == 0


def test_load_concurrent_streams_equal_solo_runs_and_free_every_block(server):
    """4 streaming clients x 3 requests of mixed lengths, every 4th cancelled: none failed, none differ."""
    specs = make_specs(12, seed=1, min_words=2, max_words=14, min_tokens=8, max_tokens=40, cancel_every=4)
    result = measure(server, specs, num_clients=4)
    assert result["failed"] == 0, result["errors"]
    assert result["mismatched"] == []
    assert result["cancelled"] == 3
    assert result["max_kv_usage"] <= 1.0
    assert result["live_sequences_at_end"] == 0 and result["blocks_free_at_end"] == result["blocks_budget"]
    assert result["loaded_tok_s"] > 0 and result["ttft_p99_s"] >= result["ttft_p50_s"]


def test_metrics_give_each_sequence_its_kv_bytes(server, tiny_engine):
    """kvchat_sequence_kv_bytes: one series per live sequence (a request's id, or seq-N), gone once freed."""
    handle = batch.new_sequence(tiny_engine, server.scheduler.config.cache)
    batch.step(tiny_engine, [(handle, list(range(5, 45)))])
    held = batch.bytes_by_sequence(tiny_engine)[batch.sequence_id(handle)]
    assert held == 3 * 12 * 1024            # 40 tokens: 3 blocks of 12 KiB (see SERVE_CACHE above)
    server.metrics.update_kv_bytes({batch.sequence_id(handle): "req-mine"})
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
    assert f'kvchat_sequence_kv_bytes{{model_name="tiny",sequence="req-mine"}} {float(held)}' in text
    batch.release(tiny_engine, handle)
    server.metrics.update_kv_bytes()
    assert 'sequence="req-mine"' not in httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text


def test_a_request_shows_as_running_before_its_first_token_goes_out(tiny_engine):
    """A client that has seen a token and then reads /metrics sees its request running (the app's dashboard
    looks right after the first token; before, the gauge moved only after the step's tokens were out)."""
    from kvchat.engine.serve.metrics import ServeMetrics
    sched = Scheduler(tiny_engine, SchedulerConfig(SERVE_CACHE, 4, prefill_chunk=32),
                      ServeMetrics(tiny_engine, "tiny-running"))
    seen = []
    registry = sched.metrics.registry
    sched.submit(Request([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=3),
                         lambda e: seen.append((type(e).__name__, registry.get_sample_value(
                             "vllm:num_requests_running", {"model_name": "tiny-running", "engine": "0"})))))
    for _ in range(20):
        sched.step()
        if any(kind == "Finished" for kind, _ in seen):
            break
    tokens = [running for kind, running in seen if kind == "TokenOut"]
    assert tokens and all(running == 1 for running in tokens), seen
