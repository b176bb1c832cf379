from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from service.spec import GPTConfig
from trainers.models import (
    GPT,
    MLP,
    build_model,
    build_optimizer,
    compute_loss,
    grad_clip_of,
    lr_factor,
)


def gpt_spec(synthetic: Any, **fields: Any) -> Any:
    config = {"vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4, "warmup_steps": 10}
    return synthetic.make_spec(trainer="gpt", dataset="file:///unused", config=config, **fields)


def test_mlp_classification_forward_backward(synthetic: Any) -> None:
    spec = synthetic.make_spec(trainer="mlp", dataset="file:///unused", config={"num_classes": 3})
    model = build_model(spec, row_shape={"input_size": 8})
    assert isinstance(model, MLP)
    batch = {"features": torch.randn(5, 8), "label": torch.tensor([0, 1, 2, 1, 0])}
    assert model(batch["features"]).shape == (5, 3)
    loss = compute_loss(model, batch, spec=spec)
    loss.backward()
    assert loss.ndim == 0
    assert all(p.grad is not None for p in model.parameters())
    assert grad_clip_of(spec) is None


def test_mlp_regression_is_mse_on_one_output(synthetic: Any) -> None:
    config = {"task": "regression", "hidden_sizes": [4]}
    spec = synthetic.make_spec(trainer="mlp", dataset="file:///unused", config=config)
    model = build_model(spec, row_shape={"input_size": 3})
    features, target = torch.randn(6, 3), torch.randn(6)
    assert model(features).shape == (6, 1)
    expected = torch.nn.functional.mse_loss(model(features).squeeze(-1), target)
    loss = compute_loss(model, {"features": features, "label": target}, spec=spec)
    assert torch.allclose(loss, expected)


def test_gpt_shapes_tying_and_initial_loss(synthetic: Any) -> None:
    spec = gpt_spec(synthetic)
    model = build_model(spec, row_shape={"seq_len": 17})
    assert isinstance(model, GPT)
    assert model.block_size == 16
    assert model.lm_head.weight is model.tok_emb.weight
    tokens = torch.randint(0, 50, (4, 17))
    assert model(tokens[:, :-1]).shape == (4, 16, 50)
    loss = compute_loss(model, {"tokens": tokens}, spec=spec)
    # Small init: the first predictions are near uniform over the vocabulary.
    assert abs(loss.item() - math.log(50)) < 0.5
    loss.backward()
    assert model.tok_emb.weight.grad is not None
    assert all(p.grad is not None for p in model.parameters())


def test_gpt_attention_is_causal(synthetic: Any) -> None:
    model = build_model(gpt_spec(synthetic), row_shape={"seq_len": 9}).eval()
    tokens = torch.randint(0, 50, (2, 8))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 50
    before, after = model(tokens), model(changed)
    assert torch.allclose(before[:, :5], after[:, :5], atol=1e-6)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_gpt_refuses_sequences_longer_than_its_context(synthetic: Any) -> None:
    model = build_model(gpt_spec(synthetic), row_shape={"seq_len": 9})
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


def test_gpt_optimizer_follows_the_schedule_and_skips_decay_on_vectors(synthetic: Any) -> None:
    spec = gpt_spec(synthetic, max_steps=50)
    model = build_model(spec, row_shape={"seq_len": 9})
    optimizer, scheduler = build_optimizer(model, spec=spec)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == pytest.approx(0.1) and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    config = spec.trainer_config()
    assert isinstance(config, GPTConfig)
    peak = config.lr
    for step in range(50):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(
            peak * lr_factor(step, warmup_steps=10, max_steps=50)
        )
        optimizer.step()
        scheduler.step()
    assert grad_clip_of(spec) == pytest.approx(1.0)


def test_mlp_optimizer_is_adam_at_a_constant_lr(synthetic: Any) -> None:
    spec = synthetic.make_spec(trainer="mlp", dataset="file:///unused", config={"num_classes": 2, "lr": 0.01})
    optimizer, scheduler = build_optimizer(build_model(spec, row_shape={"input_size": 2}), spec=spec)
    assert type(optimizer) is torch.optim.Adam
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
