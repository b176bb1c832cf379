"""The MLflow sink's process settings (service.tracking.MlflowSink): the export against a real MLflow
server is tests/integration/test_tracking.py."""

from __future__ import annotations

import pytest

from service.tracking import MlflowSink


def test_the_sink_turns_off_mlflows_own_usage_reports_unless_the_operator_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MLflow 3's client sends usage telemetry to MLflow's servers from inside the service otherwise.
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    monkeypatch.delenv("DO_NOT_TRACK", raising=False)
    from mlflow.environment_variables import MLFLOW_DISABLE_TELEMETRY

    MlflowSink("http://127.0.0.1:9")  # no request is made on construction
    assert MLFLOW_DISABLE_TELEMETRY.get() is True
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")
    MlflowSink("http://127.0.0.1:9")
    assert MLFLOW_DISABLE_TELEMETRY.get() is False
