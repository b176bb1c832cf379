"""Checkpoint retention: which of a job's checkpoints to delete (`to_delete`, pure), and the pass that
deletes them (`Retention`, run by the leader's scheduler at each tick).

What is kept, per job (`checkpoint.keep_last`, `checkpoint.keep_best` of its spec):
- the newest `keep_last` checkpoints (by step);
- the best `keep_best.count` by a step metric (rank 0's value at the checkpoint's step; a checkpoint
  without the metric is never among the best);
- ALWAYS the job's `latest_checkpoint` (the one it resumes from), and everything newer than it. A
  job without a latest checkpoint deletes nothing.
Ended jobs keep their retention too: their latest checkpoint always stays.

Deletion is two-phase, so that the database and storage never disagree: a checkpoint is marked
`deleting` in one transaction (with the job row locked, like telemetry ingest), its folder is then
emptied in storage, and only then is it marked `deleted`. A failure leaves it `deleting`, with the
error and the attempt count, and a later pass tries again (after `retry_delay_s`). A folder already
gone counts as deleted. Only folders directly inside the job's own run folder are ever deleted:
a checkpoint reported anywhere else is left in place and says why.

Why a folder is emptied rather than removed: Ray Train lists every checkpoint of a run in its run
snapshot (`checkpoint_manager_snapshot.json` in the run folder), and when a job's next attempt starts
the same run again (a recovery, a preempted job readmitted) Ray Train 2.60 refuses a snapshot that
names a path that does not exist any more (`CheckpointManagerInitializationError`). So a deleted
checkpoint's folder keeps one small file, `TOMBSTONE`, that says what happened, and nothing else.

Cheap: a pass reads, in one indexed query, only the jobs that have checkpoints with work
(`checkpoints.retention_due`: new ones to judge, deletions to retry), and at most `max_jobs` of them.
Bounded: a pass stops trying deletions once it has spent `max_pass_s` on them (it tries one at least;
an unreachable object store makes each try last a second or more of the storage client's retries),
so that the scheduler's tick, which runs it, renews its lease in time; what is left stays due for the
next pass.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow.fs as pafs
from sqlalchemy.orm import Session

from service.contract.errors import one_line
from service.contract.spec import JobSpec, KeepBest
from service.contract.storage import resolve_uri
from service.store import repository
from service.store.db import Database
from service.store.models import Checkpoint, CheckpointState

logger = logging.getLogger(__name__)

TOMBSTONE = "_DELETED_BY_APIARY"


@dataclass(frozen=True, kw_only=True)
class StoredCheckpoint:
    """A checkpoint as the decision sees it."""

    id: int
    step: int
    uri: str
    metrics: Mapping[str, float]


def to_delete(
    checkpoints: Sequence[StoredCheckpoint],
    *,
    latest_uri: str | None,
    latest_step: int | None,
    keep_last: int,
    keep_best: KeepBest | None = None,
) -> list[StoredCheckpoint]:
    """The checkpoints to delete, oldest first: all but the newest `keep_last`, the best
    `keep_best.count`, the latest one (`latest_uri`) and any newer than it (`latest_step`)."""
    if latest_uri is None or latest_step is None:
        return []
    newest_first = sorted(checkpoints, key=lambda c: (c.step, c.id), reverse=True)
    kept = {c.id for c in newest_first[:keep_last]}
    kept |= {c.id for c in checkpoints if c.uri == latest_uri or c.step >= latest_step}
    if keep_best is not None:
        kept |= {c.id for c in best(checkpoints, keep_best)}
    return sorted((c for c in checkpoints if c.id not in kept), key=lambda c: (c.step, c.id))


def best(checkpoints: Sequence[StoredCheckpoint], keep_best: KeepBest) -> list[StoredCheckpoint]:
    """The best `keep_best.count` checkpoints by the metric (ties: the newer wins)."""
    scored = [c for c in checkpoints if _finite(c.metrics.get(keep_best.metric))]
    sign = 1.0 if keep_best.mode == "min" else -1.0
    scored.sort(key=lambda c: (sign * c.metrics[keep_best.metric], -c.step, -c.id))
    return scored[: keep_best.count]


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and value == value and abs(value) != float("inf")


@dataclass(frozen=True, kw_only=True)
class PassResult:
    deleted: int = 0
    failed: int = 0


@dataclass(kw_only=True)
class Retention:
    """One retention pass over the jobs with work, through `fenced` transactions (the scheduler's)."""

    db: Database
    fenced: Callable[[Session], bool]  # first call of every transaction: is this replica the leader?
    run_uri: Callable[[int], str]  # a job's run folder, where its trainers write its checkpoints
    s3_endpoint_url: str | None = None
    max_jobs: int = 100
    retry_base_s: float = 5.0
    retry_max_s: float = 600.0
    max_pass_s: float = 2.5

    def run_pass(self, now: datetime) -> PassResult:
        with self.db.session() as session:
            due = repository.retention_due(session, now=now, limit=self.max_jobs)
        deleted = failed = tried = 0
        deadline = time.monotonic() + self.max_pass_s
        for job_id in due:
            work = self._decide(job_id, now=now)
            if work is None:
                break  # no longer the leader
            for checkpoint_id, uri, attempts in work:
                if tried and time.monotonic() > deadline:
                    logger.info(
                        "retention pass out of time after %g s: the other deletions wait for the next pass",
                        self.max_pass_s,
                        extra={"action": "retention_pass_out_of_time"},
                    )
                    return PassResult(deleted=deleted, failed=failed)
                error = self._delete(uri, job_id=job_id, now=now)
                tried += 1
                with self.db.session() as session:
                    if not self.fenced(session):
                        return PassResult(deleted=deleted, failed=failed)
                    if error is None:
                        deleted += repository.checkpoint_deleted(session, checkpoint_id, now=now)
                        continue
                    failed += 1
                    retry_at = now + timedelta(seconds=self.retry_delay_s(attempts + 1))
                    repository.checkpoint_delete_failed(
                        session, checkpoint_id, error=error, retry_at=retry_at
                    )
                logger.warning(
                    "job %s: deleting checkpoint %s failed (attempt %d), retried from %s: %s",
                    job_id,
                    uri,
                    attempts + 1,
                    retry_at.isoformat(timespec="seconds"),
                    error,
                    extra={"action": "checkpoint_delete_failed", "job": {"id": job_id}, "uri": uri},
                )
        return PassResult(deleted=deleted, failed=failed)

    def retry_delay_s(self, attempts: int) -> float:
        """After `attempts` failed tries: 5 s, 10 s, 20 s, ... at most `retry_max_s`."""
        return min(self.retry_max_s, self.retry_base_s * 2 ** max(0, attempts - 1))

    def _decide(self, job_id: int, *, now: datetime) -> list[tuple[int, str, int]] | None:
        """Phase one, in one transaction: mark what the job's spec lets go `deleting`, settle the rest;
        returns the deletions to try now (id, uri, failed attempts so far); None if not the leader."""
        with self.db.session() as session:
            if not self.fenced(session):
                return None
            # Locked like telemetry ingest: the latest checkpoint cannot move under the decision.
            job = repository.get_job(session, job_id, for_update=True)
            spec = JobSpec.model_validate(job.spec).checkpoint
            rows = repository.live_checkpoints(session, job_id)
            if spec.keep_best is not None:
                for row in rows:
                    if spec.keep_best.metric not in row.metrics:  # its point came after it, or never
                        row.metrics = repository.step_metrics(session, job_id, row.step) or row.metrics
            kept = [row for row in rows if row.state is CheckpointState.KEPT]
            doomed = to_delete(
                _stored(kept),
                latest_uri=job.latest_checkpoint,
                latest_step=job.latest_checkpoint_step,
                keep_last=spec.keep_last,
                keep_best=spec.keep_best,
            )
            doomed_ids = {c.id for c in doomed}
            marked = []
            for row in kept:
                row.retention_due = False
                if row.id not in doomed_ids:
                    continue
                if not self._inside_run(row.uri, job_id):
                    run = self.run_uri(job_id)
                    row.last_error = f"not deleted: {row.uri} is not a folder of the job's run folder {run}"
                    logger.warning(
                        "job %s: checkpoint %s is outside the job's run folder; left in place",
                        job_id,
                        row.uri,
                        extra={"action": "checkpoint_not_deleted", "job": {"id": job_id}},
                    )
                    continue
                row.state = CheckpointState.DELETING
                row.retention_due = True
                marked.append(row)
            if marked:
                repository.record_event(
                    session,
                    job,
                    actor="retention",
                    reason=f"deleting {len(marked)} checkpoint(s) at step(s) "
                    f"{', '.join(str(row.step) for row in marked)}: beyond "
                    f"{_kept_text(spec.keep_last, spec.keep_best)}; "
                    f"resumes from step {job.latest_checkpoint_step}",
                )
            return [
                (row.id, row.uri, row.delete_attempts)
                for row in rows
                if row.state is CheckpointState.DELETING and _at_or_before(row.retry_at, now)
            ]

    def _inside_run(self, uri: str, job_id: int) -> bool:
        """Whether `uri` names a folder directly inside the job's run folder (and nothing above it)."""
        run = self.run_uri(job_id)
        if uri.startswith("s3://") != run.startswith("s3://"):
            return False
        try:
            folder, _ = resolve_uri(run, s3_endpoint_url=self.s3_endpoint_url)
            path, _ = resolve_uri(uri, s3_endpoint_url=self.s3_endpoint_url)
        except ValueError:
            return False
        return posixpath.dirname(path) == folder and posixpath.basename(path) not in ("", ".", "..")

    def _delete(self, uri: str, *, job_id: int, now: datetime) -> str | None:
        """Phase two: empty the checkpoint's folder but for its tombstone; the error, or None when done."""
        try:
            path, filesystem = resolve_uri(uri, s3_endpoint_url=self.s3_endpoint_url)
            tombstone = f"{path}/{TOMBSTONE}"
            with filesystem.open_output_stream(tombstone) as out:
                out.write(
                    f"Checkpoint deleted by Apiary's retention at {now.isoformat(timespec='seconds')} "
                    f"(job {job_id}). The folder stays because Ray Train's run snapshot names it.\n".encode()
                )
            for entry in filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
                if entry.path.rstrip("/") == tombstone:
                    continue
                if entry.type == pafs.FileType.Directory:
                    filesystem.delete_dir(entry.path)
                elif entry.type != pafs.FileType.NotFound:
                    filesystem.delete_file(entry.path)
        except (OSError, ValueError) as err:
            return one_line(err)
        logger.info(
            "job %s: deleted checkpoint %s",
            job_id,
            uri,
            extra={"action": "checkpoint_deleted", "job": {"id": job_id}, "uri": uri},
        )
        return None


def _kept_text(keep_last: int, keep_best: KeepBest | None) -> str:
    text = f"keep_last {keep_last}"
    if keep_best is not None:
        text += f" and keep_best {keep_best.count} by {keep_best.mode} {keep_best.metric}"
    return text


def _at_or_before(when: datetime | None, now: datetime) -> bool:
    if when is None:
        return True
    return (when if when.tzinfo is not None else when.replace(tzinfo=UTC)) <= now


def _stored(rows: Sequence[Checkpoint]) -> list[StoredCheckpoint]:
    return [StoredCheckpoint(id=r.id, step=r.step, uri=r.uri, metrics=r.metrics) for r in rows]
