"""Ray, as the service sees it: a cluster to start or join, capacity to read, jobs to submit.

`RayBackend` talks to any Ray cluster through its dashboard's HTTP APIs (Jobs API,
State API and the cluster status), so the service never becomes a Ray driver itself.
Capacity is each alive node's total (State API) and what Ray reports in use on it
by anyone: the autoscaler monitor's load report (`/api/cluster_status`, rewritten
every few seconds), from which the policy tells other Ray users' use from
Apiary's own (service.scheduling.policy glossary: foreign use). `LocalRay`
starts the embedded default: `ray start --head --block` as its own process
group, with explicit free ports (Redis may hold 6379), its temp folder under the
data dir and more logical CPUs than cores (so Ray Data's read tasks run beside
the train workers). It outlives a crash of the service (a restarted service
finds it again through `ray_cluster.json`) and stops on a clean shutdown.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from service.capacity import ClusterSnapshot, NodeCapacity, format_resources
from service.contract.errors import ClusterUnavailable
from service.contract.spec import is_spot_node
from service.ray_drains import GcsDrains

if TYPE_CHECKING:
    from ray.util.state.common import NodeState

logger = logging.getLogger(__name__)


class RayJobStatus(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    MISSING = "MISSING"  # the cluster does not know the submission (e.g. it was restarted)


@dataclass(frozen=True, kw_only=True)
class RayJobInfo:
    status: RayJobStatus
    message: str = ""


class ClusterBackend(Protocol):
    """What the scheduler needs from a cluster. `RayBackend` is the real one."""

    def snapshot(self) -> ClusterSnapshot: ...

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        env_vars: dict[str, str],
        py_modules: list[str] | None = None,
        working_dir: str | None = None,
    ) -> None: ...

    def job_info(self, submission_id: str) -> RayJobInfo: ...

    def job_logs(self, submission_id: str) -> str: ...

    def submissions(self, prefix: str) -> list[str]: ...

    def stop(self, submission_id: str) -> None: ...

    def draining_nodes(self) -> dict[str, float | None]:
        """The nodes Ray drains: node id -> the Unix time by which each goes (None: no deadline)."""
        ...

    def drain_node(self, node_id: str, *, deadline_at: float, reason: str) -> str | None:
        """Ask Ray to drain a node by `deadline_at`: None when it accepted, else why not."""
        ...


class CurrentBackend:
    """The one holder of the service's cluster backend: the job service, the scheduler and the routes
    all talk to this, and a restarted local Ray is swapped in here (`switch`), once for all of them."""

    def __init__(self, backend: ClusterBackend) -> None:
        self.current = backend

    def switch(self, backend: ClusterBackend) -> None:
        self.current = backend

    def snapshot(self) -> ClusterSnapshot:
        return self.current.snapshot()

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        env_vars: dict[str, str],
        py_modules: list[str] | None = None,
        working_dir: str | None = None,
    ) -> None:
        self.current.submit(
            submission_id=submission_id,
            entrypoint=entrypoint,
            env_vars=env_vars,
            py_modules=py_modules,
            working_dir=working_dir,
        )

    def job_info(self, submission_id: str) -> RayJobInfo:
        return self.current.job_info(submission_id)

    def job_logs(self, submission_id: str) -> str:
        return self.current.job_logs(submission_id)

    def submissions(self, prefix: str) -> list[str]:
        return self.current.submissions(prefix)

    def stop(self, submission_id: str) -> None:
        self.current.stop(submission_id)

    def draining_nodes(self) -> dict[str, float | None]:
        return self.current.draining_nodes()

    def drain_node(self, node_id: str, *, deadline_at: float, reason: str) -> str | None:
        return self.current.drain_node(node_id, deadline_at=deadline_at, reason=reason)


class RayBackend:
    def __init__(
        self,
        dashboard_url: str,
        *,
        auth_token_path: Path | None = None,
        auth_token: str | None = None,
        gcs_address: str | None = None,
    ) -> None:
        """`auth_token_path` (the local Ray's file) or `auth_token` (APIARY_RAY_AUTH_TOKEN): the token
        of a cluster with Ray's token auth, sent as `Authorization: Bearer` on every Jobs and State
        API call. `gcs_address` (host:port, APIARY_RAY_GCS_ADDRESS for an existing cluster): where node
        drains are read and asked for (service.ray_drains); without it, none are seen from Ray."""
        if auth_token_path is not None:
            # Ray's clients read these from the environment (some of it once, when Ray is first
            # imported): this process talks to this one cluster.
            os.environ.update(auth_env(auth_token_path))
        elif auth_token is not None:
            os.environ.update(token_auth_env(auth_token))
        from ray.job_submission import JobSubmissionClient

        self.dashboard_url = dashboard_url.rstrip("/")
        token = auth_token_path.read_text().strip() if auth_token_path is not None else auth_token
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._usage_problem: str | None = None  # why Ray's use is not known, as last logged
        self._drains = GcsDrains(gcs_address) if gcs_address else None
        try:
            self._jobs = JobSubmissionClient(self.dashboard_url)
        except Exception as err:  # Ray raises plain exceptions (ConnectionError, RuntimeError)
            raise ClusterUnavailable(
                f"cannot reach the Ray dashboard at {self.dashboard_url}: {err}"
            ) from err

    def snapshot(self) -> ClusterSnapshot:
        from ray.util.state import list_nodes

        try:
            nodes = list_nodes(address=self.dashboard_url, detail=True, raise_on_missing_output=False)
        except Exception as err:
            raise ClusterUnavailable(f"cannot list Ray nodes at {self.dashboard_url}: {err}") from err
        alive = [node for node in nodes if node.state == "ALIVE"]
        report = self._load_report()
        by_key = _report_keys(alive, report)
        return ClusterSnapshot(
            nodes=tuple(
                NodeCapacity(
                    node_id=node.node_id,
                    resources=(total := _schedulable(node.resources_total or {})),
                    used=_node_used(total, by_key.get(node.node_id)),
                    spot=is_spot_node(node.labels or {}, total),
                )
                for node in alive
            ),
            pending=_pending_demand(report),
            departed=tuple(
                (node.node_id, node.state_message or "") for node in nodes if node.state == "DEAD"
            ),
        )

    def _load_report(self) -> Mapping[str, object]:
        """The autoscaler monitor's load report, or {} (logged once) where there is none: then capacity
        is the total less Apiary's own gangs, as before shared clusters were seen."""
        problem = None
        report: Mapping[str, object] = {}
        try:
            response = httpx.get(
                f"{self.dashboard_url}/api/cluster_status", headers=self._headers, timeout=10
            )
            response.raise_for_status()
            status = response.json()["data"].get("clusterStatus") or {}
            report = status.get("loadMetricsReport") or {}
            age_s = time.time() - float(status.get("time", 0.0))
            if not report:
                # Autoscaler v2 (RAY_enable_autoscaler_v2) writes no such report.
                problem = "the Ray cluster's monitor publishes no load report"
            elif age_s > REPORT_MAX_AGE_S:
                problem, report = f"the Ray cluster's load report is {age_s:.0f} s old", {}
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as err:
            problem = f"cannot read the Ray cluster status at {self.dashboard_url}: {err}"
        if problem != self._usage_problem:
            if problem is not None:
                logger.warning(
                    "%s: capacity counts Apiary's own jobs only (other Ray users' use is not seen)",
                    problem,
                    extra={"action": "ray_usage_unknown"},
                )
            else:  # e.g. a fresh cluster's first report (the monitor writes it after a few seconds)
                logger.info(
                    "Ray's load report is read: other Ray users' use is seen",
                    extra={"action": "ray_usage_known"},
                )
            self._usage_problem = problem
        return report

    def wait_for_nodes(self, timeout_s: float = 60) -> ClusterSnapshot:
        """A fresh cluster's dashboard answers a moment before its head node registers."""
        deadline = time.monotonic() + timeout_s
        while not (snapshot := self.snapshot()).nodes:
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"the Ray cluster at {self.dashboard_url} has no alive node")
            time.sleep(0.3)
        return snapshot

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        env_vars: dict[str, str],
        py_modules: list[str] | None = None,
        working_dir: str | None = None,
    ) -> None:
        """`py_modules`: local package folders that Ray uploads (once per content) and puts on the
        path of the job's driver, workers and tasks, on every node. `working_dir`: the job's own code,
        a local zip (service.code) that Ray uploads the same way and unpacks on every node as the
        working folder of those processes, on their path after the `py_modules`."""
        runtime_env: dict[str, object] = {"env_vars": env_vars}
        if py_modules:
            runtime_env |= {"py_modules": py_modules, "excludes": ["__pycache__"]}
        if working_dir:
            runtime_env["working_dir"] = working_dir
        # The driver takes no CPU: the gang's resources are the workers' and Ray Data's.
        self._jobs.submit_job(
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env=runtime_env,
            entrypoint_num_cpus=0,
        )

    def job_info(self, submission_id: str) -> RayJobInfo:
        try:
            info = self._jobs.get_job_info(submission_id)
        except RuntimeError as err:
            if "does not exist" in str(err) or "404" in str(err):
                return RayJobInfo(status=RayJobStatus.MISSING, message=str(err))
            raise ClusterUnavailable(f"cannot read Ray job {submission_id}: {err}") from err
        except Exception as err:
            raise ClusterUnavailable(f"cannot read Ray job {submission_id}: {err}") from err
        return RayJobInfo(status=RayJobStatus(str(info.status)), message=info.message or "")

    def job_logs(self, submission_id: str) -> str:
        try:
            return str(self._jobs.get_job_logs(submission_id))
        except Exception as err:
            logger.warning("cannot read logs of Ray job %s: %s", submission_id, err)
            return ""

    def submissions(self, prefix: str) -> list[str]:
        """The submission ids the cluster knows that start with `prefix` (oldest first)."""
        try:
            jobs = self._jobs.list_jobs()
        except Exception as err:
            raise ClusterUnavailable(f"cannot list Ray jobs at {self.dashboard_url}: {err}") from err
        found = [job for job in jobs if (job.submission_id or "").startswith(prefix)]
        return [str(job.submission_id) for job in sorted(found, key=lambda job: job.start_time or 0)]

    def stop(self, submission_id: str) -> None:
        try:
            self._jobs.stop_job(submission_id)
        except Exception as err:
            raise ClusterUnavailable(f"cannot stop Ray job {submission_id}: {err}") from err

    def draining_nodes(self) -> dict[str, float | None]:
        return self._drains.draining() if self._drains is not None else {}

    def drain_node(self, node_id: str, *, deadline_at: float, reason: str) -> str | None:
        if self._drains is None:
            return "the Ray cluster's GCS address is not known (APIARY_RAY_GCS_ADDRESS)"
        return self._drains.drain(node_id, deadline_at=deadline_at, reason=reason)


