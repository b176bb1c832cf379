"""The `apiary` commands that use a server (api/cli_jobs.py), through typer's CliRunner against the real
app served over HTTP (SQLite, fake cluster): output, --json, and the exit codes 0, 1 and 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner, Result

from api.cli import app
from service.cluster import RayJobStatus, free_port
from tests.conftest import MigratedTemplates, migrated_sqlite
from tests.integration.conftest import Service
from tests.support.wait import wait_until


@pytest.fixture
def database_url(tmp_path: Path, migrated_templates: MigratedTemplates) -> str:
    """SQLite only: the CLI is under test here, not the database (tests/integration/test_api.py)."""
    return migrated_sqlite(tmp_path, migrated_templates)


# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "cli-test",
}


@pytest.fixture
def spec_file(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def apiary(service: Service, tmp_path: Path) -> Any:
    """Runs `apiary ARGS` against the service (no config file of this machine's): without a token, as
    its local user ada."""
    env = {
        "APIARY_URL": str(service.http.base_url),
        "APIARY_TOKEN": None,
        "APIARY_CONFIG": str(tmp_path / "no-config.toml"),
        "COLUMNS": "200",
    }

    def run(*args: str, **extra_env: str) -> Result:
        return CliRunner().invoke(app, list(args), env={**env, **extra_env})

    return run


def run_job(
    service: Service, job_id: int, *, outcome: RayJobStatus, delay_s: float = 0.5
) -> threading.Thread:
    """In the background: admit the job, run it (steps reported by rank 0), end it with `outcome`."""

    def admitted() -> bool:
        # The CLI under test submits the job at its own pace (slow on a loaded machine): tick until
        # the job exists and the scheduler has handed it to the (fake) cluster.
        service.tick()
        return any(launch.job_id == job_id for _, launch in service.backend.submitted)

    def advance() -> None:
        try:
            wait_until(admitted, timeout_s=120, interval_s=delay_s, what=f"job {job_id} being admitted")
        except AssertionError:
            # End the watch under test (it would otherwise wait for the test's own timeout).
            service.http.post(f"/jobs/{job_id}/cancel")
            raise
        submission_id = service.backend.submission_of(job_id)
        service.backend.statuses[submission_id] = RayJobStatus.RUNNING
        service.tick()
        for step in (5, 10):
            point = {
                "step": step,
                "rank": 0,
                "time": time.time(),
                "values": {"loss": 1 / step, "samples_per_s": 80},
            }
            service.report(job_id, {"attempt": 1, "points": [point]})
            time.sleep(delay_s)
        service.backend.statuses[submission_id] = outcome
        service.tick()

    thread = threading.Thread(target=advance)
    thread.start()
    return thread


def test_submit_then_list_show_and_queue(apiary: Any, spec_file: Path, service: Service) -> None:
    submitted = apiary("submit", str(spec_file))
    assert submitted.exit_code == 0, submitted.output
    assert "submitted job 1 (cli-test) to research: queued" in submitted.output
    as_json = apiary("submit", str(spec_file), "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["id"] == 2

    listed = apiary("jobs")
    assert listed.exit_code == 0 and "cli-test" in listed.output and "queued" in listed.output
    rows = json.loads(apiary("jobs", "--json").stdout)
    assert [job["id"] for job in rows["data"]] == [2, 1] and rows["count"] == 2
    assert apiary("cancel", "1").exit_code == 0
    assert [j["id"] for j in json.loads(apiary("jobs", "--json", "--state", "cancelled").stdout)["data"]] == [
        1
    ]
    assert json.loads(apiary("jobs", "--json", "--mine").stdout)["count"] == 2
    assert apiary("jobs", "--state", "sleeping").exit_code == 2

    shown = apiary("show", "2")
    assert shown.exit_code == 0 and "2 cli-test (owner ada)" in shown.output and "queued" in shown.output
    detail = json.loads(apiary("show", "2", "--json").stdout)
    assert detail["state"] == "queued" and detail["events"][0]["to_state"] == "queued"

    queue = apiary("queue")
    assert queue.exit_code == 0 and "research" in queue.output and "full-scale" in queue.output
    assert "cli-test" in queue.output
    queues = json.loads(apiary("queue", "--json").stdout)["data"]
    research = next(q for q in queues if q["name"] == "research")
    assert [job["id"] for job in research["jobs"]] == [2]

    # With a token the CLI is its user: bob reads everything, owns nothing, may not cancel ada's job.
    bob = service.token("bob")
    assert json.loads(apiary("jobs", "--json", APIARY_TOKEN=bob).stdout)["count"] == 2
    assert json.loads(apiary("jobs", "--json", "--mine", APIARY_TOKEN=bob).stdout)["count"] == 0
    refused = apiary("cancel", "2", APIARY_TOKEN=bob)
    assert refused.exit_code == 1 and "only its owner or an admin may cancel it" in refused.output
    anonymous = apiary("jobs")  # now that a token exists, every request needs one
    assert anonymous.exit_code == 1 and "apiary token create" in anonymous.output


def test_jobs_lists_without_loading_the_job_spec(
    service: Service, spec: dict[str, Any], tmp_path: Path
) -> None:
    """`apiary jobs` in a process of its own, as a user runs it: its table comes from summaries
    (api.client.JobSummary), so the job spec's models are never built (issue 26: start in < 0.3 s)."""
    service.http.post("/jobs", json=spec).raise_for_status()
    probe = (
        "import sys\nfrom api.cli import main\nsys.argv[:] = ['apiary', 'jobs']\ntry:\n    main()\n"
        "finally:\n    print([m for m in ('service.contract.spec', 'api.schemas') if m in sys.modules], "
        "file=sys.stderr)"
    )
    env = {**os.environ, "APIARY_URL": str(service.http.base_url), "COLUMNS": "200"}
    env.update(APIARY_CONFIG=str(tmp_path / "no-config.toml"), APIARY_TOKEN="")
    root = Path(__file__).resolve().parents[2]
    listed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env, cwd=root
    )
    assert listed.returncode == 0, listed.stderr
    row = next(line.split() for line in listed.stdout.splitlines() if "cli-test" in line)
    assert row[:7] == ["1", "cli-test", "research", "queued", "ada", "0", "1"], listed.stdout
    assert row[7] == f"0/{spec['max_steps']}" and listed.stderr.strip() == "[]", listed.stderr


