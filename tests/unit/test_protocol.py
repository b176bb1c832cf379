"""The service/trainer protocol (`service.contract.protocol`, `service.contract.handoff`): launch requests,
report tokens
and failure reasons."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from service.contract.errors import AttemptSuperseded
from service.contract.handoff import (
    LOOP_CONFIG_KEY,
    is_own_checkpoint,
    job_prefix,
    loop_token,
    new_token,
    pointer_from_env,
    read_launch,
    read_token,
    write_handoff,
)
from service.contract.protocol import (
    ERROR_PREFIX,
    LAUNCH_ENV_VAR,
    MAX_REASON_CHARS,
    SUPERSEDED_ERROR,
    JobFailure,
    LaunchPointer,
    LaunchRequest,
    code_modules,
    entrypoint,
    error_line,
    failure_from_logs,
    find_module,
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


def test_the_launch_request_travels_through_the_handoff_and_the_environment_holds_only_a_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The largest config a spec may have (64 KiB as JSON): with the rest of a spec, the environment
    # would be within reach of exec's 128 KiB limit on one variable; here it holds a pointer only.
    spec = make_spec(
        trainer="tests.support.custom_trainer:train",
        dataset="file:///data/tokens",
        config={"vocab_size": 64, "note": "x" * 65_000},
        name="big-config",
    )
    request = LaunchRequest(
        job_id=3,
        attempt=2,
        spec=spec,
        storage_uri=str(tmp_path / "ckpt"),
        run_name="job-3",
        telemetry_url="http://127.0.0.1:8000/internal/jobs/3/telemetry",
        data_trace_dir="/tmp/trace",
    )
    token = new_token()
    env = launch_env(write_handoff(request, token=token))
    assert len(env[LAUNCH_ENV_VAR]) < 1024
    assert token not in json.dumps(env) and "vocab_size" not in env[LAUNCH_ENV_VAR]
    assert env["RAY_CHDIR_TO_TRIAL_DIR"] == "0"
    assert entrypoint() == f"{sys.executable} -P -m trainers.launch"

    # Every process of the attempt reads the request and its token from the job's storage prefix.
    pointer = LaunchPointer.model_validate_json(env[LAUNCH_ENV_VAR])
    assert pointer.handoff_uri.startswith(job_prefix(request.storage_uri, 3))
    assert read_launch(pointer) == request
    assert read_token(pointer) == token
    monkeypatch.setenv(LAUNCH_ENV_VAR, env[LAUNCH_ENV_VAR])
    assert pointer_from_env() == pointer
    # The Train workers get the pointer in their loop config and read the token themselves.
    assert loop_token({LOOP_CONFIG_KEY: pointer.model_dump(mode="json")}) == token
    assert loop_token({}) is None
    # A pointer to another attempt's folder is not taken.
    with pytest.raises(ValueError, match="holds attempt 2 of job 3, not attempt 5"):
        read_launch(pointer.model_copy(update={"attempt": 5}))


def test_a_checkpoint_is_the_jobs_own_only_under_its_prefix() -> None:
    own = job_prefix("s3://bucket/runs", 7)
    assert own == "s3://bucket/runs/job-7/"
    assert is_own_checkpoint(f"{own}checkpoint_00000010", storage_uri="s3://bucket/runs", job_id=7)
    for foreign in (
        "s3://bucket/runs/job-70/checkpoint_00000010",  # another job that shares the digits
        "s3://elsewhere/job-7/checkpoint_00000010",
        f"{own}../job-8/checkpoint_00000010",
        f"{own}%2e%2e/job-8/checkpoint_00000010",
        f"{own}_apiary/attempt-1",  # the handoffs
        own,
    ):
        assert not is_own_checkpoint(foreign, storage_uri="s3://bucket/runs", job_id=7), foreign
    assert job_prefix("/data/ckpt", 7) == "file:///data/ckpt/job-7/"


def test_the_superseded_error_name_is_the_domain_errors() -> None:
    assert AttemptSuperseded.__name__ == SUPERSEDED_ERROR


def test_code_modules_are_the_packages_a_job_imports_of_this_checkout() -> None:
    import api
    import apiary
    import service
    import trainers

    folders = [Path(folder) for folder in code_modules()]
    expected = [Path(package.__file__).parent for package in (service, trainers, apiary, api)]
    assert folders == expected
    assert all((folder / "__init__.py").is_file() for folder in folders)
    assert entrypoint("/opt/nodes/python") == "/opt/nodes/python -P -m trainers.launch"


def test_find_module_finds_a_module_of_a_namespace_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder without `__init__.py` (a namespace package, as a user's code folder often is) holds
    modules too; finding one imports nothing."""
    (tmp_path / "nspkg" / "inner").mkdir(parents=True)
    (tmp_path / "nspkg" / "inner" / "train.py").write_text("def train_func(config): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = find_module("nspkg.inner.train")
    assert found is not None and found.origin == str(tmp_path / "nspkg" / "inner" / "train.py")
    assert find_module("nspkg.inner.missing") is None
    assert "nspkg" not in sys.modules
