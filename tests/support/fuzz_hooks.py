"""Schemathesis hooks for tests/integration/test_fuzz.py (loaded by the `st` it runs, in its own process).

Whether a valid job spec can run depends on more than its schema: its dataset must exist and its
trainer import. A generated spec whose dataset URI and trainer are valid in form is pointed at the
test's dataset (APIARY_FUZZ_DATASET_URI) and a trainer that imports, so that many generated jobs are
created and stored (which is where out-of-range values used to fail); an invalid body is left as is.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

CUSTOM_TRAINER = "tests.support.custom_trainer:train"


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    for spec in (body, body.get("spec") if isinstance(body, dict) else None):
        if not isinstance(spec, dict):
            continue
        section = spec.get("dataset")
        uri = section.get("uri") if isinstance(section, dict) else None
        if isinstance(uri, str) and uri.startswith(("file:///", "s3://")):
            section["uri"] = os.environ["APIARY_FUZZ_DATASET_URI"]
        trainer = spec.get("trainer")
        if isinstance(trainer, str) and ":" in trainer:
            spec["trainer"] = CUSTOM_TRAINER
    return body
