"""The pure retention decision (service.scheduling.retention.to_delete): keep_last, keep_best min/max, and the
checkpoint a job resumes from, which is always kept with everything newer than it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from service.contract.spec import CheckpointSpec, KeepBest
from service.scheduling.retention import StoredCheckpoint, to_delete


def checkpoints(steps: Sequence[int], losses: dict[int, float] | None = None) -> list[StoredCheckpoint]:
    losses = losses or {}
    return [
        StoredCheckpoint(
            id=index + 1,
            step=step,
            uri=f"file:///ckpt/job-1/checkpoint_{step:08d}",
            metrics={"loss": losses[step]} if step in losses else {},
        )
        for index, step in enumerate(steps)
    ]


def deleted_steps(found: list[StoredCheckpoint], **kwargs: object) -> list[int]:
    latest = kwargs.pop("latest", max(c.step for c in found))
    return [
        c.step
        for c in to_delete(
            found,
            latest_uri=f"file:///ckpt/job-1/checkpoint_{latest:08d}",
            latest_step=latest,  # type: ignore[arg-type]
            **kwargs,  # type: ignore[arg-type]
        )
    ]


def test_keep_last_keeps_the_newest_steps_and_deletes_the_rest_oldest_first() -> None:
    found = checkpoints([50, 10, 40, 20, 30])  # reported out of order
    assert deleted_steps(found, keep_last=3) == [10, 20]
    assert deleted_steps(found, keep_last=1) == [10, 20, 30, 40]
    assert deleted_steps(found, keep_last=5) == []


def test_keep_best_keeps_the_lowest_or_highest_metric_besides_the_last() -> None:
    losses = {10: 0.5, 20: 0.1, 30: 0.9, 40: 0.3, 50: 0.7, 60: 0.8}
    found = checkpoints(sorted(losses), losses)
    best_min = KeepBest(metric="loss", mode="min", count=2)
    assert deleted_steps(found, keep_last=1, keep_best=best_min) == [10, 30, 50]  # keeps 20, 40 (+60)
    best_max = KeepBest(metric="loss", mode="max", count=1)
    assert deleted_steps(found, keep_last=1, keep_best=best_max) == [10, 20, 40, 50]  # keeps 30 (+60)


def test_a_checkpoint_without_the_metric_is_never_among_the_best() -> None:
    found = checkpoints([10, 20, 30, 40], {20: 0.4, 30: float("nan")})
    best = KeepBest(metric="loss", mode="min", count=2)
    assert deleted_steps(found, keep_last=1, keep_best=best) == [10, 30]


def test_the_latest_is_kept_even_when_newer_ones_are_reported_and_nothing_newer_is_deleted() -> None:
    # The job resumes from step 30; 40 and 50 were reported (a late post, an older attempt's
    # checkpoint stored in storage) but are newer: they stay, and so does the latest, though
    # keep_last 1 alone would keep only 50.
    found = checkpoints([10, 20, 30, 40, 50])
    assert deleted_steps(found, keep_last=1, latest=30) == [10, 20]


def test_the_latest_is_kept_when_it_is_not_among_the_last_by_step() -> None:
    # Odd order: the latest (step 20) has a smaller step than checkpoints reported at the same
    # or a later time under other names; it is still what the job resumes from.
    found = [
        StoredCheckpoint(id=1, step=5, uri="file:///ckpt/job-1/a", metrics={}),
        StoredCheckpoint(id=2, step=20, uri="file:///ckpt/job-1/latest", metrics={}),
        StoredCheckpoint(id=3, step=20, uri="file:///ckpt/job-1/b", metrics={}),
        StoredCheckpoint(id=4, step=10, uri="file:///ckpt/job-1/c", metrics={}),
    ]
    doomed = to_delete(found, latest_uri="file:///ckpt/job-1/latest", latest_step=20, keep_last=1)
    assert [c.uri for c in doomed] == ["file:///ckpt/job-1/a", "file:///ckpt/job-1/c"]


def test_a_job_without_a_latest_checkpoint_deletes_nothing() -> None:
    found = checkpoints([10, 20, 30, 40])
    assert to_delete(found, latest_uri=None, latest_step=None, keep_last=1) == []


@pytest.mark.parametrize(
    ("checkpoint", "field"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_best": {"metric": "loss", "mode": "lowest"}}, "keep_best.mode"),
        ({"keep_best": {"metric": "loss", "mode": "min", "count": 0}}, "keep_best.count"),
        ({"keep_best": {"mode": "min"}}, "keep_best.metric"),
        ({"keep_best": {"metric": "loss"}}, "keep_best.mode"),
        ({"keep_best": {"metric": "", "mode": "min"}}, "keep_best.metric"),
    ],
)
def test_bad_retention_settings_name_their_field(checkpoint: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CheckpointSpec.model_validate(checkpoint)
    assert [".".join(str(p) for p in e["loc"]) for e in info.value.errors()] == [field]


def test_retention_defaults() -> None:
    spec = CheckpointSpec()
    assert (spec.keep_last, spec.keep_best) == (3, None)
