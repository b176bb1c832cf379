"""A Ray cluster of several nodes on this machine, as processes: `ray start --head` and `ray start
--address` (each node with its own ports, CPUs and a custom resource named after it), for tests of
what happens across nodes and when one dies.

Every node is one `ray start --block` in its own session, so `RayNode.kill()` takes all of it at once
(raylet, agents, workers), as a lost machine does. The head's GCS notices a dead raylet within a few
seconds (fast health checks). Token auth is on, with a token of the cluster's own.

The nodes run a plain Ray installation: `RayCluster.python`, a virtual environment with this one's
packages (torch, ray, pyarrow...) but without Apiary, no PYTHONPATH, in a folder outside the
repository. A job's code can only come with its runtime_env, as on a cluster Apiary did not build.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.cluster import _PORT_FLAGS, free_port, local_ray_env, pid_running
from tests.support.wait import wait_until

# Ports only a head has.
_HEAD_ONLY = ("port", "dashboard-port", "ray-client-server-port")
# Starts of a node before giving up (see RayCluster._launch).
START_TRIES = 3
# How fast the GCS declares a silent raylet dead (Ray's defaults take about 30 s).
FAST_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@dataclass
class RayNode:
    name: str  # its custom resource
    process: subprocess.Popen[bytes]
    log: Path

    def session_pids(self) -> list[int]:
        """Every process of this node (its session: `ray start` leads one)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                # pid (comm) state ppid pgrp session ...: comm may hold spaces, so split after it.
                if int(stat.rsplit(")", 1)[1].split()[3]) == self.process.pid:
                    pids.append(int(entry.name))
        return pids

    def kill(self) -> None:
        """SIGKILL the whole node at once, as a lost machine."""
        for pid in self.session_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(20)
        self.kill()


@dataclass
class RayCluster:
    root: Path
    gcs_address: str
    dashboard_url: str
    token_path: Path
    temp_dir: Path
    python: Path  # the nodes' interpreter: Ray and torch, no Apiary (bare_python)
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def token(self) -> str:
        return self.token_path.read_text().strip()

    def add_node(self, name: str, *, num_cpus: int, resources: dict[str, float] | None = None) -> RayNode:
        """A worker node with resource `name` (1) and `resources`, joined to the head."""
        return self._launch(name, head=False, num_cpus=num_cpus, resources=resources)

    def _launch(self, name: str, *, head: bool, num_cpus: int, resources: dict[str, float] | None) -> RayNode:
        """Start a node and wait until the GCS lists it alive. `ray start` gives a raylet 30 s to
        register, which a loaded machine can miss: a node that gave up is started again, on new ports."""
        for _ in range(START_TRIES):
            ports = {flag: free_port() for flag in _PORT_FLAGS if head or flag not in _HEAD_ONLY}
            if head:
                self.gcs_address = f"127.0.0.1:{ports['port']}"
                self.dashboard_url = f"http://127.0.0.1:{ports['dashboard-port']}"
                flags = ["--head", "--dashboard-host=127.0.0.1", "--include-dashboard=true"]
            else:
                flags = [f"--address={self.gcs_address}"]
            node = self._start(
                name,
                [*flags, *[f"--{flag}={port}" for flag, port in ports.items()]],
                num_cpus=num_cpus,
                resources=resources,
            )

            def joined(node: RayNode = node) -> str | None:
                if not pid_running(node.process.pid):
                    return "exited"
                return "alive" if name in self.alive_nodes() else None

            if wait_until(joined, timeout_s=150, interval_s=0.5, what=f"Ray node {name} starting") == "alive":
                return node
            node.kill()
            self.nodes.remove(node)
        raise RuntimeError(
            f"Ray node {name} did not start in {START_TRIES} tries:\n{node.log.read_text()[-3000:]}"
        )

    def _start(
        self, name: str, flags: list[str], *, num_cpus: int, resources: dict[str, float] | None
    ) -> RayNode:
        log = self.root / f"{name}.log"
        # No PYTHONPATH: the jobs' code must come through their runtime_env.
        environ = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env = {**local_ray_env(environ, auth_token_path=self.token_path), **FAST_HEALTH_CHECKS}
        # `ray start` by the nodes' interpreter: Ray starts its workers with the same one.
        command = [
            str(self.python),
            "-c",
            "import sys; from ray.scripts.scripts import main; sys.exit(main())",
            "start",
            "--block",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps({name: 1, **(resources or {})})}",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",
            *flags,
        ]
        with log.open("ab") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.root,
                start_new_session=True,
            )
        node = RayNode(name=name, process=process, log=log)
        self.nodes.append(node)
        return node

    def alive_nodes(self) -> dict[str, str]:
        """custom resource name -> Ray node id, of the alive nodes (the State API, as Apiary reads it)."""
        try:
            response = httpx.get(
                f"{self.dashboard_url}/api/v0/nodes",
                params={"detail": "1", "limit": "100"},
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=10,
            )
        except httpx.HTTPError:
            return {}  # the dashboard is not up yet
        if response.status_code != 200:
            return {}
        names = {node.name for node in self.nodes}
        alive = {}
        for node in response.json()["data"]["result"]["result"]:
            if node["state"] == "ALIVE":
                for name in names & set(node.get("resources_total") or {}):
                    alive[name] = node["node_id"]
        return alive

    def stop(self) -> None:
        for node in reversed(self.nodes):  # the head last
            node.stop()


@contextlib.contextmanager
def ray_cluster(
    root: Path, *, head_cpus: int, head_resources: dict[str, float] | None = None
) -> Iterator[RayCluster]:
    """A head node named `head` (explicit free ports, never 6379); add nodes with `add_node`."""
    root.mkdir(parents=True, exist_ok=True)
    token_path = root / "ray_auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    # Ray's unix sockets live under the temp dir, whose path must stay short.
    cluster = RayCluster(
        root=root,
        gcs_address="",  # set by the head's start
        dashboard_url="",
        token_path=token_path,
        temp_dir=Path("/tmp") / f"apiary-mn-{secrets.token_hex(4)}",
        python=bare_python(root / "bare-venv"),
    )
    try:
        cluster._launch("head", head=True, num_cpus=head_cpus, resources=head_resources)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)  # Ray's session folders and logs


def bare_python(folder: Path) -> Path:
    """An interpreter with this environment's third-party packages and without Apiary: a new virtual
    environment whose only addition is this one's site-packages as a plain path entry. Its `.pth`
    files (among them the editable install's hook that makes `service` and `trainers` importable)
    run only for a site directory, so they do not run there."""
    python = folder / "bin" / "python"
    if not python.exists():
        base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(folder)], check=True)
        site = next(path for path in sys.path if path.endswith("site-packages") and sys.prefix in path)
        (
            folder
            / "lib"
            / f"python{sys.version_info.major}.{sys.version_info.minor}"
            / "site-packages"
            / "apiary-test-packages.pth"
        ).write_text(f"{site}\n")
    return python
