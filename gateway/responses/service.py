"""`ResponseService`: what the `/v1/responses` routes need, opened in the app's lifespan.

It holds the stored responses (`ResponseStore`, on the database the files and batches use), runs the
`BackgroundRunner`, and with a retention deletes the responses that have outlived it (every gateway sweeps; two
sweeps on a shared database delete each response once). Its calls turn a Responses body into the conversation to
send (the items of the stored chain `previous_response_id` names, then the body's own), and store, cancel and look
up responses for one project.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from gateway.engines import EnginePool
from gateway.errors import APIError, invalid
from gateway.responses.background import BackgroundRunner
from gateway.responses.conversations import ConversationService
from gateway.store import ids
from gateway.store.responses import ResponseStore, StoredResponse
from gateway.usage import UsageLedger

log = structlog.get_logger(__name__)

CONTINUABLE = frozenset({"completed", "incomplete"})


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response with id '{response_id}' found.", param=param, code="not_found")


class ResponseService:
    """Stored responses and background runs of one gateway."""

    def __init__(self, pool: EnginePool, lease_s: float, usage: UsageLedger, retention_s: float | None = None,
                 sweep_interval_s: float = 60.0) -> None:
        """`retention_s`: how long a stored response is kept (None: until deleted), checked every
        `sweep_interval_s`."""
        self.pool = pool
        self.lease_s = lease_s
        self.usage = usage  # where background responses count what they used
        self.retention_s = retention_s
        self.sweep_interval_s = sweep_interval_s
        self.conversations = ConversationService()
        self._store: ResponseStore | None = None
        self._runner: BackgroundRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def store(self) -> ResponseStore:
        assert self._store is not None, "ResponseService.start() has not run"
        return self._store

    async def start(self, db: Engine) -> None:
        self._store = ResponseStore(db)
        self.conversations.start(db)
        self._runner = BackgroundRunner(self._store, self.pool, self.lease_s, self.usage, self.conversations)
        self._tasks.append(asyncio.create_task(self._runner.run(), name="background-responses"))
        if self.retention_s is not None:
            self._tasks.append(asyncio.create_task(self._sweep(self.retention_s), name="response-retention"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def delete_expired(self, retention_s: float, now: float | None = None) -> int:
        """Delete every response created more than `retention_s` before `now` (default: the present) that has
        ended; how many. Blocking."""
        created_before = int((time.time() if now is None else now) - retention_s)
        deleted = 0
        while page := self.store.delete_created_before(created_before):
            deleted += page
        return deleted

    async def _sweep(self, retention_s: float) -> None:
        """`delete_expired`, then wait `sweep_interval_s`, until cancelled; a database error is logged and the
        next sweep tried."""
        while True:
            try:
                deleted = await asyncio.to_thread(self.delete_expired, retention_s)
                if deleted:
                    log.info("stored responses past their retention deleted", responses=deleted)
            except SQLAlchemyError:
                log.exception("could not delete stored responses past their retention; trying again later")
            await asyncio.sleep(self.sweep_interval_s)

    async def history(self, previous_response_id: str | None, conversation_id: str | None, project: str
                      ) -> list[dict[str, Any]]:
        """The items a response starts from: its conversation's (`conversation_id`), or those continuing
        `previous_response_id` (every stored response of its chain's input items and output, oldest first), or
        none. 404 if the project has no such conversation or response; 400 if the response has not ended with
        output to continue from."""
        if conversation_id is not None:
            return await self.conversations.history(conversation_id, project)
        if previous_response_id is None:
            return []
        chain: list[StoredResponse] = []
        if ids.is_id(previous_response_id, ids.RESPONSE_PREFIX):
            chain = await asyncio.to_thread(self.store.chain, previous_response_id, project)
        if not chain:
            raise not_found(previous_response_id, "previous_response_id")
        last = chain[-1]
        if last.status not in CONTINUABLE:
            raise invalid(f"previous_response_id names a response that is {last.status}; only a completed or "
                          "incomplete response can be continued", "previous_response_id")
        items: list[dict[str, Any]] = []
        for stored in chain:
            items += stored.input_items
            items += stored.response.get("output", [])
        return items

    async def store_response(self, response: dict[str, Any], project: str, items: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self.store.insert, response, project, items)

    async def ended(self, response: dict[str, Any], project: str, items: list[dict[str, Any]], store: bool) -> None:
        """A response that ran here has ended: stored (with `store`), then its input `items` and output appended
        to its conversation, if it has one."""
        if store:
            await self.store_response(response, project, items)
        await asyncio.to_thread(self.conversations.append_ended, response, project, items)

    async def queue(self, response: dict[str, Any], project: str, items: list[dict[str, Any]],
                    engine_request: bytes) -> None:
        """Store a background response (status queued) for a runner to claim; this gateway's starts at once."""
        await asyncio.to_thread(self.store.insert, response, project, items, engine_request)
        if self._runner is not None:
            self._runner.wake.set()

    async def get(self, response_id: str, project: str) -> StoredResponse:
        found = None
        if ids.is_id(response_id, ids.RESPONSE_PREFIX):
            found = await asyncio.to_thread(self.store.get, response_id, project)
        if found is None:
            raise not_found(response_id)
        return found

    async def delete(self, response_id: str, project: str) -> None:
        deleted = ids.is_id(response_id, ids.RESPONSE_PREFIX) and await asyncio.to_thread(
            self.store.delete, response_id, project)
        if not deleted:
            raise not_found(response_id)
        if self._runner is not None:
            self._runner.cancel_local(response_id)

    async def cancel(self, response_id: str, project: str) -> dict[str, Any]:
        """Cancel a background response (at once if it runs here; within a second on another gateway). 400 for
        a response that is not a background one; one that has ended is returned as it is."""
        stored = await self.get(response_id, project)
        if not stored.background:
            raise invalid("Only responses created with background: true can be cancelled.", "response_id")
        cancelled = await asyncio.to_thread(self.store.cancel, response_id, project)
        if cancelled is None:
            raise not_found(response_id)
        if self._runner is not None:
            self._runner.cancel_local(response_id)
        return cancelled.response

    async def input_items(
        self, response_id: str, project: str, limit: int, after: str | None, order: str
    ) -> tuple[list[dict[str, Any]], bool]:
        """A page of a stored response's input items (`after`: an item id; `order` "asc" or "desc") and whether
        more follow; 404 for an unknown response, 400 if `after` is none of its items."""
        stored = await self.get(response_id, project)
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        start = 0
        if after is not None:
            positions = {item.get("id"): i for i, item in enumerate(items)}
            if after not in positions:
                raise invalid(f"after {after!r} is not an input item of {response_id}", "after")
            start = positions[after] + 1
        return items[start:start + limit], start + limit < len(items)
