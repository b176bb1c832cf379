"""A real HTTP server that stands in for the control plane's telemetry endpoint."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from service.contract.protocol import SYSTEM_PREFIX


def trained(point: dict[str, Any]) -> dict[str, float]:
    """A posted point's values less the system figures a post may add to it (`trainers.telemetry`)."""
    return {name: value for name, value in point["values"].items() if not name.startswith(SYSTEM_PREFIX)}


class TelemetryServer:
    """A real HTTP server on 127.0.0.1 that collects TelemetryBatch posts.

    The first `fail_first` posts get `fail_status` (and are not kept), like a control plane that is
    down for a while. Set `stop` to reply as the control plane does to a preempted job, `refusal` to
    answer every post with that (status, JSON body). `authorizations` holds each kept post's
    Authorization header.
    """

    def __init__(self, *, fail_first: int = 0, fail_status: int = 503) -> None:
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.attempts = 0
        self.stop = False
        self.superseded = False
        self.refusal: tuple[int, dict[str, Any]] | None = None
        self.batches: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with server.lock:
                    server.attempts += 1
                    if server.refusal is not None:
                        status, refusal = server.refusal
                        self._send(status, json.dumps(refusal).encode())
                        return
                    failing = server.attempts <= server.fail_first
                    if not failing:
                        server.batches.append(json.loads(body))
                        server.authorizations.append(self.headers.get("authorization"))
                    reply = (
                        b""
                        if failing
                        else json.dumps(
                            {"stored": 0, "stop": server.stop, "superseded": server.superseded}
                        ).encode()
                    )
                self._send(server.fail_status if failing else 200, reply)

            def _send(self, status: int, reply: bytes) -> None:
                self.send_response(status)
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # keep pytest output quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/telemetry"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def points(self) -> list[dict[str, Any]]:
        with self.lock:
            return [point for batch in self.batches for point in batch["points"]]

    def checkpoints(self) -> list[dict[str, Any]]:
        with self.lock:
            return [batch["checkpoint"] for batch in self.batches if batch["checkpoint"] is not None]

    def events(self) -> list[dict[str, Any]]:
        with self.lock:
            return [event for batch in self.batches for event in batch["events"]]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
