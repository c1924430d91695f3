"""Batch records and the lease protocol that lets any number of workers share them safely.

A worker `claim`s a batch that is active and not leased (or whose lease expired): the claim increments
`lease_epoch`, and every later write of that worker is fenced by its epoch, so once another worker has claimed
the batch, the first can no longer change it (LeaseLostError). Progress is committed per group of results, in
one transaction with the committed lengths of the claim's segment files: counts and files never disagree.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import Connection, Engine, Row, case, delete, func, insert, or_, select, update

from gateway.store.database import lock_project
from gateway.store.files import FileRecord, ProjectLimitError, used_bytes
from gateway.store.pages import page
from gateway.store.tables import DEFAULT_PROJECT, batches, files, line_failures, segments

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
ACTIVE_STATUSES: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE_STATUSES: tuple[BatchStatus, ...] = ("validating", "in_progress")
FinalStatus = Literal["failed", "completed", "expired", "cancelled"]


@dataclass(frozen=True)
class BatchRecord:
    """One batch as stored (see tables.batches for the columns)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    model: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, int | None] = field(default_factory=dict)  # in_progress_at ... cancelled_at
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    lease_expires_at: float | None = None
    failures: int = 0
    last_error: str | None = None
    project: str = DEFAULT_PROJECT
    output_expires_after_s: int | None = None  # the lifetime of its output and error files
    unfinished_claims: int = 0  # claims since it last made progress or was released (tables.batches)
    transient_failures: int = 0

    @classmethod
    def from_row(cls, row: Any) -> BatchRecord:
        times = {name: getattr(row, name) for name in _TIME_COLUMNS}
        return cls(
            id=row.id, endpoint=row.endpoint, input_file_id=row.input_file_id,
            completion_window=row.completion_window, status=row.status, created_at=row.created_at,
            expires_at=row.expires_at, metadata=json.loads(row.metadata_json) if row.metadata_json else None,
            errors=json.loads(row.errors_json) if row.errors_json else None, model=row.model,
            output_file_id=row.output_file_id, error_file_id=row.error_file_id, times=times, total=row.total,
            completed=row.completed, failed=row.failed, prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens, cached_tokens=row.cached_tokens,
            reasoning_tokens=row.reasoning_tokens, lease_expires_at=row.lease_expires_at, failures=row.failures,
            last_error=row.last_error,
            project=row.project,
            output_expires_after_s=row.output_expires_after_s,
            unfinished_claims=row.unfinished_claims, transient_failures=row.transient_failures,
        )

    def result_file(self, file_id: str, filename: str, purpose: str, size: int, blob_key: str) -> FileRecord:
        """The record of one of this batch's result files, made now: in the batch's project, expiring
        `output_expires_after_s` from now."""
        now = int(time.time())
        expires_at = now + self.output_expires_after_s if self.output_expires_after_s is not None else None
        return FileRecord(file_id, filename, purpose, size, now, blob_key, self.project, expires_at)

    def leased(self, now: float) -> bool:
        return self.lease_expires_at is not None and self.lease_expires_at >= now


_TIME_COLUMNS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
                 "cancelled_at")


@dataclass(frozen=True)
class Claim:
    """A worker's hold on one batch: the batch as it was when claimed and the epoch that fences its writes."""

    batch: BatchRecord
    epoch: int


@dataclass(frozen=True)
class Segment:
    """The committed lengths of one claim's result files."""

    epoch: int
    output_bytes: int
    error_bytes: int


@dataclass(frozen=True)
class Progress:
    """What one claim has committed, all absolute: its segment files' lengths and the lines and tokens they
    hold. A commit sets these (it never adds them), so repeating one whose acknowledgement was lost changes
    nothing."""

    output_bytes: int
    error_bytes: int
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class LineFailures:
    """A line's failed attempts so far (gateway.batches.attempts): all of them, those in a call of its own, and
    the last one's reason."""

    failures: int
    failures_alone: int
    last_error: str


class LeaseLostError(Exception):
    """Another worker has claimed the batch since this claim: stop working on it, write nothing more."""


