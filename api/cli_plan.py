"""`apiary plan`: the cluster math of a run (service.planning.formulas) as a table, or one flat JSON object.

    apiary plan job.yaml --params 7e9 --step-time-s 1.2 --link-gbps 100 --storage-gbytes-per-s 2 \\
        --mtbf-h 24 --restart-s 120 --price-per-gpu-h 2.5 --spot-discount 0.6 --spot-preemptions-per-h 0.2

Facts come from the spec file, then from flags (flags win). With `--job ID` (or `--url`) the server
computes the plan, adding what Apiary measured: the job's spec and step time, the cluster's nodes
and the failure rate it has observed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.table import Table

from api.client import ApiaryClient, ApiaryClientError
from service.contract.errors import one_line
from service.contract.spec import JobSpec, parse_spec_text
from service.planning.formulas import Plan, Row, facts_from_spec, merge_facts, plan

console = Console(soft_wrap=True)

# A fact's flag, for "needs ..." (the facts that flags give in other units).
FLAGS = {
    "link_bytes_per_s": "--link-gbps or --link-gbytes-per-s",
    "storage_bytes_per_s": "--storage-gbytes-per-s",
    "mtbf_s": "--mtbf-h",
    "price_per_gpu_h_usd": "--price-per-gpu-h",
}
_UNIT_SCALES = (("B", 1e12, "TB"), ("B", 1e9, "GB"), ("B", 1e6, "MB"), ("B", 1e3, "kB"))


def _flag(fact: str) -> str:
    return FLAGS.get(fact, "--" + fact.replace("_", "-"))


def _need_text(need: str) -> str:
    """A fact as its flag; "a | b and c" as "--a, or --b and --c"; a condition as it is."""
    if "|" in need:
        options = need.split("|")
        return ", or ".join(
            " and ".join(_flag(fact.strip()) for fact in option.split(" and ")) for option in options
        )
    return _flag(need) if need.isidentifier() else need


def needs_text(needs: list[str]) -> str:
    """What an absent quantity lacks, as flags: "needs --params, --workers (or give --ckpt-bytes)"."""
    required = [need for need in needs if not need.startswith("or ")]
    given = [need.removeprefix("or ") for need in needs if need.startswith("or ")]
    text = "needs " + "; ".join(_need_text(need) for need in required)
    return text + (f" (or give {', '.join(_flag(fact) for fact in given)})" if given else "")


def format_value(value: Any, unit: str) -> str:
    """A value with its unit, readable: 8.4e10 B -> '84.0 GB', 2693.99 s -> '2694 s (44.9 min)'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if unit == "B":
        for _, scale, name in _UNIT_SCALES:
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.0f} B"
    if unit == "s":
        text = f"{value:.3g} s" if value < 100 else f"{value:.0f} s"
        if value >= 7200:
            return f"{text} ({value / 3600:.1f} h)"
        return f"{text} ({value / 60:.1f} min)" if value >= 120 else text
    if unit == "USD":
        return f"${value:,.2f}"
    if isinstance(value, int):
        return f"{value:,} {unit}".strip()
    return f"{value:.4g} {unit}".strip()


def print_table(rows: list[dict[str, Any]], *, sources: dict[str, str]) -> None:
    table = Table(title="apiary plan", show_lines=False)
    for column in ("quantity", "formula", "value", "what it means"):
        table.add_column(column, justify="right" if column == "value" else "left", overflow="fold")
    for row in rows:
        value = row["value"]
        text = (
            format_value(value, row["unit"]) if value is not None else f"[dim]{needs_text(row['needs'])}[/]"
        )
        table.add_row(row["name"], row["formula"], text, row["meaning"])
    console.print(table)
    if sources:
        by_source: dict[str, list[str]] = {}
        for fact, source in sources.items():
            by_source.setdefault(source, []).append(fact)
        console.print(
            "facts: " + "; ".join(f"{source}: {', '.join(facts)}" for source, facts in by_source.items())
        )


def _usage_error(message: str) -> NoReturn:
    console.print(f"[red]error:[/] {message}")
    raise typer.Exit(2)


def _rows(result: Plan) -> list[dict[str, Any]]:
    rows: tuple[Row, ...] = result.rows
    return [row.as_dict() for row in rows]


