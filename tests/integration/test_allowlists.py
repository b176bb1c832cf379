"""What a submission may name (service.allowlists): custom trainers only from APIARY_TRAINER_MODULES,
found without importing anything; datasets only under APIARY_DATA_ROOTS, resolved first, listed within
bounds. Every refusal is a 422 naming the field, and writes nothing."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from api.demo import classification_table, write_shards
from service import allowlists
from service.allowlists import check_dataset, check_trainer
from service.cluster import local_ray_temp_dir
from service.contract.errors import DatasetError, InvalidSpec
from service.contract.spec import DataFormat
from service.contract.storage import MANIFEST_NAME
from service.settings import Settings
from service.sharding import shard_dataset
from tests.integration.conftest import Service

# The fields of this module's `spec` (tests/integration/conftest.py) that differ from
# tests.support.jobs.classification_job.
SPEC_FIELDS = {
    "name": "allowlist-test",
    "max_steps": 10,
}


def refused(service: Service, spec: dict[str, Any], field: str) -> str:
    """The message of a submission refused with 422 on `field`; checks that nothing was written."""
    response = service.http.post("/jobs", json=spec)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["detail"][0]["loc"] == ["body", *field.split(".")], body
    assert service.count() == 0
    return str(body["message"])


def test_a_custom_trainer_must_come_from_an_allowed_module(service: Service, spec: dict[str, Any]) -> None:
    # The service of these tests allows `tests.support` (tests/integration/conftest.py).
    for trainer in (
        "os:system",
        "subprocess:run",
        "tests:anything",  # the parent of an allowed prefix is not allowed
        "tests.supportive:train",  # a prefix matches whole package names only
        "tests.support.no_such_module:train",  # allowed, but not installed
    ):
        message = refused(service, {**spec, "trainer": trainer}, "trainer")
        assert message.startswith(f"trainer {trainer!r} is not allowed here"), message
        assert "APIARY_TRAINER_MODULES (tests.support)" in message
    assert service.submit({**spec, "trainer": "tests.support.custom_trainer:train"})["state"] == "queued"


def test_checking_a_trainer_imports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "evil_pkg"
    (package / "sub").mkdir(parents=True)
    marker = tmp_path / "imported"
    # Importing the parent package (as importlib.util.find_spec does for a dotted name) would run this.
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "train.py").write_text("def train(config):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    check_trainer("evil_pkg.sub.train:train", allowed_modules=["evil_pkg"])
    with pytest.raises(InvalidSpec, match="is not allowed here"):
        check_trainer("evil_pkg.sub.missing:train", allowed_modules=["evil_pkg"])
    with pytest.raises(InvalidSpec, match=r"APIARY_TRAINER_MODULES \(none\)"):
        check_trainer("evil_pkg.sub.train:train", allowed_modules=[])
    assert not marker.exists() and "evil_pkg" not in sys.modules
    check_trainer("mlp", allowed_modules=[])  # the built-ins need no allowlist


def test_a_dataset_must_lie_under_a_data_root(
    service: Service, spec: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The data root of these tests' service is its tmp_path. A real dataset outside it...
    outside = tmp_path_factory.mktemp("elsewhere") / "dataset"
    write_shards(
        classification_table(num_rows=32, num_features=8, num_classes=3), outside.as_uri(), num_shards=1
    )
    # ... and a link inside the root that points at it.
    (tmp_path / "link").symlink_to(outside)
    inside = Path(spec["dataset"]["uri"].removeprefix("file://"))
    messages = {
        uri: refused(service, {**spec, "dataset": {"uri": uri}}, "dataset.uri")
        for uri in (
            "file:///",
            "file:///etc",
            "file:///etc/../etc",
            f"file://{inside}/../../{outside.parent.name}/dataset",
            outside.as_uri(),
            (tmp_path / "link").as_uri(),
            (tmp_path / "no-such-dataset").as_uri(),  # inside, but missing: the same answer
        )
    }
    for uri, message in messages.items():
        assert message == (
            f"dataset {uri} does not exist or is not under a data root this Apiary may read "
            "(APIARY_DATA_ROOTS)"
        )
    # A path that only passes through `..` inside the root is fine.
    fine = f"file://{inside}/../{inside.name}"
    assert service.submit({**spec, "dataset": {"uri": fine}})["state"] == "queued"


def check(uri: str, roots: list[str], *, timeout_s: float = 5, **bounds: int) -> None:
    """`check_dataset` of a parquet dataset without an S3 endpoint."""
    check_dataset(
        uri, roots=roots, data_format=DataFormat.PARQUET, s3_endpoint_url=None, timeout_s=timeout_s, **bounds
    )


def test_s3_roots_and_keys(tmp_path: Path) -> None:
    for uri, roots in (
        ("s3://other-bucket/data", ["s3://datasets"]),
        ("s3://datasets-2/data", ["s3://datasets"]),
        ("s3://datasets/team-b/data", ["s3://datasets/team-a"]),
        ("s3://datasets/team-a/../team-b", ["s3://datasets/team-a"]),
        ("s3://datasets/data", [str(tmp_path)]),
    ):
        with pytest.raises(DatasetError, match="is not under a data root"):
            check(uri, roots)


def test_a_listing_is_bounded_in_entries_and_depth(tmp_path: Path) -> None:
    wide = tmp_path / "wide"
    wide.mkdir()
    for index in range(30):
        (wide / f"part-{index}.parquet").write_bytes(b"")
    deep = tmp_path / "deep"
    (deep / "a" / "b" / "c" / "d").mkdir(parents=True)

    roots = [str(tmp_path)]
    with pytest.raises(DatasetError, match="holds more than 10 files and folders"):
        check(wide.as_uri(), roots, max_entries=10)
    with pytest.raises(DatasetError, match="nests folders deeper than 2 levels"):
        check(deep.as_uri(), roots, max_depth=2)
    with pytest.raises(DatasetError, match=r"has no \.parquet files"):
        check(deep.as_uri(), roots)


def test_a_slow_listing_times_out_off_the_request_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def hung(*args: Any, **kwargs: Any) -> None:
        time.sleep(2)  # a hung network filesystem

    monkeypatch.setattr(allowlists, "list_shards", hung)
    started = time.monotonic()
    with pytest.raises(DatasetError, match=r"could not be checked within 0\.3 s"):
        check(tmp_path.as_uri(), [str(tmp_path)], timeout_s=0.3)
    assert time.monotonic() - started < 1.5


def write_dataset(folder: Path) -> Path:
    write_shards(
        classification_table(num_rows=32, num_features=8, num_classes=3), folder.as_uri(), num_shards=2
    )
    return folder


def test_a_symlink_inside_a_dataset_that_leaves_the_roots_is_refused(
    service: Service, spec: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each listed file is resolved: a link (to a file or to a folder) below an allowed folder that
    points outside the roots refuses the dataset; a link that stays inside is fine."""
    outside = write_dataset(tmp_path_factory.mktemp("elsewhere") / "secret")
    shard = next(outside.glob("*.parquet"))
    by_file = write_dataset(tmp_path / "by-file")
    (by_file / "zz-extra.parquet").symlink_to(shard)
    by_folder = write_dataset(tmp_path / "by-folder")
    (by_folder / "more").symlink_to(outside)
    for folder in (by_file, by_folder):
        message = refused(service, {**spec, "dataset": {"uri": folder.as_uri()}}, "dataset.uri")
        assert "is not under a data root" in message
    within = write_dataset(tmp_path / "within")
    (within / "more").symlink_to(write_dataset(tmp_path / "other-inside"))
    assert service.submit({**spec, "dataset": {"uri": within.as_uri()}})["state"] == "queued"


