"""Issue 37, round three, items 11 and 22: every number the server reads is checked, nothing it cannot honour is
ignored (tools, response formats), what it can honour is (logit bias, presence and frequency penalties), and no
connection holds it open for nothing."""
import json
import socket
import time

import httpx
import numpy as np
import pytest
import torch

from kvchat.engine import CacheConfig, SamplingParams
from kvchat.engine.runtime.sampling import sample, sample_numpy
from kvchat.engine.serve.server import ServeConfig, Server

CACHE = CacheConfig(k_format="fp32", v_format="fp32", budget_mb=0.5)
JSON = {"content-type": "application/json"}
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_engine):
    srv = Server(tiny_engine, ServeConfig(port=0, model_id="tiny", read_timeout_s=READ_TIMEOUT_S), CACHE)
    srv.start()
    yield srv
    srv.stop()


def _post(server, path: str, content: str) -> httpx.Response:
    return httpx.post(server.base_url + path, content=content, headers=JSON, timeout=30)


def _base(kind: str) -> str:
    return ('{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]' if kind == "chat"
            else '{"model": "tiny", "max_tokens": 2, "prompt": [5, 6, 7]')


# ---- item 11: every numeric field of both endpoints ------------------------------------------------------------

COMMON = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "n",
          "max_tokens", "logit_bias")
NUMERIC = {"chat": COMMON + ("max_completion_tokens", "top_logprobs"), "completion": COMMON + ("best_of", "logprobs")}
BAD = ("NaN", "Infinity", "-Infinity", "1e308", str(10**30), '"1"', "[1]", "true")
CASES = [(kind, field, raw) for kind, fields in NUMERIC.items() for field in fields for raw in BAD
         if not (kind == "chat" and field == "logprobs" and raw == "true")]


@pytest.mark.parametrize("kind, field, raw", CASES)
def test_every_numeric_field_refuses_non_finite_huge_and_wrong_types_naming_the_field(server, kind, field, raw):
    """NaN, +-inf, a huge value, a string, a list or a bool where a number goes: a 400 naming the field."""
    value = '{"5": ' + raw + "}" if field == "logit_bias" else raw      # logit_bias's numbers are its values
    r = _post(server, "/chat/completions" if kind == "chat" else "/completions",
              _base(kind) + f', "{field}": {value}' + "}")
    assert r.status_code == 400, (field, raw, r.text)
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_the_numeric_fields_still_take_good_values(server):
    """The same fields at ordinary values answer 200 (the checks refuse only what is wrong)."""
    good = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "seed": 3, "n": 1, "logit_bias": {"5": 1.5}}
    chat = _post(server, "/chat/completions", _base("chat") + ", " + json.dumps(
        {**good, "max_completion_tokens": 3, "top_logprobs": 0, "logprobs": False})[1:])
    completion = _post(server, "/completions", _base("completion") + ", " + json.dumps(
        {**good, "best_of": 1, "logprobs": 0})[1:])
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 3, chat.text
    assert completion.status_code == 200, completion.text


def test_a_repetition_penalty_that_makes_logits_infinite_is_refused(server):
    """repetition_penalty 1e-300 (every penalized logit / 1e-300 is infinite) is a 400, as SamplingParams refuses it."""
    r = _post(server, "/completions", _base("completion") + ', "repetition_penalty": 1e-300}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


# ---- item 22: refused, not ignored ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
])
def test_tools_and_response_formats_are_400_not_supported(server, field, value):
    r = _post(server, "/chat/completions", _base("chat") + f', "{field}": {json.dumps(value)}' + "}")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "not supported" in error["message"] and field in error["message"]


def test_plain_text_format_and_no_tools_are_accepted(server):
    r = _post(server, "/chat/completions", _base("chat") + ', "response_format": {"type": "text"}, "tools": [], '
                                                          '"tool_choice": "none"}')
    assert r.status_code == 200, r.text


def _completion(server, **extra) -> dict:
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, **extra}
    r = _post(server, "/completions", json.dumps(body))
    assert r.status_code == 200, r.text
    return r.json()


def _ids(tiny_engine, text: str) -> list[int]:
    return tiny_engine.tokenizer.encode(text, add_special_tokens=False)


