"""What the driver learns of a dataset before any worker starts, and how rows become tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from service.contract.errors import DatasetError
from service.contract.spec import MLPConfig
from tests.support.datasets import write_classes, write_tokens
from tests.support.jobs import make_spec
from trainers.data import DatasetInfo, inspect_dataset
from trainers.recipe import recipe_for
from trainers.recipes import GPTCollate, MLPCollate

GPT_CONFIG = {"vocab_size": 32, "d_model": 16, "n_heads": 2}


def test_inspect_gpt_dataset(tmp_path: Path) -> None:
    folder = write_tokens(tmp_path / "tokens", rows=100, seq_len=9, shards=3)
    spec = make_spec(trainer="gpt", dataset=folder, config=GPT_CONFIG)
    info = inspect_dataset(spec, recipe=recipe_for(spec))
    assert info.num_rows == 100 and len(info.files) == 3
    assert info.columns == ["id", "tokens"]
    assert info.row_shape == {"seq_len": 9}
    assert info.read_columns == ["tokens"]
    assert DatasetInfo.from_dict(info.to_dict()) == info


def test_inspect_mlp_dataset(tmp_path: Path) -> None:
    folder = write_classes(tmp_path / "cls", rows=64, num_features=6)
    spec = make_spec(trainer="mlp", dataset=folder, config={"num_classes": 3})
    assert inspect_dataset(spec, recipe=recipe_for(spec)).row_shape == {"input_size": 6}


@pytest.mark.parametrize(
    ("table", "trainer", "config", "message"),
    [
        (
            pa.table({"a": [1, 2], "b": [3, 4]}),
            "gpt",
            GPT_CONFIG,
            r"has no column 'tokens' \(columns: a, b\)",
        ),
        (
            pa.table({"tokens": ["x", "y"]}),
            "gpt",
            GPT_CONFIG,
            "column 'tokens' must be a list of integer ids",
        ),
        (pa.table({"tokens": [[1], [2]]}), "gpt", GPT_CONFIG, "need at least 2 ids, got 1"),
        (
            pa.table({"features": [[1.0], [2.0]], "label": [0.5, 1.5]}),
            "mlp",
            {"num_classes": 2},
            "column 'label' must be an integer class id, got double",
        ),
        (
            pa.table({"features": [1.0, 2.0], "label": [0, 1]}),
            "mlp",
            {"num_classes": 2},
            "column 'features' must be a list of numbers",
        ),
    ],
)
def test_inspect_refuses_datasets_that_cannot_feed_the_trainer(
    tmp_path: Path, table: pa.Table, trainer: str, config: dict[str, Any], message: str
) -> None:
    pq.write_table(table, tmp_path / "part.parquet")
    spec = make_spec(trainer=trainer, dataset=tmp_path, config=config, num_workers=1, batch_size=1)
    with pytest.raises(DatasetError, match=message):
        inspect_dataset(spec, recipe=recipe_for(spec))


def test_inspect_refuses_missing_empty_and_too_small(tmp_path: Path) -> None:
    spec = make_spec(trainer="gpt", dataset=tmp_path / "nowhere", config=GPT_CONFIG)
    with pytest.raises(DatasetError, match="does not exist"):
        inspect_dataset(spec, recipe=recipe_for(spec))
    (tmp_path / "empty").mkdir()
    spec = make_spec(trainer="gpt", dataset=tmp_path / "empty", config=GPT_CONFIG)
    with pytest.raises(DatasetError, match=r"has no \.parquet files"):
        inspect_dataset(spec, recipe=recipe_for(spec))
    small = write_tokens(tmp_path / "small", rows=20, shards=1)
    spec = make_spec(trainer="gpt", dataset=small, config=GPT_CONFIG, num_workers=2, batch_size=16)
    with pytest.raises(DatasetError, match=r"has 20 rows but one step needs .* = 32"):
        inspect_dataset(spec, recipe=recipe_for(spec))


def test_collates_turn_arrow_batches_into_tensors() -> None:
    tokens = pa.table({"tokens": pa.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], pa.list_(pa.int32()))})
    batch = GPTCollate(seq_len=3, vocab_size=10, uri="file:///d")(tokens.slice(1, 2))
    assert torch.equal(batch["tokens"], torch.tensor([[4, 5, 6], [7, 8, 9]]))
    assert batch["tokens"].dtype == torch.int64

    table = pa.table({"features": [[1.0, 2.0], [3.0, 4.0]], "label": [1, 0]})
    batch = MLPCollate(input_size=2, config=MLPConfig(num_classes=2), uri="file:///d")(table)
    assert batch["features"].dtype == torch.float32 and batch["features"].shape == (2, 2)
    assert torch.equal(batch["label"], torch.tensor([1, 0]))
    regression = MLPConfig(task="regression")
    batch = MLPCollate(input_size=2, config=regression, uri="file:///d")(table)
    assert batch["label"].dtype == torch.float32


def test_collates_name_bad_rows() -> None:
    ragged = pa.table({"tokens": [[1, 2, 3], [4, 5]]})
    with pytest.raises(DatasetError, match=r"every row of 'tokens' must have 3 values .* found 2"):
        GPTCollate(seq_len=3, vocab_size=10, uri="file:///d")(ragged)
    with pytest.raises(DatasetError, match=r"token ids must be in \[0, vocab_size=5\)"):
        GPTCollate(seq_len=3, vocab_size=5, uri="file:///d")(pa.table({"tokens": [[1, 2, 7]]}))
    labels = pa.table({"features": [[1.0], [2.0]], "label": [0, 3]})
    with pytest.raises(DatasetError, match=r"dataset file:///d: label 3 is outside \[0, num_classes=2\)"):
        MLPCollate(input_size=1, config=MLPConfig(num_classes=2), uri="file:///d")(labels)


def test_build_collate_matches_the_trainer() -> None:
    spec = make_spec(trainer="gpt", dataset="file:///d", config=GPT_CONFIG)
    collate = recipe_for(spec).build_collate({"seq_len": 5}, uri="file:///d")
    assert isinstance(collate, GPTCollate) and collate.seq_len == 5 and collate.vocab_size == 32
