"""`apiary serve` with APIARY_LOG_FORMAT=json: every line it writes, uvicorn's included, is one JSON
object. The Ray address leads nowhere, so the service migrates its SQLite, fails to reach Ray, logs
why and exits: what a log shipper would get from a start that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from service.cluster import free_port


def test_apiary_serve_writes_one_json_object_per_line(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "APIARY_LOG_FORMAT": "json",
        "APIARY_DATA_DIR": str(tmp_path / "data"),
        "APIARY_RAY_ADDRESS": f"http://127.0.0.1:{free_port()}",
        "APIARY_RAY_AUTH_TOKEN": "not-logged-anywhere",
    }
    apiary = Path(sys.executable).parent / "apiary"
    result = subprocess.run(
        [str(apiary), "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # each line parses on its own
    assert all({"time", "level", "logger", "message"} <= set(record) for record in records)
    by_logger = {record["logger"] for record in records}
    assert {"uvicorn.error", "service.store.db"} <= by_logger
    assert {"action": "db_upgraded", "revision": "head"}.items() <= next(
        record for record in records if record["logger"] == "service.store.db"
    ).items()
    assert any(record["level"] == "ERROR" for record in records)
    assert "not-logged-anywhere" not in result.stdout + result.stderr
