"""The trace simulator (`service.scheduling.simulate`) and `apiary simulate`: exact waits on hand-made traces,
preemption accounting, the generator's shape, and the command's input and output."""

from __future__ import annotations

import io
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.cli import app
from service.contract.queues import QueuesConfig
from service.scheduling.policy import Decisions, decide
from service.scheduling.simulate import (
    POLICIES,
    SimCosts,
    TraceError,
    TraceJob,
    TraceShape,
    generate,
    read_trace,
    simulate,
    trace_csv,
)

NODE = {"CPU": 32.0, "GPU": 8.0}


def job(job_id: int, submit_s: float, gpus: int, duration_s: float, **fields: object) -> TraceJob:
    values: dict[str, object] = {
        "job_id": job_id,
        "submit_s": submit_s,
        "queue": "full-scale",
        "owner": "ada",
        "priority": 0,
        "num_workers": max(1, gpus // 8),
        "cpu_per_worker": 4.0 * min(gpus, 8),
        "gpu_per_worker": float(min(gpus, 8)),
        "duration_s": duration_s,
        "checkpoint_every_s": 600.0,
        **fields,
    }
    return TraceJob(**values)  # type: ignore[arg-type]


def test_waits_are_exact_on_a_hand_made_trace() -> None:
    # One node of 8 GPUs: job 1 holds it for an hour; job 2 (8 GPUs) waits for it, job 3 (8) for both.
    trace = [job(1, 0, 8, 3600), job(2, 10, 8, 600), job(3, 20, 8, 60)]
    result = simulate(trace, nodes=1, node=NODE, policy="fifo")
    assert result.unfinished == 0 and result.queues["full-scale"].wait.max == 4180.0  # 3600 + 600 - 20
    assert result.queues["full-scale"].wait.mean == pytest.approx((0 + 3590 + 4180) / 3, abs=0.1)
    assert result.utilization == pytest.approx(1.0)  # never idle from first arrival to last end


def test_greedy_lets_a_small_job_pass_and_fifo_does_not() -> None:
    trace = [job(1, 0, 4, 3600), job(2, 1, 8, 600), job(3, 2, 4, 60)]
    fifo = simulate(trace, nodes=1, node=NODE, policy="fifo")
    greedy = simulate(trace, nodes=1, node=NODE, policy="greedy")
    assert fifo.size_classes["2-8"].max == 3600 + 600 - 2  # job 3 waited behind job 2
    assert greedy.size_classes["2-8"].max == 3599.0  # job 2; job 3 started at once beside job 1


def test_a_preempted_job_pays_the_checkpoint_at_its_next_step_and_its_restart() -> None:
    # Full-scale borrows the research share with a 4-GPU job; a research job then takes its share back.
    queues = QueuesConfig.model_validate(
        {"research": {"share": 0.5, "min_runtime_s": 0}, "full-scale": {"share": 0.5, "min_runtime_s": 0}}
    )
    trace = [
        job(1, 0, 4, 3600),  # full-scale, within its share of 4
        job(2, 0, 4, 3600),  # full-scale, borrowing research's 4
        job(3, 1000, 4, 100, queue="research"),
    ]
    costs = SimCosts(checkpoint_s=60, restart_s=120)
    result = simulate(trace, nodes=1, node=NODE, policy="two-queue", queues=queues, costs=costs, check=True)
    assert result.preemptions == 1
    # Job 2 checkpoints at its next step (60 s, keeping its 1000 s of work), job 3 starts at 1060 and
    # ends at 1160; job 2 restarts (120 s) and runs its last 2600 s: 180 s of 4 GPUs lost.
    assert result.lost_work_s == pytest.approx(180) and result.lost_gpu_s == pytest.approx(180 * 4)
    assert result.queues["research"].wait.max == 60.0
    assert result.queues["full-scale"].queued.max == pytest.approx(100.0)  # 1060 -> 1160
    assert result.makespan_s == pytest.approx(1160 + 120 + 2600)
    assert result.busy_gpu_s == pytest.approx(4 * (3600 + 3600 + 100) + 4 * 180)


def test_a_victim_told_to_stop_at_its_checkpoint_loses_only_its_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def at_checkpoint(**kwargs: Any) -> Decisions:
        decisions = decide(**kwargs)
        return replace(decisions, preempt=tuple(replace(p, at_checkpoint=True) for p in decisions.preempt))

    monkeypatch.setitem(POLICIES, "deferred", at_checkpoint)
    queues = QueuesConfig.model_validate(
        {"research": {"share": 0.5, "min_runtime_s": 0}, "full-scale": {"share": 0.5, "min_runtime_s": 0}}
    )
    trace = [job(1, 0, 4, 3600), job(2, 0, 4, 3600), job(3, 1000, 4, 100, queue="research")]
    costs = SimCosts(checkpoint_s=60, restart_s=120)
    result = simulate(trace, nodes=1, node=NODE, policy="deferred", queues=queues, costs=costs, check=True)
    # Job 2 runs on to its periodic checkpoint at 1200 s of work, then stops: job 3 runs 1200-1300.
    assert result.preemptions == 1 and result.lost_work_s == pytest.approx(120)
    assert result.queues["research"].wait.max == 200.0
    assert result.makespan_s == pytest.approx(1300 + 120 + 2400)


@pytest.mark.parametrize("policy", ["two-queue", "fifo", "greedy", "share-first"])
def test_invariants_hold_on_a_generated_trace(policy: str) -> None:
    """No node over capacity and every gang whole at every event; busy = useful + lost at the end."""
    jobs = generate(300, seed=5, shape=TraceShape(nodes=4))
    result = simulate(jobs, nodes=4, node=NODE, policy=policy, check=True)
    assert result.unfinished == 0 and 0.5 < result.utilization <= 1.0 + 1e-9


def test_a_job_larger_than_the_cluster_never_runs_and_is_counted() -> None:
    result = simulate([job(1, 0, 8, 60), job(2, 0, 16, 60)], nodes=1, node=NODE, policy="two-queue")
    assert (result.jobs, result.unfinished) == (2, 1)


def test_generated_traces_are_shaped_like_published_ones_and_repeatable() -> None:
    jobs = generate(2000, seed=7)
    assert jobs == generate(2000, seed=7) and jobs != generate(2000, seed=8)
    research = [j for j in jobs if j.queue == "research"]
    assert 0.8 < len(research) / len(jobs) < 0.9  # most jobs are research
    gpu_hours = {
        queue: sum(j.num_workers * j.gpu_per_worker * j.duration_s for j in jobs if j.queue == queue)
        for queue in ("research", "full-scale")
    }
    assert gpu_hours["full-scale"] > 2 * gpu_hours["research"]  # a few large jobs hold most GPU-hours
    durations = sorted(j.duration_s for j in jobs)
    assert durations[-1] > 10 * statistics.median(durations)  # a heavy tail
    assert all(j.max_runtime_s is not None and j.max_runtime_s >= j.duration_s for j in jobs)
    # The submission span makes the offered load 0.9 of 8 x 8 GPUs.
    span = jobs[-1].submit_s - jobs[0].submit_s
    work = sum(j.num_workers * j.gpu_per_worker * j.duration_s for j in jobs)
    assert work / (64 * span) == pytest.approx(0.9, rel=0.05)
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)


