"""The trace suite (benchmarks/traces): every trace reads cleanly, its manifest entry matches it, and
a slice of a real window replays under every policy with the invariants checked."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from service.contract.queues import load
from service.scheduling.simulate import POLICIES, limits, parse_node, read_trace, simulate

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
SUITE = json.loads((TRACES / "suite.json").read_text())["traces"]
FILES = [entry for entry in SUITE if "trace" in entry]


def test_the_suite_has_real_windows_and_generated_shapes_in_both_subsets() -> None:
    assert len(FILES) >= 6 and len(SUITE) - len(FILES) >= 3
    assert {entry["subset"] for entry in SUITE} == {"tune", "held-out"}
    research = [entry["research_load"] for entry in FILES]
    assert min(research) < 0.05 and max(research) > 0.4  # from a few percent to ~45% of the load
    assert (TRACES / "LICENSE-elasticflow-traces").exists()
    assert sum(path.stat().st_size for path in TRACES.iterdir()) < 5 * 2**20


@pytest.mark.parametrize("entry", FILES, ids=[entry["name"] for entry in FILES])
def test_a_trace_file_reads_cleanly_and_matches_its_manifest(entry: dict[str, object]) -> None:
    with gzip.open(TRACES / str(entry["trace"]), "rt", newline="") as source:
        jobs = read_trace(source, nodes=int(str(entry["nodes"])), node=parse_node(str(entry["node"])))
    assert len(jobs) == entry["jobs"]
    queues = load(TRACES / str(entry["queues"]))
    cut = sum(1 for job in jobs if (limit := limits(job, queues)[1]) is not None and job.duration_s > limit)
    refused = sum(1 for job in jobs if limits(job, queues)[0] is not None)
    assert refused == 0 and cut == entry["limits_touch"]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_slice_of_a_real_window_replays_with_the_invariants_checked(policy: str) -> None:
    entry = next(entry for entry in FILES if entry["name"] == "itp-c02-d0-fs8")
    with gzip.open(TRACES / str(entry["trace"]), "rt", newline="") as source:
        jobs = list(itertools.islice(read_trace(source), 150))
    result = simulate(
        jobs,
        nodes=int(str(entry["nodes"])),
        node=parse_node(str(entry["node"])),
        policy=policy,
        queues=load(TRACES / str(entry["queues"])),
        check=True,
    )
    assert result.unfinished == 0 and result.queues["research"].wait.jobs > 0
