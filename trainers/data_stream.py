"""Each rank's batches, read through Ray Data in the deterministic order of `trainers.data_order`.

Ray Data stays the reader; determinism is built into what it is asked to read rather than left to
its scheduling. Per rank and epoch, `SliceDatasource` turns the rank's slices (row ranges of parquet
row groups or tar shards) into Ray Data read tasks in order, and the dataset runs with
`preserve_order=True`, so blocks come back in slice order whatever task finishes first. Ray Data
parallelises and prefetches the reads; the rank then applies the bounded window shuffle, cuts full
batches and collates them.

`iter_rank_batches` runs that pipeline in a background thread with a bounded queue of collated
batches, so reading, decoding and the next epoch's start-up overlap the training step, and yields
`(epoch, batch)` forever from a data position `(start_epoch, start_sample)`: resuming starts the
first epoch at that position without reading what came before it (see `trainers.data_order`).

Each rank's read tasks use at most `data_cpus / world_size` CPUs, so the job's data tasks stay within
the CPUs its gang reserved for them. The bytes of the blocks a rank receives are counted
(`trainers.system.count_data_read`): its data-read figure.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from ray.data import ExecutionResources
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from service.contract.errors import DatasetError, one_line
from service.contract.spec import DataFormat
from service.contract.storage import S3Credentials, resolve_uri, s3_credentials, use_s3_credentials
from service.contract.webdataset import decode_webdataset
from trainers.data_order import DataOrder, DataPosition, Slice, seek
from trainers.system import count_data_read

logger = logging.getLogger(__name__)

# A collated batch: column name -> tensor (and "__ids__", the sample ids, while tracing).
Batch = dict[str, Any]
# Rows a read task reads at least (several small slices share one task: a task costs ~ms to start).
_MIN_ROWS_PER_TASK = 16384
# Seconds between checks of the stop flag while the queue is full.
_POLL_S = 0.1
# Blocks Ray Data fetches ahead of the window shuffle.
_PREFETCH_BLOCKS = 2


@dataclass(frozen=True, kw_only=True)
class ShardSource:
    """A dataset's shards and how to read them: what every read task needs besides its slices.

    `files[unit.file]` is the path of a unit's shard on the filesystem `uri` resolves to (with
    `s3_endpoint_url` for S3); `columns` None reads them all. `credentials`: the S3 credentials of the
    process that built it (the job's, in memory), which its read tasks use: Ray pickles them to the
    tasks with the source, never through an environment variable.
    """

    uri: str
    files: list[str]
    data_format: DataFormat
    columns: list[str] | None
    s3_endpoint_url: str | None = None
    credentials: S3Credentials | None = field(default_factory=s3_credentials, repr=False)


class SliceDatasource(Datasource):
    """Ray Data datasource over an ordered list of slices; one block per slice, in slice order."""

    def __init__(self, source: ShardSource, slices: list[Slice]) -> None:
        super().__init__()
        self.source = source
        self.slices = slices

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        # The task list is fixed by the slices, not by `parallelism`: order must not depend on it.
        tasks: list[ReadTask] = []
        for group in _group_slices(self.slices, min_rows=_MIN_ROWS_PER_TASK):
            read = functools.partial(read_slices, self.source, group)
            metadata = BlockMetadata(
                num_rows=sum(piece.num_rows for piece in group),
                size_bytes=None,
                exec_stats=None,
                input_files=tuple(sorted({self.source.files[piece.unit.file] for piece in group})),
            )
            tasks.append(ReadTask(read, metadata))
        return tasks


def _group_slices(slices: list[Slice], *, min_rows: int) -> Iterator[list[Slice]]:
    group: list[Slice] = []
    rows = 0
    for piece in slices:
        group.append(piece)
        rows += piece.num_rows
        if rows >= min_rows:
            yield group
            group, rows = [], 0
    if group:
        yield group


def read_slices(source: ShardSource, slices: list[Slice]) -> Iterable[pa.Table]:
    """Read `slices` in order, one Arrow table each (runs inside a Ray Data read task)."""
    uri, files, columns = source.uri, source.files, source.columns
    if source.credentials is not None:
        use_s3_credentials(source.credentials)
    _, filesystem = resolve_uri(uri, s3_endpoint_url=source.s3_endpoint_url)
    parquet_files: dict[int, pq.ParquetFile] = {}
    tar_tables: dict[int, pa.Table] = {}
    for piece in slices:
        unit = piece.unit
        path = files[unit.file]
        try:
            if source.data_format == DataFormat.PARQUET:
                if unit.file not in parquet_files:
                    parquet_files[unit.file] = pq.ParquetFile(filesystem.open_input_file(path))
                table = parquet_files[unit.file].read_row_group(unit.part, columns=columns)
            else:
                if unit.file not in tar_tables:
                    # A tar has no index: the whole shard is read once per task, then sliced.
                    tar_tables.clear()
                    with filesystem.open_input_stream(path) as stream:
                        tar_tables[unit.file] = decode_webdataset(stream.read())
                table = tar_tables[unit.file]
                if columns is not None:
                    table = table.select(columns)
        except (OSError, pa.ArrowInvalid) as err:
            raise DatasetError(f"dataset {uri}: cannot read {path}: {one_line(err)}") from err
        if table.num_rows != unit.num_rows:
            raise DatasetError(
                f"dataset {uri}: {path} unit {unit.part} has {table.num_rows} rows, expected {unit.num_rows} "
                "(the shard changed after the job was checked)"
            )
        yield table.slice(piece.start, piece.num_rows)


def build_epoch_dataset(
    source: ShardSource, slices: list[Slice], *, data_cpus: float | None = None, split_blocks: bool = True
) -> ray.data.Dataset:
    """A Ray Data dataset that yields `slices` of `source` in order.

    With `split_blocks`, Ray Data cuts each read task's output into as many blocks as it thinks the
    cluster's parallelism wants (200 at least: 36-row blocks for a 7,000-row task), which feeds
    parallel operators downstream. A rank's own stream has none: without it, a read task's output
    stays in as few blocks as Ray Data's block size allows, and no time goes into hundreds of tiny
    blocks.
    """
    datasource = SliceDatasource(source, slices)
    # Read tasks ask for a fraction of the limit so that two can overlap even on a 1-CPU budget.
    num_cpus = None if data_cpus is None else max(0.05, data_cpus / 2)
    dataset = ray.data.read_datasource(
        datasource,
        num_cpus=num_cpus,
        override_num_blocks=None if split_blocks else max(1, len(datasource.get_read_tasks(1))),
    )
    # The dataset's own copy of the DataContext: the process-wide one is left as it was.
    # Each rank opens a stream per epoch: Ray Data's progress bars and start banners would repeat in
    # the job's log (and cost the log forwarder CPU beside training) for every one of them. The step
    # metrics show the progress.
    dataset.context.enable_progress_bars = False
    dataset.context.print_on_execution_start = False
    options = dataset.context.execution_options
    options.preserve_order = True
    if data_cpus is not None:
        options.resource_limits = ExecutionResources.for_limits(cpu=data_cpus)
    return dataset


def iter_rank_batches(
    source: ShardSource,
    order: DataOrder,
    *,
    rank: int,
    collate_fn: Callable[[pa.Table], Batch],
    start: DataPosition = DataPosition(),
    data_cpus: float | None = None,
    prefetch_batches: int = 8,
    id_column: str | None = None,
) -> BatchStream:
    """(epoch, collated batch) for rank `rank` of `order` forever, from data position `start`.

    Reading starts at once, in the background: open the stream before building the model and the
    first batch is read while the model is built. With `id_column`, each batch also carries
    `batch["__ids__"]`, that column's values (for tracing). Close the stream when done.
    """
    per_rank, batch_size = order.rows_per_rank, order.batch_size
    if per_rank == 0:
        raise DatasetError(
            f"dataset {source.uri} has {order.total_rows} rows, "
            f"fewer than one batch per rank ({order.world_size} x {batch_size})"
        )
    if start.sample % batch_size:
        raise ValueError(f"start sample {start.sample} is not a whole number of batches of {batch_size}")

    def epoch_tables(epoch: int, position: int) -> Iterator[pa.Table]:
        """This rank's rows of `epoch` from `position` on, in final order, as Arrow tables."""
        window = order.window
        first_window = position // window
        begin = first_window * window
        slices = seek(order.rank_slices(epoch=epoch, rank=rank), begin)
        dataset = build_epoch_dataset(source, slices, data_cpus=data_cpus, split_blocks=False)
        blocks = dataset.iter_batches(
            batch_size=None, batch_format="pyarrow", prefetch_batches=_PREFETCH_BLOCKS
        )
        yield from shuffle_windows(
            _counted(blocks),
            window=window,
            first_window=first_window,
            rows=per_rank - begin,
            drop=position - begin,
            permute=(
                (
                    lambda index, size: order.window_permutation(
                        epoch=epoch, rank=rank, window=index, size=size
                    )
                )
                if window > 1
                else None
            ),
        )

    def produce(put: Callable[[Any], bool]) -> None:
        for epoch in itertools.count(start.epoch):
            position = start.sample if epoch == start.epoch else 0
            if position >= per_rank:
                continue  # a checkpoint taken right at the end of an epoch
            carry: pa.Table | None = None
            for table in epoch_tables(epoch, position):
                carry = table if carry is None else pa.concat_tables([carry, table])
                while carry.num_rows >= batch_size:
                    rows, carry = carry.slice(0, batch_size), carry.slice(batch_size)
                    batch = collate_fn(rows)
                    if id_column is not None:
                        batch["__ids__"] = rows.column(id_column).to_pylist()
                    if not put((epoch, batch)):
                        return
            # per_rank and position are whole batches, so an epoch ends on a batch boundary.
            assert carry is None or carry.num_rows == 0, "epoch did not end on a batch boundary"

    return BatchStream(produce, maxsize=prefetch_batches)


def _counted(blocks: Iterable[pa.Table]) -> Iterator[pa.Table]:
    """`blocks`, each counted as read by this process's data pipeline (`trainers.system`)."""
    for block in blocks:
        count_data_read(block.nbytes)
        yield block


def shuffle_windows(
    blocks: Iterable[pa.Table],
    *,
    window: int,
    first_window: int,
    rows: int,
    drop: int,
    permute: Callable[[int, int], np.ndarray] | None,
) -> Iterator[pa.Table]:
    """Regroup `blocks` (the rank's `rows` rows from window `first_window` on) into shuffled windows.

    `permute(w, n)` orders the n rows of window w (None: no shuffle). The first `drop` rows of the
    first window (already consumed before a resume) are left out.
    """
    if permute is None:
        # No shuffle: blocks pass through as they are, less the rows consumed before a resume.
        for block in blocks:
            if drop >= block.num_rows:
                drop -= block.num_rows
                rows -= block.num_rows
                continue
            rows -= block.num_rows
            block, drop = block.slice(drop), 0
            yield block
        if rows:
            raise DatasetError(f"the data stream ended {rows} rows early (a shard changed while training?)")
        return
    pending: list[pa.Table] = []
    pending_rows = 0
    index = first_window
    remaining = rows

    def cut(size: int) -> pa.Table:
        nonlocal pending, pending_rows
        table = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
        head, tail = table.slice(0, size), table.slice(size)
        pending, pending_rows = ([tail] if tail.num_rows else []), pending_rows - size
        return head

    for block in blocks:
        if block.num_rows == 0:
            continue
        pending.append(block)
        pending_rows += block.num_rows
        while remaining and pending_rows >= min(window, remaining):
            size = min(window, remaining)
            table = cut(size).take(pa.array(permute(index, size)))
            if drop:
                table, drop = table.slice(drop), 0
            remaining -= size
            index += 1
            if table.num_rows:
                yield table
    if remaining:
        raise DatasetError(f"the data stream ended {remaining} rows early (a shard changed while training?)")


class BatchStream(Iterator[tuple[int, Batch]]):
    """Runs `produce` in a thread from construction on, feeding a bounded queue; iterating takes its items.

    An error in `produce` is raised here, in the consumer (the train loop). `close()` stops the thread;
    the stream is also a context manager.
    """

    def __init__(self, produce: Callable[[Callable[[Any], bool]], None], *, maxsize: int) -> None:
        self._items: queue.Queue[Any] = queue.Queue(maxsize=max(1, maxsize))
        self._stop = threading.Event()
        self._done = object()
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(produce,), name="apiary-data", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._items.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, produce: Callable[[Callable[[Any], bool]], None]) -> None:
        try:
            produce(self._put)
        except BaseException as err:  # handed to the consumer, which raises it in the train loop
            self._put(err)
        else:
            self._put(self._done)

    def __next__(self) -> tuple[int, Batch]:
        if self._finished:
            raise StopIteration
        item = self._items.get()
        if item is self._done:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        return item

    def close(self) -> None:
        self._finished = True
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
