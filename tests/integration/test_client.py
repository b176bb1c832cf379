"""The SDK (api.client) over real HTTP: against the real app (SQLite, fake cluster) for the REST calls,
and against small stand-in HTTP servers for what the app does not do here (a connection dropped
mid-request, the server-sent-event streams of /work/notes' contract)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.client import (
    ApiaryClient,
    ApiaryConflict,
    ApiaryConnectionError,
    ApiaryInvalid,
    ApiaryNotFound,
    StreamEnd,
)
from api.schemas import EventPublic, JobPublic, MetricsPublic
from service.cluster import RayJobStatus, free_port
from service.contract.spec import JobSpec
from tests.conftest import MigratedTemplates, migrated_sqlite
from tests.integration.conftest import Service


@pytest.fixture
def database_url(tmp_path: Path, migrated_templates: MigratedTemplates) -> str:
    """SQLite only: the SDK is under test here, not the database (tests/integration/test_api.py)."""
    return migrated_sqlite(tmp_path, migrated_templates)


# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "sdk-test",
}


@pytest.fixture
def client(service: Service) -> Iterator[ApiaryClient]:
    with ApiaryClient(str(service.http.base_url), retries=1, backoff_s=0.01) as client:
        yield client


def test_submit_takes_a_dict_a_jobspec_or_a_yaml_file_and_returns_the_apis_schema(
    client: ApiaryClient, spec: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**spec, "name": "from-yaml"}))
    jobs = [
        client.submit(spec),
        client.submit(JobSpec.model_validate({**spec, "name": "from-spec"})),
        client.submit(path),
        client.submit(str(path)),
    ]
    assert all(isinstance(job, JobPublic) for job in jobs)
    assert [job.name for job in jobs] == ["sdk-test", "from-spec", "from-yaml", "from-yaml"]
    assert jobs[0].owner == "ada" and jobs[0].state == "queued"
    fetched = client.get(jobs[1].id)
    assert isinstance(fetched.spec, JobSpec) and fetched.spec.name == "from-spec" and fetched.id == jobs[1].id


def test_pages_and_the_iterator_over_all_of_them(client: ApiaryClient, spec: dict[str, Any]) -> None:
    ids = [client.submit({**spec, "name": f"j{i}"}).id for i in range(5)]
    page = client.list_jobs(limit=2, offset=1)
    assert page.count == 5 and [job.id for job in page.data] == ids[::-1][1:3]
    assert [job.id for job in client.iter_jobs(page_size=2)] == ids[::-1]
    # What `apiary jobs` lists: the same jobs, read without their specs' models.
    shown = ("id", "name", "queue", "priority", "owner", "state", "latest_step", "created_at")
    assert [
        (*(getattr(job, name) for name in shown), job.spec.max_workers, job.spec.max_steps)
        for job in client.iter_job_summaries(page_size=2)
    ] == [
        (*(getattr(job, name) for name in shown), job.spec.max_workers, job.spec.max_steps)
        for job in client.iter_jobs()
    ]
    assert [job.id for job in client.iter_jobs(state=["cancelled"])] == []
    client.cancel(ids[0])
    assert [job.id for job in client.iter_jobs(state=["cancelled"], page_size=1)] == [ids[0]]


def test_refusals_raise_typed_errors_with_the_servers_message_and_field(
    client: ApiaryClient, spec: dict[str, Any]
) -> None:
    with pytest.raises(ApiaryNotFound) as missing:
        client.get(999)
    assert (missing.value.message, missing.value.status_code) == ("job 999 does not exist", 404)

    job = client.submit(spec)
    assert client.cancel(job.id).state == "cancelled"
    with pytest.raises(ApiaryConflict, match=f"job {job.id} is already cancelled"):
        client.cancel(job.id)

    with pytest.raises(ApiaryInvalid) as invalid:
        client.submit({**spec, "max_steps": 0})
    assert invalid.value.field == "max_steps" and "greater than or equal to 1" in invalid.value.message
    with pytest.raises(ApiaryInvalid) as no_data:  # refused by the service, not by the schema
        client.submit({**spec, "dataset": {"uri": "file:///nowhere/at/all"}})
    assert no_data.value.field == "dataset.uri"


def test_wait_returns_the_ended_job_or_times_out(
    service: Service, client: ApiaryClient, spec: dict[str, Any]
) -> None:
    job = client.submit(spec)
    with pytest.raises(TimeoutError, match=f"job {job.id} is still queued"):
        client.wait(job.id, timeout_s=0.3, poll_s=0.1)
    service.tick()
    service.backend.statuses[service.backend.submission_of(job.id)] = RayJobStatus.SUCCEEDED
    service.tick()
    assert client.wait(job.id, timeout_s=5, poll_s=0.1).state == "succeeded"


def test_logs_and_following_them(service: Service, client: ApiaryClient, spec: dict[str, Any]) -> None:
    job = client.submit(spec)
    with pytest.raises(ApiaryConflict, match="has not started yet"):
        client.logs(job.id)
    service.tick()
    submission_id = service.backend.submission_of(job.id)
    service.backend.logs[submission_id] = "a\nb\nc\n"
    assert client.logs(job.id) == "a\nb\nc\n"
    assert client.logs(job.id, tail=1, attempt=1) == "c\n"
    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    assert "".join(client.follow_logs(job.id, tail=2)) == "b\nc\n"


# ---------------------------------------------------------------------------------------------
# Stand-in servers


class StandIn:
    """A real HTTP server on 127.0.0.1 whose handler is `respond(handler, number_of_the_request)`."""

    def __init__(self, respond: Callable[[BaseHTTPRequestHandler, int], None]) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                stand_in.requests.append((self.path, dict(self.headers)))
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                respond(self, len(stand_in.requests))

            do_GET = do_POST = handle_one

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def send(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def job_json(spec: dict[str, Any], *, state: str = "queued") -> dict[str, Any]:
    now = "2026-01-01T00:00:00Z"
    return JobPublic.model_validate(
        {
            **dict.fromkeys(
                [
                    "ray_submission_id",
                    "latest_checkpoint",
                    "latest_checkpoint_step",
                    "message",
                    "queue_position",
                    "waiting_reason",
                    "eta_at",
                    "latest_step",
                    "stop_requested",
                    "ranks",
                    "admitted_at",
                    "started_at",
                    "finished_at",
                ]
            ),
            **{"id": 1, "name": spec["name"], "queue": "research", "priority": 0, "owner": "ada"},
            **{"state": state, "attempt": 0, "spec": spec, "preemptions": 0, "restarts": 0, "failures": 0},
            **{"created_at": now, "updated_at": now},
        }
    ).model_dump(mode="json")


def test_a_submit_retried_after_a_dropped_connection_sends_the_same_idempotency_key(
    spec: dict[str, Any],
) -> None:
    def respond(handler: BaseHTTPRequestHandler, number: int) -> None:
        if number == 1:  # the request arrived; the answer is lost
            handler.close_connection = True
            handler.connection.shutdown(2)
            return
        send(handler, 201, json.dumps(job_json(spec)).encode(), "application/json")

    stand_in = StandIn(respond)
    try:
        with ApiaryClient(stand_in.url, token="s3cret", retries=2, backoff_s=0.01) as client:
            assert client.submit(spec).name == "sdk-test"
            client.submit(spec)
    finally:
        stand_in.close()
    keys = [headers["Idempotency-Key"] for _path, headers in stand_in.requests]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]
    assert all(headers["Authorization"] == "Bearer s3cret" for _path, headers in stand_in.requests)


def test_a_server_that_is_not_there_is_one_connection_error_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with ApiaryClient(url, retries=2, backoff_s=0.01) as client, pytest.raises(ApiaryConnectionError) as err:
        client.get(1)
    assert err.value.message.startswith(f"cannot reach Apiary at {url}")


def test_the_config_file_gives_the_url_and_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any]
) -> None:
    stand_in = StandIn(lambda h, _n: send(h, 200, json.dumps(job_json(spec)).encode(), "application/json"))
    (tmp_path / "apiary").mkdir()
    (tmp_path / "apiary" / "config.toml").write_text(f'url = "{stand_in.url}"\ntoken = "from-file"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in ("APIARY_URL", "APIARY_TOKEN", "APIARY_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    try:
        with ApiaryClient() as client:
            client.get(1)
    finally:
        stand_in.close()
    assert stand_in.requests[0][1]["Authorization"] == "Bearer from-file"


def sse(*messages: tuple[str, str, Any]) -> bytes:
    """Messages (id, event, data) in the contract's wire format, with a keep-alive comment."""
    out = ": keep-alive\n\n"
    for message_id, event, data in messages:
        out += f"id: {message_id}\nevent: {event}\ndata: {json.dumps(data)}\n\n"
    return out.encode()


