"""Recipes: a model Apiary trains with its own loop, and so with every guarantee it gives.

A recipe is a class, named in a job's spec as `trainer: package.module:ClassName`. It says what the
model is and how it learns; Apiary's loop (`trainers.loop`) does the rest: the deterministic,
resumable data order, DDP or FSDP2 and bf16 (`strategy`, `precision`), exact resume from async
checkpoints, checkpoint-then-requeue preemption, per-step metrics, anomaly rollback, hang
detection, and evaluation (`eval`). The built-in trainers are recipes like any other (`mlp` and
`gpt` are aliases of `trainers.recipes:MLPRecipe` and `trainers.recipes:GPTRecipe`):

    class TinyLM(Recipe[TinyLMConfig]):
        config_type = TinyLMConfig            # the spec's `config`, validated against it
        read_columns = ("tokens",)            # columns read from the dataset (None: all)

        def check_columns(self, schema, first_row, *, uri):   # on the driver, before any worker starts
            require_list_column(schema, uri=uri, name="tokens", of="integer ids", ok=pa.types.is_integer)
            return {"seq_len": first_row_length(first_row, uri=uri, name="tokens")}

        def build_collate(self, row_shape, *, uri):           # Arrow rows -> tensors (on the workers)
            return TokensCollate(row_shape["seq_len"])

        def build_model(self, row_shape):                     # the same weights on every rank: seeded
            return TinyLMModel(self.config, seq_len=row_shape["seq_len"])

        def loss(self, model, batch):                         # a loss, or (loss, {name: metric})
            logits = model(batch["tokens"][:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten())
            return loss, {"perplexity": loss.exp()}

        def build_optimizer(self, model, *, max_steps):       # after the model is wrapped and placed
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.config.lr)
            return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

The members, in the order the job uses them:

- `config_type` (a pydantic model; default `NoConfig`, which takes `{}` only): the job's driver
  validates the spec's `config` against it before any worker starts; a bad config fails the job at
  once with one line naming the field (`config.lr: Input should be greater than 0`). The recipe gets
  the validated model as `self.config`. The API never imports a recipe (its module runs user code),
  so it validates only the built-ins' configs at submission.
- `check_columns(schema, first_row, *, uri)` (on the driver; default: any columns): raise
  `DatasetError` (from `service.contract.errors`) unless the dataset can feed the recipe; return its
  row shape, a dict of ints that sizes the model (e.g. `{"seq_len": 128}`), given to the members
  below and saved in every checkpoint. `require_column`, `require_list_column` and
  `first_row_length` below help. `read_columns` names the columns the workers read (None: all).
- `build_collate(row_shape, *, uri)`: a picklable callable from a `pyarrow.Table` of rows to a dict
  of tensors (on the CPU; the loop moves them to the rank's device).
- `build_model(row_shape)`: an `nn.Module`, built after `torch.manual_seed(spec.seed)` on every
  rank. It must not depend on the rank. `fsdp_blocks(model)` names its transformer blocks, FSDP2's
  units with `fsdp.units: blocks` (default: `model.blocks` when it is an `nn.ModuleList`).
- `loss(model, batch)`: a scalar loss tensor, or `(loss, metrics)` with `metrics` a dict of scalars
  (tensors or floats): each is recorded with the step's own metrics (`STEP_METRICS` of
  `trainers.loop`, whose names it must not take), reaches the metrics endpoint, the streams, the web
  charts and Prometheus, and may be `checkpoint.keep_best.metric`. It runs under the spec's precision.
- `build_optimizer(model, *, max_steps)`: the optimizer and its LR schedule, stepped once per
  optimizer step. `grad_clip` (default None: the norm is measured, not clipped).
- `state_dict()` / `load_state_dict(state)` (optional): the recipe's own state besides the model,
  optimizer and schedule (e.g. a curriculum's position), the same on every rank: rank 0's is saved
  in every checkpoint, and every rank gets it back on resume. Plain containers, numbers, strings and
  tensors only (a checkpoint loads with `weights_only=True`).
- `evaluate(model, batch)` (optional): one eval batch's metrics (default: `loss` and the metrics
  `loss` returns), run without gradients under the spec's precision; with the spec's `eval` they
  are averaged over the eval batches and ranks and recorded as `eval_<name>` (`eval_loss`).

A recipe object lives on one process (the driver, or one rank); its members are called by the loop
in that order, and never concurrently.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import pyarrow as pa
from pydantic import BaseModel, ValidationError

from service.contract.errors import DatasetError
from service.contract.spec import JobSpec, Strict
from service.contract.storage import is_list_type

if TYPE_CHECKING:
    import torch
    from torch import nn

# The recipes behind the built-in names: the same path as any `package.module:ClassName`.
BUILTIN_RECIPES = {"mlp": "trainers.recipes:MLPRecipe", "gpt": "trainers.recipes:GPTRecipe"}

ConfigT = TypeVar("ConfigT", bound=BaseModel)
# What the driver learns from the data that sizes the model (e.g. {"input_size": n}, {"seq_len": L}).
RowShape = dict[str, int]
# Arrow rows -> a batch of tensors (what `Recipe.loss` takes); it runs on the workers.
Collate = Callable[[pa.Table], dict[str, "torch.Tensor"]]


class NoConfig(Strict):
    """The config of a recipe that takes none: `config` must be `{}`."""


class Recipe(ABC, Generic[ConfigT]):
    """A model and how it learns; see the module's docstring for the protocol."""

    config_type: ClassVar[type[BaseModel]] = NoConfig
    read_columns: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, config: ConfigT) -> None:
        self.config = config

    def check_columns(self, schema: pa.Schema, first_row: pa.Table, *, uri: str) -> RowShape:
        """Raise `DatasetError` unless these columns can feed the recipe; return the row shape."""
        return {}

    @abstractmethod
    def build_collate(self, row_shape: RowShape, *, uri: str) -> Collate:
        """Arrow rows -> the batch of tensors that `loss` takes."""

    @abstractmethod
    def build_model(self, row_shape: RowShape) -> nn.Module: ...

    @abstractmethod
    def loss(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
        """The batch's scalar loss, or (loss, {name: scalar metric})."""

    @abstractmethod
    def build_optimizer(
        self, model: nn.Module, *, max_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer and its per-step LR schedule (called after the model is wrapped and placed)."""

    @property
    def grad_clip(self) -> float | None:
        """The gradient-norm clip; None measures the norm without clipping."""
        return None

    def fsdp_blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        """The model's repeated blocks: FSDP2's units with `fsdp.units: blocks`, before the root."""
        from torch import nn

        blocks = getattr(model, "blocks", None)
        return list(blocks) if isinstance(blocks, nn.ModuleList) else []

    def state_dict(self) -> dict[str, Any]:
        """The recipe's own state, saved in every checkpoint (rank 0's); {} by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on every rank, when a run resumes)."""

    def evaluate(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor | float]:
        """One eval batch's metrics, by name (recorded as `eval_<name>`): by default `loss` and the
        metrics `loss` returns."""
        loss, metrics = split_loss(self.loss(model, batch))
        return {"loss": loss, **metrics}


def split_loss(
    output: torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor | float]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """A recipe's `loss` output as (loss, metrics)."""
    if isinstance(output, tuple):
        if len(output) != 2 or not isinstance(output[1], Mapping):
            raise TypeError("a recipe's loss returns a loss tensor or (loss, dict of metrics)")
        return output[0], dict(output[1])
    return output, {}


