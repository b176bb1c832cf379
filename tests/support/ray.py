"""A fresh local Ray cluster for tests that run trainers through `trainers.launch.run()`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def local_ray(*, runtime_env: dict[str, Any] | None = None) -> Iterator[str]:
    """A fresh local Ray cluster (8 logical CPUs) with the settings of the service's own local Ray
    (`service.cluster.LOCAL_RAY_ENV`: e.g. no preemption watcher actor per run); yields its GCS
    address, then shuts it down."""
    import ray

    from service.cluster import LOCAL_RAY_ENV

    # Ray's processes inherit this process's environment. ray.init() of a new local cluster also
    # switches this process to token auth by setting RAY_AUTH_MODE: put the environment back, so that
    # later tests in this session start from what they expect.
    saved = {name: os.environ.get(name) for name in (*LOCAL_RAY_ENV, "RAY_AUTH_MODE")}
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=runtime_env)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
