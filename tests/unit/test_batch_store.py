"""File and batch records on a real database (SQLite and PostgreSQL): pages, the claim and lease protocol, fenced
commits, cancellation and the final transaction."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from gateway.store.batches import BatchStore, LeaseLostError, LineFailures, Progress
from gateway.store.database import database_url, open_database
from gateway.store.files import FileInUseError, FileRecord, FileStore, ProjectLimitError
from gateway.store.ids import BATCH_PREFIX, FILE_PREFIX, is_id, new_id
from gateway.store.pages import UnknownCursorError
from gateway.store.tables import DEFAULT_PROJECT

LEASE_S = 30.0


@pytest.fixture
def db(store_db: Engine) -> Engine:
    return store_db


def add_file(files: FileStore, purpose: str = "batch", project: str = DEFAULT_PROJECT) -> FileRecord:
    file_id = new_id(FILE_PREFIX)
    record = files.record(file_id, "in.jsonl", purpose, 10, f"files/{file_id}", project)
    files.add(record)
    return record


def add_batch(db: Engine, input_file: FileRecord | None = None, window_s: int = 3600,
              project: str = DEFAULT_PROJECT) -> Any:
    source = input_file or add_file(FileStore(db), project=project)
    record = BatchStore(db).create(new_id(BATCH_PREFIX), "/v1/chat/completions", source.id, "24h", window_s, None,
                                   project=project)
    assert record is not None
    return record


def test_ids_are_unguessable_and_checked() -> None:
    a, b = new_id(FILE_PREFIX), new_id(FILE_PREFIX)
    assert a != b and is_id(a, FILE_PREFIX) and not is_id(a, BATCH_PREFIX)
    for bad in ["file-../../etc/passwd", "file-" + "A" * 32, "file-" + "a" * 31, "../" + a, a + "/content"]:
        assert not is_id(bad, FILE_PREFIX)


def test_open_database_twice_keeps_the_schema_and_records(db: Engine) -> None:
    record = add_file(FileStore(db))
    again = open_database(db.url.render_as_string(hide_password=False))
    try:
        assert FileStore(again).get(record.id) == record
    finally:
        again.dispose()


def test_file_pages_follow_insertion_order(db: Engine) -> None:
    files = FileStore(db)
    made = [add_file(files, "batch" if i % 2 else "assistants") for i in range(5)]
    newest_first, more = files.list_page(2, None, "desc", None)
    assert [r.id for r in newest_first] == [made[4].id, made[3].id] and more
    rest, more = files.list_page(10, newest_first[-1].id, "desc", None)
    assert [r.id for r in rest] == [m.id for m in reversed(made[:3])] and not more
    oldest, _ = files.list_page(2, made[0].id, "asc", None)
    assert [r.id for r in oldest] == [made[1].id, made[2].id]
    batch_only, _ = files.list_page(10, None, "asc", "batch")
    assert [r.id for r in batch_only] == [made[1].id, made[3].id]
    with pytest.raises(UnknownCursorError):
        files.list_page(10, new_id(FILE_PREFIX), "desc", None)


def test_a_file_that_an_unfinished_batch_reads_cannot_be_removed(db: Engine) -> None:
    files = FileStore(db)
    source = add_file(files)
    batch = add_batch(db, source)
    with pytest.raises(FileInUseError, match=batch.id):
        files.remove(source.id)
    claim = BatchStore(db).claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    BatchStore(db).fail(claim, [{"code": "x", "message": "y", "line": 1, "param": None}])
    assert files.remove(source.id) == source
    assert files.get(source.id) is None and files.remove(source.id) is None


def test_a_batch_needs_an_existing_input_file(db: Engine) -> None:
    assert BatchStore(db).create(new_id(BATCH_PREFIX), "/v1/completions", new_id(FILE_PREFIX), "24h", 60, None) is None


def test_only_one_of_many_racing_workers_claims_a_batch(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claims: list[Any] = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        claims.append(store.claim_next(f"w{i}", time.time(), LEASE_S))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [c for c in claims if c is not None]
    assert len(won) == 1 and won[0].batch.id == batch.id and won[0].epoch == 1
    assert store.claim_next("late", time.time(), LEASE_S) is None  # the lease is live


def test_an_expired_lease_is_claimed_again_and_fences_the_old_worker(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    old = store.claim(batch.id, "old", time.time(), 0.2)
    assert old is not None
    store.add_segment(old)
    time.sleep(0.3)
    new = store.claim_next("new", time.time(), LEASE_S)
    assert new is not None and new.epoch == old.epoch + 1
    with pytest.raises(LeaseLostError):
        store.commit(old, time.time(), LEASE_S, Progress(10, 0, completed=1))
    with pytest.raises(LeaseLostError):
        store.finish(old, "completed", None, None)
    assert store.get(batch.id).completed == 0  # type: ignore[union-attr]


def test_commits_set_a_claims_totals_and_the_batch_counts_are_their_sums(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    assert store.start(claim, 5, "m") == "in_progress"
    store.add_segment(claim)
    store.commit(claim, time.time(), LEASE_S, Progress(100, 0, completed=2, prompt_tokens=7, completion_tokens=3))
    progress = Progress(150, 40, completed=3, failed=1, prompt_tokens=7, completion_tokens=3, cached_tokens=4)
    status = store.commit(claim, time.time(), LEASE_S, progress)
    assert status == "in_progress"
    store.commit(claim, time.time(), LEASE_S, progress)  # repeated after a lost acknowledgement: no change
    record = store.get(batch.id)
    assert record is not None
    assert (record.total, record.completed, record.failed) == (5, 3, 1)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (7, 3, 4)
    assert [(s.epoch, s.output_bytes, s.error_bytes) for s in store.segments(batch.id)] == [(1, 150, 40)]

    store.release(claim)  # a later claim's segment adds to the earlier one's
    later = store.claim(batch.id, "w2", time.time(), LEASE_S)
    assert later is not None
    store.add_segment(later)
    store.commit(later, time.time(), LEASE_S, Progress(30, 0, completed=1, prompt_tokens=2))
    record = store.get(batch.id)
    assert record is not None and (record.completed, record.failed, record.prompt_tokens) == (4, 1, 9)


def test_a_batch_is_not_finalized_while_lines_lack_results(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    store.start(claim, 3, "m")
    store.add_segment(claim)
    store.commit(claim, time.time(), LEASE_S, Progress(20, 10, completed=1, failed=1))
    assert store.set_finalizing(claim) == "in_progress"
    store.commit(claim, time.time(), LEASE_S, Progress(30, 10, completed=2, failed=1))
    assert store.set_finalizing(claim) == "finalizing"


def test_failures_are_counted_and_release_the_lease(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    assert store.record_failure(claim, "OSError: no space left on device") == 1
    again = store.claim_next("w2", time.time(), LEASE_S)
    assert again is not None and again.batch.failures == 1 and "no space" in (again.batch.last_error or "")
    with pytest.raises(LeaseLostError):
        store.record_failure(claim, "stale")
    store.finish(again, "failed", None, None, [{"code": "batch_failed", "message": "m", "param": None,
                                                  "line": None}])
    record = store.get(batch.id)
    assert record is not None and record.status == "failed" and record.errors == [
        {"code": "batch_failed", "message": "m", "param": None, "line": None}]


def test_cancel_is_seen_by_the_worker_at_its_next_commit(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    store.start(claim, 3, "m")
    cancelled = store.request_cancel(batch.id)
    assert cancelled is not None and cancelled.status == "cancelling" and cancelled.times["cancelling_at"]
    assert store.commit(claim, time.time(), LEASE_S) == "cancelling"
    assert store.set_finalizing(claim) == "cancelling"  # a cancel that won the race is kept


def test_finish_publishes_files_releases_the_lease_and_drops_segments(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    store.start(claim, 1, "m")
    store.add_segment(claim)
    store.commit(claim, time.time(), LEASE_S, Progress(3, 0, completed=1))
    assert store.set_finalizing(claim) == "finalizing"
    output = FileStore.record(new_id(FILE_PREFIX), "out.jsonl", "batch_output", 3, "batches/x/output.jsonl")
    store.finish(claim, "completed", output, None)
    record = store.get(batch.id)
    assert record is not None and record.status == "completed" and record.output_file_id == output.id
    assert record.error_file_id is None and record.times["completed_at"] and not record.leased(time.time())
    assert FileStore(db).get(output.id) == output
    assert store.segments(batch.id) == []
    assert store.claim_next("w2", time.time(), LEASE_S) is None  # final batches are never claimed
    assert store.request_cancel(batch.id).status == "completed"  # type: ignore[union-attr]


def test_release_lets_another_worker_claim_at_once(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None and store.claim_next("other", time.time(), LEASE_S) is None
    store.release(claim)
    again = store.claim_next("other", time.time(), LEASE_S)
    assert again is not None and again.epoch == 2
    store.release(claim)  # a stale release changes nothing
    assert store.claim_next("third", time.time(), LEASE_S) is None


def test_batch_pages_newest_first_and_status_counts(db: Engine) -> None:
    made = [add_batch(db) for _ in range(3)]
    store = BatchStore(db)
    page, more = store.list_page(2, None)
    assert [b.id for b in page] == [made[2].id, made[1].id] and more
    page, more = store.list_page(2, page[-1].id)
    assert [b.id for b in page] == [made[0].id] and not more
    store.request_cancel(made[0].id)
    assert store.count_by_status() == {"validating": 2, "cancelling": 1}


def test_a_database_is_paired_with_one_blob_directory(db: Engine, tmp_path: Path) -> None:
    from gateway.store.blobs import BlobStore
    from gateway.store.pairing import StorePairingError, pair

    shared = BlobStore(tmp_path / "shared")
    store_id = pair(db, shared)
    assert pair(db, shared) == store_id  # a restart, or a replica on the same shared directory
    with pytest.raises(StorePairingError, match="--data-dir"):
        pair(db, BlobStore(tmp_path / "own"), wait_s=0.2)  # a replica with a directory of its own


def test_a_new_database_adopts_an_existing_blob_directory(tmp_path: Path) -> None:
    from gateway.store.blobs import BlobStore
    from gateway.store.pairing import pair

    blobs = BlobStore(tmp_path / "blobs")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = open_database(database_url(None, tmp_path / "a"))
    second = open_database(database_url(None, tmp_path / "b"))
    try:
        assert pair(second, blobs) == pair(first, blobs)
    finally:
        first.dispose()
        second.dispose()


def test_claims_go_round_robin_by_project(db: Engine) -> None:
    """Project A queued three batches before B and C queued one each: workers claiming one after another get A's
    oldest, then B's, then C's (each of A, B, C now has a batch running), then A's next."""
    a = [add_batch(db, project="a") for _ in range(3)]
    b, c = add_batch(db, project="b"), add_batch(db, project="c")
    store = BatchStore(db)
    claimed = []
    for k in range(4):
        claim = store.claim_next(f"w{k}", time.time(), LEASE_S)
        assert claim is not None
        claimed.append(claim.batch.id)
    assert claimed == [a[0].id, b.id, c.id, a[1].id]


