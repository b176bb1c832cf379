"""What a rank's process uses (`trainers.system`), read from this very process, and carried by its
telemetry (`trainers.telemetry`) to a real HTTP server."""

from __future__ import annotations

import os
import sys
import time
import types

import pytest

from service.contract.protocol import MAX_VALUES_PER_POINT, SYSTEM_PREFIX, SystemStats
from tests.support.telemetry import TelemetryServer
from trainers import system
from trainers.system import SystemSampler, count_data_read, net_bytes
from trainers.telemetry import Telemetry

# /proc/net/dev's layout (two header lines, then `name: 8 receive counters, 8 transmit counters`).
PROC_NET_DEV = """Inter-|   Receive |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier
    lo: 9000000 100 0 0 0 0 0 0 9000000 100 0 0 0 0 0 0
  eth0:    1500  10 0 0 0 0 0 0     700   5 0 0 0 0 0 0
  ens5:2500       3 0 0 0 0 0 0     300   2 0 0 0 0 0 0
"""


def test_network_bytes_sum_the_interfaces_but_loopback() -> None:
    assert net_bytes(PROC_NET_DEV) == (700 + 300, 1500 + 2500)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sample_measures_this_processs_cpu_memory_and_data_over_the_interval() -> None:
    sampler = SystemSampler()
    before = sampler.sample()
    held = bytearray(64 * 1024 * 1024)  # touched: resident
    for index in range(0, len(held), 4096):
        held[index] = 1
    count_data_read(3_000_000)
    started = time.process_time()
    while time.process_time() - started < 0.3:  # one core busy
        pass
    after = sampler.sample()

    assert after.rss_bytes is not None and before.rss_bytes is not None
    assert after.rss_bytes - before.rss_bytes >= 48 * 1024 * 1024
    # The CPU time it accounts for is at least the 0.3 s burned, whatever the machine's load.
    elapsed = after.sampled_at - before.sampled_at
    assert after.cpu_percent is not None
    assert 0.3 <= after.cpu_percent / 100 * elapsed <= elapsed * (os.cpu_count() or 1) + 0.05
    assert after.data_read_bytes - before.data_read_bytes == 3_000_000
    assert after.data_read_bytes_per_s == pytest.approx(3_000_000 / elapsed, rel=0.1)
    assert after.net_sent_bytes is not None and after.net_sent_bytes_per_s is not None
    # No CUDA in this process: no GPU figures, and sampling did not start CUDA.
    assert after.gpu_utilization_percent is None and after.gpu_memory_bytes is None
    torch = sys.modules.get("torch")
    assert torch is None or not torch.cuda.is_initialized()
    del held


class FakeCuda:
    """torch.cuda as a rank on a GPU sees it (no GPU here): device 1 in use, NVML answering or not."""

    def __init__(self, *, nvml: bool) -> None:
        self.nvml = nvml

    def is_initialized(self) -> bool:
        return True

    def memory_reserved(self, index: int) -> int:
        return {1: 3 * 1024**3}[index]

    def utilization(self, index: int) -> int:
        if not self.nvml:
            raise ModuleNotFoundError("pynvml")
        return {1: 87}[index]


@pytest.mark.parametrize("nvml", [True, False])
def test_a_rank_on_a_gpu_samples_its_devices_utilization_and_memory(
    monkeypatch: pytest.MonkeyPatch, nvml: bool
) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=FakeCuda(nvml=nvml)))
    sampler = SystemSampler()
    sampler.cuda_device = 1  # the rank's device, as the training context sets it
    stats = sampler.sample()
    assert stats.gpu_memory_bytes == 3 * 1024**3
    assert stats.gpu_utilization_percent == (87.0 if nvml else None)  # without NVML: memory only
    values = stats.point_values()
    assert values[f"{SYSTEM_PREFIX}gpu_memory_bytes"] == 3 * 1024**3
    assert (f"{SYSTEM_PREFIX}gpu_utilization_percent" in values) is nvml


def test_a_second_sample_within_the_interval_is_the_same_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "MIN_INTERVAL_S", 60.0)
    sampler = SystemSampler()
    first, fresh = sampler.latest()
    again, fresh_again = sampler.latest()
    assert fresh and not fresh_again and again is first
    monkeypatch.setattr(system, "MIN_INTERVAL_S", 0.0)
    assert sampler.latest()[1]


def test_the_point_figures_are_the_known_ones_under_the_prefix() -> None:
    stats = SystemStats(sampled_at=1.0, cpu_percent=150.0, rss_bytes=1024, data_read_bytes=10)
    assert stats.point_values() == {"sys_cpu_percent": 150.0, "sys_rss_bytes": 1024.0}


def test_posts_carry_the_ranks_system_figures_and_its_newest_point_too(
    telemetry_server: TelemetryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(system, "MIN_INTERVAL_S", 60.0)  # one sample for the whole test
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=1)
    count_data_read(1234)
    for step in (1, 2):
        sender.record(step, {"loss": 1.0})
    assert sender.flush()
    sender.record(3, {"loss": 1.0})
    assert sender.flush()
    sender.close()

    first, second = telemetry_server.batches
    status = first["status"]["system"]
    assert status["rss_bytes"] > 0 and status["data_read_bytes"] >= 1234
    assert second["status"]["system"] == status  # not sampled again within the interval
    figures = {name: value for name, value in first["points"][-1]["values"].items() if name != "loss"}
    assert figures and all(name.startswith(SYSTEM_PREFIX) for name in figures)
    assert figures[f"{SYSTEM_PREFIX}rss_bytes"] == status["rss_bytes"]
    # Only the post that took the sample carries it on a point: the figures are not repeated.
    assert [set(p["values"]) for p in (*first["points"][:-1], *second["points"])] == [{"loss"}, {"loss"}]


def test_a_point_with_the_most_values_goes_without_the_figures(telemetry_server: TelemetryServer) -> None:
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0)
    full = {f"m{index}": 1.0 for index in range(MAX_VALUES_PER_POINT)}
    sender.record(1, full)
    assert sender.flush()
    sender.close()
    (batch,) = telemetry_server.batches
    assert batch["points"][0]["values"] == full
    assert batch["status"]["system"]["rss_bytes"] > 0


def test_a_sampler_that_fails_leaves_the_figures_out_not_the_post(
    telemetry_server: TelemetryServer, caplog: pytest.LogCaptureFixture
) -> None:
    sender = Telemetry(url=telemetry_server.url, attempt=1, rank=0)

    def broken() -> tuple[SystemStats, bool]:
        raise OSError("no /proc here")

    sender.system.latest = broken  # type: ignore[method-assign]
    sender.record(1, {"loss": 1.0})
    assert sender.flush()
    sender.close()
    (batch,) = telemetry_server.batches
    assert batch["status"]["system"] is None and batch["points"][0]["values"] == {"loss": 1.0}
    assert "cannot sample this rank's system figures" in caplog.text