def test_apiarys_own_folders_are_never_datasets_even_under_a_root(
    start_service: Any, spec: dict[str, Any], tmp_path: Path
) -> None:
    """The data dir holds Apiary's own files (the database, Ray's token, temp folder and logs, the
    handoffs with each attempt's report token): only its `datasets/` folder may hold data, whatever
    the roots say, and a handoff folder (`_apiary`) is never data, wherever storage is. The temp root
    of the system (which holds the local Ray's temp folder when the data dir's path is long) is a root
    here, as in tests/e2e."""
    service = start_service(data_roots=f"{tempfile.gettempdir()},s3://")
    data_dir = service.runtime.settings.data_dir
    ray_temp = local_ray_temp_dir(data_dir)
    try:
        places = [
            data_dir / "ray_auth_token",
            data_dir / "ray.log",
            data_dir / "logs",
            data_dir / "checkpoints" / "job-1" / "_apiary" / "attempt-1",
            ray_temp / "session_latest" / "logs",
            tmp_path / "elsewhere-storage" / "job-1" / "_apiary" / "attempt-1",
        ]
        for place in places:
            if place.suffix or place.name == "ray_auth_token":
                place.parent.mkdir(parents=True, exist_ok=True)
                place.write_bytes(b"PAR1 not really")
                uris = [place.as_uri()]
            else:
                write_dataset(place)
                uris = [place.as_uri(), next(place.glob("*.parquet")).as_uri()]
            for uri in uris:
                message = refused(service, {**spec, "dataset": {"uri": uri}}, "dataset.uri")
                assert "is not under a data root" in message, (uri, message)
        # A link from an allowed place into them is refused too.
        (tmp_path / "innocent").mkdir()
        (tmp_path / "innocent" / "token.parquet").symlink_to(data_dir / "ray_auth_token")
        refused(service, {**spec, "dataset": {"uri": (tmp_path / "innocent").as_uri()}}, "dataset.uri")
        with pytest.raises(DatasetError, match="is not under a data root"):
            check("s3://bucket/ckpt/job-1/_apiary/attempt-1/report-token", ["s3://"])
        ok = write_dataset(data_dir / "datasets" / "mine")
        assert service.submit({**spec, "dataset": {"uri": ok.as_uri()}})["state"] == "queued"
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)


