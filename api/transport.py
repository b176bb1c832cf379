"""The connection under the API: how long a client may take to send a request, whom the forwarded
headers are believed from, and what the access log may show.

- Request heads (`head_deadline_protocol`): uvicorn closes an idle keep-alive connection, but a client
  that trickles a request line and headers a byte at a time (slowloris) would keep its connection and
  file descriptor for ever. Each connection must deliver a complete request head within
  `Settings.header_timeout_s` of opening, or of its previous response ending; else it is closed.
- Request bodies (`BodyDeadline`, a pure ASGI middleware): a body must arrive whole within
  `Settings.body_timeout_s` of the request's start; else 408 and the connection is closed.
- Forwarded headers: uvicorn believes `X-Forwarded-For`/`-Proto` only from
  `Settings.forwarded_allow_ips` (default 127.0.0.1): behind a TLS proxy on another address, name it,
  or the login cookie is not marked `Secure` (the request looks like plain HTTP).
- The access log (`RedactSecrets`): a token sent in a query string (`?token=`, `?access_token=`,
  ...; refused anyway) is written as `[redacted]`, and so is anything that looks like an API token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.auth import TOKEN_PREFIX

# Query parameters whose values are secrets, whatever a client meant by them.
SECRET_PARAMS = ("token", "access_token", "api_key", "apikey", "key", "password", "secret", "session")
_SECRET_QUERY = re.compile(rf"(?i)([?&](?:{'|'.join(SECRET_PARAMS)})=)[^&\s]*")
_TOKEN_LIKE = re.compile(rf"{re.escape(TOKEN_PREFIX)}[A-Za-z0-9_\-]+")


def redact(text: str) -> str:
    return _TOKEN_LIKE.sub("[redacted]", _SECRET_QUERY.sub(r"\1[redacted]", text))


class RedactSecrets(logging.Filter):
    """On uvicorn's access logger: its record's path (with the query) has its secrets redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in record.args)
        return True


def head_deadline_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, closing a connection whose request head is not complete within
    `header_timeout_s` of the connection opening or of its previous response ending."""

    class HeadDeadline(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            if not self.pipeline:  # a pipelined request's head has arrived already
                self._arm()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadDeadline


class _BodyTooSlow(Exception):
    pass


class BodyDeadline:
    """Answers 408 (and closes the connection) when a request's body has not all arrived within
    `timeout_s` of the request's start. Only the body is timed: a stream's later wait for the client
    to go away (`http.disconnect`) is not."""

    def __init__(self, app: ASGIApp, *, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = timed_out = started = False

        async def timed_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                timed_out = True
                raise _BodyTooSlow from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message: Message) -> None:
            # Whatever the route made of the broken body (FastAPI answers 400), the client gets the 408.
            nonlocal started
            if timed_out:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await _request_timeout(send, self.timeout_s)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except _BodyTooSlow:
            if not started:
                await _request_timeout(send, self.timeout_s)


async def _request_timeout(send: Send, timeout_s: float) -> None:
    message = f"the request body did not arrive within {timeout_s:g} s: send it faster, or less at a time"
    body = json.dumps({"message": message, "error": "RequestTimeout"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 408,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str,
    header_timeout_s: float,
    forwarded_allow_ips: str,
    log_config: dict[str, Any] | None = uvicorn.config.LOGGING_CONFIG,
) -> uvicorn.Config:
    """uvicorn's configuration of the API: head deadlines, forwarded headers, a redacted access log."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config,
        http=head_deadline_protocol(header_timeout_s),
        proxy_headers=True,
        forwarded_allow_ips=forwarded_allow_ips,
    )
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(existing, RedactSecrets) for existing in access.filters):
        access.addFilter(RedactSecrets())
    return config
