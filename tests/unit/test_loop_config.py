"""The loop config the driver hands every worker (trainers.loop_config): one writer, one reader."""

from __future__ import annotations

from pathlib import Path

from service.contract.handoff import new_token, write_handoff
from service.contract.protocol import LaunchRequest
from service.contract.spec import JobSpec
from trainers.loop_config import LoopConfig


def request(tmp_path: Path) -> LaunchRequest:
    spec = JobSpec.model_validate(
        {
            "name": "job",
            "trainer": "mlp",
            "num_workers": 1,
            "dataset": {"uri": f"file://{tmp_path}/data"},
            "max_steps": 3,
            "batch_size": 2,
            "config": {"task": "classification", "num_classes": 2},
        }
    )
    return LaunchRequest(
        job_id=7,
        attempt=2,
        spec=spec,
        storage_uri=str(tmp_path / "storage"),
        run_name="job-7",
        telemetry_url="http://127.0.0.1:1/internal/jobs/7/telemetry",
    )


def test_it_round_trips_and_reads_the_token_from_the_handoff(tmp_path: Path) -> None:
    launch = request(tmp_path)
    token = new_token()
    pointer = write_handoff(launch, token=token)
    config = LoopConfig(request=launch, handoff=pointer)
    back = LoopConfig.from_dict(config.to_dict())
    assert back == config and back.dataset is None and back.eval_dataset is None
    assert back.token() == token
    assert LoopConfig.from_dict(LoopConfig(request=launch).to_dict()).token() is None
