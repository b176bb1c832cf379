"""Dependencies: route signatures read like a spec (`JobsDep`, `SchedulerDep`, `CurrentUser`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer

from api.schemas import error_responses
from service.auth import Auth, User
from service.jobs import JobService
from service.runtime import Runtime
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.sweeps import SweepService

TOKEN_COOKIE = "apiary_token"  # the web view's token (set by POST /login), HttpOnly

# auto_error=False: a missing token is not an error while auth is not required (service.auth).
BEARER = HTTPBearer(auto_error=False, description="An API token: `apiary token create NAME`.")
COOKIE = APIKeyCookie(name=TOKEN_COOKIE, auto_error=False, description="The web view's token.")

# What every route that needs a user may answer besides its own statuses (declared in the OpenAPI).
AUTH_RESPONSES = error_responses(401)
OWNER_RESPONSES = error_responses(401, 403)
ADMIN_RESPONSES = error_responses(401, 403)


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def get_jobs(runtime: Annotated[Runtime, Depends(get_runtime)]) -> JobService:
    return runtime.jobs


def get_sweeps(runtime: Annotated[Runtime, Depends(get_runtime)]) -> SweepService:
    return runtime.sweeps


def get_scheduler(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Scheduler:
    return runtime.scheduler


def get_auth(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Auth:
    return runtime.auth


def get_settings(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Settings:
    return runtime.settings


def get_current_user(
    auth: Annotated[Auth, Depends(get_auth)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)],
    cookie: Annotated[str | None, Depends(COOKIE)],
) -> User:
    """The request's user: its bearer token's (the API, CLI, SDK), else its cookie's (the web view),
    else the local user while auth is not required; 401 otherwise."""
    return authenticate(auth, bearer=bearer.credentials if bearer is not None else None, cookie=cookie)


def authenticate(auth: Auth, *, bearer: str | None, cookie: str | None) -> User:
    """`get_current_user` from the credentials alone (api.gate calls it before a body is read)."""
    return auth.authenticate(bearer if bearer is not None else cookie)


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
JobsDep = Annotated[JobService, Depends(get_jobs)]
SweepsDep = Annotated[SweepService, Depends(get_sweeps)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
AuthDep = Annotated[Auth, Depends(get_auth)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
CurrentUser = Annotated[User, Depends(get_current_user)]
