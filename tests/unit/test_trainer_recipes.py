"""The recipe protocol (`trainers.recipe`) and the built-in recipes (`trainers.recipes`): loading,
config errors, models, losses, optimizers and schedules."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from service.contract.spec import BUILTIN_CONFIGS, GPTConfig
from tests.support.jobs import make_spec
from trainers.models import GPT, MLP
from trainers.recipe import BUILTIN_RECIPES, Recipe, recipe_class, recipe_for, split_loss
from trainers.recipes import GPTRecipe, MLPRecipe, lr_factor

GPT_CONFIG = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "warmup_steps": 10}


def gpt(**fields: Any) -> Recipe[Any]:
    return recipe_for(make_spec(trainer="gpt", dataset="file:///unused", config=GPT_CONFIG, **fields))


def mlp(config: dict[str, Any]) -> Recipe[Any]:
    return recipe_for(make_spec(trainer="mlp", dataset="file:///unused", config=config))


def test_every_builtin_name_is_a_recipe_with_the_specs_config_schema() -> None:
    assert {name: recipe_class(name).config_type for name in BUILTIN_RECIPES} == BUILTIN_CONFIGS
    trainer = gpt()
    assert isinstance(trainer, GPTRecipe) and isinstance(trainer.config, GPTConfig)
    assert isinstance(mlp({"num_classes": 3}), MLPRecipe)
    # A built-in goes the way any recipe does: by its `package.module:ClassName`.
    assert recipe_class("trainers.recipes:GPTRecipe") is recipe_class("gpt") is GPTRecipe


def test_a_name_that_is_no_recipe_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot import module 'my_pkg\.train'"):
        recipe_class("my_pkg.train:Loop")
    with pytest.raises(ValueError, match=r"module 'trainers\.recipes' has no 'Nope'"):
        recipe_class("trainers.recipes:Nope")
    with pytest.raises(
        ValueError, match=r"lr_factor is not a recipe \(a subclass of trainers\.recipe\.Recipe\)"
    ):
        recipe_class("trainers.recipes:lr_factor")


def test_a_config_error_is_one_line_naming_the_field() -> None:
    spec = make_spec(trainer="gpt", dataset="file:///unused", config=GPT_CONFIG)
    with pytest.raises(ValueError) as caught:
        recipe_for(spec.model_copy(update={"config": {**GPT_CONFIG, "d_model": "wide"}}))
    assert (
        str(caught.value)
        == "config.d_model: Input should be a valid integer, unable to parse string as an integer"
    )
    with pytest.raises(ValueError, match=r"^config\.vocab_size: Field required$"):
        recipe_for(spec.model_copy(update={"config": {}}))
    with pytest.raises(ValueError, match=r"^config\.extra: Extra inputs are not permitted$"):
        recipe_for(spec.model_copy(update={"config": {**GPT_CONFIG, "extra": 1}}))


def test_a_loss_may_come_with_metrics() -> None:
    loss = torch.tensor(2.0)
    assert split_loss(loss) == (loss, {})
    assert split_loss((loss, {"accuracy": 0.5})) == (loss, {"accuracy": 0.5})
    with pytest.raises(TypeError, match="loss tensor or"):
        split_loss((loss, 0.5))  # type: ignore[arg-type]


def test_the_default_evaluation_is_the_loss_and_its_metrics() -> None:
    trainer = mlp({"num_classes": 3})
    model = trainer.build_model({"input_size": 8})
    batch = {"features": torch.randn(5, 8), "label": torch.tensor([0, 1, 2, 1, 0])}
    metrics = trainer.evaluate(model, batch)
    assert set(metrics) == {"loss"}
    assert torch.equal(torch.as_tensor(metrics["loss"]), trainer.loss(model, batch))


def test_mlp_classification_forward_backward() -> None:
    trainer = mlp({"num_classes": 3})
    model = trainer.build_model({"input_size": 8})
    assert isinstance(model, MLP)
    batch = {"features": torch.randn(5, 8), "label": torch.tensor([0, 1, 2, 1, 0])}
    assert model(batch["features"]).shape == (5, 3)
    loss = trainer.loss(model, batch)
    loss.backward()
    assert loss.ndim == 0
    assert all(p.grad is not None for p in model.parameters())
    assert trainer.grad_clip is None


def test_mlp_regression_is_mse_on_one_output() -> None:
    trainer = mlp({"task": "regression", "hidden_sizes": [4]})
    model = trainer.build_model({"input_size": 3})
    features, target = torch.randn(6, 3), torch.randn(6)
    assert model(features).shape == (6, 1)
    expected = torch.nn.functional.mse_loss(model(features).squeeze(-1), target)
    loss = trainer.loss(model, {"features": features, "label": target})
    assert torch.allclose(loss, expected)


def test_gpt_shapes_tying_and_initial_loss() -> None:
    trainer = gpt()
    model = trainer.build_model({"seq_len": 17})
    assert isinstance(model, GPT)
    assert model.block_size == 16
    assert model.lm_head.weight is model.tok_emb.weight
    tokens = torch.randint(0, 50, (4, 17))
    assert model(tokens[:, :-1]).shape == (4, 16, 50)
    loss = trainer.loss(model, {"tokens": tokens})
    # Small init: the first predictions are near uniform over the vocabulary.
    assert abs(loss.item() - math.log(50)) < 0.5
    loss.backward()
    assert model.tok_emb.weight.grad is not None
    assert all(p.grad is not None for p in model.parameters())


def test_gpt_attention_is_causal() -> None:
    model = gpt().build_model({"seq_len": 9}).eval()
    tokens = torch.randint(0, 50, (2, 8))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 50
    before, after = model(tokens), model(changed)
    assert torch.allclose(before[:, :5], after[:, :5], atol=1e-6)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_gpt_refuses_sequences_longer_than_its_context() -> None:
    model = gpt().build_model({"seq_len": 9})
    with pytest.raises(ValueError, match="longer than the model's context 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_lr_factor_warms_up_then_decays_to_ten_percent() -> None:
    factors = [lr_factor(step, warmup_steps=10, max_steps=100) for step in range(101)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0)
    assert factors[100] == pytest.approx(0.1)
    assert all(a < b for a, b in itertools.pairwise(factors[:10]))
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))
    assert lr_factor(0, warmup_steps=0, max_steps=10) == pytest.approx(1.0)
    assert lr_factor(500, warmup_steps=0, max_steps=10) == pytest.approx(0.1)


def test_gpt_optimizer_follows_the_schedule_and_skips_decay_on_vectors() -> None:
    trainer = gpt()
    model = trainer.build_model({"seq_len": 9})
    optimizer, lr_schedule = trainer.build_optimizer(model, max_steps=50)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == pytest.approx(0.1) and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    peak = trainer.config.lr
    for step in range(50):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(
            peak * lr_factor(step, warmup_steps=10, max_steps=50)
        )
        optimizer.step()
        lr_schedule.step()
    assert trainer.grad_clip == pytest.approx(1.0)


def test_mlp_optimizer_is_adam_at_a_constant_lr() -> None:
    trainer = mlp({"num_classes": 2, "lr": 0.01})
    optimizer, lr_schedule = trainer.build_optimizer(trainer.build_model({"input_size": 2}), max_steps=10)
    assert type(optimizer) is torch.optim.Adam
    for _ in range(3):
        optimizer.step()
        lr_schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
