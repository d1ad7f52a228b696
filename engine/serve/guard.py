"""Who may call the server and how much they may send, checked before a request reaches the model.

Without an API key the server answers only requests addressed to a loopback name and sent from no
other site: a web page the user visits can otherwise reach it, by DNS rebinding (its own name
resolving to 127.0.0.1, Ollama's CVE-2024-28224) or by a cross-site form post. A POST must say it is
JSON: text/plain is what a form sends without a CORS preflight.

A connection may not hold the server open for nothing: its request line and headers must arrive within a
deadline (HeaderDeadline; uvicorn itself times out only idle keep-alive connections), and its body within
another (read_body).
"""
from __future__ import annotations

import asyncio
import ipaddress
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvchat.engine.serve.protocol import APIError

MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32       # a context's worth of text, even JSON-escaped, or of token ids, fits
READ_TIMEOUT_S = 15.0           # for a request's line and headers, and again for its body


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name in a Host header: "[::1]:8000" -> "::1", "localhost:8000" -> "localhost"."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if ":" in value else value


def _forbidden(message: str, code: str) -> APIError:
    return APIError(403, message, "invalid_request_error", code=code)


def refusal(request, api_key: str | None) -> APIError | None:
    """Why this request is refused before it is read, or None."""
    headers = request.headers
    if not api_key:
        host = headers.get("host")
        if host is not None and not is_loopback(_host_name(host)):
            return _forbidden(f"This server answers only requests addressed to 127.0.0.1, localhost or [::1] "
                              f"(this one named {host!r}); start it with --api-key to serve other names.",
                              "forbidden_host")
        origin = headers.get("origin")
        if origin is not None and not is_loopback((urlsplit(origin).hostname or "").lower()):
            return _forbidden(f"Requests from web pages of other sites are refused (Origin {origin!r}); start the "
                              f"server with --api-key to serve browsers.", "forbidden_origin")
    elif request.url.path.startswith("/v1") and headers.get("authorization", "") != f"Bearer {api_key}":
        return APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server "
                             "was started with.", "invalid_request_error", code="invalid_api_key")
    if request.method == "POST":
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            return APIError(415, f"The body must be JSON sent as 'Content-Type: application/json' "
                                 f"(got {media or 'no content type'!r}).", "invalid_request_error",
                            code="unsupported_media_type")
    return None


def body_limit(max_context: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)


async def read_body(request, limit: int, timeout_s: float = READ_TIMEOUT_S) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes, declared or not (a chunked upload), and (408)
    when it has not all come within timeout_s."""
    try:
        return await asyncio.wait_for(_read_body(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s.", "invalid_request_error",
                       code="request_timeout") from None


async def _read_body(request, limit: int) -> bytes:
    too_large = APIError(413, f"The request body is over this server's limit of {limit:,} bytes, more than any "
                              f"prompt its context holds.", "invalid_request_error", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request line and headers do not arrive within
    read_timeout_s of its opening (or of the previous response): more data does not extend the deadline, so a
    client trickling a byte at a time is closed too."""

    def __init__(self, *args, read_timeout_s: float = READ_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:      # a whole request line and headers came
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:   # the next request's turn
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
