"""The batch invariant under random faults: every input line of a batch ends in exactly one of an output line, an
error-file line or the batch's `errors`, and the counts say exactly what the files hold.

Each seed runs small batches through workers on a real SQLite store and a fake engine on loopback gRPC while a
chaos task, driven by that seed, ends Batch calls mid-way (an engine that dies or drains), answers items with
finish reason ABORT (a draining engine) or refuses them for load, kills workers without releasing their lease
(a gateway's kill -9: their uncommitted appends stay in the segment files) and loses a commit's acknowledgement
after it landed (a PostgreSQL connection cut at COMMIT). A failing seed replays exactly: `-k "seed-<n>"`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from gateway.batches.worker import BatchWorker, WorkerSettings
from gateway.store.batches import BatchRecord, BatchStore, Claim, Progress
from tests.unit.fake_engine import FakeEngine
from tests.unit.test_batch_worker import Rig, chat_line

SEEDS = range(12)
BATCHES_PER_SEED = 3
FINAL = {"completed", "failed", "expired", "cancelled"}


class CrashingStore(BatchStore):
    """A worker's view of the store whose process may die at any moment: a killed worker never releases its
    claim, and one commit in a few loses its acknowledgement after landing."""

    def __init__(self, store: BatchStore, rng: random.Random, lost_ack_rate: float) -> None:
        super().__init__(store.db)
        self.rng = rng
        self.lost_ack_rate = lost_ack_rate

    def release(self, claim: Claim) -> None:
        return None  # kill -9: the lease has to run out

    def commit(self, claim: Claim, now: float, lease_s: float, progress: Progress | None = None, **options: Any
               ) -> Any:
        status = super().commit(claim, now, lease_s, progress, **options)
        if progress is not None and self.rng.random() < self.lost_ack_rate:
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
        return status


async def run_with_chaos(rig: Rig, batch: BatchRecord, rng: random.Random, timeout: float = 60) -> BatchRecord:
    """Run `batch` to a final status through workers that the chaos kills and replaces."""
    settings = WorkerSettings(lease_s=0.4, commit_interval_s=0.02, poll_interval_s=0.02, heartbeat_interval_s=0.1)
    faults: Counter[str] = Counter()

    def start_worker() -> asyncio.Task[None]:
        store = CrashingStore(rig.batches, rng, lost_ack_rate=0.1)
        worker = BatchWorker(store, rig.blobs, rig.pool, settings, asyncio.Event())
        return asyncio.create_task(worker.run())

    task = start_worker()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            record = rig.batches.get(batch.id)
            assert record is not None
            if record.status in FINAL:
                return record
            await asyncio.sleep(rng.uniform(0.01, 0.12))
            fault = rng.choice(["none", "none", "call", "call", "worker"])
            faults[fault] += 1
            if fault == "call":
                rig.fake.kill_calls()
            elif fault == "worker":
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                task = start_worker()
        raise TimeoutError(f"batch still {record.status} after {timeout} s; faults {dict(faults)}")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def check_invariant(rig: Rig, record: BatchRecord, ids: list[str], invalid: set[str]) -> None:
    output, errors = rig.result_lines(record.output_file_id), rig.result_lines(record.error_file_id)
    ended = Counter(line["custom_id"] for line in output + errors)
    assert max(ended.values(), default=1) == 1, f"custom_ids with two results: {ended.most_common(3)}"
    assert (record.completed, record.failed) == (len(output), len(errors))
    if record.status == "completed":
        assert set(ended) == set(ids) and record.completed + record.failed == record.total == len(ids)
    else:  # the batch itself failed: its errors account for every line without a result
        assert record.status == "failed" and record.errors, record
    for line in output:
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["finish_reason"] == "stop"  # never an engine's ABORT
    for line in errors:
        assert line["custom_id"] in invalid and line["response"]["status_code"] == 400


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed-{s}" for s in SEEDS])
async def test_every_line_ends_exactly_once_under_random_faults(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    fake = FakeEngine(delay_s=0.01, max_num_seqs=rng.choice([1, 2, 4]))
    async with Rig(fake, tmp_path) as rig:
        rig.pool.config = dataclasses.replace(rig.pool.config, retry_after_s=0)  # refusals retried at once
        for b in range(BATCHES_PER_SEED):
            n = rng.randint(1, 40)
            items = [chat_line(1000 * b + i) for i in range(n)]
            texts = [item["body"]["messages"][0]["content"] for item in items]
            fake.refuse_once |= {t for t in texts if rng.random() < 0.15}
            fake.abort_once |= {t for t in texts if rng.random() < 0.15}
            invalid_texts = {t for t in texts if rng.random() < 0.1}
            fake.invalid |= invalid_texts
            invalid = {item["custom_id"] for item, t in zip(items, texts, strict=True) if t in invalid_texts}
            record = await run_with_chaos(rig, rig.batch(items), rng)
            check_invariant(rig, record, [item["custom_id"] for item in items], invalid)
            assert record.status == "completed", record  # no fault here repeats, so none may fail the batch


def test_check_invariant_catches_a_lost_line(tmp_path: Path) -> None:
    """The checker itself: a completed batch missing a line, or holding one twice, is caught."""

    class Files:
        def __init__(self, lines_by_file: dict[str, list[dict[str, Any]]]) -> None:
            self.lines_by_file = lines_by_file

        def result_lines(self, file_id: str | None) -> list[dict[str, Any]]:
            return self.lines_by_file.get(file_id or "", [])

    ok = {"custom_id": "a", "response": {"status_code": 200, "body": {"choices": [{"finish_reason": "stop"}]}}}
    record = BatchRecord(id="b", endpoint="/v1/chat/completions", input_file_id="f", completion_window="24h",
                         status="completed", created_at=0, expires_at=1, output_file_id="out", total=2, completed=1)
    with pytest.raises(AssertionError):
        check_invariant(Files({"out": [ok]}), record, ["a", "b"], set())  # type: ignore[arg-type]
    twice = BatchRecord(**{**vars(record), "completed": 2})
    with pytest.raises(AssertionError):
        check_invariant(Files({"out": [ok, ok]}), twice, ["a", "b"], set())  # type: ignore[arg-type]
