"""Cluster math before (and during) a run: throughput, the communication ceiling, checkpoint cost,
checkpoint cadence, failure waste and price. Pure functions: no database, no Ray, no HTTP.

`plan(PlanFacts(...))` computes every quantity it has the facts for and says, for each one it has
not, what it needs. `apiary plan`, `POST /plan`, the scheduler's ETA (`time_to_finish_s`) and
`checkpoint: {auto: true}` (`auto_checkpoint_interval_s`) all use this module.

The model behind the cadence quantities (Young 1974, Daly 2006), with
  tau = the compute time between checkpoints, delta = the time one synchronous save stalls,
  M = the mean time between failures, R = the time a restart takes:
- each period of tau + delta costs delta, so the stall is delta / tau of the useful time;
- a failure strikes on average half-way through a period and costs that half plus the restart,
  tau / 2 + R;
- the expected waste per unit of useful time is then delta / tau + (tau / 2 + R) / M (first order,
  failures rare against the period), whose minimum over tau is Young's sqrt(2 delta M). Daly's
  higher-order optimum corrects it for periods that are not small against M.

Glossary: a "fact" is an input (a flag, a spec field or a measurement); a "quantity" is derived.
Every quantity's key carries its unit (`_s`, `_bytes`, `_per_s`, `_usd`); plain fractions, counts
and flags have none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.contract.spec import MAX_INT, Float, GPTConfig, Int, JobSpec

HOUR_S = 3600.0
# A job's mean time between failures until one is observed (Settings.default_mtbf_s; the trainers'
# own default when the launch request carries none).
DEFAULT_MTBF_S = 24 * HOUR_S
# Bytes per parameter of the gradients that the all-reduce moves, by training precision. Mixed
# precision (bf16, fp16) reduces gradients in the half type.
GRAD_BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp16": 2}
# A checkpoint holds fp32 weights in every precision: mixed precision keeps fp32 master weights (the
# half-precision copy is derived from them and not saved).
CKPT_WEIGHT_BYTES_PER_PARAM = 4
# Optimizer state per parameter, fp32: Adam's two moments; SGD's momentum buffer.
OPTIMIZER_BYTES_PER_PARAM = {"adam": 8, "sgd": 4}

Precision = Literal["fp32", "bf16", "fp16"]
Optimizer = Literal["adam", "sgd"]
Value = float | int | bool


class PlanFacts(BaseModel):
    """What the plan is computed from. Every fact is optional: a quantity whose facts are missing is
    reported as absent, with what it needs. Units are SI except where the name says otherwise."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    params: Float | None = Field(default=None, gt=0, description="Model parameters, e.g. 70e9.")
    workers: Int | None = Field(default=None, le=MAX_INT, ge=1, description="Data-parallel workers (ranks).")
    batch_per_worker: Int | None = Field(
        default=None, le=MAX_INT, ge=1, description="Samples per worker per step."
    )
    step_time_s: Float | None = Field(
        default=None, gt=0, description="Time of one step's compute (a measured step: the whole step)."
    )
    steps: Int | None = Field(
        default=None, le=MAX_INT, ge=1, description="Steps of the run (the spec's max_steps)."
    )
    grad_bytes_per_worker: Float | None = Field(
        default=None,
        ge=0,
        description="Bytes each worker moves per step; default params x gradient bytes x 2(N-1)/N.",
    )
    link_bytes_per_s: Float | None = Field(
        default=None, gt=0, description="Bandwidth of the slowest link the all-reduce crosses."
    )
    precision: Precision = Field(default="fp32", description="Training precision: fp32, bf16 or fp16.")
    optimizer: Optimizer = Field(default="adam", description="adam (2 fp32 moments) or sgd (momentum).")
    ckpt_bytes: Float | None = Field(
        default=None, gt=0, description="Size of one checkpoint; default from params and optimizer."
    )
    storage_bytes_per_s: Float | None = Field(
        default=None, gt=0, description="Write bandwidth to checkpoint storage."
    )
    ckpt_write_s: Float | None = Field(
        default=None, gt=0, description="A measured save time, instead of size over bandwidth."
    )
    ckpt_every_steps: Int | None = Field(
        default=None, le=MAX_INT, ge=1, description="Checkpoint every K steps."
    )
    ckpt_every_s: Float | None = Field(default=None, gt=0, description="Checkpoint every S seconds.")
    mtbf_s: Float | None = Field(default=None, gt=0, description="Mean time between failures of the job.")
    restart_s: Float | None = Field(
        default=None, ge=0, description="Time from a failure to training again (before lost work)."
    )
    gpus_per_worker: Float = Field(default=1.0, gt=0, description="GPUs each worker holds.")
    price_per_gpu_h_usd: Float | None = Field(
        default=None, ge=0, description="On-demand price of a GPU-hour."
    )
    spot_discount: Float | None = Field(
        default=None, ge=0, lt=1, description="Fraction off the on-demand price for spot capacity."
    )
    spot_preemptions_per_h: Float | None = Field(
        default=None, ge=0, description="Spot preemptions per hour of the whole job."
    )
    hours: Float | None = Field(
        default=None, gt=0, description="Wall hours of work to price; default steps x step time."
    )
    nodes: Int | None = Field(
        default=None, le=MAX_INT, ge=1, description="Nodes of the cluster (shown, not used)."
    )


