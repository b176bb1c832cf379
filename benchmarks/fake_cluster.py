"""The cluster the benchmarks use where Ray is not what they measure: fixed nodes, and every job
submitted is RUNNING at once (until stopped). Same interface as `service.cluster.RayBackend`."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.capacity import ClusterSnapshot, NodeCapacity
from service.cluster import RayJobInfo, RayJobStatus


@dataclass
class FakeCluster:
    nodes: int = 1
    node: dict[str, float] = field(default_factory=lambda: {"CPU": 4.0})
    statuses: dict[str, RayJobStatus] = field(default_factory=dict)

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            nodes=tuple(NodeCapacity(node_id=f"n{i}", resources=self.node) for i in range(self.nodes))
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
        self.statuses[submission_id] = RayJobStatus.RUNNING

    def job_info(self, submission_id: str) -> RayJobInfo:
        return RayJobInfo(status=self.statuses.get(submission_id, RayJobStatus.RUNNING))

    def job_logs(self, submission_id: str) -> str:
        return ""

    def submissions(self, prefix: str) -> list[str]:
        return [sid for sid in self.statuses if sid.startswith(prefix)]

    def stop(self, submission_id: str) -> None:
        self.statuses[submission_id] = RayJobStatus.STOPPED
