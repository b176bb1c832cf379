"""The job spec: the one schema that the API, the service and the trainers share.

A spec that the API accepts is exactly what the trainer runs. This module must stay importable
without SQLAlchemy, FastAPI or Ray: the trainers import it on the cluster. It also holds the
hyperparameter schemas of the built-in trainers (`BUILTIN_CONFIGS`), so that the API validates a
built-in's `config` without importing the trainers; `trainers.recipes` binds each name to its
implementation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic import (
    Strict as StrictType,
)
from pydantic_core import PydanticCustomError

from service.contract.formats import DataFormat
from service.contract.signal import parse_time

MAX_WORKERS = 1024
MAX_PRIORITY = 100
# The largest integer the API takes anywhere (ids, steps, counts): every JSON client reads it exactly
# (a double's 53 bits), and it fits the database's 64-bit columns.
MAX_INT = 2**53 - 1
MAX_CONFIG_BYTES = 64 * 1024
MAX_URI_CHARS = 4096
# Text that is stored: PostgreSQL's text cannot hold a NUL character.
NO_NUL = r"^[^\x00]*$"
# Matched whole (`fullmatch`); the same patterns are in the OpenAPI schema, so that a client generating
# specs from it and the server agree.
_IMPORT_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
_CODE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RESOURCE = re.compile(r"[A-Za-z_][A-Za-z0-9_:.-]{0,63}")
MAX_TRAINER_CHARS = 256
MAX_RESOURCES = 32
# A step metric's name (checkpoint.keep_best, plateau).
_METRIC_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"


def _number(value: Any) -> Any:
    """No `false` for a step and no "1" for a count: JSON has one number type (3.0 is the integer 3, as
    in JSON Schema), and neither a boolean nor a string is one. Non-finite floats: see `Strict`."""
    if isinstance(value, bool | str | bytes):
        raise PydanticCustomError(
            "number_type", "Input should be a number, not {kind}", {"kind": type(value).__name__}
        )
    return value


# Bounded by each field (`le=MAX_INT` where nothing smaller applies): a bound here would override theirs.
Int = Annotated[int, BeforeValidator(_number)]
Float = Annotated[float, BeforeValidator(_number)]
Bool = Annotated[bool, StrictType()]


class Queue(StrEnum):
    RESEARCH = "research"
    FULL_SCALE = "full-scale"


class Strategy(StrEnum):
    DDP = "ddp"
    FSDP = "fsdp"


class Placement(StrEnum):
    """Where Ray puts the workers of a group: its placement group's strategy (admission agrees)."""

    PACK = "pack"  # as few nodes as possible (Ray's default)
    SPREAD = "spread"  # over as many nodes as it can, best effort
    STRICT_SPREAD = "strict_spread"  # every worker on a node of its own, or the job waits


class SpotUse(StrEnum):
    """Whether a job's workers may run on spot nodes (capacity that may be taken back, with a notice)."""

    ALLOWED = "allowed"  # on spot or on-demand nodes, whichever is free (research's default)
    NEVER = "never"  # on-demand nodes only: admission counts only them, Ray's placement is held to them
    PREFERRED = "preferred"  # spot nodes first; on-demand where the spot nodes cannot take the gang

    @classmethod
    def default_for(cls, queue: Queue) -> SpotUse:
        return cls.NEVER if queue is Queue.FULL_SCALE else cls.ALLOWED


# A spot node carries the Ray node label `spot=true` (`ray start --labels spot=true`: the primary mark),
# or Ray's own `ray.io/market-type=spot` (Ray sets it from RAY_NODE_MARKET_TYPE, as KubeRay may); both
# hold Ray's placement. The custom resource `spot` (`--resources '{"spot": 1}'`) is accepted too, but
# only admission and the counts see it: Ray cannot keep a `never` job off such a node (docs/deploy.md).
SPOT_LABEL = "spot"
MARKET_TYPE_LABEL = "ray.io/market-type"
SPOT_RESOURCE = "spot"
# What a `never` job's workers ask of Ray (ScalingConfig.label_selector): a node with neither label.
# A node without the label matches `!value` (checked on Ray 2.60: tests/ray/test_spot_placement.py).
ON_DEMAND_SELECTOR = {SPOT_LABEL: "!true", MARKET_TYPE_LABEL: "!spot"}


