"""The `apiary` command: run the service, or the demo a new user starts with."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn
from rich.console import Console

from api.app import create_app
from api.client import ApiaryClientError
from api.demo import run_demo_job, write_demo_dataset
from api.server import BackgroundServer
from service.cluster import free_port
from service.errors import one_line
from service.settings import Settings
from service.spec import DataFormat

app = typer.Typer(
    help="Apiary: queue and run distributed PyTorch training jobs on Ray.", no_args_is_help=True
)
console = Console(soft_wrap=True)


def _settings(**overrides: Any) -> Settings:
    try:
        return Settings(**{key: value for key, value in overrides.items() if value is not None})
    except ValueError as err:  # pydantic's ValidationError: a bad APIARY_* variable
        console.print(f"[red]error:[/] bad configuration: {err}")
        raise typer.Exit(2) from None


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Interface to listen on [default: 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on [default: 8000].")] = None,
) -> None:
    """Start the API, the scheduler and (unless APIARY_RAY_ADDRESS is set) a local Ray."""
    _configure_logging()
    settings = _settings(host=host, port=port)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


@app.command()
def demo(
    steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 60,
    workers: Annotated[int, typer.Option(min=1, help="Train workers.")] = 2,
) -> None:
    """Write a small token dataset, start Apiary, train a tiny GPT on 2 workers, show progress."""
    logging.basicConfig(level=logging.WARNING)
    port = free_port()
    settings = _settings(port=port)
    dataset = settings.data_dir / "datasets" / "demo-tokens"
    console.print(f"[bold]1.[/] writing a synthetic token dataset to {dataset}")
    write_demo_dataset(dataset)
    console.print(f"[bold]2.[/] starting Apiary on {settings.resolved_public_url} (SQLite, local Ray)")
    server = BackgroundServer(create_app(settings), host=settings.host, port=settings.port)
    server.start()
    try:
        code = run_demo_job(
            settings.resolved_public_url, dataset=dataset, steps=steps, workers=workers, console=console
        )
    finally:
        console.print("stopping Apiary and its local Ray ...")
        server.stop()
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


def main() -> None:
    try:
        app()
    except ApiaryClientError as err:
        console.print(f"[red]error:[/] {err.message}")
        sys.exit(1)


if __name__ == "__main__":
    main()
