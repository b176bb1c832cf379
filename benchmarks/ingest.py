"""Ingest benchmark: how fast the data plane feeds 2 workers, and what share of a gpt step waits on data.

    .venv/bin/python benchmarks/ingest.py            # ~2-3 min on a 2-core machine

Side by side in one run, on the same token shards (parquet, 1024-row row groups):

1. `pipeline`: Apiary's deterministic per-rank stream (`trainers.data.iter_batches_for_rank`: Ray Data
   read tasks, window shuffle, collate to tensors) in 2 Ray workers at once, 2 epochs each;
   steady-state rows/s over both workers (after each one's first batch) and time to first batch.
2. `pyarrow`: one process reading the same files row group by row group with pyarrow and decoding
   them with the same collate function (no Ray, no shuffle).
3. `mock`: a loader that hands out one prepared batch again and again (the ceiling of any loader).
4. `gpt`: a real 2-worker `gpt` job through `trainers.launch.run()`; every rank reports data_wait_s
   and step_time_s per step: the data-wait share of step time (goal < 10%), steps after the first.

Prints one line per measurement and the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from api.demo import token_table, write_shards
from service.contract.protocol import LaunchRequest
from service.contract.spec import JobSpec
from trainers.data import DatasetInfo, inspect_dataset, iter_batches_for_rank
from trainers.recipe import recipe_for

SEQ_LEN = 129
VOCAB = 256
GPT_CONFIG = {"vocab_size": VOCAB, "d_model": 64, "n_layers": 2, "n_heads": 4, "warmup_steps": 5, "lr": 3e-3}


def make_spec(data: Path, *, batch_size: int, max_steps: int = 10) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "bench",
            "trainer": "gpt",
            "num_workers": 2,
            "dataset": {"uri": data.as_uri()},
            "max_steps": max_steps,
            "batch_size": batch_size,
            "config": GPT_CONFIG,
        }
    )


def stream_request(spec: JobSpec) -> LaunchRequest:
    """What a rank's stream reads from the launch request: the spec, and 2 CPUs for its data tasks."""
    return LaunchRequest(
        job_id=1,
        attempt=1,
        spec=spec,
        storage_uri="/unused",
        run_name="bench",
        telemetry_url=None,
        data_cpus=2.0,
    )


@ray.remote(num_cpus=1)
def consume(request_json: str, info: dict[str, Any], rank: int, num_batches: int) -> dict[str, float]:
    # torch's first import in a worker (~1 s) is worker start-up, not the data path: see resume.py.
    import torch  # noqa: F401

    request = LaunchRequest.model_validate_json(request_json)
    spec = request.spec
    dataset = DatasetInfo.from_dict(info)
    started = time.perf_counter()
    collate = recipe_for(spec).build_collate(dataset.row_shape, uri=dataset.uri)
    batches = iter_batches_for_rank(request, dataset, rank=rank, world_size=2, collate_fn=collate)
    next(batches)
    first_s = time.perf_counter() - started
    steady_started = time.perf_counter()
    for _ in range(num_batches - 1):
        next(batches)
    steady_s = time.perf_counter() - steady_started
    batches.close()
    return {
        "first_batch_s": first_s,
        "rows": (num_batches - 1) * spec.required_batch_size,
        "steady_s": steady_s,
    }


def bench_pipeline(spec: JobSpec, info: DatasetInfo, *, epochs: int) -> dict[str, float]:
    per_rank_batches = info.num_rows // 2 // spec.required_batch_size
    results = ray.get(
        [
            # Positional: Ray's typed `.remote` does not take keyword arguments.
            consume.remote(
                stream_request(spec).model_dump_json(), info.to_dict(), rank, epochs * per_rank_batches
            )
            for rank in (0, 1)
        ]
    )
    return {
        "rows_per_s": sum(r["rows"] for r in results) / max(r["steady_s"] for r in results),
        "first_batch_s": max(r["first_batch_s"] for r in results),
    }


