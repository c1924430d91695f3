"""The batch worker: claims stored batches and carries each to its end.

A claimed batch moves on from whatever status it was left in, so a batch whose worker died resumes where its
last commit stopped:
  validating   check every line (`lines.validate`) -> in_progress, or failed with the line errors;
  in_progress  run the lines not yet committed through the engines (`LineRunner`), committing results every
               `commit_interval_s` (which also renews the lease and reads the status, so a cancel is seen);
               all done -> finalizing; cancelling -> stop; past `expires_at` -> the rest become batch_expired;
  finalizing / cancelling / past expiry -> `publish` the result files -> completed / cancelled / expired.
A gateway runs several workers, each carrying one batch at a time; claims go round-robin by project
(`BatchStore.claim_next`), and the lines in flight of one project's batches share one window (`project_window`),
so one project's batches neither hold every worker nor fill an engine's queue. A worker claims only while some
engine is SERVING, so a batch never waits under a lease for an engine; while none is, it still claims the batches
that need none (cancelling, finalizing, or past their completion window), so they end (expired ones with their
results so far, and a batch_expired error line for each line not run) whether or not an engine ever comes back.

Guarantees beyond that. A batch is finalized only when its committed counts add up to its total (the store
refuses otherwise); a run that ends with lines unaccounted for runs those lines again, and after `MAX_PASSES`
such runs the batch fails with an error saying so. An attempt that ends in an error is recorded in the batch: a
storage error (an OSError such as a full disk, or a database that cannot be reached) is no fault of the batch,
so it is not counted, and the batch is claimed again after an exponentially growing pause, for as long as it
takes; any other error is counted, and after `max_failures` of them the batch ends `failed` with `errors`
naming the last one. A batch whose committed results cannot be written yet is never finished without them: its
publishing is retried like a storage error. A batch that keeps losing its workers without recording progress or
an error (killed for memory, say) ends `failed` after `max_unfinished_claims` such claims. Result bytes count
against the project's storage quota: a batch whose results would pass it stops `failed` with what it committed
and `storage_limit_exceeded` in `errors`. Every step that can outlast a lease (validating a large file, reading
committed results, writing out an expired batch's remaining lines, publishing) renews the lease while it runs,
and reading the input (skipping the lines already done on a resume) happens off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import structlog
from opentelemetry import trace
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from gateway import calls
from gateway.batches import lines
from gateway.batches.attempts import AttemptLimits
from gateway.batches.input_reader import pending_lines
from gateway.batches.line_runner import BACKOFF_S, MAX_BACKOFF_S, LineResult, LineRunner
from gateway.batches.lines import InputLine
from gateway.batches.results import ResultSink, committed_custom_ids, publish
from gateway.batches.validation import validate_file
from gateway.engines import EnginePool
from gateway.media import MediaFetcher
from gateway.metrics import GatewayMetrics
from gateway.store.batches import BatchRecord, BatchStatus, BatchStore, Claim, FinalStatus, LeaseLostError
from gateway.store.blobs import BlobStore, upload_key
from gateway.store.files import ProjectLimitError
from gateway.store.ids import BATCH_REQUEST_PREFIX, new_id
from gateway.translate.cache_salt import project_cache_salt

log = structlog.get_logger(__name__)

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
MAX_PASSES = 3  # runs of a batch's lines under one claim before lines still without a result fail the batch
EXPIRY_COMMIT_LINES = 1000  # batch_expired lines written between two commits (each renews the lease)
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerSettings:
    lease_s: float = 30.0
    window: int | None = None  # engine items in flight per batch; None: twice the engine's max_num_seqs
    max_line_bytes: int = 16 * 1024 * 1024
    poll_interval_s: float = 1.0
    commit_interval_s: float = 0.25
    heartbeat_interval_s: float = 1.0
    max_failures: int = 5  # attempts ending in an error (not a storage error) before the batch ends `failed`
    max_unfinished_claims: int = 5  # claims lost without progress or a recorded error before it ends `failed`
    retry_base_s: float = 1.0  # pause after the first storage error; doubled after each, up to retry_max_s
    retry_max_s: float = 300.0
    call_backoff_s: float = BACKOFF_S  # pause after a failed Batch call; doubled after each in a row, up to the max
    call_backoff_max_s: float = MAX_BACKOFF_S
    attempt_limits: AttemptLimits = field(default_factory=AttemptLimits)
    project_max_file_bytes: int | None = None  # the quota result bytes count against (None: none)


class BatchWorker:
    """One worker: one batch at a time. `run` until cancelled; a claim it holds then is released.
    `project_window(project)` is the window shared by the project's batches (None: each batch's own only)."""

    def __init__(
        self,
        store: BatchStore,
        blobs: BlobStore,
        pool: EnginePool,
        settings: WorkerSettings,
        wake: asyncio.Event,
        metrics: GatewayMetrics | None = None,
        project_window: Callable[[str], asyncio.Semaphore] | None = None,
        claim_turn: asyncio.Lock | None = None,
        tracer: trace.Tracer | None = None,
        media: MediaFetcher | None = None,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.pool = pool
        self.settings = settings
        self.wake = wake
        self.metrics = metrics
        self.project_window = project_window
        self.claim_turn = claim_turn or asyncio.Lock()
        self.tracer = tracer  # a span per claim run, parent of its Batch calls' engine spans
        self.media = media  # fetches the lines' images and audio (None: each run opens its own, default limits)
        self.name = f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(4)}"
        self.runner: LineRunner | None = None  # while lines run, for /metrics

    async def run(self) -> None:
        while True:
            claim = await self._claim()
            with structlog.contextvars.bound_contextvars(batch_id=claim.batch.id, epoch=claim.epoch):
                try:
                    with self.metrics.working() if self.metrics is not None else contextlib.nullcontext(), \
                            self._traced(claim):
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

    @contextlib.contextmanager
    def _traced(self, claim: Claim) -> Iterator[None]:
        """The claim's run as a span (when tracing), and its batch id for the engine's spans."""
        token = calls.batch_id.set(claim.batch.id)
        try:
            if self.tracer is None:
                yield
                return
            attributes: dict[str, str | int] = {"ladle.batch_id": claim.batch.id, "ladle.project": claim.batch.project,
                          "ladle.batch.epoch": claim.epoch}
            with self.tracer.start_as_current_span("batch", attributes=attributes):
                yield
        finally:
            calls.batch_id.reset(token)

    async def _claim(self) -> Claim:
        """The next batch this worker runs. Idle workers sharing `claim_turn` take turns at polling the store:
        one polls (every `poll_interval_s`, or at once on `wake`) while the others wait for the turn, which passes
        as soon as that one has claimed a batch (four workers each polling cost ~2% of a core, idle)."""
        async with self.claim_turn:
            return await self._poll_for_claim()

    async def _poll_for_claim(self) -> Claim:
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
        """Record a failed attempt in the batch (it is resumed, here or elsewhere): counted towards
        `max_failures`, unless it is a storage error (an OSError: a full disk, say; not a missing file), which is
        not the batch's fault: that one is retried after a pause that doubles each time. A lost database
        connection cannot be recorded at all: the lease runs out and the batch is resumed once it answers."""
        if isinstance(exc, OperationalError | InterfaceError):
            log.warning("batch work stopped: the database is unreachable; it will be resumed", exc_info=exc)
            return
        error = f"{type(exc).__name__}: {exc}"
        transient = isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)  # waiting won't bring it back
        pause = min(self.settings.retry_max_s, self.settings.retry_base_s * 2 ** claim.batch.transient_failures)
        try:
            failures = await asyncio.to_thread(self.store.record_failure, claim, error, transient=transient,
                                               retry_at=time.time() + pause if transient else None)
        except LeaseLostError:
            return
        except Exception:
            log.exception("batch work failed, and so did recording it; the lease will run out")
            return
        if transient:
            log.warning("batch work stopped by a storage error; it will be resumed", storage_errors=failures,
                        pause_s=pause, error=error)
        else:
            log.error("batch work failed; it will be resumed", failures=failures, limit=self.settings.max_failures,
                      exc_info=exc)

    async def process(self, claim: Claim) -> None:
        """Carry a claimed batch as far as it goes: to a final status, unless the lease is lost."""
        if claim.batch.failures >= self.settings.max_failures:
            await self._give_up(claim, f"the batch failed {claim.batch.failures} times; the last error was: "
                                       f"{claim.batch.last_error}")
            return
        if claim.batch.unfinished_claims > self.settings.max_unfinished_claims:
            await self._give_up(claim, f"the workers running this batch stopped {claim.batch.unfinished_claims - 1} "
                                       "times without recording progress or an error (killed, e.g. for memory)")
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
            try:
                status, expired = await self._run_lines(claim)
            except ProjectLimitError as exc:
                await self._give_up(claim, f"the batch's results would take project {exc.project} past its storage "
                                           f"limit of {exc.limit} bytes; the results committed until then are "
                                           "kept", code="storage_limit_exceeded")
                return
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

    async def _give_up(self, claim: Claim, message: str, code: str = "batch_failed") -> None:
        """End the batch `failed` with `message` in its errors, publishing the results it committed. A storage
        error while publishing is raised (the batch is tried again later, its results kept); only results that
        can no longer be read back (a segment shorter than its committed length) let it fail without them, and
        its errors then say so."""
        errors = [lines.LineError(code, message).as_dict()]
        log.error("batch failed for good", message=message)
        try:
            await self._leased(claim, asyncio.to_thread(publish, self.blobs, self.store, claim, "failed", errors))
        except (LeaseLostError, OSError, SQLAlchemyError):
            raise
        except Exception as exc:
            errors.append(lines.LineError("results_unwritable", f"its committed results could not be read back: "
                                          f"{type(exc).__name__}: {exc}").as_dict())
            await asyncio.to_thread(self.store.finish, claim, "failed", None, None, errors)

    async def _leased(self, claim: Claim, work: Awaitable[T]) -> T:
        return await leased(self.store, claim, work, self.settings.lease_s)

    async def _validate(self, claim: Claim) -> BatchStatus:
        batch = claim.batch
        model = self.pool.model_id
        assert model is not None  # claims are made only once an engine answered

        path = self.blobs.path(upload_key(batch.input_file_id))
        try:  # in a child process for a large file: checking lines holds the GIL, which the event loop needs
            total, errors = await self._leased(
                claim, validate_file(path, batch.endpoint, model, self.settings.max_line_bytes,
                                     info=self.pool.model_info(), adapters=[a.name for a in self.pool.adapters()]))
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
        window = self.project_window(batch.project) if self.project_window is not None else None
        failures = await asyncio.to_thread(self.store.line_failures, batch.id)
        runner = LineRunner(self.pool, batch.model or self.pool.model_id or "", self.settings.window,
                            cache_salt=project_cache_salt(batch.project), project_window=window,
                            limits=self.settings.attempt_limits, failures=failures, on_failure=sink.note_failure,
                            backoff_s=self.settings.call_backoff_s, max_backoff_s=self.settings.call_backoff_max_s,
                            media=self.media)
        self.runner = runner
        started = time.monotonic()
        try:
            stop = asyncio.Event()
            task = asyncio.create_task(runner.run(self._lines(batch, done), sink.add, stop))
            await self._supervise(sink, task, stop, batch.expires_at)
            finished = task.result()
            status = await self._commit(sink)
            # Past the window and not finalizing yet: expired, even if every line has run (an earlier claim may
            # have written batch_expired lines and died before publishing).
            expired = status == "in_progress" and time.time() >= batch.expires_at
            if expired:
                async for line in self._lines(batch, done | sink.committed_ids):
                    record = lines.unrun_record(new_id(BATCH_REQUEST_PREFIX), line.custom_id, "batch_expired",
                                                EXPIRED_MESSAGE)
                    sink.add(LineResult(line, record, ok=False))
                    if sink.pending >= EXPIRY_COMMIT_LINES:
                        await self._commit(sink)  # and renews the lease: a large remainder outlasts one
                status = await self._commit(sink)
        finally:
            self.runner = None
        log.info("batch lines stopped", finished=finished, status=status, expired=expired,
                 committed=len(sink.committed_ids), seconds=round(time.monotonic() - started, 1))
        if finished and status == "in_progress" and not expired:
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
        status = await asyncio.to_thread(sink.commit, results, self.settings.lease_s,
                                         self.settings.project_max_file_bytes)
        if self.metrics is not None:
            batch = sink.claim.batch
            model = batch.model or self.pool.model_id or ""
            for result in results:
                self.metrics.batch_lines.labels("completed" if result.ok else "failed").inc()
                if result.usage:  # counted for the line's LoRA adapter, if it names one
                    line_model = lines.line_adapter(result.line, model) or model
                    self.metrics.usage.record(batch.project, line_model, "batch", result.usage)
        return status

    def _lines(self, batch: BatchRecord, done: set[str]) -> AsyncIterator[InputLine]:
        """The batch's lines that have no committed result yet, in file order (the file was validated), read off
        the event loop."""
        return pending_lines(self.blobs.path(upload_key(batch.input_file_id)), batch.endpoint, done)


async def leased(store: BatchStore, claim: Claim, work: Awaitable[T], lease_s: float) -> T:
    """Await `work`, renewing the claim's lease every third of `lease_s` meanwhile; LeaseLostError (and `work`
    cancelled) if another worker has claimed the batch."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=lease_s / 3)
            if done:
                return task.result()
            try:
                await asyncio.to_thread(store.commit, claim, time.time(), lease_s)
            except SQLAlchemyError:
                log.warning("could not renew the batch lease; trying again", exc_info=True)
    finally:
        if not task.done():
            task.cancel()
