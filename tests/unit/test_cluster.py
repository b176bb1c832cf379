from __future__ import annotations

from pathlib import Path

from service.cluster import ERROR_PREFIX, _short_temp_dir, failure_reason


def test_the_trainers_last_error_line_wins() -> None:
    logs = "\n".join(
        [
            f"{ERROR_PREFIX} first",
            "Traceback (most recent call last):",
            "ValueError: boom",
            f"{ERROR_PREFIX} real",
        ]
    )
    assert failure_reason(logs, "ray says") == "real"


def test_without_an_error_line_the_last_exception_then_rays_message() -> None:
    assert (
        failure_reason("noise\nRuntimeError: worker died\nmore noise\n", "ray says")
        == "RuntimeError: worker died"
    )
    assert failure_reason("just noise\n", "ray says") == "ray says"
    assert failure_reason("", "") == "the Ray job failed without a message"


def test_ray_temp_dir_stays_short_enough_for_unix_sockets(tmp_path: Path) -> None:
    assert _short_temp_dir(Path("/srv/apiary")) == Path("/srv/apiary/ray")
    deep = tmp_path / ("x" * 80)
    short = _short_temp_dir(deep)
    assert len(str(short)) < 40 and short == _short_temp_dir(deep)  # stable, so a restart finds it
