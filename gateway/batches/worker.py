"""The batch worker: claims stored batches and carries each to its end.

A claimed batch moves on from whatever status it was left in, so a batch whose worker died resumes where its
last commit stopped:
  validating   check every line (`lines.validate`) -> in_progress, or failed with the line errors;
  in_progress  run the lines not yet committed through the engines (`LineRunner`), committing results every
               `commit_interval_s` (which also renews the lease and reads the status, so a cancel is seen);
               all done -> finalizing; cancelling -> stop; past `expires_at` -> the rest become batch_expired;
  finalizing / cancelling / past expiry -> `publish` the result files -> completed / cancelled / expired.
A worker claims only while some engine is SERVING, so a batch never waits under a lease for an engine; while none
is, it still claims batches past their completion window, so they end `expired` (with their results so far, and a
batch_expired error line for each line not run) whether or not an engine ever comes back.

Two guarantees beyond that. A batch is finalized only when its committed counts add up to its total (the store
refuses otherwise); a run that ends with lines unaccounted for runs those lines again, and after `MAX_PASSES`
such runs the batch fails with an error saying so. An attempt that ends in an error (a result write that fails,
any other exception) is counted in the batch's record: after `max_failures` of them the batch ends `failed` with
`errors` naming the last one, keeping the results it committed, instead of being claimed again forever. Every
step that can outlast a lease (validating a large file, reading committed results, publishing) renews the lease
while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import structlog
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from gateway.batches import lines
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.batches.lines import InputLine
from gateway.batches.results import ResultSink, committed_custom_ids, publish
from gateway.batches.validation import validate_file
from gateway.engines import EnginePool
from gateway.metrics import GatewayMetrics
from gateway.store.batches import BatchRecord, BatchStatus, BatchStore, Claim, FinalStatus, LeaseLostError
from gateway.store.blobs import BlobStore, upload_key
from gateway.store.ids import BATCH_REQUEST_PREFIX, new_id

log = structlog.get_logger(__name__)

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
MAX_PASSES = 3  # runs of a batch's lines under one claim before lines still without a result fail the batch
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerSettings:
    lease_s: float = 30.0
    window: int | None = None  # engine items in flight per batch; None: twice the engine's max_num_seqs
    max_line_bytes: int = 16 * 1024 * 1024
    poll_interval_s: float = 1.0
    commit_interval_s: float = 0.25
    heartbeat_interval_s: float = 1.0
    max_failures: int = 5  # attempts ending in an error before the batch ends `failed`


class BatchWorker:
    """One worker: one batch at a time. `run` until cancelled; a claim it holds then is released."""

    def __init__(
        self,
        store: BatchStore,
        blobs: BlobStore,
        pool: EnginePool,
        settings: WorkerSettings,
        wake: asyncio.Event,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.pool = pool
        self.settings = settings
        self.wake = wake
        self.metrics = metrics
        self.name = f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(4)}"
        self.runner: LineRunner | None = None  # while lines run, for /metrics

    async def run(self) -> None:
        while True:
            claim = await self._claim()
            with structlog.contextvars.bound_contextvars(batch_id=claim.batch.id, epoch=claim.epoch):
                try:
                    await self.process(claim)
                except LeaseLostError:
                    log.warning("batch lease lost to another worker; leaving the batch to it")
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(self.store.release, claim)
                    raise
                except Exception as exc:
                    await self._record_failure(claim, exc)
                    await asyncio.sleep(self.settings.poll_interval_s)

    async def _claim(self) -> Claim:
        while True:
            serving = self.pool.model_id is not None and self.pool.ready
            try:
                claim = await asyncio.to_thread(self.store.claim_next, self.name, time.time(),
                                                self.settings.lease_s, not serving)
            except SQLAlchemyError:
                log.exception("could not claim batches: the database is unreachable")
                claim = None
            if claim is not None:
                log.info("batch claimed", batch_id=claim.batch.id, status=claim.batch.status)
                return claim
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.settings.poll_interval_s)

    async def _record_failure(self, claim: Claim, exc: Exception) -> None:
        """Count a failed attempt in the batch's record (the batch is resumed after a pause, here or elsewhere,
        until `max_failures`). A lost database connection is not the batch's fault and is not counted: the
        lease runs out and the batch is resumed once the database answers."""
        if isinstance(exc, OperationalError | InterfaceError):
            log.warning("batch work stopped: the database is unreachable; it will be resumed", exc_info=exc)
            return
        error = f"{type(exc).__name__}: {exc}"
        try:
            failures = await asyncio.to_thread(self.store.record_failure, claim, error)
        except LeaseLostError:
            return
        except Exception:
            log.exception("batch work failed, and so did recording it; the lease will run out")
            return
        log.error("batch work failed; it will be resumed", failures=failures, limit=self.settings.max_failures,
                  exc_info=exc)

    async def process(self, claim: Claim) -> None:
        """Carry a claimed batch as far as it goes: to a final status, unless the lease is lost."""
        if claim.batch.failures >= self.settings.max_failures:
            await self._give_up(claim, f"the batch failed {claim.batch.failures} times; the last error was: "
                                       f"{claim.batch.last_error}")
            return
        status: BatchStatus = claim.batch.status
        expired = time.time() >= claim.batch.expires_at
        if status == "validating" and expired:
            await self._leased(claim, asyncio.to_thread(
                publish, self.blobs, self.store, claim, "expired",
                [lines.LineError("batch_expired", "the completion window ended before the batch was validated; "
                                 "none of its requests ran").as_dict()]))
            log.info("batch expired before validation")
            return
        if status == "validating":
            status = await self._validate(claim)
        if status == "in_progress":
            status, expired = await self._run_lines(claim)
            if status == "in_progress" and not expired:
                await self._give_up(claim, f"some lines still had no result after {MAX_PASSES} runs")
                return
        if status == "failed":
            return
        final: FinalStatus = (
            "completed" if status == "finalizing" else "cancelled" if status == "cancelling" else "expired"
        )
        if final == "expired" and not expired:
            raise RuntimeError(f"batch in status {status} cannot be finished")
        await self._leased(claim, asyncio.to_thread(publish, self.blobs, self.store, claim, final))
        log.info("batch finished", status=final)

    async def _give_up(self, claim: Claim, message: str) -> None:
        """End the batch `failed` with `message` in its errors, publishing the results it committed (if even that
        cannot be written, the batch fails without result files, and its errors say so)."""
        errors = [lines.LineError("batch_failed", message).as_dict()]
        log.error("batch failed for good", message=message)
        try:
            await self._leased(claim, asyncio.to_thread(publish, self.blobs, self.store, claim, "failed", errors))
        except LeaseLostError:
            raise
        except Exception as exc:
            errors.append(lines.LineError("results_unwritable", f"its committed results could not be written "
                                          f"either: {type(exc).__name__}: {exc}").as_dict())
            await asyncio.to_thread(self.store.finish, claim, "failed", None, None, errors)

    async def _leased(self, claim: Claim, work: Awaitable[T]) -> T:
        """Await `work`, renewing the claim's lease every third of it meanwhile; LeaseLostError (and `work`
        cancelled) if another worker has claimed the batch."""
        task: asyncio.Future[T] = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.settings.lease_s / 3)
                if done:
                    return task.result()
                try:
                    await asyncio.to_thread(self.store.commit, claim, time.time(), self.settings.lease_s)
                except SQLAlchemyError:
                    log.warning("could not renew the batch lease; trying again", exc_info=True)
        finally:
            if not task.done():
                task.cancel()

    async def _validate(self, claim: Claim) -> BatchStatus:
        batch = claim.batch
        model = self.pool.model_id
        assert model is not None  # claims are made only once an engine answered

        path = self.blobs.path(upload_key(batch.input_file_id))
        try:  # in a child process for a large file: checking lines holds the GIL, which the event loop needs
            total, errors = await self._leased(
                claim, validate_file(path, batch.endpoint, model, self.settings.max_line_bytes))
        except FileNotFoundError:
            total, errors = 0, [lines.LineError("missing_input_file", "the input file was deleted")]
        if errors:
            await asyncio.to_thread(self.store.fail, claim, [e.as_dict() for e in errors])
            log.info("batch failed validation", errors=len(errors), first=errors[0].message)
            return "failed"
        log.info("batch validated", total=total)
        return await asyncio.to_thread(self.store.start, claim, total, model)

    async def _run_lines(self, claim: Claim) -> tuple[BatchStatus, bool]:
        """Run the batch's lines that have no committed result until none is left (at most MAX_PASSES runs);
        (status afterwards, whether it stopped for its expiry)."""
        sink = await asyncio.to_thread(ResultSink, self.blobs, self.store, claim)
        try:
            for attempt in range(1, MAX_PASSES + 1):
                if attempt > 1:  # the lines ran to their end and some still have no result: run those again
                    log.warning("batch lines without a result after a run; running them again", attempt=attempt)
                status, expired = await self._execute(claim, sink)
                if status != "in_progress" or expired:
                    break
        finally:
            sink.close()
        return status, expired

    async def _execute(self, claim: Claim, sink: ResultSink) -> tuple[BatchStatus, bool]:
        """Run the batch's remaining lines; (status afterwards, whether it stopped for its expiry). Lines left
        when the batch expires get a batch_expired error line each, committed like any result. Once every line
        has run, the batch moves to `finalizing`, unless its committed counts fall short of its total (the
        status then stays `in_progress`)."""
        batch = claim.batch
        done = await self._leased(claim, asyncio.to_thread(committed_custom_ids, self.blobs, self.store, batch.id))
        runner = LineRunner(self.pool, batch.model or self.pool.model_id or "", self.settings.window)
        self.runner = runner
        started = time.monotonic()
        try:
            stop = asyncio.Event()
            task = asyncio.create_task(runner.run(self._lines(batch, done), sink.add, stop))
            await self._supervise(sink, task, stop, batch.expires_at)
            finished = task.result()
            status = await self._commit(sink)
            expired = not finished and status == "in_progress" and time.time() >= batch.expires_at
            if expired:
                async for line in self._lines(batch, done | sink.committed_ids):
                    record = lines.unrun_record(new_id(BATCH_REQUEST_PREFIX), line.custom_id, "batch_expired",
                                                EXPIRED_MESSAGE)
                    sink.add(LineResult(line, record, ok=False))
                status = await self._commit(sink)
        finally:
            self.runner = None
        log.info("batch lines stopped", finished=finished, status=status, expired=expired,
                 committed=len(sink.committed_ids), seconds=round(time.monotonic() - started, 1))
        if finished and status == "in_progress":
            status = await asyncio.to_thread(self.store.set_finalizing, claim)
        return status, expired

    async def _supervise(self, sink: ResultSink, task: asyncio.Task[bool], stop: asyncio.Event,
                         expires_at: int) -> None:
        """Commit results while `task` runs, and stop it once the batch is cancelled or expires. A commit that
        fails is retried until the lease is nearly spent; then (or if the lease is lost) the task is cancelled
        and the error raised."""
        last_commit = time.monotonic()
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self.settings.commit_interval_s)
                if not sink.has_pending and time.monotonic() - last_commit < self.settings.heartbeat_interval_s:
                    continue
                try:
                    status = await self._commit(sink)
                    last_commit = time.monotonic()
                except SQLAlchemyError:
                    if time.monotonic() - last_commit > 0.8 * self.settings.lease_s:
                        raise
                    log.warning("commit failed; retrying", exc_info=True)
                    continue
                if status != "in_progress" or time.time() >= expires_at:
                    stop.set()
        except BaseException:
            stop.set()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise

    async def _commit(self, sink: ResultSink) -> BatchStatus:
        results = sink.take()
        status = await asyncio.to_thread(sink.commit, results, self.settings.lease_s)
        if self.metrics is not None:
            for result in results:
                self.metrics.batch_lines.labels("completed" if result.ok else "failed").inc()
        return status

    async def _lines(self, batch: BatchRecord, done: set[str]) -> AsyncIterator[InputLine]:
        """The batch's lines that have no committed result yet, in file order (the file was validated)."""
        with self.blobs.path(upload_key(batch.input_file_id)).open("rb") as f:
            for index, (number, raw) in enumerate(lines.read_lines(f, self.settings.max_line_bytes)):
                if raw is None:
                    raise ValueError(f"line {number} of a validated batch is too long")
                line = lines.parse_line(raw, number, index, batch.endpoint, None)
                if line.custom_id not in done:
                    yield line
