"""Pure ASGI middleware: API-key check and request-body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect messages pass
through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvserve.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})  # load balancers and Prometheus scrape these


async def _send_error(send: Send, status: int, message: str, close: bool = False) -> None:
    body = error_body(message, status)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Every path but OPEN_PATHS needs ``Authorization: Bearer <key>`` (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            await _send_error(send, 401, "invalid or missing API key: send 'Authorization: "
                              "Bearer <key>' with the key the server was started with")  # fmt: skip
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reject bodies over `max_bytes` with 413 before the app parses them.

    A declared Content-Length over the limit is refused without buffering; a chunked body is
    read up to the limit and then replayed to the app, so the app never sees a partial body.
    Before answering 413, the rest of the body is read and dropped (up to `drain_bytes` or
    DRAIN_SECONDS): a server that closes a connection with unread bytes in its socket makes
    the kernel send a reset, and a client still uploading then sees "connection reset"
    instead of the 413."""

    DRAIN_SECONDS = 30.0

    def __init__(self, app: ASGIApp, max_bytes: int, drain_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = max(64 * 2**20, 4 * max_bytes) if drain_bytes is None else drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(receive, send, more_body=True)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more_body = message.get("more_body", False)
            if size > self.max_bytes:
                await self._too_large(receive, send, more_body)
                return
            if not more_body:
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, receive: Receive, send: Send, more_body: bool) -> None:
        if more_body:
            await self._drain(receive)  # past the drain caps a client may still see a reset
        await _send_error(send, 413, f"request body is over the limit of {self.max_bytes} bytes "
                          "(--max-request-body-bytes)", close=True)  # fmt: skip

    async def _drain(self, receive: Receive) -> None:
        """Read and drop the rest of the body, within drain_bytes and DRAIN_SECONDS."""
        try:
            await asyncio.wait_for(self._drain_all(receive), self.DRAIN_SECONDS)
        except TimeoutError:
            pass

    async def _drain_all(self, receive: Receive) -> None:
        size = 0
        while size <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that first returns the buffered body, then the real messages (so the app
    still learns about a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
