"""APIARY_LOG_FORMAT=json (api/logformat.py): one JSON object per line, with the `extra` a call site
passes, tracebacks inside the object, and values that are not JSON as their text."""

from __future__ import annotations

import io
import json
import logging
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
