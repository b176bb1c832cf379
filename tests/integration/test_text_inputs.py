"""Text that reaches the database is clean: a NUL byte or another control character in any query
parameter or path value is a 422 naming where it was, on SQLite and on PostgreSQL (whose text types
cannot hold NUL: it used to reach the driver and come back as a 500).

Every operation of the OpenAPI schema is walked, and the web pages' own parameters beside it, so that
a route added later is covered without being named here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest

from tests.integration.conftest import Service
from tests.support.jobs import classification_job

CONTROL = ["\x00", "\x01", "\x1b", "\x1f", "\x7f", "\x85"]
# Query parameters of the HTML pages (api.web.views), which the schema leaves out.
PAGE_QUERIES = {"/": ["offset", "part"], "/login": ["next"], "/compare": ["jobs"]}


def schema_queries(service: Service) -> dict[tuple[str, str], list[str]]:
    schema: dict[str, Any] = service.http.get("/openapi.json").json()
    found: dict[tuple[str, str], list[str]] = {}
    for template, operations in schema["paths"].items():
        path = template.replace("{job_id}", "1").replace("{token_id}", "1")
        for method, operation in operations.items():
            names = [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"]
            found[(method.upper(), path)] = names
    return found


@pytest.mark.parametrize("char", CONTROL, ids=[f"U+{ord(c):04X}" for c in CONTROL])
def test_a_control_character_in_a_query_parameter_is_a_422_naming_it(
    service: Service, classification_dataset: str, char: str
) -> None:
    service.submit(classification_job(classification_dataset, name="one"))
    queries = schema_queries(service)
    queries.update({("GET", path): names for path, names in PAGE_QUERIES.items()})
    assert queries[("GET", "/jobs")] == ["state", "queue", "offset", "limit"]
    checked = 0
    for (method, path), names in queries.items():
        for name in names:
            response = service.http.request(method, path, params={name: f"a{char}b"})
            assert response.status_code == 422, (method, path, name, response.status_code, response.text)
            assert response.json()["message"].startswith(name), response.text
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("char", CONTROL, ids=[f"U+{ord(c):04X}" for c in CONTROL])
def test_a_control_character_in_a_path_value_is_a_422(
    service: Service, classification_dataset: str, char: str
) -> None:
    service.submit(classification_job(classification_dataset, name="one"))
    encoded = quote(char, safe="")
    for path in ("/jobs/1", "/jobs/1/events", "/queues", "/compare", "/me", "/healthz", "/nowhere"):
        response = service.http.get(f"{path}{encoded}")
        assert response.status_code == 422, (path, response.status_code, response.text)
        assert response.json()["message"].startswith("path:"), response.text
    # In a parameter's own name too.
    response = service.http.get(f"/jobs?qu{encoded}eue=a")
    assert response.status_code == 422, response.text


def test_ordinary_text_still_passes(service: Service) -> None:
    assert service.http.get("/jobs", params={"queue": "research, not a queue é"}).status_code == 200
    assert service.http.get("/jobs", params={"queue": "ré search"}).json()["count"] == 0
