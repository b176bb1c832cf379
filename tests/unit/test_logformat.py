"""APIARY_LOG_FORMAT=json (api/logformat.py): one JSON object per line, with the `extra` a call site
passes, tracebacks inside the object, and values that are not JSON as their text."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

from api.logformat import JsonFormatter


def test_each_record_is_one_json_object_with_its_extra_fields() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("apiary.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        logger.info(
            "job %d admitted", 7, extra={"action": "job_admitted", "job": {"id": 7, "queue": "research"}}
        )
        logger.warning("path\nwith a newline", extra={"where": Path("/tmp/x")})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("it failed")
        logger.debug("not at this level")
    finally:
        logger.removeHandler(handler)

    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    admitted, newline, failed = (json.loads(line) for line in lines)
    assert admitted["message"] == "job 7 admitted"
    assert admitted["level"] == "INFO" and admitted["logger"] == "apiary.test.json"
    assert admitted["action"] == "job_admitted" and admitted["job"] == {"id": 7, "queue": "research"}
    assert admitted["time"].endswith("+00:00")
    assert set(admitted) == {"time", "level", "logger", "message", "action", "job"}
    assert newline["message"] == "path\nwith a newline" and newline["where"] == "/tmp/x"
    assert failed["level"] == "ERROR"
    assert "ValueError: boom" in failed["exc_info"] and "Traceback" in failed["exc_info"]


def test_rays_lines_go_through_apiarys_handler_at_warning_unless_verbose() -> None:
    """Ray's client logs "Uploading package ..." at INFO through a handler of its own; `apiary serve`
    and `apiary demo` route it through theirs, at WARNING unless -v (a fresh process: Ray's logger
    is global)."""
    script = """
import logging, sys
from api.logformat import configure_logging, route_ray_logs
configure_logging("json")
route_ray_logs(verbose=sys.argv[1] == "1")
import ray.job_submission  # as the scheduler's first submission does: its SDK's logger sets INFO
sdk = logging.getLogger("ray.dashboard.modules.dashboard_sdk")
sdk.info("Uploading package gcs://x.zip.")
sdk.warning("a warning")
"""
    for verbose, expected in (("0", ["a warning"]), ("1", ["Uploading package gcs://x.zip.", "a warning"])):
        done = subprocess.run(
            [sys.executable, "-c", script, verbose], capture_output=True, text=True, timeout=120, check=True
        )
        lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
        assert [line["message"] for line in lines] == expected, done.stderr
