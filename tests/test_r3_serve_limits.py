"""Issue 37, round three, items 14 and 18: a max_new_tokens far past the context ends at the context, promptly,
with speculation on; logits that are not finite end the turn with one clear line (session, server, CLI)."""
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvchat.cli.terminal import main as cli_main
from kvchat.engine import CacheConfig, Engine, EngineConfig, SamplingParams
from kvchat.engine.config import ConfigError
from kvchat.engine.events import FinishReason, TurnFinished
from kvchat.engine.runtime.sampling import NON_FINITE_MESSAGE
from kvchat.engine.serve.scheduler import Finished, Request
from kvchat.engine.serve.server import ServeConfig, Server
from tiny_models import tiny_model_dir

CONTEXT = 96
CACHE = CacheConfig(k_format="fp32", v_format="fp32", budget_mb=1)
TURN_S = 60.0           # a turn of CONTEXT tokens on a tiny model takes well under a second


@pytest.fixture(scope="module")
def short_engine(tmp_path_factory):
    """A tiny model with a context of CONTEXT tokens and the default speculation (prompt lookup)."""
    folder = tiny_model_dir(tmp_path_factory.mktemp("short"), hidden=64, layers=2, max_positions=CONTEXT)
    engine = Engine.load(EngineConfig(model=folder))
    assert engine.config.speculative.method == "lookup"
    return engine


def _no_stop(engine) -> dict[int, float]:
    """A logit bias that keeps the model from ending its reply by itself: the turn must run to a limit."""
    return {i: -100.0 for i in engine.stop_ids}


def _finish_in_time(send) -> TurnFinished | None:
    """Runs a turn in a thread; its TurnFinished, or None when it has not ended within TURN_S (it spins on)."""
    done: list = []
    thread = threading.Thread(target=lambda: done.extend(e for e in send() if isinstance(e, TurnFinished)),
                              daemon=True)
    thread.start()
    thread.join(TURN_S)
    return done[-1] if done else None


# ---- item 14 --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_max_new_tokens_of_10_to_the_12_ends_at_the_context_with_speculation_on(short_engine, temperature):
    """max_new_tokens 10**12, speculation on: the turn ends at the context within TURN_S (before, the room for
    drafts was counted down from 10**12 one by one inside the first decode step)."""
    session = short_engine.new_session(cache=CACHE)
    params = SamplingParams(temperature=temperature, max_new_tokens=10**12, logit_bias=_no_stop(short_engine))
    started = time.monotonic()
    finished = _finish_in_time(lambda: session.send("Hello! How are you?", params))
    assert finished is not None, "the turn did not end"
    assert finished.finish_reason in (FinishReason.CONTEXT, FinishReason.LENGTH)
    assert finished.stats.spec is not None and finished.stats.spec.steps > 0      # speculation was on
    assert len(session.token_ids) >= CONTEXT - 1 and time.monotonic() - started < TURN_S


@pytest.fixture(scope="module")
def short_server(short_engine):
    srv = Server(short_engine, ServeConfig(port=0, model_id="short"), CACHE)
    srv.start()
    yield srv
    srv.stop()


def test_the_server_answers_max_tokens_of_10_to_the_12_promptly(short_server, short_engine):
    """Over HTTP a max_tokens past the context is a prompt 400 naming it; without max_tokens the reply runs to the
    context; a scheduler request of 10**12 tokens ends at the context."""
    url = short_server.base_url + "/completions"
    started = time.monotonic()
    r = httpx.post(url, json={"model": "short", "prompt": [5, 6, 7], "max_tokens": 10**12}, timeout=TURN_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    bias = {str(i): b for i, b in _no_stop(short_engine).items()}
    r = httpx.post(url, json={"model": "short", "prompt": [5, 6, 7], "temperature": 0, "logit_bias": bias},
                   timeout=TURN_S)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == CONTEXT - 3
    events, done = [], threading.Event()

    def emit(event):
        events.append(event)
        if isinstance(event, Finished):
            done.set()
    params = SamplingParams(temperature=0, max_new_tokens=10**12, logit_bias=_no_stop(short_engine))
    short_server.scheduler.submit(Request([5, 6, 7], params, emit))
    assert done.wait(TURN_S) and events[-1].reason == FinishReason.CONTEXT
    assert time.monotonic() - started < TURN_S


# ---- item 18 --------------------------------------------------------------------------------------------------

def test_a_repetition_penalty_that_overflows_is_refused_naming_the_field():
    """1e-300 passed every check and made the penalized logits infinite; now SamplingParams names the range."""
    for bad in (1e-300, 0.0, 1e6, float("nan")):
        with pytest.raises(ConfigError, match=r"repetition_penalty=.*from 0.01 to 100"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(repetition_penalty=1.3).repetition_penalty == 1.3


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> str:
    """A tiny model saved, then one weight of one layer set to NaN: every logit it gives is NaN."""
    from safetensors.torch import load_file, save_file
    folder = Path(tiny_model_dir(tmp_path_factory.mktemp("nan"), hidden=64, layers=2, max_positions=CONTEXT))
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def nan_engine(nan_model):
    return Engine.load(EngineConfig(model=nan_model))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_new_tokens=8),
                                    SamplingParams(temperature=0.8, max_new_tokens=8),
                                    SamplingParams(temperature=0.8, max_new_tokens=8, seed=1)])
def test_nan_logits_end_the_turn_with_one_clear_line(nan_engine, params):
    """Greedy returned an empty reply silently and sampling raised; now the turn ends with ERROR and the message."""
    session = nan_engine.new_session(cache=CACHE)
    events = list(session.send("Hello!", params))
    finished = events[-1]
    assert isinstance(finished, TurnFinished) and finished.finish_reason == FinishReason.ERROR
    assert finished.message == NON_FINITE_MESSAGE and "\n" not in finished.message
    assert finished.text == "" and session.messages[-1] == {"role": "assistant", "content": ""}
    assert session.seq.num_tokens == len(session.token_ids)        # the cache holds the conversation, no more


def test_the_server_answers_nan_logits_with_a_clean_error_and_lives_on(nan_engine):
    srv = Server(nan_engine, ServeConfig(port=0, model_id="nan"), CACHE)
    srv.start()
    try:
        for stream in (False, True):
            r = httpx.post(srv.base_url + "/completions", json={"model": "nan", "prompt": [5, 6, 7], "max_tokens": 4,
                                                                 "temperature": 0.7, "stream": stream}, timeout=30)
            if stream:
                assert r.status_code == 200 and '"code": "non_finite_logits"' in r.text and "Traceback" not in r.text
            else:
                error = r.json()["error"]
                assert r.status_code == 500 and error["code"] == "non_finite_logits"
                assert NON_FINITE_MESSAGE in error["message"] and "Traceback" not in r.text
        assert httpx.get(srv.base_url.removesuffix("/v1") + "/health").status_code == 200
    finally:
        srv.stop()


def test_the_cli_prints_one_line_for_nan_logits(nan_model, capsys):
    code = cli_main(["chat", "--model", nan_model, "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("!")] == [f"! {NON_FINITE_MESSAGE}"]
