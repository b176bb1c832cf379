"""Bad numerics (`trainers.anomaly`): the detector of one rank, and the ranks' agreement on a step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.contract.spec import AnomalySpec
from trainers.anomaly import Anomaly, AnomalyDetector, decide, encode
from trainers.telemetry import Telemetry


def feed(detector: AnomalyDetector, norms: list[float], *, first_step: int = 1) -> list[Anomaly]:
    """Judge and (when normal) apply one step per norm, as the loop does; the anomalies seen."""
    seen = []
    for step, norm in enumerate(norms, start=first_step):
        anomaly = detector.check(step=step, loss=1.0, grad_norm=norm)
        if anomaly is None:
            detector.accept(step=step, grad_norm=norm)
        else:
            seen.append(anomaly)
    return seen


def test_nan_and_inf_are_anomalies_from_the_first_step() -> None:
    detector = AnomalyDetector(zscore=6, window=50, min_steps=20, rank=1)
    nan = detector.check(step=1, loss=math.nan, grad_norm=1.0)
    assert nan == Anomaly(kind="nan", metric="loss", step=1, rank=1, value=nan.value if nan else 0.0)
    assert nan is not None and nan.describe() == "loss is NaN at step 1 on rank 1"
    inf = detector.check(step=1, loss=0.5, grad_norm=math.inf)
    assert inf is not None and (inf.kind, inf.metric) == ("inf", "grad_norm")
    assert inf.describe() == "grad_norm is inf at step 1 on rank 1"
    negative = detector.check(step=1, loss=-math.inf, grad_norm=1.0)
    assert negative is not None and negative.describe() == "loss is -inf at step 1 on rank 1"
    # JSON has no NaN: the event carries it as text.
    assert nan.event_data() == {"anomaly": "nan", "metric": "loss", "value": "NaN"}
    Telemetry(url=None, attempt=1, rank=1).event(
        "anomaly", step=1, message=nan.describe(), **nan.event_data()
    )
    assert detector.check(step=1, loss=0.5, grad_norm=1.0) is None


def test_a_gradient_norm_spike_is_found_by_its_zscore() -> None:
    rng = np.random.default_rng(0)
    detector = AnomalyDetector(zscore=6, window=50, min_steps=20)
    normal = list(1.0 + 0.05 * rng.standard_normal(60))
    assert feed(detector, normal) == []
    spike = detector.check(step=61, loss=1.0, grad_norm=2.5)
    assert spike is not None and spike.kind == "spike" and spike.metric == "grad_norm"
    assert spike.zscore is not None and spike.zscore > 6
    assert spike.describe().startswith("grad_norm spiked to 2.5 (z-score ")
    assert spike.event_data()["value"] == 2.5 and "zscore" in spike.event_data()
    # A rise well within the noise is not one, nor is a drop of any size.
    assert detector.check(step=61, loss=1.0, grad_norm=1.1) is None
    assert detector.check(step=61, loss=1.0, grad_norm=0.01) is None


def test_no_false_alarm_on_a_noisy_but_normal_training_curve() -> None:
    # Gradient norms of a real run: decaying, noisy (10% lognormal), with a slow drift.
    rng = np.random.default_rng(7)
    steps = np.arange(1, 2001)
    norms = (2.0 * np.exp(-steps / 500) + 0.3) * rng.lognormal(0.0, 0.1, size=steps.size)
    detector = AnomalyDetector.from_spec(AnomalySpec(), rank=0)
    assert feed(detector, list(norms)) == []


def test_spikes_are_looked_for_only_after_min_steps() -> None:
    detector = AnomalyDetector(zscore=6, window=50, min_steps=20)
    assert feed(detector, [1.0, 1.01, 0.99] * 6 + [1.0]) == []  # 19 steps
    assert detector.zscore(100.0) is None
    assert detector.check(step=20, loss=1.0, grad_norm=100.0) is None
    detector.accept(step=20, grad_norm=1.0)
    assert detector.check(step=21, loss=1.0, grad_norm=100.0) is not None


def test_a_constant_history_does_not_make_a_small_rise_a_spike() -> None:
    detector = AnomalyDetector(zscore=6, window=10, min_steps=5)
    feed(detector, [1.0] * 10)
    assert detector.check(step=11, loss=1.0, grad_norm=1.05) is None  # std floored at 1% of the mean
    assert detector.check(step=11, loss=1.0, grad_norm=2.0) is not None


def test_a_converged_runs_jitter_is_not_a_spike_however_high_its_zscore() -> None:
    # Tiny gradient norms with tinier noise: a 30% rise is a z-score of ~15, and harmless.
    detector = AnomalyDetector(zscore=6, window=50, min_steps=20)
    feed(detector, [0.005 + 0.0001 * (step % 3) for step in range(50)])
    assert (detector.zscore(0.0065) or 0) > 6
    assert detector.check(step=51, loss=0.01, grad_norm=0.0065) is None
    assert detector.check(step=51, loss=0.01, grad_norm=0.012) is not None


def test_judging_a_step_again_forgets_the_steps_after_it() -> None:
    """After a rollback to step 10, the replayed steps meet the history of steps 1-10 only."""
    detector = AnomalyDetector(zscore=6, window=50, min_steps=5)
    feed(detector, [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.1, 0.9, 1.0])
    before = detector.zscore(3.0)
    for step in range(11, 16):  # spikes applied (as under on_anomaly: warn) join the history
        detector.accept(step=step, grad_norm=50.0)
    assert detector.zscore(3.0) != before
    assert detector.check(step=11, loss=1.0, grad_norm=1.0) is None
    assert detector.zscore(3.0) == before


def test_min_steps_must_fit_the_window() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        AnomalyDetector(zscore=6, window=10, min_steps=11)


def test_the_ranks_agree_on_the_root_anomaly() -> None:
    # Rank 1's NaN loss made every rank's (all-reduced) gradient norm NaN.
    rank0 = Anomaly(kind="nan", metric="grad_norm", step=7, rank=0, value=math.nan)
    rank1 = Anomaly(kind="nan", metric="loss", step=7, rank=1, value=math.nan)
    verdict = decide([encode(rank0), encode(rank1)], step=7)
    assert verdict is not None
    assert verdict.describe() == "loss is NaN at step 7 on rank 1"

    spike = Anomaly(kind="spike", metric="grad_norm", step=7, rank=0, value=9.0, zscore=8.5)
    inf = Anomaly(kind="inf", metric="grad_norm", step=7, rank=2, value=math.inf)
    assert decide([encode(spike), encode(None), encode(inf)], step=7) == inf  # non-finite before a spike
    assert decide([encode(spike), encode(None)], step=7) == spike  # the z-score travels too
    assert decide([encode(None)] * 2, step=7) is None
