"""How fast `apiary` starts, and how much a client installs: today (this checkout) against before the
split into extras and lazy imports (`--baseline`, a commit), in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/cli_startup.py      # ~2 minutes here (a venv is built)

Times `apiary --help` and `apiary jobs` (against a running server holding 20 jobs: SQLite, fake
cluster) as new processes, each variant in turn in every round, `--repeats` rounds (the median and the
fastest; wall time):
- before: this checkout's CLI after importing what the baseline's `api/cli*.py` imported at their
  top (the app, the server, the database, Ray's client, ...: `EAGER`), with this venv (everything
  installed); the baseline's own client cannot read today's server's jobs;
- after, full venv: this checkout's CLI, with this venv;
- after, client venv: `pip install apiary` with no extra, as a user has it (tests/support/client_venv.py);
- with `--previous REV`, also REV's sources on that client venv (`PYTHONPATH`): a change measured
  against the commit before it, in the same run.
Sizes: the client venv on disk, against what `pip install apiary` installed before (the baseline's
dependencies and theirs, as this venv holds them) and against this whole venv (`.[dev]`).
Goal: both commands under 0.3 s.
"""

from __future__ import annotations

import argparse
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import command, machine  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402

from api.demo import classification_table, write_shards  # noqa: E402
from api.server import BackgroundServer  # noqa: E402
from service.cluster import free_port  # noqa: E402
from tests.support.client_venv import build_client_venv  # noqa: E402
from tests.support.jobs import classification_job  # noqa: E402

GOAL_S = 0.3
# The last commit before `import apiary`, the extras and the lazy CLI.
BASELINE = "b933677"
# `apiary ARGS` run from sources on this venv's Python (what the console script runs).
ENTRY = "import sys; from api.cli import main; sys.argv[0] = 'apiary'; main()"
# What the baseline's api/cli.py, cli_admin.py, cli_db.py, cli_jobs.py and cli_plan.py imported at
# their top, and so loaded for every command.
EAGER = (
    "api.app",
    "api.server",
    "api.demo",
    "api.logformat",
    "api.client",
    "api.schemas",
    "service.auth",
    "service.cluster",
    "service.settings",
    "service.store.db",
    "sqlalchemy",
    "httpx",
    "yaml",
    "rich.progress",
)


def dependencies_of(commit: str) -> list[str]:
    """What `pip install apiary` installed at `commit` (its pyproject's dependencies)."""
    show = ["git", "-C", str(ROOT), "show", f"{commit}:pyproject.toml"]
    text = subprocess.run(show, capture_output=True, text=True, check=True).stdout
    dependencies: list[str] = tomllib.loads(text)["project"]["dependencies"]
    return dependencies


def installed_bytes(requirements: Iterable[str]) -> int:
    """The bytes on disk of `requirements` and everything they require (their extras' too), as this
    venv installed them; each distribution counted once."""
    todo = [Requirement(text) for text in requirements]
    followed: set[tuple[str, frozenset[str]]] = set()
    counted: set[str] = set()
    total = 0
    while todo:
        requirement = todo.pop()
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if (name, frozenset(requirement.extras)) in followed:
            continue
        followed.add((name, frozenset(requirement.extras)))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # another platform's dependency
        if name not in counted:
            counted.add(name)
            files = (Path(str(dist.locate_file(file))) for file in dist.files or ())
            total += sum(path.stat().st_size for path in files if path.is_file())
        extras = requirement.extras or {""}
        for text in dist.requires or ():
            inner = Requirement(text)
            if inner.marker is None or any(inner.marker.evaluate({"extra": extra}) for extra in extras):
                todo.append(inner)
    return total


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def serve(workdir: Path) -> BackgroundServer:
    """A server on SQLite with the fake cluster, holding 20 queued jobs."""
    import httpx

    from api.app import create_app
    from service.runtime import Runtime
    from service.settings import Settings
    from tests.support.fakes import FakeBackend

    dataset = (workdir / "dataset").as_uri()
    write_shards(classification_table(num_rows=64, num_features=8, num_classes=3), dataset, num_shards=1)
    port = free_port()
    settings = Settings(data_dir=workdir / "data", port=port, data_roots=str(workdir))
    runtime = Runtime(settings, backend=FakeBackend.running(), run_scheduler=False)
    server = BackgroundServer(create_app(runtime=runtime), host="127.0.0.1", port=port)
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for index in range(20):
            response = client.post("/jobs", json=classification_job(dataset, name=f"startup-{index}"))
            assert response.status_code == 201, response.text
    return server


