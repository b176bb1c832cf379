"""`benchmarks/export_cost.py` (TensorBoard and MLflow export on against off) without running it: its
sides set what the service reads, and its figures come from the job's stored points as it says."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from export_cost import side_env, steady_figures, summarize, verdict

from service.settings import Settings


@pytest.mark.parametrize(
    ("side", "tensorboard", "mlflow"), [("on", True, "http://127.0.0.1:5999"), ("off", False, None)]
)
def test_each_side_turns_the_services_export_on_or_off(
    monkeypatch: pytest.MonkeyPatch, side: str, tensorboard: bool, mlflow: str | None
) -> None:
    for name, value in side_env(side, mlflow_url="http://127.0.0.1:5999").items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.tensorboard is tensorboard
    assert (settings.mlflow_tracking_uri or None) == mlflow
    with pytest.raises(ValueError, match="side must be one of"):
        side_env("maybe", mlflow_url="")


def points(step_times: dict[int, float], *, slow_rank: float = 0.0) -> list[dict[str, Any]]:
    """Both ranks' points: rank 0 ends step s at s seconds; rank 1 records `slow_rank` more each step."""
    found = []
    for step, step_time in step_times.items():
        found.append({"step": step, "rank": 0, "time": float(step), "values": {"step_time_s": step_time}})
        found.append(
            {"step": step, "rank": 1, "time": step + 0.1, "values": {"step_time_s": step_time + slow_rank}}
        )
    # A point that carries only system figures is no step.
    found.append({"step": 6, "rank": 0, "time": 99.0, "values": {"sys_cpu_percent": 50.0}})
    return found


def test_the_steady_state_leaves_out_the_warmup_steps_and_reads_every_ranks_step_time() -> None:
    stored = points({1: 9.0, 2: 9.0, 3: 0.1, 4: 0.3, 5: 0.2, 6: 0.4}, slow_rank=0.01)
    figures = steady_figures(stored, warmup=2)
    # Steps 3-6 of both ranks: 0.1, 0.11, 0.2, 0.21, 0.3, 0.31, 0.4, 0.41.
    assert figures["step_time_s"] == pytest.approx(0.255)
    assert figures["wall_per_step_s"] == pytest.approx(1.0)  # rank 0's step 2 at 2 s, step 6 at 6 s
    assert (figures["start"], figures["end"], figures["steps"]) == (2.0, 6.0, 6.0)
    with pytest.raises(ValueError, match="no steady state after step 6"):
        steady_figures(stored, warmup=6)


def job(side: str, step_time_s: float) -> dict[str, Any]:
    return {
        "side": side,
        "step_time_s": step_time_s,
        "wall_per_step_s": 2 * step_time_s,
        "serve_cpu_percent": 10.0 if side == "off" else 15.0,
        "mlflow_cpu_percent": 1.0,
    }


def test_the_ratio_is_of_the_medians_each_round_pairs_its_two_jobs_and_the_verdict_weighs_the_noise() -> None:
    jobs = [job("off", 0.100), job("on", 0.101), job("on", 0.103), job("off", 0.104), job("off", 0.102)]
    summary = summarize(jobs)
    assert summary["step_ratio"] == pytest.approx(0.102 / 0.102)  # medians: off 0.102, on 0.102
    assert summary["round_ratios"] == pytest.approx([0.101 / 0.100, 0.103 / 0.104])
    assert summary["paired_ratio"] == pytest.approx((0.101 / 0.100 + 0.103 / 0.104) / 2)
    assert summary["spread"]["off"] == pytest.approx(1.04)
    assert summary["medians"]["on"]["serve_cpu_percent"] == 15.0
    assert "within the noise" in verdict(summary) and verdict(summary).endswith(": met")

    slower = summarize([job("off", 0.100), job("on", 0.110), job("off", 0.101), job("on", 0.111)])
    assert slower["step_ratio"] == pytest.approx(0.1105 / 0.1005)
    assert "outside the noise" in verdict(slower) and verdict(slower).endswith("NOT met")
    with pytest.raises(ValueError, match="both sides"):
        summarize([job("off", 0.1)])
