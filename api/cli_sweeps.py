"""`apiary sweep FILE`, `apiary sweeps`, `apiary sweep show|best|cancel ID`, `apiary resume JOB`: sweeps
over the SDK (service.sweeps on the server)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from api.cli_jobs import AsJson, JobId, Token, Url, _client, _fail, _print_json, console

if TYPE_CHECKING:
    from api.schemas import SweepPublic


class _RunByDefault(TyperGroup):
    """`apiary sweep FILE` is `apiary sweep run FILE`: a first word that is no subcommand is a file."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


sweep_app = typer.Typer(
    cls=_RunByDefault,
    no_args_is_help=True,
    help="Search a job's config: `apiary sweep FILE.yaml [--code DIR]`, then show, best, cancel.",
)
SweepId = Annotated[int, typer.Argument(help="The sweep's id.", min=1)]


def register(app: typer.Typer) -> None:
    app.add_typer(sweep_app, name="sweep")
    app.command("sweeps")(list_sweeps)
    app.command("resume")(resume)


@sweep_app.command("run")
def run(
    file: Annotated[Path, typer.Argument(help="The sweep file (YAML or JSON).")],
    code: Annotated[
        Path | None, typer.Option("--code", help="A folder every trial runs (packed and uploaded).")
    ] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Start a sweep. A file the server refuses names the field and its line (exit 2)."""
    import yaml

    from api.client import ApiaryInvalid  # where used: `apiary --help` loads no HTTP client (api/cli.py)
    from service.contract.errors import one_line
    from service.contract.spec import field_line, parse_spec_text

    try:
        text = file.read_text()
        payload = parse_spec_text(text)
    except OSError as err:
        _fail(f"cannot read {file}: {err.strerror or err}", code=2)
    except (yaml.YAMLError, ValueError) as err:
        _fail(f"{file}: {one_line(err)}", code=2)
    if code is not None and not code.is_dir():
        _fail(f"--code {code}: not a folder", code=2)
    with _client(url, token) as client:
        try:
            sweep = client.sweep(payload, code=code)
        except ApiaryInvalid as err:
            line = field_line(text, err.field.split(".")) if err.field else None
            where = f"{file}:{line}" if line else str(file)
            _fail(f"{where}: {err.message}", code=2)
    if as_json:
        _print_json(sweep)
    else:
        console.print(
            f"sweep [bold]{sweep.id}[/] ({escape(sweep.name)}): {sweep.total} trials, "
            f"{sweep.spec.get('parallel')} at once; `apiary sweep show {sweep.id}`"
        )


@sweep_app.command("show")
def show(sweep_id: SweepId, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """A sweep: its state, each trial's state, point and objective, and its best trial."""
    with _client(url, token) as client:
        sweep = client.get_sweep(sweep_id)
    if as_json:
        _print_json(sweep)
        return
    _print_sweep(sweep)


@sweep_app.command("best")
def best(
    sweep_id: SweepId,
    full_scale: Annotated[bool, typer.Option("--full-scale", help="Put it in the full-scale queue.")] = False,
    url: Url = None,
    token: Token = None,
) -> None:
    """Print the best trial's spec as YAML, ready to submit (`> job.yaml`)."""
    import yaml

    with _client(url, token) as client:
        spec = client.best_spec(sweep_id, queue="full-scale" if full_scale else None)
    sys.stdout.write(
        yaml.safe_dump(spec.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False)
    )


@sweep_app.command("cancel")
def cancel(sweep_id: SweepId, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """Cancel the sweep and its unfinished trials (exit 1 if it already ended)."""
    with _client(url, token) as client:
        sweep = client.cancel_sweep(sweep_id)
    if as_json:
        _print_json(sweep)
    else:
        console.print(f"sweep {sweep.id}: {sweep.state}")


def list_sweeps(url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """The newest sweeps: state, trials done of all, best objective."""
    with _client(url, token) as client:
        sweeps = client.sweeps()
    if as_json:
        print(json.dumps([sweep.model_dump(mode="json") for sweep in sweeps]))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("id", "name", "owner", "state", "trials", "objective", "best"):
        table.add_column(column)
    for sweep in sweeps:
        ended = sum(1 for trial in sweep.trials if trial.state.is_terminal)
        best_text = (
            f"job {sweep.best.job}: {sweep.best.objective:.4g}"
            if sweep.best is not None and sweep.best.objective is not None
            else "-"
        )
        objective = f"{sweep.objective['metric']} ({sweep.objective['mode']})"
        table.add_row(
            str(sweep.id),
            escape(sweep.name),
            sweep.owner,
            sweep.state,
            f"{ended}/{sweep.total}",
            objective,
            best_text,
        )
    console.print(table)


def resume(job_id: JobId, url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """Queue a pruned sweep trial again: it resumes from its checkpoint."""
    with _client(url, token) as client:
        job = client.resume(job_id)
    if as_json:
        _print_json(job)
    else:
        console.print(f"job {job.id}: {job.state} (resumes from its checkpoint)")


def _print_sweep(sweep: SweepPublic) -> None:
    objective = f"{sweep.objective['metric']} ({sweep.objective['mode']})"
    console.print(
        f"[bold]sweep {sweep.id}[/] {escape(sweep.name)}: {sweep.state}, {sweep.method}, {objective}"
    )
    if sweep.message:
        console.print(f"  {escape(sweep.message)}")
    table = Table(box=None, pad_edge=False)
    for column in ("trial", "job", "state", "step", "objective", "point"):
        table.add_column(column)
    for trial in sweep.trials:
        mark = " *" if sweep.best is not None and trial.job == sweep.best.job else ""
        table.add_row(
            f"{trial.trial}{mark}",
            str(trial.job),
            str(trial.state),
            str(trial.step if trial.step is not None else "-"),
            f"{trial.objective:.4g}" if trial.objective is not None else "-",
            escape(json.dumps(trial.params)),
        )
    console.print(table)
    console.print(f"{len(sweep.trials)} of {sweep.total} trials started; * the best")
