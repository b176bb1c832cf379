"""A server-sent-event client for the tests: reads a stream over real HTTP in a thread, so that a test
can wait for the next message with a timeout (and see that none comes)."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Message:
    event: str
    id: str
    data: Any  # the parsed JSON


class SseReader:
    """GET `url` as text/event-stream; messages (not comments) arrive in `next()`. `close()` hangs up."""

    def __init__(self, base_url: str, path: str, *, headers: dict[str, str] | None = None) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=httpx.Timeout(10, read=None))
        self.messages: queue.Queue[Message | BaseException | None] = queue.Queue()
        self.comments = 0
        self._response = self.client.send(
            self.client.build_request("GET", path, headers=headers), stream=True
        )
        self.status_code = self._response.status_code
        self.content_type = self._response.headers.get("content-type", "")
        if self.status_code == 200:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        fields: dict[str, str] = {}
        try:
            for line in self._response.iter_lines():
                if line.startswith(":"):
                    self.comments += 1
                elif line == "":
                    if fields:
                        self.messages.put(Message(fields["event"], fields["id"], json.loads(fields["data"])))
                    fields = {}
                else:
                    name, _, value = line.partition(": ")
                    fields[name] = value
            self.messages.put(None)  # the server ended the stream
        except Exception as err:  # closed under it by `close()`, or a broken connection
            self.messages.put(err)

    def next(self, timeout_s: float = 10) -> Message | None:
        """The next message; None when the server closed the stream; queue.Empty after `timeout_s`."""
        item = self.messages.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    def until(self, event: str, timeout_s: float = 10) -> list[Message]:
        """Messages up to and including the first `event` one."""
        seen: list[Message] = []
        while True:
            message = self.next(timeout_s)
            assert message is not None, f"the stream ended before a {event!r} message: {seen}"
            seen.append(message)
            if message.event == event:
                return seen

    def close(self) -> None:
        # Shut the socket down first: closing it alone while the reader thread is blocked in recv()
        # sends no FIN until that call returns, so the server would never see the client go.
        sock = self._response.extensions["network_stream"].get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._response.close()
        self.client.close()