def retired_idle(message: str) -> bool:
    """Whether Ray's message on a dead node says the autoscaler retired it as idle (death reason
    AUTOSCALER_DRAIN_IDLE, in the words of Ray 2.60's `ray.dashboard.utils.compose_state_message`), not
    that it was taken back or failed."""
    return message.startswith("Terminated due to idle")


def submission_prefix(job_id: int, attempt: int) -> str:
    """The start of the Ray submission id of a job's attempt (the scheduler adds a random suffix), by
    which an earlier attempt's Ray job is found again: the job row holds only the current one."""
    return f"apiary-job-{job_id}-attempt-{attempt}-"


def stop_job(backend: ClusterBackend, submission_id: str) -> None:
    """Ask Ray to stop a job. A cluster that cannot be reached is logged, not raised: the caller's
    database change stands (a job Apiary still tracks is stopped again by the reconciler)."""
    try:
        backend.stop(submission_id)
    except ClusterUnavailable as err:
        logger.error(
            "could not stop Ray job %s: %s",
            submission_id,
            err,
            extra={"action": "ray_stop_failed", "submission_id": submission_id},
        )


# Older than this, Ray's load report (rewritten every AUTOSCALER_UPDATE_INTERVAL_S, 5 s by default) is
# a monitor that stopped: ignored. Generous, as the head's clock and the service's may differ a little.
REPORT_MAX_AGE_S = 60.0


