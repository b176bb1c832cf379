"""The one fake cluster: a backend for tests and benchmarks where Ray is not under test. Same
interface as `RayBackend`.

Tests drive each submission's status themselves (it starts PENDING) and read what was submitted (the
launch request, its report token, its environment). Benchmarks take `FakeBackend.running(...)`: every
job submitted is RUNNING at once, until stopped, and nothing is read back from the handoff."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from service.capacity import ClusterSnapshot, NodeCapacity
from service.cluster import ClusterBackend, RayJobInfo, RayJobStatus
from service.contract.errors import ClusterUnavailable
from service.contract.handoff import read_launch, read_token
from service.contract.protocol import LAUNCH_ENV_VAR, LAUNCH_MODULE, LaunchPointer, LaunchRequest
from service.contract.spec import is_spot_node


@dataclass
class FakeBackend:
    nodes: list[dict[str, float]] = field(default_factory=lambda: [{"CPU": 8.0}])
    statuses: dict[str, RayJobStatus] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    submitted: list[tuple[str, LaunchRequest]] = field(default_factory=list)
    # Each submission's report token, read from its handoff folder as its trainers would.
    tokens: dict[str, str] = field(default_factory=dict)
    environments: dict[str, dict[str, str]] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    # The nodes' ids, in the order of `nodes` (past its end: `fake_node_id(index)`), so that a test can
    # replace a node by a new one.
    node_ids: list[str] = field(default_factory=list)
    # Ray's node drains: node id -> deadline (Unix seconds; None: none given).
    draining: dict[str, float | None] = field(default_factory=dict)
    available: bool = True
    # The runtime_env of the last submission.
    env_vars: dict[str, str] = field(default_factory=dict)
    py_modules: list[str] | None = None
    working_dir: str | None = None
    # A real cluster to read capacity from (instead of `nodes`), where capacity is under test and
    # running the jobs is not.
    capacity: ClusterBackend | None = None
    # Benchmarks: a submission is RUNNING at once and its handoff is not read; an unknown one is `unknown`.
    run_at_once: bool = False
    departed: tuple[tuple[str, str], ...] = ()  # dead nodes, with Ray's message (ClusterSnapshot.departed)
    unknown: RayJobStatus = RayJobStatus.MISSING

    @classmethod
    def running(cls, *, nodes: int = 1, node: dict[str, float] | None = None) -> FakeBackend:
        """`nodes` alike nodes (default 4 CPUs each), where every job runs from its submission on."""
        return cls(
            nodes=[dict(node or {"CPU": 4.0}) for _ in range(nodes)],
            run_at_once=True,
            unknown=RayJobStatus.RUNNING,
        )

    def snapshot(self) -> ClusterSnapshot:
        if not self.available:
            raise ClusterUnavailable("fake cluster is down")
        if self.capacity is not None:
            return self.capacity.snapshot()
        return ClusterSnapshot(
            # A node with the custom resource `spot` is a spot node (service.contract.spec.is_spot_node).
            nodes=tuple(
                NodeCapacity(node_id=self.node_id(i), resources=r, spot=is_spot_node({}, r))
                for i, r in enumerate(self.nodes)
            ),
            departed=self.departed,
        )

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        env_vars: dict[str, str],
        py_modules: list[str] | None = None,
        working_dir: str | None = None,
    ) -> None:
        if self.run_at_once:
            self.statuses[submission_id] = RayJobStatus.RUNNING
            return
        assert entrypoint.endswith(f"-m {LAUNCH_MODULE}")
        pointer = LaunchPointer.model_validate(json.loads(env_vars[LAUNCH_ENV_VAR]))
        self.submitted.append((submission_id, read_launch(pointer)))
        self.tokens[submission_id] = read_token(pointer)
        self.environments[submission_id] = dict(env_vars)
        self.env_vars, self.py_modules, self.working_dir = dict(env_vars), py_modules, working_dir
        self.statuses[submission_id] = RayJobStatus.PENDING

    def job_info(self, submission_id: str) -> RayJobInfo:
        return RayJobInfo(status=self.statuses.get(submission_id, self.unknown))

    def job_logs(self, submission_id: str) -> str:
        return self.logs.get(submission_id, "")

    def submissions(self, prefix: str) -> list[str]:
        return [sid for sid in self.statuses if sid.startswith(prefix)]

    def stop(self, submission_id: str) -> None:
        self.stopped.append(submission_id)
        self.statuses[submission_id] = RayJobStatus.STOPPED

    def node_id(self, index: int) -> str:
        return self.node_ids[index] if index < len(self.node_ids) else fake_node_id(index)

    def draining_nodes(self) -> dict[str, float | None]:
        if not self.available:
            raise ClusterUnavailable("fake cluster is down")
        return dict(self.draining)

    def drain_node(self, node_id: str, *, deadline_at: float, reason: str) -> str | None:
        if not self.available:
            raise ClusterUnavailable("fake cluster is down")
        self.draining[node_id] = deadline_at
        return None

    def submission_of(self, job_id: int) -> str:
        return next(sid for sid, launch in self.submitted if launch.job_id == job_id)

    def report_headers(self, job_id: int) -> dict[str, str]:
        """The telemetry headers of the job's latest attempt, as its trainers send them."""
        submission_id = next(sid for sid, launch in reversed(self.submitted) if launch.job_id == job_id)
        return {"authorization": f"Bearer {self.tokens[submission_id]}"}


def fake_node_id(index: int) -> str:
    """A node id shaped like Ray's (56 hex digits), the same for the same index."""
    return hashlib.sha224(f"node-{index}".encode()).hexdigest()
