"""The job state machine: which transitions exist, and who may make them.

States (lowercase on the wire):

    queued ──admit──▶ admitted ──Ray job running──▶ running ──▶ succeeded | failed
      ▲                                                 │
      │                          preempt or max runtime │
      │                                                 ▼
      └────────── checkpointed and stopped ───────── preempting ──▶ succeeded | failed

    cancel: from queued, admitted, running or preempting ──▶ cancelled

`admitted` means the scheduler reserved the gang's resources and submitted the
Ray job; `running` means Ray reports the driver running. A failed submission
goes `admitted → failed`; a submission that Ray never received (the
service died between admitting and submitting) goes `admitted → queued`.
`preempting` means the job was told to checkpoint and stop (`jobs.stop_requested`
says why: the policy or a user preempted it, or it ran out of `max_runtime_s`);
it still holds its gang. Once its Ray job has ended it goes back to `queued`
(preempted: it keeps its place and resumes from that checkpoint), to `failed`
(out of runtime), or to `succeeded` (it reached `max_steps` first).

Invariants:
- Only the service changes state, and only through `repository.transition`,
  which writes the new state and one `job_events` row in the same transaction.
- Terminal states (succeeded, failed, cancelled) are final.

This module needs nothing beyond the standard library: the ORM (`service.models`) and the SDK
(`api.client`) both read the states from here.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    PREEMPTING = "preempting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class StopReason(StrEnum):
    """Why a job was told to checkpoint and stop (`jobs.stop_requested`, state `preempting`)."""

    PREEMPTED = "preempted"  # by the policy, for another job
    USER = "user"  # POST /jobs/{id}/preempt: back to the queue like a preemption
    MAX_RUNTIME = "max_runtime"  # it ran out of max_runtime_s: failed once stopped


ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED}),
    # admitted -> queued: the submission never reached Ray (e.g. the service died in between).
    JobState.ADMITTED: frozenset(
        {JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTING}
    ),
    JobState.PREEMPTING: frozenset(
        {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

#: States whose gang holds cluster resources.
ACTIVE_STATES = frozenset({JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTING})


def can_transition(current: JobState, target: JobState) -> bool:
    return target in ALLOWED[current]
