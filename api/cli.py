"""The `apiary` command: run the service, or the demo a new user starts with; the commands that use a
running server (submit, jobs, queue, show, logs, watch, cancel, preempt) are in api/cli_jobs.py, and
`apiary token` (on the database) in api/cli_admin.py.

Each command imports what it needs when it runs (`apiary --help` and the client commands load neither
the server's nor the cluster's modules), and one whose extra is not installed says which to install
and exits 2 (api/extras.py).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from api import cli_admin, cli_db, cli_jobs, cli_sweeps
from api.extras import install_hint, missing
from service.contract.errors import one_line
from service.contract.formats import DataFormat

if TYPE_CHECKING:
    from rich.table import Table

    from service.contract.queues import QueuesConfig
    from service.scheduling.replay import Observed, Replay
    from service.scheduling.simulate import SimResult
    from service.settings import Settings

# `apiary plan`'s summary, as `apiary --help` lists it (the command's docstring begins with it).
PLAN_SUMMARY = (
    "Throughput, communication ceiling, checkpoint cost, cadence, failure waste and price of a run."
)


class _Commands(TyperGroup):
    """Apiary's commands. `apiary plan` is built only when it runs: its options come from `PlanFacts`,
    whose import (the job spec's models) would cost every other command about 0.15 s. Until then
    `apiary --help` lists it by its summary."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] == "plan":
            from api.cli_plan import plan_command

            plan = typer.Typer()
            plan.command("plan")(plan_command)
            self.commands["plan"] = typer.main.get_command(plan)
        return super().resolve_command(ctx, args)


app = typer.Typer(
    cls=_Commands,
    help="Apiary: queue and run distributed PyTorch training jobs on Ray.",
    no_args_is_help=True,
)
console = Console(soft_wrap=True)
cli_jobs.register(app)
cli_sweeps.register(app)


# Ray's own log lines (its INFO) too; Apiary's are shown either way.
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Also show Ray's INFO log lines.")]


def _private_files() -> None:
    """Every file the service writes, and its local Ray's processes (which inherit this) write, is its
    owner's alone (0600, folders 0700): the data dir holds tokens, logs and checkpoints."""
    os.umask(0o077)


def _need(command: str, *extras: str, why: str = "") -> None:
    """Exit 2, naming the extra to install, unless `extras` are installed."""
    absent = missing(*extras)
    if absent:
        needs = f"apiary[{','.join(extras)}]{why}"
        console.print(
            f"[red]error:[/] `apiary {command}` needs {escape(needs)} ({absent[0]} is not installed): "
            f"{escape(install_hint(*extras))}"
        )
        raise typer.Exit(2)


def _settings(**overrides: Any) -> Settings:
    from service.costs import check_at_start
    from service.settings import Settings

    try:
        settings = Settings(**{key: value for key, value in overrides.items() if value is not None})
        settings.queues  # noqa: B018 (reads and checks APIARY_QUEUES_FILE)
        check_at_start(settings.price_signal)
    except ValueError as err:  # pydantic's ValidationError or InvalidSpec: a bad APIARY_* variable or file
        console.print(f"[red]error:[/] bad configuration: {one_line(err)}")
        raise typer.Exit(2) from None
    return settings


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Interface to listen on [default: 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on [default: 8000].")] = None,
    forwarded_allow_ips: Annotated[
        str | None,
        typer.Option(
            help="Proxies whose X-Forwarded-For/-Proto are believed, comma-separated or '*' "
            "[default: 127.0.0.1; env APIARY_FORWARDED_ALLOW_IPS]."
        ),
    ] = None,
    verbose: Verbose = False,
) -> None:
    """Start the API, the scheduler and (unless APIARY_RAY_ADDRESS is set) a local Ray."""
    _private_files()
    _need("serve", "server")
    settings = _settings(host=host, port=port, forwarded_allow_ips=forwarded_allow_ips)
    if settings.ray_address is None:
        _need("serve", "server", "cluster", why=" to run jobs on a local Ray (or set APIARY_RAY_ADDRESS)")
    from api import server
    from api.app import create_app
    from api.logformat import configure_logging, route_ray_logs
    from service.runtime import ray_client_env

    cli_admin.refuse_unsafe_bind(settings)
    configure_logging(settings.log_format)
    os.environ.update(ray_client_env(settings))  # before Ray's first import (route_ray_logs)
    route_ray_logs(verbose=verbose)
    server.serve(create_app(settings), settings)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 60,
    workers: Annotated[int, typer.Option(min=1, help="Train workers.")] = 2,
    verbose: Verbose = False,
) -> None:
    """Write a small token dataset, start Apiary, train a tiny GPT on 2 workers, show progress."""
    _private_files()
    _need("demo", "server", "cluster")
    from api import server
    from api.app import create_app
    from api.demo import run_demo_job, write_demo_dataset
    from api.logformat import route_ray_logs
    from service.cluster import free_port
    from service.runtime import ray_client_env

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    port = free_port()
    settings = _settings(port=port)
    os.environ.update(ray_client_env(settings))  # before Ray's first import (route_ray_logs)
    route_ray_logs(verbose=verbose)
    cli_admin.refuse_unsafe_bind(settings)
    dataset = settings.datasets_dir / "demo-tokens"
    console.print(f"[bold]1.[/] writing a synthetic token dataset to {dataset}")
    write_demo_dataset(dataset)
    console.print(f"[bold]2.[/] starting Apiary on {settings.resolved_public_url} (SQLite, local Ray)")
    background = server.BackgroundServer(create_app(settings), host=settings.host, port=settings.port)
    background.start()
    try:
        code = run_demo_job(
            settings.resolved_public_url, dataset=dataset, steps=steps, workers=workers, console=console
        )
    finally:
        console.print("stopping Apiary and its local Ray ...")
        background.stop()
    raise typer.Exit(code)


