"""Telemetry from a rank to the control plane (`trainers.telemetry`), against a real HTTP server."""

from __future__ import annotations

import socket

import pytest

from service.contract.protocol import SUPERSEDED_ERROR
from tests.support.telemetry import TelemetryServer, trained
from tests.support.wait import wait_until
from trainers import telemetry
from trainers.telemetry import Telemetry


def test_failed_post_keeps_points_and_the_next_flush_delivers_them() -> None:
    server = TelemetryServer(fail_first=1)
    try:
        sender = Telemetry(url=server.url, attempt=2, rank=1)
        for step in (1, 2, 3):
            sender.record(step, {"loss": 1.0 / step})
        sender.checkpoint_saved(3, "file:///ckpt/run/checkpoint_00000003")

        assert sender.flush() is False  # the control plane answered 503
        assert sender.pending_points == 3
        assert server.batches == []

        assert sender.flush() is True
        assert sender.pending_points == 0
        assert server.attempts == 2
        (batch,) = server.batches
        assert batch["attempt"] == 2
        assert [(p["step"], p["rank"], p["values"]["loss"]) for p in batch["points"]] == [
            (1, 1, 1.0),
            (2, 1, 0.5),
            (3, 1, pytest.approx(1 / 3)),
        ]
        assert batch["checkpoint"] == {
            "step": 3,
            "uri": "file:///ckpt/run/checkpoint_00000003",
            "write_s": None,
        }
        sender.close()
        assert server.attempts == 2  # nothing left to send
    finally:
        server.close()


def test_unreachable_control_plane_never_raises() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sender = Telemetry(url=f"http://127.0.0.1:{port}/telemetry", attempt=1, rank=0, close_retry_s=0.5)
    sender.record(1, {"loss": 1.0})
    assert sender.flush() is False
    assert sender.pending_points == 1
    sender.close()


def test_close_keeps_retrying_until_the_control_plane_is_back() -> None:
    # Down for the first 5 posts (about 1 s of retries at the interval below): a job that ends while
    # the service restarts still delivers its last points, checkpoint and events.
    server = TelemetryServer(fail_first=5)
    try:
        sender = Telemetry(url=server.url, attempt=1, rank=0, flush_interval_s=0.2, close_retry_s=30)
        sender.segment = 1234
        sender.record(7, {"loss": 1.0})
        sender.checkpoint_saved(7, "file:///c/checkpoint_00000007")
        sender.event("group_started", step=0, message="started", world_size=2)
        sender.close()
        assert server.attempts == 6
        (batch,) = server.batches
        assert batch["segment"] == 1234
        assert [p["step"] for p in batch["points"]] == [7]
        assert batch["checkpoint"]["step"] == 7
        assert [(e["kind"], e["data"]) for e in batch["events"]] == [("group_started", {"world_size": 2})]
    finally:
        server.close()


def test_buffer_is_bounded_and_drops_the_oldest(caplog: pytest.LogCaptureFixture) -> None:
    sender = Telemetry(url=None, attempt=1, rank=0, max_buffered_points=5)
    for step in range(1, 9):
        sender.record(step, {"loss": 0.0})
    assert sender.pending_points == 5
    assert sender.dropped_points == 3
    assert [p.step for p in sender._points] == [4, 5, 6, 7, 8]
    assert "telemetry buffer full" in caplog.text
    assert sender.flush() is True  # no telemetry URL: points are only logged, then let go
    assert sender.pending_points == 0


def test_refused_batch_is_dropped_not_retried_forever() -> None:
    server = TelemetryServer(fail_first=1, fail_status=422)
    try:
        sender = Telemetry(url=server.url, attempt=1, rank=0)
        sender.record(1, {"loss": 1.0})
        assert sender.flush() is True
        assert sender.dropped_points == 1 and sender.pending_points == 0
        sender.record(2, {"loss": 1.0})
        sender.close()
        assert [p["step"] for p in server.points()] == [2]
    finally:
        server.close()


def test_large_buffers_go_out_in_schema_sized_posts(
    telemetry_server: TelemetryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry, "MAX_POINTS_PER_POST", 2)
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0)
    for step in range(5):
        sender.record(step, {"loss": 0.0})
    assert sender.flush() is True
    assert [len(b["points"]) for b in telemetry_server.batches] == [2, 2, 1]


