"""What the client commands load (issue 26: `apiary jobs` starts in < 0.3 s): the SDK loads without
the job spec's models, and a listing reads `JobSummary`s, which must stay a view of `JobPublic`."""

from __future__ import annotations

import subprocess
import sys
import typing

from api.client import JobSummary, SpecSummary
from api.schemas import JobPublic
from tests.support.jobs import make_spec


def test_the_sdk_loads_without_the_job_spec_the_schemas_or_the_code_packer() -> None:
    heavy = ("service.contract.spec", "api.schemas", "pathspec", "yaml")
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, api.client; print([m for m in {heavy!r} if m in sys.modules])"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_a_job_summary_reads_fields_that_job_public_has_with_their_types() -> None:
    public = typing.get_type_hints(JobPublic)  # without Annotated's validators
    for name, hint in typing.get_type_hints(JobSummary).items():
        assert name in public, f"JobSummary.{name} is not a field of JobPublic"
        assert name == "spec" or hint == public[name], (name, hint, public[name])  # spec: summarised


def test_a_spec_summary_gives_max_steps_and_max_workers_fixed_or_elastic() -> None:
    for workers, most in ((3, 3), ({"min": 1, "max": 4}, 4)):
        spec = make_spec(
            trainer="mlp", dataset="file:///data", config={"task": "regression"}, num_workers=workers
        )
        summary = SpecSummary.model_validate(spec.model_dump(mode="json"))
        assert (summary.max_workers, summary.max_steps) == (spec.max_workers, spec.max_steps) == (most, 30)
