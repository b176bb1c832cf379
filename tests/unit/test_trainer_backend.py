"""The job's driver and the Ray Train controller import no torch (trainers.backend).

Each import is paid on the path from submission to the first step. The workers, which do import it,
are covered by every Ray test that trains (tests/ray, tests/e2e).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ray import cloudpickle

from trainers.backend import ProcessGroupBackend, ProcessGroupConfig, TorchDeviceContext
from trainers.launch import recipe_train_loop


def run_probe(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_job_driver_imports_no_torch() -> None:
    assert run_probe("import sys, trainers.launch; print('torch' in sys.modules)") == "False"


def test_the_train_controller_unpickles_the_backend_and_train_function_without_torch(tmp_path: Path) -> None:
    # What the controller receives from the driver: the backend config, and the train function
    # (pickled by reference to a torch-free module).
    payload = tmp_path / "payload.pkl"
    config = ProcessGroupConfig(backend="nccl", timeout_s=60)
    payload.write_bytes(cloudpickle.dumps((config, recipe_train_loop)))
    probe = (
        "import pickle, sys; "
        f"config, fn = pickle.loads(open({str(payload)!r}, 'rb').read()); "
        "print(config.backend_cls.__name__, config.train_func_context.__name__, config.framework.name, "
        "config.to_dict()['backend'], fn.__name__, 'torch' in sys.modules)"
    )
    assert run_probe(probe) == (
        f"{ProcessGroupBackend.__name__} {TorchDeviceContext.__name__} TORCH nccl recipe_train_loop False"
    )
