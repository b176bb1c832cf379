from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from service.contract.errors import InvalidTransition, JobNotFound
from service.contract.protocol import MetricPoint
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import repository
from service.store.db import Database
from service.store.models import Job, JobEvent, Metric


@pytest.fixture
def db(database_url: str) -> Iterator[Database]:
    database = Database(database_url)
    database.upgrade()
    yield database
    database.dispose()


def spec(name: str = "job", priority: int = 0) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "priority": priority,
            "trainer": "mlp",
            "num_workers": 2,
            "dataset": {"uri": "file:///data"},
            "max_steps": 5,
            "batch_size": 2,
            "config": {"num_classes": 3},
        }
    )


def test_a_transition_writes_the_state_and_one_event_together(db: Database) -> None:
    with db.session() as session:
        job_id = repository.create_job(session, spec=spec(), owner="ada").id
    with db.session() as session:
        job = repository.get_job(session, job_id)
        repository.transition(session, job, JobState.ADMITTED, actor="scheduler", reason="fits", attempt=1)
    with db.session() as session:
        job = repository.get_job(session, job_id)
        assert (job.state, job.attempt) == (JobState.ADMITTED, 1)
        assert job.admitted_at is not None
        events = repository.list_events(session, job_id)
        assert [(e.from_state, e.to_state, e.actor) for e in events] == [
            (None, JobState.QUEUED, "api"),
            (JobState.QUEUED, JobState.ADMITTED, "scheduler"),
        ]


def test_a_refused_transition_writes_nothing(db: Database) -> None:
    with db.session() as session:
        job_id = repository.create_job(session, spec=spec(), owner="ada").id
    with pytest.raises(InvalidTransition), db.session() as session:
        repository.transition(
            session, repository.get_job(session, job_id), JobState.RUNNING, actor="x", reason="y"
        )
    with db.session() as session:
        assert repository.get_job(session, job_id).state is JobState.QUEUED
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 1


def test_a_failed_unit_of_work_rolls_back_the_job_and_its_event(db: Database) -> None:
    with pytest.raises(RuntimeError), db.session() as session:
        repository.create_job(session, spec=spec(), owner="ada")
        raise RuntimeError("crash before commit")
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 0


def test_waiting_decisions_are_stored_in_bulk_and_read_back_in_order(db: Database) -> None:
    with db.session() as session:
        ids = [repository.create_job(session, spec=spec(name), owner="ada").id for name in "abc"]
    with db.session() as session:
        repository.set_waiting(
            session,
            [
                {"id": ids[0], "queue_position": 2, "waiting_reason": "behind c", "eta_at": None},
                {"id": ids[2], "queue_position": 1, "waiting_reason": "needs 2 CPU", "eta_at": None},
            ],
        )
    with db.session() as session:
        assert [job.name for job in repository.waiting_line(session, "research", limit=10)] == ["c", "a", "b"]
        assert [job.id for job in repository.unfinished_jobs(session)] == ids
        assert repository.count_unfinished(session) == {("research", JobState.QUEUED): 3}


def test_one_holder_at_a_time_takes_the_lease_until_it_expires(db: Database) -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    with db.session() as session:
        assert repository.hold_lease(session, name="scheduler", holder="a", now=now, ttl_s=5)
    with db.session() as session:
        assert not repository.hold_lease(session, name="scheduler", holder="b", now=now, ttl_s=5)
        assert repository.owns_lease(session, name="scheduler", holder="a", now=now)
        assert not repository.owns_lease(session, name="scheduler", holder="b", now=now)
    with db.session() as session:  # a renews
        assert repository.hold_lease(
            session, name="scheduler", holder="a", now=now + timedelta(seconds=3), ttl_s=5
        )
    later = now + timedelta(seconds=9)  # a stopped renewing 6 s ago: its lease ran out
    with db.session() as session:
        assert not repository.owns_lease(session, name="scheduler", holder="a", now=later)
        assert repository.hold_lease(session, name="scheduler", holder="b", now=later, ttl_s=5)
    with db.session() as session:
        assert not repository.hold_lease(session, name="scheduler", holder="a", now=later, ttl_s=5)


def test_owner_usage_is_upserted(db: Database) -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    with db.session() as session:
        repository.set_owner_usage(session, {"ada": 10.0, "bob": 1.0}, now=now)
    with db.session() as session:
        repository.set_owner_usage(session, {"ada": 12.5}, now=now + timedelta(seconds=1))
    with db.session() as session:
        usage = repository.owner_usage(session)
    assert {owner: value for owner, (value, _) in usage.items()} == {"ada": 12.5, "bob": 1.0}


def test_list_filters_and_paginates(db: Database) -> None:
    with db.session() as session:
        ids = [repository.create_job(session, spec=spec(f"j{i}"), owner="ada").id for i in range(5)]
        repository.transition(
            session, repository.get_job(session, ids[0]), JobState.CANCELLED, actor="u", reason="r"
        )
    with db.session() as session:
        page, count = repository.list_jobs(session, states=[JobState.QUEUED], limit=2, offset=1)
        assert count == 4
        assert [job.id for job in page] == [ids[3], ids[2]]
        assert repository.list_jobs(session, queue="full-scale")[1] == 0


def test_metrics_are_idempotent_and_filterable(db: Database) -> None:
    with db.session() as session:
        job = repository.create_job(session, spec=spec(), owner="ada")
        points = [
            MetricPoint(step=s, rank=r, time=1.0, values={"loss": 1.0 / (s + 1)})
            for s in range(3)
            for r in (0, 1)
        ]
        repository.add_metrics(session, job, attempt=1, points=points)
    with db.session() as session:
        repository.add_metrics(session, job, attempt=1, points=points[:2])  # a re-posted batch
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(Metric)) == 6
        rank1 = repository.list_metrics(session, job.id, repository.MetricsQuery(rank=1, min_step=1))
        assert [(m.step, m.rank) for m in rank1] == [(1, 1), (2, 1)]
        assert rank1[0].values == {"loss": 0.5}


def test_only_a_newer_checkpoint_replaces_the_latest(db: Database) -> None:
    with db.session() as session:
        job = repository.create_job(session, spec=spec(), owner="ada")
        assert repository.set_checkpoint(session, job, step=10, uri="file:///c/10")
        assert not repository.set_checkpoint(session, job, step=5, uri="file:///c/5")
    with db.session() as session:
        assert repository.get_job(session, job.id).latest_checkpoint == "file:///c/10"


def test_unknown_job(db: Database) -> None:
    with pytest.raises(JobNotFound), db.session() as session:
        repository.get_job(session, 999)