def _report_keys(nodes: list[NodeState], report: Mapping[str, object]) -> dict[str, Mapping[str, object]]:
    """Node id -> its entry of the report's `usageByNode`, which Ray keys by node id (`ray start`
    clusters) or by node IP (cloud providers, KubeRay: an IP shared by two nodes is not attributed)."""
    usage = report.get("usageByNode")
    if not isinstance(usage, Mapping):
        return {}
    ips = Counter(node.node_ip for node in nodes)
    found = {}
    for node in nodes:
        entry = usage.get(node.node_id)
        if entry is None and ips[node.node_ip] == 1:
            entry = usage.get(node.node_ip)
        if isinstance(entry, Mapping):
            found[node.node_id] = entry
    return found


def _node_used(total: Mapping[str, float], entry: Mapping[str, object] | None) -> dict[str, float] | None:
    """What the report says is in use of each of the node's resources (its `[used, total]` pairs),
    None when the node is not in it. The dashboard camelCases the report's keys, resource names
    included (`my_res` comes as `myRes`): each is matched through the node's own names."""
    if entry is None:
        return None
    used = {}
    for key, amount in total.items():
        pair = entry.get(_camel_case(key))
        in_use = float(pair[0]) if isinstance(pair, list) and pair else 0.0
        used[key] = min(max(0.0, in_use), amount)
    return used


