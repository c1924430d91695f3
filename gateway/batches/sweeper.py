"""`FileSweeper`: deletes the files whose `expires_at` has passed, record first, then bytes.

A file that an unfinished batch reads as its input is left until that batch ends (`FileStore.expired` skips it,
and `FileStore.remove` refuses it should a batch be created on it in between). Every gateway sweeps; on a shared
database two sweepers may pick the same file, and the one that does not delete the record leaves it alone.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from sqlalchemy.exc import SQLAlchemyError

from gateway.store.blobs import BlobStore
from gateway.store.files import FileInUseError, FileStore

log = structlog.get_logger(__name__)

SWEEP_PAGE = 100  # records read per query


class FileSweeper:
    """Deletes expired files every `interval_s` seconds while `run` runs."""

    def __init__(self, files: FileStore, blobs: BlobStore, interval_s: float) -> None:
        self.files = files
        self.blobs = blobs
        self.interval_s = interval_s

    def sweep(self, now: int | None = None) -> int:
        """Delete every file expired by `now` (default: the present) that no unfinished batch reads; how many.
        Blocking."""
        now = int(time.time()) if now is None else now
        deleted = 0
        while True:
            expired = self.files.expired(now, SWEEP_PAGE)
            progress = 0
            for record in expired:
                try:
                    removed = self.files.remove(record.id)
                except FileInUseError:
                    continue  # a batch was created on it since it was listed; swept once that batch ends
                if removed is not None:
                    self.blobs.delete(removed.blob_key)
                    deleted += 1
                    progress += 1
            if len(expired) < SWEEP_PAGE or not progress:
                return deleted

    async def run(self) -> None:
        """Sweep, then wait `interval_s`, until cancelled; a database error is logged and the next sweep tried."""
        while True:
            try:
                deleted = await asyncio.to_thread(self.sweep)
                if deleted:
                    log.info("expired files deleted", files=deleted)
            except (SQLAlchemyError, OSError):
                log.exception("could not delete expired files; trying again later")
            await asyncio.sleep(self.interval_s)
