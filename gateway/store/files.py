"""File records: what POST /v1/files stored, and the result files of finished batches."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from gateway.store import tables
from gateway.store.pages import Order, page
from gateway.store.tables import files

# Purposes a client may upload with (OpenAI's); batch_output is the gateway's own, for batch result files.
UPLOAD_PURPOSES = frozenset({"assistants", "batch", "fine-tune", "vision", "user_data", "evals"})
BATCH_OUTPUT_PURPOSE = "batch_output"
# A batch in one of these still reads its input file, which therefore cannot be deleted.
_ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    blob_key: str

    @classmethod
    def from_row(cls, row: Any) -> FileRecord:
        return cls(row.id, row.filename, row.purpose, row.bytes, row.created_at, row.blob_key)

    def values(self) -> dict[str, Any]:
        return {"id": self.id, "filename": self.filename, "purpose": self.purpose, "bytes": self.bytes,
                "created_at": self.created_at, "blob_key": self.blob_key}


class FileInUseError(Exception):
    """The file is the input of a batch that has not finished."""


class FileStore:
    """File records in the database. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    @staticmethod
    def record(file_id: str, filename: str, purpose: str, size: int, blob_key: str) -> FileRecord:
        return FileRecord(file_id, filename, purpose, size, int(time.time()), blob_key)

    def add(self, record: FileRecord) -> None:
        with self.db.begin() as c:
            c.execute(insert(files).values(**record.values()))

    def get(self, file_id: str) -> FileRecord | None:
        with self.db.begin() as c:
            row = c.execute(select(files).where(files.c.id == file_id)).one_or_none()
        return FileRecord.from_row(row) if row is not None else None

    def list_page(
        self, limit: int, after: str | None, order: Order, purpose: str | None
    ) -> tuple[list[FileRecord], bool]:
        """A page of records and whether more follow. UnknownCursorError if `after` is not a file id."""
        where = [files.c.purpose == purpose] if purpose else []
        with self.db.begin() as c:
            result = page(c, files, limit, after, order, where)
        return [FileRecord.from_row(r) for r in result.rows], result.has_more

    def remove(self, file_id: str) -> FileRecord | None:
        """Delete the record (the caller then deletes the bytes); None if there was none. FileInUseError if an
        unfinished batch reads it."""
        batches = tables.batches
        with self.db.begin() as c:
            # Locked, so a batch cannot be created on this file while it is being deleted (PostgreSQL; SQLite
            # serializes whole transactions anyway).
            row = c.execute(select(files).where(files.c.id == file_id).with_for_update()).one_or_none()
            if row is None:
                return None
            user = c.execute(
                select(batches.c.id)
                .where(batches.c.input_file_id == file_id, batches.c.status.in_(_ACTIVE_BATCH_STATUSES))
                .limit(1)
            ).scalar_one_or_none()
            if user is not None:
                raise FileInUseError(user)
            c.execute(delete(files).where(files.c.id == file_id))
        return FileRecord.from_row(row)
