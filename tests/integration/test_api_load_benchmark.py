"""`benchmarks/api_load.py` at a small size, so that the benchmark keeps working: its served app and its
baseline answer, its retried and repeated submissions are each persisted once, and its check would say
otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_api_load_benchmark_runs_and_finds_every_job_persisted_once() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "api_load.py"),
            "--jobs",
            "30",
            "--repeat",
            "5",
            "--timeout-retry",
            "3",
            "--databases",
            "sqlite,postgresql",
            "--replicas",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # SQLite, PostgreSQL, and PostgreSQL with two replicas.
    assert result.stdout.count("every submission persisted exactly once: 30 jobs, 30 keys") == 3, (
        result.stdout
    )
    assert result.stdout.count("postgresql: 2 replicas / 1") == 1, result.stdout
    assert result.stdout.count("every submission persisted exactly once: 30 rows, one id each") == 2
    assert result.stdout.count("Apiary / baseline") == 2, result.stdout
