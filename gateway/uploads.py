"""`POST /v1/files` bodies: multipart/form-data parsed as it arrives (python-multipart's push parser).

The `file` part goes straight into a temporary file in the blob directory and is refused (413) the moment it
passes the size cap, so an upload is never held whole in memory nor written beyond the cap; the other parts
are small form fields (e.g. `purpose`), kept in memory up to a few KiB each, and the whole body, parts skipped
included, may not pass the cap plus `FORM_OVERHEAD_BYTES`. With an `UploadQuota` (gateway/disk.py), no byte of
the file is written before the quota holds room for it: the declared size is reserved before the body is read,
and a chunked body's reservation grows a step at a time, the upload refused when the quota has no more room.

The event loop only receives the body: it gathers up to `FEED_BYTES` of it, then a worker thread parses that
and writes the file's bytes (a write can wait on the disk for long), while uvicorn keeps reading the socket.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from gateway.disk import UploadQuota
from gateway.errors import APIError, invalid
from gateway.multipart import PartReader
from gateway.store.blobs import BlobStore

MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16
FORM_OVERHEAD_BYTES = 64 * 1024  # boundaries, part headers and small fields around the file
FEED_BYTES = 1024 * 1024  # body handed to the parsing thread at a time: ~200 thread hops for a 200 MB file


@dataclass
class Upload:
    """A received upload: the file's bytes in `temp` (publish or discard it), its name and the form fields."""

    temp: Path
    size: int = 0
    filename: str | None = None  # None: the body had no `file` part
    fields: dict[str, str] = field(default_factory=dict)


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the file is larger than the limit of {max_bytes} bytes", param="file",
                    code="file_too_large")


def safe_filename(name: str) -> str:
    """The last path component of a client's file name, without control characters (it is only ever shown,
    never used as a path; this keeps what is shown tidy)."""
    base = PurePosixPath(name.replace("\\", "/")).name
    cleaned = "".join(ch for ch in base if ch.isprintable()).strip()
    return cleaned[:255] if cleaned.strip(".") else "upload"


class _FormReader(PartReader):
    """Each part of an upload's form to the file or to a field."""

    def __init__(self, upload: Upload, out: BinaryIO, max_bytes: int, quota: UploadQuota | None = None) -> None:
        super().__init__()
        self.upload = upload
        self.out = out
        self.max_bytes = max_bytes
        self.quota = quota

    def part_named(self, name: str, params: dict[bytes, bytes]) -> str | None:
        if name == "file":
            if self.upload.filename is not None:
                raise invalid("send one `file` part", "file")
            self.upload.filename = safe_filename(params.get(b"filename", b"").decode("utf-8", "replace"))
            return "file"
        return name if name and len(self.upload.fields) < MAX_FIELDS else None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part == "file":
            self.upload.size += end - start
            if self.upload.size > self.max_bytes:
                raise too_large(self.max_bytes)
            if self.quota is not None:
                self.quota.ensure(self.upload.size)  # may wait on the database: this runs in the parsing thread
            self.out.write(memoryview(data)[start:end])
        elif self._part is not None:
            self._buffer += data[start:end]
            if len(self._buffer) > MAX_FIELD_BYTES:
                raise invalid(f"form field `{self._part}` is longer than {MAX_FIELD_BYTES} bytes", self._part)

    def _part_end(self) -> None:
        if self._part not in (None, "file"):
            self.upload.fields[self._part] = self._buffer.decode("utf-8", "replace")


async def receive_upload(
    request: Request, blobs: BlobStore, max_bytes: int, quota: UploadQuota | None = None
) -> Upload:
    """Read a multipart/form-data body into an Upload; APIError (400, 413) for a body that is not one or a
    file over `max_bytes`. With `quota`, its hold is taken before the body is read (the declared file size:
    the Content-Length less the two boundary lines every form has, at most `max_bytes`; or a first step for a
    chunked body) and grown before each write past it: APIError 400 `storage_limit_exceeded` or 507 when it
    cannot be. The caller owns `Upload.temp` once this returns, and releases `quota`."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise invalid("the body must be multipart/form-data with a `file` part and a `purpose` field")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes + FORM_OVERHEAD_BYTES:
        raise too_large(max_bytes)
    if quota is not None:
        declared = min(max(int(length) - 2 * len(boundary) - 8, 0), max_bytes) if length.isdigit() else None
        await asyncio.to_thread(quota.start, declared)
    temp, out = await asyncio.to_thread(blobs.temp_file)
    upload = Upload(temp)
    try:
        with out:
            reader = _FormReader(upload, out, max_bytes, quota)
            parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
            await _feed(request, parser, max_bytes + FORM_OVERHEAD_BYTES)
    except BaseException as exc:
        if isinstance(exc, Exception):
            await asyncio.to_thread(blobs.discard, temp)  # unlinking a large partial file is disk work too
        else:
            blobs.discard(temp)  # cancelled: nothing more may be awaited
        if isinstance(exc, MultipartParseError):
            raise invalid(f"the multipart body is malformed: {exc}") from None
        if isinstance(exc, ClientDisconnect):
            raise APIError(400, "the client disconnected during the upload") from None
        raise
    return upload


async def _feed(request: Request, parser: MultipartParser, max_body_bytes: int) -> None:
    """Push the body through `parser` in a worker thread, `FEED_BYTES` at a time, and finalize it there; 413 once
    the body passes `max_body_bytes` (a chunked body's parts that are skipped count too)."""
    pending: list[bytes] = []
    size = 0
    body = 0
    async for chunk in request.stream():
        body += len(chunk)
        if body > max_body_bytes:
            raise APIError(413, f"the upload's body is larger than {max_body_bytes} bytes (the file size limit plus "
                           f"{FORM_OVERHEAD_BYTES} for the rest of the form)", code="file_too_large")
        pending.append(chunk)
        size += len(chunk)
        if size >= FEED_BYTES:
            await asyncio.to_thread(_write_all, parser, pending)
            pending, size = [], 0
    await asyncio.to_thread(_write_all, parser, pending, True)


def _write_all(parser: MultipartParser, chunks: list[bytes], last: bool = False) -> None:
    for chunk in chunks:
        parser.write(chunk)
    if last:
        parser.finalize()
