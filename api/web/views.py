"""The pages: the queue view at `/` and a job's page at `/jobs/{id}` (for a browser: the same path answers
JSON to every other client), and the static files they use under `/static`.

The pages need a user like every JSON route (service.auth): a browser without a valid `apiary_token`
cookie is sent to `/login`, a small form that checks a token and sets that cookie (HttpOnly, SameSite
Strict, so that another site's page cannot post with it); the page's Cancel and Preempt buttons call the
JSON routes with it.

Server-rendered with Jinja2 (autoescaped: every name, reason and message comes from users or trainers).
The pages stay live through the streams (api.routes.streams): the script swaps in a fresh rendering of
a page's live part (`?part=live`) when a stream says something changed, and draws the charts. The
queue page reads one page of each list through the service's paginated calls, never every job.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi import Path as FastPath
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import (
    SESSION_COOKIE,
    AuthDep,
    JobsDep,
    SweepsDep,
    authenticate_request,
    csrf_token,
    is_same_origin,
)
from api.limits import JobId
from api.routes.compare import JOB_LIST_PATTERN, parse_job_list
from api.schemas import CheckpointPublic, ComparePublic, EventPublic, JobPublic, ProfilePublic, SweepPublic
from service.auth import SESSION_TTL_S, Auth, User
from service.contract.errors import Forbidden, InvalidSpec, Unauthenticated
from service.contract.signal import job_cost_text
from service.contract.spec import MAX_INT
from service.contract.states import ACTIVE_STATES, JobState
from service.contract.system import SYSTEM_FIGURES, SYSTEM_OUTLIER_FACTOR, show_figure
from service.jobs import QueueView
from service.store.models import Job

HERE = Path(__file__).parent
QUEUE_PAGE = 50  # queued jobs per queue on a page
FINISHED_PAGE = 20
RUNNING_SHOWN = 100
FINISHED_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED)

# Autoescape everything (Starlette's default only covers some file names).
LOGIN_COOKIE = "apiary_login"  # the login form's CSRF token (double submit): set with the form


def _csrf_context(request: Request) -> dict[str, Any]:
    """Every page's `csrf_token` (in a meta tag, for its scripts' requests), from its web session."""
    session_id = request.cookies.get(SESSION_COOKIE)
    return {"csrf_token": csrf_token(session_id) if session_id else ""}


templates = Jinja2Templates(
    env=jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True),
    context_processors=[_csrf_context],
)


def _ago(when: datetime | None) -> str:
    if when is None:
        return ""
    if when.tzinfo is None:  # SQLite hands back naive UTC
        when = when.replace(tzinfo=UTC)
    seconds = (datetime.now(UTC) - when).total_seconds()
    ahead = seconds < 0
    seconds = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            text = f"{seconds / size:.0f}{unit}"
            break
    else:
        text = f"{seconds:.0f}s"
    return f"in {text}" if ahead else f"{text} ago"


def _amounts(amounts: dict[str, float] | None) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in sorted((amounts or {}).items())) or "-"


def _workers(spec: dict[str, Any]) -> str:
    """A stored spec's workers: `2`, or `2-4` for an elastic group."""
    workers = spec.get("num_workers")
    return f"{workers['min']}-{workers['max']}" if isinstance(workers, dict) else str(workers)


def _figure(value: float | None, unit: str) -> str:
    return "-" if value is None else show_figure(value, unit)


templates.env.filters["ago"] = _ago
templates.env.filters["figure"] = _figure
templates.env.globals["system_figures"] = SYSTEM_FIGURES
templates.env.globals["outlier_factor"] = f"{SYSTEM_OUTLIER_FACTOR:g}"
templates.env.filters["workers"] = _workers
templates.env.filters["amounts"] = _amounts


