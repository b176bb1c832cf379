"""What the service learns from its ended jobs, on SQLite and PostgreSQL: the queue's ETAs use history's
estimates (service.scheduling.history), and `apiary simulate --from-db` replays the jobs through another
queue configuration beside what really happened (service.scheduling.replay)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner, Result

from api.cli import app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store.db import Database
from tests.integration.conftest import Service
from tests.support.history import add_ended_job, job_spec

SPEC_FIELDS = {"name": "quick", "num_workers": 6}  # 6 workers + 1 data CPU: 7 of the node's 8 CPUs


def _ran(seconds: float, *, waited_s: float = 5) -> list[tuple[JobState, float]]:
    return [
        (JobState.ADMITTED, waited_s),
        (JobState.RUNNING, waited_s + 1),
        (JobState.SUCCEEDED, waited_s + 1 + seconds),
    ]


def _eta(service: Service, job_id: int) -> float:
    (research,) = [
        queue for queue in service.http.get("/queues").json()["data"] if queue["name"] == "research"
    ]
    (job,) = [job for job in research["jobs"] if job["id"] == job_id]
    return datetime.fromisoformat(job["eta_at"]).timestamp()


def test_a_30_second_job_shows_an_eta_from_its_history_not_an_hour_away(
    service: Service, spec: dict[str, Any]
) -> None:
    db = service.runtime.db
    assert db is not None
    past = datetime.now(UTC) - timedelta(hours=2)
    for i in range(3):  # three earlier runs of the same job took 30 s each
        add_ended_job(
            db,
            spec=JobSpec.model_validate(spec),
            owner="ada",
            submitted_at=past + timedelta(minutes=i),
            timeline=_ran(30),
        )
    running, head, behind = (service.submit(spec)["id"] for _ in range(3))
    now = datetime.now(UTC).timestamp()
    service.tick(now)
    assert service.job(running)["state"] == "admitted"
    # The head starts when the running job ends (30 s), the next one 30 s later: not at the research
    # queue's default max_runtime_s (1 h) each.
    assert now + 25 <= _eta(service, head) <= now + 60
    assert _eta(service, behind) - _eta(service, head) == pytest.approx(30, abs=1)
    assert service.job(behind)["spec"]["max_runtime_s"] == 3600


# -- apiary simulate --from-db --------------------------------------------------------------------


@pytest.fixture
def history(database_url: str) -> Iterator[Database]:
    """Three research jobs of ada (2 x 1 GPU) submitted a minute apart an hour ago that really waited
    0, 600 and 1200 s and ran 1000 s each, a full-scale job of 8 GPUs that waited 60 s, and a job
    submitted 30 days ago."""
    db = Database(database_url)
    research = job_spec(name="bert", resources_per_worker={"CPU": 1, "GPU": 1}, max_runtime_s=3000)
    ago = datetime.now(UTC) - timedelta(hours=1)
    for i in range(3):
        add_ended_job(
            db,
            spec=research,
            owner="ada",
            submitted_at=ago + timedelta(minutes=i),
            timeline=_ran(1000, waited_s=600 * i),
        )
    big = job_spec(name="gpt", queue="full-scale", num_workers=8, resources_per_worker={"CPU": 4, "GPU": 1})
    add_ended_job(db, spec=big, owner="bob", submitted_at=ago, timeline=_ran(2000, waited_s=60))
    add_ended_job(db, spec=research, owner="ada", submitted_at=ago - timedelta(days=30), timeline=_ran(10))
    yield db
    db.dispose()


def _apiary(database_url: str, tmp_path: Path, *args: str) -> Result:
    env = {"APIARY_DATABASE_URL": database_url, "APIARY_DATA_DIR": str(tmp_path / "data"), "COLUMNS": "200"}
    return CliRunner().invoke(app, ["simulate", *args], env=env)


def test_simulate_from_db_replays_the_window_beside_what_really_happened(
    history: Database, database_url: str, tmp_path: Path
) -> None:
    shown = _apiary(database_url, tmp_path, "--from-db", "--nodes", "2", "--node", "CPU=32,GPU=8")
    assert shown.exit_code == 0, shown.output
    assert "two-queue: 4 jobs on 2 x CPU=32,GPU=8" in shown.output
    assert "what really happened: 4 jobs" in shown.output
    # Really: research waited 0, 10 and 20 min (p50 10 min); simulated on an idle cluster: nothing.
    # Each table's first "research" row (at a narrow width the "research queued" row wraps, and its
    # first line reads "research" too; the console's width is fixed when the CLI is first imported).
    simulated, real = (
        next(
            row
            for row in ([cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines())
            if row and row[0] == "research"
        )
        for table in shown.output.split("what really happened")
    )
    assert simulated[1:3] == ["3", "0 s"] and real[1:3] == ["3", "10.0 min"], shown.output

    as_json = json.loads(_apiary(database_url, tmp_path, "--from-db", "--since", "2d", "--json").stdout)
    assert as_json["jobs"] == 4 and as_json["queues"]["research"]["wait_s"]["max"] == 0
    real = as_json["real"]
    assert real["queues"]["research"]["wait_s"] == {
        "p50": 600,
        "p95": 1200,
        "p99": 1200,
        "mean": 600,
        "max": 1200,
    }
    assert real["queues"]["full-scale"]["jobs"] == 1 and real["queues"]["full-scale"]["wait_s"]["max"] == 60
    assert real["size_classes"]["2-8"]["jobs"] == 4 and as_json["left_out"] == {}

    # Another configuration: research takes no job over 1 worker, so its three jobs are refused.
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"research": {"max_workers_per_job": 1}}))
    strict = json.loads(_apiary(database_url, tmp_path, "--from-db", "--queues", str(other), "--json").stdout)
    assert strict["refused"] == 3 and strict["queues"]["research"]["jobs"] == 0
    assert strict["real"]["queues"]["research"]["jobs"] == 3
    # A month back, the old job is in the window too.
    month = json.loads(_apiary(database_url, tmp_path, "--from-db", "--since", "31d", "--json").stdout)
    assert month["jobs"] == 5


def test_simulate_from_db_refuses_bad_input_with_exit_2(
    history: Database, database_url: str, tmp_path: Path
) -> None:
    for args, words in [
        (["--from-db", "--since", "14x"], "--since must be a positive duration"),
        (["--from-db", "--since", "1s"], "no job submitted in the last 1s has run and ended"),
        (
            ["--from-db", "--nodes", "1", "--node", "CPU=4,GPU=8"],
            "fits no node layout of the simulated cluster",
        ),
        (["--since", "2d"], "--since goes with --from-db"),
        (["trace.csv", "--from-db"], "not both"),
    ]:
        refused = _apiary(database_url, tmp_path, *args)
        assert refused.exit_code == 2 and words in refused.output, (args, refused.output)
