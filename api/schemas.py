"""Request and response schemas, one per direction. The request body of POST /jobs is `JobSpec`."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from service.models import Job, JobEvent, Metric
from service.spec import JobSpec
from service.states import JobState


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    queue: str
    priority: int
    owner: str
    state: JobState
    attempt: int
    spec: JobSpec
    ray_submission_id: str | None
    latest_checkpoint: str | None
    latest_checkpoint_step: int | None
    message: str | None
    waiting_reason: str | None = None
    created_at: datetime
    updated_at: datetime
    admitted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def build(cls, job: Job, *, waiting_reason: str | None = None) -> JobPublic:
        public = cls.model_validate(job)
        return public.model_copy(update={"waiting_reason": waiting_reason}) if waiting_reason else public


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


class EventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    from_state: JobState | None
    to_state: JobState | None
    actor: str
    reason: str

    @classmethod
    def build(cls, event: JobEvent) -> EventPublic:
        return cls.model_validate(event)


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int


class MetricPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    rank: int
    attempt: int
    time: float
    values: dict[str, float]

    @classmethod
    def build(cls, metric: Metric) -> MetricPublic:
        return cls.model_validate(metric)


class MetricsPublic(BaseModel):
    data: list[MetricPublic]
    count: int


class TelemetryAccepted(BaseModel):
    stored: int


class Health(BaseModel):
    status: str
    database: str
    ray: str
