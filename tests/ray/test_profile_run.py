"""Profiles on request on a real local Ray cluster: `profile: {start_step, steps}` in a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.contract.profiles import profile_folder, trace_name
from service.profiles import list_profiles
from tests.support.datasets import write_classes
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.launch import run

pytestmark = [pytest.mark.timeout(300)]


def test_every_rank_saves_a_trace_of_the_window_and_rank_0_posts_its_split(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer
) -> None:
    data = write_classes(tmp_path / "cls", rows=256, num_features=8, num_classes=3)
    spec = make_spec(
        trainer="mlp",
        dataset=data,
        config={"num_classes": 3},
        max_steps=6,
        batch_size=8,
        profile={"start_step": 3, "steps": 2},
    )
    storage = tmp_path / "storage"
    result = run(make_request(spec, storage=storage, run_name="job-1", telemetry_url=telemetry_server.url))
    assert result.step == 6

    folder = storage / "job-1/profile/plugins/profile/steps-3-4"
    assert folder.as_uri() == profile_folder(
        storage_uri=str(storage), run_name="job-1", start_step=3, end_step=4
    )
    for rank in (0, 1):
        trace = json.loads((folder / trace_name(rank)).read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        # The two steps of the window, marked, and DDP's gradient all-reduce over gloo in them.
        assert {"ProfilerStep#3", "ProfilerStep#4"} <= names and "ProfilerStep#5" not in names
        assert "gloo:all_reduce" in names

    (event,) = [event for event in telemetry_server.events() if event["kind"] == "profile"]
    assert (event["rank"], event["step"]) == (0, 4)
    figures = event["data"]
    assert (figures["start_step"], figures["end_step"], figures["ranks"], figures["traces"]) == (3, 4, 2, 2)
    assert figures["folder"] == folder.as_uri()
    assert figures["window_s"] > 0 and figures["compute_s"] > 0 and figures["communication_s"] > 0
    assert 0 < figures["communication_percent"] <= figures["communication_percent_max"] <= 100
    assert event["message"].startswith("profiled steps 3-4 on 2 ranks: compute ")

    # What the service lists: the folder, both traces, and every rank's split from summary.json.
    (profile,) = list_profiles(str(storage), 1)
    assert (profile.run, profile.start_step, profile.end_step) == ("steps-3-4", 3, 4)
    assert [trace.rank for trace in profile.traces] == [0, 1]
    assert profile.summary is not None
    assert [rank["rank"] for rank in profile.summary["per_rank"]] == [0, 1]
    assert all(rank["communication_s"] > 0 for rank in profile.summary["per_rank"])
