"""The API against its own OpenAPI schema: schemathesis (its `st run`, as a user runs it) generates
requests from the schema (valid ones, invalid ones, and the boundaries of every bound it states) and
runs all of its checks on each answer: no 5xx, only declared status codes, bodies and headers as
declared, invalid data refused, valid data accepted. On SQLite and PostgreSQL, over real HTTP, with a
fake cluster.

Bounded for CI: `MAX_EXAMPLES` per operation. A failure prints schemathesis' report, with a curl
command that replays each failing request.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import Service
from tests.support.jobs import classification_job

MAX_EXAMPLES = 10
ROOT = Path(__file__).resolve().parents[2]
# Whether a valid spec can run depends on more than its schema: the dataset must exist, the trainer
# import, the gang fit the cluster (422 naming the field). tests/support/fuzz_hooks.py points valid
# specs at a real dataset and trainer, so that many are created; the rest may be refused.
CONFIG = """
hooks = "tests.support.fuzz_hooks"
# The SSE routes stream until a job ends: their first event is enough to check.
max-stream-events = 1

# A followed log streams until the job's Ray job ends, which a fake cluster's never does.
[[operations]]
include-path = "/jobs/{job_id}/logs"
parameters = {"query.follow" = false}

# Telemetry takes only the report token of the job's current attempt, which no schema can give.
[[operations]]
include-path = "/internal/jobs/{job_id}/telemetry"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422"]

# Credentials go only for the single-use fetch token of the job's current attempt, which no schema can
# give.
[[operations]]
include-path = "/internal/jobs/{job_id}/attempts/{attempt}/credentials"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422"]

# Its schema's pattern cannot say "2 to 20 different ids": a list of one id, or of one id repeated, is 422.
[[operations]]
include-path = "/compare"
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "422"]

# A code package must be a zip whose sha256 is its path's, which no schema can say.
[[operations]]
include-path = "/code/{sha256}"
checks.positive_data_acceptance.expected-statuses = ["2xx", "422"]

[[operations]]
include-method = "POST"
include-path-regex = "^/(jobs|plan)$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "409", "422"]

"""


@pytest.fixture
def fuzzed_service(start_service: Callable[..., Service]) -> Service:
    """The service under test, with auth on; its client's headers (an admin's token, which may do
    everything: a generated POST /admin/tokens must not turn the rest into 401s) go with every request.
    The two fake nodes share the tests' folder as a shared filesystem."""
    service = start_service(
        nodes=[{"CPU": 8.0}, {"CPU": 8.0, "GPU": 2.0}], shared_filesystem=True, auth_required=True
    )
    service.http.headers["Authorization"] = f"Bearer {service.token('fuzzer', admin=True)}"
    return service


def test_every_answer_is_what_the_schema_says(
    fuzzed_service: Service, classification_dataset: str, tmp_path: Path
) -> None:
    # A few jobs, so that generated ids (small ones come first) find something to read and change.
    for name in ("fuzz-a", "fuzz-b"):
        fuzzed_service.submit(classification_job(classification_dataset, name=name))
    fuzzed_service.tick()
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    headers = [
        arg
        for name, value in fuzzed_service.http.headers.items()
        if name.lower().startswith("x-") or name.lower() == "authorization"
        for arg in ("-H", f"{name}: {value}")
    ]
    command = [
        str(Path(sys.executable).parent / "st"),
        "--config-file",
        str(config),
        "run",
        f"{fuzzed_service.http.base_url}/openapi.json",
        "--checks=all",
        # It would send the requests without our Authorization header, which it does not know for
        # auth (it knows only what `--auth` or the config gives); tests/integration/test_auth.py checks
        # that every protected route answers 401 without a token.
        "--exclude-checks=ignored_auth",
        # DELETE /admin/tokens/{id} would revoke the fuzzer's own token (id 1 is among the first it
        # tries), and every later request would be a 401; test_auth.py covers revocation.
        "--exclude-method=DELETE",
        f"--max-examples={MAX_EXAMPLES}",
        "--workers=1",
        "--generation-database=none",
        "--request-timeout=30",
        "--no-color",
        *headers,
    ]
    env = {**os.environ, "APIARY_FUZZ_DATASET_URI": classification_dataset, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-20_000:] + done.stderr[-5000:]
    tested = re.search(r"Tested: (\d+)", done.stdout)
    assert tested and int(tested.group(1)) >= 15, done.stdout[-5000:]  # every operation of the schema