# ---------------------------------------------------------------------------------------------------
# The formulas, one function each
# ---------------------------------------------------------------------------------------------------


def ring_allreduce_bytes(*, params: float, bytes_per_param: float, workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce of `params` gradients:
    2(N-1)/N of the buffer (a reduce-scatter, then an all-gather, each moving (N-1)/N)."""
    return params * bytes_per_param * 2 * (workers - 1) / workers


def ckpt_bytes(*, params: float, optimizer: Optimizer) -> float:
    """Size of a checkpoint: fp32 weights (or master weights) plus the optimizer's fp32 state."""
    return params * (CKPT_WEIGHT_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM[optimizer])


def young_interval_s(*, save_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints: sqrt(2 x save time x MTBF)."""
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval_s(*, save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006): for save < 2 MTBF,
    sqrt(2 d M) x (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d; else M."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s


def expected_loss_per_failure_s(*, interval_s: float, restart_s: float) -> float:
    """Work lost to one failure on average: half an interval since the last checkpoint, plus the restart."""
    return interval_s / 2 + restart_s


def expected_waste_fraction(*, interval_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """Time wasted per unit of useful time: the save stall plus the failures' loss (module docstring)."""
    return (
        save_s / interval_s + expected_loss_per_failure_s(interval_s=interval_s, restart_s=restart_s) / mtbf_s
    )


def time_to_finish_s(*, steps_left: int, step_time_s: float) -> float:
    """How long the steps left take at the step time (the scheduler's ETA of a running job's end)."""
    return max(0, steps_left) * step_time_s


def auto_checkpoint_interval_s(*, save_s: float, mtbf_s: float, min_interval_s: float = 0.0) -> float:
    """The cadence of `checkpoint: {auto: true}`: Daly's optimum for a measured save time and MTBF,
    never shorter than `min_interval_s` (an async save cannot start before the last one is written)."""
    return max(daly_interval_s(save_s=save_s, mtbf_s=mtbf_s), min_interval_s)


def gpt_params(config: GPTConfig, *, context: int | None = None) -> int:
    """Parameters of the built-in `gpt` (trainers.models.GPT): tied token embedding V d, per block
    12 d^2 + 13 d (attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, two LayerNorms 4 d), the final LayerNorm
    2 d, and the position embedding context x d (left out when the context is unknown)."""
    d = config.d_model
    return config.vocab_size * d + (context or 0) * d + config.n_layers * (12 * d * d + 13 * d) + 2 * d


def facts_from_spec(spec: JobSpec) -> dict[str, Any]:
    """The facts a job spec gives: workers (an elastic group's max), batch, steps, precision, the
    checkpoint cadence, GPUs per worker and, for the built-in gpt, parameters (without position
    embeddings: the context comes from the data)."""
    facts: dict[str, Any] = {
        "workers": spec.max_workers,
        "batch_per_worker": spec.batch_size,
        "steps": spec.max_steps,
        "precision": spec.precision,
        "ckpt_every_steps": spec.checkpoint.every_steps,
        "ckpt_every_s": spec.checkpoint.every_s,
    }
    if spec.uses_gpu:
        facts["gpus_per_worker"] = spec.resources_per_worker["GPU"]
    if spec.trainer == "gpt":
        facts["params"] = gpt_params(GPTConfig.model_validate(spec.config))
        # The built-in trainers use AdamW.
        facts["optimizer"] = "adam"
    return {key: value for key, value in facts.items() if value is not None}


# ---------------------------------------------------------------------------------------------------
# The plan: every quantity, in order, each from the facts and the quantities before it
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Quantity:
    name: str
    unit: str  # for people: "s", "B", "samples/s", "USD", "GPU-h", "" (a count, fraction or flag)
    formula: str
    meaning: str
    needs: tuple[str, ...]  # facts or earlier quantities, all of which must be known
    compute: Callable[[Mapping[str, Any]], Value | None]
    given_by: str | None = None  # a fact that, when set, is the quantity itself
    # When `compute` returns None though every need is known: the condition it lacks.
    absent_when: str = ""


def _interval(v: Mapping[str, Any]) -> float | None:
    candidates = []
    if v.get("ckpt_every_s") is not None:
        candidates.append(float(v["ckpt_every_s"]))
    if v.get("ckpt_every_steps") is not None and v.get("step_time_s") is not None:
        candidates.append(v["ckpt_every_steps"] * v["step_time_s"])
    return min(candidates) if candidates else None  # both set: whichever comes first


def _spot_lost_fraction(v: Mapping[str, Any]) -> float:
    return float(v["spot_preemptions_per_h"] / HOUR_S * v["expected_loss_per_failure_s"])


def _spot_gpu_hours(v: Mapping[str, Any]) -> float | None:
    lost = v["spot_lost_fraction"]
    return v["gpu_hours"] / (1 - lost) if lost < 1 else None


QUANTITIES: tuple[Quantity, ...] = (
    # 1. Throughput
    Quantity(
        name="global_batch",
        unit="samples",
        formula="workers x batch_per_worker",
        meaning="samples in one optimizer step across all workers",
        needs=("workers", "batch_per_worker"),
        compute=lambda v: v["workers"] * v["batch_per_worker"],
    ),
    Quantity(
        name="samples_per_s",
        unit="samples/s",
        formula="global_batch / step_time_s",
        meaning="training throughput of the whole job",
        needs=("global_batch", "step_time_s"),
        compute=lambda v: v["global_batch"] / v["step_time_s"],
    ),
    # 2. Communication
    Quantity(
        name="grad_bytes_per_worker",
        unit="B",
        formula="params x grad bytes (fp32 4, bf16/fp16 2) x 2(workers-1)/workers",
        meaning="bytes each worker moves in one step's ring all-reduce of the gradients",
        needs=("params", "workers"),
        compute=lambda v: ring_allreduce_bytes(
            params=v["params"], bytes_per_param=GRAD_BYTES_PER_PARAM[v["precision"]], workers=v["workers"]
        ),
        given_by="grad_bytes_per_worker",
    ),
    Quantity(
        name="comm_time_s",
        unit="s",
        formula="grad_bytes_per_worker / link_bytes_per_s",
        meaning="time of one step's gradient all-reduce over the slowest link",
        needs=("grad_bytes_per_worker", "link_bytes_per_s"),
        compute=lambda v: v["grad_bytes_per_worker"] / v["link_bytes_per_s"],
    ),
    Quantity(
        name="comm_ratio",
        unit="",
        formula="comm_time_s / step_time_s",
        meaning="communication per unit of compute; above 1 it cannot be hidden behind the backward pass",
        needs=("comm_time_s", "step_time_s"),
        compute=lambda v: v["comm_time_s"] / v["step_time_s"],
    ),
    Quantity(
        name="comm_bound",
        unit="",
        formula="comm_time_s > step_time_s",
        meaning="true: data-parallel scaling has hit its ceiling (more workers will not go faster)",
        needs=("comm_time_s", "step_time_s"),
        compute=lambda v: v["comm_time_s"] > v["step_time_s"],
    ),
    Quantity(
        name="step_time_no_overlap_s",
        unit="s",
        formula="step_time_s + comm_time_s",
        meaning="step time if communication does not overlap compute at all (the worst case)",
        needs=("step_time_s", "comm_time_s"),
        compute=lambda v: v["step_time_s"] + v["comm_time_s"],
    ),
    # 3. Checkpoint
    Quantity(
        name="ckpt_bytes",
        unit="B",
        formula="params x (4 fp32 weights + optimizer: adam 8, sgd 4)",
        meaning="size of one checkpoint (weights and optimizer state)",
        needs=("params",),
        compute=lambda v: ckpt_bytes(params=v["params"], optimizer=v["optimizer"]),
        given_by="ckpt_bytes",
    ),
    Quantity(
        name="ckpt_write_s",
        unit="s",
        formula="ckpt_bytes / storage_bytes_per_s",
        meaning="time to write one checkpoint",
        needs=("ckpt_bytes", "storage_bytes_per_s"),
        compute=lambda v: v["ckpt_bytes"] / v["storage_bytes_per_s"],
        given_by="ckpt_write_s",
    ),
    Quantity(
        name="ckpt_interval_s",
        unit="s",
        formula="ckpt_every_s, or ckpt_every_steps x step_time_s (the shorter)",
        meaning="compute time between checkpoints at the chosen cadence",
        needs=("ckpt_every_s | ckpt_every_steps and step_time_s",),
        compute=_interval,
    ),
    Quantity(
        name="ckpt_stall_fraction",
        unit="",
        formula="ckpt_write_s / ckpt_interval_s",
        meaning="share of training time a synchronous save stalls at this cadence",
        needs=("ckpt_write_s", "ckpt_interval_s"),
        compute=lambda v: v["ckpt_write_s"] / v["ckpt_interval_s"],
    ),
    # 4. Cadence
    Quantity(
        name="expected_loss_per_failure_s",
        unit="s",
        formula="ckpt_interval_s / 2 + restart_s",
        meaning="work lost to one failure on average: half an interval redone, plus the restart",
        needs=("ckpt_interval_s", "restart_s"),
        compute=lambda v: expected_loss_per_failure_s(
            interval_s=v["ckpt_interval_s"], restart_s=v["restart_s"]
        ),
    ),
    Quantity(
        name="young_interval_s",
        unit="s",
        formula="sqrt(2 x ckpt_write_s x mtbf_s)",
        meaning="Young's optimal time between checkpoints",
        needs=("ckpt_write_s", "mtbf_s"),
        compute=lambda v: young_interval_s(save_s=v["ckpt_write_s"], mtbf_s=v["mtbf_s"]),
    ),
    Quantity(
        name="daly_interval_s",
        unit="s",
        formula="sqrt(2dM) x (1 + sqrt(d/2M)/3 + (d/2M)/9) - d, d = ckpt_write_s, M = mtbf_s",
        meaning="Daly's higher-order optimum; what checkpoint: {auto: true} uses",
        needs=("ckpt_write_s", "mtbf_s"),
        compute=lambda v: daly_interval_s(save_s=v["ckpt_write_s"], mtbf_s=v["mtbf_s"]),
    ),
    Quantity(
        name="expected_waste_fraction",
        unit="",
        formula="ckpt_write_s / ckpt_interval_s + expected_loss_per_failure_s / mtbf_s",
        meaning="time lost to saves and failures per unit of useful time, at the chosen cadence",
        needs=("ckpt_write_s", "ckpt_interval_s", "restart_s", "mtbf_s"),
        compute=lambda v: expected_waste_fraction(
            interval_s=v["ckpt_interval_s"],
            save_s=v["ckpt_write_s"],
            mtbf_s=v["mtbf_s"],
            restart_s=v["restart_s"],
        ),
    ),
    Quantity(
        name="expected_waste_fraction_at_optimum",
        unit="",
        formula="the same at ckpt_interval_s = daly_interval_s",
        meaning="the least waste any cadence achieves",
        needs=("ckpt_write_s", "daly_interval_s", "restart_s", "mtbf_s"),
        compute=lambda v: expected_waste_fraction(
            interval_s=v["daly_interval_s"],
            save_s=v["ckpt_write_s"],
            mtbf_s=v["mtbf_s"],
            restart_s=v["restart_s"],
        ),
    ),
    # 5. Cost
    Quantity(
        name="run_s",
        unit="s",
        formula="hours x 3600, or steps x step_time_s",
        meaning="wall time of the run being priced",
        needs=("hours | steps and step_time_s",),
        compute=lambda v: (
            v["hours"] * HOUR_S
            if v.get("hours") is not None
            else time_to_finish_s(steps_left=v["steps"], step_time_s=v["step_time_s"])
            if v.get("steps") is not None and v.get("step_time_s") is not None
            else None
        ),
    ),
    Quantity(
        name="gpu_hours",
        unit="GPU-h",
        formula="workers x gpus_per_worker x run_s / 3600",
        meaning="GPU time the run holds",
        needs=("workers", "run_s"),
        compute=lambda v: v["workers"] * v["gpus_per_worker"] * v["run_s"] / HOUR_S,
    ),
    Quantity(
        name="on_demand_usd",
        unit="USD",
        formula="gpu_hours x price_per_gpu_h_usd",
        meaning="price of the run on on-demand capacity",
        needs=("gpu_hours", "price_per_gpu_h_usd"),
        compute=lambda v: v["gpu_hours"] * v["price_per_gpu_h_usd"],
    ),
    Quantity(
        name="spot_lost_fraction",
        unit="",
        formula="spot_preemptions_per_h / 3600 x expected_loss_per_failure_s",
        meaning="share of spot time lost to preemptions at the chosen cadence",
        needs=("spot_preemptions_per_h", "expected_loss_per_failure_s"),
        compute=_spot_lost_fraction,
    ),
    Quantity(
        name="spot_gpu_hours",
        unit="GPU-h",
        formula="gpu_hours / (1 - spot_lost_fraction)",
        meaning="GPU time on spot for the same work, redoing what preemptions lose (absent if all is lost)",
        needs=("gpu_hours", "spot_lost_fraction"),
        compute=_spot_gpu_hours,
        absent_when="spot_lost_fraction < 1 (preemptions would lose all the work)",
    ),
    Quantity(
        name="spot_usd",
        unit="USD",
        formula="spot_gpu_hours x price_per_gpu_h_usd x (1 - spot_discount)",
        meaning="price of the same work on spot capacity, preemptions included",
        needs=("spot_gpu_hours", "price_per_gpu_h_usd", "spot_discount"),
        compute=lambda v: v["spot_gpu_hours"] * v["price_per_gpu_h_usd"] * (1 - v["spot_discount"]),
    ),
    Quantity(
        name="spot_savings_usd",
        unit="USD",
        formula="on_demand_usd - spot_usd",
        meaning="what spot saves (negative: preemptions cost more than the discount gives)",
        needs=("on_demand_usd", "spot_usd"),
        compute=lambda v: v["on_demand_usd"] - v["spot_usd"],
    ),
)
QUANTITY_NAMES = tuple(quantity.name for quantity in QUANTITIES)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One quantity of a plan, as a report shows it."""

    name: str
    value: Value | None  # None: absent
    unit: str
    formula: str
    meaning: str
    needs: tuple[str, ...] = ()  # the facts it lacks, when absent

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "formula": self.formula,
            "meaning": self.meaning,
            "needs": list(self.needs),
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    facts: PlanFacts
    rows: tuple[Row, ...]

    def __getitem__(self, name: str) -> Value | None:
        return next(row.value for row in self.rows if row.name == name)

    def as_dict(self) -> dict[str, Value | None]:
        """Every quantity by name, None where absent (one flat object, for scripts)."""
        return {row.name: row.value for row in self.rows}


def merge_facts(*layers: tuple[str, Mapping[str, Any]]) -> tuple[PlanFacts, dict[str, str]]:
    """One PlanFacts from layers of facts, later layers winning (e.g. spec, then the job's
    measurements, then flags), and where each fact set came from. ValueError for a bad value."""
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, facts in layers:
        for name, value in facts.items():
            if value is not None:
                merged[name], sources[name] = value, source
    return PlanFacts.model_validate(merged), sources


def plan(facts: PlanFacts) -> Plan:
    """Every quantity that the facts allow; the others absent with the facts they need."""
    values: dict[str, Any] = facts.model_dump()
    lacking: dict[str, tuple[str, ...]] = {}  # quantity -> the facts it lacks
    rows = []
    for quantity in QUANTITIES:
        given = quantity.given_by is not None and values.get(quantity.given_by) is not None
        value: Value | None = values[quantity.given_by] if given and quantity.given_by else None
        missing: tuple[str, ...] = ()
        if not given:
            absent = [need for need in quantity.needs if "|" not in need and values.get(need) is None]
            if absent:
                missing = tuple(dict.fromkeys(fact for need in absent for fact in lacking.get(need, (need,))))
            else:
                value = quantity.compute(values)
                if value is None:
                    missing = tuple(need for need in quantity.needs if "|" in need) or (quantity.absent_when,)
        values[quantity.name] = value
        if value is None:
            lacking[quantity.name] = missing or quantity.needs
        rows.append(
            Row(
                name=quantity.name,
                value=value,
                unit=quantity.unit,
                formula=f"given ({quantity.given_by})" if given else quantity.formula,
                meaning=quantity.meaning,
                # A quantity that could also be given says so ("or ckpt_write_s").
                needs=(*lacking[quantity.name], *([f"or {quantity.given_by}"] if quantity.given_by else []))
                if value is None
                else (),
            )
        )
    return Plan(facts=facts, rows=tuple(rows))
