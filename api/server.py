"""Run the API in a background thread of this process (used by `apiary demo` and the tests)."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    def __init__(self, app: FastAPI, *, host: str, port: int, log_level: str = "warning") -> None:
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, name="apiary-api", daemon=True)

    def start(self, timeout_s: float = 120) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the service did not start; see the log above")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 90) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
