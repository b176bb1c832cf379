"""The planner's quantities on worked examples checked by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from service.contract.spec import GPTConfig, JobSpec
from service.planning.formulas import (
    QUANTITY_NAMES,
    PlanFacts,
    auto_checkpoint_interval_s,
    daly_interval_s,
    facts_from_spec,
    gpt_params,
    merge_facts,
    plan,
    time_to_finish_s,
    young_interval_s,
)

# A 7B model on 8 workers, fp32 with Adam, 400 Gbit/s links, 2 GB/s to storage, a checkpoint every
# 1,000 steps of 1 s, an MTBF of 24 h, 2 min restarts, $3/GPU-h, spot 60% off with 0.5 preemptions/h.
SEVEN_B = PlanFacts(
    params=7e9,
    workers=8,
    batch_per_worker=4,
    step_time_s=1.0,
    link_bytes_per_s=50e9,
    storage_bytes_per_s=2e9,
    ckpt_every_steps=1000,
    mtbf_s=86_400,
    restart_s=120,
    price_per_gpu_h_usd=3.0,
    spot_discount=0.6,
    spot_preemptions_per_h=0.5,
    hours=10,
)


def test_throughput() -> None:
    result = plan(SEVEN_B)
    assert result["global_batch"] == 32  # 8 workers x 4
    assert result["samples_per_s"] == pytest.approx(32.0)  # 32 / 1.0 s


def test_communication_below_the_ceiling() -> None:
    result = plan(SEVEN_B)
    # ring all-reduce: 7e9 params x 4 B (fp32 grads) x 2(8-1)/8 = 7e9 x 4 x 1.75 = 4.9e10 B
    assert result["grad_bytes_per_worker"] == pytest.approx(4.9e10)
    assert result["comm_time_s"] == pytest.approx(0.98)  # 4.9e10 B / 5e10 B/s
    assert result["comm_ratio"] == pytest.approx(0.98)  # 0.98 s / 1.0 s
    assert result["comm_bound"] is False  # 0.98 s < 1.0 s
    assert result["step_time_no_overlap_s"] == pytest.approx(1.98)  # 1.0 + 0.98


def test_communication_bound_at_70b_in_bf16() -> None:
    result = plan(
        PlanFacts(params=70e9, workers=64, step_time_s=2.0, precision="bf16", link_bytes_per_s=12.5e9)
    )
    # 70e9 x 2 B (bf16 grads) x 2(63)/64 = 70e9 x 2 x 1.96875 = 2.75625e11 B
    assert result["grad_bytes_per_worker"] == pytest.approx(2.75625e11)
    assert result["comm_time_s"] == pytest.approx(22.05)  # 2.75625e11 / 12.5e9 (100 Gbit/s)
    assert result["comm_ratio"] == pytest.approx(11.025)  # 22.05 / 2.0
    assert result["comm_bound"] is True


def test_one_worker_moves_nothing_and_a_given_size_wins() -> None:
    assert plan(PlanFacts(params=1e9, workers=1))["grad_bytes_per_worker"] == 0  # 2(1-1)/1 = 0
    given = plan(PlanFacts(params=1e9, workers=4, grad_bytes_per_worker=123.0))
    assert given["grad_bytes_per_worker"] == 123.0
    assert next(row.formula for row in given.rows if row.name == "grad_bytes_per_worker").startswith("given")


def test_checkpoint_size_write_time_and_stall() -> None:
    result = plan(SEVEN_B)
    assert result["ckpt_bytes"] == pytest.approx(8.4e10)  # 7e9 x (4 fp32 weights + 8 Adam moments)
    assert result["ckpt_write_s"] == pytest.approx(42.0)  # 8.4e10 B / 2e9 B/s
    assert result["ckpt_interval_s"] == pytest.approx(1000.0)  # 1,000 steps x 1.0 s
    assert result["ckpt_stall_fraction"] == pytest.approx(0.042)  # 42 s / 1,000 s
    # SGD (one momentum buffer): 1e9 x (4 + 4) = 8e9 B; a measured save time replaces size / bandwidth.
    sgd = plan(PlanFacts(params=1e9, optimizer="sgd", storage_bytes_per_s=1e9, ckpt_write_s=3.0))
    assert sgd["ckpt_bytes"] == pytest.approx(8e9)
    assert sgd["ckpt_write_s"] == 3.0


def test_the_shorter_of_two_cadences_counts() -> None:
    # every 1,000 steps of 1 s = 1,000 s, or every 600 s: 600 s comes first
    both = plan(PlanFacts(ckpt_every_steps=1000, step_time_s=1.0, ckpt_every_s=600))
    assert both["ckpt_interval_s"] == 600


def test_cadence() -> None:
    result = plan(SEVEN_B)
    assert result["expected_loss_per_failure_s"] == pytest.approx(620.0)  # 1,000 / 2 + 120
    # Young: sqrt(2 x 42 x 86,400) = sqrt(7,257,600) = 2,693.99
    assert result["young_interval_s"] == pytest.approx(2693.9933, rel=1e-6)
    # Daly: d/2M = 42 / 172,800 = 2.43056e-4, sqrt = 0.0155902;
    # 2,693.9933 x (1 + 0.0155902/3 + 2.43056e-4/9) - 42 = 2,693.9933 x 1.0052237 - 42 = 2,666.066
    assert result["daly_interval_s"] == pytest.approx(2666.066, rel=1e-6)
    # at 1,000 s: 42/1,000 + 620/86,400 = 0.042 + 0.0071759 = 0.0491759
    assert result["expected_waste_fraction"] == pytest.approx(0.0491759, rel=1e-5)
    # at Daly's 2,666.066 s: 42/2,666.066 + (1,333.033 + 120)/86,400 = 0.0157536 + 0.0168175 = 0.0325711
    assert result["expected_waste_fraction_at_optimum"] == pytest.approx(0.0325711, rel=1e-5)
    assert result["expected_waste_fraction_at_optimum"] < result["expected_waste_fraction"]


def test_daly_limits() -> None:
    # a save of at least 2 MTBF: Daly's interval is the MTBF itself
    assert daly_interval_s(save_s=200.0, mtbf_s=100.0) == 100.0
    # a save small against the MTBF: Daly tends to Young (d = 1 s, M = 1e6 s: 1,414.2 vs 1,414.2 - 1 + ...)
    assert daly_interval_s(save_s=1.0, mtbf_s=1e6) == pytest.approx(
        young_interval_s(save_s=1.0, mtbf_s=1e6) - 1, rel=1e-3
    )
    # auto: an async save may not come before the last one is written (floor), else Daly's optimum
    assert auto_checkpoint_interval_s(save_s=50.0, mtbf_s=60.0, min_interval_s=50.0) == 50.0
    assert auto_checkpoint_interval_s(save_s=42.0, mtbf_s=86_400) == pytest.approx(2666.066, rel=1e-6)


def test_cost_on_demand_and_spot() -> None:
    result = plan(SEVEN_B)
    assert result["run_s"] == 36_000  # 10 h
    assert result["gpu_hours"] == pytest.approx(80.0)  # 8 workers x 1 GPU x 10 h
    assert result["on_demand_usd"] == pytest.approx(240.0)  # 80 x $3
    # 0.5 preemptions/h = 1.3889e-4 /s, each losing 620 s: 0.0861111 of the time
    assert result["spot_lost_fraction"] == pytest.approx(0.0861111, rel=1e-5)
    assert result["spot_gpu_hours"] == pytest.approx(87.53799, rel=1e-5)  # 80 / (1 - 0.0861111)
    assert result["spot_usd"] == pytest.approx(105.04559, rel=1e-5)  # 87.538 x $3 x (1 - 0.6)
    assert result["spot_savings_usd"] == pytest.approx(134.95441, rel=1e-5)  # 240 - 105.046


def test_the_run_is_priced_from_steps_without_hours() -> None:
    # 10,000 steps x 0.5 s = 5,000 s; 4 workers x 2 GPUs x 5,000/3,600 h = 11.111 GPU-h x $2 = $22.22
    result = plan(
        PlanFacts(steps=10_000, step_time_s=0.5, workers=4, gpus_per_worker=2, price_per_gpu_h_usd=2)
    )
    assert result["run_s"] == 5000
    assert result["gpu_hours"] == pytest.approx(11.1111, rel=1e-4)
    assert result["on_demand_usd"] == pytest.approx(22.2222, rel=1e-4)


def test_preemptions_that_lose_everything_leave_spot_absent_with_why() -> None:
    # 10 preemptions/h x (3,600/2 + 0 s) lost each = 10/3,600 x 1,800 = 5: more than all the time
    result = plan(
        PlanFacts(
            workers=1,
            hours=1,
            ckpt_every_s=3600,
            restart_s=0,
            spot_preemptions_per_h=10,
            price_per_gpu_h_usd=1,
        )
    )
    assert result["spot_lost_fraction"] == pytest.approx(5.0)
    row = next(row for row in result.rows if row.name == "spot_gpu_hours")
    assert row.value is None and "spot_lost_fraction < 1" in row.needs[0]


def test_missing_facts_leave_quantities_absent_with_what_they_need() -> None:
    result = plan(PlanFacts())
    flat = result.as_dict()
    assert tuple(flat) == QUANTITY_NAMES and all(value is None for value in flat.values())
    needs = {row.name: row.needs for row in result.rows}
    assert needs["global_batch"] == ("workers", "batch_per_worker")
    assert needs["ckpt_write_s"] == ("params", "storage_bytes_per_s", "or ckpt_write_s")
    assert needs["young_interval_s"] == ("params", "storage_bytes_per_s", "mtbf_s")
    assert needs["ckpt_interval_s"] == ("ckpt_every_s | ckpt_every_steps and step_time_s",)
    # a partial plan: what it has is computed, the rest says what is missing
    partial = plan(PlanFacts(ckpt_write_s=10, mtbf_s=5000))
    assert partial["young_interval_s"] == pytest.approx(316.2278, rel=1e-6)  # sqrt(2 x 10 x 5,000)
    assert partial["expected_waste_fraction"] is None


@pytest.mark.parametrize(
    ("facts", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"spot_discount": 1.0}, "spot_discount"),
        ({"precision": "fp8"}, "precision"),
        ({"step_time_s": -1}, "step_time_s"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_facts_are_value_errors_naming_the_field(facts: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field) as caught:
        PlanFacts.model_validate(facts)
    assert isinstance(caught.value, ValidationError)


def test_merge_facts_later_layers_win_and_say_where_from() -> None:
    facts, sources = merge_facts(
        ("spec", {"workers": 4, "precision": "bf16"}), ("flag", {"workers": 8, "params": None})
    )
    assert (facts.workers, facts.precision, facts.params) == (8, "bf16", None)
    assert sources == {"workers": "flag", "precision": "spec"}


def test_gpt_params_match_the_torch_model() -> None:
    from trainers.models import GPT

    config = GPTConfig(vocab_size=1000, d_model=64, n_layers=3, n_heads=4)
    model = GPT(config, block_size=31)
    # 1000 x 64 + 31 x 64 + 3 x (12 x 64^2 + 13 x 64) + 2 x 64 = 64,000 + 1,984 + 149,952 + 128 = 216,064
    assert gpt_params(config, context=31) == sum(p.numel() for p in model.parameters()) == 216_064


def test_facts_from_a_spec() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "gpt",
            "trainer": "gpt",
            "num_workers": {"min": 2, "max": 8},
            "resources_per_worker": {"GPU": 1, "CPU": 4},
            "precision": "bf16",
            "dataset": {"uri": "s3://bucket/tokens"},
            "max_steps": 500,
            "batch_size": 16,
            "checkpoint": {"every_steps": 100},
            "config": {"vocab_size": 1000, "d_model": 64, "n_layers": 3, "n_heads": 4},
        }
    )
    facts = facts_from_spec(spec)
    assert facts == {
        "workers": 8,  # an elastic group's max
        "batch_per_worker": 16,
        "steps": 500,
        "precision": "bf16",
        "ckpt_every_steps": 100,
        "gpus_per_worker": 1,
        "params": 214_080,  # 216,064 less the position embedding (context unknown): 31 x 64 = 1,984
        "optimizer": "adam",
    }


def test_time_to_finish() -> None:
    assert time_to_finish_s(steps_left=300, step_time_s=0.25) == 75.0
    assert time_to_finish_s(steps_left=-5, step_time_s=0.25) == 0.0  # past max_steps: nothing left
    assert math.isclose(young_interval_s(save_s=2, mtbf_s=3600), 120.0)  # sqrt(14,400)
