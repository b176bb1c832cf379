"""The data plane on a real local Ray cluster, through `trainers.launch.run()`.

Every rank appends the sample ids of each step to `{data_trace_dir}/{run_name}/rank-{r}.jsonl` (the
launch request's `data_trace_dir`), which lets these tests compare runs sample by sample. Each `run()`
pays Ray Train's start-up, so the jobs are tiny.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from api.demo import token_table, write_shards
from service.contract.errors import DatasetError
from service.contract.protocol import LaunchRequest, error_line
from service.sharding import shard_dataset
from tests.support.jobs import launch_environment, make_request, make_spec
from tests.support.order import rank_row_order
from trainers.data import ID_COLUMN, inspect_dataset
from trainers.data_order import Slice
from trainers.data_stream import build_epoch_dataset
from trainers.launch import run
from trainers.recipe import recipe_for

pytestmark = [pytest.mark.timeout(900)]

GPT_CONFIG = {"vocab_size": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "warmup_steps": 2, "lr": 3e-3}
BATCH_SIZE = 8


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 token rows with ids 0..299, as 3 parquet shards of 16-row row groups, with a manifest."""
    root = tmp_path_factory.mktemp("data")
    write_shards(
        token_table(num_rows=300, seq_len=9, vocab_size=32), (root / "source").as_uri(), num_shards=3
    )
    shard_dataset(str(root / "source"), str(root / "shards"), num_shards=3, row_group_rows=16)
    return root / "shards"


def read_trace(trace_dir: Path, run_name: str) -> dict[int, list[tuple[int, list[int]]]]:
    """rank -> [(epoch, ids of one step), ...] in step order."""
    traces = {}
    for rank in (0, 1):
        lines = (trace_dir / run_name / f"rank-{rank}.jsonl").read_text().splitlines()
        traces[rank] = [(entry["epoch"], entry["ids"]) for entry in map(json.loads, lines)]
    return traces


def gpt_request(
    *,
    data: Path,
    storage: Path,
    run_name: str,
    max_steps: int,
    trace_dir: Path,
    data_format: str = "parquet",
    buffer_rows: int = 32,
) -> LaunchRequest:
    spec = make_spec(
        trainer="gpt",
        dataset={"uri": data.as_uri(), "format": data_format, "shuffle_buffer_rows": buffer_rows},
        config=GPT_CONFIG,
        max_steps=max_steps,
        batch_size=BATCH_SIZE,
        checkpoint={"every_steps": 10},
    )
    return make_request(spec, storage=storage, run_name=run_name, data_trace_dir=str(trace_dir))


def test_order_is_reproducible_follows_the_plan_and_resumes_exactly(
    ray_cluster: str, tmp_path: Path, trace_dir: Path, dataset: Path
) -> None:
    storage = tmp_path / "storage"
    # 300 rows, 2 ranks, batches of 8: 144 rows (18 steps) per rank per epoch; 24 steps cross into epoch 1.
    first = run(gpt_request(data=dataset, storage=storage, run_name="a", max_steps=24, trace_dir=trace_dir))
    second = run(gpt_request(data=dataset, storage=storage, run_name="b", max_steps=24, trace_dir=trace_dir))
    assert first.step == second.step == 24
    a, b = read_trace(trace_dir, "a"), read_trace(trace_dir, "b")
    assert a == b
    # Identical data and seeds give bit-identical training.
    assert first.metrics["loss"] == second.metrics["loss"]

    # What the ranks read is exactly the pure plan: disjoint rank ranges, shuffled within windows.
    spec = gpt_request(data=dataset, storage=storage, run_name="x", max_steps=24, trace_dir=trace_dir).spec
    units = inspect_dataset(spec, recipe=recipe_for(spec)).read_units()
    for rank in (0, 1):
        assert [epoch for epoch, _ in a[rank]] == [0] * 18 + [1] * 6
        for epoch in (0, 1):
            expected = rank_row_order(
                units,
                seed=spec.seed,
                epoch=epoch,
                world_size=2,
                batch_size=BATCH_SIZE,
                rank=rank,
                shuffle=True,
                buffer_rows=spec.dataset.shuffle_buffer_rows,
            ).tolist()
            got = [i for e, ids in a[rank] if e == epoch for i in ids]
            assert got == expected[: len(got)]
    epoch0 = {rank: {i for e, ids in a[rank] if e == 0 for i in ids} for rank in (0, 1)}
    assert not epoch0[0] & epoch0[1] and len(epoch0[0] | epoch0[1]) == 288  # 12 rows truncated
    # A new epoch, a new order: epoch 1 does not start like epoch 0.
    assert [i for e, ids in a[0] if e == 1 for i in ids] != [i for e, ids in a[0] if e == 0 for i in ids][:48]

    # Interrupted at step 14 (sample 112 of the epoch: inside a row group and inside the 32-row shuffle
    # window 96..127), then resumed to 24 under the same run name.
    stopped = run(gpt_request(data=dataset, storage=storage, run_name="c", max_steps=14, trace_dir=trace_dir))
    assert stopped.step == 14
    resumed = run(gpt_request(data=dataset, storage=storage, run_name="c", max_steps=24, trace_dir=trace_dir))
    assert resumed.step == 24
    assert read_trace(trace_dir, "c") == a


