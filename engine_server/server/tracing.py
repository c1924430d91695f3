"""The engine's spans (with tracing on, `ladle.tracing`): one per RPC, continuing the caller's trace from the call's
metadata (its trace id bound into the log context while it runs), and one per Batch item; a generation's span gets
its phases as events at the times they happened.

A generation's events, from the core's `RequestTimeline` (its first choice's): `queued` (it arrived), `scheduled`
(first admitted to a step), `preempted` (each time its blocks were taken back), `first_token`, then `finished`
with its token counts and finish reason. The span's attributes name the request id and, for a batch job's items,
the batch id the gateway sent (`ladle.tracing.BATCH_ID_KEY`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
import structlog
from opentelemetry import trace

from engine_server.frontend import GenerationResult
from ladle.tracing import BATCH_ID_KEY, epoch_ns, extract, set_attributes, trace_id

SERVICE = "ladle.v1.EngineService"


class RpcTracing:
    """Spans of the engine's RPCs; every method is a no-op without a tracer."""

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self.tracer = tracer

    @contextlib.contextmanager
    def call(self, rpc: str, context: grpc.aio.ServicerContext[Any, Any]) -> Iterator[trace.Span | None]:
        """The RPC's server span, a child of the trace context in the call's metadata (if any), current while
        the block runs."""
        if self.tracer is None:
            yield None
            return
        metadata = tuple((m[0], m[1]) for m in context.invocation_metadata() or ())
        attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": rpc}
        batch_id = self.batch_id(context)
        if batch_id is not None:
            attributes["ladle.batch_id"] = batch_id
        with self.tracer.start_as_current_span(f"{SERVICE}/{rpc}", context=extract(metadata),
                                               kind=trace.SpanKind.SERVER, attributes=attributes) as span, \
                structlog.contextvars.bound_contextvars(trace_id=trace_id(span)):
            yield span

    @staticmethod
    def batch_id(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """The batch job a Batch call runs for, as the gateway names it in the call's metadata."""
        found = next((m[1] for m in context.invocation_metadata() or () if m[0] == BATCH_ID_KEY), None)
        return found if isinstance(found, str) else None

    @contextlib.contextmanager
    def item(self, item_id: str, batch_id: str | None) -> Iterator[trace.Span | None]:
        """A Batch item's span, a child of its call's."""
        if self.tracer is None:
            yield None
            return
        attributes = {"ladle.item_id": item_id, **({"ladle.batch_id": batch_id} if batch_id else {})}
        with self.tracer.start_as_current_span(f"{SERVICE}/Batch item", attributes=attributes) as span:
            yield span


def record_pooling(span: trace.Span | None, request_id: str, prompt_tokens: int) -> None:
    """An Embed or Score call's request id and the tokens it read, as attributes of `span`."""
    if span is None or not span.is_recording():
        return
    set_attributes(span, {"ladle.request_id": request_id, "gen_ai.usage.input_tokens": prompt_tokens})


def record_generation(span: trace.Span | None, request_id: str, result: GenerationResult) -> None:
    """The generation's phases as events of `span`, and its counts as attributes."""
    if span is None or not span.is_recording():
        return
    usage = result.usage
    set_attributes(span, {
        "ladle.request_id": request_id, "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "ladle.usage.cached_tokens": usage.cached_prompt_tokens,
        "gen_ai.response.finish_reasons": [str(c.finish_reason) for c in result.choices if c.finish_reason],
    })
    timeline = result.timeline
    if timeline is not None:
        span.add_event("queued", timestamp=epoch_ns(timeline.arrival))
        if timeline.scheduled is not None:
            span.add_event("scheduled", timestamp=epoch_ns(timeline.scheduled))
        for preempted in timeline.preempted:
            span.add_event("preempted", timestamp=epoch_ns(preempted))
        if timeline.first_token is not None:
            span.add_event("first_token", timestamp=epoch_ns(timeline.first_token))
    span.add_event("finished", attributes={"prompt_tokens": usage.prompt_tokens,
                                           "cached_tokens": usage.cached_prompt_tokens,
                                           "output_tokens": usage.completion_tokens})