def test_refusals_exit_1_with_the_servers_message(apiary: Any, spec_file: Path) -> None:
    missing = apiary("show", "99")
    assert (missing.exit_code, missing.stderr.strip()) == (1, "error: job 99 does not exist")
    apiary("submit", str(spec_file))
    preempt = apiary("preempt", "1")
    assert preempt.exit_code == 1 and "only a running job can be preempted" in preempt.stderr
    assert apiary("cancel", "1", "--json").exit_code == 0
    again = apiary("cancel", "1")
    assert again.exit_code == 1 and "already cancelled" in again.stderr
    never = apiary("logs", "1")
    assert never.exit_code == 1 and "has not started yet" in never.stderr


def test_a_server_that_is_not_there_is_one_line_and_exit_1(apiary: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["jobs"], ["show", "1"], ["logs", "1", "-f"], ["queue", "--json"]):
        result = apiary(*args, "--url", url)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith(f"error: cannot reach Apiary at {url}")
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_a_bad_spec_names_the_field_and_its_line_and_exits_2(
    apiary: Any, spec: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**spec, "max_steps": 0, "batch_size": "many"}, sort_keys=False))
    lines = path.read_text().splitlines()
    result = apiary("submit", str(path))
    assert result.exit_code == 2
    assert (
        f"{path}:{lines.index('max_steps: 0') + 1}: max_steps: Input should be greater than" in result.stderr
    )
    assert f"{path}:{lines.index('batch_size: many') + 1}: batch_size:" in result.stderr

    # Refused by the service (the schema is fine): the field it names, on its line.
    path.write_text(yaml.safe_dump({**spec, "dataset": {"uri": "file:///no/such/folder"}}, sort_keys=False))
    uri_line = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if "uri:" in line)
    refused = apiary("submit", str(path))
    assert refused.exit_code == 2 and refused.stderr.startswith(f"error: {path}:{uri_line}: dataset.uri: ")

    path.write_text("name: x\nmax_steps: [1,\n")
    broken = apiary("submit", str(path))
    assert broken.exit_code == 2 and f"{path}:3: not valid YAML" in broken.stderr
    assert apiary("submit", str(tmp_path / "missing.yaml")).exit_code == 2
    assert "Traceback" not in result.output + refused.output + broken.output


