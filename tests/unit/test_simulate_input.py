"""`apiary simulate` on bad input (issue 27, point 6): every bad value is refused with exit 2 and a
message naming its row and column; `--json` is strict JSON; the metrics' definitions."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from service.scheduling.simulate import TraceError, read_trace, simulate, trace_csv
from tests.unit.test_simulate import NODE, job

HEADER = (
    "job_id,submit_s,queue,owner,priority,num_workers,cpu_per_worker,gpu_per_worker,duration_s,"
    "checkpoint_every_s,max_runtime_s"
)
GOOD = "1,0,research,ada,0,1,4,1,600,300,"


def with_field(column: str, value: str) -> str:
    """GOOD with one column replaced."""
    cells = dict(zip(HEADER.split(","), GOOD.split(","), strict=True))
    cells[column] = value
    return ",".join(cells.values())


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("duration_s", "nan"),
        ("duration_s", "NaN"),
        ("duration_s", "inf"),
        ("duration_s", "-5"),
        ("duration_s", "0"),
        ("duration_s", "1e30"),  # absurd: longer than a year
        ("submit_s", "-1"),
        ("submit_s", "inf"),
        ("gpu_per_worker", "-1"),
        ("gpu_per_worker", "nan"),
        ("cpu_per_worker", "-4"),
        ("cpu_per_worker", "1e12"),
        ("num_workers", "0"),
        ("num_workers", "-2"),
        ("num_workers", "10000000"),
        ("num_workers", "1.5"),
        ("checkpoint_every_s", "nan"),
        ("checkpoint_every_s", "-600"),
        ("max_runtime_s", "inf"),
        ("max_runtime_s", "-1"),
        ("priority", "1000"),
        ("priority", "x"),
        ("job_id", "-3"),
        ("job_id", "abc"),
        ("queue", "urgent"),
    ],
)
def test_a_bad_value_is_refused_naming_its_row_and_column(column: str, value: str) -> None:
    text = f"{HEADER}\n{GOOD}\n{with_field(column, value).replace('1,', '2,', 1)}\n"
    with pytest.raises(TraceError, match=rf"row 3, column {column}:"):
        read_trace(io.StringIO(text))


def test_a_job_of_no_resources_is_refused() -> None:
    text = f"{HEADER}\n{with_field('cpu_per_worker', '0').replace(',1,600', ',0,600')}\n"
    with pytest.raises(TraceError, match=r"row 2, column gpu_per_worker:.*asks for nothing"):
        read_trace(io.StringIO(text))


def test_duplicate_ids_short_and_long_rows_are_refused() -> None:
    with pytest.raises(TraceError, match=r"row 3, column job_id: job 1 appears again \(first on row 2\)"):
        read_trace(io.StringIO(f"{HEADER}\n{GOOD}\n{GOOD}\n"))
    with pytest.raises(TraceError, match=r"row 2, column duration_s: missing \(the row has 8 fields"):
        read_trace(io.StringIO(f"{HEADER}\n1,0,research,ada,0,1,4,1\n"))
    with pytest.raises(TraceError, match=r"row 2: 12 fields, more than the header's 11"):
        read_trace(io.StringIO(f"{HEADER}\n{GOOD},7\n"))


def test_a_byte_order_mark_is_read_through() -> None:
    plain = read_trace(io.StringIO(f"{HEADER}\n{GOOD}\n"))
    assert read_trace(io.StringIO(f"\ufeff{HEADER}\n{GOOD}\n")) == plain and plain[0].job_id == 1


def test_a_gang_that_fits_no_node_is_refused_naming_its_row() -> None:
    text = f"{HEADER}\n{GOOD}\n3,5,full-scale,bob,0,2,32,16,600,300,\n"
    with pytest.raises(TraceError, match=r"row 3, columns num_workers, gpu_per_worker.*fits no node"):
        read_trace(io.StringIO(text), nodes=8, node=NODE)
    assert len(read_trace(io.StringIO(text), nodes=2, node={"CPU": 32.0, "GPU": 16.0})) == 2


def test_simulate_refuses_values_read_trace_would_refuse() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        simulate([job(1, 0, 8, math.nan)], nodes=1, node=NODE, policy="fifo")


def test_an_empty_queue_is_shown_with_no_jobs() -> None:
    result = simulate([job(1, 0, 8, 600)], nodes=1, node=NODE, policy="two-queue").to_json()
    assert result["queues"]["research"]["jobs"] == 0
    assert result["queues"]["research"]["queued_s"]["p95"] == 0.0
    assert result["queues"]["research"]["preemptions_per_job"] == 0.0
    json.dumps(result, allow_nan=False)


def test_utilization_counts_busy_time_from_first_arrival_to_last_submission() -> None:
    # 8 GPUs. Job 1 (8 GPUs) runs 0-1000; job 2 (4 GPUs) is submitted at 2000 and runs 2000-12000.
    # In [0, 2000]: busy 8 x 1000 of 8 x 2000 = 0.5; the drain tail after 2000 is left out.
    result = simulate([job(1, 0, 8, 1000), job(2, 2000, 4, 10_000)], nodes=1, node=NODE, policy="fifo")
    assert result.utilization == pytest.approx(0.5)


def test_queued_time_counts_every_wait_including_after_a_preemption() -> None:
    from service.contract.queues import QueuesConfig

    queues = QueuesConfig.model_validate(
        {"research": {"share": 0.5, "min_runtime_s": 0}, "full-scale": {"share": 0.5, "min_runtime_s": 0}}
    )
    # Job 2 borrows research's half; research job 3 takes it back at 1000 and runs 100 s; job 2 then
    # waits until job 3 ends at 1100 (plus what the stop and restart cost).
    trace = [job(1, 0, 4, 3600), job(2, 0, 4, 3600), job(3, 1000, 4, 100, queue="research")]
    result = simulate(trace, nodes=1, node=NODE, policy="two-queue", queues=queues).to_json()
    full = result["queues"]["full-scale"]
    assert full["jobs"] == 2 and full["preemptions_per_job"] == 0.5
    assert full["wait_s"]["max"] == 0.0  # both started at once: first-start wait hides the requeue
    assert full["queued_s"]["max"] >= 100.0 and full["queued_s"]["mean"] == pytest.approx(
        full["queued_s"]["max"] / 2
    )
    assert result["lost_gpu_s"] == pytest.approx(result["lost_work_s"] * 4)


def test_the_command_refuses_bad_traces_with_exit_2_and_prints_strict_json(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = tmp_path / "bad.csv"
    for body, message in [
        (f"{HEADER}\n{with_field('duration_s', 'nan')}\n", "row 2, column duration_s"),
        (f"{HEADER}\n{GOOD}\n{GOOD}\n", "row 3, column job_id"),
        (f"{HEADER}\n1,0,research,ada,0,1,4,1\n", "row 2, column duration_s: missing"),
        (f"{HEADER}\n1,0,full-scale,ada,0,1,4,64,600,300,\n", "row 2, columns num_workers, gpu_per_worker"),
    ]:
        bad.write_text(body)
        refused = runner.invoke(app, ["simulate", str(bad), "--nodes", "2"])
        assert refused.exit_code == 2 and message in refused.output, refused.output
        assert "Traceback" not in refused.output
    for node in ("CPU=nan,GPU=8", "CPU=inf", "CPU=-1", "CPU=0,GPU=0"):
        bad.write_text(f"{HEADER}\n{GOOD}\n")
        refused = runner.invoke(app, ["simulate", str(bad), "--node", node])
        assert refused.exit_code == 2 and "--node" in refused.output, (node, refused.output)
    good = tmp_path / "good.csv"
    good.write_bytes(("\ufeff" + trace_csv([job(1, 0, 8, 600)])).encode())
    printed = runner.invoke(app, ["simulate", str(good), "--nodes", "1", "--json"])
    assert printed.exit_code == 0, printed.output
    body = json.loads(printed.output, parse_constant=lambda name: pytest.fail(f"non-standard {name}"))
    assert body["queues"]["research"]["jobs"] == 0 and body["queues"]["full-scale"]["jobs"] == 1
