"""`apiary token create|list|revoke`: API tokens, on the database directly (APIARY_DATABASE_URL), so
that the first admin can be made before anyone can call the API; and the check that keeps `apiary
serve` from listening beyond loopback while anyone could call it as the local user (service.auth).

The secret of a new token goes to stdout alone (`export APIARY_TOKEN=$(apiary token create ada)`),
everything else to stderr; it is shown this once, and never logged.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from service.contract.errors import ApiaryError

if TYPE_CHECKING:
    # Imported where used: the client commands' `apiary` loads no database code (api/cli.py).
    from api.schemas import TokenPublic
    from service.auth import Auth
    from service.settings import Settings

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)


def register(app: typer.Typer, *, load_settings: Callable[[], Settings]) -> None:
    token_app = typer.Typer(
        help="API tokens (on the server's database): who may use Apiary, and who is an admin.",
        no_args_is_help=True,
    )
    app.add_typer(token_app, name="token")

    @token_app.command("create")
    def create(
        name: Annotated[str, typer.Argument(help="The user the token is for: the owner of their jobs.")],
        admin: Annotated[
            bool, typer.Option("--admin", help="An admin: any job, any priority, and tokens.")
        ] = False,
    ) -> None:
        """Issue a token for NAME and print it once. From the first token on, every request needs one."""
        with _one_line_errors(), _auth(load_settings()) as auth:
            issued = auth.create_token(user=name, admin=admin)
        role = "an admin" if admin else "a user"
        errors.print(
            f"token {issued.token.id} for {issued.token.user_name} ({role}); it is shown only now: pass "
            'it as APIARY_TOKEN, or `token = "..."` in ~/.config/apiary/config.toml, or log in to the '
            "web view"
        )
        print(issued.secret)

    @token_app.command("list")
    def list_tokens(
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON (for scripts).")] = False,
    ) -> None:
        """Every token (revoked ones too), without secrets: only their hashes are stored."""
        from api.schemas import TokenPublic

        with _auth(load_settings()) as auth:
            tokens = [TokenPublic.build(token) for token in auth.list_tokens()]
        if as_json:
            print(json.dumps({"data": [t.model_dump(mode="json") for t in tokens], "count": len(tokens)}))
            return
        _print_tokens(tokens)

    @token_app.command("revoke")
    def revoke(
        token_id: Annotated[int, typer.Argument(help="The token's id (`apiary token list`).")],
    ) -> None:
        """Revoke a token: it stops working at once."""
        with _one_line_errors(), _auth(load_settings()) as auth:
            token = auth.revoke_token(token_id)
        errors.print(f"token {token.id} of {token.user_name} is revoked")


def _print_tokens(tokens: list[TokenPublic]) -> None:
    from rich.table import Table

    table = Table(box=None)
    for column in ("ID", "USER", "ROLE", "CREATED", "REVOKED"):
        table.add_column(column)
    for token in tokens:
        table.add_row(
            str(token.id),
            token.user,
            "admin" if token.admin else "user",
            f"{token.created_at:%Y-%m-%d %H:%M}",
            f"{token.revoked_at:%Y-%m-%d %H:%M}" if token.revoked_at else "",
        )
    console.print(table)


@contextlib.contextmanager
def _auth(settings: Settings) -> Iterator[Auth]:
    from service.auth import Auth
    from service.store.db import Database

    settings.data_dir.mkdir(parents=True, exist_ok=True)  # the default SQLite file lives there
    db = Database(settings.resolved_database_url)
    try:
        db.upgrade()
        yield Auth(db=db, settings=settings)
    finally:
        db.dispose()


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    try:
        yield
    except ApiaryError as err:  # a bad name (InvalidSpec) or an unknown id: the user's mistake
        errors.print(f"[red]error:[/] {err.message}")
        raise typer.Exit(2) from None


def refuse_unsafe_bind(settings: Settings) -> None:
    """Exit 2 when `apiary serve` would listen beyond loopback with no auth: anyone who could reach it
    would be the local user, an admin."""
    from service.auth import CREATE_TOKEN_HINT, is_loopback

    if is_loopback(settings.host) or settings.auth_required:
        return
    with _auth(settings) as auth:
        if auth.required():
            return
    errors.print(
        f"[red]error:[/] refusing to listen on {settings.host}: no API token exists, so anyone who can "
        f"reach it could cancel any job. First {CREATE_TOKEN_HINT} (then every request needs a token), "
        "or set APIARY_AUTH_REQUIRED=true, or listen on 127.0.0.1."
    )
    raise typer.Exit(2)
