"""Queue configuration (`service.contract.queues`): defaults, a file over them, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from service.contract.errors import InvalidSpec
from service.contract.queues import DEFAULT_QUEUES, load
from service.contract.spec import Queue


def test_defaults_split_the_cluster_three_to_seven() -> None:
    assert load(None) is DEFAULT_QUEUES
    assert DEFAULT_QUEUES.of(Queue.RESEARCH).share_of("GPU") == 0.3
    assert DEFAULT_QUEUES.of("full-scale").share_of("CPU") == 0.7
    assert DEFAULT_QUEUES.research.default_max_runtime_s == 3600


def test_a_file_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(
        "research:\n  share: {CPU: 0.2, GPU: 0.25}\n  min_runtime_s: 60\nfull-scale:\n  share: 0.75\n"
    )
    queues = load(path)
    assert queues.research.share_of("GPU") == 0.25 and queues.research.share_of("TPU") == 0.0
    assert queues.research.min_runtime_s == 60
    assert queues.research.max_workers_per_job == DEFAULT_QUEUES.research.max_workers_per_job
    assert queues.full_scale.share_of("GPU") == 0.75


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("research: {share: 0.6}\n", "add up to 1.3, more than 1"),
        ("research: {share: 1.5}\n", "share must be a fraction"),
        ("research: {default_max_runtime_s: 99999}\n", "default_max_runtime_s must not exceed max_runtime_s"),
        ("research: {bogus: 1}\n", "research.bogus: Extra inputs are not permitted"),
        ("- a list\n", "must be a mapping"),
        ("research: [\n", "queues file"),
    ],
)
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(text)
    with pytest.raises(InvalidSpec, match=message):
        load(path)


def test_the_service_does_not_start_on_a_bad_queues_file(tmp_path: Path) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text("research: {share: 2}\n")
    result = CliRunner().invoke(app, ["serve"], env={"APIARY_QUEUES_FILE": str(path)})
    assert result.exit_code == 2
    assert "bad configuration: queues file" in result.output and "share must be a fraction" in result.output
    assert "Traceback" not in result.output
