"""What kind of trainer a spec's `trainer` names, told from its source without running it.

`trainer` is a built-in name (`mlp`, `gpt`) or `package.module:Name`. What `Name` is decides the kind:
- a class: a recipe (`trainers.recipe.Recipe`): Apiary runs the loop and gives it every guarantee.
  The built-ins are recipes;
- a function whose first parameter is annotated `TrainContext` (`def train(ctx: TrainContext)`): its
  own loop on Apiary's training context (`trainers.context`);
- any other function, of no argument or of `config`: a Ray Train function, run as Ray runs it.

The API must not import user code (its module-level statements would run in the API's process), so
the kind is read from the module's source with `ast`: only top-level `class` and `def` statements are
taken at their word. A name bound any other way (an assignment, an import, a definition inside `if` or
`try`, a decorated function, a module `__getattr__`) cannot be told from the source: `kind_of` answers
None and the job's driver decides. A name the source certainly does not define raises
`TrainerNotDefined`, so that a submission can be refused at once.

What each kind honors of the spec (`kind_refusal`; the API refuses the rest with a 422 naming the
field when it knows the kind at submission, else the job's driver fails the job with one line):
- a recipe: everything; it needs `dataset`, `max_steps` and `batch_size`;
- an own loop: `eval` is refused (it evaluates itself and reports the metrics with `ctx.report`),
  and so is an `on_anomaly` other than the default (it judges its own numerics);
- a Ray Train function prepares its own model and chooses when to checkpoint: `strategy: fsdp`,
  `precision: bf16`, an `on_anomaly` other than the default, `eval`, and the checkpoint cadence
  (`checkpoint.every_steps`, `every_s`, `auto`, `async`) are refused; `checkpoint.keep_last` and
  `keep_best` are honored (retention of the checkpoints it reports), and `dataset`, `max_steps`
  and `batch_size` are optional (`config` carries what the function needs).

Like the rest of `service.contract`, this module imports neither Ray nor torch nor any trainer.
"""

from __future__ import annotations

import ast
from collections.abc import Set
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from service.contract.protocol import find_module
from service.contract.spec import BUILTIN_TRAINERS, AnomalyAction, JobSpec, Strategy

# The annotation of a loop's first parameter, by its last dotted name (`TrainContext`,
# `apiary.TrainContext`, `"trainers.context.TrainContext"`).
CONTEXT_TYPE = "TrainContext"


class TrainerKind(StrEnum):
    RECIPE = "recipe"  # a class: Apiary's loop runs it
    LOOP = "loop"  # def train(ctx: TrainContext): its own loop on Apiary's training context
    RAY_FUNCTION = "ray_function"  # def train() or def train(config): a Ray Train function


class TrainerNotDefined(LookupError):
    """The module's source certainly does not define the trainer's name."""


def kind_of(source: str, name: str) -> TrainerKind | None:
    """The kind of top-level `name` in module `source`; None when the source cannot tell.

    Raises `TrainerNotDefined` when nothing in the module can bind `name`, and `SyntaxError` when
    `source` is not Python.
    """
    tree = ast.parse(source)
    binding: ast.stmt | None = None  # the last top-level statement that binds `name` (it wins)
    dynamic = False  # something at top level that may bind any name
    for statement in tree.body:
        bound = _binds(statement, name)
        if bound is None:
            dynamic = True
        elif bound:
            binding = statement
    if binding is None:
        if dynamic:
            return None
        raise TrainerNotDefined(name)
    if isinstance(binding, ast.ClassDef):
        return TrainerKind.RECIPE
    if isinstance(binding, ast.FunctionDef) and not binding.decorator_list:
        return TrainerKind.LOOP if _first_annotation(binding) == CONTEXT_TYPE else TrainerKind.RAY_FUNCTION
    return None


def kind_of_trainer(trainer: str) -> TrainerKind | None:
    """The kind of a spec's `trainer`, its module found (not imported) in this environment: built-ins
    are recipes; None when the module cannot be found or read, or its source cannot tell.

    Raises `TrainerNotDefined` when the module is found and does not define the name."""
    if trainer in BUILTIN_TRAINERS:
        return TrainerKind.RECIPE
    module, _, name = trainer.partition(":")
    found = find_module(module)
    if found is None or found.origin is None or not found.origin.endswith(".py"):
        return None
    try:
        source = Path(found.origin).read_text(encoding="utf-8")
        return kind_of(source, name)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None  # the driver's import reports it, with the module's own error


