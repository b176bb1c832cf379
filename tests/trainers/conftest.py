"""Synthetic datasets and launch requests for the trainer tests, and the local Ray cluster fixture.

Test modules get the helpers through the `synthetic` fixture rather than by importing this file,
so they do not depend on how pytest names conftest modules.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.spec import JobSpec, LaunchRequest


def write_shards(folder: Path, table: pa.Table, *, shards: int) -> Path:
    """Write `table` as `shards` parquet files under `folder` and return the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, table.num_rows, shards + 1).astype(int)
    for index, (start, stop) in enumerate(itertools.pairwise(bounds)):
        pq.write_table(table.slice(start, stop - start), folder / f"part-{index:05d}.parquet")
    return folder


def write_token_dataset(
    folder: Path, *, rows: int = 256, seq_len: int = 17, vocab_size: int = 32, shards: int = 3, seed: int = 0
) -> Path:
    """Rows of `tokens` that count up modulo vocab_size from a random start: easy to learn."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, vocab_size, size=(rows, 1))
    tokens = (starts + np.arange(seq_len)) % vocab_size
    return write_shards(
        folder, pa.table({"tokens": pa.array(tokens.tolist(), pa.list_(pa.int64()))}), shards=shards
    )


def write_classification_dataset(
    folder: Path,
    *,
    rows: int = 512,
    num_features: int = 8,
    num_classes: int = 3,
    shards: int = 3,
    seed: int = 0,
) -> Path:
    """Rows of `features` (float list) and `label`, the argmax of a fixed linear map: linearly separable."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(rows, num_features)).astype(np.float32)
    labels = (features @ rng.normal(size=(num_features, num_classes))).argmax(axis=1)
    table = pa.table(
        {
            "features": pa.array(features.tolist(), pa.list_(pa.float32())),
            "label": pa.array(labels, pa.int64()),
        }
    )
    return write_shards(folder, table, shards=shards)


def make_spec(*, trainer: str, dataset: Path | str, config: dict[str, Any], **fields: Any) -> JobSpec:
    uri = dataset if isinstance(dataset, str) else dataset.absolute().as_uri()
    values: dict[str, Any] = {
        "name": f"test-{trainer}",
        "trainer": trainer,
        "num_workers": 2,
        "dataset": {"uri": uri},
        "max_steps": 30,
        "batch_size": 16,
        "config": config,
    }
    values.update(fields)
    return JobSpec.model_validate(values)


def make_request(
    spec: JobSpec, *, storage: Path, run_name: str, report_url: str | None = None
) -> LaunchRequest:
    return LaunchRequest(
        job_id=1,
        attempt=1,
        spec=spec,
        storage_uri=str(storage),
        run_name=run_name,
        report_url=report_url,
        data_cpus=1.0,
    )


class ReportServer:
    """A real HTTP server on 127.0.0.1 that collects ReportBatch posts.

    The first `fail_first` posts get `fail_status` (and are not kept), like a control plane that is
    down for a while.
    """

    def __init__(self, *, fail_first: int = 0, fail_status: int = 503) -> None:
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.attempts = 0
        self.batches: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with server.lock:
                    server.attempts += 1
                    failing = server.attempts <= server.fail_first
                    if not failing:
                        server.batches.append(json.loads(body))
                self.send_response(server.fail_status if failing else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # keep pytest output quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/report"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def points(self) -> list[dict[str, Any]]:
        with self.lock:
            return [point for batch in self.batches for point in batch["points"]]

    def checkpoints(self) -> list[dict[str, Any]]:
        with self.lock:
            return [batch["checkpoint"] for batch in self.batches if batch["checkpoint"] is not None]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def report_server() -> Iterator[ReportServer]:
    server = ReportServer()
    yield server
    server.close()


class Synthetic:
    """The helpers above, handed to tests by the `synthetic` fixture."""

    write_shards = staticmethod(write_shards)
    write_token_dataset = staticmethod(write_token_dataset)
    write_classification_dataset = staticmethod(write_classification_dataset)
    make_spec = staticmethod(make_spec)
    make_request = staticmethod(make_request)
    ReportServer = ReportServer


@pytest.fixture(scope="session")
def synthetic() -> type[Synthetic]:
    return Synthetic


@contextlib.contextmanager
def local_ray(*, runtime_env: dict[str, Any] | None = None) -> Iterator[str]:
    """A fresh local Ray cluster (8 logical CPUs); yields its GCS address, then shuts it down."""
    import ray

    # ray.init() of a new local cluster switches this process to token auth by setting RAY_AUTH_MODE;
    # put the environment back so later tests in this session start from what they expect.
    saved = os.environ.get("RAY_AUTH_MODE")
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=runtime_env)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A fresh local Ray cluster for one test module; yields its GCS address."""
    with local_ray() as address:
        yield address
