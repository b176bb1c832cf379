"""Bounds on what one request may carry, so that no input reaches the database out of its range.

- Bodies: at most `MAX_BODY_BYTES` on the public routes and `MAX_INTERNAL_BODY_BYTES` on `/internal/`
  (a trainer's telemetry post: up to `MAX_POINTS_PER_POST` points), else 413, before a route reads it
  (`BodyLimit`, a pure ASGI middleware: it also counts a body sent without Content-Length).
- Text in paths and queries: no control character (Unicode category Cc: C0, DEL, C1; NUL among them,
  which PostgreSQL's text cannot hold), else 422 naming the parameter, before any route or database
  sees it (`CleanText`, on every route, the web pages' included).
- Integers in paths and queries: `JobId`, and `le=MAX_INT` on each query: at most `MAX_INT`
  (2**53 - 1, which every JSON client reads exactly and every 64-bit column holds); bodies use
  `service.contract.spec.Int` the same way.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Annotated
from urllib.parse import parse_qsl

from fastapi import Path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.contract.code import DEFAULT_MAX_BYTES, ZIP_OVERHEAD_BYTES, mib
from service.contract.spec import MAX_INT

MAX_BODY_BYTES = 1024 * 1024
MAX_INTERNAL_BODY_BYTES = 8 * 1024 * 1024
INTERNAL_PREFIX = "/internal/"

# The schema's word for CleanText's rule, on each free-text query parameter: a client generating requests
# from the schema (schemathesis in tests/integration/test_fuzz.py) sends control characters as invalid.
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"

JobId = Annotated[int, Path(ge=1, le=MAX_INT, description="The job's id.")]
TokenId = Annotated[int, Path(ge=1, le=MAX_INT, description="The token's id.")]
# A Ray node id: 28 bytes, in hex.
NodeId = Annotated[str, Path(pattern=r"^[0-9a-f]{56}$", description="The Ray node's id (hex).")]


CODE_PREFIX = "/code/"


def body_limit(path: str, *, code_max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    if path.startswith(CODE_PREFIX):  # a job's code package (api.routes.code)
        return code_max_bytes + ZIP_OVERHEAD_BYTES
    return MAX_INTERNAL_BODY_BYTES if path.startswith(INTERNAL_PREFIX) else MAX_BODY_BYTES


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Answers 413 to a request whose body is larger than `body_limit(path)`: at once when its
    Content-Length says so, else as soon as the bytes received pass it (whatever the route then did
    with the broken body, the client gets the 413)."""

    def __init__(self, app: ASGIApp, *, code_max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.app = app
        self.code_max_bytes = code_max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = body_limit(scope["path"], code_max_bytes=self.code_max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(send, limit, path=scope["path"])
            return
        received = 0
        exceeded = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await _too_large(send, limit, path=scope["path"])
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            if not started:
                await _too_large(send, limit, path=scope["path"])


def has_control_character(text: str) -> bool:
    return any(unicodedata.category(char) == "Cc" for char in text)


def dirty_field(scope: Scope) -> str | None:
    """The first path or query part of a request that holds a control character, as the field an error
    names: `path`, `query` (a parameter's name) or the parameter's name; None when all are clean."""
    if has_control_character(scope["path"]):
        return "path"
    # As Starlette reads the query: percent-escapes decoded as UTF-8, `+` as a space.
    for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True):
        if has_control_character(name):
            return "query"
        if has_control_character(value):
            return name
    return None


class CleanText:
    """Answers 422 to a request whose path or query holds a control character (`dirty_field`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (field := dirty_field(scope)) is None:
            await self.app(scope, receive, send)
            return
        where = "path" if field == "path" else "query"
        what = (
            "a query parameter's name" if field == "query" else "the path" if field == "path" else "the value"
        )
        message = f"{field}: {what} holds a control character (NUL, ESC, DEL, ...): send printable text"
        loc = [where] if field in ("path", "query") else [where, field]
        await _answer(
            send,
            422,
            {
                "message": message,
                "error": "InvalidSpec",
                "detail": [{"loc": loc, "msg": message, "type": "value_error"}],
            },
        )


async def _too_large(send: Send, limit: int, *, path: str) -> None:
    message = f"the request body is larger than {limit} bytes: send less at a time"
    if path.startswith(CODE_PREFIX):
        message = (
            f"the code package is larger than the code limit of {mib(limit - ZIP_OVERHEAD_BYTES)} "
            "(APIARY_CODE_MAX_BYTES): leave data and checkpoints out of the folder (.apiaryignore)"
        )
    await _answer(send, 413, {"message": message, "error": "PayloadTooLarge"})


async def _answer(send: Send, status: int, content: dict[str, object]) -> None:
    body = json.dumps(content).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