def _camel_case(name: str) -> str:
    # What the dashboard's rest_response does to every key (ray.dashboard.utils.to_camel_case).
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


def _pending_demand(report: Mapping[str, object]) -> tuple[str, ...]:
    """The report's demand that Ray cannot place yet, as text: tasks and actors (`resourceDemand`),
    placement groups (`pgDemand`) and `ray.autoscaler.sdk.request_resources` (`requestDemand`).
    Their resource names come as Ray spells them (the dashboard leaves dicts inside lists alone)."""

    def bundles(value: object) -> str:
        return ", ".join(f"{count} x {format_resources(bundle)}" for bundle, count in _counted(value))

    pending = [
        f"{count} task(s)/actor(s) of {format_resources(bundle)}"
        for bundle, count in _counted(report.get("resourceDemand"))
    ]
    pending += [
        f"{count} placement group(s) {group.get('strategy', '?')} of [{bundles(group.get('bundles'))}]"
        for group, count in _counted(report.get("pgDemand"))
    ]
    pending += [
        f"{count} request(s) (request_resources) of {format_resources(bundle)}"
        for bundle, count in _counted(report.get("requestDemand"))
    ]
    return tuple(pending)


def _counted(value: object) -> list[tuple[Mapping[str, Any], int]]:
    """The report's `[[item, count], ...]` lists, skipping what does not have that shape."""
    if not isinstance(value, list):
        return []
    return [
        (entry[0], int(entry[1]))
        for entry in value
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], Mapping)
    ]


def _schedulable(resources: dict[str, float]) -> dict[str, float]:
    # Ray's bookkeeping resources (node:<ip>, memory, object store) are not what jobs ask for.
    return {
        key: value
        for key, value in resources.items()
        if not key.startswith("node:") and key not in ("memory", "object_store_memory")
    }


# ---------------------------------------------------------------------------------------------
# The embedded local Ray


_PORT_FLAGS = (
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
    "node-manager-port",
    "object-manager-port",
)