def is_spot_node(labels: Mapping[str, str], resources: Mapping[str, float]) -> bool:
    """Whether a Ray node, by its labels and resources, is a spot node (the marks above)."""
    return (
        labels.get(SPOT_LABEL) == "true"
        or labels.get(MARKET_TYPE_LABEL) == "spot"
        or resources.get(SPOT_RESOURCE, 0.0) > 0
    )


class Strict(BaseModel):
    """Unknown fields are an error, NaN and infinity too, and a validated value never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DatasetSpec(Strict):
    uri: str = Field(
        max_length=MAX_URI_CHARS,
        description="Folder or file of shards: file:///abs/path or s3://bucket/prefix.",
        json_schema_extra={"pattern": "^(file:///|s3://)[^\\x00]*$"},
    )
    format: DataFormat = DataFormat.PARQUET
    shuffle: Bool = Field(default=True, description="Shuffle shards and samples by (seed, epoch).")
    shuffle_buffer_rows: Int = Field(
        default=1024, le=MAX_INT, ge=1, description="Samples are shuffled within a window of this many rows."
    )

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        if not uri.startswith(("file:///", "s3://")):
            raise ValueError("must start with file:/// (an absolute local path) or s3://")
        if "\x00" in uri:
            raise ValueError("must not contain a NUL character")
        return uri


class KeepBest(Strict):
    """Also keep the `count` checkpoints with the best value of a step metric (rank 0's, at the
    checkpoint's step), lowest first for `mode: min`, highest first for `max`."""

    metric: str = Field(
        pattern=_METRIC_NAME,
        description="A metric the trainers report with each step, e.g. 'loss' (built-ins: trainers.loop).",
    )
    mode: Literal["min", "max"] = Field(description="min: lower is better (loss); max: higher is.")
    count: Int = Field(default=1, ge=1, le=1000)


class CheckpointSpec(Strict):
    """When to checkpoint, and whether the write stalls training.

    `every_steps` and `every_s` may both be set: a checkpoint is taken at whichever comes first (the
    ranks agree on the step). A final one is always saved at max_steps, and one when the job is asked
    to stop.
    """

    # `async` is a Python keyword: the attribute is `async_`, the spec (JSON/YAML) field is "async".
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True, serialize_by_alias=True
    )

    every_steps: Int | None = Field(
        default=None,
        le=MAX_INT,
        ge=1,
        description="Save a checkpoint every N steps; a final one is always saved at max_steps.",
    )
    keep_last: Int = Field(
        default=3,
        ge=1,
        le=1000,
        description="The service deletes older checkpoints beyond the newest keep_last (and keep_best); "
        "the one the job resumes from is always kept (service.scheduling.retention).",
    )
    keep_best: KeepBest | None = Field(
        default=None, description="Also keep the best checkpoints by a step metric, e.g. {metric: loss}."
    )
    every_s: Float | None = Field(
        default=None,
        gt=0,
        description="Save a checkpoint when this many seconds have passed since the last one.",
    )
    async_: Bool = Field(
        default=True,
        alias="async",
        description="Copy the state to host memory at the step and write it in the background while "
        "training goes on (at most one write in flight); false writes it before the next step.",
    )
    auto: Bool = Field(
        default=False,
        description="Choose the time between checkpoints: Daly's optimum (service.planning.formulas) for "
        "the save time the trainers measure (the first save comes after the first step) and the mean time "
        "between failures Apiary has observed on the cluster; shown as a `checkpoint_cadence` event of the "
        "job. Replaces every_s; every_steps, if set, still applies (whichever comes first).",
    )

    @model_validator(mode="after")
    def _one_time_cadence(self) -> CheckpointSpec:
        if self.auto and self.every_s is not None:
            raise ValueError("set every_s or auto: true, not both (auto chooses the time between saves)")
        return self