def test_stream_messages_are_read_as_the_event_stream_format_says(spec: dict[str, Any]) -> None:
    """Comments (a keep-alive after an id too) are no messages, `data:` lines join with a newline, and
    only CR and LF end a line: pydantic writes U+2028 in a string as it is."""
    event = {"id": 1, "at": "2026-01-01T00:00:00Z", "from_state": None, "to_state": "failed"}
    event |= {"actor": "system", "reason": "first line\u2028second line"}
    body = "id: 1.0\nevent: event\ndata: {\n"
    body += f"data: {json.dumps(event, ensure_ascii=False)[1:]}\n\n"
    body += ": keep-alive\n\n" + sse(("1.0", "end", {"state": "failed"})).decode()

    def respond(handler: BaseHTTPRequestHandler, _number: int) -> None:
        send(handler, 200, body.encode(), "text/event-stream")

    stand_in = StandIn(respond)
    try:
        with ApiaryClient(stand_in.url, retries=0) as client:
            updates = list(client.stream(1))
    finally:
        stand_in.close()
    assert updates == [EventPublic.model_validate(event), StreamEnd(state="failed")]


def test_streams_resume_with_last_event_id_after_a_dropped_connection(spec: dict[str, Any]) -> None:
    point = {"rank": 0, "attempt": 1, "segment": 0, "time": 1.0, "values": {"loss": 1.0}}
    event = {"id": 1, "at": "2026-01-01T00:00:00Z", "from_state": None, "to_state": "queued"}
    event |= {"actor": "user", "reason": "submitted"}
    first = sse(
        ("1.0", "state", job_json(spec, state="running")),
        ("1.0", "event", event),
        ("1.2", "metrics", {"data": [{**point, "step": 1}, {**point, "step": 2}], "count": 2}),
    )
    rest = sse(
        ("1.2", "state", job_json(spec, state="running")),
        ("1.3", "metrics", {"data": [{**point, "step": 3}], "count": 1}),
        ("2.3", "state", job_json(spec, state="succeeded")),
        ("2.3", "end", {"state": "succeeded"}),
    )

    def respond(handler: BaseHTTPRequestHandler, number: int) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Connection", "close")  # the body ends when the connection closes
        handler.end_headers()
        # Odd requests drop after the first part (a proxy cut it); even ones send the rest.
        handler.wfile.write(first if number % 2 else rest)
        handler.close_connection = True

    stand_in = StandIn(respond)
    try:
        with ApiaryClient(stand_in.url, retries=1, backoff_s=0.01) as client:
            updates = list(client.stream(1))
            steps = [p.step for p in client.stream_metrics(1)]
            events = list(client.stream_events(1))
    finally:
        stand_in.close()
    assert [type(u) for u in updates] == [
        JobPublic,
        EventPublic,
        MetricsPublic,
        JobPublic,
        MetricsPublic,
        JobPublic,
        StreamEnd,
    ]
    assert updates[-1] == StreamEnd(state="succeeded")
    assert steps == [1, 2, 3]
    assert [e.reason for e in events] == ["submitted"]
    paths = [(path, headers.get("Last-Event-ID")) for path, headers in stand_in.requests]
    assert paths[:2] == [("/jobs/1/stream", None), ("/jobs/1/stream", "1.2")]


def test_an_https_server_must_show_a_certificate_the_client_trusts(tmp_path: Path) -> None:
    """A plain-HTTP URL skips loading the CA store; an https one still verifies: a self-signed server is
    refused before anything is sent."""
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    command = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=127.0.0.1",
    ]
    subprocess.run(
        [*command, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            self.send_response(200)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}"
        with (
            ApiaryClient(url, retries=0) as client,
            pytest.raises(ApiaryConnectionError, match="CERTIFICATE_VERIFY_FAILED"),
        ):
            client.get(1)
    finally:
        server.shutdown()
    assert requests == []
