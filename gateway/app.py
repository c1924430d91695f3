"""`create_app`: the FastAPI application for one GatewayConfig.

The lifespan opens the engine pool (channels + health polling), the files-and-batches service (database, blob
directory, batch workers), the stored responses (on that database, with their background runner) and the
usage flush, and closes them and the media fetcher's HTTP client; routers reach them through dependencies.
Nothing lives at module level, so tests can build as many apps as they like.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.adapters import AdapterRegistry
from gateway.batches.service import BatchService
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.errors import install_error_handlers
from gateway.keys import KeyRing
from gateway.media import MediaFetcher
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestContextMiddleware
from gateway.rate_limits import RateLimiter, RateLimits
from gateway.responses.service import ResponseService
from gateway.routers import (
    adapters,
    audio,
    batch_chat,
    batches,
    chat,
    completions,
    conversations,
    embeddings,
    files,
    models,
    operations,
    responses,
    scores,
    sglang_generate,
    tokenize,
    usage,
)
from gateway.schemas.errors import ERROR_RESPONSES
from gateway.store.rate_windows import RateWindowStore
from gateway.store.usage import UsageStore
from gateway.usage import flush_usage
from ladle.tracing import Tracing


def create_app(config: GatewayConfig) -> FastAPI:
    """The app; KeysFileError (RateLimitsFileError) if the API keys (rate limits) file cannot be read or is
    malformed."""
    keys = KeyRing.from_config(config)
    limiter = RateLimiter(RateLimits(config.rate_limits_file))
    tracing = Tracing.configure("ladle-gateway", config.otlp_traces_endpoint)
    pool = EnginePool(config)
    adapter_registry = AdapterRegistry(pool)
    metrics = GatewayMetrics(pool)
    media = MediaFetcher.from_config(config)
    service = BatchService(config, pool, metrics, tracing.tracer, media)
    stored_responses = ResponseService(pool, config.batch_lease_s, metrics.usage, config.response_retention_s,
                                       config.file_sweep_interval_s)
    metrics.watch_batches(service.count_by_status, service.lines_in_flight)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lag_probe = asyncio.create_task(metrics.watch_event_loop(), name="event-loop-lag")
        await pool.start()
        try:
            await service.start()
            adapter_registry.open(service.db)
            usage_flush = asyncio.create_task(flush_usage(metrics.usage, UsageStore(service.db)), name="usage-flush")
            limiter.open(RateWindowStore(service.db), UsageStore(service.db))
            try:
                await stored_responses.start(service.db)
                try:
                    yield
                finally:
                    await stored_responses.close()
            finally:
                usage_flush.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await usage_flush
                await service.close()
        finally:
            await pool.close()
            await media.aclose()
            lag_probe.cancel()
            await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(title="ladle gateway", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  responses=ERROR_RESPONSES)
    app.state.config = config
    app.state.keys = keys
    app.state.pool = pool
    app.state.metrics = metrics
    app.state.batches = service
    app.state.responses = stored_responses
    app.state.adapters = adapter_registry
    app.state.limiter = limiter
    app.state.media = media
    app.state.draining = False  # set on SIGTERM under --drain-grace (gateway.server): /health answers 503
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, metrics=metrics, max_request_bytes=config.max_request_bytes,
                       keys=keys, tracer=tracing.tracer)
    for module in (models, chat, completions, batch_chat, embeddings, scores, audio, files, batches, responses,
                   conversations, tokenize, usage, adapters, operations, sglang_generate):
        app.include_router(module.router)
    app.include_router(tokenize.version_router)
    return app
