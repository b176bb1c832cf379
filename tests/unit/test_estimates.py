"""The estimates the policy and the simulator share (`service.scheduling.estimates`), and what the live
service and `apiary simulate --from-db` read of its ended jobs (`service.scheduling.history`, `.replay`)."""

from __future__ import annotations

import math
import statistics
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from service.contract.states import JobState
from service.scheduling.estimates import (
    PACE_AFTER_S,
    History,
    job_size,
    live_remaining_s,
    pace_error,
    pace_remaining_s,
    simulated_remaining_s,
    size_class,
)
from service.scheduling.history import LiveHistory, ended_job
from service.scheduling.replay import parse_since, replay
from service.scheduling.simulate import node_cluster
from tests.support.history import job_spec


def test_history_prefers_the_closest_kind_of_job_with_enough_of_them() -> None:
    history = History()
    assert history.estimate(owner="ada", name="bert", size=8) is None  # nothing finished yet
    for duration in (100, 200, 300):
        history.record(owner="bob", name="gpt", size=4, duration_s=duration)
    # Ada has no history: the size class 2-8 (bob's jobs) answers.
    assert history.estimate(owner="ada", name="bert", size=8) == 200
    for duration in (1000, 1100, 1200):
        history.record(owner="ada", name="resnet", size=2, duration_s=duration)
    # Ada's own jobs of that size class now answer, before the class as a whole.
    assert history.estimate(owner="ada", name="bert", size=8) == 1100
    for duration in (50, 60, 70):
        history.record(owner="ada", name="bert", size=8, duration_s=duration)
    assert history.estimate(owner="ada", name="bert", size=8) == 60  # the same name, closest of all
    assert history.estimate(owner="ada", name="bert", size=64) is None  # another size class
    # A declared max_runtime_s is a bound: the estimate never exceeds it, and stands in for none.
    assert history.estimate(owner="ada", name="bert", size=8, declared_s=55) == 55
    assert history.estimate(owner="ada", name="x", size=64, declared_s=900) == 900


def test_history_forgets_beyond_what_it_keeps() -> None:
    history = History(keep=3)
    for duration in (10, 10, 10, 500, 600, 700):
        history.record(owner="ada", name=None, size=1, duration_s=duration)
    assert history.estimate(owner="ada", name=None, size=1) == 600


def test_size_classes() -> None:
    classes = [size_class(g) for g in (1, 2, 8, 9, 32, 33, 640)]
    assert classes == ["1", "2-8", "2-8", "9-32", "9-32", "33+", "33+"]


def test_pace_needs_a_few_minutes_and_a_step_count() -> None:
    assert pace_remaining_s(ran_s=PACE_AFTER_S - 1, steps_done=10, max_steps=100) is None
    assert pace_remaining_s(ran_s=600, steps_done=100, max_steps=None) is None
    assert pace_remaining_s(ran_s=600, steps_done=0, max_steps=100) is None
    assert pace_remaining_s(ran_s=600, steps_done=100, max_steps=400) == pytest.approx(1800)
    assert pace_remaining_s(ran_s=600, steps_done=500, max_steps=400) == 0


def test_the_simulated_pace_errs_by_a_fixed_log_normal_factor_per_job() -> None:
    errors = [pace_error(job_id) for job_id in range(4000)]
    assert pace_error(7) == pace_error(7) and pace_error(7) != pace_error(8)
    logs = [math.log(e) for e in errors]
    assert abs(statistics.fmean(logs)) < 0.02 and statistics.stdev(logs) == pytest.approx(0.3, rel=0.05)
    truth = {"true_remaining_s": 1000.0, "error": 1.5}
    young = simulated_remaining_s(**truth, ran_s=60, expected_s=900, done_s=100)
    assert young == 800  # before PACE_AFTER_S: what was expected, less the work done
    assert simulated_remaining_s(**truth, ran_s=60, expected_s=None, done_s=0) is None
    assert simulated_remaining_s(**truth, ran_s=PACE_AFTER_S, expected_s=900, done_s=0) == 1500


# -- the estimates as the live service uses them ---------------------------------------------------


def test_a_running_job_trusts_its_pace_after_a_few_minutes_and_history_before() -> None:
    # Young: history's expected duration less what it ran (the early pace says little)...
    assert live_remaining_s(ran_s=10, pace_s=5000, expected_s=30) == 20
    assert live_remaining_s(ran_s=40, pace_s=5000, expected_s=30) == 0  # overdue: ends any moment
    # ...unless there is no history: then the early pace is better than nothing.
    assert live_remaining_s(ran_s=10, pace_s=5000, expected_s=None) == 5000
    assert live_remaining_s(ran_s=10, pace_s=None, expected_s=None) is None
    # After PACE_AFTER_S the measured pace wins over history.
    assert live_remaining_s(ran_s=PACE_AFTER_S, pace_s=5000, expected_s=30) == 5000
    assert live_remaining_s(ran_s=PACE_AFTER_S, pace_s=None, expected_s=900) == 900 - PACE_AFTER_S


