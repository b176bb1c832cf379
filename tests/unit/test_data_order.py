"""The deterministic data order (pure functions, no Ray): balance, coverage, determinism, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from api.demo import token_table, write_shards
from service.contract.errors import DatasetError
from service.sharding import shard_dataset
from tests.support.jobs import make_spec
from tests.support.order import rank_row_order
from trainers.data import inspect_dataset
from trainers.data_order import Unit, rank_slices, rows_per_rank, seek, window_permutation
from trainers.data_stream import shuffle_windows
from trainers.recipe import recipe_for

# Uneven units, like row groups of shards of different sizes: 10 units, 503 rows.
UNITS = [
    Unit(file=i // 3, part=i % 3, num_rows=n) for i, n in enumerate([64, 64, 7, 64, 64, 30, 50, 50, 50, 60])
]
TOTAL = sum(unit.num_rows for unit in UNITS)


def order(**overrides: Any) -> list[np.ndarray]:
    args: dict[str, Any] = {
        "seed": 0,
        "epoch": 0,
        "world_size": 3,
        "batch_size": 8,
        "shuffle": True,
        "buffer_rows": 32,
    }
    args.update(overrides)
    return [rank_row_order(UNITS, rank=rank, **args) for rank in range(args["world_size"])]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_are_equal_disjoint_and_cover_the_epoch_up_to_the_truncation(
    world_size: int, shuffle: bool
) -> None:
    ranks = order(world_size=world_size, shuffle=shuffle)
    per_rank = rows_per_rank(TOTAL, world_size=world_size, batch_size=8)
    assert all(len(rows) == per_rank for rows in ranks) and per_rank % 8 == 0
    seen = np.concatenate(ranks)
    assert len(set(seen.tolist())) == len(seen)  # disjoint, no row twice
    assert set(seen.tolist()) <= set(range(TOTAL))
    # What is dropped is the documented tail: fewer than world_size * batch_size rows.
    assert 0 <= TOTAL - len(seen) < world_size * 8


def test_order_is_a_function_of_seed_epoch_and_world_size() -> None:
    first, again = order(), order()
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(order(epoch=1)[0], first[0])
    assert not np.array_equal(order(seed=1)[0], first[0])
    # Samples are shuffled, not only units: consecutive rows of a rank are not consecutive ids.
    assert np.mean(np.diff(first[0]) == 1) < 0.5
    # The shuffle is bounded: a row moves at most within its window of 32 rows of the rank's range.
    plain = rank_row_order(
        UNITS, seed=0, epoch=0, world_size=3, batch_size=8, rank=0, shuffle=True, buffer_rows=1
    )
    for start in range(0, len(plain), 32):
        assert sorted(first[0][start : start + 32].tolist()) == sorted(plain[start : start + 32].tolist())


def test_without_shuffle_ranks_read_contiguous_ranges_in_order() -> None:
    ranks = order(shuffle=False)
    per_rank = len(ranks[0])
    for rank, rows in enumerate(ranks):
        assert rows.tolist() == list(range(rank * per_rank, (rank + 1) * per_rank))


def test_seek_skips_whole_units_and_slices_only_the_current_one() -> None:
    slices = rank_slices(UNITS, seed=0, epoch=2, world_size=2, batch_size=8, rank=1, shuffle=True)
    rows = sum(piece.num_rows for piece in slices)
    for position in (0, 1, 63, 64, 100, rows - 1, rows):
        rest = seek(slices, position)
        assert sum(piece.num_rows for piece in rest) == rows - position
        # Units after the first are untouched slices of the original plan: skipped whole, not read.
        assert rest[1:] == slices[len(slices) - len(rest) + 1 :]


def _blocks(rows: np.ndarray, rng: np.random.Generator) -> list[pa.Table]:
    """`rows` as Arrow blocks cut at random places, as a reader might return them."""
    cuts = sorted(rng.choice(np.arange(1, len(rows)), size=min(7, len(rows) - 1), replace=False).tolist())
    return [pa.table({"id": part}) for part in np.split(rows, cuts)]


@pytest.mark.parametrize("position", [0, 8, 24, 32, 40, 96, 152])
def test_windowed_stream_matches_the_order_and_resumes_exactly(position: int) -> None:
    # The reader side: whatever the block cuts, the window shuffle gives rank_row_order, and starting at
    # a data position reads from the start of that position's window only and gives the exact tail.
    seed, epoch, rank, buffer_rows = 3, 1, 1, 32
    expected = rank_row_order(
        UNITS,
        seed=seed,
        epoch=epoch,
        world_size=3,
        batch_size=8,
        rank=rank,
        shuffle=True,
        buffer_rows=buffer_rows,
    )
    slices = rank_slices(UNITS, seed=seed, epoch=epoch, world_size=3, batch_size=8, rank=rank, shuffle=True)
    in_range = np.concatenate(
        [
            np.arange(piece.start, piece.stop) + sum(u.num_rows for u in UNITS[: UNITS.index(piece.unit)])
            for piece in slices
        ]
    )
    first_window = position // buffer_rows
    begin = first_window * buffer_rows
    read = in_range[begin:]  # what the reader is asked for: seek(slices, begin)
    assert sum(piece.num_rows for piece in seek(slices, begin)) == len(read)
    tables = shuffle_windows(
        _blocks(read, np.random.default_rng(position)),
        window=buffer_rows,
        first_window=first_window,
        rows=len(in_range) - begin,
        drop=position - begin,
        permute=lambda index, size: window_permutation(
            seed=seed, epoch=epoch, rank=rank, window=index, size=size
        ),
    )
    got = np.concatenate([table.column("id").to_numpy() for table in tables])
    assert got.tolist() == expected[position:].tolist()


def test_inspect_reads_units_from_the_manifest_and_checks_shards(tmp_path: Path) -> None:
    source = tmp_path / "source"
    write_shards(token_table(num_rows=80, seq_len=9, vocab_size=32), source.as_uri(), num_shards=2)
    shard_dataset(str(source), str(tmp_path / "pq"), num_shards=3, row_group_rows=10)
    shard_dataset(str(source), str(tmp_path / "wds"), data_format="webdataset", num_shards=3)
    config = {"vocab_size": 32, "d_model": 16, "n_heads": 2}

    parquet_spec = make_spec(trainer="gpt", dataset=tmp_path / "pq", config=config)
    info = inspect_dataset(parquet_spec, recipe=recipe_for(parquet_spec))
    assert info.num_rows == 80 and info.format == "parquet" and info.row_shape == {"seq_len": 9}
    assert info.units[:4] == [[0, 0, 10], [0, 1, 10], [0, 2, 6], [1, 0, 10]]
    wds_dataset = {"uri": (tmp_path / "wds").as_uri(), "format": "webdataset"}
    spec = make_spec(trainer="gpt", dataset=wds_dataset, config=config)
    wds = inspect_dataset(spec, recipe=recipe_for(spec))
    assert wds.units == [[0, -1, 26], [1, -1, 27], [2, -1, 27]] and wds.row_shape == {"seq_len": 9}
    assert wds.columns == ["id", "tokens"]

    # Without a manifest the tar shards are scanned.
    (tmp_path / "wds" / "_manifest.json").unlink()
    assert inspect_dataset(spec, recipe=recipe_for(spec)).units == wds.units

    # A corrupt shard fails here, on the driver, before any worker starts.
    shard = tmp_path / "pq" / "shard-00002.parquet"
    data = bytearray(shard.read_bytes())
    data[50] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"shard-00002\.parquet fails its sha256 check"):
        inspect_dataset(parquet_spec, recipe=recipe_for(parquet_spec))


def test_unshuffled_stream_passes_blocks_through_and_skips_exactly() -> None:
    rows = np.arange(100)
    blocks = _blocks(rows, np.random.default_rng(0))
    tables = shuffle_windows(blocks, window=1, first_window=0, rows=100, drop=0, permute=None)
    assert np.concatenate([t.column("id").to_numpy() for t in tables]).tolist() == list(range(100))
    tables = shuffle_windows(
        _blocks(rows, np.random.default_rng(1)), window=1, first_window=0, rows=100, drop=37, permute=None
    )
    assert np.concatenate([t.column("id").to_numpy() for t in tables]).tolist() == list(range(37, 100))
    with pytest.raises(DatasetError, match="ended 5 rows early"):
        list(shuffle_windows(blocks, window=1, first_window=0, rows=105, drop=0, permute=None))
