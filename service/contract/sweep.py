"""A sweep: one base job spec, a search space over its `config.*` (and `batch_size`, `max_steps`), and
how to search it. Pure: the API validates a sweep file with it, the service runs it
(`service.sweeps`), and the trials are ordinary jobs (`trial_spec`).

    name: lr-search
    base: {...a job spec, with eval: {dataset: ..., every_steps: 20}...}
    space:
      config.lr: {loguniform: [1.0e-4, 1.0]}
      config.hidden: {choice: [64, 128, 256]}
    method: random            # grid | random | tpe
    seed: 5
    max_trials: 24
    parallel: 4
    objective: {metric: eval_loss, mode: min}
    early_stopping: {method: asha, min_steps: 20, reduction_factor: 3}

A parameter is one of `{choice: [v, ...]}`, `{uniform: [low, high]}`, `{loguniform: [low, high]}`
(low > 0) and `{int: [low, high]}` (both included). `grid` takes choices and ints only and runs every
point of their product once (at most `max_trials` of them); `random` draws each trial's point from
(seed, trial number), so a restarted service draws the same ones; `tpe` asks Optuna's TPE sampler,
told every finished trial's objective.

Early stopping (ASHA, Li et al. 2020): rungs at `min_steps * reduction_factor**k` steps (below the
trials' `max_steps`). A trial's value at a rung is the objective's last value at or before that step.
Once at least `reduction_factor` trials have a value at a rung, a trial outside the best
1/`reduction_factor` of them (`asha_keeps`) stops at its next step boundary, with a checkpoint, and
ends `pruned`.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from service.contract.spec import MAX_INT, Float, Int, JobSpec, Queue, Strict

MAX_TRIALS = 1000
MAX_PARALLEL = 100
MAX_CHOICES = 1000
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# What a sweep may vary: a key under `config` (dotted for nested keys), or these spec fields.
_PARAM = re.compile(r"config(\.[A-Za-z_][A-Za-z0-9_-]{0,63}){1,8}|batch_size|max_steps")
_TOP_LEVEL_PARAMS = ("batch_size", "max_steps")

# A parameter's value: a number, text, a flag, or any JSON value a choice lists (e.g. [64, 64]).
Value = Any


class Choice(Strict):
    choice: list[Value] = Field(min_length=1, max_length=MAX_CHOICES)


class Uniform(Strict):
    uniform: tuple[Float, Float]

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        low, high = self.uniform
        if not low < high:
            raise ValueError(f"uniform needs low < high, got [{low}, {high}]")
        return self


class LogUniform(Strict):
    loguniform: tuple[Float, Float]

    @model_validator(mode="after")
    def _ordered(self) -> LogUniform:
        low, high = self.loguniform
        if not 0 < low < high:
            raise ValueError(f"loguniform needs 0 < low < high, got [{low}, {high}]")
        return self


class IntRange(Strict):
    int_: tuple[Int, Int] = Field(alias="int")

    model_config = Strict.model_config | {"populate_by_name": True}

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        low, high = self.int_
        if not low <= high:
            raise ValueError(f"int needs low <= high, got [{low}, {high}]")
        if high - low >= MAX_TRIALS * MAX_CHOICES:
            raise ValueError(f"int range [{low}, {high}] is too wide to search")
        return self


Param = Choice | Uniform | LogUniform | IntRange


def _param(value: Any) -> Param:
    """A parameter by its one key (the union's own errors would name every member)."""
    kinds: dict[str, type[Param]] = {
        "choice": Choice,
        "uniform": Uniform,
        "loguniform": LogUniform,
        "int": IntRange,
    }
    if isinstance(value, Choice | Uniform | LogUniform | IntRange):
        return value
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in kinds:
        raise ValueError(
            "must be one of {choice: [...]}, {uniform: [low, high]}, {loguniform: [low, high]}, "
            "{int: [low, high]}"
        )
    return kinds[next(iter(value))].model_validate(value)


class Objective(Strict):
    metric: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$", description="e.g. eval_loss")
    mode: Literal["min", "max"]


class EarlyStopping(Strict):
    method: Literal["asha"] = "asha"
    min_steps: Int = Field(ge=1, le=MAX_INT, description="The first rung: compared after this many steps.")
    reduction_factor: Int = Field(default=3, ge=2, le=100, description="Keep the best 1/N at each rung.")


class SweepSpec(Strict):
    name: str = Field(description="Letters, digits, '.', '_', '-'; the trials are NAME-t0, NAME-t1, ...")
    base: JobSpec
    space: dict[str, Annotated[Param, Field()]] = Field(min_length=1, max_length=64)
    method: Literal["grid", "random", "tpe"] = "random"
    seed: Int = Field(default=0, ge=0, le=MAX_INT)
    max_trials: Int = Field(default=16, ge=1, le=MAX_TRIALS)
    parallel: Int = Field(default=4, ge=1, le=MAX_PARALLEL, description="Trials queued or running at once.")
    objective: Objective
    early_stopping: EarlyStopping | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(
                "1-100 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return name

    @field_validator("space", mode="before")
    @classmethod
    def _space(cls, space: Any) -> Any:
        if not isinstance(space, dict):
            return space
        parsed: dict[str, Param] = {}
        for key, value in space.items():
            if not isinstance(key, str) or not _PARAM.fullmatch(key):
                raise ValueError(f"{key!r}: a sweep varies config.<key>, batch_size or max_steps")
            try:
                parsed[key] = _param(value)
            except ValueError as err:
                raise ValueError(f"{key}: {_first(err)}") from None
        return parsed

    @model_validator(mode="after")
    def _consistent(self) -> SweepSpec:
        if self.method == "grid":
            for key, param in self.space.items():
                if not isinstance(param, Choice | IntRange):
                    raise ValueError(f"space.{key}: grid takes choice and int parameters only")
        if self.early_stopping is not None:
            top = max_steps_of(self)
            if self.early_stopping.min_steps >= top:
                raise ValueError(
                    f"early_stopping.min_steps ({self.early_stopping.min_steps}) must be below the "
                    f"trials' max_steps ({top})"
                )
        if self.objective.metric.startswith("eval_") and self.base.eval is None:
            raise ValueError(
                f"objective.metric {self.objective.metric} is an eval metric: the base spec needs eval"
            )
        for key, param in self.space.items():  # every point is a valid job
            for value in _extremes(param):
                trial_spec(self, {key: value}, index=0)
        return self

    @property
    def queue(self) -> Queue:
        return self.base.queue

    def total_trials(self) -> int:
        """How many trials the sweep runs: max_trials, or the grid's size when that is smaller."""
        if self.method != "grid":
            return self.max_trials
        return min(self.max_trials, math.prod(len(_grid_values(param)) for param in self.space.values()))


def _first(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return str(err)


def _grid_values(param: Param) -> list[Value]:
    if isinstance(param, Choice):
        return list(param.choice)
    assert isinstance(param, IntRange)
    low, high = param.int_
    return list(range(low, high + 1))


def _extremes(param: Param) -> list[Value]:
    if isinstance(param, Choice):
        return list(param.choice)
    if isinstance(param, Uniform):
        return list(param.uniform)
    if isinstance(param, LogUniform):
        return list(param.loguniform)
    return list(param.int_)


def max_steps_of(sweep: SweepSpec) -> int:
    """The most steps a trial may run."""
    param = sweep.space.get("max_steps")
    if param is not None:
        return max(int(v) for v in _extremes(param))
    return sweep.base.max_steps if sweep.base.max_steps is not None else MAX_INT


# -- trials --------------------------------------------------------------------------------------


def grid_point(sweep: SweepSpec, index: int) -> dict[str, Value]:
    """The grid's `index`-th point, in a fixed order (the space's keys sorted, the last fastest)."""
    keys = sorted(sweep.space)
    values = [_grid_values(sweep.space[key]) for key in keys]
    point = next(itertools.islice(itertools.product(*values), index, None))
    return dict(zip(keys, point, strict=True))


def random_point(sweep: SweepSpec, index: int) -> dict[str, Value]:
    """Trial `index`'s point, drawn from (seed, index) alone: the same after any restart."""
    rng = random.Random(f"{sweep.seed}:{index}")
    point: dict[str, Value] = {}
    for key in sorted(sweep.space):
        param = sweep.space[key]
        if isinstance(param, Choice):
            point[key] = rng.choice(param.choice)
        elif isinstance(param, Uniform):
            point[key] = rng.uniform(*param.uniform)
        elif isinstance(param, LogUniform):
            low, high = param.loguniform
            point[key] = math.exp(rng.uniform(math.log(low), math.log(high)))
        else:
            point[key] = rng.randint(*param.int_)
    return point


def trial_spec(sweep: SweepSpec, point: Mapping[str, Value], *, index: int) -> JobSpec:
    """The base spec with `point` applied: a trial, named NAME-t<index>. ValueError if the point does
    not make a valid job (a config value the trainer refuses is found on the job's driver)."""
    spec = sweep.base.model_dump(mode="json", by_alias=True)
    spec["name"] = f"{sweep.name}-t{index}"[:128]
    for key, value in point.items():
        if key in _TOP_LEVEL_PARAMS:
            spec[key] = value
            continue
        node = spec.setdefault("config", {})
        *parents, leaf = key.split(".")[1:]
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"space.{key}: config.{part} is not a mapping in the base spec")
        node[leaf] = value
    return JobSpec.model_validate(spec)


# -- early stopping ------------------------------------------------------------------------------


def rungs(early: EarlyStopping, *, max_steps: int) -> list[int]:
    """The steps at which trials are compared: min_steps * factor**k, below max_steps."""
    found: list[int] = []
    step = early.min_steps
    while step < max_steps:
        found.append(step)
        step *= early.reduction_factor
    return found


def value_at(points: Sequence[tuple[int, float]], step: int) -> float | None:
    """The objective's last value at or before `step` (points sorted by step); None before its first."""
    found = None
    for at, value in points:
        if at > step:
            break
        found = value
    return found


def asha_keeps(value: float, others: Sequence[float], *, factor: int, mode: str) -> bool:
    """Whether a trial whose value at a rung is `value` goes on, given every value recorded at that
    rung (`others`, its own included): yes while fewer than `factor` trials reached it, else only
    within the best ceil(n / factor)."""
    if len(others) < factor:
        return True
    ordered = sorted(others, reverse=mode == "max")
    kept = ordered[: math.ceil(len(ordered) / factor)]
    threshold = kept[-1]
    return value <= threshold if mode == "min" else value >= threshold
