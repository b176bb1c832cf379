"""api.feeds' pieces that need no server (the feeds themselves: tests/integration/test_watchers.py)."""

from __future__ import annotations

from api.feeds import JobCursor, metrics_json
from api.schemas import MetricPublic, MetricsPublic


def test_a_metrics_message_built_from_its_points_json_is_what_pydantic_writes() -> None:
    points = [
        MetricPublic(step=step, rank=rank, attempt=1, segment=5, time=1.5, values={"loss": 0.25, "lr": 1e-3})
        for step in range(3)
        for rank in range(2)
    ]
    for chosen in (points, points[:1], []):
        expected = MetricsPublic(data=chosen, count=len(chosen)).model_dump_json()
        assert metrics_json([point.model_dump_json() for point in chosen]) == expected


def test_a_cursor_reads_back_what_it_writes() -> None:
    assert JobCursor.parse(str(JobCursor(12, 345))) == JobCursor(12, 345)
    assert JobCursor.parse("7") == JobCursor(7, 0)