def plan_command(
    spec_file: Annotated[Path | None, typer.Argument(help="Job spec (YAML/JSON) to take facts from.")] = None,
    params: Annotated[float | None, typer.Option(min=1, help="Model parameters, e.g. 70e9.")] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Data-parallel workers.")] = None,
    batch_per_worker: Annotated[int | None, typer.Option(min=1, help="Samples per worker per step.")] = None,
    step_time_s: Annotated[float | None, typer.Option(help="Compute time per step, seconds.")] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Steps of the run (prices it without --hours).")
    ] = None,
    grad_bytes_per_worker: Annotated[
        float | None, typer.Option(help="Bytes each worker moves per step [default: from params].")
    ] = None,
    link_gbps: Annotated[float | None, typer.Option(help="Slowest link of the all-reduce, Gbit/s.")] = None,
    link_gbytes_per_s: Annotated[float | None, typer.Option(help="The same in GB/s.")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, bf16 or fp16 [default: fp32].")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adam or sgd [default: adam].")] = None,
    ckpt_bytes: Annotated[float | None, typer.Option(help="Checkpoint size [default: from params].")] = None,
    storage_gbytes_per_s: Annotated[
        float | None, typer.Option(help="Checkpoint write bandwidth, GB/s.")
    ] = None,
    ckpt_write_s: Annotated[
        float | None, typer.Option(help="A measured checkpoint save time, seconds.")
    ] = None,
    ckpt_every_steps: Annotated[int | None, typer.Option(help="Checkpoint every K steps.")] = None,
    ckpt_every_s: Annotated[float | None, typer.Option(help="Checkpoint every S seconds.")] = None,
    mtbf_h: Annotated[
        float | None, typer.Option(help="Mean time between failures of the job, hours.")
    ] = None,
    restart_s: Annotated[float | None, typer.Option(help="Time a restart takes, seconds.")] = None,
    gpus_per_worker: Annotated[float | None, typer.Option(help="GPUs per worker [default: 1].")] = None,
    price_per_gpu_h: Annotated[float | None, typer.Option(help="On-demand USD per GPU-hour.")] = None,
    spot_discount: Annotated[float | None, typer.Option(help="Spot's fraction off, e.g. 0.6.")] = None,
    spot_preemptions_per_h: Annotated[float | None, typer.Option(help="Spot preemptions per hour.")] = None,
    hours: Annotated[
        float | None, typer.Option(help="Wall hours to price [default: steps x step time].")
    ] = None,
    job: Annotated[
        int | None, typer.Option(help="Add what Apiary measured of this job (asks the server).")
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(envvar="APIARY_URL", help="Compute on this Apiary server (adds the cluster's facts)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every quantity as one flat JSON object.")
    ] = False,
) -> None:
    """Throughput, communication ceiling, checkpoint cost, cadence, failure waste and price of a run."""
    if link_gbps is not None and link_gbytes_per_s is not None:
        _usage_error("give --link-gbps or --link-gbytes-per-s, not both")
    flags: dict[str, Any] = {
        "params": params,
        "workers": workers,
        "batch_per_worker": batch_per_worker,
        "step_time_s": step_time_s,
        "steps": steps,
        "grad_bytes_per_worker": grad_bytes_per_worker,
        "link_bytes_per_s": link_gbps * 1e9 / 8 if link_gbps is not None else None,
        "precision": precision,
        "optimizer": optimizer,
        "ckpt_bytes": ckpt_bytes,
        "storage_bytes_per_s": storage_gbytes_per_s * 1e9 if storage_gbytes_per_s is not None else None,
        "ckpt_write_s": ckpt_write_s,
        "ckpt_every_steps": ckpt_every_steps,
        "ckpt_every_s": ckpt_every_s,
        "mtbf_s": mtbf_h * 3600 if mtbf_h is not None else None,
        "restart_s": restart_s,
        "gpus_per_worker": gpus_per_worker,
        "price_per_gpu_h_usd": price_per_gpu_h,
        "spot_discount": spot_discount,
        "spot_preemptions_per_h": spot_preemptions_per_h,
        "hours": hours,
    }
    if link_gbytes_per_s is not None:
        flags["link_bytes_per_s"] = link_gbytes_per_s * 1e9
    flags = {name: value for name, value in flags.items() if value is not None}
    spec: JobSpec | None = None
    if spec_file is not None:
        try:
            spec = JobSpec.model_validate(parse_spec_text(spec_file.read_text()))
        except (OSError, ValueError) as err:
            _usage_error(f"{spec_file}: {one_line(err)}")
    if job is not None or url is not None:
        url = url or "http://127.0.0.1:8000"
        try:
            with ApiaryClient(url) as client:
                answer = client.plan(facts=flags, spec=spec, job_id=job)
        except ApiaryClientError as err:  # a bad fact (422), no such job (404)
            _usage_error(err.message)
        except httpx.HTTPError as err:
            console.print(f"[red]error:[/] cannot reach Apiary at {url}: {one_line(err)}")
            raise typer.Exit(1) from None
        flat, rows, sources = answer["plan"], answer["rows"], answer["sources"]
    else:
        layers = [("spec", facts_from_spec(spec))] if spec is not None else []
        try:
            facts, sources = merge_facts(*layers, ("flag", flags))
        except ValueError as err:
            _usage_error(one_line(err))
        result = plan(facts)
        flat, rows = result.as_dict(), _rows(result)
    if as_json:
        print(json.dumps(flat))
        return
    print_table(rows, sources=sources)
