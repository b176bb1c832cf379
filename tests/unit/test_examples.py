"""The examples' recipes (`examples/`) in one process: their config and data checks, and one step."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from examples.hf_image.make_images import image_table
from service.contract.errors import DatasetError
from tests.support.jobs import make_spec
from trainers.recipe import Recipe, recipe_for, split_loss

GPT2 = "examples.hf_gpt2.hf_gpt2:GPT2LM"
VIT = "examples.hf_image.hf_vit:ViTClassifier"


def recipe(trainer: str, config: dict[str, object]) -> Recipe[object]:
    return recipe_for(make_spec(trainer=trainer, name="example", dataset="file:///unused", config=config))


def test_a_config_error_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"^config\.vocab_size: Field required$"):
        recipe(GPT2, {})
    with pytest.raises(ValueError, match=r"n_embd \(30\) must be divisible by n_head \(4\)"):
        recipe(GPT2, {"vocab_size": 8, "n_embd": 30})
    with pytest.raises(ValueError, match=r"^config\.num_classes: Input should be greater than or equal to 2"):
        recipe(VIT, {"num_classes": 1})


def test_the_gpt2_recipe_takes_a_step_and_names_its_blocks() -> None:
    lm = recipe(GPT2, {"vocab_size": 16, "n_embd": 16, "n_layer": 2, "n_head": 2})
    tokens = pa.table({"tokens": pa.array([[1, 2, 3, 4, 5]] * 4, pa.list_(pa.int64()))})
    shape = lm.check_columns(tokens.schema, tokens.slice(0, 1), uri="file:///t")
    assert shape == {"seq_len": 5}
    torch.manual_seed(0)
    model = lm.build_model(shape)
    assert len(lm.fsdp_blocks(model)) == 2
    optimizer, schedule = lm.build_optimizer(model, max_steps=10)
    loss, _ = split_loss(lm.loss(model, lm.build_collate(shape, uri="file:///t")(tokens)))
    loss.backward()
    optimizer.step()
    schedule.step()
    assert loss.item() == pytest.approx(torch.log(torch.tensor(16.0)).item(), abs=0.5)


def test_the_image_recipe_reads_pngs_and_refuses_what_does_not_fit() -> None:
    vit = recipe(VIT, {"num_classes": 4, "patch_size": 4, "hidden_size": 16, "num_heads": 2})
    table = image_table(rows=8, size=16, classes=4)
    shape = vit.check_columns(table.schema, table.slice(0, 1), uri="file:///i")
    assert shape == {"height": 16, "width": 16, "channels": 3}
    batch = vit.build_collate(shape, uri="file:///i")(table)
    assert batch["pixels"].shape == (8, 3, 16, 16) and batch["pixels"].abs().max() <= 1.0
    model = vit.build_model(shape)
    assert len(vit.fsdp_blocks(model)) == 2
    loss, metrics = split_loss(vit.loss(model, batch))
    assert set(metrics) == {"accuracy"} and loss.ndim == 0

    with pytest.raises(ValueError, match=r"^config\.patch_size: 5 does not divide the images' 16x16"):
        recipe(VIT, {"num_classes": 4, "patch_size": 5}).check_columns(
            table.schema, table.slice(0, 1), uri="x"
        )
    with pytest.raises(DatasetError, match=r"label 3 is outside \[0, num_classes=3\)"):
        recipe(VIT, {"num_classes": 3}).build_collate(shape, uri="file:///i")(table)
    no_images = pa.table({"image": pa.array(["not bytes"]), "label": pa.array([0])})
    with pytest.raises(DatasetError, match=r"column 'image' must be image bytes"):
        vit.check_columns(no_images.schema, no_images, uri="file:///i")
