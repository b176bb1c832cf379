"""What the job's driver hands every worker: Ray Train's `train_loop_config`, typed.

Ray Train pickles the loop config to each worker as a plain dict; this is its one reader and its one
writer (`trainers.launch` writes it; the recipes' loop, the training context and the Ray-function
runner read it):

- `request`: the attempt's `LaunchRequest` (the spec with it);
- `dataset`, `eval_dataset`: what the driver learned of the datasets (`DatasetInfo`), or None;
- `handoff`: the attempt's handoff pointer, not its report token (Ray Train keeps the loop config);
  each worker reads the token from storage (`token()`). None for a run without one.
- `credentials`: the job's S3 credentials that the driver redeemed (service.contract.handoff), which
  `from_dict` installs in the worker's process: pickled by Ray to the workers, never in their
  environment. None: the AWS SDK's own chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.contract.handoff import LOOP_CONFIG_KEY, read_token
from service.contract.protocol import LaunchPointer, LaunchRequest
from service.contract.storage import S3Credentials, s3_credentials, use_s3_credentials
from trainers.data import DatasetInfo


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    request: LaunchRequest
    dataset: DatasetInfo | None = None
    eval_dataset: DatasetInfo | None = None
    handoff: LaunchPointer | None = None
    credentials: S3Credentials | None = field(default_factory=s3_credentials, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The dict Ray Train carries (JSON-ready values only)."""
        return {
            "request": self.request.model_dump(mode="json"),
            "dataset": self.dataset.to_dict() if self.dataset is not None else None,
            "eval_dataset": self.eval_dataset.to_dict() if self.eval_dataset is not None else None,
            # The pointer without its fetch token (dead once the driver redeemed it).
            LOOP_CONFIG_KEY: self.handoff.model_copy(update={"credentials_token": None}).model_dump(
                mode="json"
            )
            if self.handoff is not None
            else None,
            "credentials": self.credentials.model_dump() if self.credentials is not None else None,
        }

    @classmethod
    def from_dict(cls, loop_config: dict[str, Any]) -> LoopConfig:
        """The worker's loop config; installs its S3 credentials in this process (`use_s3_credentials`)
        first, so that every S3 filesystem the worker resolves uses them."""
        credentials = loop_config.get("credentials")
        if credentials is not None:
            use_s3_credentials(S3Credentials.model_validate(credentials))

        def dataset(key: str) -> DatasetInfo | None:
            value = loop_config.get(key)
            return DatasetInfo.from_dict(value) if value is not None else None

        handoff = loop_config.get(LOOP_CONFIG_KEY)
        return cls(
            request=LaunchRequest.model_validate(loop_config["request"]),
            dataset=dataset("dataset"),
            eval_dataset=dataset("eval_dataset"),
            handoff=LaunchPointer.model_validate(handoff) if handoff is not None else None,
            credentials=s3_credentials(),
        )

    def token(self) -> str | None:
        """The attempt's report token, read from its handoff folder; None without a handoff."""
        return read_token(self.handoff) if self.handoff is not None else None
