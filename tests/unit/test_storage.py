from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from api.demo import token_table, write_shards
from service.contract.errors import DatasetError
from service.contract.storage import list_shards, node_local, resolve_uri


def test_resolve_uri_local_and_s3() -> None:
    path, filesystem = resolve_uri("file:///data/my%20set/")
    assert path == "/data/my set" and isinstance(filesystem, pafs.LocalFileSystem)
    assert resolve_uri("/data/x")[0] == "/data/x"
    with pytest.raises(ValueError, match="not an absolute path"):
        resolve_uri("data/x")
    with pytest.raises(ValueError, match="unsupported scheme"):
        resolve_uri("gs://bucket/x")
    path, filesystem = resolve_uri("s3://bucket/prefix/", s3_endpoint_url="http://127.0.0.1:9000")
    assert path == "bucket/prefix" and isinstance(filesystem, pafs.S3FileSystem)
    with pytest.raises(ValueError, match="must look like"):
        resolve_uri("s3://bucket/prefix", s3_endpoint_url="127.0.0.1:9000")


def test_list_shards_skips_hidden_and_other_files(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    write_shards(token_table(num_rows=8, seq_len=5, vocab_size=8), folder.as_uri(), num_shards=2)
    (folder / "_SUCCESS").write_text("")
    (folder / "notes.txt").write_text("")
    files, _ = list_shards(folder.as_uri())
    assert [Path(f).name for f in files] == ["shard-00000.parquet", "shard-00001.parquet"]
    single, _ = list_shards((folder / "shard-00001.parquet").as_uri())
    assert single == [str(folder / "shard-00001.parquet")]


def test_missing_or_empty_datasets_are_a_dataset_error_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist") as missing:
        list_shards((tmp_path / "nope").as_uri())
    assert missing.value.field == "dataset.uri"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"has no \.parquet files"):
        list_shards((tmp_path / "empty").as_uri())


def test_only_local_paths_are_node_local() -> None:
    assert node_local("/data/clf") and node_local("file:///data/clf")
    assert not node_local("s3://bucket/clf")
