"""The job state machine: which transitions exist, and who may make them.

States (lowercase on the wire):

    queued ──admit──▶ admitted ──Ray job running──▶ running ──▶ succeeded | failed
      ▲                                                 │
      │                          preempt or max runtime │
      │                                                 ▼
      └────────── checkpointed and stopped ───────── preempting ──▶ succeeded | failed

                    driver or Ray job lost                      Ray job running
    admitted | running ─────────────────────▶ recovering ──────────────────▶ running
                                                  │ not started in time ──▶ queued
                                                  └ failure budget spent ──▶ failed

    cancel: from queued, admitted, running, preempting or recovering ──▶ cancelled

`admitted` means the scheduler reserved the gang's resources and submitted the
Ray job; `running` means Ray reports the driver running. A failed submission
goes `admitted → failed`; a submission that Ray never received (the
service died between admitting and submitting) goes `admitted → queued`.
`preempting` means the job was told to checkpoint and stop (`jobs.stop_requested`
says why: the policy or a user preempted it, or it ran out of `max_runtime_s`);
it still holds its gang. Once its Ray job has ended it goes back to `queued`
(preempted, the service is stopping, a node of its gang drains, or its gang lost a node and no longer fits:
it keeps its place and resumes from that checkpoint), to `failed` (out of
runtime), or to `succeeded` (it reached `max_steps` first, or it was stopped early on a loss plateau).
`recovering` means the job's Ray job was lost to something that is not the job's
own fault (its driver died, the cluster was restarted and forgot it): the
scheduler resubmitted it as a new attempt that resumes from the latest
checkpoint, and it holds its gang meanwhile. Each recovery counts against the
spec's `max_failures`, as do worker-group restarts inside Ray Train (`jobs.failures`);
once the budget is spent the job fails. A job failed by its own code (an
exception in the trainer, a bad dataset) fails at once and is not recovered.

Invariants:
- Only the service changes state, and only through `repository.transition`,
  which writes the new state and one `job_events` row in the same transaction.
- Terminal states (succeeded, failed, cancelled) are final.

This module needs nothing beyond the standard library: the ORM (`service.store.models`) and the SDK
(`api.client`) both read the states from here.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    PREEMPTING = "preempting"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # A sweep's trial stopped early (with a checkpoint) because it lost at a rung (service.sweeps);
    # `POST /jobs/{id}/resume` queues it again from that checkpoint.
    PRUNED = "pruned"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED})


class StopReason(StrEnum):
    """Why a job was told to checkpoint and stop (`jobs.stop_requested`, state `preempting`)."""

    PREEMPTED = "preempted"  # by the policy, for another job
    USER = "user"  # POST /jobs/{id}/preempt: back to the queue like a preemption
    MAX_RUNTIME = "max_runtime"  # it ran out of max_runtime_s: failed once stopped
    SHUTDOWN = "shutdown"  # the service that owns the local Ray is stopping: requeued, not counted
    # Its gang no longer fits the cluster's alive nodes (a node left): stopped at once (its group is
    # broken, no checkpoint can be taken), requeued, not counted; it resumes when capacity is back.
    LOST_CAPACITY = "lost_capacity"
    # A node it has a rank on drains (a spot notice, service.drains): it checkpoints at its next step
    # boundary before the node's deadline, or is stopped before it; requeued, not counted.
    DRAINED = "drained"
    # A sweep's trial that lost at a rung (service.sweeps): pruned once stopped.
    PRUNED = "pruned"
    # Its `plateau.metric` stopped improving and `on_plateau` is stop (service.plateau): succeeded once
    # stopped (early stopping).
    PLATEAU = "plateau"


ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED}),
    # admitted -> queued: the submission never reached Ray (e.g. the service died in between).
    JobState.ADMITTED: frozenset(
        {
            JobState.QUEUED,
            JobState.RUNNING,
            JobState.RECOVERING,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTING, JobState.RECOVERING}
    ),
    # recovering -> recovering: the new attempt was lost too (another failure, within the budget).
    JobState.RECOVERING: frozenset(
        {
            JobState.RUNNING,
            JobState.RECOVERING,
            JobState.QUEUED,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.PREEMPTING: frozenset(
        {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    # resumed by hand (`apiary resume`): back in its queue, from its checkpoint.
    JobState.PRUNED: frozenset({JobState.QUEUED}),
}

#: States whose gang holds cluster resources.
ACTIVE_STATES = frozenset({JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTING, JobState.RECOVERING})


def can_transition(current: JobState, target: JobState) -> bool:
    return target in ALLOWED[current]


class CheckpointState(StrEnum):
    """Where a checkpoint is in its retention (service.scheduling.retention): deletion is two-phase, so a
    folder
    is only ever removed from storage while its row says `deleting`."""

    KEPT = "kept"
    DELETING = "deleting"  # decided; the folder may be partly gone; retried until it is
    DELETED = "deleted"