def test_the_default_data_root_is_the_data_dirs_datasets_folder(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    assert settings.resolved_data_roots == (str(tmp_path / "data" / "datasets"), "s3://")


def test_what_a_ray_function_cannot_honor_is_refused_by_name(service: Service, spec: dict[str, Any]) -> None:
    """A Ray Train function (known from its module's source at submission) prepares its own model and
    chooses when to checkpoint: those fields are refused, naming the field; its defaults pass, and it
    needs no dataset, max_steps or batch_size."""
    function = {**spec, "trainer": "tests.support.custom_trainer:train", "num_workers": 1}
    for fields, field in (
        ({"strategy": "fsdp"}, "strategy"),
        ({"precision": "bf16"}, "precision"),
        ({"on_anomaly": "warn"}, "on_anomaly"),
        ({"checkpoint": {"every_steps": 5}}, "checkpoint.every_steps"),
        ({"checkpoint": {"async": True}}, "checkpoint.async"),
    ):
        message = refused(service, {**function, **fields}, field)
        assert message.startswith(f"{field}: "), message
    bare = {
        key: value for key, value in function.items() if key not in ("dataset", "max_steps", "batch_size")
    }
    assert service.submit({**bare, "checkpoint": {"keep_last": 2}})["state"] == "queued"


def manifest_dataset(folder: Path, *, age_s: float = 60) -> Path:
    """A dataset of 2 shards written with its manifest (`apiary data shard`), the manifest `age_s` old."""
    source = write_dataset(folder.parent / f"{folder.name}-source")
    shard_dataset(source.as_uri(), folder.as_uri(), num_shards=2)
    age(folder / MANIFEST_NAME, age_s)
    return folder


def age(path: Path, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(path, (when, when))


def test_a_dataset_is_listed_once_per_version_of_its_manifest_and_checked_again_when_it_changes(
    service: Service,
    spec: dict[str, Any],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listings: list[str] = []
    real = allowlists.list_shards

    def counted(uri: str, **options: Any) -> Any:
        listings.append(uri)
        return real(uri, **options)

    monkeypatch.setattr(allowlists, "list_shards", counted)
    dataset = manifest_dataset(tmp_path / "sharded")
    job = {**spec, "dataset": {"uri": dataset.as_uri()}}

    def answer() -> int:
        return service.http.post("/jobs", json=job).status_code

    assert [answer(), answer(), answer()] == [201, 201, 201]
    assert len(listings) == 1  # the manifest did not change: listed once
    shard = sorted(dataset.glob("*.parquet"))[0]
    kept = shard.read_bytes()

    # A shard gone or rewritten, the manifest as it was: refused, as a full check refuses it.
    shard.unlink()
    assert answer() == 422
    shard.write_bytes(kept + b"x")
    assert answer() == 422
    shard.write_bytes(kept)
    assert answer() == 201
    # A shard replaced by a link out of the roots (same bytes): refused.
    outside = tmp_path_factory.mktemp("elsewhere") / shard.name
    outside.write_bytes(kept)
    shard.unlink()
    shard.symlink_to(outside)
    assert "is not under a data root" in service.http.post("/jobs", json=job).json()["message"]
    shard.unlink()
    shard.write_bytes(kept)
    assert answer() == 201
    listed = len(listings)
    assert answer() == 201 and len(listings) == listed  # remembered again

    # The manifest rewritten (here: another format), even with its old mtime: listed again, refused.
    manifest = dataset / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"format": "parquet"', '"format": "webdataset"'))
    age(manifest, 60)
    refusal = service.http.post("/jobs", json=job)
    assert refusal.status_code == 422 and "says format 'webdataset'" in refusal.text, refusal.text
    assert len(listings) == listed + 1


def test_a_manifest_written_a_moment_ago_is_not_remembered(
    service: Service, spec: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A change within the same clock tick could keep the same mtime: a new manifest is listed each time.
    listings: list[str] = []
    real = allowlists.list_shards
    monkeypatch.setattr(allowlists, "list_shards", lambda uri, **kw: listings.append(uri) or real(uri, **kw))
    dataset = manifest_dataset(tmp_path / "fresh", age_s=0)
    job = {**spec, "dataset": {"uri": dataset.as_uri()}}
    assert [service.http.post("/jobs", json=job).status_code for _ in range(2)] == [201, 201]
    assert len(listings) == 2
    plain = write_dataset(tmp_path / "plain")  # no manifest: its listing is its only marker
    job = {**spec, "dataset": {"uri": plain.as_uri()}}
    assert [service.http.post("/jobs", json=job).status_code for _ in range(2)] == [201, 201]
    assert len(listings) == 4


def test_the_listing_cache_keeps_the_most_recently_used() -> None:
    cache = allowlists.ListingCache(max_entries=2)
    listing = allowlists._Listing(marker=(1,), files=("a",), sizes=None)
    for key in ("x", "y"):
        cache.put((key, "parquet", None), listing)
    assert cache.get(("x", "parquet", None), (1,)) is listing  # x used: y is the oldest
    cache.put(("z", "parquet", None), listing)
    assert cache.get(("y", "parquet", None), (1,)) is None
    assert cache.get(("x", "parquet", None), (1,)) is listing
    assert cache.get(("x", "parquet", None), (2,)) is None  # another marker: not this listing
