"""`/v1/batches`: create, retrieve, list and cancel OpenAI batch jobs. The work happens in the batch workers
(gateway/batches/worker.py); these routes only store and read records, each request those of its project (another
project's batch or input file is answered as unknown, 404). Below the free-space floor a new batch is refused with
507 (gateway/disk.py): its results would need room."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse

from gateway.batches.lines import ENDPOINTS
from gateway.batches.objects import batch_object, list_object
from gateway.deps import Batches, Config, Limiter, Project, require_api_key
from gateway.disk import require_free_space
from gateway.errors import APIError, invalid
from gateway.routers.files import find_file
from gateway.schemas.batches import CreateBatchRequest
from gateway.store.batches import BatchRecord
from gateway.store.files import ProjectLimitError
from gateway.store.ids import BATCH_PREFIX, is_id, new_id
from gateway.store.pages import UnknownCursorError

router = APIRouter(dependencies=[Depends(require_api_key)])

COMPLETION_WINDOWS = {"24h": 24 * 3600}


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", code="batch_not_found")


async def find_batch(batches: Batches, batch_id: str, project: str) -> BatchRecord:
    record = await asyncio.to_thread(batches.batches.get, batch_id, project) if is_id(batch_id, BATCH_PREFIX) else None
    if record is None:
        raise batch_not_found(batch_id)
    return record


@router.post("/v1/batches", response_model=None)
async def create_batch(
    body: CreateBatchRequest, batches: Batches, config: Config, project: Project, limiter: Limiter
) -> Any:
    if body.endpoint not in ENDPOINTS:
        supported = ", ".join(sorted(ENDPOINTS))
        raise invalid(f"endpoint {body.endpoint!r} is not supported; use one of {supported}", "endpoint")
    window_s = COMPLETION_WINDOWS.get(body.completion_window)
    if window_s is None:
        raise invalid(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}", "completion_window")
    await limiter.check_batch_budget(project)
    await asyncio.to_thread(require_free_space, batches.blobs, config.min_free_disk_bytes)
    source = await find_file(batches.files, body.input_file_id, project, "input_file_id")
    if source.purpose != "batch":
        raise invalid(f"file {source.id} was uploaded with purpose {source.purpose!r}; a batch reads only files "
                      "uploaded with purpose 'batch'", "input_file_id")
    output_expires_after_s = body.output_expires_after.seconds if body.output_expires_after else None
    try:
        record = await asyncio.to_thread(
            lambda: batches.batches.create(
                new_id(BATCH_PREFIX), body.endpoint, source.id, body.completion_window, window_s, body.metadata,
                project=project, max_active=config.project_max_active_batches,
                output_expires_after_s=output_expires_after_s,
            )
        )
    except ProjectLimitError as exc:
        # Like a rate limit: the same request succeeds once one of the project's batches has ended.
        raise APIError(429, f"Project {exc.project} has {exc.used} batches in progress, its limit; wait for one to "
                       "end (or cancel one), then try again.", type="rate_limit_error",
                       code="batch_limit_exceeded") from None
    if record is None:  # deleted in between
        await find_file(batches.files, body.input_file_id, project, "input_file_id")
        raise invalid(f"file {body.input_file_id} was deleted", "input_file_id")
    batches.wake.set()
    return JSONResponse(batch_object(record))


@router.get("/v1/batches", response_model=None)
async def list_batches(
    batches: Batches,
    project: Project,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> Any:
    try:
        records, has_more = await asyncio.to_thread(batches.batches.list_page, limit, after, project)
    except UnknownCursorError:
        raise invalid(f"after: no batch {after}", "after") from None
    return JSONResponse(list_object(records, has_more, batch_object))


@router.get("/v1/batches/{batch_id}", response_model=None)
async def retrieve_batch(batch_id: str, batches: Batches, project: Project) -> Any:
    return JSONResponse(batch_object(await find_batch(batches, batch_id, project)))


@router.post("/v1/batches/{batch_id}/cancel", response_model=None)
async def cancel_batch(batch_id: str, batches: Batches, project: Project) -> Any:
    await find_batch(batches, batch_id, project)
    record = await batches.cancel(batch_id)
    if record is None:
        raise batch_not_found(batch_id)
    if record.status not in ("cancelling", "cancelled"):
        raise APIError(409, f"batch {batch_id} is {record.status} and can no longer be cancelled",
                       code="batch_not_cancellable")
    return JSONResponse(batch_object(record))
