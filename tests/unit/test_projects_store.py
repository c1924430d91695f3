"""Projects, limits and expiry in the store, on SQLite and PostgreSQL: each project sees only its own files and
batches, the per-project limits hold (also under racing inserts), the sweeper deletes expired files but not one an
unfinished batch reads, and a database made by an earlier version gains the new columns when opened."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, create_engine, insert, inspect, select

from gateway.batches.sweeper import FileSweeper
from gateway.store import database
from gateway.store.batches import BatchRecord, BatchStore
from gateway.store.blobs import BlobStore, upload_key
from gateway.store.database import database_url, open_database
from gateway.store.files import FileRecord, FileStore, ProjectLimitError
from gateway.store.ids import BATCH_PREFIX, FILE_PREFIX, new_id
from gateway.store.pages import UnknownCursorError
from gateway.store.tables import DEFAULT_PROJECT, files, metadata

CHAT = "/v1/chat/completions"
# The columns this change added; an "old" database is the schema without them.
ADDED = {"ladle_files": {"project", "expires_at"}, "ladle_batches": {"project", "output_expires_after_s"}}


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return database_url(None, tmp_path)
    return database_url(request.getfixturevalue("postgres").new_database(), tmp_path)


@pytest.fixture
def db(url: str) -> Iterator[Engine]:
    engine = open_database(url)
    yield engine
    engine.dispose()


def add_file(db: Engine, project: str, size: int = 10, expires_at: int | None = None,
             blobs: BlobStore | None = None) -> FileRecord:
    file_id = new_id(FILE_PREFIX)
    record = FileRecord(file_id, "in.jsonl", "batch", size, int(time.time()), upload_key(file_id), project,
                        expires_at)
    if blobs is not None:
        path = blobs.path(record.blob_key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    FileStore(db).add(record)
    return record


def add_batch(db: Engine, source: FileRecord, **options: object) -> BatchRecord:
    record = BatchStore(db).create(new_id(BATCH_PREFIX), CHAT, source.id, "24h", 3600, None,
                                   project=source.project, **options)  # type: ignore[arg-type]
    assert record is not None
    return record


def test_a_project_sees_only_its_own_files(db: Engine) -> None:
    store = FileStore(db)
    mine, theirs = add_file(db, "alpha"), add_file(db, "beta")
    assert store.get(mine.id, "alpha") == mine and store.get(theirs.id, "alpha") is None
    assert store.get(theirs.id) == theirs  # workers and the sweeper see every project
    assert [r.id for r in store.list_page(10, None, "desc", None, "alpha")[0]] == [mine.id]
    with pytest.raises(UnknownCursorError):  # another project's id is no cursor either
        store.list_page(10, theirs.id, "desc", None, "alpha")
    assert store.remove(theirs.id, "alpha") is None and store.get(theirs.id) == theirs
    assert store.remove(mine.id, "alpha") == mine


def test_a_project_sees_only_its_own_batches(db: Engine) -> None:
    store = BatchStore(db)
    mine = add_batch(db, add_file(db, "alpha"))
    theirs = add_batch(db, add_file(db, "beta"))
    assert mine.project == "alpha" and store.get(mine.id, "alpha") == mine
    assert store.get(theirs.id, "alpha") is None and store.get(theirs.id) == theirs
    assert [r.id for r in store.list_page(10, None, "alpha")[0]] == [mine.id]
    with pytest.raises(UnknownCursorError):
        store.list_page(10, theirs.id, "alpha")
    # A batch is made only from a file of its own project.
    other_file = add_file(db, "beta")
    assert store.create(new_id(BATCH_PREFIX), CHAT, other_file.id, "24h", 3600, None, project="alpha") is None


def test_the_stored_bytes_limit(db: Engine) -> None:
    store = FileStore(db)
    add_file(db, "alpha", size=60)
    add_file(db, "beta", size=90)  # another project's bytes do not count
    file_id = new_id(FILE_PREFIX)
    store.add(store.record(file_id, "a", "batch", 40, upload_key(file_id), "alpha"), max_project_bytes=100)
    file_id = new_id(FILE_PREFIX)
    with pytest.raises(ProjectLimitError) as refused:
        store.add(store.record(file_id, "b", "batch", 1, upload_key(file_id), "alpha"), max_project_bytes=100)
    assert (refused.value.used, refused.value.limit) == (100, 100) and store.get(file_id) is None


def test_the_stored_bytes_limit_holds_under_racing_uploads(db: Engine) -> None:
    """Ten uploads of 30 bytes at once under a limit of 100: three get in, whatever the interleaving."""
    store = FileStore(db)
    start = threading.Barrier(10)
    outcomes: list[bool] = []

    def upload() -> None:
        file_id = new_id(FILE_PREFIX)
        start.wait()
        try:
            store.add(store.record(file_id, "a", "batch", 30, upload_key(file_id), "alpha"), max_project_bytes=100)
            outcomes.append(True)
        except ProjectLimitError:
            outcomes.append(False)

    threads = [threading.Thread(target=upload) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count(True) == 3 and len(store.list_page(100, None, "desc", None, "alpha")[0]) == 3


def test_the_active_batches_limit(db: Engine) -> None:
    store = BatchStore(db)
    source = add_file(db, "alpha")
    first = add_batch(db, source, max_active=2)
    add_batch(db, source, max_active=2)
    with pytest.raises(ProjectLimitError):
        add_batch(db, source, max_active=2)
    add_batch(db, add_file(db, "beta"), max_active=2)  # another project has its own count
    store.request_cancel(first.id)  # cancelling is not finished: still counted
    with pytest.raises(ProjectLimitError):
        add_batch(db, source, max_active=2)
    claim = store.claim(first.id, "w", time.time(), 30)
    assert claim is not None
    store.finish(claim, "cancelled", None, None)
    assert add_batch(db, source, max_active=2).status == "validating"


def test_output_files_take_the_batch_project_and_lifetime(db: Engine) -> None:
    batch = add_batch(db, add_file(db, "alpha"), output_expires_after_s=7200)
    record = BatchStore(db).get(batch.id)
    assert record is not None and record.output_expires_after_s == 7200
    output = record.result_file(new_id(FILE_PREFIX), "out.jsonl", "batch_output", 5, "results/x")
    assert output.project == "alpha" and output.expires_at == output.created_at + 7200
    never = add_batch(db, add_file(db, "alpha")).result_file(new_id(FILE_PREFIX), "o", "batch_output", 5, "r/x")
    assert never.expires_at is None


def test_the_sweeper_deletes_expired_files_but_not_the_input_of_an_unfinished_batch(db: Engine,
                                                                                     tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    store, batches = FileStore(db), BatchStore(db)
    now = int(time.time())
    expired = add_file(db, "alpha", expires_at=now - 1, blobs=blobs)
    fresh = add_file(db, "alpha", expires_at=now + 3600, blobs=blobs)
    kept = add_file(db, "alpha", blobs=blobs)
    in_use = add_file(db, "beta", expires_at=now - 1, blobs=blobs)
    batch = add_batch(db, in_use)
    sweeper = FileSweeper(store, blobs, interval_s=60)

    assert sweeper.sweep(now) == 1
    assert store.get(expired.id) is None and not blobs.path(expired.blob_key).exists()
    for record in (fresh, kept, in_use):
        assert store.get(record.id) == record and blobs.path(record.blob_key).exists()

    claim = batches.claim(batch.id, "w", time.time(), 30)
    assert claim is not None
    batches.finish(claim, "completed", None, None)  # the batch ends: its input may go now
    assert sweeper.sweep(now) == 1 and store.get(in_use.id) is None and not blobs.path(in_use.blob_key).exists()
    assert sweeper.sweep(now + 7200) == 1 and store.get(fresh.id) is None and store.get(kept.id) == kept


def test_the_sweeper_pages_through_many_expired_files(db: Engine, tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    made = [add_file(db, "alpha", expires_at=1) for _ in range(250)]
    assert FileSweeper(FileStore(db), blobs, interval_s=60).sweep() == 250
    assert all(FileStore(db).get(r.id) is None for r in made)


def _old_schema() -> MetaData:
    """The tables as the previous release created them: today's, less the columns added since."""
    old = MetaData()
    for table in metadata.sorted_tables:
        dropped = ADDED.get(table.name, set())
        Table(table.name, old, *(c._copy() for c in table.columns if c.name not in dropped))
    return old