def test_traces_round_trip_through_csv_and_bad_rows_are_named() -> None:
    jobs = generate(50, seed=1)
    assert read_trace(io.StringIO(trace_csv(jobs))) == jobs
    with pytest.raises(TraceError, match="lacks the column"):
        read_trace(io.StringIO("job_id,submit_s\n1,0\n"))
    bad = trace_csv(jobs[:2]).replace(",research,", ",urgent,", 1).replace(",full-scale,", ",urgent,", 1)
    with pytest.raises(TraceError, match="trace row 2, column queue: must be research or full-scale"):
        read_trace(io.StringIO(bad))


def test_the_command_generates_replays_and_refuses_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    generated = runner.invoke(app, ["simulate", "--generate", "200", "--seed", "3"])
    assert generated.exit_code == 0
    trace = tmp_path / "trace.csv"
    trace.write_text(generated.output)
    result = runner.invoke(app, ["simulate", str(trace), "--nodes", "8", "--policy", "greedy", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["policy"] == "greedy" and body["jobs"] == 200 and body["unfinished"] >= 0
    assert set(body["queues"]) == {"research", "full-scale"}
    assert set(body["queues"]["research"]["wait_s"]) == {"p50", "p95", "p99", "mean", "max"}
    assert 0 < body["utilization"] <= 1 and not math.isnan(body["lost_work_s"])
    table = runner.invoke(app, ["simulate", str(trace), "--nodes", "8"])
    assert table.exit_code == 0 and "utilization" in table.output and "research" in table.output
    for args, message in [
        ([str(trace), "--policy", "lifo"], "--policy must be one of two-queue, fifo, greedy"),
        ([str(trace), "--node", "GPU"], "--node 'GPU' must look like CPU=32,GPU=8"),
        ([str(tmp_path / "missing.csv")], "No such file"),
        ([], "give a TRACE.csv to replay"),
    ]:
        refused = runner.invoke(app, ["simulate", *args])
        assert refused.exit_code == 2 and message in refused.output, refused.output
        assert "Traceback" not in refused.output
