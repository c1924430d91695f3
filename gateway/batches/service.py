"""`BatchService`: everything the files and batches routes need, opened in the app's lifespan.

It opens the database (creating the schema) and the blob directory, and runs the configured number of batch
workers and the sweeper of expired files as tasks of the gateway's event loop. Routers reach it through
`deps.Batches`. The workers share one window per project (`project_window`): however many of a project's batches
run here at once, together they keep at most that many engine items in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog
from opentelemetry import trace
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from gateway import calls
from gateway.batches.results import publish
from gateway.batches.sweeper import FileSweeper
from gateway.batches.worker import BatchWorker, WorkerSettings, leased
from gateway.config import GatewayConfig, default_data_dir
from gateway.engines import EnginePool
from gateway.media import MediaFetcher
from gateway.metrics import GatewayMetrics
from gateway.store.batches import BatchRecord, BatchStore
from gateway.store.blobs import BlobStore
from gateway.store.database import database_url, open_database
from gateway.store.files import FileStore
from gateway.store.pairing import pair

log = structlog.get_logger(__name__)


class BatchService:
    """The file and batch stores, the blob directory and the workers of one gateway."""

    def __init__(self, config: GatewayConfig, pool: EnginePool, metrics: GatewayMetrics,
                 tracer: trace.Tracer | None = None, media: MediaFetcher | None = None) -> None:
        self.config = config
        self.tracer = tracer
        self.media = media  # fetches the images and audio of the lines' messages (None: each run opens its own)
        self.pool = pool
        self.metrics = metrics
        self.data_dir = config.data_dir or default_data_dir()
        self.wake = asyncio.Event()  # set when a batch is created here, so an idle worker claims it at once
        self.claim_turn = asyncio.Lock()  # held by the one idle worker polling the store (BatchWorker._claim)
        self.workers: list[BatchWorker] = []
        self._project_windows: dict[str, asyncio.Semaphore] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._db: Engine | None = None
        self._files: FileStore | None = None
        self._batches: BatchStore | None = None
        self._blobs: BlobStore | None = None

    @property
    def db(self) -> Engine:
        """The database of files, batches and stored responses."""
        assert self._db is not None, "BatchService.start() has not run"
        return self._db

    @property
    def files(self) -> FileStore:
        assert self._files is not None, "BatchService.start() has not run"
        return self._files

    @property
    def batches(self) -> BatchStore:
        assert self._batches is not None, "BatchService.start() has not run"
        return self._batches

    @property
    def blobs(self) -> BlobStore:
        assert self._blobs is not None, "BatchService.start() has not run"
        return self._blobs

    async def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        url = database_url(self.config.database_url, self.data_dir)
        self._db = await asyncio.to_thread(open_database, url)
        self._files = FileStore(self._db)
        self._batches = BatchStore(self._db)
        self._blobs = BlobStore(self.data_dir / "blobs")
        await asyncio.to_thread(pair, self._db, self._blobs)
        await asyncio.to_thread(self._blobs.sweep_temp)
        settings = WorkerSettings(lease_s=self.config.batch_lease_s, window=self.config.batch_window,
                                  max_line_bytes=self.config.max_request_bytes,
                                  project_max_file_bytes=self.config.project_max_file_bytes)
        for _ in range(self.config.batch_workers):
            worker = BatchWorker(self.batches, self.blobs, self.pool, settings, self.wake, self.metrics,
                                 self.project_window, self.claim_turn, self.tracer, self.media)
            self.workers.append(worker)
            self._tasks.append(asyncio.create_task(worker.run(), name=f"batch-worker-{worker.name}"))
        sweeper = FileSweeper(self.files, self.blobs, self.config.file_sweep_interval_s)
        self._tasks.append(asyncio.create_task(sweeper.run(), name="file-sweeper"))
        log.info("files and batches ready", data_dir=str(self.data_dir), database=self._db.url.render_as_string(),
                 workers=len(self.workers))

    async def close(self) -> None:
        """Stop the workers (each releases the batch it holds, so another worker resumes it at once)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._db is not None:
            self._db.dispose()

    def count_by_status(self) -> dict[str, int]:
        """Batches by status, every replica's (from the database); AssertionError before `start`."""
        return self.batches.count_by_status()

    def project_window(self, project: str) -> asyncio.Semaphore:
        """The window `project`'s batches share in this gateway, made on first use: `batch_project_window`
        permits, or the batch window times the number of engines known then."""
        window = self._project_windows.get(project)
        if window is None:
            size = self.config.batch_project_window or (
                (self.config.batch_window or calls.in_flight_window(self.pool.model_info()))
                * max(1, len(self.pool.engines)))
            window = self._project_windows[project] = asyncio.Semaphore(size)
        return window

    def lines_in_flight(self) -> int:
        return sum(w.runner.in_flight for w in self.workers if w.runner is not None)

    async def cancel(self, batch_id: str) -> BatchRecord | None:
        """Ask for a batch to be cancelled. A batch no worker holds is finished here and now (its results
        published in a thread under a renewed lease, like a worker's); one a worker holds is stopped by that
        worker within a second or so. The record afterwards; None if unknown. A storage error while publishing
        leaves the batch `cancelling` for a worker to finish."""
        record = await asyncio.to_thread(self.batches.request_cancel, batch_id)
        if record is None or record.status != "cancelling" or record.leased(time.time()):
            return record
        lease_s = self.config.batch_lease_s
        claim = await asyncio.to_thread(self.batches.claim, batch_id, "api", time.time(), lease_s)
        if claim is not None:
            try:
                await leased(self.batches, claim, asyncio.to_thread(publish, self.blobs, self.batches, claim,
                                                                    "cancelled"), lease_s)
            except (OSError, SQLAlchemyError):
                log.warning("could not publish a cancelled batch's results; a worker will", batch_id=batch_id,
                            exc_info=True)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.batches.release, claim)
                self.wake.set()
        return await asyncio.to_thread(self.batches.get, batch_id)
