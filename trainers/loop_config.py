"""What the job's driver hands every worker: Ray Train's `train_loop_config`, typed.

Ray Train pickles the loop config to each worker as a plain dict; this is its one reader and its one
writer (`trainers.launch` writes it; the recipes' loop, the training context and the Ray-function
runner read it):

- `request`: the attempt's `LaunchRequest` (the spec with it);
- `dataset`, `eval_dataset`: what the driver learned of the datasets (`DatasetInfo`), or None;
- `handoff`: the attempt's handoff pointer, not its report token (Ray Train keeps the loop config);
  each worker reads the token from storage (`token()`). None for a run without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.contract.handoff import LOOP_CONFIG_KEY, read_token
from service.contract.protocol import LaunchPointer, LaunchRequest
from trainers.data import DatasetInfo


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    request: LaunchRequest
    dataset: DatasetInfo | None = None
    eval_dataset: DatasetInfo | None = None
    handoff: LaunchPointer | None = None

    def to_dict(self) -> dict[str, Any]:
        """The dict Ray Train carries (JSON-ready values only)."""
        return {
            "request": self.request.model_dump(mode="json"),
            "dataset": self.dataset.to_dict() if self.dataset is not None else None,
            "eval_dataset": self.eval_dataset.to_dict() if self.eval_dataset is not None else None,
            LOOP_CONFIG_KEY: self.handoff.model_dump(mode="json") if self.handoff is not None else None,
        }

    @classmethod
    def from_dict(cls, loop_config: dict[str, Any]) -> LoopConfig:
        def dataset(key: str) -> DatasetInfo | None:
            value = loop_config.get(key)
            return DatasetInfo.from_dict(value) if value is not None else None

        handoff = loop_config.get(LOOP_CONFIG_KEY)
        return cls(
            request=LaunchRequest.model_validate(loop_config["request"]),
            dataset=dataset("dataset"),
            eval_dataset=dataset("eval_dataset"),
            handoff=LaunchPointer.model_validate(handoff) if handoff is not None else None,
        )

    def token(self) -> str | None:
        """The attempt's report token, read from its handoff folder; None without a handoff."""
        return read_token(self.handoff) if self.handoff is not None else None
