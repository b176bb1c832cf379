"""Write a synthetic image classification dataset as parquet shards: rows of `id`, `image` (PNG bytes)
and `label` (0 to classes - 1), the format the image classifier recipe (`hf_vit.py`) reads.

Each class is a pattern: horizontal stripes, vertical stripes, diagonal stripes, a checkerboard (and
so on, cycling with a different stripe width), drawn in a random colour at a random phase, on noise:

    python examples/hf_image/make_images.py /data/images --rows 2048 --size 32 --classes 4 --shards 4
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

PATTERNS = 4  # horizontal, vertical, diagonal, checkerboard


def pattern(label: int, *, size: int, rng: np.random.Generator) -> np.ndarray:
    """One `size` x `size` RGB image (uint8) of class `label`."""
    width = 2 + label // PATTERNS  # classes past the four patterns repeat them with wider stripes
    ys, xs = np.mgrid[0:size, 0:size]
    ys, xs = ys + rng.integers(0, 2 * width), xs + rng.integers(0, 2 * width)
    kind = label % PATTERNS
    if kind == 0:
        mask = (ys // width) % 2
    elif kind == 1:
        mask = (xs // width) % 2
    elif kind == 2:
        mask = ((xs + ys) // width) % 2
    else:
        mask = ((xs // width) + (ys // width)) % 2
    colour = rng.integers(96, 256, size=3)
    noise = rng.normal(0, 24, size=(size, size, 3))
    image = mask[..., None] * colour + noise + 16
    return np.clip(image, 0, 255).astype(np.uint8)


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(out, format="PNG")
    return out.getvalue()


def image_table(*, rows: int, size: int = 32, classes: int = 4, seed: int = 0) -> pa.Table:
    """`rows` synthetic images, labels balanced and shuffled."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(rows) % classes)
    images = [png(pattern(int(label), size=size, rng=rng)) for label in labels]
    return pa.table(
        {
            "id": pa.array(np.arange(rows), pa.int64()),
            "image": pa.array(images, pa.binary()),
            "label": pa.array(labels, pa.int64()),
        }
    )


def write_images(
    folder: Path, *, rows: int, size: int = 32, classes: int = 4, shards: int = 2, seed: int = 0
) -> Path:
    """The dataset as `shards` parquet files in `folder` (created)."""
    table = image_table(rows=rows, size=size, classes=classes, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, shards + 1).astype(int)
    for index in range(shards):
        part = table.slice(int(bounds[index]), int(bounds[index + 1] - bounds[index]))
        pq.write_table(part, folder / f"shard-{index:05d}.parquet", row_group_size=256)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--size", type=int, default=32, help="image height and width, in pixels")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="a held-out set: the same command, another seed")
    args = parser.parse_args()
    write_images(
        args.folder, rows=args.rows, size=args.size, classes=args.classes, shards=args.shards, seed=args.seed
    )
    print(f"{args.rows} images of {args.size}x{args.size} in {args.classes} classes -> {args.folder}")


if __name__ == "__main__":
    main()
