"""`pip install apiary` with no extra: a wheel of this checkout in a fresh venv holds the SDK and the
client commands, none of torch, Ray, FastAPI, SQLAlchemy or psycopg, and drives a running server (SQLite,
fake cluster) with that venv's `apiary` and `apiary.Client`. The server's and the cluster's commands
there name the extra to install and exit 2. The venv: tests/support/client_venv.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.cluster import RayJobStatus
from tests.conftest import MigratedTemplates, migrated_sqlite
from tests.integration.conftest import Service
from tests.integration.test_cli import run_job
from tests.support.client_venv import build_client_venv

# What a client install must not bring (the server's and the cluster's dependencies).
ABSENT = ("torch", "ray", "fastapi", "sqlalchemy", "psycopg", "alembic", "uvicorn", "pyarrow")

SPEC_FIELDS = {"name": "client-install"}


@pytest.fixture
def database_url(tmp_path: Path, migrated_templates: MigratedTemplates) -> str:
    """SQLite only: the client install is under test here, not the database."""
    return migrated_sqlite(tmp_path, migrated_templates)


@pytest.fixture(scope="module")
def client_venv() -> Iterator[Path]:
    """The client venv's `bin/`, in a folder of its own (pytest's basetemp of this module could be
    cleaned by other pytest runs while the module's tests use it)."""
    folder = Path(tempfile.mkdtemp(prefix="apiary-client-"))
    yield build_client_venv(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _run(
    bin_dir: Path, *args: str, env: dict[str, str], timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env},
        cwd=bin_dir.parent,  # not the checkout: only the venv's Apiary can be imported
    )


def test_the_client_install_has_no_server_or_cluster_dependency(client_venv: Path) -> None:
    probe = (
        "import importlib.util as u, apiary; "
        f"print([m for m in {ABSENT!r} if u.find_spec(m)], apiary.__file__, apiary.__version__)"
    )
    found = _run(client_venv, "python", "-c", probe, env={})
    assert found.returncode == 0, found.stderr
    absent, where, version = found.stdout.split()
    assert absent == "[]" and where.startswith(str(client_venv.parent)) and version == "0.1.0"


def test_the_client_drives_a_server(client_venv: Path, service: Service, spec: dict[str, Any]) -> None:
    home = client_venv.parent
    env = {
        "APIARY_URL": str(service.http.base_url),
        "APIARY_CONFIG": str(home / "none.toml"),
        "COLUMNS": "200",
    }
    spec_file = home / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))

    assert _run(client_venv, "apiary", "--help", env=env).returncode == 0
    submitted = _run(client_venv, "apiary", "submit", str(spec_file), "--json", env=env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    runner = run_job(service, job_id, outcome=RayJobStatus.SUCCEEDED, delay_s=0.2)
    watched = _run(client_venv, "apiary", "watch", str(job_id), "--interval", "0.1", env=env)
    runner.join()
    assert watched.returncode == 0 and f"job {job_id} succeeded" in watched.stdout, watched.stderr
    service.backend.logs[service.backend.submission_of(job_id)] = "driver\nrank 0 says hi\n"
    logs = _run(client_venv, "apiary", "logs", str(job_id), env=env)
    assert (logs.returncode, logs.stdout) == (0, "driver\nrank 0 says hi\n")
    listed = _run(client_venv, "apiary", "jobs", "--json", env=env)
    assert [job["state"] for job in json.loads(listed.stdout)["data"]] == ["succeeded"]

    # The SDK, through the one public package: a job, its log, and a refusal that names the field.
    script = textwrap.dedent(
        f"""
        import json, sys, apiary
        spec = json.loads(sys.argv[1])
        with apiary.Client({str(service.http.base_url)!r}) as client:
            job = client.get({job_id})
            assert job.state is apiary.JobState.SUCCEEDED, job.state
            assert client.logs({job_id}) == "driver\\nrank 0 says hi\\n"
            try:
                client.submit({{**spec, "max_workers": 0}})
            except apiary.ApiaryInvalid as err:
                print(err.field, err.status_code)
        """
    )
    sdk = _run(client_venv, "python", "-c", script, json.dumps(spec), env=env)
    assert sdk.returncode == 0, sdk.stderr
    assert sdk.stdout.split() == ["max_workers", "422"]


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (["serve"], "apiary[server]"),
        (["db", "current"], "apiary[server]"),
        (["token", "list"], "apiary[server]"),
        (["demo"], "apiary[server,cluster]"),
        (["data", "shard", "in.parquet", "out"], "apiary[cluster]"),
    ],
)
def test_a_command_whose_extra_is_missing_names_it(client_venv: Path, command: list[str], extra: str) -> None:
    ran = _run(client_venv, "apiary", *command, env={"COLUMNS": "200", "APIARY_DATA_DIR": "data"})
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert f"`apiary {command[0]}" in ran.stdout and f"pip install '{extra}'" in ran.stdout
    assert "Traceback" not in ran.stdout + ran.stderr


def test_the_client_commands_that_compute_locally_run(client_venv: Path) -> None:
    planned = _run(client_venv, "apiary", "plan", "--params", "7e9", "--workers", "8", "--json", env={})
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)
    generated = _run(client_venv, "apiary", "simulate", "--generate", "3", env={})
    assert generated.returncode == 0, generated.stderr
    trace = client_venv.parent / "trace.csv"
    trace.write_text(generated.stdout)
    simulated = _run(client_venv, "apiary", "simulate", str(trace), "--json", env={})
    assert simulated.returncode == 0 and json.loads(simulated.stdout)["jobs"] == 3, simulated.stderr
    # What runs on the cluster says which extra brings it.
    recipe = _run(client_venv, "python", "-c", "import apiary; apiary.Recipe", env={})
    assert "pip install 'apiary[cluster]'" in recipe.stderr
