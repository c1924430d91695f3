"""A batch's results on disk, and the protocol that makes each line's result appear exactly once.

Every claim appends its results to segment files of its own (`blobs.segment_key`), flushes them to disk, then
commits their new lengths together with the counts they add (`BatchStore.commit`, fenced by the claim's
epoch). What a claim appended past its last commit is never read: a worker that resumes a batch reads only the
committed prefixes (`committed_custom_ids`) and runs every other line again, and a claim that lost its lease
cannot commit at all. A finished batch's output and error files are the committed prefixes of its segments,
joined (`publish`). So the files always hold exactly the lines the counts say.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from gateway.batches.line_runner import LineResult
from gateway.batches.lines import encode
from gateway.store.batches import BatchStatus, BatchStore, Claim, FinalStatus, LineFailures, Progress
from gateway.store.blobs import BlobStore, ResultKind, result_key, segment_key
from gateway.store.files import BATCH_OUTPUT_PURPOSE, FileRecord
from gateway.store.ids import FILE_PREFIX, new_id


@dataclass
class _Totals:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


class ResultSink:
    """One claim's segment: results are added on the event loop, then written and committed as a group."""

    def __init__(self, blobs: BlobStore, store: BatchStore, claim: Claim) -> None:
        self.store = store
        self.claim = claim
        batch_id = claim.batch.id
        store.add_segment(claim)
        self._output = blobs.open_segment(segment_key(batch_id, claim.epoch, "output"))
        self._error = blobs.open_segment(segment_key(batch_id, claim.epoch, "error"))
        self._pending: list[LineResult] = []
        self._written = _Totals()  # everything appended to this claim's segment, committed or not yet
        self.committed_ids: set[str] = set()
        self._unconfirmed_ids: list[str] = []
        self._failed_lines: dict[str, LineFailures] = {}  # recorded with the next commit

    def note_failure(self, custom_id: str, failures: LineFailures) -> None:
        """Record a line's failed attempts with the next commit (called on the event loop)."""
        self._failed_lines[custom_id] = failures

    def add(self, result: LineResult) -> None:
        self._pending.append(result)

    @property
    def has_pending(self) -> bool:
        """Results or lines' failed attempts wait for a commit."""
        return bool(self._pending or self._failed_lines)

    @property
    def pending(self) -> int:
        """Results added and not yet taken."""
        return len(self._pending)

    def take(self) -> list[LineResult]:
        """The results added since the last call (call on the event loop; hand them to `commit`)."""
        taken, self._pending = self._pending, []
        return taken

    def commit(self, results: list[LineResult], lease_s: float, max_project_bytes: int | None = None) -> BatchStatus:
        """Append `results`, flush, and commit them with the lease extended; the batch's status. Blocking. If
        the commit fails, what was written is committed by the next successful call (the commit records this
        claim's totals, never increments, so one that did land although it raised is not counted twice).
        ProjectLimitError if the project's stored bytes would pass `max_project_bytes` (nothing is committed)."""
        for result in results:
            (self._output if result.ok else self._error).append(encode(result.record))
            _count(self._written, result)
            self._unconfirmed_ids.append(result.line.custom_id)
        progress = Progress(self._output.sync(), self._error.sync(), **vars(self._written))
        failed, self._failed_lines = self._failed_lines, {}
        try:
            status = self.store.commit(self.claim, time.time(), lease_s, progress, progressed=bool(results),
                                       max_project_bytes=max_project_bytes, failed_lines=failed)
        except BaseException:
            self._failed_lines = {**failed, **self._failed_lines}  # the next commit records them
            raise
        self.committed_ids.update(self._unconfirmed_ids)
        self._unconfirmed_ids.clear()
        return status

    def close(self) -> None:
        self._output.close()
        self._error.close()


def _count(delta: _Totals, result: LineResult) -> None:
    if result.ok:
        delta.completed += 1
    else:
        delta.failed += 1
    for usage in result.usage:
        delta.prompt_tokens += usage.prompt_tokens
        delta.completion_tokens += usage.completion_tokens
        delta.cached_tokens += usage.cached_prompt_tokens
        delta.reasoning_tokens += usage.reasoning_tokens


def committed_custom_ids(blobs: BlobStore, store: BatchStore, batch_id: str) -> set[str]:
    """The custom_ids that already have a committed result, from every earlier claim's segments."""
    done: set[str] = set()
    for segment in store.segments(batch_id):
        for kind, length in (("output", segment.output_bytes), ("error", segment.error_bytes)):
            for raw in blobs.read_lines(segment_key(batch_id, segment.epoch, kind), length):  # type: ignore[arg-type]
                done.add(json.loads(raw)["custom_id"])
    return done


def publish(
    blobs: BlobStore, store: BatchStore, claim: Claim, status: FinalStatus, errors: list[dict[str, Any]] | None = None
) -> None:
    """End the batch with `status` (and `errors`): join its segments into the output and error files, record them
    and the status in one transaction, then delete the segments. Safe to repeat after a crash at any point."""
    batch_id = claim.batch.id
    parts = store.segments(batch_id)
    files: dict[ResultKind, FileRecord | None] = {}
    for kind in ("output", "error"):
        lengths = [(segment_key(batch_id, s.epoch, kind), s.output_bytes if kind == "output" else s.error_bytes)
                   for s in parts]
        size = sum(length for _, length in lengths)
        files[kind] = None
        if size:
            key = result_key(batch_id, kind)
            blobs.concatenate(lengths, key)
            files[kind] = claim.batch.result_file(new_id(FILE_PREFIX), f"{batch_id}_{kind}.jsonl", BATCH_OUTPUT_PURPOSE,
                                                  size, key)
    store.finish(claim, status, files["output"], files["error"], errors)
    for segment in parts:
        for kind in ("output", "error"):
            blobs.delete(segment_key(batch_id, segment.epoch, kind))  # type: ignore[arg-type]


def with_status(claim: Claim, status: BatchStatus) -> Claim:
    return replace(claim, batch=replace(claim.batch, status=status))
