"""`GET /health` (200 only while an engine is SERVING and the gateway is not draining; no API key) and
`GET /metrics` (Prometheus; only for the
operator's key: `--metrics-api-key`, else a key of the project `default`, so no project reads the others' load)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.deps import Metrics, Pool, require_metrics_key
from gateway.errors import draining, no_engine

router = APIRouter()


@router.get("/health")
async def health(request: Request, pool: Pool) -> JSONResponse:
    if request.app.state.draining:
        return draining().response()
    ready = pool.ready
    if not ready:
        return no_engine("no engine is SERVING").response()
    return JSONResponse({"status": "ok", "engines": [e.address for e in ready]})


METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus' text format"},
}


@router.get("/metrics", dependencies=[Depends(require_metrics_key)], responses=METRICS_RESPONSES)
async def metrics(metrics: Metrics) -> Response:
    return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE_LATEST)
