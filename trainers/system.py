"""What a rank's process uses (`service.contract.protocol.SystemStats`), sampled by its telemetry thread.

`Telemetry` samples once per post, at most once a `MIN_INTERVAL_S` (the status cadence: about a
second while points flow, every heartbeat otherwise), never on the training thread. Each figure is
read where it is cheap and needs no extra package:

- CPU: the process's user and system time (`os.times`, every thread) over the wall time since the
  previous sample, in percent of one core;
- RSS: the resident pages of `/proc/self/statm` (None without /proc);
- GPU, only when CUDA is already initialized in the process (sampling never creates a CUDA
  context), of device `cuda_device` (the training context sets the rank's; by default the first
  visible one, which Ray Train makes the worker's own): the memory torch's caching allocator holds
  (`torch.cuda.memory_reserved`), and the device's utilization from `torch.cuda.utilization`, which
  asks NVML (None where pynvml is not installed);
- data: the bytes of the Arrow blocks this process's data streams received from Ray Data
  (`count_data_read`, called by `trainers.data_stream`), a process-wide total;
- network: `/proc/net/dev`, summed over the interfaces other than loopback (the node's network
  namespace: ranks on one node see the same counters).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

from service.contract.protocol import SystemStats

logger = logging.getLogger(__name__)

# A sample younger than this is reused (several posts in a row would measure rates over milliseconds).
MIN_INTERVAL_S = 1.0
# Rates over a shorter interval than this are left out (None): they would be mostly noise.
MIN_RATE_INTERVAL_S = 0.05
PROC = Path("/proc")

_data_lock = threading.Lock()
_data_read_bytes = 0


def count_data_read(num_bytes: int) -> None:
    """The data pipeline received `num_bytes` more (any thread)."""
    global _data_read_bytes
    with _data_lock:
        _data_read_bytes += num_bytes


def data_read_bytes() -> int:
    with _data_lock:
        return _data_read_bytes


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def rss_bytes(proc: Path = PROC) -> int | None:
    try:
        resident = int((proc / "self" / "statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident * os.sysconf("SC_PAGE_SIZE")


def net_bytes(text: str) -> tuple[int, int]:
    """(sent, received) bytes summed over the interfaces of a `/proc/net/dev` text, less loopback."""
    sent = received = 0
    for line in text.splitlines()[2:]:  # two header lines
        name, _, counters = line.partition(":")
        fields = counters.split()
        if name.strip() == "lo" or len(fields) < 9:
            continue
        received += int(fields[0])
        sent += int(fields[8])
    return sent, received


def _read_net(proc: Path) -> tuple[int, int] | None:
    try:
        return net_bytes((proc / "net" / "dev").read_text())
    except (OSError, ValueError):
        return None


def _gpu(index: int) -> tuple[float | None, int | None]:
    """(utilization %, memory held) of CUDA device `index`, when this process already uses CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None, None
    memory = int(torch.cuda.memory_reserved(index))
    try:
        utilization: float | None = float(torch.cuda.utilization(index))
    except Exception:  # no NVML (pynvml) or a driver that does not answer: memory only
        utilization = None
    return utilization, memory


def _rate(now: float | None, before: float | None, seconds: float) -> float | None:
    if now is None or before is None or seconds < MIN_RATE_INTERVAL_S:
        return None
    return max(0.0, (now - before) / seconds)


class SystemSampler:
    """Samples this process; rates are over the time since the previous sample (or construction)."""

    def __init__(self, *, proc: Path = PROC) -> None:
        self.proc = proc
        self.cuda_device = 0  # the rank's device, set by the training context when it trains on CUDA
        self._last: SystemStats | None = None
        self._wall = time.monotonic()
        self._cpu = cpu_seconds()
        self._data = data_read_bytes()
        net = _read_net(proc)
        self._net_sent: int | None = net[0] if net is not None else None
        self._net_recv: int | None = net[1] if net is not None else None

    def sample(self) -> SystemStats:
        wall, cpu, data, net = time.monotonic(), cpu_seconds(), data_read_bytes(), _read_net(self.proc)
        sent, received = net if net is not None else (None, None)
        seconds = wall - self._wall
        utilization, gpu_memory = _gpu(self.cuda_device)
        stats = SystemStats(
            sampled_at=time.time(),
            cpu_percent=None if (busy := _rate(cpu, self._cpu, seconds)) is None else 100 * busy,
            rss_bytes=rss_bytes(self.proc),
            gpu_utilization_percent=utilization,
            gpu_memory_bytes=gpu_memory,
            data_read_bytes=data,
            data_read_bytes_per_s=_rate(data, self._data, seconds),
            net_sent_bytes=sent,
            net_recv_bytes=received,
            net_sent_bytes_per_s=_rate(sent, self._net_sent, seconds),
            net_recv_bytes_per_s=_rate(received, self._net_recv, seconds),
        )
        self._wall, self._cpu, self._data = wall, cpu, data
        self._net_sent, self._net_recv = sent, received
        self._last = stats
        return stats

    def latest(self) -> tuple[SystemStats, bool]:
        """A sample at most `MIN_INTERVAL_S` old, and whether it was taken now."""
        if self._last is not None and time.monotonic() - self._wall < MIN_INTERVAL_S:
            return self._last, False
        return self.sample(), True
