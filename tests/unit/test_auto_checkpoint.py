"""checkpoint: {auto: true}: the cadence the trainers choose from a measured save and the MTBF."""

from __future__ import annotations

import pytest

from service.contract.spec import CheckpointSpec
from trainers.checkpoint import auto_cadence


def test_auto_takes_dalys_optimum_and_says_why() -> None:
    # save 42 s, MTBF 24 h = 86,400 s: Daly 2,666.066 s (tests/unit/test_planner.py works it out),
    # Young sqrt(2 x 42 x 86,400) = 2,693.99 s
    cadence = auto_cadence(
        save_s=42.0, mtbf_s=86_400, mtbf_basis="observed: 2 failure(s) in 48.0 job-hours", async_=True
    )
    assert cadence.interval_s == pytest.approx(2666.066, rel=1e-6)
    assert cadence.reason == (
        "checkpoint every 2666.1 s: Daly's optimum for a 42.00 s save and an MTBF of 24.0 h "
        "(observed: 2 failure(s) in 48.0 job-hours); Young's sqrt(2 x save x MTBF) is 2694.0 s"
    )


def test_an_async_save_is_never_due_before_the_last_one_is_written() -> None:
    # save 50 s, MTBF 60 s: Daly: d/2M = 0.41667, sqrt = 0.6455; sqrt(6,000) = 77.46;
    # 77.46 x (1 + 0.21517 + 0.046296) - 50 = 77.46 x 1.26146 - 50 = 47.71 s: under the 50 s write
    cadence = auto_cadence(save_s=50.0, mtbf_s=60.0, mtbf_basis="observed", async_=True)
    assert cadence.interval_s == 50.0 and "one async write at a time" in cadence.reason
    synchronous = auto_cadence(save_s=50.0, mtbf_s=60.0, mtbf_basis="observed", async_=False)
    assert synchronous.interval_s == pytest.approx(47.71, abs=0.01)


def test_auto_replaces_every_s() -> None:
    assert CheckpointSpec.model_validate({"auto": True, "every_steps": 100}).auto
    with pytest.raises(ValueError, match="every_s or auto"):
        CheckpointSpec.model_validate({"auto": True, "every_s": 60})
