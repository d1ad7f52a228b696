"""The HTTP side: a Starlette-on-FastAPI app that turns OpenAI requests into scheduler requests.

guard.py decides who may call and how much they may send; prompts are rendered and tokenized in a
worker thread under a deadline, so the event loop stays free; detokenizing and stop strings happen
in the event loop; the scheduler deals in token ids on its own thread and hands tokens back through
call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvchat.engine.text.chat_format import ChatTemplateError, encode_conversation, last_message, tokenize_pieces
from kvchat.engine.text.reasoning import PLAIN
from kvchat.engine.text.reply import reply_format
from kvchat.engine.events import FinishReason
from kvchat.engine.serve import batch
from kvchat.engine.serve import guard
from kvchat.engine.serve import protocol
from kvchat.engine.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from kvchat.engine.serve.protocol import APIError, bad_request
from kvchat.engine.serve.scheduler import Finished, QueueFull, Request, Scheduler, TokenOut

DISCONNECT_POLL_S = 0.5
PROMPT_TIMEOUT_S = 10.0         # render and tokenize; the template's own limit (3 s) ends a runaway render first
MAX_CHARS_PER_TOKEN = 64        # more text than this per token of context cannot fit: refused untokenized
PROMPT_WORKERS = 4


def _engine_dead() -> APIError:
    return APIError(503, "The server's engine thread has stopped: restart kvchat serve.", "server_error",
                    code="engine_dead")


def _context_error(message: str) -> APIError:
    return bad_request(message, "messages", "context_length_exceeded")


class PromptIds(list):
    """A request's prompt token ids, and where its newest message's tokens begin (0: not known)."""
    message_start = 0


class Generation:
    """One request in flight: tokens from the engine thread become text, cut at stop strings. A chat reply of a model
    that reasons apart (gpt-oss) comes as two parts: the reasoning, never cut, and the answer, which the stop
    strings cut; a completion is the model's text as it came."""

    def __init__(self, app_state: "ServeState", parsed: protocol.Parsed, prompt_ids: list[int]):
        self.state = app_state
        self.parsed = parsed
        self.queue: asyncio.Queue = asyncio.Queue()
        fmt = app_state.reply_format if parsed.kind == "chat" else PLAIN
        self.parts = fmt.parser(app_state.tokenizer)
        self.stops = protocol.StopMatcher(parsed.stop)
        self.num_prompt = len(prompt_ids)
        self.num_completion = 0
        self.finish: FinishReason | None = None
        loop = asyncio.get_running_loop()

        def emit(event):        # engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:    # the loop closed under a shutdown: nobody is listening
                pass

        limit = app_state.max_context
        max_new = parsed.params.max_new_tokens if parsed.max_tokens_given else limit - len(prompt_ids)
        self.request = Request(prompt_ids, replace(parsed.params, max_new_tokens=max_new), emit,
                               ignore_eos=parsed.ignore_eos, message_start=getattr(prompt_ids, "message_start", 0))

    def submit(self) -> None:
        if not self.state.scheduler.is_alive():
            raise _engine_dead()
        try:
            self.state.scheduler.submit(self.request)
        except QueueFull as exc:
            raise APIError(503, f"The server is busy ({exc}); retry in a moment.", "server_error",
                           code="server_busy") from None

    def abort(self) -> None:
        if self.finish is None:
            self.state.scheduler.abort(self.request.id)

    async def next(self, timeout: float | None = None) -> tuple[str, str] | None:
        """The next pieces of (answer, reasoning) ("" when nothing is safe to show yet), or None once finished."""
        while self.finish is None:
            event = await asyncio.wait_for(self.queue.get(), timeout) if timeout else await self.queue.get()
            if isinstance(event, TokenOut):
                if self.stops.stopped:
                    continue
                self.num_completion += 1
                text, reasoning = self.parts.push(event.token_id)
                text = self.stops.push(text)
                if self.stops.stopped:
                    self.state.scheduler.abort(self.request.id)
                    self.finish = FinishReason.STOP_STRING
                return text, reasoning
            if self.stops.stopped:
                self.finish = FinishReason.STOP_STRING
                return "", ""
            self.finish = self._finish_reason(event)
            text, reasoning = self.parts.flush()
            text = self.stops.push(text)        # bytes held back may complete a stop string
            if self.stops.stopped:
                self.finish = FinishReason.STOP_STRING
            return text + self.stops.flush(), reasoning
        return None

    def _finish_reason(self, event: Finished) -> FinishReason:
        if event.reason == FinishReason.ABORTED:
            raise APIError(503, f"The request was cancelled: {event.message or 'aborted'}.", "server_error",
                           code="cancelled")
        if event.reason == FinishReason.ERROR:
            raise APIError(500, f"Generation failed: {event.message}", "server_error",
                           code=event.code or "internal_error")
        return event.reason


