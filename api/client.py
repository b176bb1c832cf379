"""The Python SDK: a thin, typed client of the REST API.

from api.client import ApiaryClient
client = ApiaryClient("http://127.0.0.1:8000")
job = client.submit("job.yaml")          # a path, a dict or a JobSpec
job = client.wait(job["id"], timeout_s=600)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from service.spec import JobSpec, parse_spec_text
from service.states import TERMINAL_STATES


class ApiaryClientError(Exception):
    """The API refused a request; `message` says why, `status_code` is the HTTP status."""

    def __init__(self, message: str, *, status_code: int, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body


class ApiaryClient:
    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", *, user: str | None = None, timeout_s: float = 30
    ):
        headers = {"X-Apiary-User": user} if user else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiaryClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.is_success:
            return response.json()
        try:
            body = response.json()
            message = body.get("message") or str(body.get("detail"))
        except ValueError:
            body, message = response.text, response.text or response.reason_phrase
        raise ApiaryClientError(message, status_code=response.status_code, body=body)

    def submit(self, spec: JobSpec | dict[str, Any] | str | Path) -> dict[str, Any]:
        if isinstance(spec, JobSpec):
            payload: dict[str, Any] = spec.model_dump(mode="json")
        elif isinstance(spec, dict):
            payload = spec
        else:
            payload = parse_spec_text(Path(spec).read_text())
        result: dict[str, Any] = self._request("POST", "/jobs", json=payload)
        return result

    def get(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", f"/jobs/{job_id}")
        return result

    def list_jobs(
        self, *, state: list[str] | None = None, queue: str | None = None, limit: int = 100
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        if queue:
            params["queue"] = queue
        result: dict[str, Any] = self._request("GET", "/jobs", params=params)
        return result

    def cancel(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._request("POST", f"/jobs/{job_id}/cancel")
        return result

    def preempt(self, job_id: int) -> dict[str, Any]:
        """Checkpoint a running job and put it back in its queue; it resumes from that checkpoint."""
        result: dict[str, Any] = self._request("POST", f"/jobs/{job_id}/preempt")
        return result

    def queues(self, *, limit: int = 100) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._request("GET", "/queues", params={"limit": limit})["data"]
        return result

    def events(self, job_id: int) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._request("GET", f"/jobs/{job_id}/events")["data"]
        return result

    def metrics(self, job_id: int, **filters: int | str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._request("GET", f"/jobs/{job_id}/metrics", params=filters)["data"]
        return result

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/healthz")
        return result

    def wait(self, job_id: int, *, timeout_s: float = 600, poll_s: float = 1.0) -> dict[str, Any]:
        """Block until the job ends; TimeoutError (with its last state) if it has not by `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if job["state"] in TERMINAL_STATES:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['state']} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def plan(
        self,
        *,
        facts: dict[str, Any] | None = None,
        spec: JobSpec | dict[str, Any] | None = None,
        job_id: int | None = None,
    ) -> dict[str, Any]:
        """The cluster math of a run (POST /plan): {"plan": flat quantities, "rows", "facts", "sources"}.
        Facts (service.planner.PlanFacts names) win over the job's measurements, which win over the spec."""
        if isinstance(spec, JobSpec):
            spec = spec.model_dump(mode="json")
        body = {"facts": facts or {}, "spec": spec, "job_id": job_id}
        result: dict[str, Any] = self._request("POST", "/plan", json=body)
        return result
