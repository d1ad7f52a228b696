"""The OpenAI wire format: request validation, error objects, response and stream chunks, stop strings.

Plain dicts in and out; no web framework here.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from kvchat.engine.config import (LOGIT_BIAS_RANGE, PRESENCE_PENALTY_RANGE, REPETITION_PENALTY_RANGE, ConfigError,
                                 SamplingParams)
from kvchat.engine.events import FinishReason

MAX_STOP_STRINGS = 4
GREEDY_BELOW = 1e-5         # logits divided by less overflow float32: the softmax would be NaN
SEED_RANGE = (-2**63, 2**64 - 1)    # what torch.Generator.manual_seed takes


class APIError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request: what to generate and how to answer."""
    kind: str                       # "chat" or "completion"
    model: str
    messages: list[dict] | None
    prompt: str | list[int] | None
    params: SamplingParams
    max_tokens_given: bool
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False        # vLLM's extra: generate to max_tokens through end-of-sequence tokens
    max_tokens_field: str = "max_tokens"    # the name the limit came under (chat's max_completion_tokens too)


def _number(body: dict, name: str, default, lo=None, hi=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise bad_request(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"'{name}' is {value}; it must be a finite number", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"'{name}' is {value}; it must be between {lo} and {hi}", name)
    return value


def _unsupported(name: str, what: str) -> APIError:
    return bad_request(f"'{name}' is not supported by this server: {what}", name, "unsupported_parameter")


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias from -100 to 100} -> {id: bias}."""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases from -100 to 100", "logit_bias")
    bias = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20):
            raise bad_request(f"'logit_bias' keys are token ids (whole numbers from 0), got {key[:40]!r}", "logit_bias")
        bias[int(key)] = _number({"logit_bias": value}, "logit_bias", None, *LOGIT_BIAS_RANGE)
    return bias


def _refuse_unsupported(body: dict, kind: str) -> None:
    """Fields this server cannot honour are refused, never ignored: a 200 in plain text would claim it did."""
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise _unsupported(name, "it answers in plain text and makes no tool calls")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise _unsupported(name, "it answers in plain text and makes no tool calls")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        shown = response_format.get("type") if isinstance(response_format, dict) else response_format
        raise _unsupported("response_format", f"{shown!r} (only {{\"type\": \"text\"}}): it answers in plain text, "
                                              f"not constrained to a format or schema")
    if kind == "chat":
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise bad_request(f"'logprobs' must be true or false, got {logprobs!r}", "logprobs")
        if logprobs:
            raise _unsupported("logprobs", "it returns no log probabilities")
        if _number(body, "top_logprobs", 0, 0, 20, integer=True):
            raise _unsupported("top_logprobs", "it returns no log probabilities")
    else:
        if _number(body, "logprobs", 0, 0, 5, integer=True):
            raise _unsupported("logprobs", "it returns no log probabilities")
        best_of = _number(body, "best_of", 1, 1, None, integer=True)
        if best_of != 1:
            raise bad_request(f"only best_of=1 is supported (one completion per request), got best_of={best_of}",
                              "best_of", "unsupported_parameter")
        if body.get("echo") not in (None, False):
            raise _unsupported("echo", "it returns the completion without the prompt")
        if body.get("suffix") not in (None, ""):
            raise _unsupported("suffix", "it completes after the prompt only")


def _content_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):       # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")


def parse(body, kind: str) -> Parsed:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: GET /v1/models lists the one this server holds", "model")
    messages = prompt = None
    if kind == "chat":
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages")
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
                raise bad_request(f"messages[{i}] needs a role of system, user or assistant", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            messages.append({"role": role, "content": _content_text(m.get("content"), i)})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                         all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt))
        if not ok:
            raise bad_request("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    n = _number(body, "n", 1, 1, None, integer=True)
    if n != 1:
        raise bad_request(f"only n=1 is supported (one choice per request), got n={n}", "n", "unsupported_parameter")
    _refuse_unsupported(body, kind)
    max_tokens, max_tokens_field = None, "max_tokens"
    for name in ("max_tokens", "max_completion_tokens") if kind == "chat" else ("max_tokens",):
        value = _number(body, name, None, 1, None, integer=True)
        if value is not None:           # OpenAI's newer name wins where both are sent
            max_tokens, max_tokens_field = value, name
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        stop = tuple(stop)
    else:
        raise bad_request(f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings", "stop")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    try:
        params = SamplingParams(
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
            top_k=0 if body.get("top_k") in (None, -1) else _number(body, "top_k", 0, 0, 2**31 - 1, integer=True),
            repetition_penalty=float(_number(body, "repetition_penalty", 1.0, *REPETITION_PENALTY_RANGE)),
            presence_penalty=float(_number(body, "presence_penalty", 0.0, *PRESENCE_PENALTY_RANGE)),
            frequency_penalty=float(_number(body, "frequency_penalty", 0.0, *PRESENCE_PENALTY_RANGE)),
            logit_bias=_logit_bias(body),
            max_new_tokens=max_tokens or 1,
            seed=_number(body, "seed", None, *SEED_RANGE, integer=True),
        )
    except ConfigError as exc:
        raise bad_request(str(exc)) from None
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be true or false", "ignore_eos")
    return Parsed(kind, model, messages, prompt, params, max_tokens is not None, tuple(s for s in stop if s),
                  bool(stream), bool(options.get("include_usage")), ignore_eos, max_tokens_field)


class StopMatcher:
    """Cuts the text at the first stop string and holds back any tail that could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add decoded text; returns what may be sent now."""
        self.text += delta
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        safe = len(self.text) if self.stopped else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


# The engine's finish reasons in OpenAI's words (and vLLM's finished_reason metric label, which adds abort and
# error): a reply that ended by itself or at a stop string is "stop"; one cut by a limit is "length".
OPENAI_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP_STRING: "stop", FinishReason.STOPPED: "stop",
                 FinishReason.LENGTH: "length", FinishReason.CONTEXT: "length", FinishReason.BUDGET: "length",
                 FinishReason.ABORTED: "abort", FinishReason.ERROR: "error"}


def openai_finish(reason: FinishReason) -> str:
    return OPENAI_FINISH[reason]


def from_openai_finish(finish: str) -> FinishReason:
    """A server's finish_reason in the engine's words; anything but "stop" ended at a limit."""
    return FinishReason.EOS if finish == "stop" else FinishReason.LENGTH


def response(kind: str, rid: str, model: str, text: str, reason: FinishReason, num_prompt: int,
             num_completion: int, reasoning: str = "") -> dict:
    """A whole answer. A chat reply's reasoning (gpt-oss's analysis channel) is no part of `content`: it goes in
    `reasoning_content`, as llama.cpp's server and vLLM send it, and only where there is some."""
    finish = openai_finish(reason)
    message = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    choice = ({"index": 0, "message": message, "finish_reason": finish, "logprobs": None} if kind == "chat" else
              {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(num_prompt, num_completion)}


def chunk(kind: str, rid: str, model: str, text: str | None, reason: FinishReason | None = None, first: bool = False,
          usage_: dict | None = None, reasoning: str = "") -> dict:
    """One event of a stream; a chat reply's reasoning goes in `delta.reasoning_content`, apart from `content`."""
    finish = None if reason is None else openai_finish(reason)
    out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
           "created": int(time.time()), "model": model}
    if usage_ is not None:
        out["choices"] = []
        out["usage"] = usage_
        return out
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        if reasoning:
            delta["reasoning_content"] = reasoning
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    return out
