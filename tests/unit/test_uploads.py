"""`receive_upload`: the file part's bytes reach the temporary file intact and are parsed and written on worker
threads, never on the event loop; a file over the cap is 413 and a malformed body 400, each leaving no file."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from starlette.requests import Request

from gateway.errors import APIError
from gateway.store.blobs import BlobStore
from gateway.uploads import receive_upload

BOUNDARY = b"----ladle-test-boundary"


def multipart(data: bytes, purpose: bytes = b"batch") -> bytes:
    return (b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n' + purpose + b"\r\n"
            + b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            + b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--" + BOUNDARY + b"--\r\n")


def request(body: bytes, chunk_bytes: int = 64 * 1024) -> Request:
    """A POST whose body arrives in `chunk_bytes` pieces, without a content-length (as a chunked upload)."""
    chunks = [body[i:i + chunk_bytes] for i in range(0, len(body), chunk_bytes)]

    async def receive() -> dict[str, Any]:
        piece = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": piece, "more_body": bool(chunks)}

    headers = [(b"content-type", b"multipart/form-data; boundary=" + BOUNDARY)]
    return Request({"type": "http", "method": "POST", "path": "/v1/files", "headers": headers}, receive)


class ThreadRecordingBlobs(BlobStore):
    """A BlobStore whose temporary files note the thread of every write."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.write_threads: set[int] = set()

    def temp_file(self) -> tuple[Path, BinaryIO]:
        path, out = super().temp_file()
        original: Callable[[Any], int] = out.write

        def write(data: Any) -> int:
            self.write_threads.add(threading.get_ident())
            return original(data)

        out.write = write  # type: ignore[method-assign]
        return path, out


def temp_files(blobs: BlobStore) -> list[Path]:
    return list((blobs.root / "tmp").iterdir())


async def on_loop(call: Callable[[], Awaitable[Any]]) -> tuple[Any, int]:
    return await call(), threading.get_ident()


async def test_the_file_is_parsed_and_written_off_the_event_loop(tmp_path: Path) -> None:
    blobs = ThreadRecordingBlobs(tmp_path)
    data = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: several feeds, and every byte value
    upload, loop_thread = await on_loop(lambda: receive_upload(request(multipart(data)), blobs, len(data)))
    assert upload.temp.read_bytes() == data
    assert (upload.size, upload.filename, upload.fields) == (len(data), "in.jsonl", {"purpose": "batch"})
    assert blobs.write_threads and loop_thread not in blobs.write_threads


async def test_a_file_over_the_cap_is_413_and_leaves_no_file(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    data = b"x" * (3 * 1024 * 1024)
    with pytest.raises(APIError) as refused:
        await receive_upload(request(multipart(data)), blobs, len(data) - 1)
    assert (refused.value.status, refused.value.code) == (413, "file_too_large")
    assert temp_files(blobs) == []


async def test_a_malformed_body_is_400_and_leaves_no_file(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    body = multipart(b"y" * (2 * 1024 * 1024)).replace(b"Content-Disposition", b"Content Disposition", 1)
    with pytest.raises(APIError) as refused:
        await receive_upload(request(body), blobs, 1 << 30)
    assert refused.value.status == 400 and "malformed" in refused.value.message
    assert temp_files(blobs) == []
