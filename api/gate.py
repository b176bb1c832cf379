"""Authenticate before reading: a request that carries a body is refused (401) on its headers alone when
they hold no valid credential, before a byte of its body is read or parsed (Kubernetes' API server
does the same), so that a client without a credential cannot make the service read and parse megabytes.

- `/internal/jobs/{id}/telemetry`: the attempt's report token (`JobService.check_report_token`);
- every other route that needs a user (service.auth): the bearer token or the web session cookie, as
  `api.deps.get_current_user` reads them (it checks again, with the rest of the route's rules);
- not `/login` and `/logout` (their form is the credential), nor what needs no user (health, metrics).

`api.limits.BodyLimit`, inside this, then caps what an authenticated request may send as it streams.
A refused request's body is left unread, and its connection closed (`Connection: close`), so that
uvicorn does not read and discard the rest of it either.
"""

from __future__ import annotations

import re

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from api import errors
from api.deps import GATE_USER, authenticate_request, bearer_of
from service.contract.errors import ApiaryError, JobNotFound
from service.runtime import Runtime

TELEMETRY = re.compile(r"^/internal/jobs/([0-9]{1,16})/telemetry$")
WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})
NO_USER = frozenset({"/login", "/logout"})


class AuthenticateFirst:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WITH_BODY or scope["path"] in NO_USER:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        runtime: Runtime | None = getattr(request.app.state, "runtime", None)
        if runtime is None:  # not started: the routes answer as they do
            await self.app(scope, receive, send)
            return
        try:
            await run_in_threadpool(self._check, runtime, request)
        except JobNotFound:
            pass  # the route says 404 (after reading the body, as for any unknown job)
        except ApiaryError as error:
            response = await errors.apiary_error(request, error)
            # The body is left unread: closing the connection spares reading (and discarding) the rest.
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        except Exception as error:
            if not errors.is_database_unavailable(error):
                raise
            await (await errors.database_error(request, error))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _check(runtime: Runtime, request: Request) -> None:
        bearer = bearer_of(request.headers.get("authorization"))
        telemetry = TELEMETRY.match(request.url.path)
        if telemetry is not None:
            if request.method == "POST":  # its one method (another is a 405, with or without a token)
                runtime.jobs.check_report_token(int(telemetry.group(1)), bearer)
        elif not request.url.path.startswith("/internal/"):
            # Kept for the route (api.deps.get_current_user): one token lookup per request.
            setattr(request.state, GATE_USER, authenticate_request(runtime.auth, request))
