"""`ResponseStore` on SQLite and PostgreSQL: records scoped to their project, chains followed oldest first, the
background lease (a claim fences its writes, a cancellation or a newer claim stops the old worker, a response
given back waits until its retry time, an expired lease is claimed again), and retention: responses past it are
deleted once they have ended, a page at a time."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from gateway.store.responses import ResponseStore


def response(response_id: str, status: str = "completed", previous: str | None = None, created_at: int = 1
             ) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "previous_response_id": previous, "output": [{"type": "message", "id": f"msg_{response_id}"}]}


def test_records_belong_to_their_project_and_chains_run_oldest_first(store_db: Engine) -> None:
    store = ResponseStore(store_db)
    store.insert(response("resp_a"), "alpha", [{"id": "in_a"}])
    store.insert(response("resp_b", previous="resp_a"), "alpha", [{"id": "in_b"}])
    store.insert(response("resp_c", previous="resp_b"), "alpha", [{"id": "in_c"}])
    assert store.get("resp_a", "beta") is None and store.chain("resp_c", "beta") == []
    assert not store.delete("resp_a", "beta")
    found = store.get("resp_b", "alpha")
    assert found is not None and found.input_items == [{"id": "in_b"}] and found.previous_response_id == "resp_a"
    assert [r.id for r in store.chain("resp_c", "alpha")] == ["resp_a", "resp_b", "resp_c"]
    assert store.delete("resp_a", "alpha")
    assert [r.id for r in store.chain("resp_c", "alpha")] == ["resp_b", "resp_c"]  # the walk stops at a gap


def test_a_claim_fences_its_writes(store_db: Engine) -> None:
    store = ResponseStore(store_db)
    store.insert(response("resp_q", status="queued"), "p", [], engine_request=b"req")
    assert store.claim_next("w1", now=100.0, lease_s=10) is not None  # fills the lease
    assert store.claim_next("w2", now=105.0, lease_s=10) is None  # held until 110
    late = store.claim_next("w2", now=111.0, lease_s=10)  # w1 died: its lease ran out
    assert late is not None and late.attempts == 2 and late.engine_request == b"req"
    stale = store.get("resp_q", "p")
    assert stale is not None and stale.status == "in_progress" and stale.response["status"] == "in_progress"
    assert store.renew(late, now=112.0, lease_s=10)
    done = dict(late.response, status="completed", output=[{"type": "message"}])
    assert store.finish(late, done)
    final = store.get("resp_q", "p")
    assert final is not None and final.status == "completed" and final.response["output"] == [{"type": "message"}]
    assert not store.finish(late, dict(done, status="failed"))  # ended: nothing more is written
    assert store.claim_next("w3", now=200.0, lease_s=10) is None


def test_a_cancelled_response_stops_its_worker(store_db: Engine) -> None:
    store = ResponseStore(store_db)
    store.insert(response("resp_c", status="queued"), "p", [], engine_request=b"req")
    claim = store.claim_next("w1", now=100.0, lease_s=10)
    assert claim is not None
    cancelled = store.cancel("resp_c", "p")
    assert cancelled is not None and cancelled.status == "cancelled" and cancelled.response["status"] == "cancelled"
    assert not store.renew(claim, now=101.0, lease_s=10)
    assert not store.finish(claim, dict(claim.response, status="completed"))
    after = store.get("resp_c", "p")
    assert after is not None and after.status == "cancelled"
    assert store.cancel("resp_c", "other") is None


def test_a_response_given_back_waits_for_its_retry_time(store_db: Engine) -> None:
    store = ResponseStore(store_db)
    store.insert(response("resp_r", status="queued"), "p", [], engine_request=b"req")
    claim = store.claim_next("w1", now=100.0, lease_s=10)
    assert claim is not None
    store.release(claim, retry_at=103.0)
    record = store.get("resp_r", "p")
    assert record is not None and record.status == "queued"
    assert store.claim_next("w2", now=102.0, lease_s=10) is None
    again = store.claim_next("w2", now=104.0, lease_s=10)
    assert again is not None and again.attempts == 1  # giving back does not count as an attempt


def test_responses_past_their_retention_are_deleted_once_they_have_ended(store_db: Engine) -> None:
    store = ResponseStore(store_db)
    for name, created_at in (("old_1", 100), ("old_2", 150), ("old_3", 199), ("new", 200)):
        store.insert(response(f"resp_{name}", created_at=created_at), "alpha", [])
    store.insert(response("resp_next", previous="resp_old_3", created_at=300), "alpha", [])
    store.insert(response("resp_running", status="queued", created_at=50), "alpha", [], engine_request=b"req")
    assert store.delete_created_before(200, limit=2) == 2  # the oldest first, a page at a time
    assert store.get("resp_old_3", "alpha") is not None
    assert store.delete_created_before(200, limit=2) == 1 and store.delete_created_before(200) == 0
    assert store.get("resp_old_1", "alpha") is None and store.get("resp_new", "alpha") is not None
    assert store.get("resp_running", "alpha") is not None  # queued: kept until it ends
    assert [r.id for r in store.chain("resp_next", "alpha")] == ["resp_next"]  # its history is gone
    claim = store.claim_next("w", now=1000.0, lease_s=10)
    assert claim is not None and store.finish(claim, dict(claim.response, status="completed"))
    assert store.delete_created_before(200) == 1 and store.get("resp_running", "alpha") is None
