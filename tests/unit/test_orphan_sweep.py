"""`FileSweeper.sweep_orphans` on SQLite and PostgreSQL: it deletes the blobs no record names once they are an hour
old — upload blobs, leftover segments and unrecorded result files of finished or unknown batches, temporary files —
and lapsed reservations; never a recorded file, a blob written in the last hour (its record may be on its way), or
anything of a batch that may still run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text, update

from gateway.batches.sweeper import FileSweeper
from gateway.store.batches import BatchStore
from gateway.store.blobs import BlobStore, result_key, segment_key, upload_key
from gateway.store.database import database_url, open_database
from gateway.store.files import FileRecord, FileStore
from gateway.store.ids import BATCH_PREFIX, FILE_PREFIX, new_id
from gateway.store.tables import batches

HOUR = 3600.0


@pytest.fixture
def db(store_db: Engine) -> Engine:
    return store_db


def blob(blobs: BlobStore, key: str, age_s: float) -> str:
    path = blobs.path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * 10)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return key


def recorded(db: Engine, blobs: BlobStore, key: str, age_s: float) -> FileRecord:
    blob(blobs, key, age_s)
    record = FileStore.record(new_id(FILE_PREFIX), "f.jsonl", "batch", 10, key)
    FileStore(db).add(record)
    return record


def batch(db: Engine, source: FileRecord, status: str) -> str:
    created = BatchStore(db).create(new_id(BATCH_PREFIX), "/v1/chat/completions", source.id, "24h", 86400, None)
    assert created is not None
    with db.begin() as c:
        c.execute(update(batches).where(batches.c.id == created.id).values(status=status))
    return created.id


def test_orphans_are_swept_and_nothing_else(db: Engine, tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    files = FileStore(db)
    kept: list[str] = []
    gone: list[str] = []

    source = recorded(db, blobs, upload_key(new_id(FILE_PREFIX)), 2 * HOUR)  # an upload with its record
    kept.append(source.blob_key)
    gone.append(blob(blobs, upload_key(new_id(FILE_PREFIX)), 2 * HOUR))  # its record never made
    kept.append(blob(blobs, upload_key(new_id(FILE_PREFIX)), 60))  # its record may be being inserted now

    for status in ("validating", "in_progress", "finalizing", "cancelling"):  # may still run: all kept
        running = batch(db, source, status)
        kept += [blob(blobs, segment_key(running, 1, "output"), 2 * HOUR),
                 blob(blobs, result_key(running, "output"), 2 * HOUR)]

    done = batch(db, source, "completed")  # its output recorded; a segment publish did not get to delete
    kept.append(recorded(db, blobs, result_key(done, "output"), 2 * HOUR).blob_key)
    gone += [blob(blobs, segment_key(done, 1, kind), 2 * HOUR) for kind in ("output", "error")]
    kept.append(blob(blobs, segment_key(done, 2, "output"), 60))  # too recent to judge

    failed = batch(db, source, "failed")  # concatenated, then failed before its files were recorded
    gone += [blob(blobs, result_key(failed, "output"), 2 * HOUR),
             blob(blobs, segment_key(failed, 3, "error"), 2 * HOUR)]
    unknown = new_id(BATCH_PREFIX)  # a directory without a batch record
    gone.append(blob(blobs, segment_key(unknown, 1, "output"), 2 * HOUR))

    gone.append(blob(blobs, "tmp/" + "a" * 32, 2 * HOUR))
    kept.append(blob(blobs, "tmp/" + "b" * 32, 60))
    now = time.time()
    files.reserve("lapsed", "alpha", 10, 10, 100, now - 120, 60)
    files.reserve("live", "alpha", 10, 10, 100, now, 60)

    counts = FileSweeper(files, blobs, 60).sweep_orphans()
    assert (counts.uploads, counts.batch_files, counts.temp, counts.reservations) == (1, 5, 1, 1)
    assert [k for k in kept if not blobs.path(k).exists()] == []
    assert [k for k in gone if blobs.path(k).exists()] == []
    assert not blobs.path(f"batches/{failed}").exists() and not blobs.path(f"batches/{unknown}").exists()
    assert files.renew("live", time.time(), 60) and not files.renew("lapsed", time.time(), 60)
    assert FileSweeper(files, blobs, 60).sweep_orphans().total() == 0  # nothing more to do


def test_an_older_database_gains_the_blob_key_index(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The sweep looks every old blob up by key: a database made before the index existed gets it when opened."""
    for url in (database_url(None, tmp_path), database_url(request.getfixturevalue("postgres").new_database(),
                                                             tmp_path)):
        engine = open_database(url)
        with engine.begin() as c:
            c.execute(text("DROP INDEX ladle_files_blob_key"))
        assert not any(i["name"] == "ladle_files_blob_key" for i in inspect(engine).get_indexes("ladle_files"))
        engine.dispose()
        engine = open_database(url)
        try:
            (index,) = [i for i in inspect(engine).get_indexes("ladle_files") if i["name"] == "ladle_files_blob_key"]
            assert index["column_names"] == ["blob_key"]
        finally:
            engine.dispose()
