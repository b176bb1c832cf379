"""A job on a real local Ray cluster that reads its dataset from S3 and checkpoints to S3 (moto on loopback).

The package's cluster (tests/ray/conftest.py) gets the AWS variables through its job-level runtime_env
(the service's jobs redeem theirs for a fetch token instead: tests/e2e/test_multinode_secrets.py):
Train workers and Ray Data tasks read S3 with them, not with whatever environment the raylet started
with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from api.demo import token_table, write_shards
from service.contract.protocol import LaunchRequest
from tests.conftest import S3
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from trainers.checkpoint import build_model_from_checkpoint, checkpoint_dir_name, load_checkpoint
from trainers.launch import run
from trainers.models import GPT

pytestmark = [pytest.mark.timeout(420)]

GPT_CONFIG = {"vocab_size": 32, "d_model": 32, "n_layers": 1, "n_heads": 4, "warmup_steps": 2, "lr": 3e-3}


def test_gpt_reads_s3_checkpoints_to_s3_and_resumes_from_there(
    ray_cluster: str, s3: S3, telemetry_server: TelemetryServer, tmp_path: Path
) -> None:
    data_uri = f"{s3.datasets_uri}/tokens"
    table = token_table(num_rows=128, seq_len=9, vocab_size=32)
    write_shards(table, data_uri, num_shards=2, s3_endpoint_url=s3.endpoint_url)

    def request(max_steps: int) -> LaunchRequest:
        spec = make_spec(
            trainer="gpt",
            dataset=data_uri,
            config=GPT_CONFIG,
            max_steps=max_steps,
            batch_size=8,
            checkpoint={"every_steps": 4},
        )
        return make_request(
            spec,
            storage=s3.checkpoints_uri,
            run_name="s3-run",
            telemetry_url=telemetry_server.url,
            s3_endpoint_url=s3.endpoint_url,
        )

    first = run(request(4))
    assert first.step == 4
    # The second submission under the same run name finds its checkpoint in S3 and resumes there.
    second = run(request(8))
    assert second.step == 8
    expected_uri = f"{s3.checkpoints_uri}/s3-run/{checkpoint_dir_name(8)}"
    assert second.checkpoint_uri == expected_uri
    # The second run reports the checkpoint it resumed from too (the control plane may have missed it).
    assert [c["uri"] for c in telemetry_server.checkpoints()] == [
        f"{s3.checkpoints_uri}/s3-run/{checkpoint_dir_name(4)}",
        f"{s3.checkpoints_uri}/s3-run/{checkpoint_dir_name(4)}",
        expected_uri,
    ]
    rank0_steps = sorted(p["step"] for p in telemetry_server.points() if p["rank"] == 0)
    assert rank0_steps == list(range(1, 9))  # the resumed run started at step 5

    state = load_checkpoint(expected_uri, s3_endpoint_url=s3.endpoint_url)
    assert state["step"] == 8 and state["samples_consumed"] == 8 * 2 * 8
    model = build_model_from_checkpoint(expected_uri, s3_endpoint_url=s3.endpoint_url)
    assert isinstance(model, GPT)
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 32)
