"""One place maps domain errors to HTTP. Clients get a message that says what to do, never a trace."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.routing import Match, Route

from service.contract.errors import (
    ApiaryError,
    AttemptSuperseded,
    ClusterUnavailable,
    CodeTooLarge,
    CodeUploadOff,
    CredentialsRedeemed,
    CredentialsRefused,
    DatabaseUnavailable,
    Forbidden,
    IdempotencyKeyReused,
    InvalidReport,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    JobNotStarted,
    LastAdminToken,
    LogsNotFound,
    NodeNotFound,
    ReportRefused,
    SweepNotFound,
    TokenNotFound,
    Unauthenticated,
    one_line,
)

logger = logging.getLogger(__name__)

# What a client that got a 503 waits before it retries (the header Retry-After).
RETRY_AFTER_S = 5

STATUS: dict[type[ApiaryError], int] = {
    JobNotFound: 404,
    NodeNotFound: 404,
    SweepNotFound: 404,
    InvalidSpec: 422,
    InvalidTransition: 409,
    IdempotencyKeyReused: 409,
    LastAdminToken: 409,
    ClusterUnavailable: 503,
    DatabaseUnavailable: 503,
    JobNotStarted: 409,
    LogsNotFound: 404,
    ReportRefused: 401,
    AttemptSuperseded: 403,
    CredentialsRefused: 401,
    CredentialsRedeemed: 403,
    InvalidReport: 422,
    Unauthenticated: 401,
    Forbidden: 403,
    TokenNotFound: 404,
    CodeTooLarge: 413,
    CodeUploadOff: 403,
}


def _status_for(error: ApiaryError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def _field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(str(part) for part in parts) or "body"


async def apiary_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiaryError)
    status = _status_for(error)
    body: dict[str, Any] = {"message": error.message, "error": type(error).__name__}
    if error.field:
        body["detail"] = [
            {"loc": ["body", *error.field.split(".")], "msg": error.message, "type": "value_error"}
        ]
    if status >= 500:
        logger.error("request failed: %s", error.message, extra={"action": "request_failed"})
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(status_code=status, content=body, headers=headers)


def is_database_unavailable(error: BaseException) -> bool:
    """A lost or refused connection, a pool that cannot hand one out, a locked SQLite file: the
    database, not the request, is at fault, and a retry may succeed. (A constraint or data error is
    not one of these.)"""
    if isinstance(error, OperationalError | InterfaceError | PoolTimeout):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


async def database_error(request: Request, error: Exception) -> JSONResponse:
    if not is_database_unavailable(error):
        raise error
    # The driver's text names hosts and statements: it goes to the log, never to the client.
    logger.warning(
        "database unavailable: %s",
        one_line(getattr(error, "orig", None) or error),
        extra={"action": "database_unavailable"},
    )
    return await apiary_error(request, DatabaseUnavailable())


async def validation_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    details = [
        {"loc": list(item["loc"]), "msg": item["msg"], "type": item["type"]} for item in error.errors()
    ]
    message = "; ".join(f"{_field_name(item['loc'])}: {item['msg']}" for item in details)
    return JSONResponse(
        status_code=422, content={"message": message, "error": "InvalidSpec", "detail": details}
    )


async def http_error(request: Request, error: Exception) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method, a body that is not JSON) in the same shape
    as every other error. A 405's Allow lists the methods of every route on the path, not only of the
    first one that matched it (GET and POST /jobs are two routes)."""
    assert isinstance(error, HTTPException)
    headers = dict(error.headers or {})
    if error.status_code == 405:
        methods = {
            method
            for route in request.app.routes
            if isinstance(route, Route)
            and route.methods
            and route.matches(request.scope)[0] is not Match.NONE
            for method in route.methods
        }
        headers["Allow"] = ", ".join(sorted(methods))
    body = {"message": str(error.detail), "error": HTTPStatus(error.status_code).phrase.replace(" ", "")}
    return JSONResponse(status_code=error.status_code, content=body, headers=headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiaryError, apiary_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(DBAPIError, database_error)
    app.add_exception_handler(PoolTimeout, database_error)
