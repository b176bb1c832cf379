"""A fresh local Ray cluster for tests that run trainers through `trainers.launch.run()`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def local_ray(*, runtime_env: dict[str, Any] | None = None) -> Iterator[str]:
    """A fresh local Ray cluster (8 logical CPUs); yields its GCS address, then shuts it down."""
    import ray

    # ray.init() of a new local cluster switches this process to token auth by setting RAY_AUTH_MODE;
    # put the environment back so later tests in this session start from what they expect.
    saved = os.environ.get("RAY_AUTH_MODE")
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=runtime_env)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