# Eval metrics are recorded as `eval_<name>` (`eval_loss`), beside the step's training metrics.
EVAL_PREFIX = "eval_"


class EvalSpec(Strict):
    """Evaluation on held-out data, for recipes (the built-ins too): every `every_steps` steps and once
    at the end, the model runs without gradients over the same batches of `dataset` each time (each
    rank its first `max_batches` batches of `batch_size` rows, in the data's order for the job's seed
    and world size), and the recipe's eval metrics (`eval_loss`, and the rest of what
    `Recipe.evaluate` returns as `eval_<name>`), averaged over the batches and the ranks, are recorded
    at their step, where `checkpoint.keep_best.metric` may use them."""

    dataset: DatasetSpec = Field(
        description="The held-out data, in the training data's format and row shape."
    )
    every_steps: Int | None = Field(
        default=None,
        le=MAX_INT,
        ge=1,
        description="Evaluate every N steps; None: only at the end (a final eval always runs at max_steps).",
    )
    max_batches: Int | None = Field(
        default=None,
        le=MAX_INT,
        ge=1,
        description="Batches each rank evaluates; None: its whole share of the dataset (kept in memory).",
    )


class AnomalyAction(StrEnum):
    """What the built-in trainers do about bad numerics at a step (`trainers.anomaly`)."""

    STOP = "stop"  # fail the job, naming the step, rank and value
    ROLLBACK = "rollback"  # restore the last checkpoint and skip the offending batch
    WARN = "warn"  # record it and go on (a non-finite step's update is still skipped)


class AnomalySpec(Strict):
    """When a step's numerics count as an anomaly, and how often a run may roll back."""

    zscore: Float = Field(
        default=6.0,
        gt=0,
        description="A gradient norm this many standard deviations above the mean of the recent window "
        "is a spike. NaN or infinite loss or gradient norm is always an anomaly.",
    )
    window: Int = Field(
        default=50, ge=2, le=10_000, description="Recent normal steps whose gradient norms the z-score uses."
    )
    min_steps: Int = Field(
        default=20,
        le=MAX_INT,
        ge=2,
        description="Normal steps in the window before spikes are looked for (at most `window`).",
    )
    max_rollbacks: Int = Field(
        default=3,
        ge=0,
        le=100,
        description="Rollbacks a run may make (counted in its checkpoints); one more anomaly then stops it.",
    )

    @model_validator(mode="after")
    def _min_steps_fit(self) -> AnomalySpec:
        if self.min_steps > self.window:
            raise ValueError(f"min_steps ({self.min_steps}) must be <= window ({self.window})")
        return self


class PlateauAction(StrEnum):
    """What the service does when a job's loss stops improving (`service.plateau`)."""

    WARN = "warn"  # record an `anomaly` event and go on
    STOP = "stop"  # also stop the job with a checkpoint: it ends `succeeded` (early stopping)


class PlateauSpec(Strict):
    """When a job's loss has stopped improving: `window_steps` steps in which its smoothed value did not
    go `min_rel_improvement` below its best so far (the rule is `service.plateau`'s)."""

    metric: str = Field(
        default="loss",
        pattern=_METRIC_NAME,
        description="The step metric judged, rank 0's, lower is better: 'loss' (training), 'eval_loss' "
        "(needs eval), or any metric the trainer reports.",
    )
    window_steps: Int = Field(
        ge=1, le=MAX_INT, description="Steps without an improvement that make a plateau (the patience)."
    )
    min_rel_improvement: Float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description="An improvement: the smoothed value at least this fraction (of the best's magnitude) "
        "below the best so far; 0.01 = 1%.",
    )
    smoothing_steps: Int | None = Field(
        default=None,
        ge=0,
        le=MAX_INT,
        description="Half-life in steps of the exponential moving average that smooths the metric "
        "(the same whether it comes every step or every eval); 0: the raw values; None: window_steps / 10.",
    )

    @property
    def half_life_steps(self) -> int:
        return self.window_steps // 10 if self.smoothing_steps is None else self.smoothing_steps


