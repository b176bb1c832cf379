"""How the service's own log lines look: `text` for people, `json` (one object per line) for log
shippers. `APIARY_LOG_FORMAT` picks one; `apiary serve` calls `configure_logging` once, at start.

Ray's lines go through the same handler (so they are JSON too), at WARNING and above unless `-v`:
its client's INFO lines ("Uploading package gcs://...") are not Apiary's news (`route_ray_logs`).

A JSON line holds `time` (UTC, ISO 8601), `level`, `logger`, `message`, the structured `extra` a call
site passed (`extra={"action": "job_admitted", "job": {...}}`), and `exc_info` when there is a
traceback. Values that are not JSON (paths, enums, datetimes) are written as their `str`.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(_JsonFormatter):
    def __init__(self) -> None:
        super().__init__(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            # An `extra` does not replace the fixed fields; uvicorn's `color_message` is its message
            # again, with terminal colours.
            reserved_attrs=[*RESERVED_ATTRS, "time", "level", "logger", "color_message"],
            json_default=str,
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        # Milliseconds and a "T": the library's own timestamp goes through `json_default` (str).
        log_data["time"] = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        super().add_fields(log_data, record, message_dict)


def configure_logging(log_format: str, *, level: int = logging.INFO) -> None:
    """Route every logger (uvicorn's too, see `api.server.serve`) through one stderr handler. Like
    `logging.basicConfig`, a no-op where the root logger already has handlers (an embedding program,
    pytest)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


def route_ray_logs(*, verbose: bool) -> None:
    """Send Ray's loggers through Apiary's handler, at INFO when `verbose`, else at WARNING and above.

    Importing Ray gives its `ray` logger a handler of its own, level INFO, and no propagation, and
    importing its job client (`ray.job_submission`) sets its SDK's logger to INFO, whatever `ray`'s
    level; so both are imported here first (the commands that call this talk to Ray anyway), then that
    is undone: every `ray.*` logger that set a level of its own below WARNING takes `ray`'s."""
    import ray
    import ray.job_submission  # noqa: F401

    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        ray_logger.removeHandler(handler)
    ray_logger.propagate = True
    ray_logger.setLevel(logging.INFO if verbose else logging.WARNING)
    for name, child in list(logging.root.manager.loggerDict.items()):
        if not (name.startswith("ray.") and isinstance(child, logging.Logger)):
            continue  # a placeholder (a name only its children have) has no level
        if logging.NOTSET < child.level < logging.WARNING:
            child.setLevel(logging.NOTSET)
