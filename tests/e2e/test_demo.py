"""`apiary demo`, exactly as a new user runs it: a fresh folder, the embedded defaults (SQLite, local Ray)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import apiary_bin

pytestmark = [pytest.mark.timeout(400)]


def test_demo_trains_a_gpt_on_two_workers_and_stops_cleanly(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("APIARY_")}
    result = subprocess.run(
        [apiary_bin(), "demo"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "succeeded" in output
    assert "checkpoint: file://" in output
    # Apiary's own lines: Ray's INFO chatter ("Uploading package gcs://...") only with -v.
    assert "Uploading package" not in output and "INFO" not in output, output[-4000:]
    losses = [float(line.split("loss")[1].split()[0]) for line in output.splitlines() if " loss " in line]
    assert len(losses) >= 2 and losses[-1] < losses[0], output[-4000:]
    assert (tmp_path / ".apiary" / "apiary.db").exists()  # the embedded default database
    assert not (tmp_path / ".apiary" / "ray_cluster.json").exists()  # its local Ray was stopped
