"""Admission at the EngineLoop seam: a full queue refuses a call (QueueFullError) or, for an add that waits (the
Batch RPC's items), holds it in arrival order until its class has room; held adds end as queued ones would when
aborted or past their deadline. A real tiny EngineCore runs on its own thread."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from engine_server.core.engine_core import CoreOutput, EngineCore
from engine_server.core.request import Priority, Request, RequestStatus
from engine_server.errors import QueueFullError
from engine_server.sampling_params import SamplingParams
from engine_server.server.engine_loop import EngineLoop, RequestStream
from tests.unit.runner_factories import MAX_MODEL_LEN, tiny_engine_config, tiny_source

T = TypeVar("T")


def _core(max_waiting: int = 2) -> EngineCore:
    config = tiny_engine_config(max_num_seqs=1)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_waiting=max_waiting))
    return EngineCore(config, tiny_source())


def _group(call: str, size: int, max_tokens: int = 3, priority: Priority = Priority.BATCH,
           deadline: float | None = None) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(f"{call}:{i}", [1 + i, 2, 3], params, max_model_len=MAX_MODEL_LEN, priority=priority,
                    deadline=deadline) for i in range(size)]


async def _finished(stream: RequestStream) -> dict[str, CoreOutput]:
    """Each core request's last output, once all have finished."""
    last: dict[str, CoreOutput] = {}
    while len([o for o in last.values() if o.finished]) < len(stream.core_ids):
        for output in await stream.next():
            last[output.request_id] = output
    return last


def _serve(core: EngineCore, body: Callable[[EngineLoop], Awaitable[T]]) -> T:
    async def run() -> T:
        loop = EngineLoop(core, asyncio.get_running_loop())
        loop.start()
        try:
            return await asyncio.wait_for(body(loop), 60)
        finally:
            await asyncio.to_thread(loop.stop)

    return asyncio.run(run())


def test_a_full_queue_refuses_an_add_that_does_not_wait() -> None:
    async def body(loop: EngineLoop) -> list[BaseException | dict[str, CoreOutput]]:
        streams = [loop.add(f"c{k}", _group(f"c{k}", 1, max_tokens=32)) for k in range(8)]
        return list(await asyncio.gather(*(_finished(s) for s in streams), return_exceptions=True))

    results = _serve(_core(), body)
    assert any(isinstance(r, QueueFullError) for r in results)


def test_adds_that_wait_are_held_in_order_until_there_is_room_and_all_finish() -> None:
    """Eight calls of three requests each (a group larger than max_waiting) against a queue of 2 and one seat:
    none is refused, each ends with its tokens, and the load counts the held requests as waiting."""
    waiting_seen: list[int] = []

    async def body(loop: EngineLoop) -> list[dict[str, CoreOutput]]:
        streams = [loop.add(f"c{k}", _group(f"c{k}", 3), final_only=True, wait=True) for k in range(8)]
        await asyncio.sleep(0)
        results = []
        for stream in streams:
            waiting_seen.append(loop.load.waiting)
            results.append(await _finished(stream))
        return results

    results = _serve(_core(), body)
    for result in results:
        assert all(o.status is RequestStatus.FINISHED_LENGTH and len(o.new_tokens) == 3 for o in result.values())
    assert max(waiting_seen) > 3  # held requests count in GetLoad's waiting


def test_held_batch_work_never_turns_an_interactive_call_away() -> None:
    async def body(loop: EngineLoop) -> tuple[dict[str, CoreOutput], list[dict[str, CoreOutput]]]:
        held = [loop.add(f"b{k}", _group(f"b{k}", 2, max_tokens=16), final_only=True, wait=True) for k in range(6)]
        chats = [loop.add(f"chat{k}", _group(f"chat{k}", 1, priority=Priority.INTERACTIVE)) for k in range(2)]
        chat_results = await asyncio.gather(*(_finished(s) for s in chats))
        return chat_results[0], list(await asyncio.gather(*(_finished(s) for s in held)))

    chat, held = _serve(_core(), body)
    assert all(o.status is RequestStatus.FINISHED_LENGTH for o in chat.values())
    assert all(o.status is RequestStatus.FINISHED_LENGTH for result in held for o in result.values())


def test_a_held_add_ends_aborted_or_past_its_deadline_as_a_queued_one_would() -> None:
    async def body(loop: EngineLoop) -> tuple[dict[str, CoreOutput], dict[str, CoreOutput], dict[str, CoreOutput]]:
        running = [loop.add(f"b{k}", _group(f"b{k}", 1, max_tokens=200), wait=True) for k in range(3)]
        aborted = loop.add("gone", _group("gone", 2), wait=True)
        # Past its deadline by the time the loop holds it (the queue is full behind b0..b2), whatever the machine's
        # speed: with a deadline ahead, a fast machine ran b0..b2's ~375 tokens, then "late", inside it.
        late = loop.add("late", _group("late", 1, deadline=time.monotonic() + 0.001), wait=True)
        stopped = loop.add("stopped", _group("stopped", 1), wait=True)
        await asyncio.sleep(0.05)
        loop.abort(list(aborted.core_ids))
        gone = await _finished(aborted)
        expired = await _finished(late)
        loop.abort_all()
        last = await _finished(stopped)
        for stream in running:
            await _finished(stream)
        return gone, expired, last

    gone, expired, last = _serve(_core(), body)
    assert {o.status for o in gone.values()} == {RequestStatus.FINISHED_ABORTED} and len(gone) == 2
    assert [o.status for o in expired.values()] == [RequestStatus.FINISHED_DEADLINE]
    assert [o.status for o in last.values()] == [RequestStatus.FINISHED_ABORTED]


def test_held_adds_are_admitted_when_the_step_that_made_room_emptied_the_core() -> None:
    """Each call finishes within the step that admits it (one token), leaving the core with nothing to do: the
    held ones must still be admitted (the loop may not wait for a command first)."""
    async def body(loop: EngineLoop) -> list[dict[str, CoreOutput]]:
        streams = [loop.add(f"c{k}", _group(f"c{k}", 1, max_tokens=1), wait=True) for k in range(4)]
        return list(await asyncio.gather(*(_finished(s) for s in streams)))

    results = _serve(_core(max_waiting=1), body)
    assert all(o.status is RequestStatus.FINISHED_LENGTH for result in results for o in result.values())
