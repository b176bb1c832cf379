"""One place maps domain errors to HTTP. Clients get a message that says what to do, never a trace."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from service.errors import (
    ApiaryError,
    AttemptSuperseded,
    ClusterUnavailable,
    Forbidden,
    IdempotencyKeyReused,
    InvalidReport,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    JobNotStarted,
    LogsNotFound,
    ReportRefused,
    TokenNotFound,
    Unauthenticated,
)

logger = logging.getLogger(__name__)

STATUS: dict[type[ApiaryError], int] = {
    JobNotFound: 404,
    InvalidSpec: 422,
    InvalidTransition: 409,
    IdempotencyKeyReused: 409,
    ClusterUnavailable: 503,
    JobNotStarted: 409,
    LogsNotFound: 404,
    ReportRefused: 401,
    AttemptSuperseded: 403,
    InvalidReport: 422,
    Unauthenticated: 401,
    Forbidden: 403,
    TokenNotFound: 404,
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
    return JSONResponse(status_code=status, content=body)


async def validation_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    details = [
        {"loc": list(item["loc"]), "msg": item["msg"], "type": item["type"]} for item in error.errors()
    ]
    message = "; ".join(f"{_field_name(item['loc'])}: {item['msg']}" for item in details)
    return JSONResponse(
        status_code=422, content={"message": message, "error": "InvalidSpec", "detail": details}
    )


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiaryError, apiary_error)
    app.add_exception_handler(RequestValidationError, validation_error)
