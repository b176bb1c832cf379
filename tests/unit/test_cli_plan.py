"""`apiary plan` through typer's runner: the table, --json, a spec file, and bad flags (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app

SEVEN_B = [
    "--params", "7e9", "--workers", "8", "--batch-per-worker", "4", "--step-time-s", "1",
    "--link-gbps", "400", "--storage-gbytes-per-s", "2", "--ckpt-every-steps", "1000",
    "--mtbf-h", "24", "--restart-s", "120", "--price-per-gpu-h", "3", "--spot-discount", "0.6",
    "--spot-preemptions-per-h", "0.5", "--hours", "10",
]  # fmt: skip


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_json_is_one_flat_object_of_every_quantity() -> None:
    code, output = run(*SEVEN_B, "--json")
    assert code == 0, output
    flat = json.loads(output)
    # 400 Gbit/s = 5e10 B/s: the worked example of tests/unit/test_planner.py
    assert flat["comm_time_s"] == pytest.approx(0.98)
    assert flat["ckpt_write_s"] == pytest.approx(42.0)
    assert flat["daly_interval_s"] == pytest.approx(2666.066, rel=1e-6)
    assert flat["spot_usd"] == pytest.approx(105.04559, rel=1e-5)
    assert all(not isinstance(value, dict | list) for value in flat.values())


def test_the_table_shows_formula_value_and_meaning_and_what_is_missing() -> None:
    code, output = run("--params", "7e9", "--workers", "8", "--storage-gbytes-per-s", "2")
    assert code == 0, output
    assert "ckpt_write_s" in output and "ckpt_bytes / storage_bytes_per_s" in output and "42 s" in output
    assert "84 GB" in output  # 7e9 x 12 B
    assert "time to write one checkpoint" in output
    assert "needs --mtbf-h" in output  # young_interval_s
    assert "needs --link-gbps or --link-gbytes-per-s" in output  # comm_time_s
    assert "facts: flag: params, workers, storage_bytes_per_s" in output


def test_facts_come_from_the_spec_and_flags_win(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: p\ntrainer: mlp\nnum_workers: 4\ndataset: {uri: 's3://b/d'}\nmax_steps: 100\nbatch_size: 32\n"
        "config: {task: regression}\n"
    )
    code, output = run(str(spec), "--step-time-s", "0.5", "--json")
    assert code == 0, output
    assert json.loads(output)["samples_per_s"] == 256  # 4 workers x 32 / 0.5 s
    code, output = run(str(spec), "--step-time-s", "0.5", "--workers", "2", "--json")
    assert json.loads(output)["global_batch"] == 64  # the flag's 2 workers x 32


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--workers", "0"], "greater than or equal to 1"),  # typer's own range check
        (["--spot-discount", "1.5"], "spot_discount"),
        (["--precision", "fp8"], "precision"),
        (["--link-gbps", "100", "--link-gbytes-per-s", "12"], "not both"),
        (["/no/such/spec.yaml"], "No such file"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args: list[str], words: str) -> None:
    code, output = run(*args)
    assert code == 2, output
    assert words in output and "Traceback" not in output


def test_the_cli_loads_without_the_plan_and_lists_it_by_its_summary() -> None:
    """`apiary plan` is built when it runs (its options come from PlanFacts, whose import is the job
    spec's models): the CLI loads without them, and `--help` lists plan by its docstring's summary."""
    import subprocess
    import sys

    from api.cli import PLAN_SUMMARY
    from api.cli_plan import plan_command

    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, api.cli; print(sorted(m for m in sys.modules if m in "
         "('service.contract.spec', 'service.planning.formulas', 'api.cli_plan', 'pydantic')))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert loaded.stdout.strip() == "[]", loaded.stdout
    assert (plan_command.__doc__ or "").startswith(PLAN_SUMMARY)
    listed = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "300"})
    assert listed.exit_code == 0 and f"plan {PLAN_SUMMARY}" in " ".join(listed.output.split()), listed.output