def test_background_thread_posts_on_its_own_and_close_sends_the_rest(
    telemetry_server: TelemetryServer,
) -> None:
    with Telemetry(url=telemetry_server.url, attempt=1, rank=0, flush_interval_s=0.05) as sender:
        sender.record(1, {"loss": 1.0})
        wait_until(lambda: len(telemetry_server.points()) == 1, timeout_s=10, interval_s=0.02)
        sender.record(2, {"loss": 0.5})
    assert [p["step"] for p in telemetry_server.points()] == [1, 2]


def test_many_points_wake_the_thread_before_the_interval(telemetry_server: TelemetryServer) -> None:
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0, flush_interval_s=60, flush_points=10)
    sender.start()
    try:
        for step in range(10):
            sender.record(step, {"loss": 0.0})
        wait_until(lambda: len(telemetry_server.points()) == 10, timeout_s=10, interval_s=0.02)
    finally:
        sender.close()


def test_non_finite_values_are_left_out_not_the_whole_batch(
    telemetry_server: TelemetryServer, caplog: pytest.LogCaptureFixture
) -> None:
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0)
    sender.record(1, {"loss": float("nan"), "lr": 0.1})
    sender.record(2, {"loss": 2.0, "lr": 0.1})
    assert sender.flush() is True
    assert [trained(p) for p in telemetry_server.points()] == [{"lr": 0.1}, {"loss": 2.0, "lr": 0.1}]
    assert "loss is nan" in caplog.text
    sender.close()


def test_a_stop_in_the_reply_is_remembered_until_the_loop_reads_it(telemetry_server: TelemetryServer) -> None:
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0)
    sender.record(1, {"loss": 1.0})
    assert sender.flush() and not sender.stop_requested.is_set()
    telemetry_server.stop = True
    sender.record(2, {"loss": 1.0})
    assert sender.flush() and sender.stop_requested.is_set()
    sender.close()


def test_a_rank_with_nothing_to_send_still_says_what_it_is_doing(
    telemetry_server: TelemetryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry, "HEARTBEAT_S", 0.2)
    with Telemetry(url=telemetry_server.url, attempt=1, rank=1, flush_interval_s=0.05) as sender:
        sender.node = "10.0.0.2 (node1)"
        sender.progress("data", step=41)
        sender.progress("sync")
        wait_until(lambda: len(telemetry_server.batches) >= 2, timeout_s=10, interval_s=0.05)
    heartbeat = telemetry_server.batches[-1]
    assert heartbeat["points"] == [] and heartbeat["events"] == []
    assert {key: heartbeat["status"][key] for key in ("rank", "step", "phase", "node")} == {
        "rank": 1,
        "step": 41,
        "phase": "sync",
        "node": "10.0.0.2 (node1)",
    }
    assert heartbeat["status"]["step_at"] <= heartbeat["status"]["phase_since"]


def test_a_rank_of_a_superseded_attempt_exits_at_once(
    telemetry_server: TelemetryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(telemetry.os, "_exit", exits.append)
    telemetry_server.superseded = True
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0)
    sender.record(1, {"loss": 1.0})
    sender.flush()
    assert exits == [telemetry.EXIT_SUPERSEDED]


def test_posts_carry_the_attempts_report_token(telemetry_server: TelemetryServer) -> None:
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0, token="s3cret")
    sender.record(1, {"loss": 1.0})
    assert sender.flush()
    assert telemetry_server.authorizations == ["Bearer s3cret"]


def test_a_rank_told_its_attempt_was_given_up_by_a_403_exits_at_once(
    telemetry_server: TelemetryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(telemetry.os, "_exit", exits.append)
    telemetry_server.refusal = (403, {"message": "given up", "error": SUPERSEDED_ERROR})
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0, token="old")
    sender.record(1, {"loss": 1.0})
    sender.flush()
    assert exits == [telemetry.EXIT_SUPERSEDED]
    # Any other refusal (a wrong token) drops the batch and goes on training.
    exits.clear()
    telemetry_server.refusal = (401, {"message": "no token", "error": "ReportRefused"})
    sender.record(2, {"loss": 1.0})
    assert sender.flush() and exits == [] and sender.dropped_points == 2
