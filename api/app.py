"""The FastAPI application: `create_app()` wires the routes to a `Runtime` and runs it for the app's life."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Response
from sqlalchemy import text

from api import errors
from api.deps import AUTH_RESPONSES, RuntimeDep, get_current_user
from api.routes import auth, internal, jobs, logs, metrics, plan, queues, streams
from api.schemas import Health
from api.web import views as web
from service.errors import ClusterUnavailable
from service.runtime import Runtime
from service.settings import Settings


def create_app(settings: Settings | None = None, *, runtime: Runtime | None = None) -> FastAPI:
    runtime = runtime or Runtime(settings or Settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start()
        app.state.runtime = runtime
        try:
            yield
        finally:
            runtime.stop()

    app = FastAPI(
        title="Apiary",
        summary="Queue, gang-schedule and checkpoint distributed PyTorch training jobs on Ray.",
        version="0.1.0",
        lifespan=lifespan,
    )
    errors.install(app)
    web.install(app)  # first: its page at /jobs/{id} answers browsers, the JSON route everyone else
    # Everything needs a user (service.auth) but the trainers' telemetry and what monitoring reads
    # (the health check, Prometheus' aggregate metrics); the routes that change a job or a token check
    # who that user is.
    for router in (jobs.router, logs.router, queues.router, streams.router, plan.router):
        app.include_router(router, dependencies=[Depends(get_current_user)], responses=AUTH_RESPONSES)
    app.include_router(auth.router, responses=AUTH_RESPONSES)
    app.include_router(internal.router)
    app.include_router(metrics.router)

    @app.get("/healthz", response_model=Health, tags=["health"])
    def healthz(runtime: RuntimeDep, response: Response) -> Health:
        database = ray = "ok"
        try:
            assert runtime.db is not None
            with runtime.db.session() as session:
                session.execute(text("SELECT 1"))
        except Exception as err:
            database = f"unavailable: {err}"
        try:
            runtime.jobs.backend.snapshot()
        except ClusterUnavailable as err:
            ray = f"unavailable: {err.message}"
        healthy = database == "ok"
        response.status_code = 200 if healthy else 503
        return Health(status="ok" if healthy and ray == "ok" else "degraded", database=database, ray=ray)

    return app
