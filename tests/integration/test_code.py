"""A job's own code through the API (service.code, api.routes.code): uploaded once per content, named by
the spec, checked at submission from its source (never imported), handed to Ray as the job's
working_dir, and given back to its owner or an admin. Refusals: over the limit (413, client and
server), a trainer the code lacks (422), code that shadows Apiary (422), uploads off (403)."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import ApiaryClient, ApiaryInvalid, ApiaryTooLarge
from service.contract.code import pack
from service.contract.errors import CodeTooLarge
from service.contract.storage import resolve_uri
from tests.conftest import S3
from tests.integration.conftest import Service

TRAIN = "import ray.train\n\n\ndef train(config):\n    ray.train.report({'loss': 1.0})\n"


@pytest.fixture
def spec(classification_dataset: str) -> dict[str, Any]:
    return {
        "name": "code-test",
        "trainer": "labcode.train:train",
        "num_workers": 1,
        "dataset": {"uri": classification_dataset},
        "max_steps": 10,
        "batch_size": 8,
    }


def folder(root: Path, files: dict[str, str] | None = None) -> Path:
    for name, text in (files or {"labcode/__init__.py": "", "labcode/train.py": TRAIN}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def put(http: httpx.Client, data: bytes, sha256: str | None = None) -> httpx.Response:
    path = f"/code/{sha256 or hashlib.sha256(data).hexdigest()}"
    return http.put(path, content=data, headers={"Content-Type": "application/octet-stream"})


def test_a_job_runs_a_trainer_from_its_own_code_which_is_stored_once(
    service: Service, spec: dict[str, Any], tmp_path: Path
) -> None:
    code = folder(tmp_path / "code")
    with ApiaryClient(str(service.http.base_url)) as client:
        job = client.submit(spec, code=code)  # labcode is not in APIARY_TRAINER_MODULES: it need not be
        again = client.submit({**spec, "name": "again"}, code=code)
        digest = pack(code).digest
        assert job.spec.code == again.spec.code == digest
        assert any(
            event.reason.startswith(f"code {digest} (2 files, ") and event.actor == "ada"
            for event in client.events(job.id)
        )
        stored = list((service.runtime.settings.data_dir / "checkpoints" / "_code").iterdir())
        assert [path.name for path in stored] == [f"{digest.removeprefix('sha256:')}.zip"]
        assert client.code(job.id) == pack(code).data
    # The job page shows the package and links to it.
    page = service.http.get(f"/jobs/{job.id}", headers={"Accept": "text/html"}).text
    assert f'<a href="/jobs/{job.id}/code" download><code>{digest}</code></a>' in page
    service.tick()
    # Ray gets the stored package as the job's working_dir (its client uploads it to the cluster).
    assert service.backend.working_dir == str(stored[0])
    assert service.backend.py_modules  # Apiary's own packages still go first


def test_an_upload_answers_what_a_spec_names_and_a_repeat_stores_nothing_new(
    service: Service, tmp_path: Path
) -> None:
    package = pack(folder(tmp_path / "code"))
    first = put(service.http, package.data)
    assert first.status_code == 201, first.text
    assert first.json() | {"created_at": None} == {
        "digest": package.digest,
        "owner": "ada",
        "files": 2,
        "size_bytes": package.size_bytes,
        "created_at": None,
    }
    assert put(service.http, package.data).status_code == 200
    cut = put(service.http, package.data[:-10], sha256=package.sha256)
    assert cut.status_code == 422 and "not " + package.sha256 in cut.json()["message"], cut.text
    assert put(service.http, b"not a zip").status_code == 422


@pytest.mark.parametrize(
    ("trainer", "files", "said"),
    [
        ("labcode.missing:train", None, "no module 'labcode.missing'"),
        ("labcode.train:fit", None, "labcode/train.py in the job's code defines no 'fit'"),
        ("labcode.train:train", {"labcode/train.py": "def train(:\n"}, "does not parse: line 1"),
        ("elsewhere.train:train", None, "is not allowed here"),  # not in the code: the allowlist
    ],
)
def test_a_trainer_the_code_cannot_provide_is_refused_at_submission(
    service: Service,
    spec: dict[str, Any],
    tmp_path: Path,
    trainer: str,
    files: dict[str, str] | None,
    said: str,
) -> None:
    code = folder(tmp_path / "code", files)
    with ApiaryClient(str(service.http.base_url)) as client, pytest.raises(ApiaryInvalid) as refused:
        client.submit({**spec, "trainer": trainer}, code=code)
    assert refused.value.status_code == 422 and refused.value.field == "trainer"
    assert said in refused.value.message, refused.value.message
    assert service.count() == 0


@pytest.mark.parametrize(
    "shadow", ["trainers/__init__.py", "service/jobs.py", "api.py", "apiary/__init__.py"]
)
def test_code_that_would_shadow_apiary_is_refused(
    service: Service, spec: dict[str, Any], tmp_path: Path, shadow: str
) -> None:
    code = folder(tmp_path / "code", {"labcode/__init__.py": "", "labcode/train.py": TRAIN, shadow: ""})
    with ApiaryClient(str(service.http.base_url)) as client, pytest.raises(ApiaryInvalid) as refused:
        client.submit(spec, code=code)
    assert refused.value.status_code == 422 and refused.value.field == "code"
    top = shadow.split("/")[0].removesuffix(".py")
    assert f"`{top}`" in refused.value.message and "Apiary's own" in refused.value.message
    assert service.count() == 0


def test_a_folder_over_the_limit_is_refused_by_the_client_and_by_the_server(
    start_service: Callable[..., Service], spec: dict[str, Any], tmp_path: Path
) -> None:
    service = start_service(code_max_bytes=64 * 1024)
    code = folder(tmp_path / "code")
    (code / "weights.bin").write_bytes(b"\0" * (100 * 1024))
    with ApiaryClient(str(service.http.base_url)) as client:
        with pytest.raises(CodeTooLarge, match=r"weights\.bin 0\.1 MiB"):
            client.submit(spec, code=code, max_code_bytes=64 * 1024)
        # A client with a larger limit than the server's: the server refuses it, naming its setting.
        with pytest.raises(ApiaryTooLarge) as refused:
            client.submit(spec, code=code)
    assert refused.value.status_code == 413 and "APIARY_CODE_MAX_BYTES" in refused.value.message
    # Declared too large (Content-Length), or only found so as it arrives: refused either way.
    random_bytes = io.BytesIO()
    with zipfile.ZipFile(random_bytes, "w") as archive:
        archive.writestr("noise.bin", bytes(range(256)) * 4096 * 16)
    huge = put(service.http, random_bytes.getvalue())
    assert huge.status_code == 413 and "APIARY_CODE_MAX_BYTES" in huge.json()["message"]
    assert service.count() == 0


def test_code_upload_off_is_a_403_naming_the_setting(
    start_service: Callable[..., Service], spec: dict[str, Any], tmp_path: Path
) -> None:
    service = start_service(code_upload=False)
    package = pack(folder(tmp_path / "code"))
    refused = put(service.http, package.data)
    assert refused.status_code == 403 and "APIARY_CODE_UPLOAD" in refused.json()["message"]
    named = service.http.post("/jobs", json={**spec, "code": package.digest})
    assert named.status_code == 403 and "APIARY_CODE_UPLOAD" in named.json()["message"]
    assert service.count() == 0


def test_the_code_is_its_owners_and_an_admins_to_read_and_only_its_uploader_may_name_it(
    service: Service, spec: dict[str, Any], tmp_path: Path
) -> None:
    tokens = {name: service.token(name, admin=name == "root") for name in ("ada", "bob", "root")}
    ada, bob, root = (service.as_user(tokens[name]) for name in ("ada", "bob", "root"))
    package = pack(folder(tmp_path / "code"))
    assert put(ada, package.data).status_code == 201
    job = ada.post("/jobs", json={**spec, "code": package.digest}).json()
    # bob saw the digest on ada's job page: he may not run (or so read) her code with it.
    stolen = bob.post("/jobs", json={**spec, "code": package.digest})
    assert stolen.status_code == 422 and "not a code package you uploaded" in stolen.json()["message"]
    assert bob.get(f"/jobs/{job['id']}/code").status_code == 403
    for reader in (ada, root):
        got = reader.get(f"/jobs/{job['id']}/code")
        assert got.status_code == 200 and got.content == package.data
        assert got.headers["x-apiary-code"] == package.digest
        assert got.headers["content-type"] == "application/zip"
    plain = ada.post("/jobs", json={**spec, "trainer": "mlp", "config": {"num_classes": 3}}).json()
    assert ada.get(f"/jobs/{plain['id']}/code").status_code == 404
    # Uploaded by bob too, the same bytes: his own now, stored once.
    assert put(bob, package.data).status_code == 201
    assert bob.post("/jobs", json={**spec, "code": package.digest}).status_code == 201


def test_on_s3_storage_the_package_is_stored_once_and_each_replica_fetches_it_once(
    start_service: Callable[..., Service], spec: dict[str, Any], s3: S3, tmp_path: Path
) -> None:
    service = start_service(storage_uri=s3.checkpoints_uri, s3_endpoint_url=s3.endpoint_url)
    package = pack(folder(tmp_path / "code"))
    assert put(service.http, package.data).status_code == 201
    stored = f"{s3.checkpoints_uri}/_code/{package.sha256}.zip"
    path, filesystem = resolve_uri(stored, s3_endpoint_url=s3.endpoint_url)
    with filesystem.open_input_stream(path) as stream:
        assert stream.read() == package.data
    job = service.submit({**spec, "code": package.digest})
    cache = service.runtime.settings.data_dir / "code-cache"
    assert sorted(p.name for p in cache.iterdir()) == [f"{package.sha256}.zip"]  # the upload, kept
    (cache / f"{package.sha256}.zip").unlink()  # as on a replica that did not take the upload
    service.tick()
    assert service.backend.working_dir == str(cache / f"{package.sha256}.zip")
    assert Path(service.backend.working_dir).read_bytes() == package.data
    assert service.http.get(f"/jobs/{job['id']}/code").content == package.data
