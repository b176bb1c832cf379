"""The web queue view in a real browser: Debian's Chromium driven by Playwright, against the service over
real HTTP (a fake cluster: Ray is not under test). Screenshots land in test-artifacts/ (git-ignored).

Playwright's own browser download cannot be reached from these machines; `.ci/run` installs the
`chromium` package, which Playwright launches by its path."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from api.client import ApiaryClient
from service.cluster import RayJobStatus
from service.contract.profiles import profile_folder, trace_name
from tests.integration.conftest import Service
from tests.support.jobs import classification_job

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
if not Path(CHROMIUM).exists():
    pytest.skip(
        f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does)", allow_module_level=True
    )


@pytest.fixture
def page() -> Iterator[Any]:
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        yield context.new_page()
        browser.close()


def spec(dataset: str, **changes: Any) -> dict[str, Any]:
    return classification_job(dataset, **{"name": "mlp-web", "num_workers": 2, "max_steps": 200, **changes})


def post_steps(service: Service, job_id: int, steps: range) -> None:
    now = time.time()
    for rank in (0, 1):
        slow = 1.0 + rank * 0.6  # rank 1 lags: a straggler to see
        points = [
            {
                "step": step,
                "rank": rank,
                "time": now,
                "values": {
                    "loss": 1.2 * 0.985**step + 0.02 * rank,
                    "samples_per_s": 8 / (0.05 * slow),
                    "step_time_s": 0.05 * slow,
                    "data_wait_s": 0.004 * slow,
                    "forward_s": 0.02 * slow,
                },
            }
            for step in steps
        ]
        status = {
            "rank": rank,
            "step": steps[-1],
            "step_at": now,
            "phase": "compute",
            "phase_since": now,
            "node": f"10.0.0.{rank + 1}",
            "pid": 100 + rank,
            # What its process uses: rank 1 holds three times the memory (an outlier after 3 posts).
            "system": {
                "sampled_at": now,
                "cpu_percent": 180.0,
                "rss_bytes": (1 + 2 * rank) * 2**30,
                "data_read_bytes": 10_000_000,
                "data_read_bytes_per_s": 2_500_000.0,
                "net_sent_bytes_per_s": 40_000.0,
                "net_recv_bytes_per_s": 52_000.0,
            },
        }
        body = {"attempt": 1, "points": points, "status": status}
        assert service.report(job_id, body).status_code == 202


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_queue_view_follows_a_job_live_in_a_browser(
    start_service: Callable[..., Service], page: Any, classification_dataset: str
) -> None:
    owner = "ada<b>x</b>"  # text from outside (a login name): the page must show it, not run it as markup
    service = start_service(local_user=owner)
    ARTIFACTS.mkdir(exist_ok=True)
    expect = playwright_api.expect
    base = str(service.http.base_url)
    page.goto(base + "/")
    expect(page.locator(".queue[data-queue=research] h2")).to_contain_text("research")

    response = service.http.post("/jobs", json=spec(classification_dataset, name="resnet-tiny"))
    job = response.json()
    row = page.locator(f".queue[data-queue=research] tr[data-job='{job['id']}']")
    expect(row).to_be_visible(timeout=15_000)  # through the queues stream, no reload
    expect(row).to_contain_text(owner)
    assert row.locator("b").count() == 0

    service.tick()
    submission_id = service.backend.submission_of(job["id"])
    service.backend.statuses[submission_id] = RayJobStatus.RUNNING
    service.tick()
    post_steps(service, job["id"], range(60))
    service.submit(spec(classification_dataset, name="big-sweep", num_workers=6, priority=5))
    service.submit(spec(classification_dataset, name="llm-pretrain", queue="full-scale", num_workers=4))
    service.tick()  # the scheduler gives the queued jobs their position, reason and ETA
    running = page.locator(f"table.running tr[data-job='{job['id']}']")
    expect(running).to_contain_text("59 / 200", timeout=15_000)
    expect(page.locator(f"canvas.sparkline[data-job='{job['id']}']")).to_have_attribute(
        "data-points", "60", timeout=15_000
    )
    page.screenshot(path=str(ARTIFACTS / "web-queue.png"), full_page=True)

    running.locator("a").click()
    page.wait_for_url(f"**/jobs/{job['id']}")
    expect(page.locator("#job-state")).to_have_text("running")
    chart = page.locator("#loss-chart")
    expect(chart).to_have_attribute("data-points", "60", timeout=15_000)
    assert chart.locator("canvas").count() == 1
    post_steps(service, job["id"], range(60, 90))  # live, through the job's stream
    expect(chart).to_have_attribute("data-points", "90", timeout=15_000)
    expect(page.locator("tr[data-rank='1'] .step-time")).to_have_text("80.0 ms")
    post_steps(service, job["id"], range(90, 95))  # the third post in a row: rank 1's memory stands out
    rss = page.locator("tr[data-rank='1'] td[data-figure='rss_bytes']")
    expect(rss).to_have_class("outlier", timeout=15_000)
    expect(rss).to_have_text("3.0 GiB")
    page.screenshot(path=str(ARTIFACTS / "web-job.png"), full_page=True)

    page.locator("#cancel").click()
    expect(page.locator("#job-state")).to_have_text("cancelled", timeout=15_000)
    expect(page.locator("#events")).to_contain_text("cancelled by")
    expect(page.locator("#cancel")).to_be_disabled()
    page.screenshot(path=str(ARTIFACTS / "web-job-cancelled.png"), full_page=True)
    assert service.job(job["id"])["state"] == "cancelled"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_with_tokens_the_browser_logs_in_and_cancels_its_own_job(
    service: Service, page: Any, classification_dataset: str
) -> None:
    expect = playwright_api.expect
    ada, bob = service.token("ada"), service.token("bob")
    job = service.as_user(ada).post("/jobs", json=spec(classification_dataset)).json()
    base = str(service.http.base_url)

    page.goto(f"{base}/jobs/{job['id']}")
    page.wait_for_url(re.compile(r"/login\?next=/jobs/"))  # no cookie yet: the login form
    page.fill("#token", bob)
    page.click("button[type=submit]")
    page.wait_for_url(f"**/jobs/{job['id']}")
    expect(page.locator("#user")).to_have_text("bob")
    expect(page.locator("#cancel")).to_be_disabled()  # ada's job

    page.click("button.link")  # log out
    page.wait_for_url("**/login")
    page.fill("#token", "apiary_wrong")
    page.click("button[type=submit]")
    expect(page.locator("#login-error")).to_contain_text("unknown or revoked")
    page.fill("#token", ada)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")
    page.goto(f"{base}/jobs/{job['id']}")
    page.locator("#cancel").click()  # the page's script posts with the HttpOnly cookie
    expect(page.locator("#job-state")).to_have_text("cancelled", timeout=15_000)
    expect(page.locator("#events")).to_contain_text("cancelled by ada")
    assert page.evaluate("document.cookie") == ""  # the script cannot read the token


ATTACKER_PAGE = """<!doctype html><html><body>
<iframe id="framed" src="{base}/jobs/{job_id}" width="800" height="400"></iframe>
<form id="forged" method="post" action="{base}/jobs/{job_id}/cancel" target="sink"></form>
<iframe name="sink"></iframe>
<script>
  fetch("{base}/jobs/{job_id}/cancel", {{method: "POST", credentials: "include", mode: "no-cors"}});
  fetch("{base}/jobs/{job_id}/cancel", {{method: "POST", credentials: "include", mode: "no-cors",
    headers: {{"Content-Type": "text/plain"}}, body: "x"}});
  document.getElementById("forged").submit();
