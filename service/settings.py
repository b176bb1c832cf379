"""One `Settings`, read from the environment (prefix `APIARY_`), validated at start-up."""

from __future__ import annotations

import getpass
import sys
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.contract import queues
from service.contract.code import DEFAULT_MAX_BYTES as DEFAULT_CODE_MAX_BYTES
from service.contract.queues import QueuesConfig
from service.contract.spec import MAX_PRIORITY
from service.contract.storage import S3Credentials
from service.planning.formulas import DEFAULT_MTBF_S

# Docker's and Kubernetes' secret files: a file named like the variable (`apiary_database_url`,
# `apiary_ray_auth_token`, `aws_secret_access_key`) holds its value; an environment variable wins.
SECRETS_DIR = Path("/run/secrets")


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name (e.g. a container's unnamed uid)
        return "local"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="APIARY_", extra="ignore", secrets_dir=SECRETS_DIR if SECRETS_DIR.is_dir() else None
    )

    data_dir: Path = Field(default=Path("./.apiary"), description="Everything local Apiary writes.")
    database_url: str | None = Field(default=None, description="Default: sqlite:///{data_dir}/apiary.db")
    database_pool_size: int = Field(
        default=30,
        ge=1,
        le=1000,
        description="PostgreSQL connections this service keeps open (plus up to 10 more at a peak): about "
        "one per request thread (40), so that a burst of requests does not queue for connections. "
        "Replicas x (this + 10) must stay under the server's max_connections.",
    )
    database_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="At start, how long to wait for the database to answer (retrying with backoff) "
        "before giving up: an orchestrator may start the service before its database.",
    )
    ray_address: str | None = Field(
        default=None,
        description="Dashboard URL (http://host:8265) of an existing Ray cluster; default: a local one.",
    )
    ray_auth_token: SecretStr | None = Field(
        default=None,
        description="Token of an existing Ray cluster that runs with token auth (RAY_AUTH_MODE=token); "
        "the service sends it with every Jobs and State API call. The local Ray makes its own.",
    )
    ray_gcs_address: str | None = Field(
        default=None,
        description="host:port of an existing Ray cluster's GCS (`ray start --head --port`; KubeRay: the "
        "head service, port 6379): where the service reads and asks for node drains (spot notices). "
        "Without it, only drains told to `POST /admin/nodes/{id}/drain` are seen.",
    )
    storage_uri: str | None = Field(
        default=None, description="Checkpoint root; default {data_dir}/checkpoints."
    )
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, moto).")
    shared_filesystem: bool = Field(
        default=False,
        description="The local paths of storage_uri and of datasets are one shared mount (NFS, a "
        "cluster filesystem) that every Ray node sees: a local path is then accepted on a cluster of "
        "more than one node (service.contract.storage.node_local).",
    )
    job_python: str = Field(
        default=sys.executable,
        description="The interpreter that runs a job's driver on the cluster's nodes (one with the "
        "same torch and ray as Apiary's); default: the service's own.",
    )
    ship_code: bool = Field(
        default=True,
        description="Send Apiary's `service` and `trainers` packages with every job (Ray runtime_env "
        "py_modules), so that the cluster's nodes need no copy of Apiary; off when the nodes run an "
        "image with Apiary installed.",
    )
    code_upload: bool = Field(
        default=True,
        description="Take a job's own code with it (`apiary submit --code DIR`, PUT /code): stored by its "
        "sha256 beside the checkpoints and shipped to the workers as Ray's working_dir. Off: 403.",
    )
    code_max_bytes: int = Field(
        default=DEFAULT_CODE_MAX_BYTES,
        gt=0,
        le=500 * 2**20,  # Ray keeps a working_dir in its GCS, which takes at most 512 MiB (gRPC's limit)
        description="The largest code package a job may bring, unpacked (its files' sizes added up).",
    )
    # The usual AWS variables (no APIARY_ prefix), read here so that the control plane can hand them to
    # each job's driver (`job_s3_credentials`), which passes them on to its Train workers and Ray Data
    # tasks on every node: the service's own environment does not reach a cluster it did not start.
    aws_access_key_id: str | None = Field(default=None, validation_alias="AWS_ACCESS_KEY_ID")
    aws_secret_access_key: SecretStr | None = Field(default=None, validation_alias="AWS_SECRET_ACCESS_KEY")
    aws_session_token: SecretStr | None = Field(default=None, validation_alias="AWS_SESSION_TOKEN")
    aws_region: str | None = Field(
        default=None, validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION")
    )
    forward_aws_env: bool = Field(
        default=True,
        description="Hand the AWS variables above to every job (off when the cluster's nodes have their "
        "own credentials, e.g. an instance role): its driver redeems a single-use fetch token for them at "
        "the control plane and keeps them in memory, never in the runtime_env that Ray logs.",
    )

    tensorboard: bool = Field(
        default=True,
        description="Write every job's metrics as TensorBoard event files under "
        "{storage_uri}/job-N/tensorboard (service.tracking).",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="An MLflow tracking server (http://host:5000): every job becomes an MLflow run there "
        "(service.tracking). Needs the `mlflow` package.",
    )
    export_interval_s: float = Field(
        default=2.0, gt=0, description="How often new metric points go to TensorBoard and MLflow."
    )

    sweep_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="How often the sweeps start trials and prune the losers (service.sweeps).",
    )

    migrate_on_start: bool = Field(
        default=True,
        description="Upgrade the database schema when the service starts. A deployment that migrates "
        "as its own step (`apiary db upgrade`) sets false: the service then refuses to start on a "
        "schema that is not at the newest revision.",
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="text for people; json for one JSON object per line (log shippers)."
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    forwarded_allow_ips: str = Field(
        default="127.0.0.1",
        description="Comma-separated addresses (or '*') of the proxies whose X-Forwarded-For and "
        "X-Forwarded-Proto are believed (uvicorn's --forwarded-allow-ips): a TLS proxy elsewhere must be "
        "named, or requests look like plain HTTP and the login cookie is not Secure.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A connection must send a whole request head (request line and headers) within this "
        "of opening or of its previous response, else it is closed (slow clients hold no descriptor).",
    )
    body_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="A request's body must arrive whole within this of the request's start, else 408.",
    )
    public_url: str | None = Field(
        default=None, description="How trainers reach this API; default http://{host}:{port}."
    )

    auth_required: bool = Field(
        default=False,
        description="Every request needs an API token, even before one exists (service.auth); auth "
        "is required anyway once any token exists.",
    )
    local_user: str = Field(
        default_factory=_login_name,
        max_length=128,
        description="Who every request is while auth is not required (one local user, an admin); "
        "default: the service's login name.",
    )
    user_max_priority: int = Field(
        default=10,
        description="The highest priority a non-admin may give a job; above it is an admin's to give.",
    )

    local_ray_cpus: int = Field(
        default=8,
        ge=1,
        description="Logical CPUs of the local Ray: more than cores, so Ray Data's tasks run beside workers.",
    )
    local_ray_check_s: float = Field(
        default=2.0, gt=0, description="How often the service checks that the local Ray it started lives."
    )
    data_cpus_per_job: float = Field(
        default=1.0, gt=0, description="CPUs reserved per job for its Ray Data tasks (part of its gang)."
    )
    scheduler_interval_s: float = Field(default=1.0, gt=0)
    default_mtbf_s: float = Field(
        default=DEFAULT_MTBF_S,
        gt=0,
        description="A job's mean time between failures for `checkpoint: {auto: true}` and `apiary plan` "
        "until Apiary has observed a failure (service.planning.measured).",
    )
    spot_prior_interruptions_per_node_h: float = Field(
        default=0.02,
        ge=0,
        description="How often a spot node is taken back (interruptions per node-hour), for the MTBF of "
        "`checkpoint: {auto: true}` on spot nodes until Apiary has observed an interruption.",
    )
    hang_floor_s: float = Field(
        default=60.0,
        gt=0,
        description="A running job none of whose ranks completed a step for max(this, hang_factor x its "
        "seconds per step) is hung: its worker group is restarted from the checkpoint.",
    )
    hang_factor: float = Field(default=10.0, gt=1)
    straggler_factor: float = Field(
        default=1.5,
        gt=1,
        description="A rank whose own work per step (data wait + forward) exceeds this multiple of the "
        "other ranks' median for 3 posts in a row is recorded as a straggler.",
    )
    start_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A submitted attempt whose Ray job has not started running after this long is "
        "stopped and the job requeued (e.g. the cluster lost the resources it reported).",
    )
    capacity_loss_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="A started job whose gang no longer fits the cluster's alive nodes (a node left) for "
        "this long is stopped and requeued; it resumes from its checkpoint once capacity is back.",
    )
    train_poll_interval_s: float = Field(
        default=0.25,
        gt=0,
        le=60,
        description="How often a job's Ray Train controller polls its workers (Ray's "
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default): its loop moves one state a poll, so a run "
        "ended ~3 s after its last checkpoint at Ray's default. Raise it for groups of hundreds of workers.",
    )
    price_signal: str | None = Field(
        default=None,
        description="A time series of price or carbon intensity: a CSV file (start,end,value; Unix seconds "
        "or ISO 8601) or an http(s) endpoint answering [{start, end, value}] (service.contract.signal). "
        "Deferrable jobs wait for its cheapest window; every job's cost is counted by it (service.costs).",
    )
    price_signal_unit: Literal["price", "carbon"] = Field(
        default="price",
        description="'price': the signal's value is a price per GPU-hour (CPU-hour for a job without GPUs); "
        "'carbon': a carbon intensity in gCO2e/kWh, and costs are kg CO2e (gpu_power_kw, cpu_power_kw).",
    )
    price_signal_refresh_s: float = Field(
        default=300.0, gt=0, description="How often the service reads the price signal again."
    )
    gpu_power_kw: float = Field(default=0.7, gt=0, description="What one GPU draws, for carbon costs.")
    cpu_power_kw: float = Field(default=0.01, gt=0, description="What one CPU draws, for carbon costs.")
    queues_file: Path | None = Field(
        default=None,
        description="YAML/JSON queue configuration over the built-in defaults (service.contract.queues).",
    )
    scheduler_lease_s: float = Field(
        default=5.0,
        gt=0,
        description="How long a scheduling replica's lease lasts unrenewed: another takes over after it.",
    )
    idempotency_key_ttl_s: float = Field(
        default=86_400.0,
        gt=0,
        description="How long an Idempotency-Key of POST /jobs matches its first request (then pruned).",
    )
    trainer_modules: str = Field(
        default="",
        description="Comma-separated module prefixes a custom trainer may come from (e.g. "
        "'acme.trainers,lab'); empty: only the built-ins (service.allowlists).",
    )
    data_roots: str | None = Field(
        default=None,
        description="Comma-separated file:///abs/path folders and s3://bucket/prefix prefixes ('s3://': any "
        "bucket) a dataset may come from; default: the data dir's datasets/ folder and any s3:// "
        "(service.allowlists).",
    )
    dataset_check_timeout_s: float = Field(
        default=10.0, gt=0, description="How long a submission waits for its dataset's listing."
    )
    data_trace_dir: Path | None = Field(
        default=None,
        description="Debugging aid: every job's ranks append the sample ids of each step under this "
        "folder (one it can write on every node), as {data_trace_dir}/job-<id>/rank-<r>.jsonl.",
    )

    priority_min: int = Field(
        default=-MAX_PRIORITY,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="The lowest priority a job may ask for (the spec's own range is -100..100).",
    )
    priority_max: int = Field(
        default=MAX_PRIORITY,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="The highest priority a job may ask for.",
    )

    @model_validator(mode="after")
    def _priority_range(self) -> Settings:
        if self.priority_min > self.priority_max:
            raise ValueError(
                f"priority_min ({self.priority_min}) must be <= priority_max ({self.priority_max})"
            )
        return self

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, data_dir: Path) -> Path:
        return data_dir.expanduser().resolve()

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'apiary.db'}"

    @property
    def resolved_storage_uri(self) -> str:
        return self.storage_uri or str(self.data_dir / "checkpoints")

    @property
    def resolved_public_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def trainer_module_prefixes(self) -> tuple[str, ...]:
        return _split(self.trainer_modules)

    @property
    def datasets_dir(self) -> Path:
        """The data dir's one folder that holds data (the demo's, by default the only data root)."""
        return self.data_dir / "datasets"

    @property
    def resolved_data_roots(self) -> tuple[str, ...]:
        if self.data_roots is None:
            return (str(self.datasets_dir), "s3://")
        return _split(self.data_roots)

    @cached_property
    def queues(self) -> QueuesConfig:
        """The queue configuration (`queues_file` over the defaults); a bad file fails at start-up."""
        return queues.load(self.queues_file)

    def job_ray_env(self) -> dict[str, str]:
        """The Ray Train settings a job's processes get (in its runtime_env, so on any cluster)."""
        return {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": f"{self.train_poll_interval_s:g}"}

    def job_aws_env(self) -> dict[str, str]:
        """The AWS variables a job's processes get (only those set; none with `forward_aws_env` off)."""
        if not self.forward_aws_env:
            return {}
        values = {
            "AWS_ACCESS_KEY_ID": self.aws_access_key_id,
            "AWS_SECRET_ACCESS_KEY": secret_value(self.aws_secret_access_key),
            "AWS_SESSION_TOKEN": secret_value(self.aws_session_token),
            "AWS_REGION": self.aws_region,
        }
        return {key: value for key, value in values.items() if value}

    def local_ray_withheld_env(self) -> frozenset[str]:
        """The AWS credential variables, which the local Ray's processes must not inherit from the
        service's environment when they are handed to jobs (`forward_aws_env`): its jobs redeem them
        like any cluster's, and a process's environment is readable in /proc by every process of its
        user (any job's code among them). None withheld otherwise: the service's environment is then
        the node's own credentials."""
        if not self.forward_aws_env:
            return frozenset()
        return frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})

    def job_s3_credentials(self) -> S3Credentials | None:
        """What an attempt's driver redeems its fetch token for (service.jobs.JobService.
        redeem_credentials): the AWS settings above, in memory; None when none is forwarded."""
        env = self.job_aws_env()
        if not env:
            return None
        return S3Credentials(
            access_key=env.get("AWS_ACCESS_KEY_ID"),
            secret_key=env.get("AWS_SECRET_ACCESS_KEY"),
            session_token=env.get("AWS_SESSION_TOKEN"),
            region=env.get("AWS_REGION"),
        )


def secret_value(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None


def _split(value: str) -> tuple[str, ...]:
    """A comma-separated setting as its non-empty items."""
    return tuple(item.strip() for item in value.split(",") if item.strip())
