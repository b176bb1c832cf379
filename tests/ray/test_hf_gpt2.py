"""The Hugging Face GPT-2 recipe (`examples/hf_gpt2`), a model Apiary did not write, on a real local Ray:
a worker SIGKILLed and then a preemption, in one run, end with final parameters `torch.equal` to an
undisturbed run's, under DDP and under FSDP2 with bf16 (issue 24's test of a recipe on a model Apiary
did not write; FSDP's sharded restore after a group restart is checked bit for bit only here)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from service.contract.protocol import GROUP_STARTED, WORKER_FAILED
from tests.support.datasets import write_tokens
from tests.support.jobs import make_request, make_spec
from tests.support.telemetry import TelemetryServer
from tests.support.wait import wait_until
from trainers.checkpoint import build_model_from_checkpoint
from trainers.launch import RunResult, run

pytestmark = [pytest.mark.timeout(600)]

# The example's recipe, paced (tests.support.recipes.PacedGPT2LM): the disturbances land mid-run.
RECIPE = "tests.support.recipes:PacedGPT2LM"
CONFIG = {"vocab_size": 32, "n_embd": 32, "n_layer": 2, "n_head": 4, "dropout": 0.1, "lr": 3e-3}
MAX_STEPS = 120
EVERY = 10


def request(data: Path, storage: Path, *, strategy: str, precision: str, telemetry_url: str | None) -> Any:
    spec = make_spec(
        trainer=RECIPE,
        name=f"hf-gpt2-{strategy}",
        dataset=data,
        config=CONFIG,
        max_steps=MAX_STEPS,
        batch_size=8,
        strategy=strategy,
        precision=precision,
        max_failures=1,
        checkpoint={"every_steps": EVERY},
    )
    return make_request(spec, storage=storage, run_name="hf-gpt2", telemetry_url=telemetry_url)


def final_parameters(result: RunResult) -> dict[str, torch.Tensor]:
    assert result.step == MAX_STEPS and result.checkpoint_path is not None
    return build_model_from_checkpoint(result.checkpoint_path).state_dict()


def latest_status(server: TelemetryServer, rank: int, *, since_batch: int = 0) -> dict[str, Any] | None:
    """What `rank` last reported of itself (its step, its pid) in the posts from `since_batch` on."""
    with server.lock:
        posts = server.batches[since_batch:]
    statuses = [post["status"] for post in posts if post.get("status") and post["status"]["rank"] == rank]
    return statuses[-1] if statuses else None


def rank_step(server: TelemetryServer, rank: int, *, since_batch: int = 0) -> int:
    status = latest_status(server, rank, since_batch=since_batch)
    return status["step"] if status is not None else 0


def steps_of_restarted_group(server: TelemetryServer) -> int:
    """The steps rank 0 of the second worker group took since it started (-1 before it started); a
    group's posts carry its `segment`."""
    with server.lock:
        posts = list(server.batches)
    starts = [
        (post["segment"], event)
        for post in posts
        for event in post["events"]
        if event["kind"] == GROUP_STARTED
    ]
    if len(starts) < 2:
        return -1
    segment, started = starts[-1]
    steps = [
        post["status"]["step"]
        for post in posts
        if post["segment"] == segment and post.get("status") and post["status"]["rank"] == 0
    ]
    return max(steps, default=started["step"]) - started["step"]


@pytest.mark.parametrize(("strategy", "precision"), [("ddp", "fp32"), ("fsdp", "bf16")])
def test_a_killed_worker_and_a_preemption_end_as_the_undisturbed_run(
    ray_cluster: str, tmp_path: Path, telemetry_server: TelemetryServer, strategy: str, precision: str
) -> None:
    data = write_tokens(tmp_path / "tokens", rows=256, seq_len=17, vocab_size=32, shards=2)
    whole = run(request(data, tmp_path / "whole", strategy=strategy, precision=precision, telemetry_url=None))
    reference = final_parameters(whole)

    disturbed = request(
        data,
        tmp_path / "disturbed",
        strategy=strategy,
        precision=precision,
        telemetry_url=telemetry_server.url,
    )
    outcome: dict[str, Any] = {}

    def first_run() -> None:
        try:
            outcome["result"] = run(disturbed)
        except BaseException as err:
            outcome["error"] = err

    thread = threading.Thread(target=first_run)
    thread.start()
    # 1. Past the first checkpoint, SIGKILL rank 1's worker (the pid it reports): Ray Train restarts the
    # group from the checkpoint.
    wait_until(lambda: rank_step(telemetry_server, 1) > EVERY + 2, timeout_s=240, what="rank 1 past step 12")
    status = latest_status(telemetry_server, 1)
    assert status is not None
    os.kill(status["pid"], signal.SIGKILL)

    # 2. Once the new group has taken a few steps, the control plane asks the job to stop (preempted):
    # the ranks checkpoint at their next common step and the run returns.
    wait_until(
        lambda: steps_of_restarted_group(telemetry_server) > 3, timeout_s=240, what="a restarted group"
    )
    telemetry_server.stop = True
    thread.join(timeout=300)
    assert "error" not in outcome, outcome
    stopped = outcome["result"]
    assert EVERY < stopped.step < MAX_STEPS, stopped
    assert [e["kind"] for e in telemetry_server.events()].count(WORKER_FAILED) == 1
    # 3. Admitted again: the same run resumes from the preemption's checkpoint, to the end.
    telemetry_server.stop = False
    resumed = run(disturbed)

    final = final_parameters(resumed)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[name], tensor) for name, tensor in reference.items())
