"""The `apiary` commands that use a running server through the SDK: submit, jobs, queue, show, logs,
watch, cancel, preempt.

The server is `--url`, else APIARY_URL, else `url` in ~/.config/apiary/config.toml, else
http://127.0.0.1:8000; a token (`--token`, APIARY_TOKEN or `token` there) is sent as a bearer token.
Exit codes: 0 success; 1 the job failed or was cancelled, the server refused, or it cannot be
reached; 2 bad input (a bad spec file names the field and its line). Read commands take `--json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from service.contract.errors import CodeError, one_line

if TYPE_CHECKING:
    # Imported where used, so that `apiary --help` loads no HTTP client and no schemas (api/cli.py).
    from pydantic import BaseModel

    from api.client import ApiaryClient, JobSummary
    from api.schemas import JobPublic
    from service.contract.spec import JobSpec
    from service.contract.states import JobState

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

Url = Annotated[
    str | None, typer.Option("--url", help="Apiary's URL [env APIARY_URL; default http://127.0.0.1:8000].")
]
Token = Annotated[
    str | None,
    typer.Option("--token", help="API token: who you are [env APIARY_TOKEN, or `token` in the config file]."),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON (for scripts).")]
JobId = Annotated[int, typer.Argument(help="The job's id.")]


def register(app: typer.Typer) -> None:
    for command in (submit, jobs, queue, show, logs, watch, cancel, preempt, compare, tensorboard):
        app.command()(command)


# ---------------------------------------------------------------------------------------------
# Commands


def submit(
    file: Annotated[Path, typer.Argument(help="The job spec (YAML or JSON).")],
    watch_: Annotated[bool, typer.Option("--watch", help="Then watch it until it ends.")] = False,
    code: Annotated[
        Path | None,
        typer.Option(
            "--code",
            help="Ship this folder with the job (without .git, __pycache__, .venv and what its "
            ".apiaryignore lists): every worker imports from it, and the trainer may be a module in it.",
        ),
    ] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Queue the job in FILE. A spec Apiary refuses names the field and its line (exit 2)."""
    from api.client import ApiaryInvalid
    from service.contract.spec import field_line

    text, spec = _read_spec(file)
    with _client(url, token) as client:
        try:
            job = client.submit(spec, code=code)
        except CodeError as err:  # the folder, before anything was sent
            _fail(f"--code {code}: {err}", code=2)
        except ApiaryInvalid as err:
            line = field_line(text, _loc(err.field)) if err.field else None
            where = f"{file}:{line}" if line else str(file)
            field = f"{err.field}: " if err.field and not err.message.startswith(err.field) else ""
            _fail(f"{where}: {field}{err.message}", code=2)
        if as_json:
            _print_json(job)
        else:
            console.print(f"submitted job [bold]{job.id}[/] ({escape(job.name)}) to {job.queue}: {job.state}")
        if watch_:
            raise typer.Exit(_watch(client, job.id, interval_s=1.0))


