"""Evaluation on held-out data (`JobSpec.eval`), for recipes: what `trainers.loop` runs at eval steps.

When: every `eval.every_steps` steps, at `max_steps` (the final eval), and, when
`checkpoint.keep_best` ranks checkpoints by an eval metric, at every checkpoint the step count makes
due (`every_steps`, `max_steps`), so that such a checkpoint has the metric at its step. A checkpoint
taken on the clock (`every_s`, `auto`) or when the job is asked to stop has none, and is never among
the best (the latest checkpoint is always kept anyway).

What: each rank evaluates the same batches every time: its first `eval.max_batches` batches (all of
its share of the dataset when unset) of `batch_size` rows, in the data's order for the job's seed
and world size (`trainers.data_order`; every rank has the same number). They are read once, at the
first eval, and kept in host memory. The model runs in eval mode, without gradients, under the
spec's precision; `Recipe.evaluate` gives each batch's metrics (by default the loss and the metrics
the loss returns), which are averaged over the batches, then over the ranks (one collective; every
rank must return the same names), and recorded by rank 0 at the step as `eval_<name>` (`eval_loss`).

Nothing here draws from a random generator, so a run with evals takes exactly the training steps a
run without them takes, and an interrupted run resumes exactly.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from service.contract.protocol import LaunchRequest
from service.contract.spec import EVAL_PREFIX
from trainers.data import DatasetInfo, iter_batches_for_rank
from trainers.data_order import rows_per_rank
from trainers.parallel import autocast, gather_values
from trainers.recipe import Recipe

Batch = dict[str, torch.Tensor]


class Evaluator:
    """One rank's evals of one run (every rank runs each eval together: its forwards and the reduction
    are collectives under FSDP)."""

    def __init__(
        self,
        request: LaunchRequest,
        info: DatasetInfo,
        recipe: Recipe[Any],
        *,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        spec = request.spec
        if spec.eval is None:
            raise ValueError("the job's spec has no eval section")
        self.spec = spec
        self.eval = spec.eval
        # The training spec, reading the eval data: the same seed, batch size and data order rules.
        self.request = request.model_copy(
            update={"spec": spec.model_copy(update={"dataset": spec.eval.dataset}), "data_trace_dir": None}
        )
        self.info = info
        self.recipe = recipe
        self.rank = rank
        self.world_size = world_size
        self.device = device
        keep_best = spec.checkpoint.keep_best
        self._at_checkpoints = keep_best is not None and keep_best.metric.startswith(EVAL_PREFIX)
        self._batches: list[Batch] | None = None

    @property
    def num_batches(self) -> int:
        """Batches each rank evaluates: its whole share, or `max_batches` of it."""
        per_rank = rows_per_rank(
            self.info.num_rows, world_size=self.world_size, batch_size=self.spec.required_batch_size
        )
        batches = per_rank // self.spec.required_batch_size
        return batches if self.eval.max_batches is None else min(batches, self.eval.max_batches)

    def due(self, step: int, *, checkpoint_due: bool) -> bool:
        """Whether to evaluate after `step` (`checkpoint_due`: a checkpoint is due by the step count)."""
        every = self.eval.every_steps
        return (
            step >= self.spec.required_max_steps
            or (every is not None and step % every == 0)
            or (self._at_checkpoints and checkpoint_due)
        )

    def run(self, model: nn.Module) -> dict[str, float]:
        """Evaluate `model` (every rank together); the metrics averaged over batches and ranks, by their
        recorded names (`eval_loss`, ...)."""
        batches = self._read() if self._batches is None else self._batches
        totals: dict[str, float] = {}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for batch in batches:
                    on_device = {key: value.to(self.device) for key, value in batch.items()}
                    with autocast(self.spec.precision, device=self.device, model=model):
                        metrics = self.recipe.evaluate(model, on_device)
                    for name, value in metrics.items():
                        totals[name] = totals.get(name, 0.0) + float(value)
        finally:
            model.train(was_training)
        names = sorted(totals)
        gathered = gather_values([totals[name] for name in names], device=self.device)
        count = len(batches) * len(gathered)
        return {
            f"{EVAL_PREFIX}{name}": sum(row[index] for row in gathered) / count
            for index, name in enumerate(names)
        }

    def _read(self) -> list[Batch]:
        """This rank's eval batches, read once (on the CPU; each eval moves them to the device)."""
        collate = self.recipe.build_collate(self.info.row_shape, uri=self.info.uri)
        with contextlib.closing(
            iter_batches_for_rank(
                self.request, self.info, rank=self.rank, world_size=self.world_size, collate_fn=collate
            )
        ) as stream:
            self._batches = [next(stream)[1] for _ in range(self.num_batches)]
        return self._batches
