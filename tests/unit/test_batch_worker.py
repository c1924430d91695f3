"""The line runner and the batch worker against a fake engine on loopback gRPC and a real SQLite store: every line gets
exactly one result through engine failures, refusals, a crashed worker, cancellation and expiry."""

from __future__ import annotations

import asyncio
import errno
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from gateway.batches import lines
from gateway.batches import results as results_module
from gateway.batches import worker as worker_module
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.batches.results import committed_custom_ids
from gateway.batches.worker import BatchWorker, WorkerSettings
from gateway.config import GatewayConfig
from gateway.engines import EnginePool
from gateway.store.batches import BatchRecord, BatchStore, Progress
from gateway.store.blobs import BlobStore, SegmentWriter, segment_key, upload_key
from gateway.store.database import database_url, open_database
from gateway.store.files import FileStore
from gateway.store.ids import BATCH_PREFIX, FILE_PREFIX, new_id
from gateway.store.tables import batches
from tests.unit.fake_engine import MODEL, FakeEngine, start_fake_engine

CHAT = "/v1/chat/completions"


def chat_line(i: int) -> dict[str, Any]:
    return {"custom_id": f"c{i}", "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}]}}


class Rig:
    """A fake engine, a pool on it, and a store + blob directory."""

    def __init__(self, fake: FakeEngine, tmp: Path) -> None:
        self.fake = fake
        self.tmp = tmp
        self.db = open_database(database_url(None, tmp))
        self.files = FileStore(self.db)
        self.batches = BatchStore(self.db)
        self.blobs = BlobStore(tmp / "blobs")

    async def __aenter__(self) -> Rig:
        self.server, address = await start_fake_engine(self.fake)
        self.pool = EnginePool(GatewayConfig(engines=(address,), health_interval_s=0.05))
        await self.pool.start()
        assert await self.pool.wait_ready(10)
        while self.pool.model_id is None:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.close()
        await self.server.stop(None)
        self.db.dispose()

    def batch(self, items: list[dict[str, Any]], window_s: int = 3600, project: str = "default",
              endpoint: str = CHAT) -> BatchRecord:
        file_id = new_id(FILE_PREFIX)
        path = self.blobs.path(upload_key(file_id))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(json.dumps(i).encode() + b"\n" for i in items))
        self.files.add(self.files.record(file_id, "in.jsonl", "batch", path.stat().st_size, upload_key(file_id),
                                         project))
        record = self.batches.create(new_id(BATCH_PREFIX), endpoint, file_id, "24h", window_s, None, project=project)
        assert record is not None
        return record

    def worker(self, **settings: Any) -> BatchWorker:
        settings = {"lease_s": 5.0, "commit_interval_s": 0.02, "poll_interval_s": 0.05, **settings}
        return BatchWorker(self.batches, self.blobs, self.pool, WorkerSettings(**settings), asyncio.Event())

    async def run_until(self, worker: BatchWorker, batch_id: str, statuses: set[str], timeout: float = 20) -> Any:
        task = asyncio.create_task(worker.run())
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                record = self.batches.get(batch_id)
                assert record is not None
                if record.status in statuses:
                    return record
                await asyncio.sleep(0.02)
            raise TimeoutError(f"batch still {record.status}")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    def result_lines(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        record = self.files.get(file_id)
        assert record is not None
        data = self.blobs.path(record.blob_key).read_bytes()
        assert len(data) == record.bytes
        return [json.loads(line) for line in data.splitlines()]


async def source(items: list[dict[str, Any]], endpoint: str = CHAT) -> AsyncIterator[lines.InputLine]:
    for index, item in enumerate(items):
        yield lines.parse_line(json.dumps(item).encode(), index + 1, index, endpoint, MODEL)


async def run_lines(rig: Rig, items: list[dict[str, Any]], endpoint: str = CHAT, window: int | None = None,
                    ) -> list[LineResult]:
    results: list[LineResult] = []
    done = await LineRunner(rig.pool, MODEL, window).run(source(items, endpoint), results.append, asyncio.Event())
    assert done
    return results


async def test_runner_gives_each_line_one_result_within_the_window(tmp_path: Path) -> None:
    async with Rig(FakeEngine(delay_s=0.01), tmp_path) as rig:
        results = await run_lines(rig, [chat_line(i) for i in range(40)], window=3)
    assert sorted(r.line.custom_id for r in results) == sorted(f"c{i}" for i in range(40))
    assert rig.fake.max_unanswered <= 3
    first = next(r for r in results if r.line.custom_id == "c0")
    body = first.record["response"]["body"]
    assert first.ok and first.record["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "LINE 0"
    assert body["id"] == "chatcmpl-" + first.record["response"]["request_id"]


async def test_the_default_window_is_twice_the_engines_seats(tmp_path: Path) -> None:
    async with Rig(FakeEngine(max_num_seqs=3, delay_s=0.02), tmp_path) as rig:
        await run_lines(rig, [chat_line(i) for i in range(30)])
    assert rig.fake.max_unanswered == 6


async def test_lines_in_flight_on_a_failed_call_are_sent_again(tmp_path: Path) -> None:
    async with Rig(FakeEngine(die_after=5, delay_s=0.01), tmp_path) as rig:
        results = await run_lines(rig, [chat_line(i) for i in range(30)], window=8)
    assert rig.fake.calls == 2
    assert Counter(r.line.custom_id for r in results) == Counter(f"c{i}" for i in range(30))
    assert sum(rig.fake.seen.values()) > 30  # some lines really ran twice; each was reported once


async def test_a_refused_item_is_retried_and_a_bad_one_is_an_error_line(tmp_path: Path) -> None:
    fake = FakeEngine(refuse_once={"line 1"}, invalid={"line 2"})
    async with Rig(fake, tmp_path) as rig:
        results = {r.line.custom_id: r for r in await run_lines(rig, [chat_line(i) for i in range(4)])}
    assert results["c1"].ok and fake.seen["line 1"] == 2
    bad = results["c2"]
    assert not bad.ok and bad.record["response"]["status_code"] == 400
    assert bad.record["response"]["body"]["error"]["param"] == "max_tokens"
    assert bad.usage == ()


async def test_a_line_waiting_to_be_resent_when_its_call_ends_is_not_dropped(tmp_path: Path) -> None:
    """Line 0 is refused for load and waits its pause in the feeder; the call dies during the pause. The line
    must still be sent on the next call (it was once in neither the retry queue nor in flight, and lost)."""
    fake = FakeEngine(refuse_once={"line 0"}, die_after_s=0.3, delay_s=0.05)
    async with Rig(fake, tmp_path) as rig:
        results = await asyncio.wait_for(run_lines(rig, [chat_line(i) for i in range(6)], window=1), 10)
    assert Counter(r.line.custom_id for r in results) == Counter(f"c{i}" for i in range(6))
    assert all(r.ok for r in results) and fake.seen["line 0"] == 2 and fake.calls == 2


async def test_a_line_read_by_a_feeder_whose_call_ended_is_not_dropped(tmp_path: Path) -> None:
    """The input is slow to read; the call dies while its feeder waits for the next line. That line (and every
    later one) runs on the next call."""
    async def slow(items: list[dict[str, Any]]) -> AsyncIterator[lines.InputLine]:
        async for line in source(items):
            await asyncio.sleep(0.25)
            yield line

    async with Rig(FakeEngine(die_after_s=0.4), tmp_path) as rig:
        results: list[LineResult] = []
        runner = LineRunner(rig.pool, MODEL)
        done = await asyncio.wait_for(runner.run(slow([chat_line(i) for i in range(4)]), results.append,
                                                 asyncio.Event()), 10)
    assert done and Counter(r.line.custom_id for r in results) == Counter(f"c{i}" for i in range(4))


async def test_an_aborted_item_is_run_again_not_reported(tmp_path: Path) -> None:
    """A draining engine ends what it still runs with finish reason ABORT: that is not the line's answer."""
    fake = FakeEngine(abort_once={"line 1"})
    async with Rig(fake, tmp_path) as rig:
        results = {r.line.custom_id: r for r in await run_lines(rig, [chat_line(i) for i in range(3)])}
    assert fake.seen["line 1"] == 2
    choice = results["c1"].record["response"]["body"]["choices"][0]
    assert results["c1"].ok and choice["finish_reason"] == "stop" and choice["message"]["content"] == "LINE 1"


async def test_a_completions_line_with_several_prompts_joins_its_parts(tmp_path: Path) -> None:
    item = {"custom_id": "p", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": ["one", "two", "three"], "max_tokens": 3}}
    async with Rig(FakeEngine(die_after=2, delay_s=0.01), tmp_path) as rig:
        [result] = await run_lines(rig, [item], "/v1/completions", window=3)
    body = result.record["response"]["body"]
    assert [c["text"] for c in body["choices"]] == ["ONE", "TWO", "THREE"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 3 + 3 + 5


async def test_stop_ends_the_run_without_results_for_lines_in_flight(tmp_path: Path) -> None:
    async with Rig(FakeEngine(delay_s=5), tmp_path) as rig:
        stop = asyncio.Event()
        results: list[LineResult] = []
        task = asyncio.create_task(LineRunner(rig.pool, MODEL).run(source([chat_line(0)]), results.append, stop))
        await asyncio.sleep(0.2)
        stop.set()
        assert await asyncio.wait_for(task, 2) is False and results == []


async def test_worker_completes_a_batch(tmp_path: Path) -> None:
    async with Rig(FakeEngine(invalid={"line 3"}), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(10)])
        record = await rig.run_until(rig.worker(), batch.id, {"completed", "failed"})
        assert record.status == "completed" and (record.total, record.completed, record.failed) == (10, 9, 1)
        assert record.times["in_progress_at"] and record.times["finalizing_at"] and record.times["completed_at"]
        assert record.model == MODEL and record.prompt_tokens == sum(len(f"line {i}") for i in range(10) if i != 3)
        output, errors = rig.result_lines(record.output_file_id), rig.result_lines(record.error_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(f"c{i}" for i in range(10) if i != 3)
        assert [e["custom_id"] for e in errors] == ["c3"] and errors[0]["response"]["status_code"] == 400
        assert rig.batches.segments(batch.id) == []
        assert not list(rig.blobs.path(f"batches/{batch.id}").glob("[0-9]*"))  # segment files are gone


async def test_idle_workers_take_turns_at_polling_and_busy_ones_pass_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four idle workers sharing a claim turn poll the store one at a time (one query per poll interval, not
    four); once one claims a batch the turn passes at once, so two batches created together run side by side."""
    async with Rig(FakeEngine(delay_s=0.3), tmp_path) as rig:
        polls: list[str] = []
        claimed_by: dict[str, str] = {}
        real = rig.batches.claim_next

        def counted(owner: str, *args: Any, **kwargs: Any) -> Any:
            polls.append(owner)
            claim = real(owner, *args, **kwargs)
            if claim is not None:
                claimed_by[claim.batch.id] = owner
            return claim

        monkeypatch.setattr(rig.batches, "claim_next", counted)
        turn = asyncio.Lock()
        workers = [BatchWorker(rig.batches, rig.blobs, rig.pool, WorkerSettings(lease_s=5.0, poll_interval_s=0.1),
                               asyncio.Event(), claim_turn=turn) for _ in range(4)]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        try:
            await asyncio.sleep(1.05)
            assert 8 <= len(polls) <= 13 and len(set(polls)) == 1  # one poller, every 0.1 s
            first, second = rig.batch([chat_line(i) for i in range(4)]), rig.batch([chat_line(i) for i in range(4)])
            deadline = time.monotonic() + 20
            while {rig.batches.get(b.id).status for b in (first, second)} != {"completed"}:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the batches did not complete"
                await asyncio.sleep(0.02)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert len(set(claimed_by.values())) == 2  # run by two workers, not one after the other


async def test_worker_fails_a_batch_with_bad_lines_without_running_any(tmp_path: Path) -> None:
    async with Rig(FakeEngine(), tmp_path) as rig:
        batch = rig.batch([chat_line(0), {**chat_line(1), "url": "/v1/embeddings"}, chat_line(0)])
        record = await rig.run_until(rig.worker(), batch.id, {"failed", "completed"})
    assert record.status == "failed" and record.times["failed_at"]
    assert [(e["code"], e["line"]) for e in record.errors] == [("invalid_url", 2), ("duplicate_custom_id", 3)]
    assert rig.fake.calls == 0 and record.output_file_id is None


async def test_a_crashed_workers_uncommitted_results_are_never_counted(tmp_path: Path) -> None:
    """A worker dies after writing results it had not committed: its committed lines are kept, the rest run
    again under the next claim, and each custom_id ends up exactly once."""
    async with Rig(FakeEngine(), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(12)])
        dead = rig.batches.claim(batch.id, "dead", time.time(), 0.3)
        assert dead is not None
        rig.batches.start(dead, 12, MODEL)
        rig.batches.add_segment(dead)
        committed = b"".join(lines.encode(lines.output_record("x", f"c{i}", "r", 200, {})) for i in range(4))
        uncommitted = lines.encode(lines.output_record("x", "c4", "r", 200, {})) + b'{"custom_id": "c5", "tru'
        segment = rig.blobs.open_segment(segment_key(batch.id, dead.epoch, "output"))
        segment.append(committed + uncommitted)
        segment.sync()
        segment.close()
        rig.batches.commit(dead, time.time(), 0.3, Progress(len(committed), 0, completed=4))
        assert committed_custom_ids(rig.blobs, rig.batches, batch.id) == {f"c{i}" for i in range(4)}
        await asyncio.sleep(0.35)  # the dead worker's lease runs out

        record = await rig.run_until(rig.worker(), batch.id, {"completed"})
        output = rig.result_lines(record.output_file_id)
    assert Counter(o["custom_id"] for o in output) == Counter(f"c{i}" for i in range(12))
    assert record.completed == 12 and sum(rig.fake.seen.values()) == 8  # only the uncommitted ones ran


async def test_cancel_stops_the_batch_with_partial_results(tmp_path: Path) -> None:
    async with Rig(FakeEngine(delay_s=0.05, max_num_seqs=2), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(200)])
        worker = rig.worker()
        task = asyncio.create_task(worker.run())
        while (rig.batches.get(batch.id) or batch).completed < 10:
            await asyncio.sleep(0.02)
        rig.batches.request_cancel(batch.id)
        started = time.monotonic()
        while (record := rig.batches.get(batch.id)) is not None and record.status != "cancelled":
            await asyncio.sleep(0.02)
        waited = time.monotonic() - started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert record is not None and waited < 2
        output = rig.result_lines(record.output_file_id)
    assert 10 <= record.completed < 200 and len(output) == record.completed and record.failed == 0
    assert len({o["custom_id"] for o in output}) == len(output)
    assert record.times["cancelling_at"] and record.times["cancelled_at"]


async def test_expiry_turns_unrun_lines_into_batch_expired_errors(tmp_path: Path) -> None:
    async with Rig(FakeEngine(delay_s=0.05, max_num_seqs=1), tmp_path) as rig:
        # Two seconds: expires_at is whole seconds, so a one-second window can end before the batch is validated.
        batch = rig.batch([chat_line(i) for i in range(100)], window_s=2)
        record = await rig.run_until(rig.worker(), batch.id, {"expired"})
        output, errors = rig.result_lines(record.output_file_id), rig.result_lines(record.error_file_id)
    assert record.completed == len(output) > 0 and record.failed == len(errors) > 0
    assert record.completed + record.failed == record.total == 100
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert {o["custom_id"] for o in output} | {e["custom_id"] for e in errors} == {f"c{i}" for i in range(100)}


async def test_a_commit_repeated_after_a_lost_acknowledgement_counts_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL can commit a transaction and then lose the connection before saying so: the sink commits the
    same results again, and the counts must not double."""
    async with Rig(FakeEngine(delay_s=0.01), tmp_path) as rig:
        real = rig.batches.commit
        lost: list[Progress] = []

        def lose_first_ack(claim: Any, now: float, lease_s: float, progress: Progress | None = None,
                           **options: Any) -> Any:
            status = real(claim, now, lease_s, progress, **options)
            if progress is not None and progress.completed and not lost:
                lost.append(progress)
                raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
            return status

        monkeypatch.setattr(rig.batches, "commit", lose_first_ack)
        batch = rig.batch([chat_line(i) for i in range(10)])
        record = await rig.run_until(rig.worker(), batch.id, {"completed", "failed"})
        output = rig.result_lines(record.output_file_id)
    assert lost and record.status == "completed"
    assert (record.total, record.completed, record.failed) == (10, 10, 0) and len(output) == 10
    assert record.prompt_tokens == sum(len(f"line {i}") for i in range(10))


async def test_a_full_disk_pauses_a_batch_until_there_is_space_again_and_loses_no_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up after a few results (appends fail), and stays full while the batch is published: each
    attempt is recorded as a storage error, never counted towards failing the batch, and tried again after a
    growing pause; once there is space again the batch completes with every result."""
    full = asyncio.Event()
    real_append, real_concatenate = SegmentWriter.append, BlobStore.concatenate
    appended = Counter[str]()

    def append(self: SegmentWriter, data: bytes) -> None:
        appended["n"] += 1
        if appended["n"] == 4:
            full.set()
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(self, data)

    def concatenate(self: BlobStore, parts: Any, key: str) -> int:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_concatenate(self, parts, key)

    monkeypatch.setattr(SegmentWriter, "append", append)
    monkeypatch.setattr(BlobStore, "concatenate", concatenate)
    async with Rig(FakeEngine(delay_s=0.03, max_num_seqs=1), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(20)])
        worker = rig.worker(max_failures=2, retry_base_s=0.05, retry_max_s=0.2)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(full.wait(), 10)
            while (record := rig.batches.get(batch.id)) is not None and record.transient_failures < 4:
                await asyncio.sleep(0.02)
            assert record is not None and record.status == "in_progress" and record.failures == 0
            full.clear()  # space again
            while (record := rig.batches.get(batch.id)) is not None and record.status not in {"completed", "failed"}:
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        output = rig.result_lines(record.output_file_id)
    assert record.status == "completed" and record.failures == 0 and record.transient_failures >= 4
    assert Counter(o["custom_id"] for o in output) == Counter(f"c{i}" for i in range(20))


async def test_a_full_disk_at_publishing_keeps_every_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every line ran; writing the output file fails for a while (ENOSPC): the batch is not finished without its
    files, and completes with every result once the write succeeds."""
    failures = Counter[str]()
    real_concatenate = BlobStore.concatenate

    def concatenate(self: BlobStore, parts: Any, key: str) -> int:
        failures["n"] += 1
        if failures["n"] <= 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_concatenate(self, parts, key)

    monkeypatch.setattr(BlobStore, "concatenate", concatenate)
    async with Rig(FakeEngine(), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(8)])
        record = await rig.run_until(rig.worker(max_failures=2, retry_base_s=0.02, retry_max_s=0.1), batch.id,
                                     {"completed", "failed"})
        output = rig.result_lines(record.output_file_id)
    assert record.status == "completed" and record.failures == 0 and record.transient_failures == 6
    assert sorted(o["custom_id"] for o in output) == sorted(f"c{i}" for i in range(8))


async def test_an_error_that_repeats_fails_the_batch_after_bounded_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error that is not about storage (here: results that cannot be encoded after a few lines) is the
    batch's: it is retried `max_failures` times, then the batch ends `failed` with errors saying why, keeping the
    results it had committed; it is never claimed again."""
    real_encode = lines.encode
    encoded = Counter[str]()

    def encode(record: dict[str, Any]) -> bytes:
        encoded["n"] += 1
        if encoded["n"] > 3:
            raise TypeError("cannot encode this record")
        return real_encode(record)

    monkeypatch.setattr(results_module, "encode", encode)
    async with Rig(FakeEngine(delay_s=0.03, max_num_seqs=1), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(20)])
        record = await rig.run_until(rig.worker(max_failures=2), batch.id, {"completed", "failed"})
        output = rig.result_lines(record.output_file_id)
        assert rig.batches.claim_next("another", time.time(), 5.0) is None
    assert record.status == "failed" and record.failures == 2
    assert record.errors is not None and record.errors[0]["code"] == "batch_failed"
    assert "cannot encode this record" in record.errors[0]["message"]
    assert 0 < record.completed == len(output) < 20


async def test_slow_validation_keeps_the_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating takes longer than the lease: the worker renews it meanwhile, so a second worker never claims
    the batch from under it (both would run it)."""
    real_validate = lines.validate

    def slow_validate(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.5)
        return real_validate(*args, **kwargs)

    monkeypatch.setattr(lines, "validate", slow_validate)
    async with Rig(FakeEngine(), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(5)])
        second = asyncio.create_task(rig.worker(lease_s=0.5).run())
        try:
            record = await rig.run_until(rig.worker(lease_s=0.5), batch.id, {"completed", "failed"})
        finally:
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
        with rig.db.begin() as c:
            epoch = c.execute(select(batches.c.lease_epoch).where(batches.c.id == batch.id)).scalar_one()
    assert record.status == "completed" and record.completed == 5
    assert epoch == 1 and sum(rig.fake.seen.values()) == 5


async def test_a_batch_whose_lines_never_all_get_results_fails_instead_of_completing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were a line ever to be dropped, the counts would fall short of the total: the batch must not complete.
    The worker runs the missing lines again, and fails the batch with an error if they still have no result."""

    class Dropping(LineRunner):
        async def run(self, source: AsyncIterator[lines.InputLine], emit: Any, stop: asyncio.Event) -> bool:
            return await super().run(source, lambda r: None if r.line.custom_id == "c3" else emit(r), stop)

    monkeypatch.setattr(worker_module, "LineRunner", Dropping)
    async with Rig(FakeEngine(), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(6)])
        record = await rig.run_until(rig.worker(), batch.id, {"completed", "failed"})
    assert record.status == "failed" and (record.completed, record.total) == (5, 6)
    assert record.errors is not None and "no result" in record.errors[0]["message"]
    assert rig.fake.seen["line 3"] == worker_module.MAX_PASSES


async def test_batches_past_their_window_expire_with_no_engine_serving(tmp_path: Path) -> None:
    """With no engine at all, a worker still ends overdue batches `expired` (OpenAI's 24 h rule): a validated
    batch keeps its results and gets a batch_expired line for every line not run; one never validated says so in
    its errors. Both stayed active forever before."""
    async with Rig(FakeEngine(), tmp_path) as rig:
        started = rig.batch([chat_line(i) for i in range(5)], window_s=1)
        claim = rig.batches.claim(started.id, "earlier", time.time(), 5.0)
        assert claim is not None and rig.batches.start(claim, 5, MODEL) == "in_progress"
        rig.batches.release(claim)
        unvalidated = rig.batch([chat_line(i) for i in range(3)], window_s=1)
        await rig.server.stop(None)
        while rig.pool.ready:
            await asyncio.sleep(0.02)
        await asyncio.sleep(max(0.0, started.expires_at + 0.05 - time.time()))
        first = await rig.run_until(rig.worker(), started.id, {"expired", "completed", "failed"})
        second = await rig.run_until(rig.worker(), unvalidated.id, {"expired", "completed", "failed"})
        errors = rig.result_lines(first.error_file_id)
    assert first.status == "expired" and (first.completed, first.failed, first.total) == (0, 5, 5)
    assert sorted(e["custom_id"] for e in errors) == [f"c{i}" for i in range(5)]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert second.status == "expired" and second.errors is not None
    assert second.errors[0]["code"] == "batch_expired" and second.output_file_id is None


async def test_a_batch_that_keeps_losing_its_workers_fails_instead_of_killing_more(tmp_path: Path) -> None:
    """Workers that die holding the batch (killed for memory, say) record no failure: after
    `max_unfinished_claims` claims lost without progress, the next worker ends it `failed` saying so."""
    async with Rig(FakeEngine(), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(3)])
        for _ in range(3):
            assert rig.batches.claim(batch.id, "killed", time.time(), 0.01) is not None
            await asyncio.sleep(0.02)
        record = await rig.run_until(rig.worker(max_unfinished_claims=2), batch.id, {"completed", "failed"})
    assert record.status == "failed" and record.errors is not None
    assert "stopped 3 times" in record.errors[0]["message"] and rig.fake.calls == 0


async def test_results_past_the_projects_quota_stop_the_batch_with_what_it_committed(tmp_path: Path) -> None:
    async with Rig(FakeEngine(delay_s=0.02, max_num_seqs=1), tmp_path) as rig:
        batch = rig.batch([chat_line(i) for i in range(40)], project="p")
        input_bytes = (rig.files.get(batch.input_file_id) or batch).bytes  # type: ignore[union-attr]
        quota = input_bytes + 3000  # room for a handful of result lines
        record = await rig.run_until(rig.worker(project_max_file_bytes=quota), batch.id, {"completed", "failed"})
        output = rig.result_lines(record.output_file_id)
        stored = sum(f.bytes for f in rig.files.list_page(100, None, "desc", None, "p")[0])
    assert record.status == "failed" and record.errors is not None
    assert record.errors[0]["code"] == "storage_limit_exceeded"
    assert 0 < record.completed == len(output) < 40 and stored <= quota


async def test_a_replica_with_a_smaller_line_limit_runs_a_batch_another_validated(tmp_path: Path) -> None:
    """Replicas may differ in --max-request-mib: one whose limit is below a validated line's length still runs
    the batch (it read the file with its own limit and failed the batch before)."""
    long_line = {**chat_line(1), "body": {**chat_line(1)["body"], "messages": [
        {"role": "user", "content": "line 1"}, {"role": "user", "content": "x" * 5000}]}}
    async with Rig(FakeEngine(), tmp_path) as rig:
        batch = rig.batch([chat_line(0), long_line, chat_line(2)])
        claim = rig.batches.claim(batch.id, "validator", time.time(), 5.0)
        assert claim is not None and rig.batches.start(claim, 3, MODEL) == "in_progress"
        rig.batches.release(claim)
        record = await rig.run_until(rig.worker(max_line_bytes=1000), batch.id, {"completed", "failed"})
    assert record.status == "completed" and record.completed == 3
