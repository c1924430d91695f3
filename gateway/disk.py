"""Disk isolation at the HTTP edge: the global free-space floor (507) and an upload's hold on its project's quota.

An upload reserves its declared size (or, for a chunked body, one `RESERVE_STEP_BYTES` step at a time as it
grows) in the database before any of its bytes is written (`FileStore.reserve`, under the project's lock), so the
bytes on disk of a project's files and uploads in progress never pass its quota, however many uploads race, on
however many gateways share the database. The reservation is renewed while the upload runs and lapses
`RESERVATION_TTL_S` after its gateway stops renewing it (a gateway killed mid-upload holds nothing for long).

The floor is a file-system-wide margin: below `min_free_bytes` free on the blob directory's file system, new
uploads (and each step of a running one) and new batches are refused with 507 `insufficient_storage`, before the
disk is full for everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import structlog

from gateway.errors import APIError
from gateway.store.blobs import BlobStore
from gateway.store.files import FileStore, ProjectLimitError

log = structlog.get_logger(__name__)

RESERVE_STEP_BYTES = 4 * 1024 * 1024  # a chunked upload's reservation grows by this much at a time
RESERVATION_TTL_S = 60.0  # a reservation nobody renewed for this long counts for nothing
RENEW_EVERY_S = RESERVATION_TTL_S / 4
RESERVATION_PREFIX = "upload-"


def insufficient_storage(free: int, floor: int) -> APIError:
    return APIError(507, f"The server is low on storage ({free // 2**20} MiB free, below its floor of "
                    f"{floor // 2**20} MiB); try again later.", type="server_error", code="insufficient_storage")


def require_free_space(blobs: BlobStore, min_free_bytes: int) -> None:
    """507 `insufficient_storage` if the blob directory's file system has less than `min_free_bytes` free (0:
    never). Blocking, but one statvfs call."""
    if min_free_bytes > 0:
        free = blobs.free_bytes()
        if free < min_free_bytes:
            raise insufficient_storage(free, min_free_bytes)


def storage_limit(exc: ProjectLimitError) -> APIError:
    # OpenAI answers a full file storage with a 400 as well.
    return APIError(400, f"Project {exc.project} has reached its file storage limit: {exc.used} of {exc.limit} "
                    "bytes are stored or being uploaded. Delete files to make room.", param="file",
                    code="storage_limit_exceeded")


class UploadQuota:
    """One upload's hold on disk: its reservation against `project`'s quota (`limit` bytes; None: no quota, then
    only the floor applies) and the free-space floor. `ensure` is called, blocking, before bytes are written."""

    def __init__(
        self, files: FileStore, blobs: BlobStore, project: str, limit: int | None, max_file_bytes: int,
        min_free_bytes: int, reservation: str,
    ) -> None:
        self.files = files
        self.blobs = blobs
        self.project = project
        self.limit = limit
        self.max_file_bytes = max_file_bytes
        self.min_free_bytes = min_free_bytes
        self.id = reservation
        self.held = 0  # bytes the upload may write without asking again

    def start(self, declared: int | None) -> None:
        """Take the first hold: `declared` bytes (a body with a Content-Length; refused at once if they do not
        fit), or one step (a chunked body). 507 below the floor, 400 `storage_limit_exceeded` over the quota."""
        require_free_space(self.blobs, self.min_free_bytes)
        if declared is not None:
            self._take(need=declared, want=declared)
        else:
            self._take(need=0, want=min(RESERVE_STEP_BYTES, self.max_file_bytes))

    def ensure(self, total: int) -> None:
        """Make sure the upload holds at least `total` bytes (what it will have written after the next write),
        growing the hold by a step if it does not; refused as in `start`."""
        if total <= self.held:
            return
        require_free_space(self.blobs, self.min_free_bytes)
        self._take(need=total, want=min(max(total, self.held + RESERVE_STEP_BYTES), self.max_file_bytes))

    def _take(self, need: int, want: int) -> None:
        if self.limit is None:
            self.held = max(need, want)
            return
        try:
            self.held = self.files.reserve(self.id, self.project, want, need, self.limit, time.time(),
                                           RESERVATION_TTL_S)
        except ProjectLimitError as exc:
            raise storage_limit(exc) from None

    def release(self) -> None:
        """Give the hold back (a no-op once `FileStore.add` replaced it by the file's record). Blocking."""
        if self.limit is not None:
            self.files.release(self.id)

    @contextlib.asynccontextmanager
    async def renewed(self) -> AsyncIterator[None]:
        """Renew the reservation every `RENEW_EVERY_S` while the block runs; release it when the block ends (in
        a thread; a cancelled block hands the release to a thread without waiting for it)."""
        renewer = asyncio.create_task(self._renew_forever(), name=f"renew-{self.id}")
        try:
            yield
        except BaseException as exc:
            renewer.cancel()
            if not isinstance(exc, Exception):  # cancelled: nothing more may be awaited
                asyncio.get_running_loop().run_in_executor(None, self.release)
                raise
            await asyncio.to_thread(self.release)
            raise
        renewer.cancel()
        await asyncio.to_thread(self.release)

    async def _renew_forever(self) -> None:
        if self.limit is None:
            return
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            try:
                if not await asyncio.to_thread(self.files.renew, self.id, time.time(), RESERVATION_TTL_S):
                    # Lapsed (the loop or the database stalled past the TTL): its bytes may have gone to others,
                    # so the next write asks again for all of them.
                    self.held = 0
            except Exception:
                log.exception("could not renew an upload's reservation; trying again", reservation=self.id)
