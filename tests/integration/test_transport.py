"""The connection under the API (api.transport), on loopback: slow clients hold nothing past their
timeouts, tokens in query strings never reach the access log, forwarded headers are believed only from
the proxies named, and a storage's own error text stays in the service's log."""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from service.cluster import free_port
from tests.conftest import S3, S3_BUCKETS
from tests.integration.conftest import Service
from tests.support.jobs import classification_job
from tests.support.wait import wait_until

SLOW_CLIENTS = 300


def server_sockets(port: int) -> int:
    """Established TCP connections whose local end is `port`: the server's side of each connection."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # ESTABLISHED
                count += 1
    return count


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def slow_clients() -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


def test_slow_heads_and_bodies_are_cut_off_at_their_timeouts(
    start_service: Callable[..., Service], slow_clients: list[socket.socket]
) -> None:
    service = start_service(header_timeout_s=3.0, body_timeout_s=3.0)
    port = int(service.http.base_url.port or 0)
    fds_before = open_fds()
    for index in range(SLOW_CLIENTS):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if index % 3:
            # A head that never ends: slowloris (its next header would come "later").
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1\r\n")
        else:
            # A whole head, then a body that never ends.
            sock.sendall(
                b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{"
            )
        slow_clients.append(sock)
    # Meanwhile the service answers others: the slow ones hold no worker slot.
    assert service.http.get("/healthz").status_code == 200

    # The server held them (its descriptors beside ours), then let each go at its timeout.
    peak = 0

    def all_dropped() -> bool:
        nonlocal peak
        peak = max(peak, open_fds())
        return server_sockets(port) == 0 and open_fds() <= fds_before + SLOW_CLIENTS + 10

    wait_until(all_dropped, timeout_s=30, interval_s=0.05, what="the server dropping the slow clients")
    assert peak >= fds_before + SLOW_CLIENTS + 50, peak
    answers = []
    for sock in slow_clients[::3]:
        sock.settimeout(5)
        answers.append(sock.recv(4096))
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers[:3]
    for sock in slow_clients[1::3]:
        sock.settimeout(5)
        assert sock.recv(4096) == b""  # closed without an answer: the head never came
    assert service.http.get("/healthz").status_code == 200


def test_a_token_in_a_query_string_is_redacted_from_the_access_log(
    start_service: Callable[..., Service],
) -> None:
    service = start_service(log_level="info")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    keep = Keep()
    access.addHandler(keep)
    try:
        secret = "apiary_" + "s3cr3t" * 7
        for query in (f"token={secret}", f"access_token={secret}&limit=5", f"queue={secret}"):
            service.http.get(f"/jobs?{query}")
        service.http.get(f"/jobs/{secret}")
    finally:
        access.removeHandler(keep)
    assert len(lines) == 4, lines
    assert not any(secret in line or "s3cr3t" in line for line in lines), lines
    assert "token=[redacted]" in lines[0] and "limit=5" in lines[1]


def log_in_through_a_proxy(service: Service, *, scheme: str) -> httpx.Response:
    """Log in as a browser behind a proxy that says `X-Forwarded-Proto: https` does: the form (its CSRF
    token), then the post, from the origin the browser sees (`scheme`)."""
    forwarded = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
    token = service.token("ada", admin=True)  # from now on auth is required, and the form has a CSRF token
    browser = service.as_user(None)
    form = browser.get("/login", headers={**forwarded, "Accept": "text/html"})
    found = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert form.status_code == 200 and found, (form.status_code, form.text[-1500:])
    origin = f"{scheme}://{browser.base_url.host}:{browser.base_url.port}"
    data = {"token": token, "next": "/", "csrf": found.group(1)}
    # The form's cookie, as the browser (on https) sends it back: httpx, on plain HTTP, would drop it.
    cookie = "; ".join(f"{name}={value}" for name, value in form.cookies.items())
    browser.cookies.clear()
    return browser.post("/login", data=data, headers={**forwarded, "Origin": origin, "Cookie": cookie})


def test_forwarded_headers_are_believed_only_from_the_named_proxies(
    start_service: Callable[..., Service],
) -> None:
    # The default, 127.0.0.1: the tests' proxy is loopback, so its word is taken (the cookie is Secure).
    response = log_in_through_a_proxy(start_service(), scheme="https")
    assert response.status_code == 303, response.text
    assert "secure" in response.headers["set-cookie"].lower(), response.headers


def test_forwarded_headers_from_a_proxy_not_named_are_ignored(start_service: Callable[..., Service]) -> None:
    service = start_service(forwarded_allow_ips="192.0.2.1")  # the proxy is elsewhere: loopback is not it
    response = log_in_through_a_proxy(service, scheme="http")  # the request stays plain HTTP
    assert response.status_code == 303, response.text
    assert "secure" not in response.headers["set-cookie"].lower(), response.headers


def test_a_storage_error_is_told_in_apiarys_words_and_logged_in_full(
    start_service: Callable[..., Service], s3: S3, caplog: pytest.LogCaptureFixture
) -> None:
    """S3's own error text names endpoints and hosts: the client gets Apiary's message, the log the
    storage's answer."""
    closed = f"127.0.0.1:{free_port()}"
    service = start_service(
        s3_endpoint_url=f"http://{closed}", data_roots="s3://", dataset_check_timeout_s=30
    )
    spec = classification_job(f"s3://{S3_BUCKETS[0]}/nowhere/data", name="s3-error")
    with caplog.at_level(logging.WARNING, logger="service.allowlists"):
        response = service.http.post("/jobs", json=spec)
    assert response.status_code == 422, response.text
    message = response.json()["message"]
    assert message.startswith(f"dataset s3://{S3_BUCKETS[0]}/nowhere/data cannot be read from its storage")
    assert closed not in message and "AWS" not in message and "curl" not in message, message
    assert closed in caplog.text or "AWS" in caplog.text, caplog.text


def test_the_schema_and_its_pages_follow_the_auth_rule(start_service: Callable[..., Service]) -> None:
    service = start_service(auth_required=True)
    token = service.token("ada")
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert service.as_user(None).get(path).status_code == 401, path
        assert service.as_user(token).get(path).status_code == 200, path
    assert "/jobs" in service.as_user(token).get("/openapi.json").json()["paths"]
