"""Datasets, checkpoints and job submission on a real S3 server (moto on loopback, `s3` fixture)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pytest
import torch
from typer.testing import CliRunner

from api.cli import app
from api.demo import token_table, write_shards
from service.auth import User
from service.contract.errors import DatasetError
from service.contract.protocol import LAUNCH_ENV_VAR
from service.contract.spec import JobSpec, ProfileSpec
from service.contract.storage import list_shards, read_manifest, resolve_uri, validate_manifest
from service.profiles import list_profiles
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from tests.conftest import S3
from tests.support.fakes import FakeBackend
from tests.support.jobs import make_request, make_spec
from tests.support.profiling import profile_small_model
from trainers.checkpoint import (
    TrainParts,
    TrainState,
    build_model_from_checkpoint,
    capture_rng_state,
    download_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainers.recipe import recipe_for

GPT_CONFIG = {"vocab_size": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}


def test_a_token_dataset_written_to_s3_lists_and_reads_back(s3: S3) -> None:
    uri = f"{s3.datasets_uri}/tokens"
    tokens = token_table(num_rows=30, seq_len=5, vocab_size=8)
    written = write_shards(tokens, uri, num_shards=3, s3_endpoint_url=s3.endpoint_url)

    files, filesystem = list_shards(uri, s3_endpoint_url=s3.endpoint_url)
    assert isinstance(filesystem, pafs.S3FileSystem)
    assert files == written and [f.rsplit("/", 1)[1] for f in files] == [
        f"shard-{index:05d}.parquet" for index in range(3)
    ]
    table = pads.dataset(files, filesystem=filesystem, format="parquet").to_table()
    assert table.column("id").to_pylist() == list(range(30))
    assert table.equals(tokens)
    single, _ = list_shards(f"s3://{files[1]}", s3_endpoint_url=s3.endpoint_url)
    assert single == [files[1]]


def test_missing_s3_datasets_are_a_dataset_error(s3: S3) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        list_shards(f"{s3.datasets_uri}/nothing-here", s3_endpoint_url=s3.endpoint_url)
    with pytest.raises(DatasetError, match=r"cannot be read|does not exist"):
        list_shards("s3://no-such-bucket/x", s3_endpoint_url=s3.endpoint_url)


def test_a_checkpoint_in_s3_loads_and_rebuilds_its_model(s3: S3, tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "s3-ckpt",
            "trainer": "gpt",
            "num_workers": 1,
            "dataset": {"uri": "file:///unused"},
            "max_steps": 1,
            "batch_size": 2,
            "config": GPT_CONFIG,
        }
    )
    torch.manual_seed(0)
    trainer = recipe_for(spec)
    model = trainer.build_model({"seq_len": 8})
    optimizer, lr_schedule = trainer.build_optimizer(model, max_steps=spec.max_steps)
    parts = TrainParts(model=model, optimizer=optimizer, lr_schedule=lr_schedule)
    local = tmp_path / "checkpoint_00000001"
    local.mkdir()
    state = TrainState(step=1, batches_in_epoch=1, samples_consumed=2)
    save_checkpoint(local, parts, state, spec=spec, row_shape={"seq_len": 8}, rng=[capture_rng_state()])
    uri = f"{s3.checkpoints_uri}/job-1/checkpoint_00000001"
    root, filesystem = resolve_uri(uri, s3_endpoint_url=s3.endpoint_url)
    pafs.copy_files(
        str(local), root, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=filesystem
    )

    assert load_checkpoint(uri, s3_endpoint_url=s3.endpoint_url)["step"] == 1
    rebuilt = build_model_from_checkpoint(uri, s3_endpoint_url=s3.endpoint_url)
    for name, tensor in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    copied = download_checkpoint(uri, tmp_path / "copy", s3_endpoint_url=s3.endpoint_url)
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in local.iterdir())
    with pytest.raises(FileNotFoundError, match="not an Apiary checkpoint"):
        load_checkpoint(f"{s3.checkpoints_uri}/job-1/nothing", s3_endpoint_url=s3.endpoint_url)
    # The file:// URI that the service records for local storage reads in place.
    assert load_checkpoint(local.as_uri())["step"] == 1


def test_jobs_of_an_external_cluster_get_no_aws_variable_in_their_runtime_env(
    s3: S3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On an external cluster (APIARY_RAY_ADDRESS) too, the runtime_env (which Ray logs) carries only a
    fetch token, which the driver redeems for the credentials (tests/integration/test_credentials.py)."""
    from service.runtime import Runtime

    uri = f"{s3.datasets_uri}/tokens"
    write_shards(
        token_table(num_rows=8, seq_len=5, vocab_size=8), uri, num_shards=1, s3_endpoint_url=s3.endpoint_url
    )
    # Settings from the environment, as `apiary serve` reads it (the `s3` fixture set the variables).
    settings = Settings(
        data_dir=tmp_path / "data", storage_uri=s3.checkpoints_uri, ray_address="http://ray-head:8265"
    )
    assert settings.s3_endpoint_url == s3.endpoint_url
    backend = FakeBackend()
    runtime = Runtime(settings, backend=backend, run_scheduler=False)
    runtime.start()
    try:
        spec = JobSpec.model_validate(
            {
                "name": "s3",
                "trainer": "gpt",
                "num_workers": 1,
                "dataset": {"uri": uri},
                "max_steps": 1,
                "batch_size": 2,
                "config": GPT_CONFIG,
            }
        )
        with caplog.at_level("DEBUG"):
            job = runtime.jobs.submit(spec, by=User(name="u"))  # lists the shards on S3 at submission
            assert isinstance(runtime.scheduler, Scheduler)
            runtime.scheduler.tick()
    finally:
        runtime.stop()

    _, launch = backend.submitted[0]
    assert launch.job_id == job.id
    assert launch.s3_endpoint_url == s3.endpoint_url and launch.storage_uri == s3.checkpoints_uri
    env = backend.env_vars
    assert not [key for key in env if key.startswith("AWS_")], sorted(env)
    assert json.loads(env[LAUNCH_ENV_VAR])["credentials_token"]
    secret = s3.env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in json.dumps(env) and secret not in json.dumps(launch.model_dump(mode="json"))
    assert secret not in caplog.text and secret not in repr(settings)
    credentials = settings.job_s3_credentials()
    assert credentials is not None and credentials.secret_key == secret and secret not in repr(credentials)

    off = Settings(data_dir=tmp_path / "data", forward_aws_env=False)
    assert off.job_aws_env() == {} and off.job_s3_credentials() is None