class ServeState:
    def __init__(self, engine, scheduler: Scheduler, metrics: ServeMetrics, model_id: str, api_key: str | None,
                 read_timeout_s: float = guard.READ_TIMEOUT_S):
        self.engine = engine
        self.read_timeout_s = read_timeout_s
        self.tokenizer = engine.tokenizer
        self.reply_format = reply_format(engine.tokenizer)     # a chat reply's reasoning apart (gpt-oss), or not
        self.scheduler = scheduler
        self.metrics = metrics
        self.model_id = model_id
        self.api_key = api_key
        self.max_context = batch.max_context(engine)
        self.vocab_size = batch.vocab_size(engine)
        self.max_body_bytes = guard.body_limit(self.max_context)
        self.created = int(time.time())
        self.prompt_pool = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="kvchat-serve-prompt")

    def _check_text_length(self, parsed: protocol.Parsed) -> None:
        texts = [m["content"] for m in parsed.messages] if parsed.kind == "chat" else [parsed.prompt]
        chars = sum(len(t) for t in texts if isinstance(t, str))
        if len(texts) >= self.max_context:      # every message takes a token at least
            raise _context_error(f"This model's maximum context length is {self.max_context} tokens, and the "
                                 f"request holds {len(texts):,} messages. Please send fewer messages.")
        if chars > MAX_CHARS_PER_TOKEN * self.max_context:
            raise _context_error(f"This model's maximum context length is {self.max_context} tokens, and the "
                                 f"request holds {chars:,} characters of text, far more than that many tokens "
                                 f"can hold. Please reduce the length of the messages.")

    def prompt_ids(self, parsed: protocol.Parsed) -> list[int]:
        """The prompt's token ids; runs in a worker thread (rendering and tokenizing take time)."""
        tok = self.tokenizer
        self._check_text_length(parsed)
        if parsed.kind == "chat":
            if not getattr(tok, "chat_template", None):
                raise bad_request("this model has no chat template: use /v1/completions with a plain prompt")
            try:    # as the app's session does: a special token's text inside a message stays plain text
                _, pieces = encode_conversation(tok, None, parsed.messages, where=self.engine.model_name)
            except ChatTemplateError as exc:
                raise bad_request(str(exc), "messages", "chat_template_error") from None
            starts: list[int | None] = []
            ids = PromptIds(tokenize_pieces(tok, pieces, starts=starts))
            if getattr(self.engine.runner, "state_layout", None) is not None:   # a recurrent state is kept where
                ids.message_start = last_message(pieces, starts) or 0           # the newest message begins
        elif isinstance(parsed.prompt, str):
            ids = tok.encode(parsed.prompt, add_special_tokens=True)
        else:
            vocab = len(tok)
            if any(t >= vocab for t in parsed.prompt):
                raise bad_request(f"token ids must be below the vocabulary size {vocab}", "prompt")
            ids = list(parsed.prompt)
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        limit = self.max_context
        if len(ids) >= limit or (parsed.max_tokens_given and len(ids) + parsed.params.max_new_tokens > limit):
            asked = parsed.params.max_new_tokens if parsed.max_tokens_given else 0
            field = parsed.max_tokens_field
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(ids) + asked} tokens ({len(ids)} in the messages, {asked} in the completion). "
                              f"Please reduce the length of the messages or '{field}'.",
                              "messages" if len(ids) >= limit else field, "context_length_exceeded")
        if not self.scheduler.prompt_fits_budget(len(ids)):
            budget = self.scheduler.config.cache.budget_mb
            raise _context_error(f"The prompt has {len(ids)} tokens, more than this server's whole KV cache budget "
                                 f"({budget:g} MiB) holds. Shorten the prompt, or restart the server with a larger "
                                 f"--budget-mb or a smaller --k-format/--v-format.")
        return ids


