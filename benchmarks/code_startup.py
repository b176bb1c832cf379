"""What shipping the code with a job costs on the way to step 1: `--code DIR` against the same trainer
installed beside the service.

    .venv/bin/python benchmarks/code_startup.py                    # 3 of each, alternating
    .venv/bin/python benchmarks/code_startup.py --repeats 5 --pad-mib 20

One real `apiary serve` (SQLite, its own local Ray) and a short warm-up job, then `--repeats` times,
alternating:
- installed: `trainer: benchmarks.startup_trainer:train`, importable in the service's environment
  (APIARY_TRAINER_MODULES=benchmarks), as a team's package in the image would be;
- shipped: the same file copied into a fresh folder as `codebench/startup_trainer.py` and submitted with
  `code=` (`trainer: codebench.startup_trainer:train`), plus `--pad-mib` of incompressible bytes beside
  it (a vocabulary, a small asset). Each shipped job's folder differs (a nonce file), so each pays what
  a changed working copy pays: packing, the upload to the API and to Ray's GCS, the unpacking on the
  node.

Figure: seconds from the call that submits (packing and upload included for the shipped job) to the end
of rank 0's step 1 (its `step_1_done` start-up mark, `trainers.startup`), median of each side, their
difference and ratio; with the milestones (Ray accepted the submission, the driver's process started,
rank 0 entered the train function) to show where the difference goes. Ends with a markdown section for
`benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import command, machine  # noqa: E402
from overhead import Serve, event_offsets, startup_offsets  # noqa: E402

from api.client import ApiaryClient  # noqa: E402
from api.demo import token_table, write_shards  # noqa: E402
from service.contract.code import pack  # noqa: E402

INSTALLED = "benchmarks.startup_trainer:train"
SHIPPED = "codebench.startup_trainer:train"
NAN = float("nan")
MILESTONES = ("ray: job submitted", "driver: process_started", "rank 0: loop_entered", "rank 0: step_1_done")


def spec(dataset_uri: str, *, trainer: str, steps: int) -> dict[str, Any]:
    return {
        "name": "code-startup",
        "trainer": trainer,
        "num_workers": 2,
        "resources_per_worker": {"CPU": 1},
        "dataset": {"uri": dataset_uri},
        "max_steps": steps,
        "batch_size": 16,
        # A Ray Train function gets the spec's `config`: what it needs of the spec goes there too.
        "config": {"vocab_size": 256, "d_model": 64, "max_steps": steps, "batch_size": 16, "seed": 0},
    }


def code_folder(root: Path, *, pad_mib: float) -> Path:
    """A fresh folder with the benchmark's trainer as `codebench.startup_trainer` (and padding)."""
    folder = root / f"code-{secrets.token_hex(4)}"
    (folder / "codebench").mkdir(parents=True)
    (folder / "codebench" / "__init__.py").write_text("")
    shutil.copyfile(ROOT / "benchmarks" / "startup_trainer.py", folder / "codebench" / "startup_trainer.py")
    (folder / "nonce.txt").write_text(secrets.token_hex(16))
    if pad_mib > 0:
        (folder / "codebench" / "asset.bin").write_bytes(os.urandom(int(pad_mib * 2**20)))
    return folder


def measure(
    serve: Serve, client: ApiaryClient, job_spec: dict[str, Any], *, code: Path | None
) -> dict[str, Any]:
    submitted = time.time()
    job = client.submit(job_spec, code=code)
    uploaded = time.time() - submitted
    job = client.wait(job.id, timeout_s=900, poll_s=5)
    if job.state != "succeeded":
        raise RuntimeError(f"job {job.id} ended {job.state}: {job.message}")
    assert job.ray_submission_id is not None
    events = [event.model_dump(mode="json") for event in client.events(job.id)]
    phases = {
        **event_offsets(events, since=submitted),
        "ray: job submitted": serve.ray_job_submitted_at(job.ray_submission_id) - submitted,
        **startup_offsets(serve.ray_job_logs(job.ray_submission_id), since=submitted),
    }
    return {"submit_call_s": uploaded, "phases": phases}


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run["phases"][key] for run in runs if key in run["phases"]]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="jobs of each side")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--pad-mib", type=float, default=0.0, help="incompressible bytes shipped beside the code"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="apiary-code-startup-"))
    dataset = (workdir / "tokens").as_uri()
    write_shards(token_table(num_rows=2048, seq_len=33, vocab_size=256), dataset, num_shards=4)
    serve = Serve(workdir / "apiary", data_root=workdir)
    installed: list[dict[str, Any]] = []
    shipped: list[dict[str, Any]] = []
    package_bytes = 0
    try:
        serve.wait_healthy()
        with ApiaryClient(serve.url, timeout_s=120) as client:
            print("warm-up job ...", flush=True)
            measure(serve, client, spec(dataset, trainer=INSTALLED, steps=2), code=None)
            for repeat in range(args.repeats):
                print(f"installed trainer {repeat + 1}/{args.repeats} ...", flush=True)
                installed.append(
                    measure(serve, client, spec(dataset, trainer=INSTALLED, steps=args.steps), code=None)
                )
                print(f"shipped code {repeat + 1}/{args.repeats} ...", flush=True)
                folder = code_folder(workdir, pad_mib=args.pad_mib)
                package_bytes = len(pack(folder).data)
                shipped.append(
                    measure(serve, client, spec(dataset, trainer=SHIPPED, steps=args.steps), code=folder)
                )
                first = [run[-1]["phases"].get("rank 0: step_1_done", NAN) for run in (installed, shipped)]
                print(f"  step 1 at {first[0]:.1f} s installed, {first[1]:.1f} s shipped", flush=True)
    finally:
        serve.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    base, code = median(installed, "rank 0: step_1_done"), median(shipped, "rank 0: step_1_done")
    if base is None or code is None:
        raise RuntimeError("no step_1_done mark in the driver logs: see the jobs' logs")
    rows = [
        f"| {name} | {median(installed, name) or NAN:.1f} | {median(shipped, name) or NAN:.1f} |"
        for name in MILESTONES
    ]
    padding = f" + {args.pad_mib:g} MiB of padding" if args.pad_mib else ""
    upload = statistics.median(run["submit_call_s"] for run in shipped)
    print(
        "\n".join(
            [
                "",
                f"### Submission to step 1: `--code` vs an installed trainer ({args.repeats} jobs each)",
                "",
                f"Package {package_bytes / 2**20:.2f} MiB (the trainer{padding}); "
                f"packing and upload (the submit call) {upload:.2f} s median.",
                "",
                "| seconds from the submit call to | installed | --code |",
                "| --- | --- | --- |",
                *rows,
                "",
                f"Step 1: {code:.1f} s with `--code` against {base:.1f} s installed: +{code - base:.1f} s, "
                f"ratio {code / base:.2f}.",
                "",
                f"Machine: {machine()}. Command: `{command()}`.",
            ]
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
