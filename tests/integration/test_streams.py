"""The SSE streams (GET /jobs/{id}/stream, GET /queues/stream) and the metrics' downsampling, over real
HTTP on SQLite and PostgreSQL (contract: docs/jobs.md, "Live streams")."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.routes import streams
from service.cluster import free_port
from service.contract.protocol import MAX_POINTS_PER_POST
from tests.integration.conftest import Service
from tests.support.sse import SseReader
from tests.support.wait import wait_until

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "stream-test",
    "num_workers": 2,
    "max_steps": 1000,
}


def post_points(service: Service, job_id: int, steps: range, *, attempt: int = 1, segment: int = 0) -> None:
    """Post points as the job's attempt does (the job was admitted: `tick()`)."""
    points = [
        {"step": step, "rank": rank, "time": 1.0 + step, "values": {"loss": 2.0 - step / 1000}}
        for step in steps
        for rank in (0, 1)
    ]
    for start in range(0, len(points), MAX_POINTS_PER_POST):  # as a trainer posts them
        body = {"attempt": attempt, "segment": segment, "points": points[start : start + MAX_POINTS_PER_POST]}
        response = service.report(job_id, body)
        assert response.status_code == 202, response.text


def stream(service: Service, path: str, **headers: str) -> SseReader:
    return SseReader(str(service.http.base_url), path, headers=headers)


def test_a_job_stream_sends_state_events_and_points_live_then_ends(
    service: Service, spec: dict[str, Any]
) -> None:
    job = service.submit(spec)
    service.tick()  # admitted: its attempt reports
    post_points(service, job["id"], range(3))
    reader = stream(service, f"/jobs/{job['id']}/stream")
    try:
        assert reader.status_code == 200 and reader.content_type.startswith("text/event-stream")
        first = reader.until("metrics")
        assert first[0].event == "state" and first[0].data["id"] == job["id"]
        assert [m.data["to_state"] for m in first if m.event == "event"] == ["queued", "admitted"]
        assert [(p["step"], p["rank"]) for p in first[-1].data["data"]] == [
            (s, r) for s in range(3) for r in (0, 1)
        ]

        post_points(service, job["id"], range(3, 5))  # while the client watches
        live = reader.until("metrics")
        assert [(p["step"], p["rank"]) for p in live[-1].data["data"]] == [
            (s, r) for s in (3, 4) for r in (0, 1)
        ]

        assert service.http.post(f"/jobs/{job['id']}/cancel").status_code == 200
        rest = reader.until("end")
        assert rest[-1].data == {"state": "cancelled"}
        assert [m.data["state"] for m in rest if m.event == "state"] == ["cancelled"]
        assert [m.data["to_state"] for m in rest if m.event == "event"] == ["cancelled"]
        assert reader.next() is None  # the server closed it
    finally:
        reader.close()


def test_a_resumed_job_stream_sends_only_what_came_after_the_last_id(
    service: Service, spec: dict[str, Any]
) -> None:
    job = service.submit(spec)
    service.tick()  # admitted: its attempt reports
    post_points(service, job["id"], range(2))
    service.http.post(f"/jobs/{job['id']}/cancel")
    reader = stream(service, f"/jobs/{job['id']}/stream")
    whole = reader.until("end")
    reader.close()
    assert [m.event for m in whole] == ["state", "event", "event", "event", "metrics", "end"]
    after_first_event = whole[2].id  # queued, then admitted

    # The header (as a browser's EventSource sends it) and the query parameter are the same.
    for resumed in (
        stream(service, f"/jobs/{job['id']}/stream", **{"Last-Event-ID": after_first_event}),
        stream(service, f"/jobs/{job['id']}/stream?last_event_id={after_first_event}"),
    ):
        again = resumed.until("end")
        resumed.close()
        assert [m.event for m in again] == ["state", "event", "metrics", "end"]  # state is always re-sent
        assert again[1].data["to_state"] == "cancelled"
        assert again[2].data["count"] == 4

    at_end = stream(service, f"/jobs/{job['id']}/stream", **{"Last-Event-ID": whole[-1].id})
    assert [m.event for m in at_end.until("end")] == ["state", "end"]
    at_end.close()


def test_a_stream_sends_only_the_points_that_count(service: Service, spec: dict[str, Any]) -> None:
    """A restarted worker group replays steps: a point replaced by a newer segment's is not sent."""
    job = service.submit(spec)
    service.tick()  # admitted: its attempt reports
    post_points(service, job["id"], range(4), segment=100)
    post_points(service, job["id"], range(2, 4), segment=200)  # resumed from step 1
    service.http.post(f"/jobs/{job['id']}/cancel")
    reader = stream(service, f"/jobs/{job['id']}/stream")
    points = [p for m in reader.until("end") if m.event == "metrics" for p in m.data["data"]]
    reader.close()
    assert [(p["step"], p["rank"], p["segment"]) for p in points] == [
        (0, 0, 100), (0, 1, 100), (1, 0, 100), (1, 1, 100),
        (2, 0, 200), (2, 1, 200), (3, 0, 200), (3, 1, 200),
    ]  # fmt: skip


