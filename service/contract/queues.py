"""The two queues as configuration: guaranteed shares, borrowing, caps and preemption limits.

A YAML or JSON file named by `APIARY_QUEUES_FILE` overrides the built-in `DEFAULT_QUEUES`; any
field it leaves out keeps its default:

    research:
      share: 0.3                  # guaranteed fraction of every resource ({CPU: 0.3, GPU: 0.25} per resource)
      may_borrow: true            # may use what the other queue leaves idle (taken back by preemption)
      max_workers_per_job: 8      # larger jobs are refused at submission (422)
      max_runtime_s: 14400        # a job may ask for at most this (422 above it)
      default_max_runtime_s: 3600 # a job that asks for none gets this; it is stopped with a checkpoint then
      min_runtime_s: 300          # a job is never preempted before it has run this long
      reclaim_after_s: 1800       # the head waits this long for its share to free up before preempting
    full-scale:
      share: 0.7
      min_runtime_s: 3600
    fair_share_half_life_s: 86400 # owners' usage decays by half over this
    preempt_grace_s: 300          # a job told to checkpoint and stop is stopped anyway after this

Pure data: the policy, the scheduler and the simulator read it; nothing here does I/O but `load`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from service.contract.errors import InvalidSpec, one_line
from service.contract.spec import Queue, Strict


class QueueConfig(Strict):
    share: float | dict[str, float] = Field(
        description="Guaranteed fraction of the cluster: one number for every resource, or per resource."
    )
    may_borrow: bool = True
    max_workers_per_job: int | None = Field(default=None, ge=1)
    max_runtime_s: float | None = Field(default=None, gt=0)
    default_max_runtime_s: float | None = Field(default=None, gt=0)
    min_runtime_s: float = Field(default=0.0, ge=0)
    reclaim_after_s: float = Field(
        default=0.0,
        ge=0,
        description="The queue's head waits this long for its share to free up by itself (running jobs "
        "ending) before the other queue's borrowers are preempted for it.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> QueueConfig:
        shares = self.share.values() if isinstance(self.share, dict) else [self.share]
        if any(not 0 <= share <= 1 for share in shares):
            raise ValueError("share must be a fraction from 0 to 1 (or a map of them)")
        if (
            self.max_runtime_s is not None
            and self.default_max_runtime_s is not None
            and self.default_max_runtime_s > self.max_runtime_s
        ):
            raise ValueError("default_max_runtime_s must not exceed max_runtime_s")
        return self

    def share_of(self, resource: str) -> float:
        if isinstance(self.share, dict):
            return self.share.get(resource, 0.0)
        return self.share


class QueuesConfig(Strict):
    research: QueueConfig
    full_scale: QueueConfig = Field(alias="full-scale")
    fair_share_half_life_s: float = Field(default=86_400.0, gt=0)
    preempt_grace_s: float = Field(default=300.0, gt=0)

    model_config = Strict.model_config | {"populate_by_name": True}

    @model_validator(mode="after")
    def _shares_fit(self) -> QueuesConfig:
        resources = {
            key
            for queue in (self.research, self.full_scale)
            if isinstance(queue.share, dict)
            for key in queue.share
        } or {"*"}
        for resource in resources:
            total = self.research.share_of(resource) + self.full_scale.share_of(resource)
            if total > 1 + 1e-9:
                raise ValueError(f"the queues' shares of {resource} add up to {total:g}, more than 1")
        return self

    def of(self, queue: Queue | str) -> QueueConfig:
        return self.research if Queue(queue) is Queue.RESEARCH else self.full_scale


DEFAULT_QUEUES = QueuesConfig.model_validate(
    {
        "research": {
            "share": 0.3,
            "may_borrow": True,
            "max_workers_per_job": 8,
            "max_runtime_s": 4 * 3600,
            "default_max_runtime_s": 3600,
            "min_runtime_s": 300,
            "reclaim_after_s": 1800,
        },
        "full-scale": {"share": 0.7, "may_borrow": True, "min_runtime_s": 3600},
    }
)


def load(path: Path | None) -> QueuesConfig:
    """The queues of `path` (YAML or JSON) over the defaults; the defaults when `path` is None."""
    if path is None:
        return DEFAULT_QUEUES
    try:
        given = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise InvalidSpec(f"queues file {path}: {one_line(err)}", field="APIARY_QUEUES_FILE") from err
    if not isinstance(given, dict):
        raise InvalidSpec(f"queues file {path} must be a mapping", field="APIARY_QUEUES_FILE")
    merged: dict[str, Any] = DEFAULT_QUEUES.model_dump(by_alias=True)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    try:
        return QueuesConfig.model_validate(merged)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidSpec(
            f"queues file {path}: {where}: {first['msg']}", field="APIARY_QUEUES_FILE"
        ) from None