def timed(argv: list[str], *, env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `argv`."""
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}: {done.stderr[-2000:]}"
    cpu = cpu_after.ru_utime - cpu_before.ru_utime + cpu_after.ru_stime - cpu_before.ru_stime
    return elapsed, cpu


Variants = dict[str, tuple[list[str], dict[str, str]]]
# (variant, command) -> (wall, CPU) seconds of each run
Times = dict[tuple[str, str], list[tuple[float, float]]]


def measure(variants: Variants, *, repeats: int, cwd: Path) -> Times:
    """Every variant runs in turn in each round, so that a change of the machine's load falls on all."""
    times: Times = {}
    for round_ in range(repeats + 1):
        for args in (["--help"], ["jobs"]):
            for name, (argv, env) in variants.items():
                measured = timed([*argv, *args], env=env, cwd=cwd)
                if round_:  # the first round warms the file cache
                    times.setdefault((name, args[0]), []).append(measured)
    return times


def sources_of(commit: str, folder: Path) -> Path:
    """The Python packages of `commit`, extracted into `folder`."""
    folder.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "apiary", "api", "service", "trainers"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def print_times(times: Times, variants: Variants) -> None:
    """Median wall and CPU time (user + system) of each; CPU time is what the machine's load changes least."""
    print(f"{'':22} {'--help wall':>12} {'cpu':>7} {'jobs wall':>10} {'cpu':>7}")
    for name in variants:
        cells = []
        for what in ("--help", "jobs"):
            runs = times[(name, what)]
            cells.append(
                f"{statistics.median(w for w, _ in runs):.3f}s {statistics.median(c for _, c in runs):.3f}s"
            )
        print(f"{name:22} {cells[0]:>20} {cells[1]:>18}")
    for what in ("--help", "jobs"):
        after = [statistics.median(m[i] for m in times[("after, client venv", what)]) for i in (0, 1)]
        for name in variants:
            if name.startswith("after"):
                continue
            other = [statistics.median(m[i] for m in times[(name, what)]) for i in (0, 1)]
            print(
                f"apiary {what}: {name} / after (client venv): wall {other[0] / after[0]:.2f}x, CPU "
                f"{other[1] / after[1]:.2f}x"
            )
        met = "met" if after[0] < GOAL_S else "NOT met"
        print(f"apiary {what}: goal < {GOAL_S} s wall (client venv): {met}")


def print_sizes(client_venv: Path, *, baseline: str) -> None:
    client_mib = folder_bytes(client_venv) / 2**20
    before_mib = installed_bytes(dependencies_of(baseline)) / 2**20
    full_mib = folder_bytes(Path(sys.prefix)) / 2**20
    print(f"installed: client venv {client_mib:,.0f} MiB; `pip install apiary` before: {before_mib:,.0f} MiB")
    print(
        f"           ({before_mib / client_mib:.0f}x the client's); this venv (.[dev]): {full_mib:,.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15, help="rounds (each runs every variant once)")
    parser.add_argument("--baseline", default=BASELINE, help="the commit to compare with")
    parser.add_argument("--previous", help="also time the client venv on this commit's sources")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="apiary-cli-startup-"))
    try:
        client_bin = build_client_venv(workdir / "client")
        server = serve(workdir)
        try:
            env = {
                "PATH": "/usr/bin:/bin",
                "PYTHONPATH": str(ROOT),
                "HOME": str(workdir),
                "COLUMNS": "120",
                "APIARY_URL": server.url,
                "APIARY_CONFIG": str(workdir / "none.toml"),
            }
            variants: Variants = {
                "before": ([sys.executable, "-c", f"import {', '.join(EAGER)}; {ENTRY}"], env),
                "after, full venv": ([sys.executable, "-c", ENTRY], env),
                # Not this checkout's sources: the venv's own Apiary.
                "after, client venv": ([str(client_bin / "apiary")], {**env, "PYTHONPATH": ""}),
            }
            if args.previous:
                previous = sources_of(args.previous, workdir / "previous")
                variants[f"{args.previous}, client venv"] = (
                    [str(client_bin / "python"), "-c", ENTRY],
                    {**env, "PYTHONPATH": str(previous)},
                )
            times = measure(variants, repeats=args.repeats, cwd=workdir)
        finally:
            server.stop()
        print(f"machine: {machine()}")
        print(f"command: {command()}; baseline {args.baseline}; {args.repeats} rounds")
        print_times(times, variants)
        print_sizes(client_bin.parent, baseline=args.baseline)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
