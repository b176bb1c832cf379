"""The background batch stream (trainers.data_stream.BatchStream) and what the job driver imports."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from trainers.data_stream import BatchStream


def test_the_stream_reads_before_it_is_asked() -> None:
    started = threading.Event()

    def produce(put: Callable[[Any], bool]) -> None:
        started.set()
        for item in range(3):
            put((0, {"item": item}))

    stream = BatchStream(produce, maxsize=2)
    # Reading starts at construction: the first batch is being read while the model is built.
    assert started.wait(5)
    assert [batch["item"] for _, batch in stream] == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(stream)
    stream.close()


def test_an_error_while_reading_is_raised_in_the_train_loop() -> None:
    def produce(put: Callable[[Any], bool]) -> None:
        put((0, {"item": 0}))
        raise ValueError("shard 3 is corrupt")

    with BatchStream(produce, maxsize=4) as stream:
        assert next(stream)[1] == {"item": 0}
        with pytest.raises(ValueError, match="shard 3 is corrupt"):
            next(stream)
        with pytest.raises(StopIteration):
            next(stream)


def test_closing_an_unread_stream_stops_its_thread() -> None:
    produced: list[int] = []

    def produce(put: Callable[[Any], bool]) -> None:
        for item in range(1000):
            if not put((0, {"item": item})):
                return
            produced.append(item)

    stream = BatchStream(produce, maxsize=2)
    thread = stream._thread
    stream.close()  # never iterated: the producer is blocked on the full queue
    assert not thread.is_alive()
    assert len(produced) <= 3


def test_the_job_driver_and_ddp_workers_do_not_import_fsdp_or_dcp() -> None:
    """FSDP, DTensor and torch.distributed.checkpoint slow every process's start:
    they are imported when a job shards its model or writes a sharded checkpoint, not before."""
    probe = (
        "import sys, trainers.launch, trainers.loop; "
        "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor', "
        "'torch.distributed.checkpoint') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
