"""The batch invariant under random faults: every input line of a batch ends in exactly one of an output line, an
error-file line or the batch's `errors`, and the counts say exactly what the files hold.

Each seed runs small batches through workers on a real SQLite store and a fake engine on loopback gRPC while a
chaos task, driven by that seed, ends Batch calls mid-way (an engine that dies or drains), answers items with
finish reason ABORT (a draining engine) or refuses them for load, kills workers without releasing their lease
(a gateway's kill -9: their uncommitted appends stay in the segment files) and loses a commit's acknowledgement
after it landed (a PostgreSQL connection cut at COMMIT). The batches are of every kind of line (chat, completions
with several prompts, embeddings, score with several queries: multi-part and pooling lines), some are cancelled or
reach the end of their window at a random moment, and some hold a poison line whose call always breaks. The fake
engine keeps the real engine's rules (unique item ids per call, a bounded intake). A failing seed replays the same
choices: `-k "seed-<n>"` (the timing, and so the interleaving, differs from run to run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from gateway.batches.attempts import AttemptLimits
from gateway.batches.worker import BatchWorker, WorkerSettings
from gateway.store.batches import BatchRecord, BatchStore, Claim, Progress
from gateway.store.tables import batches
from tests.unit.fake_engine import MODEL, FakeEngine
from tests.unit.test_batch_worker import CHAT, Rig, chat_line

SEEDS = range(12)
QUICK_SEEDS = 3  # `make test-quick` runs the first three seeds; `make test` all twelve
BATCHES_PER_SEED = 3
FINAL = {"completed", "failed", "expired", "cancelled"}
COMPLETIONS, EMBEDDINGS, SCORE = "/v1/completions", "/v1/embeddings", "/v1/score"
LIMITS = AttemptLimits(shared=3, alone=3)


@pytest.fixture(autouse=True, scope="module")
def plain_tracebacks() -> Iterator[None]:
    """The chaos has the workers log dozens of exceptions a seed. structlog's console renders each with rich, as a
    panel of frames and their locals: about 40% of this module's CPU time, spent on the event loop the workers
    share (which delays their heartbeats too). A plain traceback says the same, for a fraction of the cost."""
    previous = structlog.get_config()
    plain = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(processors=[plain if isinstance(step, structlog.dev.ConsoleRenderer) else step
                                    for step in previous["processors"]])
    yield
    structlog.configure(**previous)


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


Fate = str  # "run" (to its end), "cancel" or "expire" at a random moment of its run


async def run_with_chaos(rig: Rig, batch: BatchRecord, rng: random.Random, fate: Fate = "run",
                         timeout: float = 90) -> BatchRecord:
    """Run `batch` to a final status through workers that the chaos kills and replaces; with `fate`, cancel it or
    move its completion window's end to now at a random moment."""
    # Every pause scaled down alike: the lease, commits, polls, and the backoff after a failed call (0.2 s doubling
    # to 5 s by default: under this chaos, a quarter of a seed's run spent waiting).
    settings = WorkerSettings(lease_s=0.4, commit_interval_s=0.02, poll_interval_s=0.02, heartbeat_interval_s=0.1,
                              call_backoff_s=0.01, call_backoff_max_s=0.25, attempt_limits=LIMITS,
                              max_unfinished_claims=1000)
    faults: Counter[str] = Counter()
    fate_at = rng.randint(1, 12)

    def start_worker() -> asyncio.Task[None]:
        store = CrashingStore(rig.batches, rng, lost_ack_rate=0.1)
        worker = BatchWorker(store, rig.blobs, rig.pool, settings, asyncio.Event())
        return asyncio.create_task(worker.run())

    task = start_worker()
    deadline = time.monotonic() + timeout
    try:
        for step in itertools.count():
            record = rig.batches.get(batch.id)
            assert record is not None
            if record.status in FINAL:
                return record
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(rng.uniform(0.01, 0.12))
            if step == fate_at and fate == "cancel":
                rig.batches.request_cancel(batch.id)
            elif step == fate_at and fate == "expire":
                with rig.db.begin() as c:
                    c.execute(update(batches).where(batches.c.id == batch.id).values(expires_at=int(time.time())))
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


