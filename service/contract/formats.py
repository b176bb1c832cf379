"""The dataset formats Apiary reads, in a module of their own: the CLI names them without importing the
job spec's models (service/contract/spec.py, about 0.15 s)."""

from __future__ import annotations

from enum import StrEnum


class DataFormat(StrEnum):
    PARQUET = "parquet"
    WEBDATASET = "webdataset"
