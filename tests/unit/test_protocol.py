"""The service/trainer protocol (`service.protocol`): launch requests and failure reasons."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from service.protocol import (
    ERROR_PREFIX,
    LAUNCH_ENV_VAR,
    MAX_REASON_CHARS,
    JobFailure,
    LaunchRequest,
    code_modules,
    entrypoint,
    error_line,
    failure_from_logs,
    launch_env,
)
from tests.support.jobs import make_spec


def test_the_trainers_last_error_line_wins() -> None:
    logs = "\n".join(
        [
            error_line("first"),
            "Traceback (most recent call last):",
            "ValueError: boom",
            error_line("real"),
        ]
    )
    assert failure_from_logs(logs, "ray says") == JobFailure("real", retryable=False)


def test_a_retry_line_or_no_line_at_all_is_a_failure_outside_the_job() -> None:
    logs = "\n".join([error_line("old"), error_line("storage unreachable", retryable=True)])
    assert failure_from_logs(logs, "") == JobFailure("storage unreachable", retryable=True)
    # A killed driver writes no line: its last exception, else Ray's message; a new attempt may work.
    assert failure_from_logs("noise\nRuntimeError: worker died\nmore noise\n", "ray says") == JobFailure(
        "RuntimeError: worker died", retryable=True
    )
    assert failure_from_logs("just noise\n", "ray says") == JobFailure("ray says", retryable=True)
    assert failure_from_logs("", "").reason == "the Ray job failed without a message"


def test_a_reason_is_one_bounded_line() -> None:
    line = error_line("x" * 5000)
    assert line.startswith(f"{ERROR_PREFIX} ") and line.endswith("...")
    assert failure_from_logs(line, "").reason == line.removeprefix(f"{ERROR_PREFIX} ")
    assert len(failure_from_logs(line, "").reason) == MAX_REASON_CHARS


def test_launch_request_round_trips_through_the_job_environment() -> None:
    spec = make_spec(trainer="gpt", dataset="file:///data/tokens", config={"vocab_size": 64})
    request = LaunchRequest(
        job_id=3,
        attempt=1,
        spec=spec,
        storage_uri="/tmp/ckpt",
        run_name="job-3",
        telemetry_url="http://127.0.0.1:8000/internal/jobs/3/telemetry",
        data_trace_dir="/tmp/trace",
    )
    env = launch_env(request)
    assert LaunchRequest.from_env(env[LAUNCH_ENV_VAR]) == request
    assert json.loads(env[LAUNCH_ENV_VAR])["spec"] == spec.model_dump(mode="json")
    assert env["RAY_CHDIR_TO_TRIAL_DIR"] == "0"
    assert entrypoint() == f"{sys.executable} -P -m trainers.launch"


def test_code_modules_are_the_service_and_trainers_packages_of_this_checkout() -> None:
    import service
    import trainers

    folders = [Path(folder) for folder in code_modules()]
    assert folders == [Path(service.__file__).parent, Path(trainers.__file__).parent]
    assert all((folder / "__init__.py").is_file() for folder in folders)
    assert entrypoint("/opt/nodes/python") == "/opt/nodes/python -P -m trainers.launch"
