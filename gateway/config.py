"""The gateway's configuration: one frozen object built at the entry point and handed to `create_app`."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024  # a 128k-token prompt as token ids is ~1 MiB of JSON


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway reaches its engines and what it admits.

    `engines` are gRPC addresses (HOST:PORT). `served_model_name` overrides the model id the engines report.
    `api_key`, when set, is required as a Bearer token on every route but /health. `request_timeout_s` becomes
    the gRPC deadline of every engine call (HTTP 504 when it passes). `health_interval_s` is how often each
    engine's health and load are polled.
    """

    engines: tuple[str, ...]
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_timeout_s: float = 600.0
    health_interval_s: float = 1.0
    retry_after_s: int = 1  # Retry-After on a 429

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("the gateway needs at least one engine address")


def parse_engine_addresses(value: str) -> tuple[str, ...]:
    """`HOST:PORT[,HOST:PORT...]` as a tuple of addresses; ValueError for an empty list or a missing port."""
    addresses = tuple(part.strip() for part in value.split(",") if part.strip())
    if not addresses:
        raise ValueError("no engine address given")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"engine address {address!r} is not HOST:PORT")
    return addresses
