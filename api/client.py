"""The Python SDK: a typed client of the REST API, returning the API's own schemas (api.schemas).
It loads them when a method first needs them: they hold the job spec's models, and a listing read as
`JobSummary`s (`iter_job_summaries`, what `apiary jobs` shows) never builds those.

    from api.client import ApiaryClient
    with ApiaryClient("http://127.0.0.1:8000") as client:   # or APIARY_URL / the config file
        job = client.submit("job.yaml")                        # a path, a dict or a JobSpec
        for point in client.stream_metrics(job.id):            # live, until the job ends
            print(point.step, point.values["loss"])
        job = client.wait(job.id, timeout_s=600)

Errors: the API's refusals raise `ApiaryClientError` subclasses (`ApiaryNotFound`, `ApiaryConflict`,
`ApiaryInvalid` with `.field`, ...) carrying the server's message; a server that cannot be reached
raises `ApiaryConnectionError` after `retries` tries with backoff. A submit sends one
`Idempotency-Key` over all its tries, so a retried submit never creates two jobs.

Configuration (each from the first place that sets it): the arguments, then `APIARY_URL` and
`APIARY_TOKEN`, then the TOML file `$APIARY_CONFIG` or `~/.config/apiary/config.toml` (keys `url`,
`token`); the URL defaults to http://127.0.0.1:8000. The token (an admin makes one with `apiary token
create NAME`) is sent as `Authorization: Bearer <token>`, and says who you are: the owner of the jobs
you submit. A server without tokens (a local one) needs none.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
import tomllib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import httpx
from httpx_sse import EventSource, ServerSentEvent
from pydantic import BaseModel

from service.contract.code import DEFAULT_MAX_BYTES as DEFAULT_CODE_MAX_BYTES
from service.contract.code import pack
from service.contract.states import TERMINAL_STATES, JobState

if TYPE_CHECKING:
    # At run time `schemas` is `_Deferred`: the job spec's models load when a method first needs them.
    from api import schemas
    from api.schemas import (
        CheckpointPublic,
        CodePublic,
        ComparePublic,
        EventPublic,
        Health,
        JobPublic,
        JobsPublic,
        MetricPublic,
        MetricsPublic,
        ProfilesPublic,
        QueuePublic,
        SweepPublic,
        TokenCreated,
        TokenPublic,
        UserPublic,
    )
    from service.contract.spec import JobSpec

DEFAULT_URL = "http://127.0.0.1:8000"
Model = TypeVar("Model", bound=BaseModel)


class _Deferred:
    """A module imported when one of its names is first read (the API's schemas: their import builds
    the job spec's models, ~0.1 s of a command's start)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


if not TYPE_CHECKING:
    schemas = _Deferred("api.schemas")


# ---------------------------------------------------------------------------------------------
# Errors


