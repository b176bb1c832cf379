"""The loop config the driver hands every worker (trainers.loop_config): one writer, one reader."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from service.contract.handoff import new_token, write_handoff
from service.contract.protocol import LaunchRequest
from service.contract.spec import DataFormat, JobSpec
from service.contract.storage import S3Credentials, resolve_uri, s3_credentials, use_s3_credentials
from trainers.data_stream import ShardSource
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


def test_the_redeemed_credentials_reach_the_workers_and_read_tasks_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the driver redeemed goes to each worker in the loop config (installed by `from_dict`), and
    on with every `ShardSource` and S3 filesystem it builds (pickled by Ray); the fetch token stays
    behind. The job's own code finds them where the AWS SDKs look, in the process's environment."""
    # None at the start, and none left after (monkeypatch undoes its setenv).
    aws = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION")
    for name in (*aws, "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    launch = request(tmp_path)
    credentials = S3Credentials(
        access_key="ak", secret_key="sk-secret", session_token="st-secret", region="r1"
    )
    pointer = write_handoff(
        launch, token=new_token(), credentials_url="http://127.0.0.1:1/x", fetch_token="fetch-secret"
    )
    try:
        use_s3_credentials(credentials)  # the driver's, once redeemed
        sent = LoopConfig(request=launch, handoff=pointer).to_dict()
        use_s3_credentials(None)  # a fresh worker process
        assert "fetch-secret" not in json.dumps(sent)
        back = LoopConfig.from_dict(sent)
        assert s3_credentials() == credentials and back.credentials == credentials
        assert "sk-secret" not in repr(back) and "st-secret" not in repr(credentials)
        source = ShardSource(uri="s3://b/d", files=[], data_format=DataFormat.PARQUET, columns=None)
        assert source.credentials == credentials and "sk-secret" not in repr(source)
        _, filesystem = resolve_uri("s3://b/d", s3_endpoint_url="http://127.0.0.1:1")
        # A read task or Train worker unpickles explicit credentials, with no AWS variable around.
        assert b"sk-secret" in pickle.dumps(filesystem)
        # The job's own code (boto3, pyarrow's default chain) reads them from the environment.
        assert os.environ["AWS_SECRET_ACCESS_KEY"] == "sk-secret"
        assert os.environ["AWS_SESSION_TOKEN"] == "st-secret"
        assert os.environ["AWS_REGION"] == os.environ["AWS_DEFAULT_REGION"] == "r1"
    finally:
        use_s3_credentials(None)
