"""A TCP proxy on a loopback port that a test can cut and restore: the database "goes away" (every
connection through it is dropped, new ones are refused) and comes back on the same address, without
stopping the real server that other tests share. With more than one target it is a fail-over load
balancer: each connection goes to the first target that accepts it."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Sequence

from service.cluster import free_port


class TcpProxy:
    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        port: int | None = None,
        fallbacks: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.targets = [(target_host, target_port), *fallbacks]
        self.port = port or free_port()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self.open()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def open(self) -> None:
        """Accept connections again (on the same port)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="proxy-accept", daemon=True).start()

    def close(self) -> None:
        """Drop every connection and refuse new ones, as a stopped server would."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        for sock in [*sockets, *([listener] if listener else [])]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            upstream = self._connect()
            if upstream is None:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _connect(self) -> socket.socket | None:
        for target in self.targets:
            try:
                upstream = socket.create_connection(target, timeout=5)
            except OSError:
                continue
            upstream.settimeout(None)
            return upstream
        return None

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