def jobs(
    state: Annotated[
        list[str] | None, typer.Option("--state", help="Only jobs in this state (repeat for several).")
    ] = None,
    queue: Annotated[str | None, typer.Option("--queue", help="research or full-scale.")] = None,
    mine: Annotated[bool, typer.Option("--mine", help="Only the jobs you own (your token's user).")] = False,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 50,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """List jobs, newest first."""
    with _client(url, token) as client:
        found: list[JobPublic | JobSummary] = []
        me = client.me().user if mine else None
        page_size = min(limit, 500)
        # The table reads summaries: whole jobs would build the job spec's models (~0.1 s).
        listed = (client.iter_jobs if as_json else client.iter_job_summaries)(
            state=state, queue=queue, page_size=page_size
        )
        for job in listed:
            if not mine or job.owner == me:
                found.append(job)
            if len(found) >= limit:
                break
    if as_json:
        print(json.dumps({"data": [job.model_dump(mode="json") for job in found], "count": len(found)}))
        return
    table = Table(box=None)
    for column in ("ID", "NAME", "QUEUE", "STATE", "OWNER", "PRI", "WORKERS", "STEP", "AGE"):
        table.add_column(column, justify="right" if column in ("ID", "PRI", "WORKERS") else "left")
    for job in found:
        table.add_row(
            str(job.id),
            escape(job.name),
            job.queue,
            _state(job.state),
            escape(job.owner),
            str(job.priority),
            str(job.spec.max_workers),
            _steps(job),
            _ago(job.created_at),
        )
    console.print(table if found else "no jobs")


def queue(
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Both queues: their use of the cluster and their waiting jobs with position, reason and ETA; and the
    cluster's spot nodes, with the interruptions seen."""
    with _client(url, token) as client:
        overview = client.queues_overview()
    if as_json:
        print(overview.model_dump_json())
        return
    spot = overview.spot
    if spot is not None and (spot.nodes or spot.interruptions):
        capacity = ", ".join(f"{key} {amount:g}" for key, amount in sorted((spot.capacity or {}).items()))
        console.print(
            f"[bold]spot[/]: {spot.nodes if spot.nodes is not None else '?'} node(s)"
            + (f" with {capacity}" if capacity else "")
            + f"; {spot.interruptions} interruption(s) in {spot.node_hours:.1f} node-hours "
            f"({spot.interruptions_per_node_h:.3g} per node-hour, {escape(spot.basis)})"
        )
    for view in overview.data:
        counts = ", ".join(f"{n} {state}" for state, n in sorted(view.counts.items())) or "empty"
        use = ", ".join(
            f"{key} {amount:g}/{(view.share or {}).get(key, 0):g}"
            for key, amount in sorted(view.in_use.items())
        )
        console.print(f"[bold]{view.name}[/]: {counts}" + (f"; in use/share: {use}" if use else ""))
        if not view.jobs:
            continue
        table = Table(box=None)
        for column in ("#", "ID", "NAME", "OWNER", "PRI", "ETA", "WAITING BECAUSE"):
            table.add_column(column)
        for job in view.jobs:
            table.add_row(
                str(job.position or ""),
                str(job.id),
                escape(job.name),
                escape(job.owner),
                str(job.priority),
                _when(job.eta_at),
                escape(job.reason or ""),
            )
        console.print(table)


def show(job_id: JobId, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """A job: its state and progress, why it waits, its checkpoint, and its recent events."""
    from service.contract.signal import job_cost_text
    from service.contract.states import JobState

    with _client(url, token) as client:
        job = client.get(job_id)
        events = client.events(job_id)
    if as_json:
        print(
            json.dumps({**job.model_dump(mode="json"), "events": [e.model_dump(mode="json") for e in events]})
        )
        return
    rows: list[tuple[str, str]] = [
        ("job", f"{job.id} {escape(job.name)} (owner {escape(job.owner)})"),
        ("state", _state(job.state) + (f": {escape(job.message)}" if job.message else "")),
        ("queue", f"{job.queue}, priority {job.priority}"),
        ("trainer", f"{job.spec.trainer} on {job.spec.max_workers} worker(s), {job.spec.strategy.value}"),
        ("progress", f"step {_steps(job)}, attempt {job.attempt}"),
    ]
    if job.state is JobState.QUEUED and job.queue_position is not None:
        why = f": {escape(job.waiting_reason)}" if job.waiting_reason else ""
        rows.append(("waiting", f"#{job.queue_position} in its queue, ETA {_when(job.eta_at)}{why}"))
    if job.latest_checkpoint:
        rows.append(("checkpoint", f"step {job.latest_checkpoint_step}: {job.latest_checkpoint}"))
    rows.append(("failures", f"{job.failures} ({job.restarts} restarts), {job.preemptions} preemptions"))
    if job.resource_hours > 0:
        rows.append(("cost", escape(job_cost_text(job))))
    rows.append(("created", _when(job.created_at)))
    for key, value in rows:
        console.print(f"[bold]{key:>10}[/]  {value}")
    for event in events[-10:]:
        moved = f"{event.from_state or '-'} -> {event.to_state}" if event.to_state else ""
        console.print(f"  {_when(event.at)}  {event.actor}: {moved} {escape(event.reason)}")


def logs(
    job_id: JobId,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    attempt: Annotated[int | None, typer.Option(min=1, help="Which attempt [default: the latest].")] = None,
    tail: Annotated[int | None, typer.Option(min=0, help="Only the last N lines.")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Keep terminal escape sequences (colours) as they were written.")
    ] = False,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """The job's log: its driver's and every rank's output (from its Ray job)."""
    with _client(url, token) as client:
        if follow:
            for chunk in client.follow_logs(job_id, attempt=attempt, tail=tail, raw=raw):
                sys.stdout.write(chunk)
                sys.stdout.flush()
            return
        text = client.logs(job_id, attempt=attempt, tail=tail, raw=raw)
    if as_json:
        print(json.dumps({"job": job_id, "attempt": attempt, "text": text}))
    else:
        sys.stdout.write(text)


def watch(
    job_id: JobId,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between updates.")] = 1.0,
    url: Url = None,
    token: Token = None,
) -> None:
    """A live progress bar (step, samples/s, loss, ETA) until the job ends; exits 0 if it succeeded,
    1 if it failed or was cancelled."""
    with _client(url, token) as client:
        raise typer.Exit(_watch(client, job_id, interval_s=interval))


def cancel(job_id: JobId, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """Cancel a queued or running job (exit 1 if it already ended)."""
    with _client(url, token) as client:
        _done(client.cancel(job_id), as_json=as_json)


def preempt(job_id: JobId, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """Checkpoint a running job and requeue it in its place (exit 1 unless it is running)."""
    with _client(url, token) as client:
        _done(client.preempt(job_id), as_json=as_json)


def compare(
    job_ids: Annotated[list[int], typer.Argument(help="Two or more job ids.", min=1)],
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Jobs side by side: final and best metrics (rank 0; best: lowest for *loss, else highest) and
    the spec keys they differ in."""
    with _client(url, token) as client:
        found = client.compare(job_ids)
    if as_json:
        _print_json(found)
        return
    table = Table(box=None, pad_edge=False)
    table.add_column("")
    for run in found.jobs:
        table.add_column(f"job {run.id}", justify="right")
    table.add_row("name", *(escape(run.name) for run in found.jobs))
    table.add_row("state", *(str(run.state) for run in found.jobs))
    table.add_row("step", *(str(run.latest_step or 0) for run in found.jobs))
    metrics = sorted({name for run in found.jobs for name in run.final})
    for name in metrics:
        table.add_row(f"final {name}", *(_number(run.final.get(name)) for run in found.jobs))
    for name in metrics:
        table.add_row(
            f"best {name}",
            *(
                f"{_number(run.best.get(name))} @{run.best_step[name]}" if name in run.best else "-"
                for run in found.jobs
            ),
        )
    for key, values in found.spec_diff.items():
        table.add_row(f"[bold]{escape(key)}[/]", *(escape(json.dumps(value)) for value in values))
    console.print(table)
    if not found.spec_diff:
        console.print("[dim]the specs are the same[/]")


def tensorboard(
    job_ids: Annotated[list[int] | None, typer.Argument(help="Job ids [default: every job].")] = None,
    print_only: Annotated[
        bool, typer.Option("--print", help="Only print the folders, even where TensorBoard is installed.")
    ] = False,
    port: Annotated[int, typer.Option(min=1, max=65535, help="TensorBoard's port.")] = 6006,
    url: Url = None,
    token: Token = None,
) -> None:
    """Print the jobs' TensorBoard folders, then start TensorBoard on them when it is installed."""
    with _client(url, token) as client:
        logdirs = client.tensorboard_logdirs(job_ids or [])
    folders = [logdir.removeprefix("file://") for logdir in logdirs]
    for folder in folders:
        print(folder)
    program = shutil.which("tensorboard")
    if print_only:
        return
    if program is None:
        console.print(
            "[dim]TensorBoard is not installed here: `pip install tensorboard`, then run it on these[/]"
        )
        return
    named = job_ids and len(folders) > 1
    where = (
        ",".join(f"job-{i}:{f}" for i, f in zip(job_ids or [], folders, strict=True)) if named else folders[0]
    )
    flag = "--logdir_spec" if named else "--logdir"
    os.execv(program, [program, flag, where, "--host", "127.0.0.1", "--port", str(port)])


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


# ---------------------------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def _client(url: str | None, token: str | None) -> Iterator[ApiaryClient]:
    """The SDK client; the server's refusals become one line and exit 1 (2 for bad input)."""
    from api.client import ApiaryClient, ApiaryClientError, ApiaryInvalid

    try:
        with ApiaryClient(url, token=token, retries=2) as client:
            yield client
    except ApiaryInvalid as err:
        _fail(err.message, code=2)
    except ApiaryClientError as err:
        _fail(err.message, code=1)


def _read_spec(file: Path) -> tuple[str, JobSpec]:
    """The file's text and its spec; a bad one exits 2 naming the field and its line."""
    import yaml
    from pydantic import ValidationError

    from service.contract.spec import JobSpec, field_line, parse_spec_text

    try:
        text = file.read_text()
    except OSError as err:
        _fail(f"cannot read {file}: {err.strerror or err}", code=2)
    try:
        data = parse_spec_text(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else str(file)
        _fail(f"{where}: not valid YAML: {getattr(err, 'problem', None) or one_line(err)}", code=2)
    except ValueError as err:
        _fail(f"{file}: {err}", code=2)
    try:
        return text, JobSpec.model_validate(data)
    except ValidationError as err:
        lines = []
        for error in err.errors():
            field = ".".join(str(part) for part in error["loc"]) or "spec"
            line = field_line(text, error["loc"])
            lines.append(
                f"{file}:{line}: {field}: {error['msg']}" if line else f"{file}: {field}: {error['msg']}"
            )
        _fail("\n".join(lines), code=2)


def _loc(field: str) -> list[str | int]:
    return [int(part) if part.isdigit() else part for part in field.split(".")]


def _watch(client: ApiaryClient, job_id: int, *, interval_s: float) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from service.contract.states import TERMINAL_STATES, JobState

    job = client.get(job_id)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}{task.fields[of]}"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("{task.fields[loss]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task(
            _progress_title(job),
            total=job.spec.max_steps,
            completed=job.latest_step or 0,
            rate="",
            loss="",
            of=f"/{job.spec.max_steps}" if job.spec.max_steps is not None else "",
        )
        while True:
            fields: dict[str, Any] = {}
            if job.latest_step:
                points = client.metrics(job_id, min_step=job.latest_step, limit=1024)
                last = [p for p in points if p.step == points[-1].step] if points else []
                if last:
                    rate = sum(p.values.get("samples_per_s", 0.0) for p in last)
                    loss = next((p.values["loss"] for p in last if p.rank == 0 and "loss" in p.values), None)
                    fields["rate"] = f"{rate:,.0f} samples/s"
                    fields["loss"] = f"loss {loss:.4f}" if loss is not None else ""
            progress.update(task, description=_progress_title(job), completed=job.latest_step or 0, **fields)
            if job.state in TERMINAL_STATES:
                break
            time.sleep(interval_s)
            job = client.get(job_id)
    outcome = f"job {job.id} {_state(job.state)}" + (f": {escape(job.message)}" if job.message else "")
    console.print(outcome)
    return 0 if job.state is JobState.SUCCEEDED else 1


def _steps(job: JobPublic | JobSummary) -> str:
    """The step a job reached, out of its max_steps (a function trainer may have none)."""
    step = job.latest_step or 0
    return f"{step}/{job.spec.max_steps}" if job.spec.max_steps is not None else str(step)


def _progress_title(job: JobPublic) -> str:
    from service.contract.states import JobState

    title = f"job {job.id} {escape(job.name)} {_state(job.state)}"
    if job.state is JobState.QUEUED and job.queue_position:
        title += f" #{job.queue_position}" + (f" (ETA {_when(job.eta_at)})" if job.eta_at else "")
    return title


def _done(job: JobPublic, *, as_json: bool) -> None:
    if as_json:
        _print_json(job)
    else:
        console.print(f"job {job.id}: {_state(job.state)}")


def _print_json(model: BaseModel) -> None:
    print(model.model_dump_json())


_STATE_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan"}


def _state(state: JobState) -> str:
    style = _STATE_STYLE.get(state.value)
    return f"[{style}]{state.value}[/]" if style else state.value


def _when(at: datetime | None) -> str:
    if at is None:
        return "-"
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    return at.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _ago(at: datetime) -> str:
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    seconds = (datetime.now(UTC) - at).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _fail(message: str, *, code: int) -> NoReturn:
    errors.print(f"[red]error:[/] {escape(message)}")
    raise typer.Exit(code)
