"""Jobs side by side over real HTTP (GET /compare, `apiary compare`) on SQLite and PostgreSQL, and the
compare page in Chromium, reached from the queue page by picking rows."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.cli import app
from service.cluster import RayJobStatus
from tests.integration.conftest import Service
from tests.support.jobs import classification_job

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def run_job(service: Service, dataset: str, *, lr: float, losses: list[float]) -> int:
    """A job with config `lr` that reported `losses` (rank 0, steps 1..n) and succeeded."""
    spec = classification_job(
        dataset, name=f"lr-{lr}", config={"task": "classification", "num_classes": 3, "lr": lr}
    )
    job_id = int(service.submit(spec)["id"])
    service.tick()
    submission_id = service.backend.submission_of(job_id)
    service.backend.statuses[submission_id] = RayJobStatus.RUNNING
    service.tick()
    now = time.time()
    points = [
        {"step": step, "rank": 0, "time": now, "values": {"loss": loss, "samples_per_s": 100.0 + step}}
        for step, loss in enumerate(losses, start=1)
    ]
    assert service.report(job_id, {"attempt": 1, "points": points}).status_code == 202
    service.backend.statuses[submission_id] = RayJobStatus.SUCCEEDED
    service.tick()
    return job_id


def test_compare_gives_final_and_best_metrics_and_the_spec_diff(
    service: Service, classification_dataset: str, tmp_path: Path
) -> None:
    fast = run_job(service, classification_dataset, lr=0.1, losses=[2.0, 0.5, 0.8])
    slow = run_job(service, classification_dataset, lr=0.01, losses=[2.0, 1.5, 1.2])

    response = service.http.get("/compare", params={"jobs": f"{fast},{slow}"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [run["id"] for run in body["jobs"]] == [fast, slow]
    first, second = body["jobs"]
    assert (first["final"]["loss"], first["best"]["loss"], first["best_step"]["loss"]) == (0.8, 0.5, 2)
    assert (second["final"]["loss"], second["best"]["loss"]) == (1.2, 1.2)
    assert first["best"]["samples_per_s"] == 103.0  # higher is better for what is not a loss
    assert body["spec_diff"]["config.lr"] == [0.1, 0.01]
    assert body["spec_diff"]["name"] == ["lr-0.1", "lr-0.01"]
    assert "max_steps" not in body["spec_diff"]

    env = {"APIARY_URL": str(service.http.base_url), "APIARY_CONFIG": str(tmp_path / "none.toml")}
    printed = CliRunner().invoke(app, ["compare", str(fast), str(slow)], env={**env, "COLUMNS": "200"})
    assert printed.exit_code == 0, printed.output
    assert "config.lr" in printed.output and "0.01" in printed.output
    assert "best loss" in printed.output and "0.5 @2" in printed.output
    as_json = CliRunner().invoke(app, ["compare", str(fast), str(slow), "--json"], env=env)
    assert json.loads(as_json.stdout)["spec_diff"]["config.lr"] == [0.1, 0.01]


def test_compare_refuses_what_it_cannot_compare(service: Service, classification_dataset: str) -> None:
    job = run_job(service, classification_dataset, lr=0.1, losses=[1.0])
    alone = service.http.get("/compare", params={"jobs": f"{job},{job}"})  # each job once
    assert alone.status_code == 200 and [run["id"] for run in alone.json()["jobs"]] == [job]
    for jobs in ("1,x", "", ",".join(str(i) for i in range(1, 22))):
        refused = service.http.get("/compare", params={"jobs": jobs})
        assert refused.status_code == 422, (jobs, refused.text)
        assert refused.json()["message"].startswith("jobs: "), refused.text
    for jobs in (f"{job},999", "0,1"):
        missing = service.http.get("/compare", params={"jobs": jobs})
        assert missing.status_code == 404, missing.text


@pytest.fixture
def page() -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does)")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        browser.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_picking_rows_on_the_queue_page_opens_their_comparison(
    service: Service, classification_dataset: str, page: Any
) -> None:
    from playwright.sync_api import expect

    fast = run_job(service, classification_dataset, lr=0.1, losses=[2.0, 0.5, 0.8])
    slow = run_job(service, classification_dataset, lr=0.01, losses=[2.0, 1.5, 1.2])
    page.goto(str(service.http.base_url) + "/")
    button = page.locator("#compare-picked")
    expect(button).to_be_disabled()
    page.locator(f"input.pick[value='{fast}']").check()
    page.locator(f"input.pick[value='{slow}']").check()
    expect(button).to_have_text("Compare 2 jobs")
    button.click()
    page.wait_for_url(f"**/compare?jobs={fast},{slow}")
    expect(page.locator("#spec-diff tr[data-key='config.lr']")).to_contain_text("0.01")
    expect(page.locator("#runs tr[data-metric='loss']")).to_contain_text("0.8")
    expect(page.locator("#loss-chart")).to_have_attribute("data-series", "2", timeout=15_000)
    assert page.locator("#loss-chart canvas").count() == 1
    expect(page.locator("#eval-chart")).to_have_attribute("data-series", "0")  # no eval: hidden
