"""`FileSweeper`: deletes the files whose `expires_at` has passed, record first, then bytes; and, less often, the
blobs that no record owns any more.

A file that an unfinished batch reads as its input is left until that batch ends (`FileStore.expired` skips it,
and `FileStore.remove` refuses it should a batch be created on it in between). Every gateway sweeps; on a shared
database two sweepers may pick the same file, and the one that does not delete the record leaves it alone.

Orphans (`sweep_orphans`, every `orphan_interval_s`): a crash, or a failed write, between writing bytes and
recording them (or between deleting a record and its bytes) leaves bytes no record names. Deleted, once last
written more than `orphan_age_s` ago (so never a blob whose record is being created right now): an upload blob
(`files/<id>`) without a file record; in a batch's directory, a file no record names (segments a publish did
not get to delete, a result file whose batch failed before recording it), only once the batch has finished or
has no record (never a segment of a batch that may still run); temporary files; reservations that lapsed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import get_args

import structlog
from sqlalchemy.exc import SQLAlchemyError

from gateway.store.batches import FinalStatus
from gateway.store.blobs import BlobStore, batch_dir_key
from gateway.store.files import FileInUseError, FileStore

log = structlog.get_logger(__name__)

SWEEP_PAGE = 100  # records read per query
ORPHAN_PAGE = 500  # blob keys or batch ids looked up per query
ORPHAN_AGE_S = 3600.0  # a blob this long untouched and unrecorded is no write in progress
ORPHAN_INTERVAL_S = 600.0  # orphans are rare: listing the blob directory every few minutes is enough
FINISHED_STATUSES = frozenset(get_args(FinalStatus))


@dataclass
class OrphanCounts:
    uploads: int = 0  # files/<id> without a record
    batch_files: int = 0  # segments and result files of finished (or unknown) batches without a record
    temp: int = 0
    reservations: int = 0

    def total(self) -> int:
        return self.uploads + self.batch_files + self.temp + self.reservations


class FileSweeper:
    """Deletes expired files every `interval_s` seconds, and orphaned blobs every `orphan_interval_s`, while `run`
    runs."""

    def __init__(
        self, files: FileStore, blobs: BlobStore, interval_s: float, orphan_interval_s: float = ORPHAN_INTERVAL_S,
        orphan_age_s: float = ORPHAN_AGE_S,
    ) -> None:
        self.files = files
        self.blobs = blobs
        self.interval_s = interval_s
        self.orphan_interval_s = orphan_interval_s
        self.orphan_age_s = orphan_age_s

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

    def sweep_orphans(self) -> OrphanCounts:
        """Delete the blobs no record names that were last written more than `orphan_age_s` ago (see the module
        docstring for which), lapsed reservations and old temporary files. Blocking."""
        counts = OrphanCounts(temp=self.blobs.sweep_temp(self.orphan_age_s),
                              reservations=self.files.drop_lapsed_reservations(time.time()))
        for keys in _pages(self.blobs.old_uploads(self.orphan_age_s)):
            counts.uploads += self._delete_unrecorded(keys)
        for batch_ids in _pages(self.blobs.batch_ids()):
            statuses = self.files.batch_statuses(batch_ids)
            for batch_id in batch_ids:
                status = statuses.get(batch_id)
                if status is not None and status not in FINISHED_STATUSES:
                    continue  # it may still run: its segments are its results
                counts.batch_files += self._delete_unrecorded(list(self.blobs.old_batch_files(batch_id,
                                                                                              self.orphan_age_s)))
                self.blobs.remove_dir_if_empty(batch_dir_key(batch_id))
        return counts

    def _delete_unrecorded(self, keys: list[str]) -> int:
        unknown = self.files.unknown_blob_keys(keys) if keys else set()
        for key in unknown:
            self.blobs.delete(key)
        return len(unknown)

    async def run(self) -> None:
        """Sweep, then wait `interval_s`, until cancelled (orphans at the first pass and every
        `orphan_interval_s`); a database or disk error is logged and the next sweep tried."""
        next_orphan_sweep = 0.0
        while True:
            try:
                deleted = await asyncio.to_thread(self.sweep)
                if deleted:
                    log.info("expired files deleted", files=deleted)
            except (SQLAlchemyError, OSError):
                log.exception("could not delete expired files; trying again later")
            if time.monotonic() >= next_orphan_sweep:
                next_orphan_sweep = time.monotonic() + self.orphan_interval_s
                try:
                    orphans = await asyncio.to_thread(self.sweep_orphans)
                    if orphans.total():
                        log.info("orphaned blobs deleted", **vars(orphans))
                except (SQLAlchemyError, OSError):
                    log.exception("could not delete orphaned blobs; trying again later")
            await asyncio.sleep(self.interval_s)


def _pages(items: Iterable[str]) -> Iterator[list[str]]:
    iterator = iter(items)
    while page := list(itertools.islice(iterator, ORPHAN_PAGE)):
        yield page
