"""The deterministic data order on global row numbers, computed without reading any data.

`trainers.data_order` plans which slices of which units each rank reads; this turns that plan, and
the in-window shuffle, into the row numbers (in the dataset's canonical order) a rank trains on, so
tests can compare what the ranks really read with what the plan says.
"""

from __future__ import annotations

import numpy as np

from trainers.data_order import Unit, rank_slices, window_permutation, window_rows


def rank_row_order(
    units: list[Unit],
    *,
    seed: int,
    epoch: int,
    world_size: int,
    batch_size: int,
    rank: int,
    shuffle: bool,
    buffer_rows: int,
) -> np.ndarray:
    """The global row numbers (canonical order) that rank `rank` trains on in `epoch`, in order."""
    starts = np.cumsum([0] + [unit.num_rows for unit in units])
    offset = {unit: int(start) for unit, start in zip(units, starts[:-1], strict=True)}
    slices = rank_slices(
        units,
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        batch_size=batch_size,
        rank=rank,
        shuffle=shuffle,
    )
    rows = np.concatenate(
        [np.arange(offset[s.unit] + s.start, offset[s.unit] + s.stop) for s in slices] or [np.zeros(0, int)]
    )
    size = window_rows(shuffle=shuffle, buffer_rows=buffer_rows, per_rank=len(rows))
    if size == 1:
        return rows
    windows = [
        window[window_permutation(seed=seed, epoch=epoch, rank=rank, window=index, size=len(window))]
        for index, window in enumerate(np.split(rows, range(size, len(rows), size)))
    ]
    return np.concatenate(windows)