def test_an_old_database_gains_the_new_columns_when_opened(url: str) -> None:
    engine = create_engine(url)
    old = _old_schema()
    old.create_all(engine)
    file_id, batch_id = new_id(FILE_PREFIX), new_id(BATCH_PREFIX)
    with engine.begin() as c:
        c.execute(insert(old.tables["ladle_files"]).values(
            id=file_id, filename="in.jsonl", purpose="batch", bytes=3, created_at=1, blob_key=upload_key(file_id)))
        c.execute(insert(old.tables["ladle_batches"]).values(
            id=batch_id, endpoint=CHAT, input_file_id=file_id, completion_window="24h", status="completed",
            created_at=1, expires_at=2, total=0, completed=0, failed=0, prompt_tokens=0, completion_tokens=0,
            cached_tokens=0, lease_epoch=0))
    engine.dispose()

    upgraded = open_database(url)
    try:
        columns = inspect(upgraded)
        for table in metadata.sorted_tables:
            assert {c["name"] for c in columns.get_columns(table.name)} == set(table.columns.keys()), table.name
        assert any(index["column_names"] == ["project"] for index in columns.get_indexes("ladle_files"))
        record = FileStore(upgraded).get(file_id, DEFAULT_PROJECT)
        assert record is not None and record.project == DEFAULT_PROJECT and record.expires_at is None
        batch = BatchStore(upgraded).get(batch_id, DEFAULT_PROJECT)
        assert batch is not None and batch.output_expires_after_s is None
        add_file(upgraded, "alpha")  # and new rows go in as usual
        again = open_database(url)  # a second open finds nothing to add
        again.dispose()
    finally:
        upgraded.dispose()


def test_a_new_column_that_old_rows_cannot_take_is_refused(url: str) -> None:
    """A NOT NULL column without a server default has no value for the rows that exist: a clear error."""
    engine = open_database(url)
    schema = MetaData()
    Table(files.name, schema, *(c._copy() for c in files.columns),
          Column("required_without_default", Integer, nullable=False))
    try:
        with engine.begin() as c, pytest.raises(RuntimeError, match="required_without_default"):
            database._add_missing_columns(c, schema)
        nullable = MetaData()
        Table(files.name, nullable, *(c._copy() for c in files.columns), Column("note", String(8)))
        with engine.begin() as c:
            database._add_missing_columns(c, nullable)
        with engine.begin() as c:
            assert c.execute(select(nullable.tables[files.name].c.note)).all() == []
    finally:
        engine.dispose()
