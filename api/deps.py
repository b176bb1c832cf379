"""Dependencies: route signatures read like a spec (`JobsDep`, `SchedulerDep`, `OwnerDep`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from service.jobs import JobService
from service.runtime import Runtime
from service.scheduler import Scheduler


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def get_jobs(runtime: Annotated[Runtime, Depends(get_runtime)]) -> JobService:
    return runtime.jobs


def get_scheduler(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Scheduler:
    return runtime.scheduler


def get_owner(x_apiary_user: Annotated[str | None, Header(max_length=128)] = None) -> str:
    return x_apiary_user or "anonymous"


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
JobsDep = Annotated[JobService, Depends(get_jobs)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
OwnerDep = Annotated[str, Depends(get_owner)]
