"""When a rank's system figure stands out from the other ranks' (`service.contract.system`)."""

from __future__ import annotations

from service.contract.system import MIB, SYSTEM_FIGURES, show_figure, system_outliers

GIB = 1024 * MIB


def test_a_figure_stands_out_past_the_factor_and_the_floor_of_the_others_median() -> None:
    others = [{"rss_bytes": 1 * GIB}, {"rss_bytes": 1 * GIB}, {"rss_bytes": 4 * GIB}]
    assert system_outliers({"rss_bytes": 3 * GIB}, others) == {"rss_bytes": (True, 1 * GIB)}
    assert system_outliers({"rss_bytes": 2 * GIB}, others) == {"rss_bytes": (False, 1 * GIB)}  # 2x: not past
    # Twice the median but within the floor (512 MiB): a small process's noise.
    assert system_outliers({"rss_bytes": 300 * MIB}, [{"rss_bytes": 100 * MIB}])["rss_bytes"][0] is False


def test_gpu_utilization_stands_out_below_the_others_and_the_rest_above() -> None:
    others = [{"gpu_utilization_percent": 90.0, "cpu_percent": 400.0}]
    verdicts = system_outliers({"gpu_utilization_percent": 30.0, "cpu_percent": 10.0}, others)
    assert verdicts == {"gpu_utilization_percent": (True, 90.0), "cpu_percent": (False, 400.0)}
    # The busy GPU of a two-rank job does not stand out against the idle one.
    assert system_outliers({"gpu_utilization_percent": 90.0}, [{"gpu_utilization_percent": 30.0}]) == {
        "gpu_utilization_percent": (False, 30.0)
    }
    # Less than half, but by fewer than 20 points: no.
    assert not system_outliers({"gpu_utilization_percent": 8.0}, [{"gpu_utilization_percent": 20.0}])[
        "gpu_utilization_percent"
    ][0]


def test_a_figure_that_this_rank_or_every_other_rank_lacks_has_no_verdict() -> None:
    assert system_outliers({"cpu_percent": 900.0}, []) == {}
    assert system_outliers({"cpu_percent": 900.0}, [{"cpu_percent": None}, {"rss_bytes": 1}]) == {}
    assert system_outliers({"gpu_memory_bytes": None}, [{"gpu_memory_bytes": GIB}]) == {}


def test_every_figure_is_a_field_of_the_status_and_shows_in_its_unit() -> None:
    from service.contract.protocol import SystemStats

    assert set(SYSTEM_FIGURES) <= set(SystemStats.model_fields)
    assert show_figure(3 * GIB, "B") == "3.0 GiB"
    assert show_figure(1.5 * MIB, "B/s") == "1.5 MiB/s"
    assert show_figure(512, "B/s") == "512 B/s"
    assert show_figure(87.4, "%") == "87%"