def test_a_project_served_last_waits_behind_one_not_served_yet(db: Engine) -> None:
    """With no batch running, the project claimed from least recently goes first, not the oldest batch."""
    a1, a2 = add_batch(db, project="a"), add_batch(db, project="a")
    b = add_batch(db, project="b")
    store = BatchStore(db)
    first = store.claim_next("w", time.time(), LEASE_S)
    assert first is not None and first.batch.id == a1.id
    store.finish(first, "completed", None, None)
    second = store.claim_next("w", time.time() + 1, LEASE_S)
    assert second is not None and second.batch.id == b.id
    store.release(second)
    third = store.claim_next("w", time.time() + 2, LEASE_S)
    assert third is not None and third.batch.id == a2.id


def test_without_an_engine_only_batches_that_need_none_are_claimed(db: Engine) -> None:
    store = BatchStore(db)
    running, cancelling, finalizing = (add_batch(db) for _ in range(3))
    for batch, status in ((running, "in_progress"), (cancelling, "cancelling"), (finalizing, "finalizing")):
        claim = store.claim(batch.id, "w", time.time(), LEASE_S)
        assert claim is not None
        store.start(claim, 1, "m")
        if status == "cancelling":
            store.request_cancel(batch.id)
        elif status == "finalizing":
            store.add_segment(claim)
            store.commit(claim, time.time(), LEASE_S, Progress(10, 0, completed=1))
            assert store.set_finalizing(claim) == "finalizing"
        store.release(claim)
    got = [store.claim_next("w", time.time(), LEASE_S, engine_free_only=True) for _ in range(3)]
    assert got[2] is None and {c.batch.id for c in got if c is not None} == {cancelling.id, finalizing.id}


