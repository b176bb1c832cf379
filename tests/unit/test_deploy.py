"""The deployment files, checked where Docker and Kubernetes cannot run: docker-compose.yml against the
Compose Specification's JSON schema (vendored: tests/support/compose-spec.json, from
github.com/compose-spec/compose-spec, schema/compose-spec.json), every APIARY_* variable they set is
one that Settings reads, every command they run exists in the image and parses, no password is written
in them, and Ray's dashboard stays inside the compose network."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
import yaml
from pydantic import AliasChoices
from sqlalchemy.engine import make_url

from api.cli import app
from service.contract.spec import JobSpec, is_spot_node, parse_spec_text
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
KUBERAY = [
    document
    for name in ("raycluster.yaml", "apiary.yaml")
    for document in yaml.safe_load_all((ROOT / "deploy" / "kuberay" / name).read_text())
]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
APIARY_IMAGE = SERVICES["api"]["image"]
# One-shot services: they run to completion (the API waits for service_completed_successfully).
ONE_SHOT = {"buckets", "migrate"}


def _settings_variables() -> set[str]:
    names = set()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {str(choice) for choice in alias.choices}
        else:
            names.add(str(alias) if alias else f"APIARY_{name.upper()}")
    return names


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} as its default, any other ${VAR...} as a placeholder."""
    value = re.sub(r"\$\{[A-Z_0-9]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{[^}]*\}", "placeholder", value)


def _compose_environments() -> Iterator[tuple[str, str, str]]:
    for service, body in SERVICES.items():
        for key, value in (body.get("environment") or {}).items():
            yield service, key, str(value)


def _kubernetes_containers() -> Iterator[dict[str, Any]]:
    for document in KUBERAY:
        if document["kind"] == "RayCluster":
            spec = document["spec"]
            for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
                yield from group["template"]["spec"]["containers"]
        elif document["kind"] in ("Deployment", "Job"):
            yield from document["spec"]["template"]["spec"]["containers"]


def _kubernetes_environments() -> Iterator[tuple[str, str, Any]]:
    for container in _kubernetes_containers():
        for entry in container.get("env", []):
            yield container["name"], entry["name"], entry.get("value", entry.get("valueFrom"))


def _image_commands() -> Iterator[list[str]]:
    """Every command line the Apiary image runs: compose (shell strings split), Kubernetes, the CMD."""
    for body in SERVICES.values():
        if body.get("image") != APIARY_IMAGE or "command" not in body:
            continue
        command = body["command"]
        if body.get("entrypoint") == ["/bin/sh", "-c"]:
            yield from (shlex.split(_interpolate(line)) for line in command)
        else:
            yield [_interpolate(part) for part in command]
    for container in _kubernetes_containers():
        if "command" in container:
            yield container["command"]
    cmd = re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.MULTILINE)
    assert cmd is not None, "the Dockerfile has an exec-form CMD"
    yield json.loads(cmd.group(1))


def _parse(command: Any, args: list[str]) -> None:
    """Walks the groups, then parses the leaf's options as the command would (nothing runs). Duck-typed:
    typer carries its own copy of click, Ray uses click itself."""
    while hasattr(command, "commands") and args and args[0] in command.commands:
        command, args = command.commands[args[0]], args[1:]
    assert not hasattr(command, "commands"), f"{args} names no command"
    command.make_context(command.name or "", list(args))


