"""Ray Train's torch process-group backend, without importing torch where no tensor lives.

`ray.train.torch.TorchConfig` is what a `TorchTrainer` hands Ray Train: the job's driver builds it
and the Train controller unpickles it, and both then import torch (a costly import, on the path
from submission to the first step) only to run `_TorchBackend.on_start` from the controller, which
calls functions that run on the workers.

`ProcessGroupConfig` is the same backend for `DataParallelTrainer`, from a module that imports no
torch: the controller picks the rendezvous address and tells each worker to set up its process
group, and every function that touches torch runs on the workers, where Ray's own
`ray.train.torch.config` helpers do the work (the same environment variables, NCCL error handling
and timeouts as `TorchTrainer`). Only the "env://" rendezvous of Ray Train V2 worker groups is
supported, which is all Apiary uses. The Ray names it needs that Ray does not promise to keep come
from `trainers.ray_private`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)

from trainers import startup
from trainers.ray_private import (
    TORCH_SET_ENV_VARS,
    TORCH_SETUP_PROCESS_GROUP,
    TORCH_SHUTDOWN,
    TrainingFramework,
    get_address_and_port,
)

logger = logging.getLogger(__name__)


@dataclass
class ProcessGroupConfig(BackendConfig):
    """`TorchConfig(backend=..., init_method="env", timeout_s=...)`, torch-free until a worker runs it."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type[Backend]:
        return ProcessGroupBackend

    @property
    def train_func_context(self) -> type[TorchDeviceContext]:
        return TorchDeviceContext

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class ProcessGroupBackend(Backend):
    """`ray.train.torch.config._TorchBackend` for V2 worker groups, run from the controller."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, ProcessGroupConfig)
        startup.mark("workers_started")
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, address=address, port=port)
        worker_group.execute(_torch_config_call, TORCH_SET_ENV_VARS)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    _torch_config_call,
                    TORCH_SETUP_PROCESS_GROUP,
                    backend=backend_config.backend,
                    world_rank=rank,
                    world_size=len(worker_group),
                    init_method="env://",
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(len(worker_group))
            ]
        )
        startup.mark("process_group_ready")
        startup.emit("controller")

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        futures = worker_group.execute_async(
            _torch_config_call, TORCH_SHUTDOWN, destroy_process_group=len(worker_group) > 1
        )
        default = DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        timeout_s = int(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, default))
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning("torch process group shutdown timed out after %d s", timeout_s)


class TorchDeviceContext:
    """Around the train function on each worker: Ray's `TorchConfigContextManager` (the CUDA device)."""

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        TorchConfigContextManager().__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        return None


def _set_master(*, address: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)


def _torch_config_call(name: str, /, **kwargs: Any) -> Any:
    """On a worker: call `ray.train.torch.config.<name>` (the import, and torch's, happen here)."""
    startup.mark("torch_importing")
    from ray.train.torch import config

    startup.mark("torch_imported")
    result = getattr(config, name)(**kwargs)
    startup.mark(f"{name.strip('_')}_done")
    return result
