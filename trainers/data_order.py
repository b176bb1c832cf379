"""Deterministic data order: which samples each rank reads, in which order, as a pure function.

The order of an epoch is a function of (seed, epoch, world_size, batch_size) and the dataset's layout
only, never of timing, of how Ray Data schedules its tasks, or of how many times the run restarted:

1. **Units.** The dataset is cut into read units in canonical order (shard files sorted as listed,
   then parquet row groups in file order; a WebDataset tar shard is one unit). Every unit knows its
   row count from the footers or the manifest, so the plan needs no data.
2. **Shard shuffle.** With `dataset.shuffle`, the units are permuted by (seed, epoch); without it
   they keep canonical order. Concatenated, they form the epoch's global row stream.
3. **Rank ranges.** Each rank takes one contiguous range of that stream, all ranges the same length
   `rows_per_rank = floor(total_rows / (world_size * batch_size)) * batch_size`, so every rank runs
   the same number of full batches and rolls over to the next epoch at the same step (a rank that ran
   out first would hang the others' collectives). The remainder, fewer than world_size * batch_size
   rows at the tail of the permuted stream, is dropped for that epoch; since the permutation changes
   every epoch, a different tail is dropped each time. A range is a list of `Slice`s: row ranges of
   units, so a rank reads only its own part of each shard.
4. **Bounded sample shuffle.** A rank's range is cut into windows of `shuffle_buffer_rows` rows
   (aligned to the start of its range), and the rows of window w are permuted by
   (seed, epoch, rank, w). Memory is bounded by one window; the window grid is fixed, so the order
   does not depend on how the reader happened to cut blocks.

Data position: a rank's place in an epoch is one number, the samples it consumed (`position`). All
ranks consume at the same pace, so the checkpoint's (epoch, batches_in_epoch) gives it as
`batches_in_epoch * batch_size`. Resuming at `position` re-reads only from the start of window
`position // shuffle_buffer_rows` (whole units before it are skipped, the first unit is sliced, and
at most one window's rows are read and dropped), never the epoch up to that point. Without shuffle
the window is a single row, so nothing is read twice beyond the first parquet row group.

`DataOrder` holds what an epoch's order is a function of, besides the epoch; `DataPosition` is a
rank's place in it. `trainers.data_stream` reads the slices through Ray Data in this order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Tags that keep the random streams of the two shuffles apart for the same (seed, epoch).
_UNIT_SHUFFLE = 0
_WINDOW_SHUFFLE = 1


@dataclass(frozen=True)
class Unit:
    """The smallest piece a reader can fetch on its own: a parquet row group or a whole tar shard."""

    file: int  # index into DatasetInfo.files
    part: int  # parquet row group index; -1 = the whole file (a WebDataset tar)
    num_rows: int


@dataclass(frozen=True)
class Slice:
    """Rows [start, stop) of one unit."""

    unit: Unit
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, kw_only=True)
class DataOrder:
    """What the order of every epoch is a function of, besides the epoch itself."""

    units: tuple[Unit, ...]  # in canonical order
    seed: int
    world_size: int
    batch_size: int
    shuffle: bool
    buffer_rows: int  # the shuffle window (dataset.shuffle_buffer_rows)

    @property
    def total_rows(self) -> int:
        return sum(unit.num_rows for unit in self.units)

    @property
    def rows_per_rank(self) -> int:
        return rows_per_rank(self.total_rows, world_size=self.world_size, batch_size=self.batch_size)

    @property
    def window(self) -> int:
        return window_rows(shuffle=self.shuffle, buffer_rows=self.buffer_rows, per_rank=self.rows_per_rank)

    def rank_slices(self, *, epoch: int, rank: int) -> list[Slice]:
        return rank_slices(
            list(self.units),
            seed=self.seed,
            epoch=epoch,
            world_size=self.world_size,
            batch_size=self.batch_size,
            rank=rank,
            shuffle=self.shuffle,
        )

    def window_permutation(self, *, epoch: int, rank: int, window: int, size: int) -> np.ndarray:
        return window_permutation(seed=self.seed, epoch=epoch, rank=rank, window=window, size=size)


@dataclass(frozen=True)
class DataPosition:
    """A rank's place in the data: `sample` is how many samples it consumed of `epoch`."""

    epoch: int = 0
    sample: int = 0


def rows_per_rank(total_rows: int, *, world_size: int, batch_size: int) -> int:
    """Rows each rank reads per epoch: equal for all ranks and a whole number of batches."""
    return (total_rows // (world_size * batch_size)) * batch_size


def unit_order(units: list[Unit], *, seed: int, epoch: int, shuffle: bool) -> list[Unit]:
    if not shuffle:
        return list(units)
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, _UNIT_SHUFFLE]))
    return [units[index] for index in rng.permutation(len(units))]


def rank_slices(
    units: list[Unit], *, seed: int, epoch: int, world_size: int, batch_size: int, rank: int, shuffle: bool
) -> list[Slice]:
    """The slices rank `rank` reads in `epoch`, in order (before the in-window shuffle)."""
    assert 0 <= rank < world_size
    per_rank = rows_per_rank(
        sum(unit.num_rows for unit in units), world_size=world_size, batch_size=batch_size
    )
    return _cut(unit_order(units, seed=seed, epoch=epoch, shuffle=shuffle), rank * per_rank, per_rank)


def seek(slices: list[Slice], position: int) -> list[Slice]:
    """The slices that remain after skipping the first `position` rows, the first one trimmed."""
    remaining: list[Slice] = []
    for piece in slices:
        if position >= piece.num_rows:
            position -= piece.num_rows
            continue
        remaining.append(Slice(piece.unit, piece.start + position, piece.stop) if position else piece)
        position = 0
    return remaining


def window_rows(*, shuffle: bool, buffer_rows: int, per_rank: int) -> int:
    """Rows per shuffle window; without shuffle the order is the range's own, one row per window."""
    return max(1, min(buffer_rows, per_rank)) if shuffle else 1


def window_permutation(*, seed: int, epoch: int, rank: int, window: int, size: int) -> np.ndarray:
    """The order of the `size` rows of window `window` of a rank's range."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, _WINDOW_SHUFFLE, rank, window]))
    return rng.permutation(size)


def _cut(units: list[Unit], begin: int, length: int) -> list[Slice]:
    """Rows [begin, begin + length) of the stream formed by `units`, as slices."""
    slices: list[Slice] = []
    position = 0
    end = begin + length
    for unit in units:
        unit_begin, unit_end = position, position + unit.num_rows
        position = unit_end
        lo, hi = max(begin, unit_begin), min(end, unit_end)
        if lo < hi:
            slices.append(Slice(unit, lo - unit_begin, hi - unit_begin))
        if position >= end:
            break
    return slices
