from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from trainers import report
from trainers.report import Reporter


def wait_for(condition: Any, *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_failed_post_keeps_points_and_the_next_flush_delivers_them(synthetic: Any) -> None:
    server = synthetic.ReportServer(fail_first=1)
    try:
        reporter = Reporter(report_url=server.url, attempt=2, rank=1, background=False)
        for step in (1, 2, 3):
            reporter.record(step, {"loss": 1.0 / step})
        reporter.report_checkpoint(3, "file:///ckpt/run/checkpoint_00000003")

        assert reporter.flush() is False  # the control plane answered 503
        assert reporter.pending_points == 3
        assert server.batches == []

        assert reporter.flush() is True
        assert reporter.pending_points == 0
        assert server.attempts == 2
        (batch,) = server.batches
        assert batch["attempt"] == 2
        assert [(p["step"], p["rank"], p["values"]["loss"]) for p in batch["points"]] == [
            (1, 1, 1.0),
            (2, 1, 0.5),
            (3, 1, pytest.approx(1 / 3)),
        ]
        assert batch["checkpoint"] == {"step": 3, "uri": "file:///ckpt/run/checkpoint_00000003"}
        reporter.close()
        assert server.attempts == 2  # nothing left to send
    finally:
        server.close()


def test_unreachable_control_plane_never_raises() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    reporter = Reporter(report_url=f"http://127.0.0.1:{port}/report", attempt=1, rank=0, background=False)
    reporter.record(1, {"loss": 1.0})
    assert reporter.flush() is False
    assert reporter.pending_points == 1
    reporter.close()


def test_buffer_is_bounded_and_drops_the_oldest(caplog: pytest.LogCaptureFixture) -> None:
    reporter = Reporter(report_url=None, attempt=1, rank=0, background=False, max_buffered_points=5)
    for step in range(1, 9):
        reporter.record(step, {"loss": 0.0})
    assert reporter.pending_points == 5
    assert reporter.dropped_points == 3
    assert [p.step for p in reporter._points] == [4, 5, 6, 7, 8]
    assert "report buffer full" in caplog.text
    assert reporter.flush() is True  # no report_url: points are only logged, then let go
    assert reporter.pending_points == 0


def test_refused_batch_is_dropped_not_retried_forever(synthetic: Any) -> None:
    server = synthetic.ReportServer(fail_first=1, fail_status=422)
    try:
        reporter = Reporter(report_url=server.url, attempt=1, rank=0, background=False)
        reporter.record(1, {"loss": 1.0})
        assert reporter.flush() is True
        assert reporter.dropped_points == 1 and reporter.pending_points == 0
        reporter.record(2, {"loss": 1.0})
        reporter.close()
        assert [p["step"] for p in server.points()] == [2]
    finally:
        server.close()


def test_large_buffers_go_out_in_schema_sized_posts(
    synthetic: Any, report_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "MAX_POINTS_PER_POST", 2)
    reporter = Reporter(report_url=report_server.url, attempt=1, rank=0, background=False)
    for step in range(5):
        reporter.record(step, {"loss": 0.0})
    assert reporter.flush() is True
    assert [len(b["points"]) for b in report_server.batches] == [2, 2, 1]


def test_background_thread_posts_on_its_own_and_close_sends_the_rest(report_server: Any) -> None:
    with Reporter(report_url=report_server.url, attempt=1, rank=0, flush_interval_s=0.05) as reporter:
        reporter.record(1, {"loss": 1.0})
        wait_for(lambda: len(report_server.points()) == 1)
        reporter.record(2, {"loss": 0.5})
    assert [p["step"] for p in report_server.points()] == [1, 2]


def test_many_points_wake_the_thread_before_the_interval(report_server: Any) -> None:
    reporter = Reporter(report_url=report_server.url, attempt=1, rank=0, flush_interval_s=60, flush_points=10)
    try:
        for step in range(10):
            reporter.record(step, {"loss": 0.0})
        wait_for(lambda: len(report_server.points()) == 10)
    finally:
        reporter.close()


def test_non_finite_values_are_left_out_not_the_whole_batch(
    report_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = Reporter(report_url=report_server.url, attempt=1, rank=0, background=False)
    reporter.record(1, {"loss": float("nan"), "lr": 0.1})
    reporter.record(2, {"loss": 2.0, "lr": 0.1})
    assert reporter.flush() is True
    assert [p["values"] for p in report_server.points()] == [{"lr": 0.1}, {"loss": 2.0, "lr": 0.1}]
    assert "loss is nan" in caplog.text
    reporter.close()
