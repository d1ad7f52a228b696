"""Who may call the server and how much they may send, checked before a request reaches the model.

Without an API key the server answers only requests addressed to a loopback name and sent from no
other site: a web page the user visits can otherwise reach it, by DNS rebinding (its own name
resolving to 127.0.0.1, Ollama's CVE-2024-28224) or by a cross-site form post. A POST must say it is
JSON: text/plain is what a form sends without a CORS preflight.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from kvchat.engine.serve.protocol import APIError

MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32       # a context's worth of text, even JSON-escaped, or of token ids, fits


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


async def read_body(request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes, declared or not (a chunked upload)."""
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