class ApiaryClientError(Exception):
    """The API refused a request; `message` says why, `status_code` is the HTTP status (None: no
    answer), `field` the request field at fault when the server named one."""

    def __init__(
        self, message: str, *, status_code: int | None, body: Any = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body
        self.field = field


class ApiaryConnectionError(ApiaryClientError):
    """The server could not be reached (after the client's retries)."""


class ApiaryUnauthorized(ApiaryClientError):
    """401/403: no token, or one that may not do this."""


class ApiaryNotFound(ApiaryClientError):
    """404: no such job (or attempt, or logs)."""


class ApiaryConflict(ApiaryClientError):
    """409: the job is not in a state that allows this (e.g. cancelling a finished job)."""


class ApiaryInvalid(ApiaryClientError):
    """422: the request (a job spec) is invalid; `field` names the field."""


class ApiaryTooLarge(ApiaryInvalid):
    """413: the request (a code package) is larger than the server takes."""


class ApiaryUnavailable(ApiaryClientError):
    """503: the server or its Ray cluster is unavailable right now."""


_ERRORS: dict[int, type[ApiaryClientError]] = {
    401: ApiaryUnauthorized,
    403: ApiaryUnauthorized,
    404: ApiaryNotFound,
    409: ApiaryConflict,
    413: ApiaryTooLarge,
    422: ApiaryInvalid,
    503: ApiaryUnavailable,
}


def _error_of(response: httpx.Response) -> ApiaryClientError:
    field = None
    try:
        body: Any = response.json()
        message = body.get("message") or str(body.get("detail"))
        detail = body.get("detail")
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            loc = [str(part) for part in detail[0].get("loc", [])]
            if loc and loc[0] in ("body", "query", "path", "header"):
                loc = loc[1:]
            field = ".".join(loc) or None
    except (ValueError, AttributeError):
        body, message = response.text, response.text or response.reason_phrase
    cls = _ERRORS.get(response.status_code, ApiaryClientError)
    return cls(message, status_code=response.status_code, body=body, field=field)


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    url: str = DEFAULT_URL
    token: str | None = None

    @classmethod
    def load(cls, *, url: str | None = None, token: str | None = None) -> ClientConfig:
        """Arguments, then the environment, then the config file (see the module docstring)."""
        found = _read_config_file()
        return cls(
            url=url or os.environ.get("APIARY_URL") or str(found.get("url") or DEFAULT_URL),
            token=token or os.environ.get("APIARY_TOKEN") or _str_or_none(found.get("token")),
        )


def config_path() -> Path:
    if explicit := os.environ.get("APIARY_CONFIG"):
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "apiary" / "config.toml"


def _read_config_file() -> dict[str, Any]:
    path = config_path()
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ApiaryClientError(f"cannot read {path}: {err}", status_code=None) from None


def _str_or_none(value: Any) -> str | None:
    return str(value) if value else None


# ---------------------------------------------------------------------------------------------
# Server-sent events (the contract: GET /jobs/{id}/stream and /queues/stream)


class StreamEnd(BaseModel):
    """The `end` message of a job's stream: the job ended, everything was sent."""

    state: JobState


JobUpdate: TypeAlias = "JobPublic | EventPublic | MetricsPublic | StreamEnd"


def _job_message(event: str) -> type[BaseModel] | None:
    """The model of a job stream's message of type `event` (None: not one a client reads)."""
    models: dict[str, type[BaseModel]] = {
        "state": schemas.JobPublic,
        "event": schemas.EventPublic,
        "metrics": schemas.MetricsPublic,
        "end": StreamEnd,
    }
    return models.get(event)


# ---------------------------------------------------------------------------------------------
# Listings: GET /jobs read without the job spec's models


class WorkerRange(BaseModel):
    min: int
    max: int


class SpecSummary(BaseModel):
    """What a listing shows of a job's spec."""

    num_workers: int | WorkerRange
    max_steps: int | None = None

    @property
    def max_workers(self) -> int:
        return self.num_workers.max if isinstance(self.num_workers, WorkerRange) else self.num_workers


class JobSummary(BaseModel):
    """A job as `apiary jobs` lists it: the fields of `JobPublic` that a listing shows (the rest of the
    answer is ignored), read without building the job spec's models."""

    id: int
    name: str
    queue: str
    priority: int
    owner: str
    state: JobState
    latest_step: int | None
    created_at: datetime
    spec: SpecSummary


class JobSummaries(BaseModel):
    data: list[JobSummary]
    count: int


# ---------------------------------------------------------------------------------------------
# The client


class ApiaryClient:
    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout_s: float = 30,
        retries: int = 4,
        backoff_s: float = 0.25,
    ) -> None:
        """`retries`: further tries after a connection error, waiting `backoff_s`, then twice that,
        and so on (at most 5 s)."""
        config = ClientConfig.load(url=base_url, token=token)
        headers = {}
        if config.token:
            headers["Authorization"] = f"Bearer {config.token}"
        self.url = config.url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        # A plain-HTTP server needs no certificates: without this, every client loads certifi's CA
        # store (~25-70 ms of a CLI command's CPU) for a TLS it never speaks.
        verify = self.url.lower().startswith("https://")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, verify=verify)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiaryClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, resend: bool, **kwargs: Any) -> httpx.Response:
        """One request, tried again after a connection error. A request that may have reached the
        server (a read timeout, a dropped answer) is sent again only if `resend` (safe to repeat)."""
        for attempt in range(self.retries + 1):
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as err:
                never_sent = isinstance(err, httpx.ConnectError | httpx.ConnectTimeout)
                if attempt == self.retries or not (never_sent or resend):
                    raise ApiaryConnectionError(
                        f"cannot reach Apiary at {self.url}: {err or type(err).__name__}", status_code=None
                    ) from None
                time.sleep(min(self.backoff_s * 2**attempt, 5.0))
                continue
            if not response.is_success:
                raise _error_of(response)
            return response
        raise AssertionError("unreachable")

    def _call(self, method: str, path: str, model: type[Model], *, resend: bool, **kwargs: Any) -> Model:
        return model.model_validate(self._send(method, path, resend=resend, **kwargs).json())

    def _get(self, path: str, model: type[Model], **kwargs: Any) -> Model:
        return self._call("GET", path, model, resend=True, **kwargs)

    def _post(self, path: str, model: type[Model], *, resend: bool = False, **kwargs: Any) -> Model:
        return self._call("POST", path, model, resend=resend, **kwargs)

    # --- jobs -------------------------------------------------------------------------------

    def submit(
        self,
        spec: JobSpec | dict[str, Any] | str | Path,
        *,
        code: str | Path | None = None,
        max_code_bytes: int = DEFAULT_CODE_MAX_BYTES,
        idempotency_key: str | None = None,
    ) -> JobPublic:
        """Queue a job: a JobSpec, a dict, or the path of a YAML/JSON file. With `code` (a folder), the
        folder is packed and uploaded first (`upload_code`, refused here above `max_code_bytes`) and the
        spec names it: the job's trainer may be a module in it. One Idempotency-Key (a fresh uuid unless
        given) for all tries: the server keeps one job for it."""
        from service.contract.spec import JobSpec, parse_spec_text

        if isinstance(spec, JobSpec):
            # What was written, not the defaults: a field given explicitly may be refused for the
            # trainer's kind (checkpoint.async for a Ray function) where its default is not.
            payload: dict[str, Any] = spec.model_dump(mode="json", exclude_unset=True)
        elif isinstance(spec, dict):
            payload = dict(spec)
        else:
            payload = parse_spec_text(Path(spec).read_text())
        if code is not None:
            payload["code"] = self.upload_code(code, max_bytes=max_code_bytes).digest
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        return self._post("/jobs", schemas.JobPublic, resend=True, json=payload, headers=headers)

    def sweep(
        self,
        sweep: dict[str, Any] | str | Path,
        *,
        code: str | Path | None = None,
        max_code_bytes: int = DEFAULT_CODE_MAX_BYTES,
    ) -> SweepPublic:
        """Start a sweep: a dict or the path of a YAML/JSON sweep file (service.contract.sweep). With
        `code`, the folder is uploaded first and every trial runs it."""
        from service.contract.spec import parse_spec_text

        payload = dict(sweep) if isinstance(sweep, dict) else parse_spec_text(Path(sweep).read_text())
        if code is not None:
            base = dict(payload.get("base") or {})
            base["code"] = self.upload_code(code, max_bytes=max_code_bytes).digest
            payload["base"] = base
        return self._post("/sweeps", schemas.SweepPublic, json=payload)

    def sweeps(self, *, limit: int = 100) -> list[SweepPublic]:
        return self._get("/sweeps", schemas.SweepsPublic, params={"limit": limit}).data

    def get_sweep(self, sweep_id: int) -> SweepPublic:
        return self._get(f"/sweeps/{sweep_id}", schemas.SweepPublic)

    def cancel_sweep(self, sweep_id: int) -> SweepPublic:
        return self._post(f"/sweeps/{sweep_id}/cancel", schemas.SweepPublic, resend=True)

    def best_spec(self, sweep_id: int, *, queue: str | None = None) -> JobSpec:
        """The sweep's best trial's spec, ready to submit (in `queue` if given)."""
        from service.contract.spec import JobSpec

        return self._get(f"/sweeps/{sweep_id}/best", JobSpec, params=_without_none(queue=queue))

    def resume(self, job_id: int) -> JobPublic:
        """Queue a pruned trial again, from its checkpoint."""
        return self._post(f"/jobs/{job_id}/resume", schemas.JobPublic, resend=True)

    def upload_code(self, folder: str | Path, *, max_bytes: int = DEFAULT_CODE_MAX_BYTES) -> CodePublic:
        """Pack `folder` (service.contract.code: without .git, __pycache__, .venv and what its
        .apiaryignore lists) and upload it; a spec names it by the answer's `digest`. A folder over
        `max_bytes` raises `CodeTooLarge` before anything is sent (the server has its own limit:
        413)."""
        package = pack(Path(folder), max_bytes=max_bytes)
        return self._call(
            "PUT",
            f"/code/{package.sha256}",
            schemas.CodePublic,
            resend=True,  # content-addressed: sending it twice stores it once
            content=package.data,
            headers={"Content-Type": "application/octet-stream"},
        )

    def code(self, job_id: int) -> bytes:
        """The code package job `job_id` ran (a zip), to its owner or an admin."""
        return self._send("GET", f"/jobs/{job_id}/code", resend=True).content

    def get(self, job_id: int) -> JobPublic:
        return self._get(f"/jobs/{job_id}", schemas.JobPublic)

    def list_jobs(
        self,
        *,
        state: list[str] | list[JobState] | None = None,
        queue: str | None = None,
        offset: int = 0,
        limit: int = 100,
    ) -> JobsPublic:
        """One page of jobs, newest first; `count` is how many match in all."""
        params = _jobs_params(state=state, queue=queue, offset=offset, limit=limit)
        return self._get("/jobs", schemas.JobsPublic, params=params)

    def iter_jobs(
        self,
        *,
        state: list[str] | list[JobState] | None = None,
        queue: str | None = None,
        page_size: int = 100,
    ) -> Iterator[JobPublic]:
        """Every matching job, newest first, fetching page after page (a job submitted meanwhile
        shifts the pages: each job is still yielded once)."""
        return self._iter_jobs(schemas.JobsPublic, state=state, queue=queue, page_size=page_size)

    def iter_job_summaries(
        self,
        *,
        state: list[str] | list[JobState] | None = None,
        queue: str | None = None,
        page_size: int = 100,
    ) -> Iterator[JobSummary]:
        """`iter_jobs`, each job read as a `JobSummary`: what a listing shows, without its spec."""
        return self._iter_jobs(JobSummaries, state=state, queue=queue, page_size=page_size)

    def _iter_jobs(
        self,
        page_model: type[BaseModel],
        *,
        state: list[str] | list[JobState] | None,
        queue: str | None,
        page_size: int,
    ) -> Iterator[Any]:
        seen: set[int] = set()
        offset = 0
        while True:
            params = _jobs_params(state=state, queue=queue, offset=offset, limit=page_size)
            page: Any = self._get("/jobs", page_model, params=params)
            for job in page.data:
                if job.id not in seen:
                    seen.add(job.id)
                    yield job
            offset += len(page.data)
            if not page.data or offset >= page.count:
                return

    def cancel(self, job_id: int) -> JobPublic:
        return self._post(f"/jobs/{job_id}/cancel", schemas.JobPublic)

    def preempt(self, job_id: int) -> JobPublic:
        """Checkpoint a running job and put it back in its queue; it resumes from that checkpoint."""
        return self._post(f"/jobs/{job_id}/preempt", schemas.JobPublic)

    def update(self, job_id: int, *, queue: str | None = None, priority: int | None = None) -> JobPublic:
        """Change a job's priority or (while it waits) queue: admins only."""
        body = _without_none(queue=queue, priority=priority)
        return self._call("PATCH", f"/jobs/{job_id}", schemas.JobPublic, resend=True, json=body)

    def wait(self, job_id: int, *, timeout_s: float = 600, poll_s: float = 1.0) -> JobPublic:
        """Block until the job ends; TimeoutError (with its last state) if it has not by `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if job.state in TERMINAL_STATES:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.state.value} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def events(self, job_id: int) -> list[EventPublic]:
        return self._get(f"/jobs/{job_id}/events", schemas.EventsPublic).data

    def metrics(self, job_id: int, **filters: int | str) -> list[MetricPublic]:
        """Stored points, by step then rank; filters: rank, min_step, max_step, limit, segments."""
        return self._get(f"/jobs/{job_id}/metrics", schemas.MetricsPublic, params=filters).data

    def checkpoints(self, job_id: int) -> list[CheckpointPublic]:
        return self._get(f"/jobs/{job_id}/checkpoints", schemas.CheckpointsPublic).data

    def profiles(self, job_id: int) -> ProfilesPublic:
        """The job's profiles (`profile` in its spec): each one's folder, trace files and split."""
        return self._get(f"/jobs/{job_id}/profiles", schemas.ProfilesPublic)

    def logs(
        self, job_id: int, *, attempt: int | None = None, tail: int | None = None, raw: bool = False
    ) -> str:
        """The job's log so far (driver and ranks) for `attempt` (default the latest); terminal escape
        sequences stripped unless `raw`."""
        params = {**_without_none(attempt=attempt, tail=tail), **({"raw": "true"} if raw else {})}
        return self._send("GET", f"/jobs/{job_id}/logs", resend=True, params=params).text

    def follow_logs(
        self, job_id: int, *, attempt: int | None = None, tail: int | None = None, raw: bool = False
    ) -> Iterator[str]:
        """The log in chunks as it grows, until the job's Ray job ends."""
        params = {
            **_without_none(attempt=attempt, tail=tail),
            "follow": "true",
            **({"raw": "true"} if raw else {}),
        }
        with self._open_stream(f"/jobs/{job_id}/logs", params=params, headers={}) as response:
            yield from response.iter_text()

    def compare(self, job_ids: Sequence[int]) -> ComparePublic:
        """Jobs side by side: final and best metrics, and the spec keys they differ in."""
        return self._get(
            "/compare", schemas.ComparePublic, params={"jobs": ",".join(str(i) for i in job_ids)}
        )

    def tensorboard_logdirs(self, job_ids: Sequence[int] = ()) -> list[str]:
        """The jobs' TensorBoard folders (none given: the storage root, which holds every job's)."""
        answer = self._send("GET", "/tensorboard", resend=True, params={"job": list(job_ids)})
        logdirs: list[str] = answer.json()["logdirs"]
        return logdirs

    # --- who you are, and tokens (admins) -------------------------------------------------------

    def me(self) -> UserPublic:
        """Who this client's token is (without one, on a server without tokens: its local user)."""
        return self._get("/me", schemas.UserPublic)

    def create_token(self, user: str, *, admin: bool = False) -> TokenCreated:
        """A new token for `user`; its secret (`.token`) is in this answer only."""
        return self._post("/admin/tokens", schemas.TokenCreated, json={"user": user, "admin": admin})

    def tokens(self) -> list[TokenPublic]:
        return self._get("/admin/tokens", schemas.TokensPublic).data

    def revoke_token(self, token_id: int) -> TokenPublic:
        return self._call("DELETE", f"/admin/tokens/{token_id}", schemas.TokenPublic, resend=True)

    # --- queues and health ------------------------------------------------------------------

    def queues(self, *, limit: int = 100) -> list[QueuePublic]:
        return self.queues_overview(limit=limit).data

    def queues_overview(self, *, limit: int = 100) -> schemas.QueuesPublic:
        """GET /queues whole: both queues (`data`) and the cluster's spot nodes (`spot`)."""
        return self._get("/queues", schemas.QueuesPublic, params={"limit": limit})

    def health(self) -> Health:
        """Readiness (GET /readyz): whether the database and Ray answer."""
        response = self._http.get("/readyz")  # 503 still answers with the body
        return schemas.Health.model_validate(response.json())

    # --- streams ----------------------------------------------------------------------------

    def stream(self, job_id: int) -> Iterator[JobUpdate]:
        """A job's live stream: JobPublic on each change (first the current one), EventPublic,
        MetricsPublic batches, and last StreamEnd. A dropped connection is resumed (Last-Event-ID)."""
        for message in self._sse(f"/jobs/{job_id}/stream", until="end"):
            model = _job_message(message.event)
            if model is not None:
                yield model.model_validate_json(message.data)  # type: ignore[misc]

    def stream_metrics(self, job_id: int) -> Iterator[MetricPublic]:
        """New metric points as they arrive, until the job ends."""
        for update in self.stream(job_id):
            if isinstance(update, schemas.MetricsPublic):
                yield from update.data

    def stream_events(self, job_id: int) -> Iterator[EventPublic]:
        """The job's events (its whole history first), until the job ends."""
        for update in self.stream(job_id):
            if isinstance(update, schemas.EventPublic):
                yield update

    def stream_queues(self) -> Iterator[list[QueuePublic]]:
        """The queues (GET /queues) now and whenever they change; endless."""
        for message in self._sse("/queues/stream", until=None):
            if message.event == "queues":
                yield schemas.QueuesPublic.model_validate_json(message.data).data

    def _sse(self, path: str, *, until: str | None) -> Iterator[ServerSentEvent]:
        """Messages of an event stream; reconnects with Last-Event-ID when the connection drops
        (`retries` tries in a row, with backoff), until a message of type `until` arrives."""
        last_id: str | None = None
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_id is not None:
                headers["Last-Event-ID"] = last_id
            try:
                with self._open_stream(path, params={}, headers=headers) as response:
                    for message in EventSource(response).iter_sse():
                        if not message.data:  # httpx-sse passes on a comment that follows an id
                            continue
                        failures = 0
                        last_id = message.id or last_id
                        yield message
                        if message.event == until:
                            return
            except (httpx.TransportError, ApiaryConnectionError) as err:
                reason: Exception = err
            else:
                reason = ApiaryConnectionError(f"{path} closed before its end", status_code=None)
            failures += 1
            if failures > self.retries:
                raise ApiaryConnectionError(
                    f"lost the stream {self.url}{path}: {reason}", status_code=None
                ) from None
            time.sleep(min(self.backoff_s * 2 ** (failures - 1), 5.0))

    @contextlib.contextmanager
    def _open_stream(
        self, path: str, *, params: dict[str, Any], headers: dict[str, str]
    ) -> Iterator[httpx.Response]:
        """An open streaming GET, its status checked; no read timeout (a quiet stream is not dead)."""
        timeout = httpx.Timeout(self._http.timeout.connect or 30, read=None)
        try:
            with self._http.stream("GET", path, params=params, headers=headers, timeout=timeout) as response:
                if not response.is_success:
                    response.read()
                    raise _error_of(response)
                yield response
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            message = f"cannot reach Apiary at {self.url}: {err}"
            raise ApiaryConnectionError(message, status_code=None) from None

    def plan(
        self,
        *,
        facts: dict[str, Any] | None = None,
        spec: JobSpec | dict[str, Any] | None = None,
        job_id: int | None = None,
    ) -> dict[str, Any]:
        """The cluster math of a run (POST /plan): {"plan": flat quantities, "rows", "facts", "sources"}.
        Facts (service.planning.formulas.PlanFacts names) win over the job's measurements, which win over the
        spec."""
        if isinstance(spec, BaseModel):  # a JobSpec
            spec = spec.model_dump(mode="json")
        body = {"facts": facts or {}, "spec": spec, "job_id": job_id}
        # Pure arithmetic on the server: safe to send again.
        result: dict[str, Any] = self._send("POST", "/plan", resend=True, json=body).json()
        return result


def _jobs_params(
    *, state: list[str] | list[JobState] | None, queue: str | None, offset: int, limit: int
) -> dict[str, Any]:
    params: dict[str, Any] = {"offset": offset, "limit": limit}
    if state:
        params["state"] = [str(s) for s in state]
    if queue:
        params["queue"] = queue
    return params


def _without_none(**params: Any) -> dict[str, Any]:
    return {key: value for key, value in params.items() if value is not None}
