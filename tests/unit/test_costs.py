"""The cost ledger and the price signal as the service reads it (`service.costs`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from service.contract.signal import SignalError, build_signal
from service.costs import OwnerCost, PriceSignal, Rates, accrue, check_at_start, read_signal, sum_costs

H = 3600.0
SIGNAL = build_signal([(0, H, 10.0), (2 * H, 3 * H, 1.0)], source="test")  # 10 for an hour, a gap, 1


def test_gpu_hours_times_the_price_and_unpriced_time_costs_nothing() -> None:
    gang = {"GPU": 4.0, "CPU": 9.0}
    spent = accrue(SIGNAL, resources=gang, start=0.5 * H, end=2.5 * H, rates=Rates())
    assert spent.resource_hours == pytest.approx(8.0)  # 4 GPUs x 2 h
    assert spent.priced_hours == pytest.approx(4.0)  # the gap is not priced
    assert spent.cost == pytest.approx(4 * (0.5 * 10 + 0.5 * 1))


def test_cpu_hours_without_gpus_and_kg_co2e_with_an_intensity_signal() -> None:
    carbon = Rates(unit="carbon", gpu_power_kw=0.5, cpu_power_kw=0.01)
    cpus = accrue(SIGNAL, resources={"CPU": 8.0, "GPU": 0.0}, start=0, end=H, rates=carbon)
    assert (cpus.resource_hours, cpus.cost) == (pytest.approx(8.0), pytest.approx(8 * 0.01 * 10 / 1000))
    gpus = accrue(SIGNAL, resources={"GPU": 2.0}, start=0, end=H, rates=carbon)
    assert gpus.cost == pytest.approx(2 * 0.5 * 10 / 1000)  # 1 kWh at 10 g/kWh = 10 g
    assert accrue(None, resources={"GPU": 2.0}, start=0, end=H, rates=Rates()).cost == 0.0


def test_queue_totals_per_unit() -> None:
    rows = [
        OwnerCost(owner="ada", unit="price", resource_hours=2, priced_hours=2, cost=3),
        OwnerCost(owner="bob", unit="price", resource_hours=1, priced_hours=0, cost=0),
    ]
    assert sum_costs(rows) == [OwnerCost(owner=None, unit="price", resource_hours=3, priced_hours=2, cost=3)]


@pytest.fixture
def endpoint() -> Iterator[dict[str, object]]:
    """An HTTP endpoint on loopback answering `state["body"]` (JSON) or `state["status"]`."""
    state: dict[str, object] = {"body": [{"start": 0, "end": 60, "value": 2}], "status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(int(state["status"]))  # type: ignore[call-overload]
            self.end_headers()
            self.wfile.write(json.dumps(state["body"]).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_port}/prices"
    yield state
    server.shutdown()


def test_an_endpoint_is_read_again_and_one_that_fails_defers_nothing(
    endpoint: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    prices = PriceSignal(str(endpoint["url"]), refresh_s=60)
    assert prices.deferral(0, margin_s=1).signal == build_signal([(0, 60, 2)], source="x")
    endpoint["status"] = 503
    assert prices.current(30) is not None  # not read again before refresh_s
    prices.current(60)  # read again, in a thread of its own: the pass goes on with what it had
    prices.join(5)
    deferral = prices.deferral(61, margin_s=1)
    assert deferral.signal is None and deferral.unavailable.startswith(
        f"price signal {endpoint['url']} cannot be read"
    )
    assert "deferrable jobs start like any other job" in caplog.text
    endpoint["status"] = 200
    prices.current(120)
    prices.join(5)
    assert prices.current(121) is not None and prices.problem == ""


def test_a_bad_signal_file_stops_the_start_with_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "none.csv"
    with pytest.raises(SignalError, match=f"price signal {missing} cannot be read: .*No such file"):
        read_signal(str(missing), timeout_s=1)
    check_at_start("http://127.0.0.1:9/prices")  # an endpoint is only read at run time
    bad = tmp_path / "prices.csv"
    bad.write_text("start,end,value\n1,2,free\n")
    result = CliRunner().invoke(app, ["serve"], env={"APIARY_PRICE_SIGNAL": str(bad)})
    assert result.exit_code == 2
    assert f"bad configuration: price signal {bad}, interval 1: value 'free' is not a number" in result.output
    assert "Traceback" not in result.output