def test_claims_lost_without_progress_are_counted_and_progress_or_a_release_clears_them(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    for expected in (1, 2, 3):
        claim = store.claim(batch.id, "w", time.time(), 0.01)  # each worker dies: its lease runs out
        assert claim is not None and claim.batch.unfinished_claims == expected
        time.sleep(0.02)
    store.start(claim, 1, "m")
    store.commit(claim, time.time(), 0.01, Progress(0, 0), progressed=True)
    time.sleep(0.02)
    again = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert again is not None and again.batch.unfinished_claims == 1
    store.release(again)
    assert (store.get(batch.id) or batch).unfinished_claims == 0


def test_a_storage_error_is_recorded_apart_and_pauses_claims(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    now = time.time()
    assert store.record_failure(claim, "OSError: no space", transient=True, retry_at=now + 60) == 1
    assert store.claim_next("w", now, LEASE_S) is None  # not before its pause is over
    again = store.claim_next("w", now + 61, LEASE_S)
    assert again is not None and (again.batch.failures, again.batch.transient_failures) == (0, 1)


def test_result_bytes_count_against_the_projects_quota(db: Engine) -> None:
    """Files, and the committed results of the project's running batches, all count: a commit that would pass
    the quota raises ProjectLimitError and records nothing; another project is not concerned."""
    files, store = FileStore(db), BatchStore(db)
    first, second = add_batch(db, project="p"), add_batch(db, project="p")  # two input files of 10 bytes
    other = add_batch(db, project="q")
    claims = [store.claim(b.id, "w", time.time(), LEASE_S) for b in (first, second, other)]
    for claim in claims:
        assert claim is not None
        store.start(claim, 100, "m")
        store.add_segment(claim)
    one, two, three = claims
    assert one is not None and two is not None and three is not None
    store.commit(one, time.time(), LEASE_S, Progress(50, 0, completed=5), max_project_bytes=100)
    store.commit(two, time.time(), LEASE_S, Progress(20, 10, completed=2, failed=1), max_project_bytes=100)
    with pytest.raises(ProjectLimitError):  # 20 of files + 50 + 30 + 1 more
        store.commit(two, time.time(), LEASE_S, Progress(21, 10, completed=3, failed=1), max_project_bytes=100)
    assert (store.get(second.id) or second).completed == 2  # nothing recorded
    store.commit(three, time.time(), LEASE_S, Progress(90, 0, completed=9), max_project_bytes=100)
    assert files.get(first.input_file_id) is not None


def test_lines_failed_attempts_outlive_a_claim_and_go_with_the_batch(db: Engine) -> None:
    batch = add_batch(db)
    store = BatchStore(db)
    claim = store.claim(batch.id, "w", time.time(), LEASE_S)
    assert claim is not None
    store.start(claim, 3, "m")
    store.commit(claim, time.time(), LEASE_S, failed_lines={"a": LineFailures(1, 0, "x")})
    store.commit(claim, time.time(), LEASE_S, failed_lines={"a": LineFailures(4, 1, "y"), "b": LineFailures(1, 0, "z")})
    assert store.line_failures(batch.id) == {"a": LineFailures(4, 1, "y"), "b": LineFailures(1, 0, "z")}
    store.finish(claim, "completed", None, None)
    assert store.line_failures(batch.id) == {}