def test_compose_file_follows_the_compose_specification() -> None:
    schema = json.loads((ROOT / "tests" / "support" / "compose-spec.json").read_text())
    jsonschema.validate(COMPOSE, schema)
    # The schema itself would accept a typo of a known service's field as an x- extension only.
    broken = {**COMPOSE, "services": {**SERVICES, "api": {**SERVICES["api"], "helthcheck": {}}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_the_stack_has_its_parts() -> None:
    assert {"postgres", "minio", "buckets", "migrate", "ray-head", "ray-worker", "api", "prometheus"} <= set(
        SERVICES
    )
    assert SERVICES["ray-worker"]["deploy"]["replicas"] == 2
    assert SERVICES["ray-head"]["image"] == SERVICES["ray-worker"]["image"] == APIARY_IMAGE
    assert "mc mb --ignore-existing local/datasets local/checkpoints" in " ".join(
        SERVICES["buckets"]["command"]
    )
    assert SERVICES["migrate"]["command"] == ["apiary", "db", "upgrade"]
    assert SERVICES["api"]["environment"]["APIARY_MIGRATE_ON_START"] == "false"
    prometheus = yaml.safe_load((ROOT / COMPOSE["configs"]["prometheus"]["file"]).read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["api:8000"]


def test_every_service_is_health_checked_restarted_and_waited_for() -> None:
    for name, body in SERVICES.items():
        assert "restart" in body, f"{name} has no restart policy"
        if name in ONE_SHOT:
            assert body["restart"] == "on-failure", name
            continue
        assert body["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
        for dependency, condition in (body.get("depends_on") or {}).items():
            expected = "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            assert condition == {"condition": expected}, f"{name} -> {dependency}"
    assert set(SERVICES["api"]["depends_on"]) == {"migrate", "buckets", "ray-head", "ray-worker"}


def test_every_apiary_variable_set_is_one_that_settings_reads() -> None:
    known = _settings_variables()
    assert "APIARY_RAY_AUTH_TOKEN" in known and "APIARY_LOG_FORMAT" in known
    set_here = [(where, key) for where, key, _ in [*_compose_environments(), *_kubernetes_environments()]]
    unknown = [(where, key) for where, key in set_here if key.startswith("APIARY_") and key not in known]
    assert unknown == []
    assert len([key for _, key in set_here if key.startswith("APIARY_")]) >= 15
    # And each value is one Settings accepts (placeholders for the values .env gives).
    for _, key, value in _compose_environments():
        if key.startswith("APIARY_"):
            Settings.model_validate({key.removeprefix("APIARY_").lower(): _interpolate(value)})
    with pytest.raises(ValueError, match="log_format"):
        Settings.model_validate({"log_format": "xml"})


def test_the_images_commands_exist_and_parse() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["apiary"] == "api.cli:main"
    ray_cli = pytest.importorskip("ray.scripts.scripts").cli
    commands = list(_image_commands())
    assert ["apiary", "db", "upgrade"] in commands and ["apiary", "serve"] in commands
    for command in commands:
        if command[0] == "apiary":
            _parse(typer.main.get_command(app), command[1:])
        elif command[0] == "ray":
            _parse(ray_cli, command[1:])
        else:
            pytest.fail(f"the image does not provide {command[0]!r}")
    for body in SERVICES.values():  # the Python health checks compile
        test = body.get("healthcheck", {}).get("test", [])
        if test[1:3] == ["python", "-c"]:
            compile(test[3], "healthcheck", "exec")
    with pytest.raises(Exception, match="No such option: --no-such-flag"):
        _parse(typer.main.get_command(app), ["serve", "--no-such-flag"])
    with pytest.raises(Exception, match=r"No such option.*--dashboard-hots"):
        _parse(ray_cli, ["start", "--head", "--dashboard-hots=0.0.0.0"])
    with pytest.raises(AssertionError, match="names no command"):
        _parse(typer.main.get_command(app), ["db"])


def test_the_dockerfile_builds_torch_from_the_pinned_cpu_wheel_by_default() -> None:
    assert len(re.findall(r"^FROM ", DOCKERFILE, re.MULTILINE)) >= 2, "multi-stage"
    pin = next(
        dep for dep in PYPROJECT["project"]["optional-dependencies"]["cluster"] if dep.startswith("torch==")
    )
    assert f"ARG TORCH_VERSION={pin.removeprefix('torch==')}" in DOCKERFILE
    assert "ARG TORCH_VARIANT=cpu" in DOCKERFILE
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}" in DOCKERFILE
    # One image for the API and the Ray nodes: both extras (api/extras.py), unless built API-only.
    assert "ARG APIARY_EXTRAS=server,cluster" in DOCKERFILE
    assert 'RUN pip install ".[${APIARY_EXTRAS}]"' in DOCKERFILE
    for package in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        folder = package.rstrip("*")
        assert f"COPY {folder} ./{folder}" in DOCKERFILE
        assert f"!{folder}/" in (ROOT / ".dockerignore").read_text()


def test_no_password_is_written_in_the_compose_file() -> None:
    secret = re.compile(r"PASSWORD|SECRET|TOKEN")
    for service, key, value in _compose_environments():
        if secret.search(key):
            assert re.fullmatch(r"\$\{[A-Z_0-9]+(:\?[^}]*)?\}", value), f"{service}: {key} is written out"
        if key == "APIARY_DATABASE_URL":
            assert str(make_url(value).password).startswith("${"), f"{service}: the database password"
    example = dict(
        line.split("=", 1)
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line and line[0] != "#"
    )
    required = set(re.findall(r"\$\{([A-Z_0-9]+):\?", (ROOT / "docker-compose.yml").read_text()))
    assert required <= set(example), "every required variable is in .env.example"
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


def test_ray_runs_with_token_auth_and_its_dashboard_is_not_published() -> None:
    for name in ("ray-head", "ray-worker"):
        environment = SERVICES[name]["environment"]
        assert environment["RAY_AUTH_MODE"] == "token"
        assert environment["RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN")
        assert "ports" not in SERVICES[name]
    assert SERVICES["api"]["environment"]["APIARY_RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN")
    for name, body in SERVICES.items():
        for port in body.get("ports", []):
            assert not re.search(r"\b(8265|6380|6379)\b", str(port)), f"{name} publishes {port}"
            if name != "api":
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this host"


def test_kuberay_example_uses_the_same_settings_and_token() -> None:
    kinds = [document["kind"] for document in KUBERAY]
    assert kinds == ["RayCluster", "Job", "Deployment", "Service"]
    environments: dict[str, dict[str, Any]] = {}
    for container, key, value in _kubernetes_environments():
        environments.setdefault(container, {})[key] = value
    for container in ("ray-head", "ray-worker"):
        assert environments[container]["RAY_AUTH_MODE"] == "token"
        assert environments[container]["RAY_AUTH_TOKEN"] == {
            "secretKeyRef": {"name": "apiary", "key": "ray-auth-token"}
        }
    api = environments["api"]
    assert api["APIARY_RAY_AUTH_TOKEN"] == environments["ray-head"]["RAY_AUTH_TOKEN"]
    assert api["APIARY_RAY_ADDRESS"] == "http://apiary-head-svc:8265"  # KubeRay's name for the head
    assert api["APIARY_MIGRATE_ON_START"] == "false"


def test_kuberay_example_labels_its_spot_group_as_apiary_reads_it() -> None:
    """`rayStartParams.labels` becomes `ray start --labels spot=true` (key=value pairs, comma-separated)."""
    (cluster,) = [document for document in KUBERAY if document["kind"] == "RayCluster"]
    spot = {}
    for group in cluster["spec"]["workerGroupSpecs"]:
        pairs = group["rayStartParams"].get("labels", "")
        labels = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
        spot[group["groupName"]] = is_spot_node(labels, {"CPU": 8})
    assert spot == {"cpu": False, "cpu-spot": True}


def test_settings_read_docker_secret_files_under_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "apiary_ray_auth_token").write_text("from-a-secret")
    (tmp_path / "apiary_database_url").write_text("postgresql+psycopg://apiary:pw@db/apiary")
    settings = Settings(_secrets_dir=tmp_path)  # type: ignore[call-arg]
    assert settings.ray_auth_token is not None
    assert settings.ray_auth_token.get_secret_value() == "from-a-secret"
    assert settings.database_url == "postgresql+psycopg://apiary:pw@db/apiary"
    monkeypatch.setenv("APIARY_RAY_AUTH_TOKEN", "from-the-environment")
    settings = Settings(_secrets_dir=tmp_path)  # type: ignore[call-arg]
    assert settings.ray_auth_token is not None
    assert settings.ray_auth_token.get_secret_value() == "from-the-environment"


def test_the_deploy_docs_first_cluster_job_is_a_valid_spec_and_its_commands_parse() -> None:
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    section = deploy[deploy.index("## Run on a cluster") :]
    spec_text = section.split("cat > job.yaml <<'YAML'\n", 1)[1].split("YAML\n", 1)[0]
    spec = JobSpec.model_validate(parse_spec_text(spec_text))
    assert spec.dataset.uri == "s3://datasets/demo-tokens"  # the bucket compose creates
    lines = [line.split("#")[0].strip() for line in section.split("```")[1].splitlines()]
    apiary_lines = [shlex.split(line) for line in lines if "apiary " in line and "python -c" not in line]
    assert len(apiary_lines) == 2
    for words in apiary_lines:
        start = next(i for i, word in enumerate(words) if word.endswith("apiary"))
        _parse(typer.main.get_command(app), words[start + 1 :])