def test_shard_to_s3_writes_a_manifest_that_validates_and_lists(s3: S3, tmp_path: Path) -> None:
    source = tmp_path / "source"
    write_shards(token_table(num_rows=100, seq_len=7, vocab_size=16), source.as_uri(), num_shards=2)
    dest = f"{s3.datasets_uri}/sharded"
    runner = CliRunner()
    result = runner.invoke(
        app, ["data", "shard", str(source), dest, "--format", "webdataset", "--num-shards", "3"]
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(dest, s3_endpoint_url=s3.endpoint_url)
    assert manifest is not None and manifest.num_rows == 100
    validate_manifest(manifest, uri=dest, s3_endpoint_url=s3.endpoint_url)
    files, _ = list_shards(dest, data_format="webdataset", s3_endpoint_url=s3.endpoint_url)
    assert [f.rsplit("/", 1)[-1] for f in files] == ["shard-00000.tar", "shard-00001.tar", "shard-00002.tar"]


def test_a_profile_is_saved_to_s3_beside_the_checkpoints_and_listed_from_there(s3: S3) -> None:
    spec = make_spec(trainer="mlp", dataset="file:///unused", config={"task": "regression"}, max_steps=5)
    request = make_request(
        spec, storage=s3.checkpoints_uri, run_name="job-7", s3_endpoint_url=s3.endpoint_url
    )
    ((kind, event),) = profile_small_model(request, ProfileSpec(start_step=1, steps=2), steps=3)
    folder = f"{s3.checkpoints_uri}/job-7/profile/plugins/profile/steps-1-2"
    assert kind == "profile" and event["folder"] == folder and event["traces"] == 1
    (profile,) = list_profiles(s3.checkpoints_uri, 7, s3_endpoint_url=s3.endpoint_url)
    assert profile.folder == folder and profile.summary is not None
    (trace,) = profile.traces
    assert (trace.rank, trace.uri) == (0, f"{folder}/rank-0.pt.trace.json") and trace.size_bytes > 0
    path, filesystem = resolve_uri(trace.uri, s3_endpoint_url=s3.endpoint_url)
    with filesystem.open_input_stream(path) as stream:
        names = {event.get("name") for event in json.loads(stream.read())["traceEvents"]}
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names
