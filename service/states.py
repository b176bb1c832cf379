"""The job state machine: which transitions exist, and who may make them.

States (lowercase on the wire):

    queued ──admit──▶ admitted ──ray job started──▶ running ──▶ succeeded | failed
       │                 │                            │
       └── cancel ───────┴────────── cancel ──────────┴──▶ cancelled

`admitted` means the scheduler reserved the gang's resources and submitted the
Ray job; `running` means Ray reports the driver running. A failed submission
goes `admitted → failed`; a submission that Ray never received (the
service died between admitting and submitting) goes `admitted → queued`.

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
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED}),
    # admitted -> queued: the submission never reached Ray (e.g. the service died in between).
    JobState.ADMITTED: frozenset(
        {JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

#: States whose gang holds cluster resources.
ACTIVE_STATES = frozenset({JobState.ADMITTED, JobState.RUNNING})


def can_transition(current: JobState, target: JobState) -> bool:
    return target in ALLOWED[current]
