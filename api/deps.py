"""Dependencies: route signatures read like a spec (`JobsDep`, `SchedulerDep`, `CurrentUser`)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.schemas import error_responses
from service.auth import Auth, User
from service.contract.errors import Forbidden
from service.jobs import JobService
from service.runtime import Runtime
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.sweeps import SweepService

SESSION_COOKIE = "apiary_session"  # the web view's session id (set by POST /login), HttpOnly
CSRF_HEADER = "X-CSRF-Token"  # the web view's scripts send its session's CSRF token in it
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The request state's name for the user api.gate authenticated (a request with a body, before reading it).
GATE_USER = "apiary_gate_user"

# auto_error=False: a missing token is not an error while auth is not required (service.auth).
BEARER = HTTPBearer(auto_error=False, description="An API token: `apiary token create NAME`.")
COOKIE = APIKeyCookie(name=SESSION_COOKIE, auto_error=False, description="The web view's session.")

# What every route that needs a user may answer besides its own statuses (declared in the OpenAPI).
AUTH_RESPONSES = error_responses(401)
OWNER_RESPONSES = error_responses(401, 403)
ADMIN_RESPONSES = error_responses(401, 403)


# The getters below only read attributes: `async def`, so that FastAPI calls them on the event loop
# instead of handing each to a worker thread (a hop per dependency per request).


async def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


async def get_jobs(runtime: Annotated[Runtime, Depends(get_runtime)]) -> JobService:
    return runtime.jobs


async def get_sweeps(runtime: Annotated[Runtime, Depends(get_runtime)]) -> SweepService:
    return runtime.sweeps


async def get_scheduler(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Scheduler:
    return runtime.scheduler


async def get_auth(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Auth:
    return runtime.auth


async def get_settings(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Settings:
    return runtime.settings


async def get_current_user(
    request: Request,
    auth: Annotated[Auth, Depends(get_auth)],
    # Read by authenticate_request; declared for the OpenAPI's security schemes.
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)],
    _cookie: Annotated[str | None, Depends(COOKIE)],
) -> User:
    """The request's user: its bearer token's (the API, CLI, SDK), else its web session's (the view),
    else the local user while auth is not required; 401 otherwise. A request that changes something
    without a bearer token must come from this site (403 otherwise: `check_same_site`).

    A request with a body was authenticated by api.gate, with these same rules, a moment ago: its
    user is taken from there rather than looked up twice."""
    user = getattr(request.state, GATE_USER, None)
    if isinstance(user, User):
        return user
    return await run_in_threadpool(authenticate_request, auth, request)


def bearer_of(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def csrf_token(session_id: str) -> str:
    """A web session's CSRF token: derived from its id, so that only a page of this site (which the
    browser shows it in) can send it, and it dies with the session."""
    return hmac.new(session_id.encode(), b"apiary csrf", hashlib.sha256).hexdigest()


def is_same_origin(request: Request, *, required: bool) -> bool:
    """Whether a browser says the request comes from a page of this site: `Origin` names this host, or
    `Sec-Fetch-Site: same-origin`. Without either header (not a browser), `not required`."""
    origin = request.headers.get("origin")
    if origin is not None and origin != "null":
        return urlsplit(origin).netloc == request.headers.get("host")
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")  # none: typed in the address bar, not another page
    return origin is None and not required


def check_same_site(request: Request, *, session_id: str | None) -> None:
    """CSRF: a request that changes something on the strength of the browser's ambient credentials
    (the session cookie, or none at all for the local user) needs a same-origin `Origin` (or
    `Sec-Fetch-Site`), and with a session its CSRF token in `X-CSRF-Token` (or the form's field)."""
    if request.method in SAFE_METHODS:
        return
    if not is_same_origin(request, required=session_id is not None):
        raise Forbidden("a request from another site may not change anything here (CSRF): use the API token")
    if session_id is not None:
        sent = request.headers.get(CSRF_HEADER.lower()) or ""
        if not hmac.compare_digest(sent, csrf_token(session_id)):
            raise Forbidden(f"the web view's CSRF token is missing or wrong ({CSRF_HEADER}): reload the page")


def authenticate_request(auth: Auth, request: Request) -> User:
    """`get_current_user` from a request's headers (also api.gate, before its body is read, and the
    streams' re-checks)."""
    bearer = bearer_of(request.headers.get("authorization"))
    if bearer is not None:
        return auth.authenticate(bearer)
    session_id = request.cookies.get(SESSION_COOKIE)
    user = auth.authenticate_session(session_id) if session_id else auth.authenticate(None)
    check_same_site(request, session_id=session_id or None)
    return user


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
JobsDep = Annotated[JobService, Depends(get_jobs)]
SweepsDep = Annotated[SweepService, Depends(get_sweeps)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
AuthDep = Annotated[Auth, Depends(get_auth)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
CurrentUser = Annotated[User, Depends(get_current_user)]
