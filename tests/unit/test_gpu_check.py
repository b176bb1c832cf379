"""`benchmarks/gpu_check.sh` on a machine without a GPU: it stops at once, exit status 1, one line
that says why (the check itself needs a GPU node; docs/performance.md, "GPU notes")."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)


def test_the_script_parses_and_passes_shellcheck() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    subprocess.run(["shellcheck", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_nvidia_smi_it_fails_with_one_line() -> None:
    result = run(dict(os.environ))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "gpu_check: no GPU here: nvidia-smi not found (run this on a node with an NVIDIA GPU)"
    ]


def test_when_nvidia_smi_finds_no_device_it_fails_with_one_line(tmp_path: Path) -> None:
    stub = tmp_path / "nvidia-smi"
    stub.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    result = run({**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "gpu_check: no GPU here: nvidia-smi failed (no driver or no device)"
    ]
