"""The service/trainer protocol (`service.protocol`): launch requests and failure reasons."""

from __future__ import annotations

import json
import sys

from service.protocol import (
    ERROR_PREFIX,
    LAUNCH_ENV_VAR,
    MAX_REASON_CHARS,
    LaunchRequest,
    entrypoint,
    error_line,
    launch_env,
    reason_from_logs,
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
    assert reason_from_logs(logs, "ray says") == "real"


def test_without_an_error_line_the_last_exception_then_rays_message() -> None:
    assert (
        reason_from_logs("noise\nRuntimeError: worker died\nmore noise\n", "ray says")
        == "RuntimeError: worker died"
    )
    assert reason_from_logs("just noise\n", "ray says") == "ray says"
    assert reason_from_logs("", "") == "the Ray job failed without a message"


def test_a_reason_is_one_bounded_line() -> None:
    line = error_line("x" * 5000)
    assert line.startswith(f"{ERROR_PREFIX} ") and line.endswith("...")
    assert reason_from_logs(line, "") == line.removeprefix(f"{ERROR_PREFIX} ")
    assert len(reason_from_logs(line, "")) == MAX_REASON_CHARS


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
    assert entrypoint() == f"{sys.executable} -m trainers.launch"