</script></body></html>"""


@contextmanager
def attacker_site(page_html: str) -> Iterator[str]:
    """A page served on another port of the same host (the same site, for SameSite cookies): its URL."""
    body = page_html.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_page_on_another_port_of_the_host_cannot_cancel_a_job(
    service: Service, page: Any, classification_dataset: str
) -> None:
    expect = playwright_api.expect
    ada = service.token("ada")
    job = service.as_user(ada).post("/jobs", json=spec(classification_dataset)).json()
    base = str(service.http.base_url).rstrip("/")
    page.goto(f"{base}/login")
    page.fill("#token", ada)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/")  # logged in: the browser holds ada's session cookie

    with attacker_site(ATTACKER_PAGE.format(base=base, job_id=job["id"])) as evil:
        page.goto(evil)
        page.wait_for_timeout(2000)  # the form and both fetches have gone out and been answered
        assert service.as_user(ada).get(f"/jobs/{job['id']}").json()["state"] == "queued"
        # The framed job page is refused (frame-ancestors 'none'): no Cancel button to click through.
        framed = next(frame for frame in page.frames if frame.name == "framed")
        assert framed.query_selector("#cancel") is None
    page.goto(f"{base}/jobs/{job['id']}")  # the session itself still works, from this site
    page.locator("#cancel").click()
    expect(page.locator("#job-state")).to_have_text("cancelled", timeout=15_000)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_job_page_charts_the_eval_loss_of_a_job_with_an_eval(
    service: Service, page: Any, classification_dataset: str
) -> None:
    held_out = {"dataset": {"uri": classification_dataset}, "every_steps": 10}
    job = service.submit(spec(classification_dataset, name="mlp-eval", eval=held_out))
    service.tick()
    service.backend.statuses[service.backend.submission_of(job["id"])] = RayJobStatus.RUNNING
    service.tick()
    # Rank 0 records the eval (the mean over the ranks) with its step's own metrics, every 10 steps.
    points = [
        {
            "step": step,
            "rank": rank,
            "time": time.time(),
            "values": {
                "loss": 1.0 / step,
                **({"eval_loss": 2.0 / step} if rank == 0 and step % 10 == 0 else {}),
            },
        }
        for rank in (0, 1)
        for step in range(1, 31)
    ]
    assert service.report(job["id"], {"attempt": 1, "points": points}).status_code == 202
    page.goto(f"{service.http.base_url}/jobs/{job['id']}")
    chart = page.locator("#eval-chart")
    playwright_api.expect(chart).to_have_attribute("data-points", "3", timeout=15_000)
    assert chart.locator("canvas").count() == 1
    expect_loss = page.locator("#loss-chart")
    playwright_api.expect(expect_loss).to_have_attribute("data-points", "30", timeout=15_000)
    page.screenshot(path=str(ARTIFACTS / "web-job-eval.png"), full_page=True)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_job_page_and_the_api_list_the_profiles_the_ranks_saved(
    service: Service, page: Any, classification_dataset: str
) -> None:
    job = service.submit(
        spec(classification_dataset, name="mlp-profile", profile={"start_step": 11, "steps": 5})
    )
    empty = service.http.get(f"/jobs/{job['id']}/profiles").json()
    assert empty["count"] == 0 and empty["logdir"] == service.checkpoint_uri(job["id"], "profile")
    page.goto(f"{service.http.base_url}/jobs/{job['id']}")
    playwright_api.expect(page.locator("#profiles")).to_contain_text(
        "No trace yet: the ranks save theirs after step 15"
    )

    # What the job's two ranks leave beside its checkpoints (trainers.profiling), in its storage.
    folder = Path(
        urlparse(
            profile_folder(
                storage_uri=service.runtime.settings.resolved_storage_uri,
                run_name=f"job-{job['id']}",
                start_step=11,
                end_step=15,
            )
        ).path
    )
    folder.mkdir(parents=True)
    for rank in (0, 1):
        (folder / trace_name(rank)).write_text(
            json.dumps({"traceEvents": [{"ph": "X", "name": "ProfilerStep#11"}]})
        )
    splits = [
        {
            "rank": rank,
            "trace": trace_name(rank),
            "window_s": 0.5,
            "compute_s": 0.3,
            "communication_s": 0.1 + 0.1 * rank,
            "overlap_s": 0.05,
            "idle_s": 0.1,
        }
        for rank in (0, 1)
    ]
    (folder / "summary.json").write_text(json.dumps({"start_step": 11, "end_step": 15, "per_rank": splits}))

    found = service.http.get(f"/jobs/{job['id']}/profiles").json()
    assert found["count"] == 1
    (profile,) = found["data"]
    assert (profile["run"], profile["start_step"], profile["end_step"]) == ("steps-11-15", 11, 15)
    assert profile["folder"] == folder.as_uri()
    assert [(t["rank"], t["name"], t["uri"]) for t in profile["traces"]] == [
        (rank, f"rank-{rank}.pt.trace.json", f"{folder.as_uri()}/rank-{rank}.pt.trace.json")
        for rank in (0, 1)
    ]
    assert profile["summary"]["per_rank"][1]["communication_s"] == 0.2
    assert service.http.get("/jobs/999999/profiles").status_code == 404
    with ApiaryClient(str(service.http.base_url)) as client:  # the SDK reads the same answer
        assert client.profiles(job["id"]).data[0].traces[1].name == "rank-1.pt.trace.json"

    page.goto(f"{service.http.base_url}/jobs/{job['id']}")
    rows = page.locator("#profiles table.profile tbody tr")
    playwright_api.expect(rows).to_have_count(2)
    playwright_api.expect(rows.nth(0)).to_contain_text("rank-0.pt.trace.json")
    playwright_api.expect(rows.nth(1)).to_contain_text("40%")  # rank 1's communication: 0.2 s of 0.5 s
    logdir = folder.parents[2]  # {storage}/job-N/profile
    playwright_api.expect(page.locator("#profiles h2")).to_contain_text(f"tensorboard --logdir {logdir}")
    page.screenshot(path=str(ARTIFACTS / "web-job-profiles.png"), full_page=True)