class HtmlRoute(APIRoute):
    """A page route that only matches a request asking for HTML (a browser), so that the same path
    (`/jobs/{id}`) keeps answering JSON to the SDK, the CLI and curl."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.NONE:
            return match, child
        accept = dict(scope.get("headers") or []).get(b"accept", b"").decode("latin-1")
        return (match, child) if "text/html" in accept else (Match.NONE, {})


router = APIRouter(route_class=HtmlRoute, include_in_schema=False)
login_router = APIRouter(include_in_schema=False)


class LoginRequired(Exception):
    """A page was asked for without a valid token: the browser goes to the login form."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


def get_page_user(request: Request, auth: AuthDep) -> User:
    try:
        return authenticate_request(auth, request)
    except Unauthenticated:
        raise LoginRequired(request.url.path) from None


PageUser = Annotated[User, Depends(get_page_user)]


def _safe_next(path: str | None) -> str:
    """Where to go after logging in: a path on this site only (never `//evil.example`)."""
    if path and path.startswith("/") and not path.startswith("//") and "\\" not in path:
        return path
    return "/"


async def login_required(_request: Request, error: Exception) -> Response:
    assert isinstance(error, LoginRequired)
    return RedirectResponse(f"/login?next={quote(error.next_path)}", status_code=303)


def _cookie(response: Response, request: Request, name: str, value: str, *, max_age: int) -> None:
    secure = request.url.scheme == "https"
    response.set_cookie(name, value, httponly=True, samesite="strict", secure=secure, max_age=max_age)


@login_router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: Annotated[str | None, Query()] = None) -> HTMLResponse:
    return _login_form(request, next_path=_safe_next(next), error=None)


def _login_form(
    request: Request, *, next_path: str, error: str | None, status_code: int = 200
) -> HTMLResponse:
    login_csrf = secrets.token_urlsafe(32)
    context = {"next": next_path, "error": error, "login_csrf": login_csrf}
    response = templates.TemplateResponse(request, "login.html", context, status_code=status_code)
    _cookie(response, request, LOGIN_COOKIE, login_csrf, max_age=3600)
    return response


@login_router.post("/login", response_class=HTMLResponse)
async def login(request: Request, auth: AuthDep) -> Response:
    """Check the form's token; if good, start a web session (its id in an HttpOnly cookie: the token
    itself is kept nowhere in the browser) and go on to `next`. The form must come from this site:
    a same-origin `Origin` and the form's own CSRF token (login CSRF would log a victim in as the
    attacker)."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    next_path = _safe_next((form.get("next") or ["/"])[0])
    sent_csrf = (form.get("csrf") or [""])[0]
    expected_csrf = request.cookies.get(LOGIN_COOKIE) or ""
    if not is_same_origin(request, required=False) or not (
        expected_csrf and hmac.compare_digest(sent_csrf, expected_csrf)
    ):
        error = "this login form did not come from this site, or it is stale: log in again from here"
        return _login_form(request, next_path=next_path, error=error, status_code=403)
    try:
        session_id = await run_in_threadpool(_start_session, auth, token)  # off the event loop
    except Unauthenticated as err:
        return _login_form(request, next_path=next_path, error=err.message, status_code=401)
    response = RedirectResponse(next_path, status_code=303)
    _cookie(response, request, SESSION_COOKIE, session_id, max_age=SESSION_TTL_S)
    response.delete_cookie(LOGIN_COOKIE, httponly=True, samesite="strict")
    return response


def _start_session(auth: Auth, token: str) -> str:
    if not token:
        raise Unauthenticated("paste an API token (`apiary token create NAME` makes one)")
    return auth.start_session(token)


@login_router.post("/logout")
async def logout(request: Request, auth: AuthDep) -> Response:
    """End the web session (server-side: its id stops working at once) and forget its cookie. The
    form's CSRF token and a same-origin `Origin` are needed (another site may not log you out)."""
    session_id = request.cookies.get(SESSION_COOKIE)
    if session_id:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        sent = (form.get("csrf_token") or [""])[0]
        if not is_same_origin(request, required=True) or not hmac.compare_digest(
            sent, csrf_token(session_id)
        ):
            raise Forbidden("a logout from another site, or a stale page: log out from this site's page")
        await run_in_threadpool(auth.end_session, session_id)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict")
    return response


