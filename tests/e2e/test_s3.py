"""Through a real `apiary serve` and local Ray, with datasets and checkpoints on S3 (moto on loopback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from api.client import ApiaryClient, ApiaryClientError
from api.demo import token_table, write_shards
from tests.conftest import S3
from tests.e2e.conftest import start_serve, stop_serve
from trainers.checkpoint import build_model_from_checkpoint, checkpoint_dir_name
from trainers.models import GPT

pytestmark = [pytest.mark.timeout(480)]


def test_a_job_reads_s3_and_checkpoints_to_s3_through_the_service(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_uri = f"{s3.datasets_uri}/tokens"
    table = token_table(num_rows=128, seq_len=9, vocab_size=32)
    write_shards(table, data_uri, num_shards=2, s3_endpoint_url=s3.endpoint_url)
    # `apiary serve` reads these (and the AWS variables the `s3` fixture set) from its environment.
    monkeypatch.setenv("APIARY_STORAGE_URI", s3.checkpoints_uri)
    spec: dict[str, Any] = {
        "name": "e2e-s3",
        "trainer": "gpt",
        "num_workers": 2,
        "dataset": {"uri": data_uri},
        "max_steps": 6,
        "batch_size": 8,
        "checkpoint": {"every_steps": 3},
        "config": {"vocab_size": 32, "d_model": 32, "n_layers": 1, "n_heads": 4},
    }
    served = start_serve(
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path / 'apiary.db'}",
        log=tmp_path / "serve.log",
    )
    try:
        with ApiaryClient(served.url) as client:
            job = client.submit(spec)
            job = client.wait(job.id, timeout_s=400)
            assert job.state == "succeeded", job
            assert job.latest_checkpoint_step == 6
            assert job.latest_checkpoint == f"{s3.checkpoints_uri}/job-{job.id}/{checkpoint_dir_name(6)}"
            # A missing S3 dataset is refused at submission (listed by the service), like a local one.
            with pytest.raises(ApiaryClientError) as refused:
                client.submit({**spec, "dataset": {"uri": f"{s3.datasets_uri}/missing"}})
            assert refused.value.status_code == 422 and "does not exist" in refused.value.message
    finally:
        stop_serve(served)
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in served.log.read_text()

    model = build_model_from_checkpoint(job.latest_checkpoint, s3_endpoint_url=s3.endpoint_url)
    assert isinstance(model, GPT)
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 32)