data_app = typer.Typer(
    help="Prepare datasets: shard local parquet into object storage.", no_args_is_help=True
)
app.add_typer(data_app, name="data")


@data_app.command("shard")
def data_shard(
    source: Annotated[str, typer.Argument(help="Local parquet file or folder (path or file:///...).")],
    dest: Annotated[
        str, typer.Argument(help="Destination folder: /abs/path, file:///... or s3://bucket/prefix.")
    ],
    data_format: Annotated[
        str, typer.Option("--format", help=f"Shard format: {' or '.join(DataFormat)}.")
    ] = DataFormat.PARQUET.value,
    num_shards: Annotated[int, typer.Option("--num-shards", help="Number of shards to write.")] = 1,
    row_group_rows: Annotated[
        int, typer.Option("--row-group-rows", help="Rows per parquet row group (the unit of resume).")
    ] = 1024,
) -> None:
    """Write SOURCE as N shards at DEST, with a _manifest.json (rows, schema, sha256 per shard)."""
    _need("data shard", "cluster")
    from service.sharding import shard_dataset

    settings = _settings()
    source_uri = source if "://" in source else str(Path(source).absolute())
    dest_uri = dest if "://" in dest else str(Path(dest).absolute())
    try:
        manifest = shard_dataset(
            source_uri,
            dest_uri,
            data_format=data_format,
            num_shards=num_shards,
            row_group_rows=row_group_rows,
            s3_endpoint_url=settings.s3_endpoint_url,
        )
    except (ValueError, OSError) as err:
        # A user mistake (bad path, format, count, unreachable store): one line, exit 2, no traceback.
        console.print(f"[red]error:[/] {one_line(err)}")
        raise typer.Exit(2) from None
    console.print(
        f"wrote {len(manifest.shards)} {manifest.format} shards ({manifest.num_rows} rows) "
        f"and _manifest.json to {dest_uri}"
    )