def progress(job: Job) -> dict[str, Any]:
    """A job's progress from its row alone (no metric query): step of max_steps, workers, samples/s."""
    public = JobPublic.build(job)
    workers = len(job.ranks) if job.ranks else public.spec.min_workers
    step = job.latest_step or 0
    return {
        "job": public,
        "workers": workers,
        "step": step,
        # A function trainer without max_steps has no end to measure against.
        "fraction": min(1.0, step / public.spec.max_steps) if public.spec.max_steps else None,
        "samples_per_s": public.spec.batch_size * workers / job.seconds_per_step
        if job.seconds_per_step and public.spec.batch_size is not None
        else None,
    }


def capacity(view: QueueView) -> list[dict[str, Any]]:
    """A queue's use of each resource against its share (a bar full at the share; borrowing overflows)."""
    rows = []
    for key, used in sorted(view.in_use.items()):
        share = view.share.get(key) if view.share is not None else None
        rows.append(
            {
                "key": key,
                "used": used,
                "share": share,
                "borrowed": view.borrowed.get(key, 0.0),
                "percent": round(min(100.0, 100 * used / share), 1) if share else 0.0,
            }
        )
    return rows


@router.get("/", response_class=HTMLResponse)
def queue_page(
    request: Request,
    jobs: JobsDep,
    user: PageUser,
    offset: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    finished_offset: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    part: Annotated[str | None, Query(pattern="^live$")] = None,
) -> HTMLResponse:
    overview = jobs.overview(limit=QUEUE_PAGE, offset=offset)
    views = overview.queues
    running, running_count = jobs.list_jobs(states=tuple(ACTIVE_STATES), limit=RUNNING_SHOWN)
    finished, finished_count = jobs.list_jobs(
        states=FINISHED_STATES, offset=finished_offset, limit=FINISHED_PAGE
    )
    context = {
        "queues": views,
        "spot": overview.spot,
        "capacity": {view.name: capacity(view) for view in views},
        "running": [progress(job) for job in running],
        "running_count": running_count,
        "finished": [JobPublic.build(job) for job in finished],
        "finished_count": finished_count,
        "offset": offset,
        "finished_offset": finished_offset,
        "queue_page": QUEUE_PAGE,
        "finished_page": FINISHED_PAGE,
        "user": user,
    }
    name = "queues_live.html" if part else "queues.html"
    return templates.TemplateResponse(request, name, context)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(
    job_id: JobId,
    request: Request,
    jobs: JobsDep,
    user: PageUser,
    part: Annotated[str | None, Query(pattern="^live$")] = None,
) -> HTMLResponse:
    history = jobs.job_history(job_id)
    row = progress(history.job)
    public: JobPublic = row["job"]
    checkpoints = [CheckpointPublic.build(c) for c in history.checkpoints]
    event_id, metric_id = history.cursor if not part else (0, 0)
    events = [EventPublic.build(e) for e in history.events] if not part else []
    ranks = sorted((public.ranks or {}).items(), key=lambda item: int(item[0]))
    context = {
        "job": public,
        "row": row,
        "ranks": ranks,
        "checkpoints": checkpoints,
        # Listed from storage, once per page (not on the live part's refreshes), only when asked for.
        "profiles": [ProfilePublic.build(found) for found in jobs.list_profiles(job_id)]
        if public.spec.profile is not None and not part
        else [],
        "profile_logdir": jobs.profile_root(job_id).removeprefix("file://"),  # TensorBoard takes a path
        "events": events,
        "cursor": f"{event_id}.{metric_id}",
        "spec_json": json.dumps(public.spec.model_dump(mode="json"), indent=2),
        "cost": job_cost_text(public) if public.resource_hours > 0 else None,
        "now": time.time(),
        "user": user,
    }
    name = "job_live.html" if part else "job.html"
    return templates.TemplateResponse(request, name, context)


