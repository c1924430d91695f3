"""`/v1/files`: upload (streamed to the blob directory), list, retrieve, content, delete — OpenAI's file API.

Every route sees only the files of the request's project: another project's file is answered as unknown (404).
An upload holds room in its project's quota before it writes (gateway/disk.py), so it is refused, not written,
when the project is full; below the free-space floor it is refused with 507.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import ValidationError

from gateway.batches.objects import file_object, list_object
from gateway.deps import Batches, Config, Project, require_api_key
from gateway.disk import RESERVATION_PREFIX, UploadQuota, storage_limit
from gateway.errors import APIError, invalid
from gateway.schemas.batches import ExpiresAfter
from gateway.store.blobs import upload_key
from gateway.store.files import UPLOAD_PURPOSES, FileInUseError, FileRecord, FileStore, ProjectLimitError
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
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
    },
}}}}}
CONTENT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "The file's bytes"},
}


def file_not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param=param, code="file_not_found")


async def find_file(service_files: FileStore, file_id: str, project: str, param: str | None = None) -> FileRecord:
    """The record of `file_id` in `project`; 404 if there is none (or the id is not one this gateway could have
    made)."""
    record = await asyncio.to_thread(service_files.get, file_id, project) if is_id(file_id, FILE_PREFIX) else None
    if record is None:
        raise file_not_found(file_id, param)
    return record


def expires_after_s(fields: dict[str, str]) -> int | None:
    """The lifetime the form's `expires_after[anchor]` and `expires_after[seconds]` fields ask for; None when
    they are absent (the file is kept until deleted)."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    try:
        return ExpiresAfter.model_validate({"anchor": anchor, "seconds": seconds}).seconds
    except ValidationError as exc:
        error = exc.errors()[0]
        param = f"expires_after.{error['loc'][0]}" if error["loc"] else "expires_after"
        raise invalid(f"{param}: {error['msg']}", param) from None


@router.post("/v1/files", response_model=None, openapi_extra=UPLOAD_BODY)
async def create_file(request: Request, batches: Batches, config: Config, project: Project) -> Any:
    quota = UploadQuota(batches.files, batches.blobs, project, config.project_max_file_bytes, config.max_file_bytes,
                        config.min_free_disk_bytes, new_id(RESERVATION_PREFIX))
    async with quota.renewed():
        return await _store_upload(request, batches, config, quota)


async def _store_upload(request: Request, batches: Batches, config: Config, quota: UploadQuota) -> Any:
    upload = await receive_upload(request, batches.blobs, config.max_file_bytes, quota)
    try:
        purpose = upload.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            allowed = ", ".join(sorted(UPLOAD_PURPOSES))
            raise invalid(f"purpose must be one of {allowed}; got {purpose!r}", "purpose")
        if upload.filename is None:
            raise invalid("the body has no `file` part", "file")
        lifetime_s = expires_after_s(upload.fields)
        file_id = new_id(FILE_PREFIX)
        record = FileStore.record(file_id, upload.filename, purpose, upload.size, upload_key(file_id), quota.project,
                                  lifetime_s)
        await asyncio.to_thread(batches.blobs.publish, upload.temp, record.blob_key)
        try:
            await asyncio.to_thread(batches.files.add, record, config.project_max_file_bytes, quota.id)
        except BaseException as exc:
            await asyncio.to_thread(batches.blobs.delete, record.blob_key)
            if isinstance(exc, ProjectLimitError):
                raise storage_limit(exc) from None
            raise
    finally:  # after a refusal this deletes the whole upload: disk work, off the loop
        await asyncio.to_thread(batches.blobs.discard, upload.temp)
    return JSONResponse(file_object(record))


@router.get("/v1/files", response_model=None)
async def list_files(
    batches: Batches,
    project: Project,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> Any:
    try:
        records, has_more = await asyncio.to_thread(batches.files.list_page, limit, after, order, purpose,
                                                  project)
    except UnknownCursorError:
        raise invalid(f"after: no file {after}", "after") from None
    return JSONResponse(list_object(records, has_more, file_object))


@router.get("/v1/files/{file_id}", response_model=None)
async def retrieve_file(file_id: str, batches: Batches, project: Project) -> Any:
    return JSONResponse(file_object(await find_file(batches.files, file_id, project)))


@router.get("/v1/files/{file_id}/content", response_model=None, response_class=FileResponse,
            responses=CONTENT_RESPONSES)
async def file_content(file_id: str, batches: Batches, project: Project) -> Any:
    record = await find_file(batches.files, file_id, project)
    path = batches.blobs.path(record.blob_key)
    if not path.is_file():
        raise file_not_found(file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=record.filename)


@router.delete("/v1/files/{file_id}", response_model=None)
async def delete_file(file_id: str, batches: Batches, project: Project) -> Any:
    await find_file(batches.files, file_id, project)
    try:
        record = await asyncio.to_thread(batches.files.remove, file_id, project)
    except FileInUseError as exc:
        raise APIError(409, f"file {file_id} is the input of batch {exc.args[0]}, which has not finished; cancel "
                       "the batch or wait for it to end", code="file_in_use") from None
    if record is None:
        raise file_not_found(file_id)
    await asyncio.to_thread(batches.blobs.delete, record.blob_key)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
