"""The line runner's attempts against a fake engine that keeps the real engine's rules (unique item ids per call,
a bounded intake): a line sent again gets fresh ids, a failed attempt sends no more of its parts, a poison line
(a reply over the message limit, a call that always breaks) ends as its own error line after bounded attempts
while the rest of its batch completes, and a project's window bounds its lines in flight over all its runners."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from gateway.batches.attempts import AttemptLimits, parse_item_id
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.store.batches import LineFailures
from gateway.translate.cache_salt import project_cache_salt
from tests.unit.fake_engine import MODEL, FakeEngine
from tests.unit.test_batch_worker import Rig, chat_line, run_lines, source

COMPLETIONS = "/v1/completions"


def by_id(results: list[LineResult]) -> dict[str, LineResult]:
    assert Counter(r.line.custom_id for r in results).most_common(1)[0][1] == 1, "a line with two results"
    return {r.line.custom_id: r for r in results}


async def test_a_line_sent_again_gets_fresh_item_ids_in_the_same_call(tmp_path: Path) -> None:
    """Refused for load, a line is sent again on the same call: the engine refuses a reused item id, so a retry
    under the old id would end as a 400 although nothing was wrong with the line."""
    fake = FakeEngine(refuse_once={"line 1", "line 4"}, max_num_seqs=1, delay_s=0.01)
    async with Rig(fake, tmp_path) as rig:
        results = by_id(await run_lines(rig, [chat_line(i) for i in range(8)]))
    assert all(r.ok for r in results.values()), [r.record for r in results.values() if not r.ok]
    assert fake.calls == 1 and fake.seen["line 1"] == fake.seen["line 4"] == 2
    assert len(set(fake.item_ids)) == len(fake.item_ids) == 10
    attempts = {parse_item_id(i) for i in fake.item_ids}
    assert (1, 1, 0) in attempts and (1, 2, 0) in attempts


async def test_a_failed_attempt_of_a_multi_part_line_sends_no_more_of_its_parts(tmp_path: Path) -> None:
    """The first part is refused while the others wait for the window: they are sent only with the next
    attempt, once each (not also for the attempt already taken back)."""
    item = {"custom_id": "p", "method": "POST", "url": COMPLETIONS,
            "body": {"model": MODEL, "prompt": ["p0", "p1", "p2"], "max_tokens": 3}}
    fake = FakeEngine(refuse_once={"p0"}, delay_s=0.02)
    async with Rig(fake, tmp_path) as rig:
        [result] = await run_lines(rig, [item], COMPLETIONS, window=1)
    assert result.ok and [c["text"] for c in result.record["response"]["body"]["choices"]] == ["P0", "P1", "P2"]
    assert fake.seen == Counter({"p0": 2, "p1": 1, "p2": 1})


async def test_a_reply_over_the_message_limit_is_its_lines_error_and_the_rest_complete(tmp_path: Path) -> None:
    fake = FakeEngine(oversize={"line 3"}, delay_s=0.01)
    limits = AttemptLimits(shared=3, alone=2)
    async with Rig(fake, tmp_path) as rig:
        results: list[LineResult] = []
        runner = LineRunner(rig.pool, MODEL, limits=limits)
        done = await asyncio.wait_for(
            runner.run(source([chat_line(i) for i in range(8)]), results.append, asyncio.Event()), 60)
    assert done
    lines = by_id(results)
    assert [c for c, r in lines.items() if not r.ok] == ["c3"] and len(lines) == 8
    error = lines["c3"].record["response"]
    assert error["status_code"] == 500 and error["body"]["error"]["code"] == "reply_too_large"
    assert "message limit" in error["body"]["error"]["message"]
    assert fake.seen["line 3"] == limits.shared + limits.alone  # bounded: never again after that


async def test_a_line_whose_call_always_breaks_ends_as_an_error_line(tmp_path: Path) -> None:
    fake = FakeEngine(break_call={"line 2"}, delay_s=0.01)
    async with Rig(fake, tmp_path) as rig:
        results = await asyncio.wait_for(run_lines(rig, [chat_line(i) for i in range(6)]), 60)
    lines = by_id(results)
    assert [c for c, r in lines.items() if not r.ok] == ["c2"] and len(lines) == 6
    error = lines["c2"].record["response"]["body"]["error"]
    assert error["code"] == "line_failed" and "INTERNAL" in error["message"] and "5 times" in error["message"]
    assert all(r.record["response"]["body"]["choices"][0]["message"]["content"] == f"LINE {c[1:]}"
               for c, r in lines.items() if r.ok)


async def test_a_project_window_bounds_the_items_in_flight_of_all_its_runners(tmp_path: Path) -> None:
    fake = FakeEngine(max_num_seqs=8, delay_s=0.03)
    async with Rig(fake, tmp_path) as rig:
        shared = asyncio.Semaphore(3)
        results: list[list[LineResult]] = [[], []]

        async def run(k: int) -> bool:
            items = [chat_line(100 * k + i) for i in range(20)]
            return await LineRunner(rig.pool, MODEL, project_window=shared).run(
                source(items), results[k].append, asyncio.Event())

        assert all(await asyncio.gather(run(0), run(1)))
    assert fake.max_unanswered_total == 3 and shared._value == 3  # every permit given back
    assert len(results[0]) == len(results[1]) == 20


async def test_the_fake_engine_refuses_a_reused_item_id_as_the_engine_does(tmp_path: Path) -> None:
    """The rule the retries above rely on, seen through the fake (the real engine's is tested in
    tests/e2e/test_rpcs.py)."""
    from ladle.v1 import engine_pb2

    fake = FakeEngine()
    async with Rig(fake, tmp_path) as rig:
        engine = rig.pool.pick()
        request = engine_pb2.GenerateRequest()
        request.input.text = "x"
        items = [engine_pb2.BatchRequest(item_id=i, request=request) for i in ("a", "a", "")]
        replies: list[Any] = [r async for r in engine.client.batch(iter(items))]
    errors = sorted(r.error.message for r in replies if r.WhichOneof("outcome") == "error")
    assert len(replies) == 3 and len(errors) == 2
    assert "already used" in errors[0] and "must not be empty" in errors[1]


async def test_a_projects_batch_completes_while_another_projects_poison_batch_runs(tmp_path: Path) -> None:
    """Project A's long batch holds a line whose call always breaks; B's one-line batch, submitted later, is
    claimed by a second worker (claims go round-robin by project) and completes while A's still runs. Every item
    carries its project's cache salt."""
    fake = FakeEngine(break_call={"line 7"}, delay_s=0.05, max_num_seqs=2)
    async with Rig(fake, tmp_path) as rig:
        a = rig.batch([chat_line(i) for i in range(60)], project="a")
        b = rig.batch([chat_line(1000)], project="b")
        tasks = [asyncio.create_task(rig.worker().run()) for _ in range(2)]
        try:
            while (record := rig.batches.get(b.id)) is not None and record.status != "completed":
                await asyncio.sleep(0.02)
            assert (rig.batches.get(a.id) or a).status == "in_progress"
            while (done := rig.batches.get(a.id)) is not None and done.status != "completed":
                await asyncio.sleep(0.05)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        errors = rig.result_lines(done.error_file_id)
    assert (done.completed, done.failed) == (59, 1) and [e["custom_id"] for e in errors] == ["c7"]
    assert errors[0]["response"]["body"]["error"]["code"] == "line_failed"
    assert set(fake.cache_salts) == {project_cache_salt("a"), project_cache_salt("b")}


async def test_a_line_takes_up_the_failed_attempts_an_earlier_claim_recorded(tmp_path: Path) -> None:
    """A poison line that failed its shared attempts under a worker that died runs alone at once under the next,
    and ends after its remaining attempts there; the counts go to `on_failure` as they grow."""
    fake = FakeEngine(break_call={"line 2"})
    recorded: dict[str, LineFailures] = {}
    async with Rig(fake, tmp_path) as rig:
        results: list[LineResult] = []
        runner = LineRunner(rig.pool, MODEL, limits=AttemptLimits(shared=3, alone=2),
                            failures={"c2": LineFailures(3, 1, "earlier")}, on_failure=recorded.__setitem__)
        assert await asyncio.wait_for(runner.run(source([chat_line(i) for i in range(4)]), results.append,
                                                 asyncio.Event()), 30)
    lines = by_id(results)
    assert [c for c, r in lines.items() if not r.ok] == ["c2"] and fake.seen["line 2"] == 1
    assert recorded["c2"] == LineFailures(4, 2, recorded["c2"].last_error) and "INTERNAL" in recorded["c2"].last_error