def bench_pyarrow(spec: JobSpec, info: DatasetInfo, *, epochs: int) -> dict[str, float]:
    collate = recipe_for(spec).build_collate(info.row_shape, uri=info.uri)
    started = time.perf_counter()
    rows = 0
    first_s = None
    for _ in range(epochs):
        for path in info.files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=spec.batch_size, columns=["tokens"]):
                collate(pa.Table.from_batches([batch]))
                rows += batch.num_rows
                first_s = first_s or time.perf_counter() - started
    return {"rows_per_s": rows / (time.perf_counter() - started), "first_batch_s": first_s or 0.0}


def bench_mock(spec: JobSpec, info: DatasetInfo, *, batches: int) -> dict[str, float]:
    table = pq.ParquetFile(info.files[0]).read_row_group(0, columns=["tokens"]).slice(0, spec.batch_size)
    batch = recipe_for(spec).build_collate(info.row_shape, uri=info.uri)(table)
    started = time.perf_counter()
    for _ in range(batches):
        _ = batch["tokens"]
    return {
        "rows_per_s": batches * spec.required_batch_size / (time.perf_counter() - started),
        "first_batch_s": 0.0,
    }


class Collector:
    """Receives the trainers' telemetry (TelemetryBatch JSON) on 127.0.0.1."""

    def __init__(self) -> None:
        self.points: list[dict[str, Any]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                collector.points.extend(body["points"])
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/telemetry"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def bench_gpt(data: Path, storage: Path, *, steps: int, batch_size: int) -> dict[str, float]:
    from trainers.launch import run

    collector = Collector()
    spec = make_spec(data, batch_size=batch_size, max_steps=steps)
    request = LaunchRequest(
        job_id=1,
        attempt=1,
        spec=spec,
        storage_uri=str(storage),
        run_name="ingest-gpt",
        telemetry_url=collector.url,
    )
    run(request)
    collector.server.shutdown()
    steady = [p["values"] for p in collector.points if p["step"] > 1]
    wait = sum(v["data_wait_s"] for v in steady)
    step = sum(v["step_time_s"] for v in steady)
    first = [p["values"]["data_wait_s"] for p in collector.points if p["step"] == 1]
    return {
        "data_wait_share": wait / step,
        "step_time_s": statistics.median(v["step_time_s"] for v in steady),
        # Per worker: every point is one rank-step of batch_size samples.
        "samples_per_s": batch_size * len(steady) / step,
        "first_batch_s": max(first) if first else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rows-per-shard", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--gpt-steps", type=int, default=60)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="apiary-ingest-") as tmp:
        data = Path(tmp) / "tokens"
        table = token_table(num_rows=args.shards * args.rows_per_shard, seq_len=SEQ_LEN, vocab_size=VOCAB)
        write_shards(table, data.as_uri(), num_shards=args.shards)
        spec = make_spec(data, batch_size=args.batch_size)
        info = inspect_dataset(spec, recipe=recipe_for(spec))
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            pipeline = bench_pipeline(spec, info, epochs=args.epochs)
            pyarrow = bench_pyarrow(spec, info, epochs=args.epochs)
            mock = bench_mock(spec, info, batches=10_000)
            gpt = bench_gpt(data, Path(tmp) / "storage", steps=args.gpt_steps, batch_size=16)
        finally:
            ray.shutdown()

    rows = info.num_rows
    print(f"dataset: {rows} rows x {SEQ_LEN} tokens, {args.shards} parquet shards, batch {args.batch_size}")
    for name, result in (
        ("pipeline (2 workers)", pipeline),
        ("pyarrow (1 process)", pyarrow),
        ("mock", mock),
    ):
        print(
            f"{name:22s} {result['rows_per_s']:>12,.0f} rows/s   first batch {result['first_batch_s']:.2f} s"
        )
    print(f"pipeline / pyarrow = {pipeline['rows_per_s'] / pyarrow['rows_per_s']:.2f}x")
    print(f"pipeline / mock    = {pipeline['rows_per_s'] / mock['rows_per_s']:.4f}x")
    print(
        f"gpt job (2 workers, batch 16): data wait {100 * gpt['data_wait_share']:.1f}% of step time "
        f"(goal < 10%), median step {1000 * gpt['step_time_s']:.0f} ms, {gpt['samples_per_s']:.0f} samples/s "
        f"per worker, first batch wait {gpt['first_batch_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
