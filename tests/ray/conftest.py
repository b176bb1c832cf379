"""Tests that run trainers on a real local Ray cluster, one cluster for the whole `tests/ray` package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.settings import Settings
from tests.conftest import S3_ENV
from tests.support.ray import local_ray


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[str]:
    """A fresh local Ray cluster shared by the modules of `tests/ray`; yields its GCS address.

    Starting and stopping a local Ray costs seconds of both cores each time, and the modules' jobs
    leave nothing behind that another module sees (each writes under its own tmp_path). The cluster
    stops when the package's last test is done, before `tests/e2e` starts its own.

    Its job-level runtime_env carries Ray Train's settings of the service's jobs
    (`Settings.job_ray_env`), and the AWS variables of the tests' S3 server (fake credentials,
    no endpoint): Train workers and Ray Data tasks of tests/ray/test_s3_run.py read S3 with them; the
    other jobs never read them. The service's own jobs get theirs in memory instead, for a fetch
    token (tests/e2e/test_multinode_secrets.py).
    """
    with local_ray(runtime_env={"env_vars": {**S3_ENV, **Settings().job_ray_env()}}) as address:
        yield address
