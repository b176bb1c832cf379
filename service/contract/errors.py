"""Domain errors, and the one-line form their messages take. The API maps each class to one HTTP status,
once (api/errors.py)."""

from __future__ import annotations


class ApiaryError(Exception):
    """Something went wrong in Apiary."""

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        self.message = message or (self.__doc__ or "").strip()
        self.field = field
        super().__init__(self.message)


class JobNotFound(ApiaryError):
    """No job has this id."""


class NodeNotFound(ApiaryError):
    """The Ray cluster has no alive node with this id."""


class SweepNotFound(ApiaryError):
    """No sweep has this id."""


class InvalidSpec(ApiaryError, ValueError):
    """The job spec cannot run as written."""


class Unschedulable(InvalidSpec):
    """The job asks for more than the cluster could ever hold."""


class DatasetError(InvalidSpec):
    """The dataset does not fit the job: wrong location, columns, types or size."""

    def __init__(self, message: str | None = None, *, field: str | None = "dataset.uri") -> None:
        super().__init__(message, field=field)


class CodeError(InvalidSpec):
    """The job's code package cannot be used as it is (service.contract.code)."""

    def __init__(self, message: str | None = None, *, field: str | None = "code") -> None:
        super().__init__(message, field=field)


class CodeTooLarge(CodeError):
    """The job's code is larger than the service's limit (APIARY_CODE_MAX_BYTES)."""


class CodeUploadOff(ApiaryError):
    """This service takes no code with a job (APIARY_CODE_UPLOAD=false): use a trainer installed in its
    image."""


class InvalidTransition(ApiaryError):
    """The job cannot move to that state from where it is."""


class JobNotStarted(ApiaryError):
    """The job has not started yet: it has no logs."""


class LogsNotFound(ApiaryError):
    """Ray has no logs for that attempt of the job."""


class Unauthenticated(ApiaryError):
    """Send an API token: `Authorization: Bearer <token>` (create one with `apiary token create NAME`)."""


class Forbidden(ApiaryError):
    """Your token may not do this: only the job's owner or an admin may."""


class TokenNotFound(ApiaryError):
    """No API token has this id."""


class LastAdminToken(ApiaryError):
    """This is the last active admin token: create another admin token before revoking it."""


class IdempotencyKeyReused(ApiaryError):
    """This Idempotency-Key was already used for a different request: use a new key for a new job."""


class ReportRefused(ApiaryError):
    """This report does not carry the report token of the job's current attempt."""


class AttemptSuperseded(ApiaryError):
    """This attempt of the job was given up for a newer one: exit without writing anything more."""


class CredentialsRefused(ApiaryError):
    """This request does not carry the fetch token of the job's current attempt."""


class CredentialsRedeemed(ApiaryError):
    """This fetch token is dead: redeemed already, or its attempt was given up or ended."""


class InvalidReport(ApiaryError):
    """The report names something that is not the job's own."""


class ClusterUnavailable(ApiaryError):
    """The Ray cluster cannot be reached right now; try again shortly."""


class SchemaOutOfDate(ApiaryError):
    """The database schema is not the one this version of Apiary needs: run `apiary db upgrade`."""


class DatabaseUnavailable(ApiaryError):
    """The database cannot be reached right now; try again shortly."""


def one_line(error: BaseException | str) -> str:
    """An error's text as one line (a user reads it in a log line, a CLI message or an API field)."""
    return " ".join(str(error).split()) or (error if isinstance(error, str) else type(error).__name__)
