"""A remote engine: chat with any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, kvchat serve).

Streaming chat over SSE with httpx; Stop closes the stream, which such servers take as an abort. Stats
combine what the stream shows (time to first token, tokens/s) with the server's /metrics under vLLM's
names when it has them (KV usage, running and waiting requests, prefix-cache hit rate).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import httpx

from kvchat.engine.runtime import memory
from kvchat.engine.api import REMOTE, EngineFacts
from kvchat.engine.config import CacheConfig, ConfigError, SamplingParams
from kvchat.engine.errors import UserError
from kvchat.engine.events import FinishReason, ServerStats, StatsSnapshot, TokenDelta, TurnFinished
from kvchat.engine.serve.protocol import from_openai_finish
from kvchat.engine.text.reasoning import assistant_message, without_reasoning

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0                  # a long prompt on a busy server may take minutes to start
METRICS_INTERVAL_S = 1.0                # /metrics is read at most this often (stats are asked for ~10x a second)


class RemoteError(UserError, RuntimeError):
    """The server could not be used; the message says what to check."""


@dataclass(slots=True)
class RemoteTurn:
    """The last turn's counts and times as the server's stream gave them, for stats()."""

    prompt_tokens: int = 0              # the server's usage, when it sends one
    completion_tokens: int = 0          # content chunks counted, or the server's usage
    decode_s: float = 0.0               # from the first chunk to the latest
    ttft_s: float = 0.0


def _v1(base_url: str) -> str:
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"server URL {base_url!r} must start with http:// or https://")
    return url if url.endswith("/v1") else url + "/v1"


def _cause(exc: Exception) -> str:
    """The short reason inside an httpx error: "incomplete chunked read", "Connection refused"."""
    text = str(exc).strip() or type(exc).__name__
    if text.endswith(")") and "(" in text:
        text = text[text.rindex("(") + 1:-1]
    return text.split("] ", 1)[-1] if text.startswith("[Errno") else text


def _error_text(response: httpx.Response) -> tuple[str, str | None]:
    try:
        error = response.json().get("error", {})
        if isinstance(error, dict):
            return str(error.get("message") or response.text), error.get("code")
        return str(error), None
    except (ValueError, AttributeError):
        return response.text.strip()[:300] or response.reason_phrase, None


class RemoteEngine:
    capabilities = REMOTE
    num_layers = 0                      # per-layer data is not available remotely
    weight_bytes = 0
    weights_label = "remote"
    notice = None

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None):
        self.base_url = _v1(base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers,
                                 timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        self.models = self._list_models()
        if model is None:
            model = self.models[0]
        elif model not in self.models:
            raise RemoteError(f"{self.base_url} does not serve {model!r}; it serves: {', '.join(self.models)}")
        self.model_name = model
        self.device = f"remote ({self.base_url})"
        self._metrics_url = self.base_url.removesuffix("/v1") + "/metrics"
        self._prefix_seen: tuple[float, float] | None = None
        self._metrics: tuple[float, ServerStats | None] | None = None    # (when read, what it said)

    @classmethod
    def connect(cls, base_url: str, api_key: str | None = None, model: str | None = None) -> "RemoteEngine":
        return cls(base_url, api_key, model)

    def _get(self, path: str) -> httpx.Response:
        try:
            return self.http.get(path)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach {self.base_url}: {exc}. Is the server running, and is the URL "
                              f"right (e.g. http://127.0.0.1:8000/v1)?") from None

    def describe(self) -> EngineFacts:
        """What this engine says about itself: a model elsewhere, nothing held here."""
        return EngineFacts(self.model_name, self.device, 0, self.weights_label)

    def _list_models(self) -> list[str]:
        r = self._get("/models")
        if r.status_code in (401, 403):
            raise RemoteError(f"{self.base_url} refused the API key ({_error_text(r)[0]}): check it in Settings")
        if r.status_code != 200:
            raise RemoteError(f"{self.base_url}/models answered {r.status_code}: {_error_text(r)[0]}")
        ids = [m.get("id") for m in r.json().get("data", []) if isinstance(m, dict) and m.get("id")]
        if not ids:
            raise RemoteError(f"{self.base_url} serves no model")
        return ids

    def new_session(self, system_prompt: str | None = None, cache: CacheConfig | None = None,
                    history: list[dict] | None = None) -> "RemoteSession":
        return RemoteSession(self, system_prompt, cache or CacheConfig(), history)

    def server_stats(self) -> ServerStats | None:
        """The server's /metrics under vLLM's names, read at most every METRICS_INTERVAL_S; None when it exposes
        none; `reachable=False` when nothing answers."""
        now = time.monotonic()
        if self._metrics is None or now - self._metrics[0] >= METRICS_INTERVAL_S:
            self._metrics = (now, self._read_metrics())
        return self._metrics[1]

    def refresh_metrics(self) -> None:
        """The next look reads /metrics again (a turn's first token: that look shows it running)."""
        self._metrics = None

    def mark_unreachable(self) -> None:
        self._metrics = (time.monotonic(), ServerStats(self._metrics_url, reachable=False))

    def _read_metrics(self) -> ServerStats | None:
        from prometheus_client.parser import text_string_to_metric_families
        try:
            r = self.http.get(self._metrics_url, timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError:
            return ServerStats(self._metrics_url, reachable=False)
        if r.status_code != 200:
            return None
        values: dict[str, list[float]] = {}
        try:
            for family in text_string_to_metric_families(r.text):
                for sample in family.samples:
                    values.setdefault(sample.name, []).append(sample.value)
        except ValueError:
            return None

        def first(*names, combine=sum):
            for name in names:
                if name in values:
                    return combine(values[name])
            return None

        usage = first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                      combine=lambda v: sum(v) / len(v))    # several data-parallel engines: their mean
        running = first("vllm:num_requests_running")
        waiting = first("vllm:num_requests_waiting")
        queries = first("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
        hits = first("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
        rate = None
        if queries is not None and hits is not None:
            seen_q, seen_h = self._prefix_seen or (0.0, 0.0)
            if queries > seen_q:
                rate = (hits - seen_h) / (queries - seen_q)
            self._prefix_seen = (queries, hits)
        drafted = first("vllm:spec_decode_num_draft_tokens_total")
        accepted = first("vllm:spec_decode_num_accepted_tokens_total")
        spec = accepted / drafted if drafted and accepted is not None else None
        if usage is None and running is None and waiting is None and rate is None:
            return None
        return ServerStats(self._metrics_url, usage, None if running is None else int(running),
                           None if waiting is None else int(waiting), rate, spec_acceptance=spec)


class RemoteSession:
    def __init__(self, engine: RemoteEngine, system_prompt: str | None, cache: CacheConfig,
                 history: list[dict] | None = None):
        self.engine = engine
        self.system_prompt = system_prompt
        self.messages: list[dict] = [dict(m) for m in history or ()]
        self._cache = cache
        self._turn = RemoteTurn()
        self._last_rate_tokens = 0

    @property
    def cache_config(self) -> CacheConfig:
        return self._cache

    def set_cache(self, config: CacheConfig) -> None:
        raise ConfigError("a remote server chooses its own KV cache format: change it where the server is "
                          "started (e.g. vLLM's --kv-cache-dtype)")

    def reset(self) -> int:
        """Nothing is held here; the server frees a request's blocks when it ends."""
        return 0

    def _body(self, text: str, params: SamplingParams) -> dict:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        history = [without_reasoning(m) for m in self.messages]      # earlier turns' reasoning is no part of a prompt
        body = {"model": self.engine.model_name, "messages": system + history + [{"role": "user", "content": text}],
                "stream": True, "stream_options": {"include_usage": True}, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        # not in OpenAI's schema; vLLM, SGLang and llama.cpp's server accept them
        if params.top_k:
            body["top_k"] = params.top_k
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty
        if params.presence_penalty:
            body["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            body["frequency_penalty"] = params.frequency_penalty
        if params.logit_bias:
            body["logit_bias"] = {str(i): bias for i, bias in params.logit_bias}
        return body

    def send(self, text: str, params: SamplingParams | None = None,
             should_stop: Callable[[], bool] | None = None) -> Iterator[TokenDelta | TurnFinished]:
        params = params or SamplingParams()
        self._turn = RemoteTurn()
        self.engine.refresh_metrics()
        started = time.perf_counter()
        pieces: list[str] = []
        thoughts: list[str] = []        # the reply's reasoning, where the server sends it apart (reasoning_content)
        reason, message, chunks = FinishReason.LENGTH, "", 0
        first_at, lost = None, None
        try:
            with self.engine.http.stream("POST", "/chat/completions", json=self._body(text, params)) as r:
                if r.status_code != 200:
                    r.read()
                    error, code = _error_text(r)
                    if code == "context_length_exceeded":
                        yield TurnFinished("", FinishReason.CONTEXT, error, self.stats())
                        return
                    raise RemoteError(f"the server answered {r.status_code}: {error}")
                self.messages.append({"role": "user", "content": text})
                for line in r.iter_lines():
                    if should_stop is not None and should_stop():
                        reason = FinishReason.STOPPED
                        break       # leaving the block closes the stream: the server aborts the request
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RemoteError(f"the server ended the reply: {_error_text_from(event)}")
                    if event.get("usage"):
                        self._turn.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                        self._turn.completion_tokens = event["usage"].get("completion_tokens", chunks)
                    for choice in event.get("choices") or ():
                        delta = choice.get("delta") or {}
                        piece = delta.get("content")
                        # llama.cpp's server and vLLM send a reasoning model's thinking apart (vLLM's newer name:
                        # reasoning); it is shown apart and never sent back in a later prompt
                        thought = delta.get("reasoning_content") or delta.get("reasoning")
                        if isinstance(thought, str) and thought:
                            thoughts.append(thought)
                            yield TokenDelta("", (), thought)
                        if piece:
                            now = time.perf_counter()
                            if first_at is None:
                                first_at = now
                                self._turn.ttft_s = now - started
                                self.engine.refresh_metrics()   # a look before now may predate the request
                            chunks += 1
                            self._turn.completion_tokens = chunks
                            self._turn.decode_s = now - first_at
                            pieces.append(piece)
                            yield TokenDelta(piece, ())
                        if choice.get("finish_reason"):
                            reason = from_openai_finish(choice["finish_reason"])
        except httpx.HTTPError as exc:
            lost = exc
        finally:
            if self.messages and self.messages[-1] == {"role": "user", "content": text}:
                if pieces or thoughts or lost is None:
                    self.messages.append(assistant_message("".join(pieces), "".join(thoughts)))
                else:
                    self.messages.pop()     # nothing came back: the turn is refused, as if never sent
        if lost is not None:
            self.engine.mark_unreachable()
            yield self._lost_turn(lost, "".join(pieces), "".join(thoughts))
            return
        yield TurnFinished("".join(pieces), reason, message, self.stats(), "".join(thoughts))

    def _lost_turn(self, exc: httpx.HTTPError, partial: str, reasoning: str = "") -> TurnFinished:
        """The server stopped answering: a partial reply (or its reasoning alone) is kept ("disconnected"); with
        none the message is refused ("unreachable"), so the app gives the text back."""
        cause, url = _cause(exc), self.engine.base_url
        if partial or reasoning:
            return TurnFinished(partial, FinishReason.DISCONNECTED,
                                f"the server went away mid-reply ({cause}); the partial reply is kept", self.stats(),
                                reasoning)
        if isinstance(exc, httpx.ConnectError):
            text = f"the server is unreachable ({cause} at {url}): start it again, or check the URL in Settings"
        else:
            text = f"the server went away before it replied ({cause}): start it again and resend"
        return TurnFinished("", FinishReason.UNREACHABLE, text + "; your message is back in the input box",
                            self.stats())

    def stats(self) -> StatsSnapshot:
        t = self._turn
        decoded = max(0, t.completion_tokens - 1)        # tokens after the first, over the time after it
        return StatsSnapshot(
            time_s=time.monotonic(), cache_label=f"remote: {self.engine.model_name}", layers=(), kv_bytes=0,
            budget_bytes=0, block_size=0, blocks_used=0, blocks_free=0, blocks_budget=0,
            tokens_in_context=t.prompt_tokens + t.completion_tokens, tokens_held=0, tokens_evicted=0,
            tokens_left=None, bytes_per_token=0.0, prefill_tokens=t.prompt_tokens, prefill_tok_s=0.0,
            decode_tok_s=decoded / t.decode_s if t.decode_s else 0.0, ttft_s=t.ttft_s,
            memory=memory.probe(), weights_label="remote", server=self.engine.server_stats())


def _error_text_from(event: dict) -> str:
    error = event.get("error")
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)