def test_watch_exits_with_the_jobs_outcome(apiary: Any, spec_file: Path, service: Service) -> None:
    first = json.loads(apiary("submit", str(spec_file), "--json").stdout)["id"]
    runner = run_job(service, first, outcome=RayJobStatus.SUCCEEDED)
    watched = apiary("watch", str(first), "--interval", "0.1")
    runner.join()
    assert watched.exit_code == 0, watched.output
    assert (
        "step 10/20" in watched.output
        and "loss 0.1000" in watched.output
        and "80 samples/s" in watched.output
    )
    assert f"job {first} succeeded" in watched.output

    second = json.loads(apiary("submit", str(spec_file), "--json").stdout)["id"]
    runner = run_job(service, second, outcome=RayJobStatus.FAILED)
    failed = apiary("watch", str(second), "--interval", "0.1")
    runner.join()
    assert failed.exit_code == 1 and f"job {second} failed" in failed.output


def test_submit_watch_and_logs(apiary: Any, spec_file: Path, service: Service) -> None:
    runner = run_job(service, 1, outcome=RayJobStatus.SUCCEEDED, delay_s=1.0)
    submitted = apiary("submit", str(spec_file), "--watch")
    runner.join()
    assert submitted.exit_code == 0 and "job 1 succeeded" in submitted.output

    service.backend.logs[service.backend.submission_of(1)] = "driver\n(RayTrainWorker pid=3) rank 0 says hi\n"
    logs = apiary("logs", "1")
    assert (logs.exit_code, logs.stdout) == (0, "driver\n(RayTrainWorker pid=3) rank 0 says hi\n")
    assert apiary("logs", "1", "--tail", "1").stdout == "(RayTrainWorker pid=3) rank 0 says hi\n"
    assert apiary("logs", "1", "-f").stdout == logs.stdout  # the Ray job has ended: so does -f
    assert json.loads(apiary("logs", "1", "--json").stdout)["text"] == logs.stdout
    assert apiary("logs", "1", "--attempt", "2").exit_code == 1

    service.backend.logs[service.backend.submission_of(1)] = "\x1b[1mbold\x1b[0m line\n"
    assert apiary("logs", "1").stdout == "bold line\n"
    assert apiary("logs", "1", "--raw").stdout == "\x1b[1mbold\x1b[0m line\n"


def test_the_config_file_gives_the_url_and_the_token(apiary: Any, service: Service, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'url = "{service.http.base_url}"\ntoken = "{service.token("carol")}"\n')
    result = apiary("jobs", "--json", APIARY_URL="", APIARY_CONFIG=str(config))
    assert result.exit_code == 0 and json.loads(result.stdout)["count"] == 0
    refused = apiary("jobs", "--json")  # no token, now that one exists
    assert refused.exit_code == 1 and "Send an API token" in refused.output


def test_submit_with_code_ships_the_folder_and_a_bad_folder_exits_2(
    apiary: Any, spec_file: Path, service: Service, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    (code / "labcode").mkdir(parents=True)
    (code / "labcode" / "__init__.py").write_text("")
    (code / "labcode" / "train.py").write_text("def train(config):\n    pass\n")
    spec = yaml.safe_load(spec_file.read_text())
    own = {"name": "own-code", "trainer": "labcode.train:train", "num_workers": 1, "dataset": spec["dataset"]}
    spec_file.write_text(yaml.safe_dump(own))
    shipped = apiary("submit", str(spec_file), "--code", str(code), "--json")
    assert shipped.exit_code == 0, shipped.output
    assert json.loads(shipped.stdout)["spec"]["code"].startswith("sha256:")
    # Over the limit: refused before anything is sent (a sparse file: its size, not its bytes).
    with (code / "weights.bin").open("wb") as weights:
        weights.truncate(101 * 2**20)
    too_large = apiary("submit", str(spec_file), "--code", str(code))
    assert too_large.exit_code == 2, too_large.output
    assert "APIARY_CODE_MAX_BYTES" in too_large.stderr and "weights.bin" in too_large.stderr
    (code / "weights.bin").unlink()
    (code / "trainers").mkdir()
    (code / "trainers" / "__init__.py").write_text("")
    shadowing = apiary("submit", str(spec_file), "--code", str(code))
    assert shadowing.exit_code == 2 and "`trainers` package" in shadowing.stderr, shadowing.output
    assert "Traceback" not in too_large.output + shadowing.output
    assert service.count() == 1
