"""Upload reservations (gateway/disk.py, `FileStore.reserve`), on SQLite and PostgreSQL: a project's files plus the
live reservations of its uploads never pass its quota, also when uploads race from threads standing for gateway
replicas; a reservation nobody renews lapses and then counts for nothing; the record replaces the reservation in
one step. `receive_upload` with a quota writes no byte the quota does not hold, refuses a chunked body when the
quota runs out, a declared size that does not fit before any file exists, and a body with extra parts past the
overall cap; below the free-space floor it is 507."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from starlette.requests import Request

from gateway import disk
from gateway.disk import RESERVE_STEP_BYTES, UploadQuota
from gateway.errors import APIError
from gateway.store.blobs import BlobStore, upload_key
from gateway.store.database import database_url, open_database
from gateway.store.files import FileRecord, FileStore, ProjectLimitError, used_bytes
from gateway.store.ids import FILE_PREFIX, new_id
from gateway.uploads import FORM_OVERHEAD_BYTES, receive_upload

MiB = 1024 * 1024
BOUNDARY = b"----quota-test"


@pytest.fixture
def db(store_db: Engine) -> Engine:
    return store_db


def used(store: FileStore, project: str, now: float | None = None) -> int:
    with store.db.begin() as c:
        return used_bytes(c, project, time.time() if now is None else now)


def record(project: str, size: int) -> FileRecord:
    file_id = new_id(FILE_PREFIX)
    return FileStore.record(file_id, "in.jsonl", "batch", size, upload_key(file_id), project)


def test_reservations_count_against_the_quota_until_they_lapse(db: Engine) -> None:
    store, now = FileStore(db), time.time()
    assert store.reserve("a", "alpha", want=60, need=10, max_project_bytes=100, now=now, ttl_s=60) == 60
    assert store.reserve("b", "alpha", want=60, need=10, max_project_bytes=100, now=now, ttl_s=60) == 40  # what is left
    with pytest.raises(ProjectLimitError) as refused:
        store.reserve("c", "alpha", want=60, need=1, max_project_bytes=100, now=now, ttl_s=60)
    assert refused.value.used == 100
    assert store.reserve("c", "beta", want=60, need=60, max_project_bytes=100, now=now, ttl_s=60) == 60  # its own quota
    # Growing, a's own bytes do not count against it, b's do.
    assert store.reserve("a", "alpha", want=70, need=60, max_project_bytes=100, now=now, ttl_s=60) == 60
    with pytest.raises(ProjectLimitError):
        store.reserve("a", "alpha", want=70, need=61, max_project_bytes=100, now=now, ttl_s=60)
    assert used(store, "alpha", now) == 100
    assert store.renew("b", now + 30, 60) and not store.renew("a", now + 61, 60)  # a lapsed: renewing it fails
    later = now + 61
    assert used(store, "alpha", later) == 40  # only b, renewed, still counts
    assert store.reserve("d", "alpha", want=60, need=60, max_project_bytes=100, now=later, ttl_s=60) == 60
    assert store.drop_lapsed_reservations(later) == 2  # a and beta's c
    store.release("b")
    store.release("b")  # twice is fine
    assert used(store, "alpha", later) == 60


def test_the_record_replaces_its_reservation_in_one_step(db: Engine) -> None:
    store, now = FileStore(db), time.time()
    store.reserve("mine", "alpha", want=80, need=80, max_project_bytes=100, now=now, ttl_s=60)
    store.reserve("other", "alpha", want=20, need=20, max_project_bytes=100, now=now, ttl_s=60)
    with pytest.raises(ProjectLimitError):  # a file without a reservation finds the quota held by the others
        store.add(record("alpha", 10), 100)
    store.add(record("alpha", 80), 100, reservation="mine")
    assert used(store, "alpha") == 100 and not store.renew("mine", time.time(), 60)


def test_racing_reservations_never_pass_the_quota(db: Engine) -> None:
    """16 threads (as many uploads, on as many gateways sharing the database) each reserve 3 units of a 10-unit
    quota: at most 3 get them."""
    stores = [FileStore(db) for _ in range(4)]
    granted: list[str] = []
    start = threading.Barrier(16)

    def race(i: int) -> None:
        start.wait()
        try:
            stores[i % 4].reserve(f"r{i}", "alpha", want=3, need=3, max_project_bytes=10, now=time.time(), ttl_s=60)
            granted.append(f"r{i}")
        except ProjectLimitError:
            pass

    threads = [threading.Thread(target=race, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(granted) == 3 and used(stores[0], "alpha") == 9


# receive_upload with a quota (SQLite only: the store's behaviour on both databases is covered above).


def multipart(*parts: tuple[bytes, bytes]) -> bytes:
    body = b""
    for disposition, data in parts:
        body += b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; " + disposition + b"\r\n\r\n" + data + b"\r\n"
    return body + b"--" + BOUNDARY + b"--\r\n"


def upload_body(data: bytes) -> bytes:
    return multipart((b'name="purpose"', b"batch"), (b'name="file"; filename="in.jsonl"', data))


def request(body: bytes, declared: bool, chunk_bytes: int = 64 * 1024) -> Request:
    chunks = [body[i:i + chunk_bytes] for i in range(0, len(body), chunk_bytes)]

    async def receive() -> dict[str, Any]:
        piece = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": piece, "more_body": bool(chunks)}

    headers = [(b"content-type", b"multipart/form-data; boundary=" + BOUNDARY)]
    if declared:
        headers.append((b"content-length", str(len(body)).encode()))
    return Request({"type": "http", "method": "POST", "path": "/v1/files", "headers": headers}, receive)


class WatchedQuota(UploadQuota):
    """Notes the largest number of bytes held, and fails the test if a write ever passes it."""

    def __init__(self, store: FileStore, blobs: BlobStore, limit: int | None, min_free: int = 0) -> None:
        super().__init__(store, blobs, "alpha", limit, 16 * MiB, min_free, "upload-test")
        self.peak_held = 0

    def ensure(self, total: int) -> None:
        super().ensure(total)
        assert total <= self.held
        self.peak_held = max(self.peak_held, self.held)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[FileStore]:
    engine = open_database(database_url(None, tmp_path))
    yield FileStore(engine)
    engine.dispose()


def temp_files(blobs: BlobStore) -> list[Path]:
    return list((blobs.root / "tmp").iterdir())


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_an_upload_that_fits_holds_what_it_writes(sqlite_store: FileStore, tmp_path: Path,
                                                        declared: bool) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    quota = WatchedQuota(sqlite_store, blobs, 20 * MiB)
    data = b"y" * (9 * MiB + 5)
    async with quota.renewed():
        upload = await receive_upload(request(upload_body(data), declared), blobs, 16 * MiB, quota)
        assert upload.temp.read_bytes() == data
        assert used(sqlite_store, "alpha") == quota.held >= len(data)
        blobs.discard(upload.temp)
    assert used(sqlite_store, "alpha") == 0  # released when the upload ended
    if declared:  # one reservation of the declared size, a little over the file's
        assert len(data) <= quota.peak_held < len(data) + 200
    else:  # steps of RESERVE_STEP_BYTES
        assert quota.peak_held == 3 * RESERVE_STEP_BYTES


async def test_a_chunked_upload_is_cut_off_where_the_quota_ends(sqlite_store: FileStore, tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    quota = WatchedQuota(sqlite_store, blobs, 6 * MiB)
    with pytest.raises(APIError) as refused:
        async with quota.renewed():
            await receive_upload(request(upload_body(b"z" * (7 * MiB)), False), blobs, 16 * MiB, quota)
    assert (refused.value.status, refused.value.code) == (400, "storage_limit_exceeded")
    assert quota.peak_held == 6 * MiB  # the first step, then what was left
    assert temp_files(blobs) == [] and used(sqlite_store, "alpha") == 0


async def test_a_declared_size_that_does_not_fit_is_refused_before_any_file(sqlite_store: FileStore,
                                                                            tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    quota = WatchedQuota(sqlite_store, blobs, 2 * MiB)
    body = upload_body(b"z" * (3 * MiB))
    chunks_read: list[int] = []
    req = request(body, True)
    original = req._receive

    async def counting() -> Any:
        message = await original()
        chunks_read.append(len(message["body"]))
        return message

    req._receive = counting
    with pytest.raises(APIError) as refused:
        await receive_upload(req, blobs, 16 * MiB, quota)
    assert refused.value.code == "storage_limit_exceeded" and chunks_read == [] and temp_files(blobs) == []


async def test_below_the_free_space_floor_an_upload_is_507(sqlite_store: FileStore, tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    quota = WatchedQuota(sqlite_store, blobs, None, min_free=blobs.free_bytes() + 1024**4)
    with pytest.raises(APIError) as refused:
        await receive_upload(request(upload_body(b"{}\n"), True), blobs, 16 * MiB, quota)
    assert (refused.value.status, refused.value.type, refused.value.code) == (507, "server_error",
                                                                             "insufficient_storage")
    assert temp_files(blobs) == []


async def test_the_floor_is_checked_at_each_step_of_a_chunked_upload(
    sqlite_store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    free = [10 * MiB]
    monkeypatch.setattr(blobs, "free_bytes", lambda: free[0])
    quota = WatchedQuota(sqlite_store, blobs, None, min_free=MiB)

    def ensure(total: int) -> None:  # the disk fills up while the upload runs
        free[0] = 0 if total > RESERVE_STEP_BYTES else free[0]
        WatchedQuota.ensure(quota, total)

    monkeypatch.setattr(quota, "ensure", ensure)
    with pytest.raises(APIError) as refused:
        await receive_upload(request(upload_body(b"z" * (6 * MiB)), False), blobs, 16 * MiB, quota)
    assert refused.value.status == 507 and quota.peak_held == RESERVE_STEP_BYTES and temp_files(blobs) == []


async def test_a_chunked_body_with_extra_parts_is_capped_as_a_whole(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    extra = [(f'name="extra{i}"'.encode(), b"e" * 1024) for i in range(40)]  # fields past MAX_FIELDS: skipped
    unnamed = [(b'filename="x"', b"u" * (2 * MiB))]  # a part without a name: skipped
    body = multipart((b'name="purpose"', b"batch"), (b'name="file"; filename="in.jsonl"', b"{}\n"), *extra, *unnamed)
    with pytest.raises(APIError) as refused:
        await receive_upload(request(body, False), blobs, MiB, None)
    assert refused.value.status == 413 and str(MiB + FORM_OVERHEAD_BYTES) in refused.value.message
    assert temp_files(blobs) == []


async def test_a_lapsed_reservation_is_taken_again_before_the_next_write(
    sqlite_store: FileStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    monkeypatch.setattr(disk, "RENEW_EVERY_S", 0.01)
    quota = WatchedQuota(sqlite_store, blobs, 20 * MiB)
    quota.start(MiB)
    sqlite_store.release(quota.id)  # as if it had lapsed and been dropped: renewing it fails
    async with quota.renewed():
        deadline = time.monotonic() + 10
        while quota.held:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        quota.ensure(100)
        assert used(sqlite_store, "alpha") == quota.held >= 100