def test_bad_stream_requests_are_404_and_422(service: Service) -> None:
    assert service.http.get("/jobs/999/stream").status_code == 404
    bad = service.http.get("/jobs/999/stream", headers={"Last-Event-ID": "yesterday"})
    assert bad.status_code == 422 and "last-event-id" in bad.json()["message"].lower()
    bad = service.http.get("/jobs/999/stream", params={"last_event_id": "1.x"})
    assert bad.status_code == 422 and "last_event_id" in bad.json()["message"]


def test_a_client_that_goes_away_ends_its_stream(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit(spec)
    # The count is the process's: the streams of earlier tests' servers must have ended first.
    wait_until(lambda: streams.open_streams == 0, timeout_s=10, what="earlier streams ending")
    before = 0
    readers = [stream(service, f"/jobs/{job['id']}/stream"), stream(service, "/queues/stream")]
    for reader in readers:
        reader.next()
    assert streams.open_streams == before + 2
    for reader in readers:
        reader.close()
    wait_until(lambda: streams.open_streams == before, timeout_s=10, what="the streams ending")


# `apiary serve` (api.server.serve) with the fake cluster: the stop signal is not under test elsewhere.
SERVE = """
import sys
from api.app import create_app
from api.server import serve
from service.runtime import Runtime
from service.settings import Settings
from tests.support.fakes import FakeBackend
port, database_url, data_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
settings = Settings(port=port, database_url=database_url, data_dir=data_dir, local_user="ada")
serve(create_app(runtime=Runtime(settings, backend=FakeBackend())), settings)
"""


def test_a_stop_signal_ends_the_open_streams(database_url: str, tmp_path: Path) -> None:
    """A browser on the web view holds a stream open: SIGTERM still stops the service."""
    port = free_port()
    args = [sys.executable, "-c", SERVE, str(port), database_url, str(tmp_path / "data")]
    process = subprocess.Popen(args, env={**os.environ, "PYTHONPATH": os.getcwd()}, stderr=subprocess.PIPE)
    reader = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{url}/healthz"), timeout_s=60, what="apiary serve answering")
        reader = SseReader(url, "/queues/stream")
        first = reader.next()
        assert first is not None and first.event == "queues"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) in (0, -signal.SIGTERM)
        assert reader.next() is None  # the stream ended cleanly
        assert process.stderr is not None and b"Application shutdown complete" in process.stderr.read()
    finally:
        if reader is not None:
            reader.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_the_queues_stream_sends_a_snapshot_then_each_change(service: Service, spec: dict[str, Any]) -> None:
    reader = stream(service, "/queues/stream")
    try:
        first = reader.next()
        assert first is not None and first.event == "queues"
        assert {queue["name"] for queue in first.data["data"]} == {"research", "full-scale"}
        job = service.submit(spec)
        changed = reader.next(timeout_s=10)
        assert changed is not None and int(changed.id) > int(first.id)
        research = next(q for q in changed.data["data"] if q["name"] == "research")
        assert [j["id"] for j in research["jobs"]] == [job["id"]]
        with pytest.raises(queue.Empty):
            reader.next(timeout_s=2.5)  # nothing changed: nothing sent
    finally:
        reader.close()

    resumed = stream(service, "/queues/stream", **{"Last-Event-ID": changed.id})
    try:
        with pytest.raises(queue.Empty):
            resumed.next(timeout_s=2.5)  # it saw this snapshot already
        service.http.post(f"/jobs/{job['id']}/cancel")
        after = resumed.next()
        assert after is not None and after.event == "queues" and int(after.id) == int(changed.id) + 1
    finally:
        resumed.close()


def test_metrics_are_downsampled_in_the_query(service: Service, spec: dict[str, Any]) -> None:
    job = service.submit(spec)
    service.tick()  # admitted: its attempt reports
    post_points(service, job["id"], range(1000))
    url = f"/jobs/{job['id']}/metrics"

    every = service.http.get(url, params={"every": 100}).json()["data"]
    assert [(p["step"], p["rank"]) for p in every] == [(s, r) for s in range(0, 1000, 100) for r in (0, 1)]

    points = service.http.get(url, params={"points": 10, "rank": 1}).json()["data"]
    assert [p["step"] for p in points] == [*range(0, 1000, 100), 999]  # the stride, and the last step

    few = service.http.get(url, params={"points": 10, "min_step": 500, "max_step": 519, "rank": 0})
    assert [p["step"] for p in few.json()["data"]] == [500, 502, 504, 506, 508, 510, 512, 514, 516, 518, 519]
    assert len(service.http.get(url, params={"points": 5000}).json()["data"]) == 2000  # fewer steps: all

    bad = service.http.get(url, params={"every": 0})
    assert bad.status_code == 422 and "every" in bad.json()["message"]