class BatchStore:
    """Batch records in the database. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    # -- the API's side --------------------------------------------------------------------------------------

    def create(
        self, batch_id: str, endpoint: str, input_file_id: str, completion_window: str, window_s: int,
        metadata: dict[str, str] | None, *, project: str = DEFAULT_PROJECT, max_active: int | None = None,
        output_expires_after_s: int | None = None,
    ) -> BatchRecord | None:
        """Insert a `validating` batch of `project`; None if its input file does not exist (any more) in that
        project. ProjectLimitError if the project already has `max_active` unfinished batches."""
        now = int(time.time())
        with self.db.begin() as c:
            found = c.execute(
                select(files.c.id).where(files.c.id == input_file_id, files.c.project == project).with_for_update()
            ).first()
            if found is None:
                return None
            if max_active is not None:
                lock_project(c, project)
                active = c.execute(select(func.count()).select_from(batches).where(
                    batches.c.project == project, batches.c.status.in_(ACTIVE_STATUSES))).scalar_one()
                if active >= max_active:
                    raise ProjectLimitError(project, max_active, active)
            c.execute(insert(batches).values(
                id=batch_id, endpoint=endpoint, input_file_id=input_file_id, completion_window=completion_window,
                status="validating", metadata_json=json.dumps(metadata) if metadata else None, created_at=now,
                expires_at=now + window_s, total=0, completed=0, failed=0, prompt_tokens=0, completion_tokens=0,
                cached_tokens=0, lease_epoch=0, project=project, output_expires_after_s=output_expires_after_s,
            ))
            return self._get(c, batch_id)

    def get(self, batch_id: str, project: str | None = None) -> BatchRecord | None:
        """The batch (None: there is none, or it is not `project`'s)."""
        with self.db.begin() as c:
            record = self._get(c, batch_id)
        return record if record is not None and project in (None, record.project) else None

    def list_page(self, limit: int, after: str | None, project: str | None = None) -> tuple[list[BatchRecord], bool]:
        """Newest first (of `project`'s, when given). UnknownCursorError if `after` is not a batch id (there)."""
        scope = [batches.c.project == project] if project is not None else []
        with self.db.begin() as c:
            result = page(c, batches, limit, after, "desc", scope=scope)
        return [BatchRecord.from_row(r) for r in result.rows], result.has_more

    def request_cancel(self, batch_id: str) -> BatchRecord | None:
        """Move a validating or in-progress batch to `cancelling` (a worker then stops it); other statuses are
        left as they are. The record afterwards, or None if there is no such batch."""
        with self.db.begin() as c:
            c.execute(
                update(batches)
                .where(batches.c.id == batch_id, batches.c.status.in_(CANCELLABLE_STATUSES))
                .values(status="cancelling", cancelling_at=int(time.time()))
            )
            return self._get(c, batch_id)

    def count_by_status(self) -> dict[str, int]:
        with self.db.begin() as c:
            rows = c.execute(select(batches.c.status, func.count()).group_by(batches.c.status))
            return {status: count for status, count in rows}

    # -- the workers' side -----------------------------------------------------------------------------------

    def claim_next(self, owner: str, now: float, lease_s: float, engine_free_only: bool = False) -> Claim | None:
        """Claim the next batch to run, if any, round-robin by project: of the projects with an active batch that
        no live lease holds (and whose retry pause is over), the one with the fewest batches under a live lease,
        then the one claimed from least recently; its oldest such batch. With `engine_free_only`, only a batch
        that needs no engine to end (cancelling, finalizing, or past its completion window). `owner` names the
        worker (for people reading the table)."""
        runnable = [batches.c.status.in_(ACTIVE_STATUSES), _lease_free(now),
                    or_(batches.c.next_attempt_at.is_(None), batches.c.next_attempt_at <= now)]
        if engine_free_only:
            runnable.append(or_(batches.c.status.in_(("cancelling", "finalizing")), batches.c.expires_at <= now))
        active = batches.c.status.in_(ACTIVE_STATUSES)
        projects = (  # over finished batches too: a project served a moment ago waits behind one not served yet
            select(batches.c.project,
                   func.sum(case((active & (batches.c.lease_expires_at >= now), 1), else_=0)).label("running"),
                   func.coalesce(func.max(batches.c.claimed_at), 0.0).label("served"))
            .where(batches.c.project.in_(select(batches.c.project).where(active)))
            .group_by(batches.c.project)
            .subquery()
        )
        with self.db.begin() as c:
            candidates = c.execute(
                select(batches.c.id)
                .join(projects, projects.c.project == batches.c.project)
                .where(*runnable)
                .order_by(projects.c.running, projects.c.served, batches.c.pk)
                .limit(8)
            ).scalars().all()
        for batch_id in candidates:
            claim = self.claim(batch_id, owner, now, lease_s)
            if claim is not None:
                return claim
        return None

    def claim(self, batch_id: str, owner: str, now: float, lease_s: float) -> Claim | None:
        """Claim one batch if it is active and not leased; None otherwise (someone else got there first)."""
        with self.db.begin() as c:
            result = c.execute(
                update(batches)
                .where(batches.c.id == batch_id, batches.c.status.in_(ACTIVE_STATUSES), _lease_free(now))
                .values(lease_epoch=batches.c.lease_epoch + 1, lease_expires_at=now + lease_s, lease_owner=owner,
                        claimed_at=now, unfinished_claims=batches.c.unfinished_claims + 1)
            )
            if result.rowcount != 1:
                return None
            row = c.execute(select(batches).where(batches.c.id == batch_id)).one()
        return Claim(BatchRecord.from_row(row), row.lease_epoch)

    def commit(
        self, claim: Claim, now: float, lease_s: float, progress: Progress | None = None, *,
        progressed: bool = False, max_project_bytes: int | None = None,
        failed_lines: dict[str, LineFailures] | None = None,
    ) -> BatchStatus:
        """Extend the lease and, with `progress`, record it; the batch's status now (a cancel shows up here).
        `progressed`: the progress holds new results (the batch is no longer suspected of killing its workers).
        With `max_project_bytes`, ProjectLimitError (nothing recorded) if the project's files, live upload
        reservations and its running batches' committed results would then hold more. `failed_lines`: lines'
        failed attempts to record (replacing what was recorded for them)."""
        with self.db.begin() as c:
            row = _locked(c, claim)
            values: dict[str, Any] = {"lease_expires_at": now + lease_s}
            if progressed:
                values["unfinished_claims"] = 0
            if progress is not None and max_project_bytes is not None:
                _check_result_bytes(c, claim, progress, now, max_project_bytes)
            if failed_lines:
                _record_line_failures(c, claim.batch.id, failed_lines)
            if progress is not None:
                c.execute(
                    update(segments)
                    .where(segments.c.batch_id == claim.batch.id, segments.c.epoch == claim.epoch)
                    .values(**vars(progress))
                )
                sums = c.execute(
                    select(*(func.coalesce(func.sum(segments.c[name]), 0) for name in _COUNT_COLUMNS))
                    .where(segments.c.batch_id == claim.batch.id)
                ).one()
                values.update(zip(_COUNT_COLUMNS, sums, strict=True))
            c.execute(update(batches).where(batches.c.id == claim.batch.id).values(**values))
            status: BatchStatus = row.status
            return status

    def start(self, claim: Claim, total: int, model: str) -> BatchStatus:
        """A validated batch moves to `in_progress` with its line count (unless it was cancelled meanwhile)."""
        return self._advance(claim, "validating", "in_progress", total=total, model=model)

    def record_failure(self, claim: Claim, error: str, *, transient: bool = False, retry_at: float | None = None
                       ) -> int:
        """Count one attempt at the batch that ended in `error` and give the lease back, so the batch is claimed
        again (not before `retry_at`); the attempts counted so far of the kind recorded: `failures`, or with
        `transient` (a storage error, not the batch's fault) `transient_failures`, which no limit ends."""
        column = "transient_failures" if transient else "failures"
        with self.db.begin() as c:
            row = _locked(c, claim)
            c.execute(update(batches).where(batches.c.id == claim.batch.id).values(
                {column: batches.c[column] + 1, "last_error": error[:2000], "next_attempt_at": retry_at,
                 "unfinished_claims": 0, **_NO_LEASE}
            ))
            failures: int = getattr(row, column) + 1
            return failures

    def fail(self, claim: Claim, errors: list[dict[str, Any]]) -> None:
        """Validation failed: the batch ends `failed` with `errors`, nothing having run."""
        with self.db.begin() as c:
            _locked(c, claim)
            c.execute(update(batches).where(batches.c.id == claim.batch.id).values(
                status="failed", failed_at=int(time.time()), errors_json=json.dumps(errors), **_NO_LEASE
            ))

    def set_finalizing(self, claim: Claim) -> BatchStatus:
        """Every line is done: `in_progress` becomes `finalizing` (a batch already cancelling stays so). Refused
        while the committed counts do not add up to `total` (the status stays `in_progress`): a batch is never
        finished with a line that has no result."""
        with self.db.begin() as c:
            row = _locked(c, claim)
            if row.status != "in_progress" or row.completed + row.failed != row.total:
                status: BatchStatus = row.status
                return status
            c.execute(update(batches).where(batches.c.id == claim.batch.id).values(
                status="finalizing", finalizing_at=int(time.time())))
            return "finalizing"

    def add_segment(self, claim: Claim) -> None:
        """Register this claim's (empty) segment before any of its results are committed."""
        with self.db.begin() as c:
            _locked(c, claim)
            c.execute(insert(segments).values(batch_id=claim.batch.id, epoch=claim.epoch, output_bytes=0,
                                              error_bytes=0))

    def line_failures(self, batch_id: str) -> dict[str, LineFailures]:
        """The failed attempts recorded for the batch's lines, by custom_id."""
        with self.db.begin() as c:
            rows = c.execute(select(line_failures).where(line_failures.c.batch_id == batch_id))
            return {r.custom_id: LineFailures(r.failures, r.failures_alone, r.last_error) for r in rows}

    def segments(self, batch_id: str) -> list[Segment]:
        with self.db.begin() as c:
            rows = c.execute(select(segments).where(segments.c.batch_id == batch_id).order_by(segments.c.epoch))
            return [Segment(r.epoch, r.output_bytes, r.error_bytes) for r in rows]

    def finish(
        self, claim: Claim, status: FinalStatus, output: FileRecord | None, error: FileRecord | None,
        errors: list[dict[str, Any]] | None = None,
    ) -> None:
        """End the batch with `status` (and `errors`, for a batch that failed): its result files become file
        records, its segments are forgotten and the lease is released, all in one transaction."""
        with self.db.begin() as c:
            _locked(c, claim)
            values: dict[str, Any] = {"status": status, f"{status}_at": int(time.time()), "next_attempt_at": None,
                                      **_NO_LEASE}
            if errors:
                values["errors_json"] = json.dumps(errors)
            for column, record in (("output_file_id", output), ("error_file_id", error)):
                if record is not None:
                    c.execute(insert(files).values(**record.values()))
                    values[column] = record.id
            c.execute(update(batches).where(batches.c.id == claim.batch.id).values(**values))
            c.execute(delete(segments).where(segments.c.batch_id == claim.batch.id))
            c.execute(delete(line_failures).where(line_failures.c.batch_id == claim.batch.id))

    def release(self, claim: Claim) -> None:
        """Give the batch back (e.g. at shutdown) so another worker may claim it at once."""
        with self.db.begin() as c:
            try:
                _locked(c, claim)
            except LeaseLostError:
                return
            # A clean release is no sign of a worker killed by the batch: this claim is not counted.
            unfinished = case((batches.c.unfinished_claims > 0, batches.c.unfinished_claims - 1), else_=0)
            c.execute(update(batches).where(batches.c.id == claim.batch.id).values(
                unfinished_claims=unfinished, **_NO_LEASE))

    # -- helpers ---------------------------------------------------------------------------------------------

    def _advance(self, claim: Claim, before: BatchStatus, after: BatchStatus, **values: Any) -> BatchStatus:
        with self.db.begin() as c:
            row = _locked(c, claim)
            if row.status != before:
                status: BatchStatus = row.status
                return status
            c.execute(update(batches).where(batches.c.id == claim.batch.id).values(
                status=after, **{f"{after}_at": int(time.time())}, **values
            ))
            return after

    @staticmethod
    def _get(c: Connection, batch_id: str) -> BatchRecord | None:
        row = c.execute(select(batches).where(batches.c.id == batch_id)).one_or_none()
        return BatchRecord.from_row(row) if row is not None else None


_NO_LEASE: dict[str, Any] = {"lease_expires_at": None, "lease_owner": None}
_COUNT_COLUMNS = ("completed", "failed", "prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens")


def _check_result_bytes(c: Connection, claim: Claim, progress: Progress, now: float, max_project_bytes: int) -> None:
    """ProjectLimitError if `claim`'s segment growing to `progress` would take its project past `max_project_bytes`
    (`files.used_bytes`, with this segment as it would be). Under the project's lock, as uploads check their room."""
    project = claim.batch.project
    lock_project(c, project)
    used = used_bytes(c, project, now, exclude_segment=(claim.batch.id, claim.epoch))
    if used + progress.output_bytes + progress.error_bytes > max_project_bytes:
        raise ProjectLimitError(project, max_project_bytes, used)


def _record_line_failures(c: Connection, batch_id: str, failed: dict[str, LineFailures]) -> None:
    c.execute(delete(line_failures).where(line_failures.c.batch_id == batch_id,
                                          line_failures.c.custom_id.in_(list(failed))))
    c.execute(insert(line_failures), [
        {"batch_id": batch_id, "custom_id": custom_id, "failures": f.failures, "failures_alone": f.failures_alone,
         "last_error": f.last_error[:2000]}
        for custom_id, f in failed.items()
    ])


def _lease_free(now: float) -> Any:
    return or_(batches.c.lease_expires_at.is_(None), batches.c.lease_expires_at < now)


def _locked(c: Connection, claim: Claim) -> Row[Any]:
    """The batch's row, locked for this transaction; LeaseLostError unless `claim` still holds it."""
    row = c.execute(select(batches).where(batches.c.id == claim.batch.id).with_for_update()).one_or_none()
    if row is None or row.lease_epoch != claim.epoch:
        raise LeaseLostError(claim.batch.id)
    return row