@app.command()
def simulate(
    trace: Annotated[Path | None, typer.Argument(help="Trace CSV or .csv.gz (see --generate).")] = None,
    nodes: Annotated[int, typer.Option(min=1, help="Nodes of the simulated cluster.")] = 8,
    node: Annotated[str, typer.Option(help="Resources of one node.")] = "CPU=32,GPU=8",
    policy: Annotated[str, typer.Option(help="two-queue, fifo, greedy or share-first.")] = "two-queue",
    queues_file: Annotated[
        Path | None,
        typer.Option(
            "--queues",
            help="Queue configuration (YAML/JSON) over the defaults (with --from-db: instead of the "
            "service's own).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    generate: Annotated[
        int | None, typer.Option(min=1, help="Write a generated trace of this many jobs to stdout instead.")
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Seed of --generate, and of --deferrable-share's and --spot-share's draws.")
    ] = 0,
    from_db: Annotated[
        bool,
        typer.Option(
            "--from-db",
            help="Replay the jobs of the service's database (APIARY_DATABASE_URL) that ran and ended, "
            "and show what really happened to them beside.",
        ),
    ] = False,
    since: Annotated[
        str | None,
        typer.Option(help="With --from-db: the jobs submitted within this span before now [default: 14d]."),
    ] = None,
    signal: Annotated[
        Path | None,
        typer.Option(
            help="A price or carbon signal CSV (start,end,value; APIARY_PRICE_SIGNAL's format): price "
            "every held hour, and let deferrable jobs wait for cheaper hours. The trace's time 0 is its "
            "first start."
        ),
    ] = None,
    signal_unit: Annotated[
        str, typer.Option(help="price or carbon (gCO2e/kWh: costs in kg CO2e).")
    ] = "price",
    defer: Annotated[bool, typer.Option(help="With --signal: rule 0 (deferral) on, or off.")] = True,
    deferrable_share: Annotated[
        float, typer.Option(help="Share of research jobs marked deferrable: {within_h: --within-h} (seeded).")
    ] = 0.0,
    within_h: Annotated[
        float, typer.Option(help="The deferrable jobs' deadline, hours after submission.")
    ] = 12.0,
    spot_share: Annotated[float, typer.Option(help="Share of the nodes that are spot nodes.")] = 0.0,
    spot_rate: Annotated[float, typer.Option(help="Interruptions per spot node-hour (Poisson).")] = 0.0,
    spot_notice_s: Annotated[
        float, typer.Option(help="The notice before a spot node goes (0: none; seconds).")
    ] = 0.0,
) -> None:
    """Replay a job trace, or the service's own finished jobs (--from-db), through a scheduling policy
    in simulated time (no Ray), or generate a trace: most jobs small and short, a few large and long,
    bursty daily arrivals."""
    from service.contract.queues import load
    from service.costs import Rates, read_signal
    from service.scheduling import simulate as sim

    if generate is not None:
        sim.write_trace(sim.generate(generate, seed=seed), sys.stdout)
        return
    if since is not None and not from_db:
        _usage_error("--since goes with --from-db")
    if trace is None and not from_db:
        _usage_error("give a TRACE.csv to replay, --from-db to replay the service's jobs, or --generate N")
    if trace is not None and from_db:
        _usage_error("give a TRACE.csv or --from-db, not both")
    if policy not in sim.POLICIES:
        _usage_error(f"--policy must be one of {', '.join(sim.POLICIES)}, got {policy!r}")
    if signal_unit not in ("price", "carbon"):
        _usage_error(f"--signal-unit must be price or carbon, got {signal_unit!r}")
    if signal is None and (deferrable_share or not defer):
        _usage_error("--deferrable-share and --no-defer go with --signal")
    replayed = None
    try:
        pricing = sim.SimPricing(
            signal=None if signal is None else read_signal(str(signal), timeout_s=0),
            rates=Rates(unit="carbon" if signal_unit == "carbon" else "price"),
            defer=defer,
            deferrable_share=deferrable_share,
            within_h=within_h,
            seed=seed,
        )
        spot = sim.SimSpot(share=spot_share, rate_per_node_h=spot_rate, notice_s=spot_notice_s, seed=seed)
        resources = sim.parse_node(node)
        queues = load(queues_file)
        if trace is not None:
            opener = gzip.open if trace.suffix == ".gz" else open  # the suite's traces are gzipped
            with opener(trace, "rt", newline="", encoding="utf-8") as source:
                jobs = sim.read_trace(source, nodes=nodes, node=resources)
        else:
            replayed, service_queues = _replay_from_db(since or "14d", nodes=nodes, node=resources)
            jobs = replayed.trace
            queues = queues if queues_file is not None else service_queues
    except (OSError, ValueError) as err:
        _usage_error(one_line(err))
    result = sim.simulate(
        jobs, nodes=nodes, node=resources, policy=policy, queues=queues, pricing=pricing, spot=spot
    )
    if as_json:
        out = result.to_json()
        if replayed is not None:
            out |= {"real": replayed.observed.to_json(), "left_out": replayed.left_out}
        print(json.dumps(out, allow_nan=False))
        return
    console.print(_wait_table(f"{policy}: {result.jobs} jobs on {nodes} x {node}", result))
    console.print(
        f"utilization {result.utilization:.3f} (first arrival to last submission); "
        f"{result.preemptions} preemptions losing "
        f"{result.lost_gpu_hours:.1f} GPU-hours ({result.lost_work_s / 3600:.1f} job-hours); "
        f"{result.unfinished} job(s) could never run; makespan {_duration(result.makespan_s)}"
    )
    if signal is not None:
        unit = "kg CO2e" if result.cost_unit == "carbon" else "cost"
        console.print(
            f"{unit} {result.cost:.4g} over {result.priced_hours:.1f} priced GPU-hours; "
            f"{result.deferrable} deferrable job(s), {result.deferred} waited for a cheaper window, "
            f"{result.deadlines_missed} missed their deadline"
        )
    if spot_share:
        console.print(
            f"{result.spot_nodes} spot node(s): {result.interruptions} interruption(s) losing "
            f"{result.interrupt_lost_gpu_hours:.2f} GPU-hours of progress (notice {spot_notice_s:g} s)"
        )
    if replayed is not None:
        real = replayed.observed
        console.print(_wait_table(f"what really happened: {real.jobs} jobs", real))
        left_out = "".join(f"; {count} left out: {why}" for why, count in replayed.left_out.items())
        console.print(f"{real.preemptions} preemptions really{left_out}")


def _replay_from_db(since: str, *, nodes: int, node: dict[str, float]) -> tuple[Replay, QueuesConfig]:
    """The jobs of the service's database submitted within `since` that ran and ended, as a trace on
    `nodes` x `node`, and the service's own queues; ValueError for bad input or no such jobs."""
    _need("simulate --from-db", "server")
    import time

    from sqlalchemy.exc import SQLAlchemyError

    from service.scheduling import replay
    from service.scheduling.simulate import node_cluster
    from service.store.db import Database

    settings = _settings()
    since_s = replay.parse_since(since)
    try:
        db = Database(settings.resolved_database_url)
    except SQLAlchemyError as err:  # a malformed URL, an unknown driver
        raise ValueError(f"APIARY_DATABASE_URL: {one_line(err)}") from None
    try:
        ended = replay.load_ended(db, submitted_since=time.time() - since_s)
    except SQLAlchemyError as err:  # unreachable, or not an Apiary database
        console.print(f"[red]error:[/] the database: {one_line(err.__cause__ or err)}")
        raise typer.Exit(1) from None
    finally:
        db.dispose()
    if not ended:
        raise ValueError(
            f"no job submitted in the last {since} has run and ended: nothing to replay (a longer --since?)"
        )
    busy_key = "GPU" if node.get("GPU") else "CPU"
    return replay.replay(ended, cluster=node_cluster(nodes, node), busy_key=busy_key), settings.queues


def _wait_table(title: str, result: SimResult | Observed) -> Table:
    """The waits per queue (first start, and all time queued) and per size class."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("", "jobs", "wait p50", "p95", "p99", "mean", "max"):
        table.add_column(column, justify="right" if column else "left")
    rows = [
        *((name, value.wait) for name, value in result.queues.items()),
        *((f"{name} queued", value.queued) for name, value in result.queues.items()),
        *(("size " + k, v) for k, v in result.size_classes.items()),
    ]
    for group, stats in rows:
        table.add_row(
            group,
            str(stats.jobs),
            *(_duration(getattr(stats, key)) for key in ("p50", "p95", "p99", "mean", "max")),
        )
    return table


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _usage_error(message: str) -> NoReturn:
    console.print(f"[red]error:[/] {message}")
    raise typer.Exit(2)


@app.command("plan", help=PLAN_SUMMARY, context_settings={"ignore_unknown_options": True})
def _plan_summary() -> None:  # pragma: no cover (replaced by api/cli_plan.py's command before it runs)
    raise AssertionError("apiary plan runs api/cli_plan.py's command")


def _server_settings(command: str) -> Settings:
    _need(command, "server")
    return _settings()


# api/cli_db.py: apiary db upgrade | current; api/cli_admin.py: apiary token create | list | revoke
cli_db.register(app, load_settings=lambda: _server_settings("db"))
cli_admin.register(app, load_settings=lambda: _server_settings("token"))


def main() -> None:
    try:
        app()
    except Exception as err:
        # The SDK's refusals, one line (only a command that loaded the SDK can raise one).
        client = sys.modules.get("api.client")
        if client is None or not isinstance(err, client.ApiaryClientError):
            raise
        console.print(f"[red]error:[/] {err.message}")
        sys.exit(1)


if __name__ == "__main__":
    main()
