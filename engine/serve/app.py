"""The HTTP side: a Starlette-on-FastAPI app that turns OpenAI requests into scheduler requests.

Tokenizing, detokenizing and stop strings happen here, in the event loop; the scheduler deals in
token ids on its own thread and hands tokens back through call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..detok import StreamDecoder
from . import batch, protocol
from .metrics import CONTENT_TYPE_LATEST, ServeMetrics
from .protocol import APIError, bad_request
from .scheduler import Finished, QueueFull, Request, Scheduler, TokenOut

DISCONNECT_POLL_S = 0.5


def _context_error(message: str) -> APIError:
    return bad_request(message, "messages", "context_length_exceeded")


class Generation:
    """One request in flight: tokens from the engine thread become text, cut at stop strings."""

    def __init__(self, app_state: "ServeState", parsed: protocol.Parsed, prompt_ids: list[int]):
        self.state = app_state
        self.parsed = parsed
        self.queue: asyncio.Queue = asyncio.Queue()
        self.decoder = StreamDecoder(app_state.tokenizer)
        self.stops = protocol.StopMatcher(parsed.stop)
        self.num_prompt = len(prompt_ids)
        self.num_completion = 0
        self.finish: str | None = None
        loop = asyncio.get_running_loop()

        def emit(event):        # engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:    # the loop closed under a shutdown: nobody is listening
                pass

        limit = app_state.max_context
        max_new = parsed.params.max_new_tokens if parsed.max_tokens_given else limit - len(prompt_ids)
        self.request = Request(prompt_ids, replace(parsed.params, max_new_tokens=max_new), emit,
                               ignore_eos=parsed.ignore_eos)

    def submit(self) -> None:
        try:
            self.state.scheduler.submit(self.request)
        except QueueFull as exc:
            raise APIError(503, f"The server is busy ({exc}); retry in a moment.", "server_error",
                           code="server_busy") from None

    def abort(self) -> None:
        if self.finish is None:
            self.state.scheduler.abort(self.request.id)

    async def next(self, timeout: float | None = None) -> str | None:
        """The next piece of text ("" when nothing is safe to show yet), or None once finished."""
        while self.finish is None:
            event = await asyncio.wait_for(self.queue.get(), timeout) if timeout else await self.queue.get()
            if isinstance(event, TokenOut):
                if self.stops.stopped:
                    continue
                self.num_completion += 1
                text = self.stops.push(self.decoder.push(event.token_id))
                if self.stops.stopped:
                    self.state.scheduler.abort(self.request.id)
                    self.finish = "stop"
                return text
            if self.stops.stopped:
                self.finish = "stop"
                return ""
            self.finish = self._finish_reason(event)
            text = self.stops.push(self.decoder.flush())     # bytes held back may complete a stop string
            if self.stops.stopped:
                self.finish = "stop"
            return text + self.stops.flush()
        return None

    def _finish_reason(self, event: Finished) -> str:
        if event.reason in ("stop", "length"):
            return event.reason
        if event.reason == "abort":
            raise APIError(503, f"The request was cancelled: {event.message or 'aborted'}.", "server_error",
                           code="cancelled")
        raise APIError(500, f"Generation failed: {event.message}", "server_error", code="internal_error")


class ServeState:
    def __init__(self, engine, scheduler: Scheduler, metrics: ServeMetrics, model_id: str, api_key: str | None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.scheduler = scheduler
        self.metrics = metrics
        self.model_id = model_id
        self.api_key = api_key
        self.max_context = batch.max_context(engine)
        self.created = int(time.time())

    def prompt_ids(self, parsed: protocol.Parsed) -> list[int]:
        tok = self.tokenizer
        if parsed.kind == "chat":
            if not getattr(tok, "chat_template", None):
                raise bad_request("this model has no chat template: use /v1/completions with a plain prompt")
            text = tok.apply_chat_template(parsed.messages, tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
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
            want = len(ids) + (parsed.params.max_new_tokens if parsed.max_tokens_given else 0)
            raise _context_error(f"This model's maximum context length is {limit} tokens. However, you requested "
                                 f"{want} tokens ({len(ids)} in the messages, "
                                 f"{parsed.params.max_new_tokens if parsed.max_tokens_given else 0} in the "
                                 f"completion). Please reduce the length of the messages or completion.")
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
    async def check_key(request: HTTPRequest, call_next):
        if state.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                return _error_response(APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>' "
                                                     "with the key the server was started with.",
                                                "invalid_request_error", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
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
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"The body is not valid JSON: {exc}") from None
        parsed = protocol.parse(body, kind)
        if parsed.model != state.model_id:
            raise APIError(404, f"The model `{parsed.model}` does not exist: this server holds `{state.model_id}`.",
                           "invalid_request_error", "model", "model_not_found")
        gen = Generation(state, parsed, state.prompt_ids(parsed))
        gen.submit()
        rid = protocol.new_id(kind)
        if parsed.stream:
            return StreamingResponse(_stream(gen, rid, kind), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces = []
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
                pieces.append(piece)
        finally:
            gen.abort()
        return protocol.response(kind, rid, state.model_id, "".join(pieces), gen.finish, gen.num_prompt,
                                 gen.num_completion)

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
                if piece:
                    yield _sse(protocol.chunk(kind, rid, model, piece))
            yield b"data: [DONE]\n\n"
        finally:
            gen.abort()         # the client went away mid-stream: its blocks go back now

    return app
