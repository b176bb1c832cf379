"""`apiary data shard` and the manifest: shards, rows, schema, checksums, and the errors users see."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from api.cli import app
from api.demo import classification_table, token_table, write_shards
from service.contract.errors import DatasetError
from service.contract.storage import MANIFEST_NAME, list_shards, read_manifest, validate_manifest
from service.contract.webdataset import decode_webdataset, encode_webdataset
from service.sharding import ShardingError, shard_dataset


@pytest.fixture
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "source"
    write_shards(token_table(num_rows=100, seq_len=7, vocab_size=16), folder.as_uri(), num_shards=2)
    return folder


@pytest.mark.parametrize("data_format", ["parquet", "webdataset"])
def test_shard_writes_balanced_shards_and_a_manifest(source: Path, tmp_path: Path, data_format: str) -> None:
    dest = tmp_path / "dest"
    manifest = shard_dataset(
        str(source), dest.as_uri(), data_format=data_format, num_shards=3, row_group_rows=8
    )
    suffix = ".parquet" if data_format == "parquet" else ".tar"
    assert [shard.path for shard in manifest.shards] == [f"shard-0000{i}{suffix}" for i in range(3)]
    assert [shard.num_rows for shard in manifest.shards] == [33, 33, 34]
    assert manifest.num_rows == 100 and manifest.format == data_format
    assert manifest.schema["id"] == "int64" and manifest.schema["tokens"].startswith("list<")
    assert manifest.arrow_schema().field("tokens").type.value_type == pa.int32()
    for shard in manifest.shards:
        assert (dest / shard.path).stat().st_size == shard.size_bytes
        assert len(shard.sha256) == 64
    if data_format == "parquet":
        assert manifest.shards[0].row_groups == [8, 8, 8, 8, 1]
        assert pq.ParquetFile(dest / "shard-00000.parquet").metadata.num_row_groups == 5
    assert read_manifest(dest.as_uri()) == manifest
    assert json.loads((dest / MANIFEST_NAME).read_text())["format_version"] == 1
    # Rows keep their order across shards.
    files, _ = list_shards(dest.as_uri(), data_format=data_format)
    assert [Path(f).name for f in files] == [shard.path for shard in manifest.shards]
    validate_manifest(manifest, uri=dest.as_uri())


def test_webdataset_round_trip_keeps_types_and_values() -> None:
    table = classification_table(num_rows=5, num_features=3, num_classes=4, seed=1)
    decoded = decode_webdataset(encode_webdataset(table))
    assert decoded.equals(table), (decoded.schema, table.schema)
    tokens = token_table(num_rows=4, seq_len=5, vocab_size=9, seed=0)
    assert decode_webdataset(encode_webdataset(tokens)).equals(tokens)


def test_webdataset_layout_is_key_column_ext() -> None:
    import io
    import tarfile

    table = pa.table({"id": [3, 4], "tokens": pa.array([[1, 2], [3, 4]], pa.list_(pa.int32()))})
    with tarfile.open(fileobj=io.BytesIO(encode_webdataset(table))) as tar:
        names = tar.getnames()
        payload = tar.extractfile("000000001.tokens.npy")
        assert payload is not None
        assert np.load(io.BytesIO(payload.read())).tolist() == [3, 4]
    assert names == ["000000000.id.cls", "000000000.tokens.npy", "000000001.id.cls", "000000001.tokens.npy"]


def test_manifest_catches_missing_resized_and_corrupt_shards(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    manifest = shard_dataset(str(source), str(dest), num_shards=2)
    shard = dest / "shard-00001.parquet"
    data = bytearray(shard.read_bytes())

    data[100] ^= 0xFF  # same size, different bytes: only the checksum sees it
    shard.write_bytes(bytes(data))
    validate_manifest(manifest, uri=str(dest), verify_checksums=False)
    with pytest.raises(DatasetError, match=r"shard shard-00001.parquet fails its sha256 check"):
        validate_manifest(manifest, uri=str(dest))

    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(DatasetError, match=r"shard-00001.parquet has \d+ bytes, _manifest.json says \d+"):
        list_shards(dest.as_uri())

    shard.unlink()
    with pytest.raises(DatasetError, match=r"shard-00001\.parquet is listed in _manifest\.json but missing"):
        list_shards(dest.as_uri())


def test_manifest_format_must_match_the_job(source: Path, tmp_path: Path) -> None:
    shard_dataset(str(source), str(tmp_path / "wds"), data_format="webdataset", num_shards=2)
    with pytest.raises(DatasetError, match="says format 'webdataset', the job says 'parquet'"):
        list_shards((tmp_path / "wds").as_uri(), data_format="parquet")
    (tmp_path / "wds" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DatasetError, match=r"_manifest\.json is not a valid manifest"):
        list_shards((tmp_path / "wds").as_uri(), data_format="webdataset")


def test_bad_sharding_requests_are_value_errors(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardingError, match="format must be one of parquet, webdataset"):
        shard_dataset(str(source), str(tmp_path / "d"), data_format="csv", num_shards=2)
    with pytest.raises(ShardingError, match="--num-shards must be >= 1"):
        shard_dataset(str(source), str(tmp_path / "d"), num_shards=0)
    with pytest.raises(ShardingError, match="fewer than --num-shards 1000"):
        shard_dataset(str(source), str(tmp_path / "d"), num_shards=1000)
    with pytest.raises(ShardingError, match="does not exist"):
        shard_dataset(str(tmp_path / "nowhere"), str(tmp_path / "d"), num_shards=1)


def test_cli_shards_and_refuses_bad_input_with_exit_2(source: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    dest = tmp_path / "cli"
    ok = runner.invoke(
        app, ["data", "shard", str(source), dest.as_uri(), "--format", "webdataset", "--num-shards", "4"]
    )
    assert ok.exit_code == 0, ok.output
    assert "wrote 4 webdataset shards (100 rows)" in ok.output
    assert read_manifest(dest.as_uri()) is not None

    for args, message in [
        (["--format", "csv", "--num-shards", "2"], "format must be one of parquet, webdataset, got 'csv'"),
        (["--num-shards", "0"], "--num-shards must be >= 1, got 0"),
    ]:
        bad = runner.invoke(app, ["data", "shard", str(source), str(tmp_path / "x"), *args])
        assert bad.exit_code == 2, bad.output
        assert bad.output.strip() == f"error: {message}"
        assert "Traceback" not in bad.output
    missing = runner.invoke(app, ["data", "shard", str(tmp_path / "nope"), str(tmp_path / "x")])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1, missing.output
    assert "does not exist" in missing.output
