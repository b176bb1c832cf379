"""No secret of a real run in any log or file under the data dir, and every file there its owner's alone.

A real `apiary serve` (its own local Ray, auth on) trains a short job that reads its dataset from S3
(moto on loopback) and checkpoints there, with S3 credentials and an API token of this test's own.
Then every file under the data dir and the local Ray's temp folder (Ray's logs among them) is read:
none holds the AWS secret key, the session token, the API token or the attempt's report token, and
each file is 0600 (or tighter), the folders that hold them 0700. Ray's token lives in its one file.
No process but the service's own holds the secret key in its command line or environment.
"""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
from pathlib import Path

import boto3
import pytest

from api.client import ApiaryClient
from api.demo import classification_table, write_shards
from tests.conftest import S3, S3_ENV
from tests.e2e.conftest import apiary_bin, mlp_spec, serving
from tests.support.processes import processes_holding

pytestmark = [pytest.mark.timeout(900)]


def test_no_secret_of_a_real_run_is_written_under_the_data_dir(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aws = {
        **S3_ENV,
        "AWS_SECRET_ACCESS_KEY": f"aws-secret-{secrets.token_hex(12)}",
        "AWS_SESSION_TOKEN": f"aws-session-{secrets.token_hex(12)}",
    }
    for key, value in aws.items():
        monkeypatch.setenv(key, value)  # moto takes any credentials
    dataset = f"{s3.datasets_uri}/clf"
    write_shards(
        classification_table(num_rows=256, num_features=8, num_classes=3),
        dataset,
        num_shards=2,
        s3_endpoint_url=s3.endpoint_url,
    )
    env = {
        **aws,
        "APIARY_S3_ENDPOINT_URL": s3.endpoint_url,
        "APIARY_STORAGE_URI": s3.checkpoints_uri,
        "APIARY_AUTH_REQUIRED": "true",
    }
    with serving(tmp_path, env=env, timeout_s=300) as served:
        api_token = subprocess.run(
            [apiary_bin(), "token", "create", "e2e", "--admin"],
            env={**os.environ, **env, "APIARY_DATABASE_URL": served.database_url},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        with ApiaryClient(served.url, token=api_token) as client:
            spec = mlp_spec(dataset, name="secrets", num_workers=1, max_steps=6)
            spec["checkpoint"] = {"every_steps": 3}
            job = client.wait(client.submit(spec).id, timeout_s=300)
            assert job.state == "succeeded", job
            # The local Ray's processes (its raylet, the job's idle workers) inherit no credential: the
            # driver redeemed them for its fetch token, and kept them in memory.
            held = processes_holding(aws["AWS_SECRET_ACCESS_KEY"], besides={os.getpid(), served.process.pid})
            assert held == [], held
            assert job.latest_checkpoint is not None and job.latest_checkpoint.startswith(s3.checkpoints_uri)
        ray_temp = Path(served.ray_state()["temp_dir"])
        ray_token = Path(served.ray_state()["auth_token_path"]).read_text().strip()
    bucket, _, prefix = s3.checkpoints_uri.removeprefix("s3://").partition("/")
    report_token = (
        boto3.client("s3", endpoint_url=s3.endpoint_url)
        .get_object(Bucket=bucket, Key=f"{prefix}/job-{job.id}/_apiary/attempt-1/report-token")["Body"]
        .read()
        .decode()
    )
    wanted = {
        "the AWS secret key": aws["AWS_SECRET_ACCESS_KEY"],
        "the AWS session token": aws["AWS_SESSION_TOKEN"],
        "the API token": api_token,
        "the report token": report_token,
        "Ray's token": ray_token,
    }
    assert all(len(value) >= 20 for value in wanted.values()), wanted

    found: list[str] = []
    loose: list[str] = []
    files = 0
    # Ray makes its own folders 0777 (for several users of one machine), and unpacks the code it ships
    # to jobs with the package's modes: the folder that holds them is Apiary's, 0700, and so is the
    # data dir; every other file is 0600.
    for top in {served.data_dir, ray_temp.parent}:
        assert stat.S_IMODE(top.stat().st_mode) == 0o700, top
    for top in {served.data_dir, ray_temp}:
        assert top.is_dir(), top
        for folder, dirs, names in os.walk(top):
            for name in [os.path.join(folder, n) for n in names + dirs]:
                mode = os.lstat(name).st_mode
                in_ray = Path(name).is_relative_to(ray_temp)
                # Code Ray unpacks for jobs (runtime_env py_modules) keeps its package's modes.
                unpacked = in_ray and "runtime_resources" in Path(name).relative_to(ray_temp).parts
                if stat.S_ISLNK(mode) or stat.S_ISSOCK(mode) or (stat.S_ISDIR(mode) and in_ray) or unpacked:
                    continue
                if mode & 0o077:
                    loose.append(f"{name} {stat.filemode(mode)}")
            for name in names:
                path = Path(folder, name)
                if not path.is_file() or path.is_symlink():
                    continue
                files += 1
                content = path.read_bytes()
                for what, value in wanted.items():
                    own_file = what == "Ray's token" and path == served.data_dir / "ray_auth_token"
                    if value.encode() in content and not own_file:
                        found.append(f"{what} in {path}")
    assert files > 20  # Ray's logs were read
    assert found == []
    assert loose == [], "\n".join(loose)