MAX_PROFILE_STEPS = 50


class ProfileSpec(Strict):
    """Steps to run under `torch.profiler` on every rank: `start_step` .. `start_step + steps - 1`.

    The traces go beside the checkpoints (`{storage}/job-N/profile/`), and their compute/communication
    split is a `profile` event (`trainers.profiling`)."""

    start_step: Int = Field(ge=1, le=MAX_INT, description="The first step profiled (steps count from 1).")
    steps: Int = Field(
        default=5,
        ge=1,
        le=MAX_PROFILE_STEPS,
        description=f"How many steps are profiled (1..{MAX_PROFILE_STEPS}): a trace grows with every step.",
    )

    @property
    def end_step(self) -> int:
        """The last step profiled."""
        return self.start_step + self.steps - 1


class MLPConfig(Strict):
    """Hyperparameters of the built-in `mlp` trainer (rows: `features`, `label`)."""

    task: Literal["classification", "regression"] = "classification"
    num_classes: int | None = Field(default=None, ge=2)
    hidden_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [64, 64])
    lr: float = Field(default=1e-3, gt=0)

    def model_post_init(self, __context: Any) -> None:
        if self.task == "classification" and self.num_classes is None:
            raise ValueError("num_classes is required when task is 'classification'")


class GPTConfig(Strict):
    """Hyperparameters of the built-in `gpt` trainer (rows: `tokens`, a fixed-length int sequence)."""

    vocab_size: int = Field(ge=2)
    d_model: int = Field(default=64, ge=8)
    n_layers: int = Field(default=2, ge=1)
    n_heads: int = Field(default=4, ge=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    lr: float = Field(default=3e-4, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    warmup_steps: int = Field(default=10, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)

    def model_post_init(self, __context: Any) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")


BUILTIN_CONFIGS: dict[str, type[BaseModel]] = {"mlp": MLPConfig, "gpt": GPTConfig}
BUILTIN_TRAINERS = tuple(BUILTIN_CONFIGS)

_WORKER_COUNT: TypeAdapter[int] = TypeAdapter(Annotated[Int, Field(ge=1, le=MAX_WORKERS)])


class ElasticWorkers(Strict):
    """`num_workers: {min, max}`: Ray Train's elastic training runs the job on min to max workers.

    Admission needs the min gang to fit; Ray Train then grows the group towards max whenever the
    cluster has room, and shrinks it (down to min) when a worker's node is lost, restarting the
    group from the latest checkpoint each time. `batch_size` stays per worker, so the global batch
    follows the group's size.
    """

    min: Int = Field(ge=1, le=MAX_WORKERS)
    max: Int = Field(ge=1, le=MAX_WORKERS)

    @model_validator(mode="after")
    def _ordered(self) -> ElasticWorkers:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class FsdpUnits(StrEnum):
    """How `strategy: fsdp` groups the parameters into units (one all-gather and one reduce-scatter each)."""

    # MODEL on CPU for a small model (gloo: no overlap, so every extra unit only adds latency), else BLOCKS
    AUTO = "auto"
    BLOCKS = "blocks"  # each transformer block its own unit, then the root: the lowest peak memory
    MODEL = "model"  # the whole model one unit: the fewest collectives, full parameters during a pass


class FsdpSpec(Strict):
    """FSDP2 choices (`strategy: fsdp` with more than one worker; one worker has nothing to shard).

    The defaults are measured (benchmarks/fsdp_speed.py, benchmarks/RESULTS.md): on CPU one unit for
    a small model (up to 64 MiB of parameters), since gloo runs collectives on the compute's own cores
    and so cannot hide them behind compute, and one per block for a larger one (faster there, and the
    whole model is never gathered at once); on GPU one unit per block, so that NCCL gathers the next
    block while this one runs (what FSDP2's authors recommend).
    """

    units: FsdpUnits = Field(
        default=FsdpUnits.AUTO,
        description="'auto': 'model' on CPU up to 64 MiB of parameters, 'blocks' above and on GPU; "
        "'blocks': every transformer block is its own "
        "unit (only one block's full parameters exist at a time; with NCCL the next block's all-gather "
        "overlaps this one's compute); 'model': one unit (the fewest collectives; full parameters during "
        "a pass).",
    )
    reshard_after_forward: bool = Field(
        default=True,
        description="Free each block unit's gathered parameters after forward and gather them again in "
        "backward (less memory); false keeps them until backward (one all-gather per unit and step fewer). "
        "The root unit (the whole model with units 'model') always keeps them, as FSDP2 does by default: "
        "backward needs them first, so resharding would cost an all-gather and save no peak memory.",
    )


def _finish_by(value: Any) -> str:
    """A time as Unix seconds or ISO 8601, kept as ISO 8601 in UTC (so a stored spec reads back alike)."""
    at = parse_time(value)
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


class DeferrableSpec(Strict):
    """`deferrable: {finish_by: <time>}` or `{within_h: N}`: the job is not urgent. It waits in its queue
    for the cheapest window of the price signal that still lets it finish by then
    (service.scheduling.deferral); at its last start time it is admitted like any other job."""

    finish_by: Annotated[str, BeforeValidator(_finish_by)] | None = Field(
        default=None,
        description="When the job must be done: ISO 8601 (UTC when no zone is named) or Unix seconds; "
        "in the future at submission.",
    )
    within_h: Float | None = Field(
        default=None, gt=0, le=366 * 24, description="Done within this many hours of its submission."
    )

    @model_validator(mode="after")
    def _one(self) -> DeferrableSpec:
        if (self.finish_by is None) == (self.within_h is None):
            raise ValueError("give exactly one of finish_by and within_h")
        return self

    def deadline(self, submitted_at: float) -> float:
        """When the job must be done, in Unix seconds."""
        if self.finish_by is not None:
            return parse_time(self.finish_by)
        assert self.within_h is not None
        return submitted_at + self.within_h * 3600


class JobSpec(Strict):
    """A distributed training job, as a user submits it (JSON or YAML)."""

    name: str = Field(
        description="Human name; letters, digits, '.', '_', '-'.",
        json_schema_extra={"pattern": f"^{_NAME.pattern}$"},
    )
    queue: Queue = Queue.RESEARCH
    priority: Int = Field(
        default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="Higher wins within a queue (-100..100)."
    )
    trainer: str = Field(
        max_length=MAX_TRAINER_CHARS,
        description="'mlp', 'gpt', or an importable 'package.module:function'.",
        json_schema_extra={"pattern": f"^({'|'.join(BUILTIN_TRAINERS)}|{_IMPORT_PATH.pattern})$"},
    )
    code: str | None = Field(
        default=None,
        description="The job's own code: the sha256 of a package its owner uploaded (`apiary submit --code "
        "DIR` packs and uploads DIR and sets this). It is every worker's Ray working_dir, first on the "
        "path: `trainer` may name a module in it.",
        json_schema_extra={"pattern": f"^{_CODE_DIGEST.pattern}$"},
    )
    num_workers: Int | ElasticWorkers = Field(
        description="Workers of the group: a number, or {min, max} for elastic training (see ElasticWorkers)."
    )
    resources_per_worker: dict[str, Float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources of each worker (e.g. CPU, GPU, memory); at least one > 0.",
        json_schema_extra={
            "propertyNames": {"pattern": f"^{_RESOURCE.pattern}$"},
            "additionalProperties": {"type": "number", "minimum": 0},
            "minProperties": 1,
            "maxProperties": MAX_RESOURCES,
        },
    )
    placement: Placement = Field(
        default=Placement.PACK,
        description="pack | spread | strict_spread (each worker on its own node): Ray Train's "
        "placement strategy for the worker group, which the scheduler's admission follows.",
    )
    spot: SpotUse | None = Field(
        default=None,
        description="allowed | never | preferred: whether the workers may run on spot nodes (never: "
        "on-demand nodes only; preferred: spot nodes first). None: the queue's default (research "
        "allowed, full-scale never), which the service writes into the stored spec.",
    )
    strategy: Strategy = Strategy.DDP
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec, description="FSDP2 choices, for strategy fsdp.")
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="bf16: with ddp, autocast (CPU too); with fsdp, FSDP2's mixed precision (bf16 "
        "parameters for compute, fp32 gradient reduction and fp32 sharded parameters and optimizer state).",
    )
    # Required for a recipe (the built-ins too: checked here; a recipe of a module at submission and on
    # the job's driver, where its kind is known); a function trainer may read its own data and choose
    # its own end (`service.contract.trainer_kind.kind_refusal`).
    dataset: DatasetSpec | None = Field(
        default=None,
        validate_default=True,
        description="The training data (required for recipes and the built-ins; a function trainer reads "
        "it with ray.train.get_dataset_shard('train')).",
    )
    max_steps: Int | None = Field(
        default=None,
        validate_default=True,
        le=MAX_INT,
        ge=1,
        description="Optimizer steps to train (required for recipes and the built-ins; a function "
        "trainer ends when it returns, and its progress is counted in reports).",
    )
    batch_size: Int | None = Field(
        default=None,
        validate_default=True,
        le=MAX_INT,
        ge=1,
        description="Samples per worker per step (required for recipes and the built-ins).",
    )
    seed: Int = Field(default=0, le=MAX_INT, ge=0)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_failures: Int = Field(default=0, ge=0, le=100)
    on_anomaly: AnomalyAction = Field(
        default=AnomalyAction.ROLLBACK,
        description="Built-in trainers, on a NaN/inf loss or gradient norm or a gradient-norm spike: "
        "'stop' fails the job; 'rollback' restores the last checkpoint (or the initial weights) and skips "
        "the offending batch, at most anomaly.max_rollbacks times, then stops; 'warn' records it.",
    )
    anomaly: AnomalySpec = Field(default_factory=AnomalySpec)
    plateau: PlateauSpec | None = Field(
        default=None,
        description="Loss plateau detection, by the service on the reported metrics: "
        "{metric: loss, window_steps: N, min_rel_improvement: 0.01}; None: off.",
    )
    on_plateau: PlateauAction = Field(
        default=PlateauAction.WARN,
        description="On a plateau: 'warn' records an anomaly event; 'stop' also stops the job with a "
        "checkpoint, and it ends succeeded with the reason (early stopping). Needs plateau.",
    )
    profile: ProfileSpec | None = Field(
        default=None,
        description="Run torch.profiler on every rank for some steps: {start_step: N, steps: K} (recipes "
        "and own loops); the traces are saved beside the checkpoints. None: off.",
    )
    max_runtime_s: Float | None = Field(
        default=None,
        gt=0,
        le=366 * 86_400,
        description="Stopped with a checkpoint after running this long; a research job without one gets "
        "its queue's default. The scheduler lets a job with one start in gaps that end before a reservation.",
    )
    deferrable: DeferrableSpec | None = Field(
        default=None,
        description="Not urgent: {finish_by: <time>} or {within_h: N}; the job waits for the cheapest "
        "window of the service's price signal that still lets it finish in time (its duration: "
        "max_runtime_s, else history's estimate). None: it starts as soon as it can.",
    )
    eval: EvalSpec | None = Field(
        default=None,
        validate_default=True,
        description="Held-out evaluation (recipes): {dataset: {uri: ...}, every_steps: N, max_batches: K}.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description=f"The trainer's hyperparameters (built-ins: MLPConfig, GPTConfig); at most "
        f"{MAX_CONFIG_BYTES // 1024} KiB as JSON, finite numbers only.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(
                "1-128 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return name

    @field_validator("trainer")
    @classmethod
    def _trainer(cls, trainer: str) -> str:
        if trainer not in BUILTIN_TRAINERS and not _IMPORT_PATH.fullmatch(trainer):
            raise ValueError(f"must be one of {', '.join(BUILTIN_TRAINERS)} or 'package.module:function'")
        return trainer

    @field_validator("dataset", "max_steps", "batch_size")
    @classmethod
    def _required_by_builtins(cls, value: Any, info: ValidationInfo) -> Any:
        trainer = info.data.get("trainer")
        if value is None and trainer in BUILTIN_TRAINERS:
            raise ValueError(f"required for trainer {trainer} (a recipe)")
        return value

    @field_validator("eval")
    @classmethod
    def _eval_for_eval_metrics(cls, eval_spec: EvalSpec | None, info: ValidationInfo) -> EvalSpec | None:
        if eval_spec is not None:
            return eval_spec
        checkpoint, plateau = info.data.get("checkpoint"), info.data.get("plateau")
        keep_best = checkpoint.keep_best if isinstance(checkpoint, CheckpointSpec) else None
        metrics = {
            "checkpoint.keep_best.metric": keep_best.metric if keep_best is not None else "",
            "plateau.metric": plateau.metric if isinstance(plateau, PlateauSpec) else "",
        }
        for where, metric in metrics.items():
            if metric.startswith(EVAL_PREFIX):
                raise ValueError(
                    f"{where} {metric!r} is an eval metric: set eval "
                    "({dataset: {uri: ...}, every_steps: N})"
                )
        return eval_spec

    @field_validator("plateau")
    @classmethod
    def _plateau_within_the_run(cls, plateau: PlateauSpec | None, info: ValidationInfo) -> PlateauSpec | None:
        max_steps = info.data.get("max_steps")
        if plateau is not None and max_steps is not None and plateau.window_steps >= max_steps:
            raise ValueError(
                f"window_steps ({plateau.window_steps}) must be < max_steps ({max_steps}): "
                "no plateau could be found"
            )
        return plateau

    @field_validator("profile")
    @classmethod
    def _profile_within_the_run(cls, profile: ProfileSpec | None, info: ValidationInfo) -> ProfileSpec | None:
        max_steps = info.data.get("max_steps")
        if profile is not None and max_steps is not None and profile.end_step > max_steps:
            raise ValueError(
                f"steps {profile.start_step}-{profile.end_step} end past max_steps ({max_steps}): "
                f"start_step must be <= {max(max_steps - profile.steps + 1, 1)} for {profile.steps} steps"
            )
        return profile

    @field_validator("on_plateau")
    @classmethod
    def _on_plateau_needs_a_rule(cls, action: PlateauAction, info: ValidationInfo) -> PlateauAction:
        # "plateau" is missing from info.data when it failed validation itself: that error is enough.
        if action is PlateauAction.STOP and "plateau" in info.data and info.data["plateau"] is None:
            raise ValueError("'stop' needs plateau: {metric: loss, window_steps: N} (when to stop)")
        return action

    @field_validator("code")
    @classmethod
    def _code(cls, code: str | None) -> str | None:
        if code is not None and not _CODE_DIGEST.fullmatch(code):
            raise ValueError(
                "must be 'sha256:' and 64 lowercase hex digits (apiary submit --code DIR sets it)"
            )
        return code

    @field_validator("num_workers", mode="before")
    @classmethod
    def _num_workers(cls, value: Any) -> int | ElasticWorkers:
        # Validated here rather than by the union, whose errors would name each member of it.
        try:
            if isinstance(value, dict | ElasticWorkers):
                return ElasticWorkers.model_validate(value)
            return _WORKER_COUNT.validate_python(value)
        except ValueError as err:
            raise ValueError(_first_error(err)) from None

    @field_validator("resources_per_worker")
    @classmethod
    def _resources(cls, resources: dict[str, float]) -> dict[str, float]:
        if len(resources) > MAX_RESOURCES:
            raise ValueError(f"at most {MAX_RESOURCES} resources, got {len(resources)}")
        for key, amount in resources.items():
            if not _RESOURCE.fullmatch(key):
                raise ValueError(f"{key!r} is not a resource name")
            if amount < 0:
                raise ValueError(f"{key} must be >= 0, got {amount}")
        if not any(amount > 0 for amount in resources.values()):
            raise ValueError("at least one resource must be > 0 (e.g. {'CPU': 1})")
        return resources

    @field_validator("config")
    @classmethod
    def _config(cls, config: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        try:
            size = len(json.dumps(config, allow_nan=False))
        except (TypeError, ValueError):
            raise ValueError("must be JSON with finite numbers (no NaN or Infinity)") from None
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"must be at most {MAX_CONFIG_BYTES} bytes as JSON, got {size}")
        schema = BUILTIN_CONFIGS.get(info.data.get("trainer", ""))
        if schema is None:
            return config
        try:
            return schema.model_validate(config).model_dump()
        except ValueError as err:
            raise ValueError(_first_error(err)) from None

    # A recipe's run needs these three; the spec (built-ins), the API and the job's driver (a recipe of
    # a module) refuse a recipe's spec without them, so a recipe's code reads them through these.
    @property
    def required_dataset(self) -> DatasetSpec:
        if self.dataset is None:
            raise ValueError(f"dataset: required for trainer {self.trainer} (a recipe)")
        return self.dataset

    @property
    def required_max_steps(self) -> int:
        if self.max_steps is None:
            raise ValueError(f"max_steps: required for trainer {self.trainer} (a recipe)")
        return self.max_steps

    @property
    def required_batch_size(self) -> int:
        if self.batch_size is None:
            raise ValueError(f"batch_size: required for trainer {self.trainer} (a recipe)")
        return self.batch_size

    @property
    def spot_use(self) -> SpotUse:
        """`spot`, or its queue's default where a spec says nothing (one stored before the field)."""
        return self.spot if self.spot is not None else SpotUse.default_for(self.queue)

    @property
    def uses_gpu(self) -> bool:
        return self.resources_per_worker.get("GPU", 0) > 0

    @property
    def min_workers(self) -> int:
        """The workers the job cannot start without (a fixed group's size, an elastic group's min)."""
        return self.num_workers.min if isinstance(self.num_workers, ElasticWorkers) else self.num_workers

    @property
    def max_workers(self) -> int:
        """The most workers the job runs on (a fixed group's size, an elastic group's max)."""
        return self.num_workers.max if isinstance(self.num_workers, ElasticWorkers) else self.num_workers

    @property
    def is_elastic(self) -> bool:
        return self.min_workers < self.max_workers


def _first_error(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return str(err)


def parse_spec_text(text: str) -> dict[str, Any]:
    """Parse a JSON or YAML document into a plain dict (validation is JobSpec's job)."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("a job spec must be a mapping of fields")
    return data


def field_line(text: str, loc: Sequence[str | int]) -> int | None:
    """The line (1-based) of the field at `loc` (a pydantic error location, e.g. ("dataset", "uri"))
    in a YAML or JSON document: the deepest part of the path the document has (for a missing field,
    its parent's line); None if the text is not YAML."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = next((pair for pair in node.value if pair[0].value == str(part)), None)
            if found is None:
                break
            line, node = found[0].start_mark.line + 1, found[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
