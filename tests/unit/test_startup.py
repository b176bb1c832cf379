"""Start-up marks (trainers.startup) and how benchmarks/overhead.py reads them from a job's log."""

from __future__ import annotations

import time

import pytest

from trainers import startup


def test_a_mark_keeps_its_first_time_and_emit_prints_one_parsable_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(startup, "_marks", {})
    before = time.time()
    assert startup.mark("ready") is True
    first = startup.marks()["ready"]
    assert startup.mark("ready") is False  # a rollback builds the model again: the first start counts
    assert startup.marks()["ready"] == first
    startup.emit("rank 0")
    line = capsys.readouterr().out
    # Ray prefixes a forwarded line with the process that printed it.
    records = startup.parse(f"(RayTrainWorker pid=7) {line}garbage\napiary-startup {{cut")
    assert len(records) == 1
    record = records[0]
    assert record["role"] == "rank 0"
    marks = record["marks"]
    assert isinstance(marks, dict)
    assert before <= marks["ready"] <= time.time()
    # The kernel's start time of this process: before anything it ran, and not long before.
    assert marks["process_started"] <= before
    assert before - marks["process_started"] < 3600


def test_the_overhead_benchmark_splits_the_time_to_step_1_from_the_marks() -> None:
    from benchmarks.overhead import SPLITS, split, startup_offsets

    log = "\n".join(
        [
            'apiary-startup {"role":"driver","pid":1,"marks":{"process_started":101.0,"imports_done":102.5}}',
            '(TrainController pid=2) apiary-startup {"role":"controller","pid":2,'
            '"marks":{"process_started":103.0}}',
            '(RayTrainWorker pid=3) apiary-startup {"role":"rank 0","pid":3,"marks":{"step_1_done":110.0}}',
            '(RayTrainWorker pid=4) apiary-startup {"role":"rank 1","pid":4,"marks":{"step_1_done":111.0}}',
        ]
    )
    phases = {"ray: job submitted": 0.5, **startup_offsets(log, since=100.0)}
    assert phases["driver: imports_done"] == 2.5
    assert phases["rank 0: step_1_done"] == 10.0
    assert "rank 1: step_1_done" not in phases  # rank 0 is the one timed, as in the step metrics
    rows = dict(split(phases))
    assert [what for what, _ in split(phases)] == [what for what, _, _ in SPLITS]
    assert rows["submission to Ray (queue, admission, runtime_env upload)"] == 0.5
    assert rows["driver imports (ray.train, ray.data, trainers)"] == pytest.approx(1.5)
    assert rows["driver connects to Ray"] is None  # a mark the log does not hold
