"""The gateway's configuration: one frozen object built at the entry point and handed to `create_app`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gateway.routing import RoutingConfig

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024  # a 128k-token prompt as token ids is ~1 MiB of JSON
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
DEFAULT_PROJECT_MAX_FILE_BYTES = 100 * 1024**3  # OpenAI's storage limit per organization
DEFAULT_PROJECT_MAX_ACTIVE_BATCHES = 100
MAX_BATCH_WORKERS = 64
DEFAULT_MIN_FREE_DISK_BYTES = 1024 * 1024**2  # below this free on the blob volume: 507 for new uploads and batches
DNS_PREFIX = "dns:"  # an engine target whose every resolved address is one engine
DEFAULT_IMAGE_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's limit for an image input
DEFAULT_MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's limit for an audio file


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/ladle, else ~/.local/share/ladle."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "ladle"


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway reaches its engines and what it admits.

    `engines` are gRPC addresses: HOST:PORT, or dns:HOST:PORT for every address HOST resolves to (resolved
    again every `resolve_interval_s`); `routing` says how calls are spread over them. `served_model_name`
    overrides the model id the engines report. `request_timeout_s` becomes the gRPC deadline of every engine
    call (HTTP 504 when it passes; a call sent again to a second engine shares it). `health_interval_s` is how
    often each engine's health and load are polled. `engine_auth_token` is sent on every engine call (engines
    started with --auth-token-file refuse calls without it; ladle.auth).

    API keys and projects: `api_key` is a key of the default project; `api_keys_file` holds `KEY PROJECT` lines
    (gateway/keys.py; read again on SIGHUP). With any key set, every route but /health needs one as a Bearer
    token, and a request acts for its key's project; with none, every request is the default project's.
    `rate_limits_file` holds per-project rate limits (gateway/rate_limits.py; read again on SIGHUP).
    `otlp_traces_endpoint` turns traces on (ladle.tracing; the standard OTEL_* variables too).
    A project may store at most `project_max_file_bytes` of files and have `project_max_active_batches`
    unfinished batches (None: no limit). `metrics_api_key` is the only key /metrics answers (None: the
    default project's keys; with no keys at all, anyone).

    Files and batches: bytes under `data_dir`/blobs, records in `database_url` (default: SQLite in `data_dir`);
    uploads up to `max_file_bytes`. `batch_workers` run batches in this process at once (0: none; another
    replica on the same database runs them; at most MAX_BATCH_WORKERS), claimed round-robin by project, each
    with at most `batch_window` engine items in flight (None: twice the engine's max_num_seqs) and all of one
    project's together at most `batch_project_window` (None: the batch window times the number of engines),
    holding a batch under a lease of `batch_lease_s` seconds (a worker that dies releases its batch when the
    lease runs out). Every `file_sweep_interval_s` the files whose expiry has passed are deleted, and the stored
    responses older than `response_retention_s` (None: kept until deleted). Below `min_free_disk_bytes` free on
    the blob directory's file system (0: no floor), uploads and new batches are refused with 507 (gateway/disk.py).

    Images and audio in chat messages (gateway/media.py): an http(s) image or audio URL is fetched within
    `image_fetch_timeout_s` (redirects included), only from the hosts in `allowed_media_domains` (exact names, as
    vLLM's flag of that name, trusted whatever they resolve to; empty: any host whose addresses are all public, so
    never loopback, a private network or a metadata endpoint unless listed); an image, fetched or inline, may hold
    at most `max_image_bytes`, an audio clip (fetched, a data: URL's or an input_audio part's) `max_audio_bytes`.
    """

    engines: tuple[str, ...]
    served_model_name: str | None = None
    api_key: str | None = None
    api_keys_file: Path | None = None
    project_max_file_bytes: int | None = DEFAULT_PROJECT_MAX_FILE_BYTES
    project_max_active_batches: int | None = DEFAULT_PROJECT_MAX_ACTIVE_BATCHES
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_timeout_s: float = 600.0
    # Seconds after SIGTERM during which /health answers 503 (`draining`) but requests are still served, so a
    # balancer's or Kubernetes' readiness checks take the gateway out of rotation before it stops listening.
    drain_grace_s: float = 0.0
    # Seconds the requests in flight get to finish once the gateway stops (after any drain grace); then they are
    # cut. A long non-streaming generation needs up to request_timeout_s.
    shutdown_timeout_s: float = 30.0
    max_engine_message_bytes: int = 64 * 1024 * 1024  # the largest engine reply taken (the engine's own limit)
    health_interval_s: float = 1.0
    resolve_interval_s: float = 10.0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    retry_after_s: int = 1  # Retry-After on a 429
    data_dir: Path | None = None  # None: default_data_dir()
    database_url: str | None = None
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    batch_workers: int = 4
    batch_window: int | None = None
    batch_project_window: int | None = None
    batch_lease_s: float = 30.0
    file_sweep_interval_s: float = 60.0
    response_retention_s: float | None = None
    min_free_disk_bytes: int = DEFAULT_MIN_FREE_DISK_BYTES
    metrics_api_key: str | None = field(default=None, repr=False)
    rate_limits_file: Path | None = None
    otlp_traces_endpoint: str | None = None
    engine_auth_token: str | None = field(default=None, repr=False)
    image_fetch_timeout_s: float = DEFAULT_IMAGE_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES
    allowed_media_domains: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("the gateway needs at least one engine address")
        if not 0 <= self.batch_workers <= MAX_BATCH_WORKERS:
            raise ValueError(f"batch_workers must be in [0, {MAX_BATCH_WORKERS}]")
        for name in ("batch_window", "batch_project_window"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None: the default)")
        if self.batch_lease_s <= 1:
            raise ValueError("batch_lease_s must be more than 1 second")
        if self.file_sweep_interval_s <= 0:
            raise ValueError("file_sweep_interval_s must be positive")
        if self.response_retention_s is not None and self.response_retention_s <= 0:
            raise ValueError("response_retention_s must be positive (or None: kept until deleted)")
        if self.min_free_disk_bytes < 0:
            raise ValueError("min_free_disk_bytes must be >= 0 (0: no floor)")
        for name in ("project_max_file_bytes", "project_max_active_batches"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (or None: no limit)")
        if self.image_fetch_timeout_s <= 0 or self.max_image_bytes < 1 or self.max_audio_bytes < 1:
            raise ValueError("image_fetch_timeout_s, max_image_bytes and max_audio_bytes must be positive")


def parse_domains(value: str) -> tuple[str, ...]:
    """`HOST[,HOST...]` as lower-case host names (an empty string: none, so any host)."""
    return tuple(dict.fromkeys(part.strip().lower() for part in value.split(",") if part.strip()))


def parse_engine_addresses(value: str) -> tuple[str, ...]:
    """`[dns:]HOST:PORT[,[dns:]HOST:PORT...]` as a tuple of addresses; ValueError for an empty list or a missing
    port."""
    addresses = tuple(part.strip() for part in value.split(",") if part.strip())
    if not addresses:
        raise ValueError("no engine address given")
    for address in addresses:
        host, sep, port = address.removeprefix(DNS_PREFIX).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"engine address {address!r} is not HOST:PORT")
    return addresses
