"""The simulator's money, carbon, deferral and spot accounting (issue 31, point 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from service.contract.signal import Signal, build_signal
from service.costs import Rates
from service.scheduling.simulate import SimPricing, SimSpot, TraceShape, generate, simulate, trace_csv
from tests.unit.test_simulate import NODE, job

HOUR = 3600.0


def hourly(values: list[float]) -> Signal:
    return build_signal([(i * HOUR, (i + 1) * HOUR, v) for i, v in enumerate(values)], source="test")


def test_a_deferrable_job_waits_for_the_cheap_hours_by_its_declared_runtime_and_meets_its_deadline() -> None:
    # Dear (100) but for 08:00-09:00 (10) and 10:00-12:00 (20). The job runs 30 min but declares 2 h:
    # deferral knows only the declaration, so it starts at 10:00 (2 h cost 40 against 110 from 08:00);
    # had it known the true 30 min, 08:00 would have been cheapest.
    signal = hourly([100.0] * 8 + [10.0, 100.0, 20.0, 20.0] + [100.0] * 12)
    trace = [job(1, 0, 8, 1800, queue="research", max_runtime_s=7200)]
    with_deferral = SimPricing(signal=signal, deferrable_share=1.0, within_h=24)
    deferred = simulate(trace, nodes=1, node=NODE, pricing=with_deferral, check=True)
    assert deferred.deferred == 1 and deferred.deadlines_missed == 0
    assert deferred.deferrable_wait is not None and deferred.deferrable_wait.max == 10 * HOUR
    assert deferred.cost == pytest.approx(8 * 20 * 0.5)  # 8 GPUs x 20 x half an hour
    without = SimPricing(signal=signal, deferrable_share=1.0, within_h=24, defer=False)
    plain = simulate(trace, nodes=1, node=NODE, pricing=without)
    assert plain.deferred == 0 and plain.cost == pytest.approx(8 * 100 * 0.5)


def test_deferral_misses_no_deadline_on_an_uncongested_cluster() -> None:
    trace = generate(120, seed=3, shape=TraceShape(nodes=8, offered_load=0.3))
    signal = hourly([50.0 + 40.0 * ((i % 24) in range(10, 18)) for i in range(24 * 10)])
    pricing = SimPricing(signal=signal, deferrable_share=1.0, within_h=12, seed=1)
    deferred = simulate(trace, nodes=8, node=NODE, pricing=pricing, check=True)
    plain = simulate(
        trace, nodes=8, node=NODE, pricing=SimPricing(signal=signal, deferrable_share=1.0, defer=False)
    )
    assert deferred.deferrable == plain.deferrable > 0 and deferred.deferred > 0
    assert deferred.deadlines_missed == 0 and deferred.unfinished == 0
    assert deferred.cost < plain.cost


@pytest.mark.parametrize("unit", ["price", "carbon"])
def test_the_cost_is_the_sum_over_the_priced_hours(unit: str) -> None:
    # A flat signal over the whole run: every held GPU-hour is priced at it.
    trace = generate(60, seed=2, shape=TraceShape(nodes=2, offered_load=0.8))
    pricing = SimPricing(signal=hourly([3.0] * 24 * 30), rates=Rates(unit=unit))  # type: ignore[arg-type]
    result = simulate(trace, nodes=2, node=NODE, pricing=pricing, check=True)
    gpu_hours = result.busy_gpu_s / HOUR
    assert result.priced_hours == pytest.approx(gpu_hours)
    assert result.cost == pytest.approx(gpu_hours * 3.0 * (0.7 / 1000 if unit == "carbon" else 1.0))
    # Hours the signal does not cover are held but not priced.
    short = simulate(trace, nodes=2, node=NODE, pricing=SimPricing(signal=hourly([3.0])))
    assert short.priced_hours < gpu_hours and short.cost == pytest.approx(short.priced_hours * 3.0)


def test_spot_interruptions_lose_progress_without_notice_and_none_with_it() -> None:
    trace = [job(1, 0, 8, 4 * HOUR), job(2, 0, 8, 3 * HOUR, queue="research")]
    lost = {}
    for notice_s in (0.0, 30.0, 120.0):
        spot = SimSpot(share=1.0, rate_per_node_h=1.0, notice_s=notice_s, seed=4)
        # check: busy time = useful + lost, every node within capacity, at every event
        result = simulate(trace, nodes=2, node=NODE, spot=spot, check=True)
        assert result.spot_nodes == 2 and result.interruptions > 0 and result.unfinished == 0
        lost[notice_s] = result.interrupt_lost_gpu_hours
    # 30 s is shorter than a checkpoint (60 s): the job keeps only its last periodic checkpoint.
    assert lost[0.0] > 0 and lost[30.0] > 0 and lost[120.0] == 0


def test_the_command_prices_a_trace_and_refuses_a_bad_signal_with_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    trace = tmp_path / "trace.csv"
    trace.write_text(trace_csv([job(1, 0, 8, 1800, queue="research", max_runtime_s=3600)]))
    signal = tmp_path / "signal.csv"
    signal.write_text(
        "start,end,value\n" + "".join(f"{i * 3600},{(i + 1) * 3600},{9 if i < 2 else 1}\n" for i in range(6))
    )
    args = ["simulate", str(trace), "--nodes", "1", "--signal", str(signal), "--deferrable-share", "1"]
    printed = runner.invoke(app, [*args, "--json"])
    assert printed.exit_code == 0, printed.output
    body = json.loads(printed.output)
    assert body["cost"] == pytest.approx(4.0) and body["deferred"] == 1 and body["deadlines_missed"] == 0
    assert "1 waited for a cheaper window" in runner.invoke(app, args).output
    bad = tmp_path / "bad.csv"
    for text, message in [
        ("start,end,value\n0,3600,1\n3600,7200,free\n", "interval 2: value 'free' is not a number"),
        ("begin,end,value\n", "it must be start,end,value"),
        ("start,end,value\n0,7200,1\n3600,9000,2\n", "intervals overlap"),
    ]:
        bad.write_text(text)
        refused = runner.invoke(app, ["simulate", str(trace), "--signal", str(bad)])
        assert refused.exit_code == 2 and message in refused.output, refused.output
        assert "Traceback" not in refused.output
    for option, value in [("--spot-rate", "-1"), ("--spot-share", "2"), ("--deferrable-share", "1.5")]:
        refused = runner.invoke(app, ["simulate", str(trace), "--signal", str(signal), option, value])
        assert refused.exit_code == 2 and option in refused.output, refused.output
    refused = runner.invoke(app, ["simulate", str(trace), "--deferrable-share", "0.5"])
    assert refused.exit_code == 2 and "go with --signal" in refused.output
