"""Who may do what: API tokens, users and roles. The domain knows users, never HTTP headers.

A token is `apiary_` followed by 43 URL-safe characters (`secrets.token_urlsafe(32)`: 256 random bits),
shown once, when it is created. The database keeps only its SHA-256, so a copy of the database holds
no usable token: a token presented with a request is hashed, looked up by that hash, and the stored
hash compared with `hmac.compare_digest`. A revoked token stops working at once (every request looks
its token up). Tokens and their hashes are never logged.

The web view logs in with a token once (`start_session`) and then holds a server-side session: its
cookie is a random session id (stored as a SHA-256, like tokens) that logout, `SESSION_TTL_S` and the
revocation of its token end (`authenticate_session`).

Roles (`User.admin`):
- everyone authenticated may read everything (jobs, events, metrics, logs, queues, the web view);
- a user submits jobs that they own, with a priority of at most `Settings.user_max_priority`, and may
  cancel or preempt only their own jobs;
- an admin may do anything: cancel or preempt any job, submit at any priority, change a job's queue
  or priority afterwards (`JobService.update`), and create, list and revoke tokens.

Authentication fails closed. It is required when `Settings.auth_required` (APIARY_AUTH_REQUIRED, the
explicit switch), and from the moment a token is first created or the service starts listening on an
address other than loopback: that moment is persisted in the database (`AuthState`), not inferred per
request, and nothing in the service unsets it, so revoking tokens never opens a server again. The
last active admin token cannot be revoked (409 `LastAdminToken`). Until auth is required Apiary is one
local user (`Settings.local_user`, an admin), as it was before tokens: `apiary serve` refuses to
listen on a non-loopback address in that mode (api.cli).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from service.contract.errors import Forbidden, InvalidSpec, Unauthenticated
from service.settings import Settings
from service.store import repository
from service.store.db import Database
from service.store.models import ApiToken

TOKEN_PREFIX = "apiary_"
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
CREATE_TOKEN_HINT = "create one with `apiary token create NAME --admin` (on the server's database)"
UNKNOWN_TOKEN = "this API token is unknown or revoked: ask an admin for a new one, or " + CREATE_TOKEN_HINT
SESSION_TTL_S = 12 * 3600  # a web session's life at most (logout and revocation end it sooner)


@dataclass(frozen=True, kw_only=True)
class User:
    """Who a request is: the owner of the jobs it submits."""

    name: str
    admin: bool = False


@dataclass(frozen=True, kw_only=True)
class IssuedToken:
    """A token just created: the only time its secret exists outside its holder's hands."""

    token: ApiToken
    secret: str


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    """Whether `host` (an interface to listen on) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_user_name(name: str) -> str:
    if not USER_NAME.fullmatch(name):
        raise InvalidSpec(
            f"user name {name!r} must be 1-128 letters, digits, '.', '_', '@' or '-', starting with a "
            "letter or digit",
            field="user",
        )
    return name


def require_owner_or_admin(user: User, *, owner: str, job_id: int, action: str) -> None:
    if not (user.admin or user.name == owner):
        raise Forbidden(f"job {job_id} belongs to {owner}: only its owner or an admin may {action} it")


def require_admin(user: User, *, action: str) -> None:
    if not user.admin:
        raise Forbidden(f"only an admin may {action}")


def check_priority(user: User, priority: int, *, ceiling: int) -> None:
    """A user's jobs may not jump the queue: a priority above `ceiling` is an admin's to give."""
    if priority > ceiling and not user.admin:
        raise Forbidden(
            f"priority {priority} is above {ceiling}, the most a non-admin may ask for: use "
            f"{ceiling} or less, or ask an admin",
            field="priority",
        )


class Auth:
    """Tokens in the database, and the user a request's token stands for."""

    def __init__(self, *, db: Database, settings: Settings) -> None:
        self.db = db
        self.settings = settings
        self._required = False  # seen required once: it never goes back (another replica may set it)

    @property
    def local_user(self) -> User:
        return User(name=self.settings.local_user, admin=True)

    def required(self) -> bool:
        """Whether a request must carry a token (see the module docstring)."""
        if self.settings.auth_required or self._required:
            return True
        with self.db.session() as session:
            self._required = repository.auth_required(session)
        return self._required

    def require(self, *, reason: str) -> None:
        """Require a token from now on, for good (persisted)."""
        with self.db.session() as session:
            repository.require_auth(session, reason=reason)
        self._required = True

    def fail_closed(self, *, host: str) -> None:
        """At start: a service that listens beyond loopback, or is told to require auth, requires it
        for good."""
        if self.settings.auth_required:
            self.require(reason="APIARY_AUTH_REQUIRED is set")
        elif not is_loopback(host):
            self.require(reason=f"the service listens on {host}")

    def authenticate(self, secret: str | None) -> User:
        """The user `secret` belongs to; without one, the local user unless auth is required."""
        if not secret:
            if self.required():
                raise Unauthenticated()
            return self.local_user
        digest = hash_token(secret)
        with self.db.session() as session:
            token = repository.find_active_token(session, token_hash=digest)
            if token is None or not hmac.compare_digest(token.token_hash, digest):
                raise Unauthenticated(UNKNOWN_TOKEN)
            return User(name=token.user_name, admin=token.admin)

    def start_session(self, secret: str) -> str:
        """Log the web view in with an API token: a new session id for the browser's cookie (the
        token itself never leaves the login form). `Unauthenticated` for a bad token."""
        digest = hash_token(secret)
        session_id = secrets.token_urlsafe(32)
        with self.db.session() as session:
            token = repository.find_active_token(session, token_hash=digest)
            if token is None or not hmac.compare_digest(token.token_hash, digest):
                raise Unauthenticated(UNKNOWN_TOKEN)
            expires_at = datetime.now(UTC) + timedelta(seconds=SESSION_TTL_S)
            repository.add_web_session(
                session, token=token, session_hash=hash_token(session_id), expires_at=expires_at
            )
        return session_id

    def authenticate_session(self, session_id: str) -> User:
        """The user of a web session that has not ended (logout), expired, or lost its token."""
        with self.db.session() as session:
            token = repository.find_web_session_token(session, session_hash=hash_token(session_id))
            if token is None:
                raise Unauthenticated(
                    "this web session ended (logged out, expired, or its token was revoked): log in again"
                )
            return User(name=token.user_name, admin=token.admin)

    def end_session(self, session_id: str) -> None:
        with self.db.session() as session:
            repository.end_web_session(session, session_hash=hash_token(session_id))

    def create_token(self, *, user: str, admin: bool = False) -> IssuedToken:
        secret = new_secret()
        with self.db.session() as session:
            token = repository.add_token(
                session, user_name=check_user_name(user), admin=admin, token_hash=hash_token(secret)
            )
            return IssuedToken(token=token, secret=secret)

    def list_tokens(self) -> list[ApiToken]:
        with self.db.session() as session:
            return repository.list_tokens(session)

    def revoke_token(self, token_id: int) -> ApiToken:
        with self.db.session() as session:
            return repository.revoke_token(session, token_id)