# The embedded local Ray is one machine serving one Apiary, usually with few cores: Ray settings that
# only cost CPU beside training there. Each applies unless the environment sets it already (an
# operator can turn any back on); a production cluster (KubeRay, `ray up`) keeps Ray's defaults.
LOCAL_RAY_ENV = {
    # Ray runs worker processes at nice 15, below its own daemons (raylet, GCS, dashboard) and the
    # API. On a machine whose cores the train workers fill, every wake-up of those then preempts a
    # rank, and DDP's all-reduce makes the other rank wait too (benchmarks/overhead.py shows the cost).
    "RAY_worker_niceness": "0",
    # One more actor process per job, watching for node drains (spot preemption): none on one machine.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # Apiary records its own per-step, per-rank metrics; Ray Train's and Ray Core's Prometheus
    # metrics cost every Ray process CPU for a dashboard page nobody reads here.
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    # Ray would prestart one worker process per CPU for the first job, which then idle (and poll)
    # for as long as the cluster runs.
    "RAY_prestart_worker_first_driver": "0",
    # Ray's log monitor lists the log folder for new files every 0.1 s until it holds 1000 files;
    # with this, every 0.5 s (LOG_NAME_UPDATE_INTERVAL_S). New workers' lines still all arrive.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    # On SIGTERM, `ray start --block` first drains its node for up to 30 s (for Ray Serve's replicas
    # on Kubernetes). Apiary has checkpointed and requeued its jobs before it stops its local Ray:
    # there is nothing to drain, and the wait made every clean stop of `apiary serve` ~15 s longer.
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
}


def local_ray_env(environ: Mapping[str, str], *, auth_token_path: Path) -> dict[str, str]:
    """The environment of the local Ray's processes: LOCAL_RAY_ENV under `environ`, then token auth."""
    env = {**LOCAL_RAY_ENV, **environ, **auth_env(auth_token_path)}
    env.pop("RAY_AUTH_TOKEN", None)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each stays bound until all are chosen (`free_port` twice in a row
    may name the same port, and Ray refuses to start when two of its components share one)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@dataclass(frozen=True, kw_only=True)
