"""A job's logs: the output of its Ray job, one per attempt.

A Ray job's log is its driver's output, and Ray forwards every worker's stdout and stderr to the
driver (prefixed `(RayTrainWorker pid=..., ip=...)`), so one log holds the driver and all ranks. The
job row holds only the current attempt's submission id; an earlier attempt's (a job resubmitted
after a recovery, or preempted and admitted again) is found on the cluster by its prefix
(`submission_prefix`). A cluster that was restarted since has forgotten its jobs and their logs.

Following a log polls Ray's job log (Ray returns it whole) and sends what is new, until the Ray job
ends: the status is read before the log, so the last read after a final status holds everything.

Terminal escape sequences (colours, cursor moves: Ray's and the libraries' progress output) are
stripped unless `raw`: a web page and a file show them as garbage. A sequence that a followed chunk
cuts in two is held back until the rest arrives (`AnsiStripper`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

from service.cluster import ClusterBackend, RayJobStatus, submission_prefix
from service.contract.errors import ClusterUnavailable, JobNotStarted, LogsNotFound, one_line
from service.store import repository
from service.store.db import Database

LIVE_STATUSES = (RayJobStatus.PENDING, RayJobStatus.RUNNING)

# ECMA-48 escape sequences: CSI (ESC [ parameters, intermediates, a final byte), OSC (ESC ] ... ended by
# BEL or ESC \\), character set choices (ESC, intermediates in space-/, a final byte: ESC ( B), and the
# two-byte ones (ESC and one byte in @-Z, \\, ^, _).
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[ -/]+[0-~]|[@-Z\\^_])")
# The start of a sequence that the text ends in the middle of.
_ANSI_CUT = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[ -/]*)?$")


def strip_ansi(text: str) -> str:
    """`text` without its terminal escape sequences."""
    return _ANSI.sub("", text)


class AnsiStripper:
    """`strip_ansi` for a text that arrives in chunks: a sequence cut at a chunk's end waits for the next."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, chunk: str) -> str:
        text = self._held + chunk
        cut = _ANSI_CUT.search(text)
        self._held = text[cut.start() :] if cut is not None else ""
        return strip_ansi(text[: cut.start()] if cut is not None else text)


@dataclass(frozen=True, kw_only=True)
class LogSource:
    """The Ray job that holds the log of one attempt of a job."""

    job_id: int
    attempt: int
    submission_id: str


def find_source(db: Database, backend: ClusterBackend, job_id: int, *, attempt: int | None) -> LogSource:
    """The Ray job of `attempt` (default: the latest) of a job; JobNotFound, JobNotStarted, or
    LogsNotFound (no such attempt, or Ray has forgotten it)."""
    with db.session() as session:
        job = repository.get_job(session, job_id)
        latest, current_submission, state = job.attempt, job.ray_submission_id, job.state.value
    if latest == 0:
        raise JobNotStarted(f"job {job_id} has not started yet (it is {state}): there are no logs")
    attempt = latest if attempt is None else attempt
    if not 1 <= attempt <= latest:
        raise LogsNotFound(
            f"job {job_id} has attempts 1 to {latest}: there is no attempt {attempt}", field="attempt"
        )
    if attempt == latest and current_submission is not None:
        return LogSource(job_id=job_id, attempt=attempt, submission_id=current_submission)
    found = backend.submissions(submission_prefix(job_id, attempt))
    if not found:
        raise LogsNotFound(
            f"Ray has no logs of attempt {attempt} of job {job_id} (its cluster was restarted since, "
            "or the attempt never reached Ray)"
        )
    return LogSource(job_id=job_id, attempt=attempt, submission_id=found[-1])


def read(backend: ClusterBackend, source: LogSource, *, tail: int | None = None, raw: bool = False) -> str:
    """The whole log of `source` so far (its last `tail` lines if given); escape sequences stripped
    unless `raw`."""
    if backend.job_info(source.submission_id).status is RayJobStatus.MISSING:
        raise LogsNotFound(
            f"Ray does not know attempt {source.attempt} of job {source.job_id} (yet, or any more): no logs"
        )
    text = last_lines(backend.job_logs(source.submission_id), tail)
    return text if raw else strip_ansi(text)


def follow(
    backend: ClusterBackend,
    source: LogSource,
    *,
    tail: int | None = None,
    poll_s: float = 1.0,
    raw: bool = False,
) -> Iterator[str]:
    """The log as it grows, in chunks (the first: the log so far, or its last `tail` lines), until
    the Ray job ends. Check `read()` first: this generator cannot raise an HTTP error once started,
    so a cluster lost mid-way ends it with a line that says so."""
    sent = 0
    first = True
    stripper = None if raw else AnsiStripper()
    while True:
        try:
            status = backend.job_info(source.submission_id).status
            text = backend.job_logs(source.submission_id)
        except ClusterUnavailable as err:
            yield f"\n[apiary] stopped following: {one_line(err.message)}\n"
            return
        if len(text) < sent:  # not the log we were sending (Ray lost it): start over
            sent = 0
        chunk = last_lines(text, tail) if first else text[sent:]
        first, sent = False, len(text)
        if stripper is not None:
            chunk = stripper.feed(chunk)
        if chunk:
            yield chunk
        if status not in LIVE_STATUSES:
            return
        time.sleep(poll_s)


def last_lines(text: str, count: int | None) -> str:
    """The last `count` lines of `text` (all of it for None), ending as `text` ends."""
    if count is None:
        return text
    if count <= 0:
        return ""
    lines = text.splitlines(keepends=True)
    return "".join(lines[-count:])