def _binds(statement: ast.stmt, name: str) -> bool | None:
    """Whether a top-level statement binds `name`: True, False, or None when it may bind any name (a
    star import, a module `__getattr__`, `globals()` written to)."""
    match statement:
        case ast.ClassDef() | ast.FunctionDef() | ast.AsyncFunctionDef():
            if statement.name == "__getattr__":
                return None
            return statement.name == name
        case ast.Import() | ast.ImportFrom():
            if any(alias.name == "*" for alias in statement.names):
                return None
            return any((alias.asname or alias.name.split(".", 1)[0]) == name for alias in statement.names)
    # Anything else: an assignment, or a compound statement (if, try, with, for) whose body may bind it.
    for node in ast.walk(statement):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store | ast.Del):
            return True
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any(
            alias.name == "*" or (alias.asname or alias.name.split(".", 1)[0]) == name for alias in node.names
        ):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("globals", "exec")
        ):
            return None
    return False


def _first_annotation(function: ast.FunctionDef) -> str | None:
    """The last dotted name of the first parameter's annotation (a string annotation is parsed)."""
    parameters = [*function.args.posonlyargs, *function.args.args]
    if not parameters or parameters[0].annotation is None:
        return None
    annotation: ast.expr = parameters[0].annotation
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    match annotation:
        case ast.Name(id=last) | ast.Attribute(attr=last):
            return last
    return None


@dataclass(frozen=True)
class Refusal:
    """A field of a spec that its trainer's kind cannot honor, and why."""

    field: str
    message: str


def kind_refusal(spec: JobSpec, kind: TrainerKind | None, *, given: Set[str] = frozenset()) -> Refusal | None:
    """The first field of `spec` that a trainer of `kind` cannot honor (None: it honors them all, or
    the kind is not known).

    `given`: the fields the submitter wrote (dotted, e.g. `checkpoint.async`), known at the API only;
    a field refused even at its default value (`checkpoint.async`) is refused only when given."""
    if kind is TrainerKind.RECIPE:
        for name in ("dataset", "max_steps", "batch_size"):
            if getattr(spec, name) is None:
                return Refusal(name, f"required for trainer {spec.trainer} (a recipe)")
        return None
    if kind is TrainerKind.LOOP:
        return _loop_refusal(spec)
    if kind is not TrainerKind.RAY_FUNCTION:
        return None
    own = "a Ray Train function prepares its own model"
    when = "a Ray Train function checkpoints when it calls ray.train.report(..., checkpoint=...)"
    checkpoint = spec.checkpoint
    refused = [
        ("strategy", spec.strategy is Strategy.FSDP, f"{own}: strategy fsdp cannot apply (wrap it yourself)"),
        (
            "precision",
            spec.precision != "fp32",
            f"{own}: precision {spec.precision} cannot apply (autocast it yourself)",
        ),
        (
            "on_anomaly",
            spec.on_anomaly is not AnomalyAction.ROLLBACK,
            "anomaly detection runs in Apiary's own loop (recipes), not in a Ray Train function",
        ),
        (
            "eval",
            getattr(spec, "eval", None) is not None,
            "eval runs in Apiary's own loop (recipes): report eval metrics yourself",
        ),
        (
            "profile",
            getattr(spec, "profile", None) is not None,
            "profile runs at Apiary's step boundary (recipes, own loops' ctx.report): in a Ray Train "
            "function, run torch.profiler yourself",
        ),
        ("checkpoint.every_steps", checkpoint.every_steps is not None, when),
        ("checkpoint.every_s", checkpoint.every_s is not None, when),
        ("checkpoint.auto", checkpoint.auto, when),
        (
            "checkpoint.async",
            not checkpoint.async_ or "checkpoint.async" in given,
            f"{when} (its upload mode is Ray's checkpoint_upload_mode)",
        ),
    ]
    return next((Refusal(name, message) for name, wrong, message in refused if wrong), None)


def _loop_refusal(spec: JobSpec) -> Refusal | None:
    """An own loop (`trainers.context`) honors strategy and precision (`ctx.parallelize`), the data
    and `checkpoint.*` (`ctx.report`); it runs its own numerics and evaluation."""
    if spec.on_anomaly is not AnomalyAction.ROLLBACK:
        return Refusal("on_anomaly", "an own loop judges its own numerics: on_anomaly applies to recipes")
    if spec.eval is not None:
        return Refusal("eval", "an own loop evaluates itself: report its eval metrics with ctx.report")
    return None
