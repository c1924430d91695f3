"""Continuous-batching scheduler: one token budget per step shared by decodes and chunked prefills.

Each step serves running requests first, in priority order (INTERACTIVE before BATCH, earlier arrival
first): a decode takes one token, a request still prefilling takes a chunk of what budget is left. Then
waiting requests are admitted in the same order (FIFO within a class, preempted requests at the front of
theirs) and prefill in chunks up to the budget, unless a running request lost its blocks this step:
admitting then would only swap one request's blocks for another's.

Interactive first. An INTERACTIVE caller waits on its first token; a BATCH job only on its total time.
- Step composition: while an INTERACTIVE request has prompt to prefill (it waits to start, or runs a chunked
  prefill), the step carries INTERACTIVE work only. Running BATCH requests keep their seats and blocks (and
  any token still on the way) but sit the step out, and no BATCH request is admitted: a step's time grows
  with its rows, on the CPU most of all, so the prefill alone reaches its first token sooner. Once it
  decodes, BATCH decodes share the steps again.
- Seats and blocks: an INTERACTIVE request being admitted that finds every seat taken (`max_num_seqs`) or
  the KV pool short of its chunk preempts running BATCH requests by recompute (below), lowest rank first,
  until it fits; never an INTERACTIVE request. Its victims are not scheduled in that step (BATCH work sits
  it out) and cannot come back in it (only INTERACTIVE requests are admitted), so none returns ahead of the
  request it made room for; and as a BATCH request never preempts an INTERACTIVE one, nothing thrashes.
  For the same reason BATCH victims of a running INTERACTIVE request short of blocks do not hold admission
  back. A BATCH request close to its end gets no reprieve: sparing it would cost the caller a whole BATCH
  step, the lowest rank is the latest arrival (in a stream of batch work, the one with least done), and with
  prefix caching its full blocks stay cached, so its recompute mostly hits.
BATCH work still fills every step without an INTERACTIVE prefill. Without INTERACTIVE traffic none of this
applies, so a batch alone is scheduled exactly as before, but for the step-time cap:
- Step-time cap: a request arriving during a step waits for it (on the CPU the engine core stops a step of BATCH
  work only for an INTERACTIVE arrival and takes it back with `undo`, engine_server.step_interrupt; not a step
  with INTERACTIVE rows, nor the next BATCH step after a stopped one, nor any step on CUDA). With a
  `StepTimeModel` (engine_server.core.step_timing), a step without INTERACTIVE prefill keeps to the model's
  time target: it carries the decode rows that fit it (INTERACTIVE rows always; BATCH rows past the limit sit
  the step out, in rank order, and no BATCH request is admitted past it, so none holds a seat it cannot use)
  and the prefill tokens that fit beside them. On a GPU rows cost little and all fit; on the CPU each costs
  about a prompt token, so without the row limit a step of 64 batch decodes alone takes ~4x the target. The
  step's progress is its rows; a step without decode rows carries at least the model's minimum chunk of
  prefill, so BATCH work always progresses. A step with INTERACTIVE prefill keeps the whole token budget.
  While no INTERACTIVE request has arrived or run for `step_timing.INTERACTIVE_QUIET_S`, every row runs and
  the model's larger quiet target bounds the prefill, so a batch alone is not cut into small, costlier steps.

When the KV pool runs dry for a running request, the lowest-priority, latest-arrived running request is
preempted by recompute: its blocks are freed (cached blocks stay reusable), `num_computed_tokens` returns
to 0 and its outputs are kept, so it later re-prefills prompt + outputs and continues where it was. No
request is ever failed for lack of blocks. A request that cannot fit even alone just waits: the engine
guarantees prompt + max_tokens <= max_model_len and a pool holding one max_model_len sequence, so that
cannot happen with a correctly sized pool.

All work per step is O(running + newly admitted), plus hashing blocks that became full.

Steady decode. A step that schedules every running request as a plain decode (one token, sampled; no drafts,
no admission, no preemption) is recorded in columns (`_SteadyRecord`). While the next step would do exactly the
same one token further on — the same running requests, nothing INTERACTIVE waiting beside BATCH rows, every
row within the budget and the row limit and allowed to run ahead of a pending token — it is scheduled from the
record: array arithmetic finds the rows whose token leaves the slots held in place (about one in `block_size`),
those alone go to the KV cache manager, and each row's counters advance in one plain loop. The step goes out as
a `SteadyDecode` (no `ScheduledRequest` per row) and its update appends the tokens in one loop, checking stop
rules only where a token is a stop or eos id of some row or the length ends the row. Decisions, blocks and
tokens are exactly those of the general path (tests/unit/test_steady_decode.py runs both side by side).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from engine_server.config import CacheConfig, SchedulerConfig
from engine_server.core.adapter_slots import AdapterSlots
from engine_server.core.kv_cache_manager import KVCacheManager
from engine_server.core.request import Priority, Request, RequestStatus, receive_pending_tokens
from engine_server.core.scheduler_output import ScheduledRequest, SchedulerOutput, StateCopies, SteadyDecode
from engine_server.core.state_slots import StateSlots
from engine_server.core.state_snapshots import StateSnapshots
from engine_server.core.step_timing import INTERACTIVE_QUIET_S, StepTimeModel
from engine_server.errors import QueueFullError

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_EVERY_ROW = 1 << 62  # no cap on a step's decode rows


def whole_images(request: Request, start: int, num_new: int, room: int) -> int:
    """`num_new` prompt tokens from `start` (what the step's prefill allowance gives) fitted so that a chunk never ends
    inside an image whose tokens attend both ways (`MultimodalInputs.bidirectional`: Gemma 3's): cut before the image,
    or, from inside it, stretched to its end where that fits `room` (the step's token budget, which an image may take
    past a BATCH prefill allowance, so that no allowance smaller than an image holds it back for good); 0 where it
    does not fit (the request waits for a step with room for all of it)."""
    images = request.multimodal
    if images is None or not images.bidirectional or start >= request.num_prompt_tokens:
        return num_new
    end = images.image_ends(start, start + num_new)
    if end <= start + num_new:
        return end - start
    return end - start if end - start <= room else 0


class Scheduler:
    """Decides, every engine step, which tokens of which requests the model runs. Owns the KV cache manager.

    Not thread-safe: call it only from the engine step loop. The loop is `schedule()`, run the model on
    the output, then `update_from_output()` with one sampled token per `needs_sample` request.

    With async scheduling the next `schedule()` may come before the last step's update: a request that
    samples counts its token as pending (`Request.num_pending_tokens`) from `schedule()` to its update, and
    a running request may decode again with that token as input (the runner takes it from the device) unless
    the pending tokens will end it by length or its sampling needs them on the host. A running request that
    sits a step out (BATCH, while an INTERACTIVE request prefills) keeps its pending token as it is: the
    engine collects each step right after launching the next, so that token is on the host before the
    request is scheduled again, and its input never has to come from an older launch than the last.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        step_time: StepTimeModel | None = None,
        window: int = 0,
        lora_slots: int = 0,
        state_slots: int = 0,
        state_snapshots: int = 0,
    ) -> None:
        """`step_time` caps the prefill of steps without INTERACTIVE prefill (module docstring); the caller
        feeds it the measured steps. None: no cap. `window` > 0: every layer of the model attends through that
        sliding window, and requests give back the blocks outside it (`KVCacheManager`). `lora_slots` > 0: the
        LoRA slots (`--max-loras`) that running requests of adapters share (`AdapterSlots`). `state_slots` > 0: the
        model keeps a linear-attention state per running request, in one of these slots each (`StateSlots`; as many
        as `max_num_seqs`); `state_snapshots` > 0 rows after them hold states at prompts' block boundaries, from
        which later requests with those prefixes start (`StateSnapshots`: with prefix caching on, a hybrid's cached
        prefix is one that ends at a snapshot)."""
        self.config = scheduler_config
        self.step_time = step_time
        self._last_interactive = -math.inf  # monotonic time an INTERACTIVE request last arrived or ran
        self.max_model_len = max_model_len
        self.total_preemptions = 0  # since start, for metrics and tests
        self._num_pooling = 0  # pooling requests queued or running (engine_server.pooling)
        self._num_reading_prompts = 0  # requests queued or running that asked for prompt logprobs
        self.kv_cache = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, window=window
        )
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: dict[Priority, deque[Request]] = {p: deque() for p in Priority}
        self._running: list[Request] = []  # sorted by _rank: preemption victims come from the tail
        self._seq: dict[str, int] = {}  # admission order: the tie-break of equal arrival times
        self._counter = itertools.count()
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (deadline, seq, request_id)
        self.steady_decode = True  # schedule steady decode steps from `_steady` (False: the general path only)
        self._steady: _SteadyRecord | None = None  # the last step, when it was a steady decode step
        self._num_finished = 0  # requests finished since start: a steady update checks no row's status unless it moved
        self.adapter_slots = AdapterSlots(lora_slots) if lora_slots else None
        self.state_slots = StateSlots(state_slots) if state_slots else None
        if state_slots and state_slots < scheduler_config.max_num_seqs:
            raise ValueError(f"{state_slots} state slots for {scheduler_config.max_num_seqs} running requests")
        self.snapshots = (
            StateSnapshots(state_slots, state_snapshots)
            if state_slots and state_snapshots and cache_config.enable_prefix_caching
            else None
        )
        self._restores: tuple[list[int], list[int]] = ([], [])  # this step's copies (`StateCopies`)
        self._saves: tuple[list[int], list[int]] = ([], [])

    # -- queries -------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def kv_usage(self) -> float:
        return self.kv_cache.usage

    @property
    def running_requests(self) -> list[Request]:
        """The running requests in rank order: the live list, to read and not to modify."""
        return self._running

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # -- admission and removal -----------------------------------------------------------------------

    def has_room(self, priority: Priority) -> bool:
        """Whether `add_requests` would admit a group of `priority` now: its class's queue holds fewer than
        `max_waiting` requests. Each class counts only its own queue, so queued BATCH work never turns an
        INTERACTIVE request away."""
        return len(self._waiting[priority]) < self.config.max_waiting

    def add_request(self, request: Request) -> None:
        """Queue a new request: `add_requests` of a group of one."""
        self.add_requests([request])

    def add_requests(self, group: Sequence[Request]) -> None:
        """Queue the requests of one call (its choices, or its pooling inputs) together, all of one priority:
        admitted while their class has room (`has_room`), whatever their number, so a call is never refused
        for its size and never half admitted. Raises QueueFullError otherwise, ValueError on a duplicate id
        (nothing is queued then)."""
        seen: set[str] = set()
        for request in group:
            if request.request_id in self._requests or request.request_id in seen:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            seen.add(request.request_id)
        if group and not self.has_room(group[0].priority):
            raise QueueFullError(f"too many queued requests (max_waiting={self.config.max_waiting})")
        for request in group:
            self._queue(request)

    def _queue(self, request: Request) -> None:
        seq = next(self._counter)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._seq[request.request_id] = seq
        self._waiting[request.priority].append(request)
        self._num_pooling += request.pooling is not None
        self._num_reading_prompts += request.sampling_params.prompt_logprobs is not None
        if request.priority is Priority.INTERACTIVE:
            self._last_interactive = max(self._last_interactive, request.arrival_time)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, seq, request.request_id))

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request in any state as FINISHED_ABORTED, freeing its blocks. None if unknown."""
        done = self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        return done[0] if done else None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End the given unfinished requests with `status` (e.g. a stop string the caller detected)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        done: list[Request] = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status in _QUEUED:
                self._waiting[request.priority].remove(request)
            request.status = status
            self._release(request)
            done.append(request)
        if any(r.is_finished for r in self._running):
            self._running = [r for r in self._running if not r.is_finished]
        return done

    def take_expired(self, now: float) -> list[Request]:
        """Finish queued requests whose deadline is <= now as FINISHED_DEADLINE and return them."""
        expired: list[Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, request_id = heapq.heappop(self._deadlines)
            request = self._requests.get(request_id)
            # A stale entry (request finished, or the id reused by a later request) is dropped.
            if request is None or self._seq[request_id] != seq or request.status not in _QUEUED:
                continue
            self._waiting[request.priority].remove(request)
            request.status = RequestStatus.FINISHED_DEADLINE
            self._release(request)
            expired.append(request)
        return expired

    # -- the step ------------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Pick this step's batch and advance `num_computed_tokens` of every scheduled request."""
        now = time.monotonic() if now is None else now
        self.kv_cache.begin_step()
        if self.snapshots is not None:
            self.snapshots.begin_step()
            self._restores, self._saves = ([], []), ([], [])
        finished = self.take_expired(now)
        record, self._steady = self._steady, None
        if record is not None:
            steady_output = self._schedule_steady(record, finished, now)
            if steady_output is not None:
                return steady_output
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        interactive_only, decode_rows = self._scan_running()
        prefill_left, row_limit = self._batch_allowance(interactive_only, decode_rows, now)
        rows_left = row_limit

        # Every running request, every step: the loop body is kept to plain arithmetic for a decode (one token,
        # inside its last block), which is most of them.
        running, kv_cache = self._running, self.kv_cache
        num_decode_rows = 0
        num_draft_tokens = 0
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if interactive_only and request.priority is not Priority.INTERACTIVE:
                break  # `_running` is in rank order: every request from here on is BATCH
            start = request.num_computed_tokens
            remaining = request.num_known_and_pending_tokens - start
            num_drafts = 0
            if remaining == 1:
                if rows_left <= 0 and request.priority is Priority.BATCH:
                    i += 1  # the step's decode rows fill the time target: this BATCH decode sits the step out
                    continue
                num_new = 1
                if request.draft_token_ids and not request.num_pending_tokens:
                    # An INTERACTIVE request's drafts speed it up; a BATCH one's count as its prefill, within the cap.
                    room = budget - 1 if request.priority is Priority.INTERACTIVE else min(budget - 1, prefill_left)
                    num_drafts = max(0, min(len(request.draft_token_ids), room))
                    num_new += num_drafts
            else:
                num_new = min(remaining, budget, prefill_left)
                if request.multimodal is not None:
                    num_new = whole_images(request, start, num_new, min(remaining, budget))
                if num_new <= 0:
                    i += 1
                    continue
                if self.snapshots is not None:
                    num_new = self._up_to_snapshot(request, start, num_new)
            if request.num_pending_tokens and not self._may_run_ahead(request):
                i += 1
                continue
            # `slots_in_place`'s first test, inline: a decode inside its last block ends here.
            blocks: list[int] | None
            if start + num_new <= request.num_slots_in_place:
                blocks = request.block_ids
            else:
                blocks = kv_cache.slot_for_one(request) if num_new == 1 else kv_cache.slots_in_place(request, num_new)
                if blocks is None and num_drafts:
                    blocks = kv_cache.allocate_slots(request, num_new)
                    if blocks is None:  # short of blocks: verify no drafts rather than preempt for them
                        num_new, num_drafts = 1, 0
                        blocks = kv_cache.slot_for_one(request)
                if blocks is None:
                    blocks = self._allocate_or_preempt(request, num_new, preempted)
                    if blocks is None:
                        break  # it preempted itself, so it was the tail: nothing after it is left
            # `_advance`, inline: this runs for every running request every step.
            request.num_computed_tokens = start + num_new
            if self.snapshots is not None and remaining != 1:
                self._snapshot_if_due(request)
            needs_sample = num_new - num_drafts == remaining and request.pooling is None
            if needs_sample:
                request.num_pending_tokens += 1  # until update_from_output brings its token
            if num_drafts:
                drafts = tuple(request.draft_token_ids[:num_drafts])
                scheduled.append(ScheduledRequest(request, start, num_new, blocks, True, 0, drafts))
                budget -= num_drafts
                if request.priority is Priority.BATCH:
                    prefill_left -= num_drafts
                num_draft_tokens += num_drafts
            else:
                scheduled.append(ScheduledRequest(request, start, num_new, blocks, needs_sample, 0))
            if remaining == 1:
                rows_left -= 1
                budget -= 1
                if start >= request.num_prompt_tokens:
                    num_decode_rows += 1  # not `is_prefill`
            else:
                budget -= num_new
                prefill_left -= num_new
                if num_new == 1 and start >= request.num_prompt_tokens:
                    num_decode_rows += 1  # a one-token chunk of a preempted request's outputs: not `is_prefill`
            i += 1

        num_running_rows = len(scheduled)
        if self._may_admit(interactive_only, preempted):
            classes = (Priority.INTERACTIVE,) if interactive_only else tuple(Priority)
            budget = self._admit_waiting(budget, prefill_left, row_limit, scheduled, finished, now, classes, preempted)

        output = self._output(
            scheduled, num_running_rows, num_decode_rows, budget, preempted, finished, num_draft_tokens
        )
        num_batched_tokens, num_decode_rows = output.num_batched_tokens, output.num_decode_rows
        if (
            self.steady_decode
            and scheduled
            and num_decode_rows == num_batched_tokens == len(scheduled) == num_running_rows == len(self._running)
            and not preempted
            and not num_draft_tokens
            and all(item.needs_sample for item in scheduled)
        ):
            self._steady = _SteadyRecord.of(scheduled, self.max_model_len)
            if self._steady is not None:
                self._steady.output = output
        return output

    def _output(
        self,
        scheduled: list[ScheduledRequest],
        num_running_rows: int,
        num_decode_rows: int,
        budget: int,
        preempted: list[str],
        finished: list[Request],
        num_draft_tokens: int,
    ) -> SchedulerOutput:
        """The step's output: `scheduled[:num_running_rows]` were running (`num_decode_rows` of them decodes), the
        rest admitted; `budget` is the token budget left."""
        num_batched_tokens = self.config.max_num_batched_tokens - budget
        num_decode_rows += sum(1 for item in scheduled[num_running_rows:] if not item.is_prefill)  # admitted ones
        return SchedulerOutput(
            scheduled,
            lora_loads=self.adapter_slots.take_loads() if self.adapter_slots is not None else None,
            num_batched_tokens=num_batched_tokens,
            preempted_ids=preempted,
            finished=finished,
            num_decode_rows=num_decode_rows,
            num_prefill_tokens=num_batched_tokens - num_decode_rows,
            num_running_rows=num_running_rows,
            num_draft_tokens=num_draft_tokens,
            has_pooling=self._num_pooling > 0,
            reads_prompts=self._num_reading_prompts > 0,
            state_copies=StateCopies(self._restores, self._saves) if self._restores[0] or self._saves[0] else None,
        )

    def _schedule_steady(self, record: _SteadyRecord, finished: list[Request], now: float) -> SchedulerOutput | None:
        """The step after a steady decode step, from its record, when it is again one (module docstring); None,
        with nothing changed but slots made for some rows (as the general path would make them), when it is not."""
        n = len(record.requests)
        if self._running != record.requests or n > self.config.max_num_batched_tokens:
            return None
        interactive_only = bool(self._waiting[Priority.INTERACTIVE])
        if interactive_only and record.num_batch:
            return None  # the BATCH rows sit the step out
        if not record.updated and (record.blocks_run_ahead or record.min_steps_left < 1):
            return None  # a row's pending token must reach the host before it runs again
        prefill_left, row_limit = self._batch_allowance(interactive_only, n, now)
        if row_limit < n and record.num_batch:
            return None  # BATCH rows past the limit sit the step out
        requests, room = record.requests, record.room
        if record.min_room < 1:
            crossing = np.flatnonzero(room < 1).tolist()
            crossers = [requests[i] for i in crossing]
            if self.kv_cache.slots_for_decodes(crossers) < len(crossers):
                return None  # short of blocks: the general path preempts (the rows served keep their slots)
            room[crossing] = [r.num_slots_in_place - r.num_computed_tokens for r in crossers]
            record.min_room = int(room.min())
        for request in requests:
            request.num_computed_tokens += 1
            request.num_pending_tokens += 1  # until update_from_output brings its token
        record.advance()
        steady = record.decode(self._num_finished)
        budget = self.config.max_num_batched_tokens - n
        if any(self._waiting.values()) and self._may_admit(interactive_only, []):
            admitted: list[ScheduledRequest] = []
            classes = (Priority.INTERACTIVE,) if interactive_only else tuple(Priority)
            preempted: list[str] = []
            budget = self._admit_waiting(budget, prefill_left, row_limit, admitted, finished, now, classes, preempted)
            if admitted or preempted:
                return self._output(steady.rows() + admitted, n, n, budget, preempted, finished, 0)
        output = SchedulerOutput(
            steady=steady, num_batched_tokens=n, finished=finished, num_decode_rows=n, num_running_rows=n
        )
        record.output = output
        self._steady = record
        return output

    def undo(self, output: SchedulerOutput) -> None:
        """Take back the scheduling of a step that stopped before it sampled (engine_server.step_interrupt), so
        that scheduling again starts from where it was: its running requests return to their computed and pending
        counts (they keep any block allocated for it: a later step uses it), the requests it admitted return, in
        order and without blocks, to the front of their queues, and the blocks it published are unpublished.
        Its preemptions and expirations stand: states a step may leave anyway (it admits nothing after one).
        Only for the last output of `schedule()`, before any `update_from_output` of it and with no other step
        between (no async scheduling).
        """
        self._steady = None  # its counts go back: the next step is scheduled by the general path
        if self.snapshots is not None:
            self.snapshots.undo()
        admitted = output.scheduled[output.num_running_rows :]
        for item in reversed(admitted):
            request = item.request
            self._give_back_adapter_slot(request)  # its slot keeps the adapter the step loaded: a later step reuses it
            self._give_back_state_slot(request)
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
            request.num_pending_tokens -= item.needs_sample
            if request.num_preemptions:
                request.status = RequestStatus.PREEMPTED
            else:
                request.status = RequestStatus.WAITING
                request.num_cached_tokens = 0
            self._waiting[request.priority].appendleft(request)
        if admitted:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        for item in output.scheduled[: output.num_running_rows]:
            item.request.num_computed_tokens = item.start_position
            item.request.num_pending_tokens -= item.needs_sample
        self.kv_cache.undo_publications()

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Sequence[int],
        runs: Sequence[Sequence[int]] | None = None,
    ) -> list[Request]:
        """Append each sampled token, apply stop rules, free finished requests and return them.

        `sampled_token_ids[i]` is the token of the i-th `needs_sample` row of `output` (the runner's sampling
        rows, in order). The token of a request that finished since `schedule()` is dropped (aborted, or, with
        async scheduling, ended by the step before). Steps must be updated in the order they were scheduled.

        `runs` (a step that verified drafts): `runs[i]` holds every token row i produced, in order (its accepted
        drafts, then the target's token; `[sampled_token_ids[i]]` for a row without drafts). They are appended one by
        one under the stop rules (a token that ends the request drops the rest), and a row with drafts takes back
        the computed positions of the drafts it rejected: their KV slots are written again by later steps.
        """
        record = self._steady
        if record is not None and record.output is output:
            record.updated = True
        steady = output.steady
        if steady is not None and runs is None and steady.finish_epoch == self._num_finished:
            return self._update_steady(steady, sampled_token_ids)  # no row finished since it was scheduled
        rows = output.scheduled
        if len(sampled_token_ids) != len(rows):  # equal: every row samples (a decode step), no filtering
            rows = [item for item in rows if item.needs_sample]
        if runs is not None:
            return self._update_runs(rows, runs)
        candidates: list[tuple[Request, int]] = []
        max_model_len = self.max_model_len
        for item, token_id in zip(rows, sampled_token_ids, strict=True):
            request = item.request
            request.num_pending_tokens -= 1
            if request.status.is_finished:
                continue
            request.append_output_token(token_id)
            # Most tokens end nothing: rule that out in a few lookups before the full stop rules.
            if (
                token_id not in request.eos_token_ids
                and token_id not in request.stop_token_ids
                and len(request.output_token_ids) < request.max_tokens
                and request.num_tokens < max_model_len
            ):
                continue
            candidates.append((request, token_id))
        return self._apply_stop_rules(candidates)

    def _update_steady(self, steady: SteadyDecode, token_ids: Sequence[int]) -> list[Request]:
        """`update_from_output` for a steady decode step none of whose rows finished since it was scheduled: every
        token appended in one loop, the stop rules applied to the rows a stop or eos id or the length may end."""
        requests = steady.requests
        receive_pending_tokens(requests, token_ids)
        length_end = steady.length_end_rows
        if steady.stop_ids.isdisjoint(token_ids) and not length_end:
            return []
        stop_ids = steady.stop_ids
        rows = sorted({*length_end, *(i for i, token_id in enumerate(token_ids) if token_id in stop_ids)})
        return self._apply_stop_rules([(requests[i], token_ids[i]) for i in rows])

    def _apply_stop_rules(self, candidates: list[tuple[Request, int]]) -> list[Request]:
        """Finish the requests whose new token (each `(request, token)` in row order) ends them; return them."""
        finished: list[Request] = []
        for request, token_id in candidates:
            status = self._stop_status(request, token_id)
            if status is not None:
                self._finish_stopped(request, status)
                finished.append(request)
        if finished:
            self._running = [r for r in self._running if not r.is_finished]
        return finished

    def _update_runs(self, rows: list[ScheduledRequest], runs: Sequence[Sequence[int]]) -> list[Request]:
        """`update_from_output` for a step with drafts: each row's tokens in order, each under the stop rules."""
        finished: list[Request] = []
        for item, run in zip(rows, runs, strict=True):
            request = item.request
            request.num_pending_tokens -= 1
            if request.status.is_finished:
                continue
            status = None
            for token_id in run:
                request.append_output_token(token_id)
                status = self._stop_status(request, token_id)
                if status is not None:
                    break
            if status is None:
                # The last token and the accepted drafts are computed; the rest is not (unless it was preempted since).
                if item.draft_token_ids and request.status is RequestStatus.RUNNING:
                    request.num_computed_tokens = item.start_position + len(run)
                continue
            self._finish_stopped(request, status)
            finished.append(request)
        if finished:
            self._running = [r for r in self._running if not r.is_finished]
        return finished

    def _finish_stopped(self, request: Request, status: RequestStatus) -> None:
        """End a request a stop rule ended (it stays in `_running` until the caller filters the list)."""
        if request.status in _QUEUED:  # preempted (async scheduling) while its token was on the way
            self._waiting[request.priority].remove(request)
        request.status = status
        self._release(request)

    # -- internals -----------------------------------------------------------------------------------

    def _may_run_ahead(self, request: Request) -> bool:
        """Whether a request whose last tokens are still pending may be scheduled again before they arrive:
        not when they will end it by length, nor when its sampling needs them on the host, nor when its next
        tokens are proposed from them (speculative decoding)."""
        if request.needs_output_history or request.speculative:
            return False
        num_outputs = request.num_output_tokens + request.num_pending_tokens
        return num_outputs < request.max_tokens and request.num_known_and_pending_tokens < self.max_model_len

    def _rank(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, self._seq[request.request_id])

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> list[int] | None:
        """Allocate for a running request, preempting from the tail of `_running` until it fits."""
        while True:
            blocks = self.kv_cache.allocate_slots(request, num_new)
            if blocks is not None:
                return blocks
            victim = self._running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None

    def _scan_running(self) -> tuple[bool, int]:
        """In one pass over the running requests (it runs every step): whether an INTERACTIVE request waits to
        start or is running with more than one token to compute, and how many have exactly one (decode rows)."""
        interactive_prefill = bool(self._waiting[Priority.INTERACTIVE])
        decode_rows = 0
        for request in self._running:
            remaining = request.num_known_and_pending_tokens - request.num_computed_tokens
            if remaining == 1:
                decode_rows += 1
            elif remaining > 1 and request.priority is Priority.INTERACTIVE:
                interactive_prefill = True
        return interactive_prefill, decode_rows

    def _batch_allowance(self, interactive_only: bool, decode_rows: int, now: float) -> tuple[int, int]:
        """(prefill tokens, decode rows) this step may carry; the rows bound BATCH seats too.
        - A step for INTERACTIVE prefill, or any step without a step-time model: the whole budget, every row.
        - A quiet spell (no INTERACTIVE request arrived or ran for a while): every row, and the prefill that fits
          the larger quiet target beside them (at least the minimum chunk).
        - Otherwise the rows that fit the target (INTERACTIVE ones are never held back; BATCH ones past the limit
          sit the step out, in rank order, and no BATCH request is admitted past it) and the prefill that fits
          beside them, possibly none: the rows are the step's progress. Without decode rows, the prefill that
          fits, but at least the minimum chunk.
        """
        if interactive_only or self.step_time is None:
            return self.config.max_num_batched_tokens, _EVERY_ROW
        if self._running and self._running[0].priority is Priority.INTERACTIVE:  # rank order: INTERACTIVE first
            self._last_interactive = now
        if now - self._last_interactive > INTERACTIVE_QUIET_S:
            return self.step_time.batch_prefill_cap(decode_rows, self.step_time.quiet_target_s), _EVERY_ROW
        row_cap = self.step_time.decode_row_cap()
        if row_cap is None or not decode_rows:
            return self.step_time.batch_prefill_cap(decode_rows), _EVERY_ROW if row_cap is None else row_cap
        return self.step_time.prefill_that_fits(min(decode_rows, row_cap)), row_cap

    def _may_admit(self, interactive_only: bool, preempted: list[str]) -> bool:
        """Whether to admit after the running requests' turn. Not when one of them lost its blocks (admitting
        would only swap blocks), except for BATCH victims in an INTERACTIVE-only step: admitting INTERACTIVE
        work would take theirs anyway, and they cannot come back in it (BATCH is not admitted then)."""
        if not interactive_only:
            return not preempted
        return all(self._requests[request_id].priority is Priority.BATCH for request_id in preempted)

    def _has_seat(self, priority: Priority, row_limit: int) -> bool:
        """Whether a request of `priority` can take a seat now: one is free (for a BATCH request, one of the first
        `row_limit`: the step-time target's decode rows), or, for an INTERACTIVE request, the lowest-ranked running
        request is BATCH and gives its seat up."""
        if priority is Priority.BATCH:
            return len(self._running) < min(self.config.max_num_seqs, row_limit)
        if len(self._running) < self.config.max_num_seqs:
            return True
        return self._running[-1].priority is Priority.BATCH

    def _preempt_latest_batch(self, preempted: list[str]) -> bool:
        """Preempt the lowest-ranked running request if it is BATCH; whether one was."""
        if not self._running or self._running[-1].priority is not Priority.BATCH:
            return False
        victim = self._running.pop()
        self._preempt(victim)
        preempted.append(victim.request_id)
        return True

    def _admit_waiting(
        self,
        budget: int,
        prefill_left: int,
        row_limit: int,
        scheduled: list[ScheduledRequest],
        finished: list[Request],
        now: float,
        classes: tuple[Priority, ...],
        preempted: list[str],
    ) -> int:
        """Move queued requests of `classes` into running while budget, prefill allowance, seats (BATCH ones
        within `row_limit`) and blocks last; returns the budget left. An INTERACTIVE request short of a seat or of
        blocks preempts running BATCH requests for them: INTERACTIVE requests wait only in a step BATCH work sits
        out, so no victim is scheduled yet."""
        for priority in classes:
            queue = self._waiting[priority]
            takes_from_batch = priority is Priority.INTERACTIVE
            while queue and min(budget, prefill_left) > 0 and self._has_seat(priority, row_limit):
                request = queue[0]
                if request.num_pending_tokens:
                    return budget  # preempted while its token was on the way: it re-prefills once that lands
                if request.deadline is not None and request.deadline <= now:
                    # Its heap entry was dropped while it ran; it has since been preempted.
                    queue.popleft()
                    request.status = RequestStatus.FINISHED_DEADLINE
                    self._release(request)
                    finished.append(request)
                    continue
                if len(self._running) >= self.config.max_num_seqs:
                    self._preempt_latest_batch(preempted)  # `_has_seat` saw a BATCH tail
                cached_blocks: list[int]
                if (request.pooling is not None and request.pooling.computes_every_token) or _reads_prompt(request):
                    # every position's hidden state is pooled, or depends on all; or each gives a prompt logprob
                    cached_blocks, num_cached = [], 0
                else:
                    cached_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
                restore = None
                if self.snapshots is not None:  # a hybrid's states must start where the cached prefix ends
                    request.snapshot_at = num_cached  # where it diverges from a prefix computed before
                    cached_blocks, restore = self._snapshot_hit(request, cached_blocks)
                    num_cached = len(cached_blocks) * self.kv_cache.block_size
                num_new = min(request.num_tokens - num_cached, budget, prefill_left)
                if request.multimodal is not None:
                    num_new = whole_images(request, num_cached, num_new, min(request.num_tokens - num_cached, budget))
                    if num_new <= 0:
                        return budget  # its next image runs whole: it waits for a step with room for all of it
                if self.snapshots is not None:
                    num_new = self._up_to_snapshot(request, num_cached, num_new)
                if request.pooling is not None and request.pooling.bidirectional:
                    if request.num_tokens > budget:
                        return budget  # an encoder's input runs whole: it waits for a step with room for all of it
                    num_new = request.num_tokens
                if not self._cross_images_fit(request):
                    return budget  # its images' cross-attention K/V would pass the cap: it waits, in its place
                if request.lora is not None and not self._take_adapter_slot(request):
                    return budget  # every slot serves another adapter's running requests: it waits, in its place
                blocks = self.kv_cache.allocate_slots(request, num_new, cached_blocks)
                while blocks is None and takes_from_batch and self._preempt_latest_batch(preempted):
                    blocks = self.kv_cache.allocate_slots(request, num_new, cached_blocks)
                if blocks is None:
                    self._give_back_adapter_slot(request)
                    return budget  # no overtaking: a later or lower-priority request must not jump ahead
                queue.popleft()
                if self.state_slots is not None:
                    request.state_slot = self.state_slots.acquire()
                    if restore is not None:
                        self._restores[0].append(restore)
                        self._restores[1].append(request.state_slot)
                if request.status is RequestStatus.WAITING:
                    request.num_cached_tokens = num_cached
                request.num_computed_tokens = num_cached
                request.status = RequestStatus.RUNNING
                if request.scheduled_time is None:
                    request.scheduled_time = time.monotonic()
                bisect.insort(self._running, request, key=self._rank)
                scheduled.append(self._advance(request, num_new, blocks, num_cached))
                if self.snapshots is not None:
                    self._snapshot_if_due(request)
                budget -= num_new
                prefill_left -= num_new
        return budget

    # -- linear-attention state snapshots (`StateSnapshots`) ------------------------------------------

    def _snapshot_points(self, request: Request) -> tuple[int, int]:
        """Where a hybrid's request has its states saved (block boundaries; 0: none): where the cached prefix it was
        admitted with ended without a snapshot (`Request.snapshot_at`: there another request's prompt went on
        otherwise, so a third that shares the prefix finds one), and its prompt's last block boundary before its
        last token (a chat's next turn, or the same prompt again, starts there)."""
        size = self.kv_cache.block_size
        return request.snapshot_at, (request.num_prompt_tokens - 1) // size * size

    def _up_to_snapshot(self, request: Request, start: int, num_new: int) -> int:
        """`num_new` tokens from `start`, or fewer so the chunk ends at the first snapshot point it would cross."""
        for point in sorted(self._snapshot_points(request)):
            if start < point < start + num_new:
                return point - start
        return num_new

    def _snapshot_if_due(self, request: Request) -> None:
        """Have this step save the request's states when its chunk ends at one of its snapshot points and no
        snapshot holds that prefix yet."""
        point = request.num_computed_tokens
        if point == 0 or point not in self._snapshot_points(request):
            return
        assert self.snapshots is not None
        row = self.snapshots.reserve(self.kv_cache.prefix_hash(request, point // self.kv_cache.block_size))
        if row is not None:
            self._saves[0].append(request.state_slot)
            self._saves[1].append(row)

    def _snapshot_hit(self, request: Request, cached_blocks: list[int]) -> tuple[list[int], int | None]:
        """The longest leading run of `cached_blocks` (a cache hit) whose end has a snapshot, and that snapshot's
        row (None, with no blocks, when no such end has one)."""
        assert self.snapshots is not None
        for count in range(len(cached_blocks), 0, -1):
            row = self.snapshots.find(request.block_hashes[count - 1])
            if row is not None:
                return cached_blocks[:count], row
        return [], None

    def _advance(self, request: Request, num_new: int, blocks: list[int], num_cached: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        request.num_computed_tokens = computed = start + num_new
        needs_sample = computed == request.num_known_and_pending_tokens and request.pooling is None
        if needs_sample:
            request.num_pending_tokens += 1  # until update_from_output brings its token
        return ScheduledRequest(request, start, num_new, blocks, needs_sample, num_cached)

    def _cross_images_fit(self, request: Request) -> bool:
        """Whether a request whose images feed cross-attention layers (Llama 3.2 Vision's; Whisper's clip, one image
        here: they keep their K/V per running request) may start: its images and the running such requests' within
        `max_cross_attention_images`, or none running (one request alone always may). True for every other request."""
        cap = self.config.max_cross_attention_images
        images = request.multimodal
        if cap <= 0 or images is None or (images.cross_attention_mask is None and not images.transcription):
            return True
        held = sum(len(r.multimodal.images) for r in self._running  # (a Whisper clip counts as one image)
                   if r.multimodal is not None
                   and (r.multimodal.cross_attention_mask is not None or r.multimodal.transcription))  # fmt: skip
        return held == 0 or held + len(images.images) <= cap

    def _take_adapter_slot(self, request: Request) -> bool:
        """Give an adapter's request its adapter's slot; False when none is free (`AdapterSlots.acquire`)."""
        assert request.lora is not None
        if self.adapter_slots is None:
            raise RuntimeError("a request names a LoRA adapter but the scheduler has no LoRA slots")
        slot = self.adapter_slots.acquire(request.lora)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _give_back_adapter_slot(self, request: Request) -> None:
        """The request no longer runs: its slot (if it holds one) may go to another adapter."""
        if request.lora_slot >= 0 and self.adapter_slots is not None:
            self.adapter_slots.release(request.lora_slot)
            request.lora_slot = -1

    def _give_back_state_slot(self, request: Request) -> None:
        """The request no longer runs: its linear-attention state's slot (if it holds one) is free."""
        if request.state_slot >= 0 and self.state_slots is not None:
            self.state_slots.release(request.state_slot)
            request.state_slot = -1

    def _preempt(self, request: Request) -> None:
        self._give_back_adapter_slot(request)
        self._give_back_state_slot(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.preempted_times += (time.monotonic(),)
        self.total_preemptions += 1
        self._waiting[request.priority].appendleft(request)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """Why the request ends after sampling `token_id`, or None to go on."""
        params = request.sampling_params
        is_eos = not params.ignore_eos and token_id in request.eos_token_ids
        if request.num_output_tokens >= params.min_tokens and (is_eos or token_id in request.stop_token_ids):
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _release(self, request: Request) -> None:
        """Drop a finished request: free its blocks and forget it (it is already out of the queues)."""
        self._num_finished += 1
        self._num_pooling -= request.pooling is not None
        self._num_reading_prompts -= request.sampling_params.prompt_logprobs is not None
        self._give_back_adapter_slot(request)
        self._give_back_state_slot(request)
        self.kv_cache.free(request)
        del self._requests[request.request_id]
        del self._seq[request.request_id]


class _SteadyRecord:
    """A steady decode step in columns, kept to schedule the next one (the module docstring's steady decode).

    Row i is `requests[i]`; after the recorded step: `starts[i]` its token's position, `room[i]` the tokens that
    still fit its slots in place (`num_slots_in_place - num_computed_tokens`), `steps_left[i]` how many more tokens
    it may have scheduled before its length ends it (max_tokens, max_model_len), counting pending ones.
    """

    __slots__ = (
        "blocks_run_ahead",
        "flags",
        "min_room",
        "min_steps_left",
        "num_batch",
        "output",
        "requests",
        "room",
        "starts",
        "steps_left",
        "stop_ids",
        "tables",
        "updated",
    )

    def __init__(
        self,
        requests: list[Request],
        tables: list[list[int]],
        starts: np.ndarray[Any, np.dtype[np.int64]],
        room: np.ndarray[Any, np.dtype[np.int64]],
        steps_left: np.ndarray[Any, np.dtype[np.int64]],
    ) -> None:
        self.requests = requests  # a copy of `_running` at the step, never modified
        self.tables = tables
        self.starts = starts
        self.room = room
        self.steps_left = steps_left
        self.min_room = int(room.min())  # the columns' minima, kept as they move: most steps need no array scan
        self.min_steps_left = int(steps_left.min())
        self.num_batch = sum(1 for r in requests if r.priority is Priority.BATCH)
        # A row that may never run ahead of a pending token (its sampling needs the outputs).
        self.blocks_run_ahead = any(r.needs_output_history for r in requests)
        self.stop_ids = frozenset().union(*{r.eos_token_ids | r.stop_token_ids for r in requests})
        self.flags = (
            all(r.argmax_only for r in requests),
            any(r.needs_output_history for r in requests),
            self.num_batch < len(requests),
            all(r.final_only and not r.wants_logprobs for r in requests),
        )
        self.updated = False  # the tokens of `output` reached the scheduler
        self.output: SchedulerOutput | None = None  # the recorded step's output

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest], max_model_len: int) -> _SteadyRecord | None:
        """The record of a step whose rows are every running request, each a plain decode; None when one of them
        speculates (its next steps verify drafts)."""
        requests = [item.request for item in scheduled]
        if any(r.speculative for r in requests):
            return None
        starts = np.fromiter((item.start_position for item in scheduled), dtype=np.int64, count=len(scheduled))
        computed = starts + 1
        room = np.fromiter((r.num_slots_in_place for r in requests), dtype=np.int64, count=len(requests)) - computed
        max_tokens = np.fromiter((r.max_tokens for r in requests), dtype=np.int64, count=len(requests))
        prompts = np.fromiter((r.num_prompt_tokens for r in requests), dtype=np.int64, count=len(requests))
        # After the step, with its sampled token counted (pending), a row has computed + 1 tokens.
        num_tokens = computed + 1
        steps_left = np.minimum(max_tokens - (num_tokens - prompts), max_model_len - num_tokens)
        return cls(requests, [item.block_ids for item in scheduled], starts, room, steps_left)

    def advance(self) -> None:
        """Every row took one more token (its counters already moved)."""
        self.starts = self.starts + 1  # a new array: the last step's output keeps its own
        self.room -= 1
        self.steps_left -= 1
        self.min_room -= 1
        self.min_steps_left -= 1
        self.updated = False

    def decode(self, finish_epoch: int) -> SteadyDecode:
        """The `SteadyDecode` of the step just scheduled from this record."""
        all_argmax_only, any_output_history, any_interactive, all_final_quiet = self.flags
        return SteadyDecode(
            self.requests,
            self.tables,
            self.starts,
            all_argmax_only,
            any_output_history,
            any_interactive,
            all_final_quiet,
            self.stop_ids,
            np.flatnonzero(self.steps_left <= 0).tolist() if self.min_steps_left <= 0 else [],
            finish_epoch,
        )


def _reads_prompt(request: Request) -> bool:
    """Whether `request` still wants prompt log-probabilities, which only computing its prompt gives (so the prefix
    cache serves it none of its prompt)."""
    logprobs = request.prompt_logprobs
    return logprobs is not None and len(logprobs) < request.num_prompt_tokens - 1
