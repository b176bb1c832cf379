"""The price signal's format (`service.contract.signal`): CSV and JSON, and the clear errors of bad ones."""

from __future__ import annotations

import pytest

from service.contract.signal import SignalError, parse_csv, parse_json, parse_time


def test_csv_with_unix_seconds_and_iso_times_in_any_order() -> None:
    signal = parse_csv(
        "start,end,value\n"
        "2027-01-01T01:00:00Z,2027-01-01T02:00:00+00:00,2.5\n"
        "1798761600,1798765200,4\n"
        "\n"
        "2027-01-01T03:00:00,2027-01-01T04:00:00,1\n",
        source="prices.csv",
    )
    assert [(p.start, p.end, p.value) for p in signal.points] == [
        (1798761600.0, 1798765200.0, 4.0),
        (1798765200.0, 1798768800.0, 2.5),
        (1798772400.0, 1798776000.0, 1.0),  # no zone: UTC
    ]
    assert signal.horizon == 1798776000.0
    # Over 00:30-03:30: half an hour at 4, an hour at 2.5, a gap, half an hour at 1.
    assert signal.integral(1798763400.0, 1798774200.0) == (1800 * 4 + 3600 * 2.5 + 1800 * 1, 7200.0)


def test_json_list_of_intervals() -> None:
    signal = parse_json(
        [{"start": 0, "end": 60, "value": 3}, {"start": "1970-01-01T00:01:00Z", "end": 120, "value": 0}],
        source="http://x",
    )
    assert signal.integral(0, 120) == (180.0, 120.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "price signal p.csv: the file is empty; it needs the header start,end,value"),
        (
            "from,to,price\n1,2,3\n",
            "price signal p.csv: the header is 'from,to,price'; it must be start,end,value",
        ),
        ("start,end,value\n1,2\n", "price signal p.csv, line 2: 2 columns, expected 3 (start,end,value)"),
        (
            "start,end,value\nyesterday,2,3\n",
            "price signal p.csv, interval 1: 'yesterday' is not a time (Unix seconds or ISO 8601)",
        ),
        ("start,end,value\n1,2,cheap\n", "price signal p.csv, interval 1: value 'cheap' is not a number"),
        (
            "start,end,value\n1,2,-1\n",
            "price signal p.csv, interval 1: value '-1' must be a finite number >= 0",
        ),
        (
            "start,end,value\n1,2,nan\n",
            "price signal p.csv, interval 1: value 'nan' must be a finite number >= 0",
        ),
        ("start,end,value\n5,2,1\n", "price signal p.csv, interval 1: end (2) must be after start (5)"),
        (
            "start,end,value\n0,3600,1\n1800,7200,2\n",
            "price signal p.csv: intervals overlap (1970-01-01T00:00:00Z-1970-01-01T01:00:00Z and "
            "1970-01-01T00:30:00Z-1970-01-01T02:00:00Z): each time may have one value",
        ),
    ],
)
def test_bad_csv_files_give_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(SignalError) as raised:
        parse_csv(text, source="p.csv")
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"start": 0}, "price signal e: expected a JSON list of {start, end, value}"),
        ([{"start": 0, "end": 1}], "price signal e, interval 1: needs start, end and value"),
        ([{"start": 0, "end": 1, "value": True}], "price signal e, interval 1: value True is not a number"),
    ],
)
def test_bad_json_gives_a_clear_error(data: object, message: str) -> None:
    with pytest.raises(SignalError) as raised:
        parse_json(data, source="e")
    assert str(raised.value) == message


def test_times() -> None:
    assert parse_time("2027-01-01T02:00:00+02:00") == parse_time(1798761600) == 1798761600.0
    for bad in (True, None, "1e400", -5, "2027-13-01"):
        with pytest.raises(ValueError):
            parse_time(bad)
