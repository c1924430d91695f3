"""OpenTelemetry traces for the gateway and the engine, off unless an OTLP endpoint is configured.

`Tracing.configure(service, endpoint)` takes the endpoint from the flag (`--otlp-traces-endpoint`), else from the
standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` variables; with none, `tracer` is
None and nothing is recorded (the SDK is not even imported). With one, spans go to it over OTLP/gRPC through a
batching processor (the SDK's `OTEL_BSP_*` variables tune it). No global provider is installed: each process holds
its own, so tests can run several.

W3C trace context (`traceparent`, `tracestate`) crosses HTTP in headers and gRPC in call metadata:
`context_metadata` gives the current span's, which `AsyncEngineClient` adds to every call, and `extract` reads it
back on the other side. `BATCH_ID_KEY` carries a batch job's id to the engine's Batch call, so its spans name it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

BATCH_ID_KEY = "ladle-batch-id"
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROPAGATOR = TraceContextTextMapPropagator()  # stateless


@dataclass
class Tracing:
    """A process's tracer (None: tracing is off) and the provider that exports its spans."""

    tracer: trace.Tracer | None = None
    provider: TracerProvider | None = None

    @classmethod
    def configure(cls, service: str, endpoint: str | None = None) -> Tracing:
        endpoint = endpoint or next((os.environ[v] for v in _ENDPOINT_VARIABLES if os.environ.get(v)), None)
        if not endpoint:
            return cls()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider.get_tracer("ladle"), provider)

    def shutdown(self) -> None:
        """Export what is pending and stop (at process end)."""
        if self.provider is not None:
            self.provider.shutdown()


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> Context:
    """The trace context a request arrived with (HTTP headers, or gRPC metadata pairs, whose binary values are
    skipped); an empty context if none."""
    pairs = carrier.items() if isinstance(carrier, Mapping) else carrier
    return _PROPAGATOR.extract({key.lower(): value for key, value in pairs if isinstance(value, str)})


def context_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's trace context as gRPC metadata pairs; none when no span is being recorded."""
    if not trace.get_current_span().get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def trace_id(span: trace.Span) -> str:
    """The span's trace id as 32 hex digits, as logs and backends show it."""
    return format(span.get_span_context().trace_id, "032x")


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as Unix nanoseconds (span event timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def set_attributes(span: trace.Span, attributes: Mapping[str, Any]) -> None:
    """Set the attributes whose value is not None."""
    span.set_attributes({key: value for key, value in attributes.items() if value is not None})