def test_logit_bias_moves_the_choice(server, tiny_engine):
    """+100 on one token makes greedy choose only it; -100 on the plain first choice makes greedy avoid it."""
    plain = _completion(server)["choices"][0]["text"]
    pushed = _completion(server, logit_bias={"40": 100})["choices"][0]["text"]
    assert pushed == tiny_engine.tokenizer.decode([40] * 8)
    first = _ids(tiny_engine, plain)[0]
    banned = _completion(server, logit_bias={str(first): -100})["choices"][0]["text"]
    assert first not in _ids(tiny_engine, banned)
    r = _post(server, "/completions", json.dumps({"model": "tiny", "prompt": [5], "logit_bias": {"999999": 1}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_presence_and_frequency_penalties_break_a_repetition(server, tiny_engine):
    """Three tokens lifted far above the rest: greedy repeats one of them; with the penalties each one generated
    loses ground, so the reply moves among them."""
    bias = {"40": 100, "41": 100, "42": 100}
    repeats = {tiny_engine.tokenizer.decode([t] * 8) for t in (40, 41, 42)}
    plain = _completion(server, logit_bias=bias)["choices"][0]["text"]
    penalized = _completion(server, logit_bias=bias, presence_penalty=2, frequency_penalty=2)["choices"][0]["text"]
    assert plain in repeats and penalized not in repeats, (plain, penalized)
    assert _completion(server, logit_bias=bias, presence_penalty=0, frequency_penalty=0)["choices"][0]["text"] == plain


def test_the_penalties_and_bias_choose_alike_in_both_samplers():
    """sample (torch) and sample_numpy (the one-shot path) apply the bias and penalties alike: same greedy choice."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(50, generator=g)
        generated = torch.randint(0, 50, (12,), generator=g).tolist()
        params = SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.2,
                                logit_bias={int(generated[0]): 2.5, 3: -1.0})
        want = sample(logits, params, generated, None, generated)
        assert sample_numpy(logits.numpy(), params, generated, np.random.default_rng(0), generated) == want


# ---- item 22: half-open connections --------------------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True once the server closed the connection (EOF or a reset) within `seconds`; what it sent is dropped."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return False


def _connect(server) -> socket.socket:
    host, port = server._socket.getsockname()[:2]
    return socket.create_connection((host, port), timeout=5)


def test_half_a_request_line_is_closed_by_the_server(server):
    """A socket that sends half a request line and waits is closed within a bounded time."""
    with _connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/compl")
        assert _closed_within(sock, READ_TIMEOUT_S + 4)
        assert time.monotonic() - started < READ_TIMEOUT_S + 4


def test_headers_trickled_a_byte_at_a_time_do_not_extend_the_deadline(server):
    with _connect(server) as sock:
        started = time.monotonic()
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
                if time.monotonic() - started > READ_TIMEOUT_S + 4:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed_within(sock, 1.0)
        assert time.monotonic() - started < READ_TIMEOUT_S + 4


def test_a_body_that_stops_coming_is_408(server):
    """Headers that promise 100 bytes, 10 sent: a 408 within a bounded time, not a connection held forever."""
    with _connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"model": ')
        sock.settimeout(READ_TIMEOUT_S + 4)
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < READ_TIMEOUT_S + 4


def test_a_kept_alive_connection_still_answers_and_a_prompt_client_is_not_cut(server):
    """The deadline is for a request's line and headers only: requests on one connection are answered."""
    with httpx.Client(timeout=10) as client:
        for _ in range(3):
            assert client.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200
            time.sleep(READ_TIMEOUT_S * 0.6)


def test_greedy_speculation_with_penalties_and_bias_is_plain_decoding(tiny_llama):
    """The verification applies the penalties over the reply with each accepted draft in it, as plain decoding does
    over its own tokens: the same tokens with prompt lookup as without."""
    from kvchat.engine import Engine, EngineConfig, SpeculativeConfig
    from kvchat.engine.events import TurnFinished
    engine = Engine.load(EngineConfig(model=tiny_llama))
    params = SamplingParams(temperature=0, max_new_tokens=40, presence_penalty=0.2, frequency_penalty=0.1,
                            logit_bias={40: 0.5})
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    runs = []
    for spec in (SpeculativeConfig("off"), SpeculativeConfig("lookup", k=6, ngram_min=1, adaptive=False)):
        engine.set_speculative(spec)
        session = engine.new_session(cache=CACHE, prefix_cache=False)
        finished = [e for e in session.send(prompt, params) if isinstance(e, TurnFinished)][-1]
        runs.append((session.token_ids, finished.stats.spec))
    (plain, _), (speculated, stats) = runs
    assert speculated == plain
    assert stats.drafted > 0 and stats.accepted > 0, stats
