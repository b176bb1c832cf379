"""The FastAPI application: `create_app()` wires the routes to a `Runtime` and runs it for the app's life."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from api import errors
from api.deps import AUTH_RESPONSES, RuntimeDep, get_current_user
from api.gate import AuthenticateFirst
from api.limits import BodyLimit, CleanText
from api.routes import (
    auth,
    code,
    compare,
    internal,
    jobs,
    logs,
    metrics,
    nodes,
    plan,
    queues,
    streams,
    sweeps,
    tracking,
)
from api.schemas import Alive, Health, error_responses
from api.transport import BodyDeadline
from api.web import views as web
from service.contract.errors import ClusterUnavailable
from service.runtime import Runtime
from service.settings import Settings

logger = logging.getLogger(__name__)


# Pydantic writes a bound that sits outside a before-validator (an optional `service.contract.spec.Int` with
# `ge=1`) under its own keyword; JSON Schema's names are what clients generating from the schema read.
_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(node: Any) -> None:
    if isinstance(node, dict):
        for key, standard in _BOUNDS.items():
            if key in node and isinstance(node[key], int | float):
                node[standard] = node.pop(key)
        for value in node.values():
            _standard_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _standard_bounds(value)


def _standard_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _standard_bounds(generate())
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None, *, runtime: Runtime | None = None) -> FastAPI:
    runtime = runtime or Runtime(settings or Settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start()
        app.state.runtime = runtime
        try:
            yield
        finally:
            streams.close_feeds(app.state)
            runtime.stop()

    app = FastAPI(
        title="Apiary",
        summary="Queue, gang-schedule and checkpoint distributed PyTorch training jobs on Ray.",
        version="0.1.0",
        lifespan=lifespan,
        # Any request: a body too large (api.limits), the database or Ray unreachable.
        responses=error_responses(413, 503),
        # The schema and its pages follow the auth rule like every route (below), not FastAPI's open ones.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(BodyLimit, code_max_bytes=runtime.settings.code_max_bytes)
    app.add_middleware(BodyDeadline, timeout_s=runtime.settings.body_timeout_s)
    app.add_middleware(AuthenticateFirst)  # outside BodyLimit: no credential, no byte of the body read
    app.add_middleware(CleanText)  # outermost: a path or query with a control character reaches nothing
    _standard_openapi(app)
    errors.install(app)
    web.install(app)  # first: its page at /jobs/{id} answers browsers, the JSON route everyone else
    # Everything needs a user (service.auth) but the trainers' telemetry and what monitoring reads
    # (the health check, Prometheus' aggregate metrics); the routes that change a job or a token check
    # who that user is.
    routers = (
        jobs.router,
        logs.router,
        queues.router,
        streams.router,
        plan.router,
        code.router,
        compare.router,
        tracking.router,
        sweeps.router,
        nodes.router,
    )
    for router in routers:
        app.include_router(router, dependencies=[Depends(get_current_user)], responses=AUTH_RESPONSES)
    app.include_router(auth.router, responses=AUTH_RESPONSES)
    app.include_router(internal.router)
    app.include_router(metrics.router)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(get_current_user)])
    def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[Depends(get_current_user)])
    def swagger_page() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Apiary API")

    @app.get("/redoc", include_in_schema=False, dependencies=[Depends(get_current_user)])
    def redoc_page() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="Apiary API")

    @app.get("/healthz", response_model=Alive, tags=["health"])
    def healthz() -> Alive:
        """Liveness: 200 while the process answers, whatever its database or Ray (see /readyz)."""
        return Alive(status="ok")

    @app.get("/readyz", response_model=Health, tags=["health"], responses={503: {"model": Health}})
    def readyz(runtime: RuntimeDep, response: Response) -> Health:
        """Readiness: 200 when the database and Ray answer; 503 (with what is down) otherwise, so that
        a load balancer sends requests elsewhere. The database's raw error stays in the log."""
        database = ray = "ok"
        try:
            assert runtime.db is not None
            runtime.db.ping()
        except Exception as err:
            logger.warning("readiness: database unavailable: %s", err, extra={"action": "not_ready"})
            database = "unavailable"
        try:
            runtime.backend.snapshot()
        except ClusterUnavailable as err:
            ray = f"unavailable: {err.message}"
        ready = database == "ok" and ray == "ok"
        response.status_code = 200 if ready else 503
        if not ready:
            response.headers["Retry-After"] = str(errors.RETRY_AFTER_S)
        status = "ok" if ready else "unavailable" if database != "ok" else "degraded"
        return Health(status=status, database=database, ray=ray)

    return app
