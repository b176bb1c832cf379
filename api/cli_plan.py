"""`apiary plan`: the cluster math of a run (service.planning.formulas) as a table, or one flat JSON object.

    apiary plan job.yaml --params 7e9 --step-time-s 1.2 --link-gbps 100 --storage-gbytes-per-s 2 \\
        --mtbf-h 24 --restart-s 120 --price-per-gpu-h 2.5 --spot-discount 0.6 --spot-preemptions-per-h 0.2

Facts come from the spec file, then from flags (flags win). With `--job ID` (or `--url`) the server
computes the plan, adding what Apiary measured: the job's spec and step time, the cluster's nodes
and the failure rate it has observed.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, NoReturn, Union, get_args, get_origin

import typer
from rich.console import Console
from rich.table import Table

from service.contract.errors import one_line
from service.contract.spec import JobSpec, parse_spec_text
from service.planning.formulas import Plan, PlanFacts, Row, facts_from_spec, merge_facts, plan

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


# Facts the command line gives in other units than PlanFacts' own (SI): flag -> (fact, scale, help).
SCALED_FLAGS: dict[str, tuple[str, float, str]] = {
    "link_gbps": ("link_bytes_per_s", 1e9 / 8, "Slowest link of the all-reduce, Gbit/s."),
    "link_gbytes_per_s": ("link_bytes_per_s", 1e9, "The same in GB/s."),
    "storage_gbytes_per_s": ("storage_bytes_per_s", 1e9, "Checkpoint write bandwidth, GB/s."),
    "mtbf_h": ("mtbf_s", 3600.0, "Mean time between failures of the job, hours."),
    "price_per_gpu_h": ("price_per_gpu_h_usd", 1.0, "On-demand USD per GPU-hour."),
}
# Facts that are shown, not given.
NOT_FLAGS = frozenset({"nodes"})


def fact_flags() -> list[inspect.Parameter]:
    """One option per fact of `PlanFacts` (its type and description), in its units or as SCALED_FLAGS
    says: the flags are read from the model, never listed twice."""
    scaled = {fact for fact, _, _ in SCALED_FLAGS.values()}
    options: list[tuple[str, type, str]] = []
    for name, field in PlanFacts.model_fields.items():
        if name in NOT_FLAGS:
            continue
        if name in scaled:
            options.extend(
                (flag, float, text) for flag, (fact, _, text) in SCALED_FLAGS.items() if fact == name
            )
            continue
        default = f" (default {field.default})" if field.default is not None else ""
        options.append((name, _scalar(field.annotation), f"{field.description}{default}"))
    return [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[kind | None, typer.Option(help=text)],
        )
        for name, kind, text in options
    ]


def _scalar(annotation: Any) -> type:
    """int or float for a (possibly optional, annotated) number; str for the rest (choices included)."""
    while get_origin(annotation) in (Union, UnionType, Annotated):
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    return annotation if annotation in (int, float) else str


def facts_from_flags(given: dict[str, Any]) -> dict[str, Any]:
    """The facts of the flags given (None: not given), in PlanFacts' units."""
    if given.get("link_gbps") is not None and given.get("link_gbytes_per_s") is not None:
        _usage_error("give --link-gbps or --link-gbytes-per-s, not both")
    facts: dict[str, Any] = {}
    for flag, value in given.items():
        if value is None:
            continue
        fact, scale, _ = SCALED_FLAGS.get(flag, (flag, 1.0, ""))
        facts[fact] = value * scale if flag in SCALED_FLAGS else value
    return facts


def plan_command(
    spec_file: Annotated[Path | None, typer.Argument(help="Job spec (YAML/JSON) to take facts from.")] = None,
    *,
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
    **flags: Any,
) -> None:
    """Throughput, communication ceiling, checkpoint cost, cadence, failure waste and price of a run."""
    import httpx

    from api.client import ApiaryClient, ApiaryClientError

    flags = facts_from_flags(flags)
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


def _with_fact_flags(command: Any) -> Any:
    """`command`'s signature with `**flags` replaced by the fact options (what Typer reads)."""
    signature = inspect.signature(command, eval_str=True)
    fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = signature.replace(parameters=[*fixed, *fact_flags()])
    command.__annotations__ = {p.name: p.annotation for p in command.__signature__.parameters.values()}
    return command


_with_fact_flags(plan_command)
