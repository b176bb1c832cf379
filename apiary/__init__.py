"""Apiary's public names: the one package a user imports.

    import apiary

    with apiary.Client("http://127.0.0.1:8000") as client:   # or APIARY_URL / the config file
        job = client.submit("job.yaml")                       # a path, a dict or an apiary.JobSpec
        job = client.wait(job.id, timeout_s=600)
    # The server's refusals raise apiary.ApiaryClientError subclasses: ApiaryInvalid names the field.

What runs on the cluster (`apiary.Recipe`, `apiary.TrainContext`) needs `pip install 'apiary[cluster]'`;
the client needs nothing beyond `pip install apiary`. Each name is imported when it is first used, so
`import apiary` costs almost nothing and loads neither the server's nor the cluster's dependencies.

The packages behind these names (`api`, `service`, `trainers`) are Apiary's internals: user code needs
only this one.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from api.extras import extra_of, install_hint

if TYPE_CHECKING:  # the names as type checkers see them (`X as X`: re-exported)
    from api.client import ApiaryClient
    from api.client import ApiaryClientError as ApiaryClientError
    from api.client import ApiaryConflict as ApiaryConflict
    from api.client import ApiaryConnectionError as ApiaryConnectionError
    from api.client import ApiaryInvalid as ApiaryInvalid
    from api.client import ApiaryNotFound as ApiaryNotFound
    from api.client import ApiaryUnauthorized as ApiaryUnauthorized
    from api.client import ApiaryUnavailable as ApiaryUnavailable
    from api.schemas import JobPublic
    from service.contract.errors import DatasetError as DatasetError
    from service.contract.spec import JobSpec as JobSpec
    from service.contract.states import JobState as JobState
    from trainers.context import TrainContext as TrainContext
    from trainers.recipe import Collate as Collate
    from trainers.recipe import Recipe as Recipe
    from trainers.recipe import RowShape as RowShape
    from trainers.recipe import first_row_length as first_row_length
    from trainers.recipe import require_column as require_column
    from trainers.recipe import require_list_column as require_list_column
    from trainers.recipes import GPTCollate as GPTCollate
    from trainers.recipes import lr_factor as lr_factor

    Client = ApiaryClient
    Job = JobPublic

# Public name -> (module, name there). The recipe protocol and the training context run on the cluster.
_NAMES = {
    "Client": ("api.client", "ApiaryClient"),
    "ApiaryClientError": ("api.client", "ApiaryClientError"),
    "ApiaryConnectionError": ("api.client", "ApiaryConnectionError"),
    "ApiaryUnauthorized": ("api.client", "ApiaryUnauthorized"),
    "ApiaryNotFound": ("api.client", "ApiaryNotFound"),
    "ApiaryConflict": ("api.client", "ApiaryConflict"),
    "ApiaryInvalid": ("api.client", "ApiaryInvalid"),
    "ApiaryUnavailable": ("api.client", "ApiaryUnavailable"),
    "Job": ("api.schemas", "JobPublic"),
    "JobSpec": ("service.contract.spec", "JobSpec"),
    "JobState": ("service.contract.states", "JobState"),
    "Recipe": ("trainers.recipe", "Recipe"),
    "TrainContext": ("trainers.context", "TrainContext"),
    # What a recipe's members use (trainers.recipe, trainers.recipes): the types of its row shape and
    # collate function, the dataset checks, the built-in `gpt`'s token collate and LR schedule, and
    # the error a column check raises.
    "Collate": ("trainers.recipe", "Collate"),
    "RowShape": ("trainers.recipe", "RowShape"),
    "require_column": ("trainers.recipe", "require_column"),
    "require_list_column": ("trainers.recipe", "require_list_column"),
    "first_row_length": ("trainers.recipe", "first_row_length"),
    "GPTCollate": ("trainers.recipes", "GPTCollate"),
    "lr_factor": ("trainers.recipes", "lr_factor"),
    "DatasetError": ("service.contract.errors", "DatasetError"),
}

# The names whose module this version has (the recipe protocol and the training context came later).
__all__ = [name for name, (module, _) in _NAMES.items() if importlib.util.find_spec(module)]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the distribution's (pyproject.toml), read when asked
        from importlib import metadata

        return metadata.version("apiary")
    try:
        module_name, attribute = _NAMES[name]
    except KeyError:
        raise AttributeError(f"module 'apiary' has no attribute {name!r}") from None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            raise AttributeError(f"apiary.{name} is not in this version of Apiary") from None
        extra = extra_of(err.name or "")
        if extra is None:
            raise
        raise ModuleNotFoundError(
            f"apiary.{name} needs {err.name}, which comes with apiary[{extra}]: {install_hint(extra)}",
            name=err.name,
        ) from err
    value = getattr(module, attribute)
    globals()[name] = value  # the next use does not come here
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