def recipe_class(trainer: str) -> type[Recipe[Any]]:
    """Import the recipe class `trainer` names (a built-in name or `package.module:ClassName`), or
    raise ValueError saying why not."""
    found = import_trainer(BUILTIN_RECIPES.get(trainer, trainer))
    if not (isinstance(found, type) and issubclass(found, Recipe)):
        name = trainer.rpartition(":")[2] or trainer
        raise ValueError(
            f"trainer {trainer!r}: {name} is not a recipe (a subclass of trainers.recipe.Recipe)"
        )
    return found


def import_trainer(trainer: str) -> Any:
    """Import `package.module:Name` and return what the module calls `Name`, or raise ValueError
    saying why not."""
    module_name, _, name = trainer.partition(":")
    if not module_name or not name:
        raise ValueError(f"trainer {trainer!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"trainer {trainer!r}: cannot import module {module_name!r} ({err})") from err
    found = getattr(module, name, None)
    if found is None:
        raise ValueError(f"trainer {trainer!r}: module {module_name!r} has no {name!r}")
    return found


def recipe_for(spec: JobSpec) -> Recipe[Any]:
    """The recipe `spec.trainer` bound to `spec.config`, validated against its `config_type`: a
    ValueError whose message names the field (`config.lr: ...`) if it does not fit."""
    recipe = recipe_class(spec.trainer)
    try:
        config = recipe.config_type.model_validate(spec.config)
    except ValidationError as err:
        raise ValueError(config_error(err)) from None
    return recipe(config)


def config_error(err: ValidationError) -> str:
    """The first error of a config's validation, as one line that names the field."""
    first = err.errors()[0]
    where = ".".join(("config", *(str(part) for part in first["loc"])))
    return f"{where}: {first['msg']}"


# -- column checks (on the driver, before any worker starts) ------------------------------------------


def require_column(
    schema: pa.Schema, *, uri: str, name: str, want: str, ok: Callable[[pa.DataType], Any]
) -> None:
    """`name` must be a column whose type passes `ok` (described by `want`), else `DatasetError`."""
    if name not in schema.names:
        raise DatasetError(f"dataset {uri} has no column {name!r} (columns: {', '.join(schema.names)})")
    data_type = schema.field(name).type
    if not ok(data_type):
        raise DatasetError(f"dataset {uri}: column {name!r} must be {want}, got {data_type}")


def require_list_column(
    schema: pa.Schema, *, uri: str, name: str, of: str, ok: Callable[[pa.DataType], Any]
) -> None:
    """`name` must be a list column whose values pass `ok` (described by `of`)."""

    def list_ok(data_type: pa.DataType) -> bool:
        return is_list_type(data_type) and bool(ok(data_type.value_type))

    require_column(schema, uri=uri, name=name, want=f"a list of {of}", ok=list_ok)


def first_row_length(first_row: pa.Table, *, uri: str, name: str) -> int:
    """The length of the first row's list in column `name`."""
    first = first_row.column(name)[0]
    if not first.is_valid:
        raise DatasetError(f"dataset {uri}: the first row of {name!r} is null")
    return len(first)
