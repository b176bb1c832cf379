"""The pure parts of service.auth: tokens, their hashes, names, roles, and which addresses are local."""

from __future__ import annotations

import re

import pytest

from service.auth import (
    User,
    check_priority,
    check_user_name,
    hash_token,
    is_loopback,
    new_secret,
    require_admin,
    require_owner_or_admin,
)
from service.contract.errors import Forbidden, InvalidSpec


def test_a_token_is_256_random_bits_and_only_its_sha256_is_kept() -> None:
    secrets = {new_secret() for _ in range(1000)}
    assert len(secrets) == 1000
    assert all(re.fullmatch(r"apiary_[A-Za-z0-9_-]{43}", secret) for secret in secrets)
    secret = secrets.pop()
    assert hash_token(secret) == hash_token(secret) != hash_token(secret + "x")
    assert re.fullmatch(r"[0-9a-f]{64}", hash_token(secret)) and secret not in hash_token(secret)


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("apiary.example.com", False),
    ],
)
def test_only_loopback_addresses_are_local(host: str, local: bool) -> None:
    assert is_loopback(host) is local


def test_user_names_are_plain() -> None:
    assert check_user_name("ada.lovelace@lab-1") == "ada.lovelace@lab-1"
    for bad in ("", "-ada", "ada lovelace", "ada<b>", "a" * 129):
        with pytest.raises(InvalidSpec) as err:
            check_user_name(bad)
        assert err.value.field == "user"


def test_roles() -> None:
    ada, bob, root = User(name="ada"), User(name="bob"), User(name="root", admin=True)
    require_owner_or_admin(ada, owner="ada", job_id=1, action="cancel")
    require_owner_or_admin(root, owner="ada", job_id=1, action="cancel")
    with pytest.raises(Forbidden, match="job 1 belongs to ada: only its owner or an admin may cancel it"):
        require_owner_or_admin(bob, owner="ada", job_id=1, action="cancel")
    require_admin(root, action="x")
    with pytest.raises(Forbidden, match="only an admin may x"):
        require_admin(ada, action="x")
    check_priority(ada, 10, ceiling=10)
    check_priority(root, 100, ceiling=10)
    with pytest.raises(Forbidden) as err:
        check_priority(ada, 11, ceiling=10)
    assert err.value.field == "priority"