def test_a_jobs_size_is_its_gpus_or_its_cpus_without_any() -> None:
    assert job_size({"CPU": 4, "GPU": 2}, 3) == 6
    assert job_size({"CPU": 4}, 3) == 12
    assert job_size({"CPU": 4, "GPU": 0}, 1) == 4


def _row(**fields: object) -> SimpleNamespace:
    values: dict[str, object] = {
        "id": 7,
        "name": "bert",
        "owner": "ada",
        "queue": "research",
        "priority": 0,
        "state": JobState.SUCCEEDED,
        "spec": job_spec(name="bert", num_workers=2, resources_per_worker={"CPU": 1, "GPU": 4}).model_dump(),
        "created_at": T0,
        "finished_at": None,
        "seconds_per_step": 2.0,
        "preemptions": 1,
    }
    return SimpleNamespace(**(values | fields))


T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_an_ended_job_ran_every_second_it_was_running_and_waited_every_second_it_was_queued() -> None:
    # Queued 60 s, admitted, running from 70 s to 1070 s, preempted (stopping 30 s), queued again
    # 200 s, admitted, running 500 s more: SQLite's times come back without their zone.
    changes = [
        (_at(60), JobState.ADMITTED),
        (_at(70), JobState.RUNNING),
        (_at(1070), JobState.PREEMPTING),
        (_at(1100), JobState.QUEUED),
        (_at(1300).replace(tzinfo=None), JobState.ADMITTED),
        (_at(1310), JobState.RUNNING),
        (_at(1810), JobState.SUCCEEDED),
    ]
    job = ended_job(_row(), changes)
    assert (job.ran_s, job.queued_s) == (1500, 260)
    assert job.first_admitted_at == T0.timestamp() + 60 and job.submitted_at == T0.timestamp()
    assert job.size == 8 and job.preemptions == 1


def test_the_live_history_estimates_from_the_jobs_it_recorded() -> None:
    live = LiveHistory()
    jobs = [
        ended_job(
            _row(id=i),
            [(_at(0), JobState.ADMITTED), (_at(1), JobState.RUNNING), (_at(31), JobState.SUCCEEDED)],
        )
        for i in range(3)
    ]
    version = live.version
    assert live.estimate(owner="ada", name="bert", size=8, declared_s=3600) == 3600  # no history yet
    live.record(jobs)
    assert live.version == version + 1
    assert live.estimate(owner="ada", name="bert", size=8, declared_s=3600) == 30  # not what it said before
    assert live.estimate(owner="bob", name="gpt", size=8, declared_s=3600) == 30  # the size class
    assert live.estimate(owner="bob", name="gpt", size=64, declared_s=3600) == 3600  # none of that size


def test_since_is_a_positive_span_with_a_unit() -> None:
    assert parse_since("14d") == 14 * 86400 and parse_since("12h") == 43200 and parse_since("1.5m") == 90
    assert parse_since("2w") == 14 * 86400
    for bad in ("", "14", "d", "-3d", "0h", "14x", "infd", "nand", "1e9w"):
        with pytest.raises(ValueError, match="--since must be"):
            parse_since(bad)


def test_a_replay_traces_what_ran_from_the_first_submission_and_observes_the_real_waits() -> None:
    every_steps = job_spec(name="a", checkpoint={"every_steps": 50}).model_dump()
    jobs = [
        ended_job(
            _row(id=1, spec=every_steps, preemptions=0),
            [(_at(10), JobState.ADMITTED), (_at(12), JobState.RUNNING), (_at(612), JobState.SUCCEEDED)],
        ),
        ended_job(
            _row(id=2, created_at=_at(100), queue="full-scale", preemptions=0),
            [(_at(400), JobState.ADMITTED), (_at(401), JobState.RUNNING), (_at(401.02), JobState.FAILED)],
        ),
        ended_job(
            _row(id=3, spec=job_spec(resources_per_worker={"memory": 1e9}).model_dump()),
            [(_at(0), JobState.ADMITTED), (_at(1), JobState.RUNNING), (_at(2), JobState.SUCCEEDED)],
        ),
    ]
    replayed = replay(jobs, cluster=node_cluster(1, {"CPU": 8, "GPU": 8}), busy_key="GPU")
    first, second = replayed.trace
    assert (first.submit_s, first.duration_s, first.checkpoint_every_s) == (0, 600, 100)  # 50 steps x 2 s
    assert (first.num_workers, first.cpu_per_worker, first.gpu_per_worker) == (2, 1, 0)
    assert (second.submit_s, second.duration_s, second.queue) == (100, 1, "full-scale")  # at least 1 s
    assert replayed.left_out == {"asks for neither CPU nor GPU": 1}
    real = replayed.observed
    assert (
        real.jobs == 2
        and real.queues["research"].wait.max == 10
        and real.queues["full-scale"].wait.max == 300
    )
    with pytest.raises(ValueError, match=r"job 1 \(bert\): a gang of 2 x \(GPU 4, CPU 1\) fits no node"):
        replay([ended_job(_row(id=1), [])], cluster=node_cluster(1, {"CPU": 8, "GPU": 2}), busy_key="GPU")