# The colours of the charts' series (api/web/static/apiary.js COLORS), for the compare page's legend.
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f")


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request, jobs: JobsDep, user: PageUser, ids: Annotated[str, Query(alias="jobs")]
) -> HTMLResponse:
    """Jobs side by side (`service.compare`): final and best metrics, spec differences, and their
    curves overlaid (drawn by the script from each job's metrics)."""
    if not re.fullmatch(JOB_LIST_PATTERN, ids):
        raise InvalidSpec("jobs: comma-separated job ids, e.g. 12,13", field="jobs")
    found = ComparePublic.build(jobs.compare(parse_job_list(ids)))
    context = {
        "runs": found.jobs,
        "metrics": sorted({name for run in found.jobs for name in run.final}),
        "spec_diff": found.spec_diff,
        "colors": COLORS,
        "user": user,
    }
    return templates.TemplateResponse(request, "compare.html", context)


# Every page: scripts, styles, images and connections from this site only, no inline script or style
# attribute (apiary.js sets the few computed styles), and never inside another site's frame (the
# Cancel and Preempt buttons must not be clickjacked). FastAPI's /docs and /redoc load Swagger UI and
# ReDoc from their CDN and run an inline script: their policy allows that, and no framing either.
PAGE_CSP = (
    "default-src 'self'; base-uri 'none'; object-src 'none'; form-action 'self'; frame-ancestors 'none'"
)
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net https://fonts.googleapis.com; "
    "font-src https://fonts.gstatic.com; img-src 'self' data: https://fastapi.tiangolo.com "
    "https://cdn.redoc.ly; worker-src blob:; base-uri 'none'; object-src 'none'; frame-ancestors 'none'"
)
DOCS_PATHS = ("/docs", "/redoc")
EVERY_RESPONSE = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin")]


class SecurityHeaders:
    """Adds the headers above: `nosniff` and `Referrer-Policy` to every response, the CSP and
    `X-Frame-Options: DENY` to every HTML one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        docs = scope["path"].startswith(DOCS_PATHS)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in EVERY_RESPONSE:
                    headers[name.decode()] = value.decode()
                if headers.get("content-type", "").startswith("text/html"):
                    headers["Content-Security-Policy"] = DOCS_CSP if docs else PAGE_CSP
                    headers["X-Frame-Options"] = "DENY"
            await send(message)

        await self.app(scope, receive, with_headers)


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(
    request: Request,
    sweeps: SweepsDep,
    user: PageUser,
    sweep_id: Annotated[int, FastPath(ge=1, le=MAX_INT)],
) -> HTMLResponse:
    """A sweep (service.sweeps): its trials, the objective against each parameter, the trials' curves
    with the best one drawn over the others, and Cancel."""
    found = SweepPublic.build(sweeps.view(sweep_id))
    data = {
        "metric": found.objective["metric"],
        "mode": found.objective["mode"],
        "best": found.best.job if found.best is not None else None,
        "params": sorted(found.spec.get("space", {})),
        "trials": [
            {
                "job": t.job,
                "trial": t.trial,
                "state": t.state.value,
                "objective": t.objective,
                "params": t.params,
            }
            for t in found.trials
        ],
    }
    context = {"sweep": found, "data": data, "colors": COLORS, "user": user}
    return templates.TemplateResponse(request, "sweep.html", context)


def install(app: FastAPI) -> None:
    """Add the pages (before the JSON routes they share a path with) and the static files."""
    app.add_middleware(SecurityHeaders)
    app.include_router(router)
    app.include_router(login_router)
    app.add_exception_handler(LoginRequired, login_required)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