def check_invariant(rig: Rig, record: BatchRecord, ids: list[str], invalid: set[str], poison: set[str] = frozenset()
                    ) -> int:  # type: ignore[assignment]
    """Every line ends at most once, exactly once unless the batch was cancelled or failed, the counts say what the
    files hold, and every error line has its cause: an invalid line (400), the poison line (500 line_failed, the
    call it breaks named), a line the chaos failed every attempt of (500 line_failed naming a killed call, an
    abort or a refusal) or the end of the batch's window (batch_expired). Returns how many error lines had the
    chaos as their cause."""
    output, errors = rig.result_lines(record.output_file_id), rig.result_lines(record.error_file_id)
    ended = Counter(line["custom_id"] for line in output + errors)
    assert max(ended.values(), default=1) == 1, f"custom_ids with two results: {ended.most_common(3)}"
    assert (record.completed, record.failed) == (len(output), len(errors))
    if record.status == "expired" and record.total == 0:  # its window ended before it was validated
        assert not ended and record.errors and record.errors[0]["code"] == "batch_expired", record
    elif record.status in ("completed", "expired"):
        assert set(ended) == set(ids) and record.completed + record.failed == record.total == len(ids)
    elif record.status == "cancelled":
        assert set(ended) <= set(ids)
    else:  # the batch itself failed: its errors account for every line without a result
        assert record.status == "failed" and record.errors, record
    for line in output:
        assert line["response"]["status_code"] == 200
        for choice in line["response"]["body"].get("choices", []):
            assert choice["finish_reason"] == "stop"  # never an engine's ABORT
    chaos = 0
    for line in errors:
        custom_id, response = line["custom_id"], line["response"]
        if response is None:
            assert line["error"]["code"] == "batch_expired" and record.status == "expired", line
        elif custom_id in invalid:
            assert response["status_code"] == 400, line
        else:
            error = response["body"]["error"]
            assert response["status_code"] == 500 and error["code"] == "line_failed", line
            if custom_id in poison:
                assert "INTERNAL" in error["message"], line
            else:
                assert any(cause in error["message"] for cause in ("UNAVAILABLE", "aborted", "refused")), line
                chaos += 1
    for custom_id in poison:
        assert record.status in ("cancelled", "expired") or custom_id in {e["custom_id"] for e in errors}
    return chaos


Kind = tuple[str, Callable[[int], dict[str, Any]], Callable[[dict[str, Any]], list[str]]]
KINDS: list[Kind] = [  # (endpoint, a line, the texts the fake engine is scripted by)
    (CHAT, chat_line, lambda item: [item["body"]["messages"][0]["content"]]),
    (COMPLETIONS, lambda i: {"custom_id": f"p{i}", "method": "POST", "url": COMPLETIONS,
                             "body": {"model": MODEL, "prompt": [f"a {i}", f"b {i}", f"c {i}"][: 1 + i % 3]}},
     lambda item: item["body"]["prompt"]),
    (EMBEDDINGS, lambda i: {"custom_id": f"e{i}", "method": "POST", "url": EMBEDDINGS,
                            "body": {"model": MODEL, "input": [f"e {i}", f"f {i}"]}},
     lambda item: item["body"]["input"][:1]),
    (SCORE, lambda i: {"custom_id": f"s{i}", "method": "POST", "url": SCORE,
                       "body": {"model": MODEL, "text_1": [f"q {i}", f"r {i}"], "text_2": [f"d {i}", f"g {i}"]}},
     lambda item: item["body"]["text_1"]),
]


@pytest.mark.parametrize(
    "seed", [pytest.param(s, id=f"seed-{s}", marks=() if s < QUICK_SEEDS else pytest.mark.slow) for s in SEEDS]
)
async def test_every_line_ends_exactly_once_under_random_faults(tmp_path: Path, seed: int) -> None:
    """Chat, multi-part completions, embeddings and multi-part score batches, some cancelled or expired at a
    random moment and some holding a poison line (its call always breaks), under the chaos above."""
    rng = random.Random(seed)
    fake = FakeEngine(delay_s=0.01, max_num_seqs=rng.choice([1, 2, 4]))
    lines_run = chaos_failed = 0
    async with Rig(fake, tmp_path) as rig:
        rig.pool.config = dataclasses.replace(rig.pool.config, retry_after_s=0)  # refusals retried at once
        for b in range(BATCHES_PER_SEED):
            endpoint, make, texts_of = rng.choice(KINDS)
            fate = rng.choice(["run", "run", "cancel", "expire"])
            items = [make(1000 * b + i) for i in range(rng.randint(1, 40))]
            texts = {item["custom_id"]: texts_of(item) for item in items}
            every = [t for ts in texts.values() for t in ts]
            fake.refuse_once |= {t for t in every if rng.random() < 0.15}
            fake.abort_once |= {t for t in every if rng.random() < 0.15}
            invalid_texts = {t for t in every if rng.random() < 0.1}
            fake.invalid |= invalid_texts
            invalid = {c for c, ts in texts.items() if invalid_texts & set(ts)}
            poison = {c for c in texts if c not in invalid and rng.random() < 0.05}
            fake.break_call |= {texts[c][0] for c in poison}
            record = await run_with_chaos(rig, rig.batch(items, endpoint=endpoint), rng, fate)
            chaos_failed += check_invariant(rig, record, list(texts), invalid, poison)
            lines_run += len(items)
            expected = {"run": "completed", "cancel": ("completed", "cancelled"), "expire": ("completed", "expired")}
            assert record.status in expected[fate], record  # no fault repeats but the poison: none fails a batch
    assert chaos_failed <= max(1, lines_run // 20), f"{chaos_failed} of {lines_run} lines failed by the chaos alone"


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