def _error_response(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="kvchat", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def on_api_error(_request, exc: APIError):
        return _error_response(exc)

    @app.middleware("http")
    async def check_caller(request: HTTPRequest, call_next):
        refused = guard.refusal(request, state.api_key)
        return _error_response(refused) if refused is not None else await call_next(request)

    @app.get("/health")
    async def health():
        if not state.scheduler.is_alive():
            return _error_response(_engine_dead())
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "kvchat", "max_model_len": state.max_context}]}

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await _complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await _complete(request, "completion")

    async def _complete(request: HTTPRequest, kind: str):
        raw = await guard.read_body(request, state.max_body_bytes, state.read_timeout_s)
        try:
            body = json.loads(raw)
        except RecursionError:
            raise bad_request("The body nests arrays or objects too deeply to be a request.") from None
        except ValueError as exc:        # JSONDecodeError, UnicodeDecodeError, an integer of thousands of digits
            raise bad_request(f"The body is not valid JSON: {exc}") from None
        parsed = protocol.parse(body, kind)
        past = [i for i, _ in parsed.params.logit_bias if i >= state.vocab_size]
        if past:
            raise bad_request(f"'logit_bias' names token id {past[0]}, outside the vocabulary "
                              f"(0-{state.vocab_size - 1})", "logit_bias")
        if parsed.model != state.model_id:
            raise APIError(404, f"The model `{parsed.model}` does not exist: this server holds `{state.model_id}`.",
                           "invalid_request_error", "model", "model_not_found")
        gen = Generation(state, parsed, await _prompt_ids(parsed))
        gen.submit()
        rid = protocol.new_id(kind)
        if parsed.stream:
            return StreamingResponse(_stream(gen, rid, kind), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces, thoughts = [], []
        try:
            while True:
                try:
                    piece = await gen.next(DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        gen.abort()
                        return Response(status_code=499)
                    continue
                if piece is None:
                    break
                pieces.append(piece[0])
                thoughts.append(piece[1])
        finally:
            gen.abort()
        return protocol.response(kind, rid, state.model_id, "".join(pieces), gen.finish, gen.num_prompt,
                                 gen.num_completion, "".join(thoughts))

    async def _prompt_ids(parsed: protocol.Parsed) -> list[int]:
        work = asyncio.get_running_loop().run_in_executor(state.prompt_pool, state.prompt_ids, parsed)
        try:
            return await asyncio.wait_for(work, PROMPT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"Preparing the prompt took longer than {PROMPT_TIMEOUT_S:g} s; retry with a shorter "
                                f"request.", "server_error", code="prompt_timeout") from None

    async def _stream(gen: Generation, rid: str, kind: str):
        model = state.model_id
        try:
            if kind == "chat":
                yield _sse(protocol.chunk(kind, rid, model, "", first=True))
            while True:
                try:
                    piece = await gen.next()
                except APIError as exc:
                    yield _sse(exc.body())
                    break
                if piece is None:
                    yield _sse(protocol.chunk(kind, rid, model, None, gen.finish))
                    if gen.parsed.include_usage:
                        yield _sse(protocol.chunk(kind, rid, model, None,
                                                  usage_=protocol.usage(gen.num_prompt, gen.num_completion)))
                    break
                if piece[0] or piece[1]:
                    yield _sse(protocol.chunk(kind, rid, model, piece[0], reasoning=piece[1]))
            yield b"data: [DONE]\n\n"
        finally:
            gen.abort()         # the client went away mid-stream: its blocks go back now

    return app
