"""What stands between the network and the routes: API keys, the body limit, and slow-client timeouts.

``RequestGuard`` is ASGI middleware in front of the app:
- Keys: with an API key set, every path but ``OPEN_PATHS`` needs ``Authorization: Bearer KEY`` (compared in
  constant time); the control paths (``ADMIN_PATHS``) need the admin key when one is set. A missing or wrong
  key is answered 401 in OpenAI's error format before anything else happens.
- Body size: a request whose Content-Length exceeds the limit is answered 413 without reading it; a body
  without a length (chunked) is counted while read and refused 413 as soon as it passes the limit.
- Body time: the whole body must arrive within ``body_timeout`` seconds of the first read, or the request
  is answered 408 and the connection closed (a client trickling bytes holds nothing for long).

``GuardedH11Protocol`` is uvicorn's HTTP/1.1 protocol with a deadline on the request head: a connection
that has not sent a complete request line and headers within ``HEADER_TIMEOUT`` seconds (after connecting,
or after its previous response) is closed. uvicorn itself bounds idle keep-alive connections and, with
``limit_concurrency``, the number of connections and requests in flight (503 beyond it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, Awaitable, Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

OPEN_PATHS = frozenset({"/health"})
ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/start_profile", "/stop_profile", "/load_lora_adapter",
                         "/unload_lora_adapter", "/update_weights_from_disk", "/pause_generation",
                         "/continue_generation", "/update_weight_version", "/init_weights_update_group",
                         "/update_weights_from_distributed", "/destroy_weights_update_group",
                         "/get_weights_by_name", "/pause", "/resume", "/release_memory_occupation",
                         "/resume_memory_occupation", "/sleep", "/wake_up"})

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def error_json(message: str, status: int, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


async def send_error(send: Send, status: int, message: str, kind: str, close: bool = False,
                     extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_json(message, status, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def key_matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class _BodyRefused(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class RequestGuard:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, api_key: str | None = None,
                 admin_api_key: str | None = None, max_body_bytes: int = 8 << 20,
                 body_timeout: float = 30.0) -> None:
        self.app = app
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    def required_key(self, path: str) -> str | None:
        if path in OPEN_PATHS:
            return None
        if path in ADMIN_PATHS and self.admin_api_key:
            return self.admin_api_key
        return self.api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        expected = self.required_key(scope["path"])
        if expected is not None and not key_matches(bearer_token(scope), expected):
            await send_error(send, 401, "Unauthorized: pass a valid API key as 'Authorization: Bearer KEY'",
                             "AuthenticationError", extra_headers=[(b"www-authenticate", b"Bearer")])
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await send_error(send, 413, f"the request body ({length} bytes) exceeds the limit of "
                                        f"{self.max_body_bytes} bytes", "RequestTooLargeError", close=True)
            return
        await self._guarded(scope, receive, send)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        received = 0
        deadline: float | None = None
        refused: list[_BodyRefused] = []
        body_done = False

        async def guarded_receive() -> Message:
            nonlocal received, deadline, body_done
            if refused:
                return {"type": "http.disconnect"}
            if body_done:  # after the body only a disconnect can come: no deadline on waiting for it
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.body_timeout
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                refused.append(_BodyRefused(408, f"the request body did not arrive within {self.body_timeout} s",
                                            "RequestTimeoutError"))
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    refused.append(_BodyRefused(413, f"the request body exceeds the limit of {self.max_body_bytes}"
                                                     " bytes", "RequestTooLargeError"))
                    return {"type": "http.disconnect"}
                body_done = not message.get("more_body", False)
            return message

        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                if not started:  # the app answered a body it never got whole: answer the refusal instead
                    started = True
                    r = refused[0]
                    await send_error(send, r.status, r.message, r.kind, close=True)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, guarded_receive, guarded_send)
        if refused and not started:
            r = refused[0]
            await send_error(send, r.status, r.message, r.kind, close=True)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


HEADER_TIMEOUT = 10.0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing connections whose request head does not arrive in time."""

    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a complete request head arrived
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
