"""Stored responses of `/v1/responses`: what `store` keeps, the chains `previous_response_id` follows, and the
lease protocol that runs background responses on any gateway sharing the database.

Every record belongs to a project; a call that takes `project` sees only that project's records, so another
project's id is as unknown as a made-up one. A background response is `queued` with its engine request; a worker
`claim`s it (status `in_progress`, `lease_epoch` + 1, a lease of `lease_s`) and keeps the lease by `renew`ing it;
its `finish` is fenced by the epoch, so a worker whose lease ran out (another has claimed it since) or whose
response was cancelled writes nothing. A worker that dies (kill -9) leaves its lease to expire; then the response
is claimed again and run from the start, at most `MAX_ATTEMPTS` times before it is failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, insert, or_, select, update

from gateway.store.tables import responses

MAX_ATTEMPTS = 3  # claims of one background response; one that keeps killing its worker then fails
MAX_CHAIN = 1000  # responses followed back from a previous_response_id (a conversation longer is cut there)
RUNNABLE = ("queued", "in_progress")


@dataclass(frozen=True)
class StoredResponse:
    id: str
    project: str
    status: str
    background: bool
    previous_response_id: str | None
    input_items: list[dict[str, Any]]
    response: dict[str, Any]

    @classmethod
    def from_row(cls, row: Any) -> StoredResponse:
        response = dict(json.loads(row.response_json), status=row.status)  # a claim changes only the column
        return cls(row.id, row.project, row.status, row.background, row.previous_response_id,
                   json.loads(row.input_items_json), response)


@dataclass(frozen=True)
class ResponseClaim:
    """A worker's hold on a background response: its writes count only while `epoch` is the row's."""

    response_id: str
    project: str
    epoch: int
    engine_request: bytes
    response: dict[str, Any]  # as created (queued): the shell the result is built on
    attempts: int
    input_items: list[dict[str, Any]]  # the response's own input items (its conversation gets them at the end)


class ResponseStore:
    """Stored responses in the database. Blocking calls: run them off the event loop."""

    def __init__(self, db: Engine) -> None:
        self.db = db

    def insert(
        self, response: dict[str, Any], project: str, input_items: list[dict[str, Any]],
        engine_request: bytes | None = None,
    ) -> None:
        """Store `response` (its id, status and previous id read from it); a background one with the engine
        request its worker will send."""
        with self.db.begin() as c:
            c.execute(insert(responses).values(
                id=response["id"], project=project, created_at=response["created_at"], status=response["status"],
                background=engine_request is not None, previous_response_id=response.get("previous_response_id"),
                input_items_json=json.dumps(input_items), response_json=json.dumps(response),
                engine_request=engine_request,
            ))

    def get(self, response_id: str, project: str) -> StoredResponse | None:
        with self.db.connect() as c:
            row = c.execute(select(responses).where(responses.c.id == response_id,
                                                    responses.c.project == project)).one_or_none()
        return StoredResponse.from_row(row) if row is not None else None

    def delete(self, response_id: str, project: str) -> bool:
        """Delete the record (a background response still running is cancelled by it: its worker's writes find
        no row); False if the project has no such response."""
        with self.db.begin() as c:
            result = c.execute(delete(responses).where(responses.c.id == response_id,
                                                       responses.c.project == project))
        return result.rowcount == 1

    def delete_created_before(self, created_before: int, limit: int = 500) -> int:
        """Delete up to `limit` responses created before `created_before` (unix seconds) that have ended (a
        background response still queued or running is kept until it ends); how many. Responses that continue a
        deleted one keep their own record; their chain stops there (`chain`)."""
        with self.db.begin() as c:
            old = c.execute(select(responses.c.pk).where(responses.c.created_at < created_before,
                                                         responses.c.status.not_in(RUNNABLE))
                            .order_by(responses.c.created_at).limit(limit)).scalars().all()
            if not old:
                return 0
            result = c.execute(delete(responses).where(responses.c.pk.in_(old), responses.c.status.not_in(RUNNABLE)))
        return int(result.rowcount)

    def chain(self, response_id: str, project: str) -> list[StoredResponse]:
        """The response `response_id` and the ones it continues, oldest first: [] if the project has no such
        response. The walk stops at a response that was deleted, or after MAX_CHAIN responses."""
        found: list[StoredResponse] = []
        next_id: str | None = response_id
        with self.db.connect() as c:
            while next_id is not None and len(found) < MAX_CHAIN:
                row = c.execute(select(responses).where(responses.c.id == next_id,
                                                        responses.c.project == project)).one_or_none()
                if row is None:
                    break
                found.append(StoredResponse.from_row(row))
                next_id = row.previous_response_id
        return found[::-1]

    # -- background ----------------------------------------------------------------------------------------

    def claim_next(self, owner: str, now: float, lease_s: float) -> ResponseClaim | None:
        """Claim the oldest runnable background response no live lease holds; None if there is none."""
        with self.db.begin() as c:
            candidates = c.execute(
                select(responses.c.id).where(responses.c.status.in_(RUNNABLE), responses.c.background.is_(True),
                                             _lease_free(now))
                .order_by(responses.c.pk).limit(8)
            ).scalars().all()
            for response_id in candidates:
                result = c.execute(
                    update(responses)
                    .where(responses.c.id == response_id, responses.c.status.in_(RUNNABLE), _lease_free(now))
                    .values(status="in_progress", lease_owner=owner, lease_expires_at=now + lease_s,
                            lease_epoch=responses.c.lease_epoch + 1, attempts=responses.c.attempts + 1)
                )
                if result.rowcount == 1:
                    row = c.execute(select(responses).where(responses.c.id == response_id)).one()
                    shell = json.loads(row.response_json)
                    return ResponseClaim(row.id, row.project, row.lease_epoch, row.engine_request or b"", shell,
                                         row.attempts, json.loads(row.input_items_json))
        return None

    def renew(self, claim: ResponseClaim, now: float, lease_s: float) -> bool:
        """Extend the lease; False if the claim no longer holds the response (cancelled, deleted, claimed by
        another worker), and the worker should stop."""
        with self.db.begin() as c:
            result = c.execute(
                update(responses)
                .where(responses.c.id == claim.response_id, responses.c.lease_epoch == claim.epoch,
                       responses.c.status == "in_progress")
                .values(lease_expires_at=now + lease_s)
            )
        return result.rowcount == 1

    def finish(self, claim: ResponseClaim, response: dict[str, Any]) -> bool:
        """Record the background response's end (`response` with its final status); False, writing nothing, if
        the claim no longer holds it."""
        with self.db.begin() as c:
            result = c.execute(
                update(responses)
                .where(responses.c.id == claim.response_id, responses.c.lease_epoch == claim.epoch,
                       responses.c.status == "in_progress")
                .values(status=response["status"], response_json=json.dumps(response), engine_request=None,
                        lease_owner=None, lease_expires_at=None)
            )
        return result.rowcount == 1

    def release(self, claim: ResponseClaim, retry_at: float) -> None:
        """Give the response back to be claimed again from `retry_at` (no engine could take it now)."""
        with self.db.begin() as c:
            c.execute(
                update(responses)
                .where(responses.c.id == claim.response_id, responses.c.lease_epoch == claim.epoch,
                       responses.c.status == "in_progress")
                .values(status="queued", lease_owner=None, lease_expires_at=retry_at,
                        attempts=responses.c.attempts - 1)
            )

    def cancel(self, response_id: str, project: str) -> StoredResponse | None:
        """Cancel a background response that has not ended (its worker stops at its next renewal); the record
        afterwards, as it is if it had ended; None if the project has no such response."""
        with self.db.begin() as c:
            row = c.execute(select(responses).where(responses.c.id == response_id,
                                                    responses.c.project == project)).one_or_none()
            if row is None:
                return None
            if row.background and row.status in RUNNABLE:
                body = dict(json.loads(row.response_json), status="cancelled")
                c.execute(update(responses).where(responses.c.id == response_id, responses.c.status.in_(RUNNABLE))
                          .values(status="cancelled", response_json=json.dumps(body), engine_request=None,
                                  lease_owner=None, lease_expires_at=None))
                row = c.execute(select(responses).where(responses.c.id == response_id)).one()
        return StoredResponse.from_row(row)


def _lease_free(now: float) -> Any:
    return or_(responses.c.lease_expires_at.is_(None), responses.c.lease_expires_at < now)

