from __future__ import annotations

import pytest

from service.contract.states import ALLOWED, TERMINAL_STATES, JobState, can_transition


def test_every_state_has_a_row() -> None:
    assert set(ALLOWED) == set(JobState)


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATES))
def test_terminal_states_are_final(terminal: JobState) -> None:
    """Final, but for a pruned sweep trial, which its owner may queue again (`apiary resume`)."""
    allowed = {target for target in JobState if can_transition(terminal, target)}
    assert allowed == ({JobState.QUEUED} if terminal is JobState.PRUNED else set())


def test_the_happy_path_and_cancel() -> None:
    assert can_transition(JobState.QUEUED, JobState.ADMITTED)
    assert can_transition(JobState.ADMITTED, JobState.RUNNING)
    assert can_transition(JobState.RUNNING, JobState.SUCCEEDED)
    assert can_transition(JobState.RUNNING, JobState.CANCELLED)
    assert not can_transition(JobState.QUEUED, JobState.RUNNING)
    assert not can_transition(JobState.RUNNING, JobState.QUEUED)
