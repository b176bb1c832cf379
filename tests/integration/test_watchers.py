"""Many watchers of one job share one poll of the database (api.feeds), over real HTTP on SQLite and
PostgreSQL: each gets every event and point in order exactly once, the polls do not grow with the
watchers, a watcher that leaves or lags does not stop the others, and a revoked token still ends a
stream."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from api import feeds
from api.feeds import JobCursor, JobFeeds
from tests.integration.conftest import Service
from tests.integration.test_auth import People, messages_until_closed
from tests.support.sse import Message, SseReader
from tests.support.wait import wait_until

SPEC_FIELDS = {"name": "watched", "num_workers": 2, "max_steps": 1000}
WATCHERS = 20


@pytest.fixture
def people(service: Service) -> People:
    return People(service)


def post_step(service: Service, job_id: int, step: int) -> None:
    points = [{"step": step, "rank": rank, "time": 1.0 + step, "values": {"loss": 1.0}} for rank in (0, 1)]
    response = service.report(job_id, {"attempt": 1, "segment": 0, "points": points})
    assert response.status_code == 202, response.text


def watch(service: Service, job_id: int, **headers: str) -> SseReader:
    return SseReader(str(service.http.base_url), f"/jobs/{job_id}/stream", headers=headers)


def alone_polls_settled(for_s: float) -> bool:
    polls = feeds.polls["alone"]
    time.sleep(for_s)
    return feeds.polls["alone"] == polls


def seen(messages: list[Message]) -> tuple[list[int], list[tuple[int, int]]]:
    """The event ids and the (step, rank) points a stream sent, in its order."""
    events = [m.data["id"] for m in messages if m.event == "event"]
    points = [(p["step"], p["rank"]) for m in messages if m.event == "metrics" for p in m.data["data"]]
    return events, points


def test_every_watcher_gets_every_event_once_in_order_from_one_poll(
    service: Service, spec: dict[str, Any]
) -> None:
    job_id = service.submit(spec)["id"]
    service.tick()  # admitted: its attempt reports
    post_step(service, job_id, 0)  # before anyone watches
    wait_until(lambda: feeds.watching == 0, timeout_s=10, what="earlier tests' watchers leaving")
    joining = feeds.polls["alone"]
    readers = [watch(service, job_id) for _ in range(WATCHERS)]
    try:
        for reader in readers:
            reader.until("metrics")  # caught up alone: step 0
        wait_until(lambda: feeds.watching == WATCHERS, timeout_s=10, what="every stream in the feed")
        # A stream that joins a feed that is past it catches up alone once more, just after it joined.
        wait_until(lambda: alone_polls_settled(0.3), timeout_s=10, what="the last catch-ups")
        # Nothing new while they joined: one poll each (the one that answers 404 for an unknown job),
        # and a catch-up only for those that came before the feed's first poll.
        assert feeds.polls["alone"] - joining <= WATCHERS + 5
        before = dict(feeds.polls)
        started = time.monotonic()
        for step in range(1, 6):  # while they watch, at about the feed's own pace
            post_step(service, job_id, step)
            time.sleep(feeds.POLL_S)
        assert service.http.post(f"/jobs/{job_id}/cancel").status_code == 200
        streamed = [reader.until("end") for reader in readers]
        elapsed_s = time.monotonic() - started

        first_events, first_points = seen(streamed[0])
        assert first_points == [(step, rank) for step in range(1, 6) for rank in (0, 1)]
        assert len(first_events) == 1 and streamed[0][-1].data == {"state": "cancelled"}
        for messages in streamed[1:]:
            assert seen(messages) == (first_events, first_points)  # the same, in the same order, once
        # One poll per POLL_S for all of them (a poll per stream would be WATCHERS times that), and
        # none alone: nobody lagged.
        feed_polls = feeds.polls["feed"] - before["feed"]
        assert 1 <= feed_polls <= elapsed_s / feeds.POLL_S + 3, (feed_polls, elapsed_s)
        assert feeds.polls["alone"] == before["alone"]
        wait_until(lambda: feeds.watching == 0, timeout_s=10, what="the feed ending with the job")
    finally:
        for reader in readers:
            reader.close()


def test_a_watcher_that_leaves_does_not_stop_the_others(service: Service, spec: dict[str, Any]) -> None:
    job_id = service.submit(spec)["id"]
    service.tick()
    wait_until(lambda: feeds.watching == 0, timeout_s=10, what="earlier tests' watchers leaving")
    readers = [watch(service, job_id) for _ in range(3)]
    try:
        for reader in readers:
            reader.until("event")  # queued, then admitted: caught up
            reader.until("event")
        wait_until(lambda: feeds.watching == 3, timeout_s=10, what="every stream in the feed")
        readers[0].close()
        wait_until(lambda: feeds.watching == 2, timeout_s=10, what="the first stream leaving")
        post_step(service, job_id, 7)
        for reader in readers[1:]:
            assert seen(reader.until("metrics"))[1] == [(7, 0), (7, 1)]
        for reader in readers[1:]:
            reader.close()
        wait_until(lambda: feeds.watching == 0, timeout_s=10, what="the last streams leaving")
        polls = feeds.polls["feed"]
        time.sleep(3 * feeds.POLL_S)
        assert feeds.polls["feed"] == polls  # the feed stopped with its last watcher
    finally:
        for reader in readers:
            reader.close()


def test_a_watcher_that_lags_is_dropped_from_the_feed_and_the_feed_goes_on(
    service: Service, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watcher whose queue is full is dropped, never waited for; it keeps what it holds (its stream
    then catches up alone from its cursor, as `test_every_watcher...` shows a joining one does)."""
    monkeypatch.setattr(feeds, "QUEUE_BATCHES", 2)
    monkeypatch.setattr(feeds, "POLL_S", 0.05)
    job_id = service.submit(spec)["id"]
    service.tick()

    async def scenario() -> None:
        job_feeds = JobFeeds(service.runtime.jobs)
        slow, _ = job_feeds.watch(job_id, JobCursor(), job=None)
        fast, _ = job_feeds.watch(job_id, JobCursor(), job=None)
        received = []
        for step in range(4):
            await asyncio.to_thread(post_step, service, job_id, step)
            while (batch := await fast.next(timeout_s=2)) is not None and not batch.metrics:
                pass  # the first poll: the job's events only
            assert batch is not None
            received.append(json.loads(batch.metrics[0][1])["step"])
        assert received == [0, 1, 2, 3]
        assert slow.lagged and slow not in slow.feed.watchers and fast in fast.feed.watchers
        held = [await slow.next(timeout_s=0.1) for _ in range(3)]
        assert [batch is not None for batch in held] == [True, True, False]  # its 2, then no more
        fast.leave()
        assert job_feeds.feeds == {}  # no watcher: no feed
        await asyncio.sleep(0.2)
        assert fast.feed.task.done()

    asyncio.run(scenario())


def test_streams_with_one_token_share_its_rechecks_and_revoking_it_ends_them_all(
    service: Service, people: People, spec: dict[str, Any]
) -> None:
    job = people.ada.post("/jobs", json=spec)
    assert job.status_code == 201, job.text
    created = people.root.post("/admin/tokens", json={"user": "carol"}).json()
    bearer = {"Authorization": f"Bearer {created['token']}"}
    readers = [watch(service, job.json()["id"], **bearer) for _ in range(5)]
    try:
        for reader in readers:
            assert [m.event for m in reader.until("event")] == ["state", "event"]  # queued
        reads = feeds.credential_reads
        service.tick()  # admitted: one batch for all five streams, one check of the token for it
        for reader in readers:
            assert reader.until("event")[-1].data["to_state"] == "admitted"
        assert feeds.credential_reads - reads <= 2
        assert people.root.delete(f"/admin/tokens/{created['id']}").status_code == 200
        for reader in readers:
            assert messages_until_closed(reader, within_s=7) == []
    finally:
        for reader in readers:
            reader.close()
