"""Run the API: `serve()` in the foreground (`apiary serve`), `BackgroundServer` in a thread of this
process (`apiary demo` and the tests)."""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from api.transport import server_config
from service.runtime import Runtime
from service.settings import Settings

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, with a clean stop that first lets the running jobs checkpoint and requeue.

    The first Ctrl-C or SIGTERM drains (`Runtime.drain`) while the API still answers the trainers'
    telemetry (which is how they hear "checkpoint and stop"), then stops; a second one stops at once.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        runtime: Runtime | None = getattr(self.app.state, "runtime", None)
        if self._draining or runtime is None or runtime.local_ray is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        logger.info("stopping: running jobs checkpoint and requeue first (signal again to stop now)")
        threading.Thread(target=self._drain_then_exit, args=(runtime, sig, frame), daemon=True).start()

    def _drain_then_exit(self, runtime: Runtime, sig: int, frame: FrameType | None) -> None:
        try:
            runtime.drain()
        except Exception:
            logger.exception("draining before the stop failed; stopping anyway")
        super().handle_exit(sig, frame)


def serve(app: FastAPI, settings: Settings) -> None:
    # uvicorn's own text handlers, or none: its loggers then reach the root's JSON handler.
    log_config = None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG
    config = server_config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        log_config=log_config,
        header_timeout_s=settings.header_timeout_s,
        forwarded_allow_ips=settings.forwarded_allow_ips,
    )
    DrainingServer(config, app).run()


class BackgroundServer:
    def __init__(
        self,
        app: FastAPI,
        *,
        host: str,
        port: int,
        log_level: str = "warning",
        header_timeout_s: float = Settings.model_fields["header_timeout_s"].default,
        forwarded_allow_ips: str = Settings.model_fields["forwarded_allow_ips"].default,
    ) -> None:
        self.url = f"http://{host}:{port}"
        config = server_config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            header_timeout_s=header_timeout_s,
            forwarded_allow_ips=forwarded_allow_ips,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="apiary-api", daemon=True)

    def start(self, timeout_s: float = 120) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the service did not start; see the log above")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 90) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
