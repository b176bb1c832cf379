"""Job specs and launch requests as the trainers receive them, for tests that run trainers directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.contract.handoff import new_token, write_handoff
from service.contract.protocol import LaunchRequest, launch_env
from service.contract.spec import JobSpec


def make_spec(
    *, trainer: str, dataset: Path | str | dict[str, Any], config: dict[str, Any], **fields: Any
) -> JobSpec:
    """A 2-worker, 30-step spec with batches of 16, unless `fields` say otherwise.

    `dataset` is a folder, a URI, or the whole `dataset` section.
    """
    if isinstance(dataset, Path):
        dataset = dataset.absolute().as_uri()
    values: dict[str, Any] = {
        "name": f"test-{trainer}",
        "trainer": trainer,
        "num_workers": 2,
        "dataset": {"uri": dataset} if isinstance(dataset, str) else dataset,
        "max_steps": 30,
        "batch_size": 16,
        "config": config,
    }
    values.update(fields)
    return JobSpec.model_validate(values)


def make_request(spec: JobSpec, *, storage: Path | str, run_name: str, **fields: Any) -> LaunchRequest:
    """Attempt 1 of job 1, checkpointing under `storage`; `fields` set the rest (telemetry_url, ...)."""
    values: dict[str, Any] = {"telemetry_url": None, "data_cpus": 1.0, **fields}
    return LaunchRequest(
        job_id=1, attempt=1, spec=spec, storage_uri=str(storage), run_name=run_name, **values
    )


def classification_job(dataset: str, *, name: str, **fields: Any) -> dict[str, Any]:
    """A job as a client submits it: the `mlp` trainer on a 3-class dataset (`dataset`, a URI), one
    worker, 20 steps of batches of 8, unless `fields` say otherwise."""
    return {
        "name": name,
        "trainer": "mlp",
        "num_workers": 1,
        "dataset": {"uri": dataset},
        "max_steps": 20,
        "batch_size": 8,
        "config": {"task": "classification", "num_classes": 3},
        **fields,
    }


def launch_environment(request: LaunchRequest) -> dict[str, str]:
    """The protocol's environment of `python -m trainers.launch` for `request`, as the scheduler sets it
    up: the request and a report token written to its handoff folder, a pointer in the environment."""
    return launch_env(write_handoff(request, token=new_token()))
