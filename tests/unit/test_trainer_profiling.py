"""The compute/communication split of a profile (trainers.profiling), and its event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.contract.profiles import profile_folder, trace_name
from service.contract.spec import ProfileSpec
from tests.support.jobs import make_request, make_spec
from tests.support.profiling import profile_small_model
from trainers.profiling import Split, profile_event, summarize_trace


def op(name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_a_cpu_ranks_split_counts_each_span_once_within_its_steps() -> None:
    trace = {
        "traceEvents": [
            op("ProfilerStep#3", 0, 1000, cat="user_annotation"),
            op("ProfilerStep#4", 1000, 1000, cat="user_annotation"),
            op("aten::addmm", 100, 300),
            op("aten::mm", 200, 100),  # nested in addmm: counted once
            op("autograd::engine::evaluate_function: AddmmBackward0", 1100, 400),
            op("c10d::allreduce_", 1450, 20),  # inside the backward op: overlaps compute
            op("gloo:all_reduce", 1450, 350, cat="user_annotation", tid=2),  # gloo's own thread
            op("c10d::allgather_", 1900, 50),
            op("aten::add_", 2500, 100),  # after the last step: outside the window
            {"ph": "i", "name": "instant", "ts": 10},  # not a span
            {"ph": "M", "name": "process_name", "args": {}},
        ]
    }
    split = summarize_trace(trace)
    assert split.window_s == pytest.approx(2000e-6)
    assert split.compute_s == pytest.approx(700e-6)  # 100-400 and 1100-1500
    assert split.communication_s == pytest.approx(400e-6)  # 1450-1800 and 1900-1950
    assert split.overlap_s == pytest.approx(50e-6)  # 1450-1500
    assert split.idle_s == pytest.approx(950e-6)
    assert split.percent(split.communication_s) == pytest.approx(20.0)


def test_a_gpu_ranks_compute_is_its_kernels_and_its_communication_nccl_kernels() -> None:
    trace = {
        "traceEvents": [
            op("ProfilerStep#1", 0, 1000, cat="user_annotation"),
            op("aten::mm", 0, 900),  # the CPU launches: not the rank's compute on a GPU
            op("ampere_sgemm_128x64_tn", 100, 500, cat="kernel"),
            op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 400, 400, cat="kernel"),
            op("nccl:all_reduce", 350, 20, cat="user_annotation"),  # the host's launch
            op("Memcpy HtoD (Pageable -> Device)", 50, 50, cat="gpu_memcpy"),
        ]
    }
    split = summarize_trace(trace)
    assert split.compute_s == pytest.approx(550e-6)  # 50-100 and 100-600
    assert split.communication_s == pytest.approx(400e-6)  # 400-800
    assert split.overlap_s == pytest.approx(200e-6)  # 400-600


def test_a_trace_without_step_marks_is_taken_whole_and_an_empty_one_is_zero() -> None:
    split = summarize_trace({"traceEvents": [op("aten::mm", 10, 90), op("gloo:broadcast", 50, 100)]})
    assert (split.window_s, split.compute_s, split.communication_s) == pytest.approx((140e-6, 90e-6, 100e-6))
    assert summarize_trace({"traceEvents": []}) == Split(0.0, 0.0, 0.0, 0.0)


def test_the_event_says_the_split_on_average_and_which_rank_communicates_the_most() -> None:
    splits = [Split(1.0, 0.8, 0.2, 0.1), Split(1.0, 0.5, 0.4, 0.1), None]
    message, data = profile_event(splits, start_step=11, end_step=15, folder="file:///s/job-3/profile/x")
    assert data["start_step"] == 11 and data["end_step"] == 15
    assert (data["ranks"], data["traces"]) == (3, 2)
    assert data["compute_percent"] == pytest.approx(65.0)
    assert data["communication_percent"] == pytest.approx(30.0)
    assert (data["communication_max_rank"], data["communication_percent_max"]) == (1, pytest.approx(40.0))
    assert data["idle_s"] == pytest.approx(0.15)
    assert message.startswith("profiled steps 11-15 on 3 ranks: compute 65%, communication 30% of 1.000 s")
    assert "rank 1 communicates the most, 40%" in message and "1 ranks wrote no trace" in message
    assert message.endswith("per rank, compute/communication: 0: 80/20%, 1: 50/40%")
    assert len(data) <= 32  # a TrainerEvent's bound
    nothing, _ = profile_event([None], start_step=1, end_step=1, folder="f")
    assert "no rank could write its trace" in nothing


def test_a_real_profile_of_a_few_steps_splits_and_saves_as_a_chrome_trace(tmp_path: Path) -> None:
    """One process, no process group: the profiler, the step marks and the trace file are torch's own."""
    spec = make_spec(trainer="mlp", dataset="file:///d", config={"task": "regression"}, max_steps=10)
    request = make_request(spec, storage=tmp_path, run_name="job-3")
    events = profile_small_model(request, ProfileSpec(start_step=2, steps=2), steps=5)
    folder = profile_folder(storage_uri=str(tmp_path), run_name="job-3", start_step=2, end_step=3)
    assert folder == (tmp_path / "job-3/profile/plugins/profile/steps-2-3").as_uri()
    trace = json.loads((tmp_path / "job-3/profile/plugins/profile/steps-2-3" / trace_name(0)).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    summary = json.loads((tmp_path / "job-3/profile/plugins/profile/steps-2-3/summary.json").read_text())
    assert summary["per_rank"][0]["trace"] == "rank-0.pt.trace.json"
    ((kind, data),) = events
    assert kind == "profile" and data["step"] == 3 and data["folder"] == folder
    assert data["compute_s"] > 0 and data["communication_s"] == 0
