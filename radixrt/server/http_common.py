"""What every route shares: JSON and server-sent-event bodies, OpenAI-style errors, and the exception mapping.

Bodies are decoded with ``decode_request`` (msgspec structs, unknown fields refused, integers within 64
bits where a field is typed, radixrt.server.json_numbers). Every route is registered with ``route``, which runs it under ``error_response_for``: a request
error is a 400 (404 for an unknown model or session, 409 for a clash with the runtime's state), a full waiting queue or a dead runtime a 503, a failure inside
the runtime while serving the request a 500, a client that went away 499, and anything unexpected a logged
500 (the server goes on serving everyone else). Error bodies are OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``. A stream that fails after its headers went out ends
with one error event (``failure_event``) and ``SSE_DONE``; ``AbortOnCloseStream`` aborts the requests of a
stream however it ends.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixrt.client import Handle
from radixrt.protocol.errors import Conflict, NotFound, Overloaded, RequestError, RequestFailed, RuntimeDown
from radixrt.server.client_wait import ClientGone
from radixrt.server.json_numbers import big_int_path, integral_floats_as_ints

logger = logging.getLogger("radixrt.http")
_json = msgspec.json.Encoder()

SSE_DONE = b"data: [DONE]\n\n"
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 503: "ServiceUnavailableError"}
T = TypeVar("T")


def decode_request(body: bytes, kind: type[T]) -> T:
    """A request body as ``kind``; RequestError (400) for an empty body, bad JSON, a huge integer or a field
    ``kind`` does not take."""
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestError(f"malformed JSON: {exc}") from None
    try:
        decoded = msgspec.convert(integral_floats_as_ints(raw), type=kind)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from None
    where = big_int_path(decoded, kind)
    if where is not None:
        raise RequestError(f"invalid request: integer out of the 64-bit range - at `{where}`")
    return decoded


class ModelNotFound(NotFound):
    """The request names a model this server does not serve (HTTP 404)."""


def encode_json(content: Any) -> bytes:
    return _json.encode(content)


def json_response(content: Any, status: int = 200) -> Response:
    return Response(_json.encode(content), status_code=status, media_type="application/json")


def error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "ServerError"), "param": None,
                      "code": status}}


def error_response(message: str, status: int = 400) -> Response:
    return json_response(error_body(message, status), status)


def sse(data: Any) -> bytes:
    return b"data: " + _json.encode(data) + b"\n\n"


def failure_event(states: list[Handle]) -> bytes | None:
    """The error event of a stream whose runtime went down (503) or failed one of its requests (500)."""
    for state in states:
        if state.error is not None and state.error != "aborted":
            return sse(error_body(state.error, 503))
        message = state.server_error()
        if message is not None:
            return sse(error_body(message, 500))
    return None


class AbortOnCloseStream(StreamingResponse):
    """A server-sent-events response that aborts its unfinished requests however it ends (client gone)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def error_response_for(exc: Exception) -> Response:
    """The answer to an exception a route raised."""
    if isinstance(exc, NotFound):
        return error_response(str(exc), 404)
    if isinstance(exc, Conflict):
        return error_response(str(exc), 409)
    if isinstance(exc, RequestError):
        return error_response(str(exc), 400)
    if isinstance(exc, Overloaded):
        return error_response(str(exc), 503)
    if isinstance(exc, RuntimeDown):
        return error_response(f"the runtime is unavailable: {exc}", 503)
    if isinstance(exc, RequestFailed):
        return error_response(str(exc), 500)
    if isinstance(exc, ClientGone):
        return Response(status_code=499)
    logger.error("request failed", exc_info=exc)
    return error_response(f"internal error: {exc!r}", 500)


def route(app: FastAPI, path: str, methods: list[str], handler: Callable[..., Awaitable[Response]],
          *bound: Any) -> None:
    """Register ``handler(*bound, request)`` at ``path``, answering its exceptions with ``error_response_for``."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(*bound, request)
        except Exception as exc:  # keep serving everyone else
            return error_response_for(exc)

    endpoint.__name__ = handler.__name__
    app.add_api_route(path, endpoint, methods=methods)
