"""Tests that run trainers on a real local Ray cluster, one cluster per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.ray import local_ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A fresh local Ray cluster for one test module; yields its GCS address."""
    with local_ray() as address:
        yield address
