"""`/v1/files`: upload (streamed to the blob directory), list, retrieve, content, delete — OpenAI's file API."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from gateway.batches.objects import file_object, list_object
from gateway.deps import Batches, Config, require_api_key
from gateway.errors import APIError, invalid
from gateway.store.blobs import upload_key
from gateway.store.files import UPLOAD_PURPOSES, FileInUseError, FileRecord, FileStore
from gateway.store.ids import FILE_PREFIX, is_id, new_id
from gateway.store.pages import UnknownCursorError
from gateway.uploads import receive_upload

router = APIRouter(dependencies=[Depends(require_api_key)])

# The upload is read as a stream (gateway/uploads.py), not through FastAPI's form parsing, so its body is
# documented here: OpenAI's multipart form.
UPLOAD_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "The file's bytes (a part with a filename)"},
        "purpose": {"type": "string", "enum": sorted(UPLOAD_PURPOSES)},
    },
}}}}}
CONTENT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "The file's bytes"},
}


def file_not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param=param, code="file_not_found")


async def find_file(service_files: FileStore, file_id: str, param: str | None = None) -> FileRecord:
    """The record of `file_id`; 404 if there is none (or the id is not one this gateway could have made)."""
    record = await asyncio.to_thread(service_files.get, file_id) if is_id(file_id, FILE_PREFIX) else None
    if record is None:
        raise file_not_found(file_id, param)
    return record


@router.post("/v1/files", response_model=None, openapi_extra=UPLOAD_BODY)
async def create_file(request: Request, batches: Batches, config: Config) -> Any:
    upload = await receive_upload(request, batches.blobs, config.max_file_bytes)
    try:
        purpose = upload.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            allowed = ", ".join(sorted(UPLOAD_PURPOSES))
            raise invalid(f"purpose must be one of {allowed}; got {purpose!r}", "purpose")
        if upload.filename is None:
            raise invalid("the body has no `file` part", "file")
        file_id = new_id(FILE_PREFIX)
        record = FileStore.record(file_id, upload.filename, purpose, upload.size, upload_key(file_id))
        await asyncio.to_thread(batches.blobs.publish, upload.temp, record.blob_key)
        try:
            await asyncio.to_thread(batches.files.add, record)
        except BaseException:
            await asyncio.to_thread(batches.blobs.delete, record.blob_key)
            raise
    finally:
        batches.blobs.discard(upload.temp)
    return JSONResponse(file_object(record))


@router.get("/v1/files", response_model=None)
async def list_files(
    batches: Batches,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> Any:
    try:
        records, has_more = await asyncio.to_thread(batches.files.list_page, limit, after, order, purpose)
    except UnknownCursorError:
        raise invalid(f"after: no file {after}", "after") from None
    return JSONResponse(list_object(records, has_more, file_object))


@router.get("/v1/files/{file_id}", response_model=None)
async def retrieve_file(file_id: str, batches: Batches) -> Any:
    return JSONResponse(file_object(await find_file(batches.files, file_id)))


@router.get("/v1/files/{file_id}/content", response_model=None, response_class=FileResponse,
            responses=CONTENT_RESPONSES)
async def file_content(file_id: str, batches: Batches) -> Any:
    record = await find_file(batches.files, file_id)
    path = batches.blobs.path(record.blob_key)
    if not path.is_file():
        raise file_not_found(file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=record.filename)


@router.delete("/v1/files/{file_id}", response_model=None)
async def delete_file(file_id: str, batches: Batches) -> Any:
    await find_file(batches.files, file_id)
    try:
        record = await asyncio.to_thread(batches.files.remove, file_id)
    except FileInUseError as exc:
        raise APIError(409, f"file {file_id} is the input of batch {exc.args[0]}, which has not finished; cancel "
                       "the batch or wait for it to end", code="file_in_use") from None
    if record is None:
        raise file_not_found(file_id)
    await asyncio.to_thread(batches.blobs.delete, record.blob_key)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
