"""Write a small synthetic classification dataset for the own-loop example: rows of `features` (8
numbers) and `label` (one of 3 classes, separable), as parquet in the folder given.

    python examples/own_loop/make_data.py /tmp/apiary-classes
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write(folder: Path, *, rows: int = 4096, features: int = 8, classes: int = 3, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=3.0, size=(classes, features))
    labels = rng.integers(0, classes, size=rows)
    points = centers[labels] + rng.normal(size=(rows, features))
    table = pa.table(
        {
            "features": pa.array(points.astype(np.float32).tolist(), type=pa.list_(pa.float32())),
            "label": pa.array(labels, type=pa.int64()),
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "part-0.parquet", row_group_size=512)
    return folder


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/apiary-classes").absolute()))