class LocalRay:
    """A local Ray head started by the service; `state_file` lets a restarted service find it."""

    pid: int
    gcs_address: str
    dashboard_url: str
    temp_dir: str
    auth_token_path: Path
    state_file: Path

    @classmethod
    def start_or_reuse(
        cls, *, data_dir: Path, num_cpus: int, withheld: Collection[str] = (), timeout_s: float = 90
    ) -> LocalRay:
        """`withheld`: the variables of the service's environment that the cluster's processes must not
        get (`Settings.local_ray_withheld_env`: the S3 credentials, which a job's driver redeems instead,
        service.contract.handoff): the raylet's environment reaches every process of every job."""
        state_file = data_dir / "ray_cluster.json"
        existing = cls._load(state_file)
        if existing is not None and existing.is_alive():
            logger.info(
                "reusing local Ray at %s (pid %s)",
                existing.dashboard_url,
                existing.pid,
                extra={"action": "ray_reused"},
            )
            return existing
        return cls._start(
            data_dir=data_dir,
            state_file=state_file,
            num_cpus=num_cpus,
            withheld=withheld,
            timeout_s=timeout_s,
        )

    @classmethod
    def _start(
        cls, *, data_dir: Path, state_file: Path, num_cpus: int, withheld: Collection[str], timeout_s: float
    ) -> LocalRay:
        ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
        if ray_bin is None:
            raise ClusterUnavailable("the `ray` command is not installed in Apiary's environment")
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        temp_dir = local_ray_temp_dir(data_dir)
        log_path = data_dir / "ray.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        temp_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp_dir.parent.chmod(0o700)
        auth_token_path = _ensure_auth_token(data_dir / LOCAL_RAY_TOKEN_FILE)
        command = [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--num-cpus={num_cpus}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            *[f"--{flag}={port}" for flag, port in ports.items()],
        ]
        # Token auth on (Ray binds beyond loopback), with a token of this data dir's own: the
        # service's client and every job driver (which inherits the raylet's environment) use it.
        environ = {key: value for key, value in os.environ.items() if key not in withheld}
        env = local_ray_env(environ, auth_token_path=auth_token_path)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: it survives a crash of the service
            )
        cluster = cls(
            pid=process.pid,
            gcs_address=f"127.0.0.1:{ports['port']}",
            dashboard_url=f"http://127.0.0.1:{ports['dashboard-port']}",
            temp_dir=str(temp_dir),
            auth_token_path=auth_token_path,
            state_file=state_file,
        )
        deadline = time.monotonic() + timeout_s
        while not cluster._dashboard_ready():
            if process.poll() is not None:
                raise ClusterUnavailable(f"local Ray exited with {process.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                cluster.stop()
                raise ClusterUnavailable(f"local Ray did not start within {timeout_s:.0f} s; see {log_path}")
            time.sleep(0.3)
        cluster._save()
        logger.info(
            "started local Ray at %s (pid %s, %s CPUs)",
            cluster.dashboard_url,
            cluster.pid,
            num_cpus,
            extra={"action": "ray_started"},
        )
        return cluster

    @classmethod
    def _load(cls, state_file: Path) -> LocalRay | None:
        try:
            data = json.loads(state_file.read_text())
            return cls(
                pid=int(data["pid"]),
                gcs_address=data["gcs_address"],
                dashboard_url=data["dashboard_url"],
                temp_dir=data["temp_dir"],
                auth_token_path=Path(data["auth_token_path"]),
                state_file=state_file,
            )
        except (OSError, ValueError, KeyError):
            return None

    def _save(self) -> None:
        state = {key: str(value) for key, value in asdict(self).items() if key != "state_file"}
        self.state_file.write_text(json.dumps(state))

    def _dashboard_ready(self) -> bool:
        try:
            return httpx.get(f"{self.dashboard_url}/api/version", timeout=2).status_code in (200, 401, 403)
        except httpx.HTTPError:
            return False

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        return self._dashboard_ready()

    def stop(self, timeout_s: float = 15) -> None:
        """Stop this cluster only (never `ray stop`, which stops every Ray on the machine)."""
        with contextlib.suppress(ProcessLookupError):
            # `ray start --block` drains (up to 30 s with work left), then stops its processes; past
            # `timeout_s` the group is killed: nothing of Apiary's lives only in Ray's memory.
            os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and pid_running(self.pid):
                time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # whatever of the group is left (workers, agents)
        with contextlib.suppress(FileNotFoundError):
            self.state_file.unlink()
        logger.info("stopped local Ray (pid %s)", self.pid, extra={"action": "ray_stopped"})


def pid_running(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:
        pass  # not our child (a restarted service): fall back to a signal probe
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


# The local Ray's token, in the service's data dir.
LOCAL_RAY_TOKEN_FILE = "ray_auth_token"


def auth_env(token_path: Path) -> dict[str, str]:
    """What Ray's processes and clients need to use a cluster with this token."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def token_auth_env(token: str) -> dict[str, str]:
    """The same for a token given as a value (Ray reads RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def _ensure_auth_token(path: Path) -> Path:
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return path


def local_ray_temp_dir(data_dir: Path) -> Path:
    # Ray puts unix sockets at {temp_dir}/session_<date>_<pid>/sockets/dash_MetricsHead, which
    # adds ~67 bytes; a unix socket path may not exceed 107.
    preferred = data_dir / "ray"
    if len(str(preferred)) <= 36:
        return preferred
    # Ray makes its temp folder 0777 (for several users of one machine): it goes one level below a
    # folder of Apiary's own, 0700 like the data dir, through which nobody else reaches it.
    digest = hashlib.sha1(str(data_dir).encode()).hexdigest()[:10]
    return Path("/tmp") / f"apiary-ray-{digest}" / "ray"
