"""Evaluation (`trainers.evaluation`) in one process: when it runs, and what it records. The eval data's
reading and the reduction over ranks run on Ray in tests/ray/test_recipes.py."""

from __future__ import annotations

from typing import Any

import torch

from tests.support.jobs import make_request, make_spec
from tests.support.recipes import CountingLM, CountingLMConfig
from trainers.data import DatasetInfo
from trainers.evaluation import Evaluator


def evaluator(*, checkpoint: dict[str, Any] | None = None, **eval_fields: Any) -> Evaluator:
    spec = make_spec(
        trainer="tests.support.recipes:CountingLM",
        name="counting-lm",
        dataset="file:///train",
        config={"vocab_size": 8},
        max_steps=20,
        batch_size=4,
        checkpoint=checkpoint or {},
        eval={"dataset": {"uri": "file:///held-out"}, **eval_fields},
    )
    info = DatasetInfo(
        uri="file:///held-out", files=[], columns=["tokens"], num_rows=30, row_shape={"seq_len": 5}
    )
    recipe = CountingLM(CountingLMConfig(vocab_size=8))
    return Evaluator(
        make_request(spec, storage="/unused", run_name="r"),
        info,
        recipe,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
    )


def test_evals_come_every_n_steps_and_at_the_end() -> None:
    every_5 = evaluator(every_steps=5)
    assert [step for step in range(1, 21) if every_5.due(step, checkpoint_due=step % 3 == 0)] == [
        5,
        10,
        15,
        20,
    ]
    only_the_end = evaluator()
    assert [step for step in range(1, 21) if only_the_end.due(step, checkpoint_due=False)] == [20]


def test_keep_best_by_an_eval_metric_evaluates_at_step_count_checkpoints_too() -> None:
    keep_best = {"every_steps": 3, "keep_best": {"metric": "eval_loss", "mode": "min"}}
    each = evaluator(every_steps=5, checkpoint=keep_best)
    assert [step for step in range(1, 21) if each.due(step, checkpoint_due=step % 3 == 0)] == [
        3, 5, 6, 9, 10, 12, 15, 18, 20,
    ]  # fmt: skip


def test_the_eval_batches_are_a_whole_number_per_rank_capped_by_max_batches() -> None:
    assert evaluator().num_batches == 7  # 30 rows, batches of 4, one rank
    assert evaluator(max_batches=3).num_batches == 3


def test_an_eval_averages_the_recipes_metrics_without_gradients_or_training_mode() -> None:
    run = evaluator()
    torch.manual_seed(0)
    batches = [{"tokens": torch.randint(0, 8, (4, 5))} for _ in range(3)]
    run._batches = batches  # read by Ray Data on a cluster; given here
    model = run.recipe.build_model({"seq_len": 5})
    model.train()
    metrics = run.run(model)

    assert model.training  # back as it was
    assert all(parameter.grad is None for parameter in model.parameters())
    assert run.recipe.batches_seen == 0  # the recipe's loss counts training batches only
    losses = [run.recipe.loss(model.eval(), batch)[0].item() for batch in batches]
    assert set(metrics) == {"eval_loss", "eval_accuracy", "eval_batches_seen", "eval_token_sum"}
    assert abs(metrics["eval_loss"] - sum(losses) / 3) < 1e-6
    assert metrics["eval_token_sum"] == sum(batch["tokens"].sum().item() for batch in batches) / 3