def test_webdataset_shards_train_in_the_planned_order(
    ray_cluster: str, tmp_path: Path, trace_dir: Path, dataset: Path
) -> None:
    shards = tmp_path / "wds"
    shard_dataset(str(dataset), str(shards), data_format="webdataset", num_shards=4)
    request = gpt_request(
        data=shards,
        storage=tmp_path / "storage",
        run_name="wds",
        max_steps=6,
        trace_dir=trace_dir,
        data_format="webdataset",
    )
    assert run(request).step == 6
    units = inspect_dataset(request.spec, recipe=recipe_for(request.spec)).read_units()
    trace = read_trace(trace_dir, "wds")
    for rank in (0, 1):
        expected = rank_row_order(
            units,
            seed=0,
            epoch=0,
            world_size=2,
            batch_size=BATCH_SIZE,
            rank=rank,
            shuffle=True,
            buffer_rows=request.spec.dataset.shuffle_buffer_rows,
        ).tolist()
        assert [i for _, ids in trace[rank] for i in ids] == expected[:48]


def test_a_corrupt_shard_fails_before_any_worker_starts(
    ray_cluster: str, tmp_path: Path, dataset: Path
) -> None:
    shards = tmp_path / "corrupt"
    shard_dataset(str(dataset), str(shards), num_shards=2)
    shard = shards / "shard-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    request = gpt_request(
        data=shards, storage=tmp_path / "storage", run_name="bad", max_steps=5, trace_dir=tmp_path / "trace"
    )
    prefix = f"dataset {shards.as_uri()}: shard shard-00001.parquet"
    expected = f"{prefix} fails its sha256 check against _manifest.json (corrupt)"
    with pytest.raises(DatasetError) as raised:
        run(request)
    assert str(raised.value) == expected

    shard.unlink()
    env = {**os.environ, **launch_environment(request), "RAY_ADDRESS": ray_cluster}
    process = subprocess.run(
        [sys.executable, "-m", "trainers.launch"], env=env, capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 1, process.stderr
    assert process.stderr.rstrip("\n").splitlines()[-1] == (
        error_line(f"{prefix} is listed in _manifest.json but missing")
    )


def test_a_rank_stream_reads_each_read_task_as_whole_blocks(ray_cluster: str, dataset: Path) -> None:
    """Ray Data cuts each read task's output into enough blocks for ~200-way parallelism: dozens of
    rows each, every one with its own object-store and executor cost. A rank's stream, which has no
    parallel operator after the read, keeps each task's rows in as few blocks as the size cap allows.
    """
    spec = make_spec(trainer="gpt", dataset=dataset, config=GPT_CONFIG)
    info = inspect_dataset(spec, recipe=recipe_for(spec))
    source = info.shard_source(s3_endpoint_url=None, extra_columns=(ID_COLUMN,))
    slices = [Slice(unit, 0, unit.num_rows) for unit in info.read_units()]

    def blocks(dataset: Any) -> list[pa.Table]:
        return list(dataset.iter_batches(batch_size=None, batch_format="pyarrow"))

    whole = blocks(build_epoch_dataset(source, slices, split_blocks=False))
    split = blocks(build_epoch_dataset(source, slices))
    # 300 rows are one read task (fewer than its minimum rows): one block, not Ray Data's pieces.
    assert [block.num_rows for block in whole] == [300]
    assert len(split) > 1, "Ray Data no longer splits read outputs: split_blocks=False can go"
    # The same rows in the same order either way.
    assert pa.concat_tables(whole)[ID_COLUMN].to_pylist() == pa.concat_tables(split)[ID_COLUMN].to_pylist()
