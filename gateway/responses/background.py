"""`BackgroundRunner`: runs the background responses of every gateway sharing the database, one task per response.

It claims queued responses (and ones whose worker died: their lease ran out) from `ResponseStore`, sends each one's
stored engine request as a non-streaming generation, renews its lease every `RENEW_S` while the engine works,
and records the finished Response fenced by its claim. A response cancelled or deleted meanwhile (here or on
another replica) loses its claim at the next renewal, and its engine call is cancelled, which aborts it in the
engine. No engine able to take it now (503, 429) gives it back to be claimed again a little later; any other
engine error is the response's own: it ends `failed` with that error. A response claimed more than
`MAX_ATTEMPTS` times (its worker keeps dying) ends `failed` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import time
from typing import Any

import structlog
from sqlalchemy.exc import SQLAlchemyError

from gateway import calls
from gateway.engines import EnginePool
from gateway.errors import APIError
from gateway.responses.conversations import ConversationService
from gateway.store.responses import MAX_ATTEMPTS, ResponseClaim, ResponseStore
from gateway.translate import responses_from_engine
from gateway.usage import UsageLedger
from ladle.v1 import engine_pb2

log = structlog.get_logger(__name__)

MAX_RUNNING = 64  # background responses one gateway runs at once
POLL_S = 1.0  # how often an idle runner looks for work that another replica queued
RENEW_S = 1.0  # how often a running response's lease is renewed, and a cancellation elsewhere noticed
RETRY_S = 2.0  # how long a response no engine could take waits before it is claimed again
TRANSIENT = frozenset({429, 503})


class BackgroundRunner:
    """Claims and runs background responses; `cancel_local` stops one running here at once."""

    def __init__(self, store: ResponseStore, pool: EnginePool, lease_s: float, usage: UsageLedger,
                 conversations: ConversationService | None = None) -> None:
        """`conversations`: where a response created in a conversation appends its items when it has ended."""
        self.store = store
        self.conversations = conversations
        self.pool = pool
        self.usage = usage
        self.lease_s = lease_s
        self.owner = f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(4)}"
        self.wake = asyncio.Event()  # set when a background response is created here
        self.running: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Claim and start responses until cancelled; then cancel the ones running (their leases run out, and
        another gateway runs them again)."""
        try:
            while True:
                claim = None
                if len(self.running) < MAX_RUNNING:
                    try:
                        claim = await asyncio.to_thread(self.store.claim_next, self.owner, time.time(), self.lease_s)
                    except SQLAlchemyError:
                        log.warning("could not claim a background response", exc_info=True)
                if claim is None:
                    self.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), POLL_S)
                    continue
                log.info("background response claimed", response_id=claim.response_id, attempt=claim.attempts)
                task = asyncio.create_task(self._run_one(claim), name=f"response-{claim.response_id}")
                self.running[claim.response_id] = task
                task.add_done_callback(functools.partial(self._ended, claim.response_id))
        finally:
            for task in list(self.running.values()):
                task.cancel()

    def _ended(self, response_id: str, _task: asyncio.Task[None]) -> None:
        self.running.pop(response_id, None)

    def cancel_local(self, response_id: str) -> None:
        task = self.running.get(response_id)
        if task is not None:
            task.cancel()

    async def _run_one(self, claim: ResponseClaim) -> None:
        request = engine_pb2.GenerateRequest.FromString(claim.engine_request)
        if claim.attempts > MAX_ATTEMPTS:
            response = responses_from_engine.failed(
                claim.response, "server_error",
                f"the response was started {MAX_ATTEMPTS} times and its gateway stopped each time")
            await self._finish(claim, response)
            return
        call = asyncio.create_task(calls.generate(self.pool, request))
        try:
            while not call.done():
                await asyncio.wait([call], timeout=RENEW_S)
                if not call.done() and not await asyncio.to_thread(self.store.renew, claim, time.time(),
                                                                   self.lease_s):
                    log.info("background response cancelled or taken over", response_id=claim.response_id)
                    return
            reply = call.result()
        except APIError as error:
            if error.status in TRANSIENT:
                log.info("no engine could take a background response now; it will be claimed again",
                         response_id=claim.response_id, status=error.status, error=error.message)
                await asyncio.to_thread(self.store.release, claim, time.time() + RETRY_S)
                return
            await self._finish(claim, responses_from_engine.failed(claim.response, error.code or error.type,
                                                                   error.message))
            return
        except SQLAlchemyError:
            log.warning("lost the database while running a background response; its lease will run out",
                        response_id=claim.response_id, exc_info=True)
            return
        except Exception:  # a bug: the lease runs out and the response is run again (up to MAX_ATTEMPTS)
            log.exception("a background response failed unexpectedly", response_id=claim.response_id)
            return
        finally:
            call.cancel()
        self.usage.record(claim.project, str(claim.response.get("model", "")), "interactive", [reply.usage])
        await self._finish(claim, responses_from_engine.from_reply(claim.response, reply, request.sampling.logprobs))

    async def _finish(self, claim: ResponseClaim, response: dict[str, Any]) -> None:
        try:
            if not await asyncio.to_thread(self.store.finish, claim, response):
                log.info("background response ended after its claim was lost", response_id=claim.response_id)
                return
            if self.conversations is not None:
                await asyncio.to_thread(self.conversations.append_ended, response, claim.project, claim.input_items)
        except SQLAlchemyError:
            log.warning("could not record a background response's end; it will run again",
                        response_id=claim.response_id, exc_info=True)
