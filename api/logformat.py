"""How the service's own log lines look: `text` for people, `json` (one object per line) for log
shippers. `APIARY_LOG_FORMAT` picks one; `apiary serve` calls `configure_logging` once, at start.

A JSON line holds `time` (UTC, ISO 8601), `level`, `logger`, `message`, the structured `extra` a call
site passed (`extra={"action": "job_admitted", "job": {...}}`), and `exc_info` when there is a
traceback. Values that are not JSON (paths, enums, datetimes) are written as their `str`.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from `extra` (uvicorn's
# `color_message` is its message again, with terminal colours).
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_") and key not in line:
                line[key] = value
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def configure_logging(log_format: str, *, level: int = logging.INFO) -> None:
    """Route every logger (uvicorn's too, see `api.server.serve`) through one stderr handler. Like
    `logging.basicConfig`, a no-op where the root logger already has handlers (an embedding program,
    pytest)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
