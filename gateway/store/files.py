"""File records: what POST /v1/files stored, and the result files of finished batches.

Every record belongs to a project. The calls that take `project` see only that project's records (None: all of
them, for the workers and the sweeper); a project's stored bytes may be capped (ProjectLimitError). What counts
against the cap is `used_bytes`: the project's files plus the live reservations of its uploads in progress
(`reserve`), so racing uploads, on one gateway or on several sharing the database, cannot together write more
than the cap allows.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, delete, func, insert, or_, select, update

from gateway.store import tables
from gateway.store.database import lock_project
from gateway.store.pages import Order, page
from gateway.store.tables import DEFAULT_PROJECT, files, upload_reservations

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
    project: str = DEFAULT_PROJECT
    expires_at: int | None = None  # when the sweeper deletes it

    @classmethod
    def from_row(cls, row: Any) -> FileRecord:
        return cls(row.id, row.filename, row.purpose, row.bytes, row.created_at, row.blob_key, row.project,
                   row.expires_at)

    def values(self) -> dict[str, Any]:
        return {"id": self.id, "filename": self.filename, "purpose": self.purpose, "bytes": self.bytes,
                "created_at": self.created_at, "blob_key": self.blob_key, "project": self.project,
                "expires_at": self.expires_at}


class FileInUseError(Exception):
    """The file is the input of a batch that has not finished."""


class ProjectLimitError(Exception):
    """An insert would take a project past one of its limits."""

    def __init__(self, project: str, limit: int, used: int) -> None:
        super().__init__(f"project {project} is at {used} of its limit of {limit}")
        self.project = project
        self.limit = limit
        self.used = used


class FileStore:
    """File records in the database. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    @staticmethod
    def record(
        file_id: str, filename: str, purpose: str, size: int, blob_key: str, project: str = DEFAULT_PROJECT,
        expires_after_s: int | None = None,
    ) -> FileRecord:
        """A new record created now, expiring `expires_after_s` from now (None: never)."""
        now = int(time.time())
        expires_at = now + expires_after_s if expires_after_s is not None else None
        return FileRecord(file_id, filename, purpose, size, now, blob_key, project, expires_at)

    def add(self, record: FileRecord, max_project_bytes: int | None = None, reservation: str | None = None) -> None:
        """Insert `record`; ProjectLimitError if its project would then use more than `max_project_bytes`. The
        upload's `reservation`, if any, is replaced by the record in the same transaction (it no longer counts)."""
        with self.db.begin() as c:
            if max_project_bytes is not None:
                lock_project(c, record.project)
                used = used_bytes(c, record.project, time.time(), exclude=reservation)
                if used + record.bytes > max_project_bytes:
                    raise ProjectLimitError(record.project, max_project_bytes, used)
            c.execute(insert(files).values(**record.values()))
            if reservation is not None:
                c.execute(delete(upload_reservations).where(upload_reservations.c.id == reservation))

    def reserve(
        self, reservation: str, project: str, want: int, need: int, max_project_bytes: int, now: float, ttl_s: float
    ) -> int:
        """Hold `want` bytes of `project`'s quota for the upload `reservation` (replacing what it held), or what
        is left if that is less but at least `need`, until `now + ttl_s`; the bytes now held. ProjectLimitError
        if fewer than `need` bytes are left. Checked and written under the project's lock, like `add`."""
        with self.db.begin() as c:
            lock_project(c, project)
            used = used_bytes(c, project, now, exclude=reservation)
            room = max_project_bytes - used
            if room < need:
                raise ProjectLimitError(project, max_project_bytes, used)
            held = max(need, min(want, room))
            c.execute(delete(upload_reservations).where(upload_reservations.c.id == reservation))
            c.execute(insert(upload_reservations).values(id=reservation, project=project, bytes=held,
                                                         expires_at=now + ttl_s))
        return held

    def renew(self, reservation: str, now: float, ttl_s: float) -> bool:
        """Extend a live reservation to `now + ttl_s`; False if it is gone or had lapsed (then other uploads may
        have been given its bytes: the holder must `reserve` again)."""
        with self.db.begin() as c:
            renewed = c.execute(update(upload_reservations)
                                .where(upload_reservations.c.id == reservation, upload_reservations.c.expires_at > now)
                                .values(expires_at=now + ttl_s))
            return renewed.rowcount == 1

    def release(self, reservation: str) -> None:
        """Drop a reservation (nothing if it is gone)."""
        with self.db.begin() as c:
            c.execute(delete(upload_reservations).where(upload_reservations.c.id == reservation))

    def drop_lapsed_reservations(self, now: float) -> int:
        """Delete the reservations whose holder stopped renewing them (they already count for nothing); how many."""
        with self.db.begin() as c:
            return c.execute(delete(upload_reservations).where(upload_reservations.c.expires_at <= now)).rowcount

    def unknown_blob_keys(self, keys: Collection[str]) -> set[str]:
        """Those of `keys` that no file record names as its bytes."""
        with self.db.begin() as c:
            known = set(c.execute(select(files.c.blob_key).where(files.c.blob_key.in_(list(keys)))).scalars())
        return set(keys) - known

    def batch_statuses(self, batch_ids: Collection[str]) -> dict[str, str]:
        """The status of each of `batch_ids` that has a record (an unknown id is left out)."""
        batches = tables.batches
        with self.db.begin() as c:
            rows = c.execute(select(batches.c.id, batches.c.status).where(batches.c.id.in_(list(batch_ids))))
            return {row.id: row.status for row in rows}

    def get(self, file_id: str, project: str | None = None) -> FileRecord | None:
        with self.db.begin() as c:
            row = c.execute(select(files).where(files.c.id == file_id, *_of(project))).one_or_none()
        return FileRecord.from_row(row) if row is not None else None

    def list_page(
        self, limit: int, after: str | None, order: Order, purpose: str | None, project: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        """A page of records and whether more follow. UnknownCursorError if `after` is not a file id (of
        `project`)."""
        where = [files.c.purpose == purpose] if purpose else []
        with self.db.begin() as c:
            result = page(c, files, limit, after, order, where, scope=_of(project))
        return [FileRecord.from_row(r) for r in result.rows], result.has_more

    def expired(self, now: int, limit: int = 100) -> list[FileRecord]:
        """Up to `limit` files whose `expires_at` has passed and that no unfinished batch reads, oldest first."""
        batches = tables.batches
        in_use = select(batches.c.id).where(batches.c.input_file_id == files.c.id,
                                             batches.c.status.in_(_ACTIVE_BATCH_STATUSES))
        with self.db.begin() as c:
            rows = c.execute(select(files).where(files.c.expires_at <= now, ~in_use.exists())
                             .order_by(files.c.pk).limit(limit))
            return [FileRecord.from_row(r) for r in rows]

    def remove(self, file_id: str, project: str | None = None) -> FileRecord | None:
        """Delete the record (the caller then deletes the bytes); None if there was none (in `project`).
        FileInUseError if an unfinished batch reads it."""
        batches = tables.batches
        with self.db.begin() as c:
            # Locked, so a batch cannot be created on this file while it is being deleted (PostgreSQL; SQLite
            # serializes whole transactions anyway).
            row = c.execute(
                select(files).where(files.c.id == file_id, *_of(project)).with_for_update()
            ).one_or_none()
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


def stored_bytes(c: Connection, project: str) -> int:
    """The bytes of every file of `project`, its batches' result files included."""
    used = c.execute(select(func.coalesce(func.sum(files.c.bytes), 0)).where(files.c.project == project)).scalar()
    return int(used or 0)


def used_bytes(
    c: Connection, project: str, now: float, exclude: str | None = None,
    exclude_segment: tuple[str, int] | None = None,
) -> int:
    """What counts against `project`'s storage cap: its files (`stored_bytes`), the reservations of its uploads
    in progress that have not lapsed by `now` (but `exclude`, the caller's own) and the committed results of its
    unfinished batches (their segments; but `exclude_segment`, a (batch id, epoch) whose commit is being
    checked)."""
    live = [upload_reservations.c.project == project, upload_reservations.c.expires_at > now]
    if exclude is not None:
        live.append(upload_reservations.c.id != exclude)
    reserved = c.execute(select(func.coalesce(func.sum(upload_reservations.c.bytes), 0)).where(*live)).scalar()
    batches, segments = tables.batches, tables.segments
    running = [batches.c.project == project]
    if exclude_segment is not None:
        batch_id, epoch = exclude_segment
        running.append(or_(segments.c.batch_id != batch_id, segments.c.epoch != epoch))
    results = c.execute(
        select(func.coalesce(func.sum(segments.c.output_bytes + segments.c.error_bytes), 0))
        .select_from(segments.join(batches, batches.c.id == segments.c.batch_id))
        .where(*running)
    ).scalar()
    return stored_bytes(c, project) + int(reserved or 0) + int(results or 0)


def _of(project: str | None) -> list[ColumnElement[bool]]:
    return [files.c.project == project] if project is not None else []
