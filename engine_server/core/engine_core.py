"""The engine core: scheduler + model runner behind one narrow seam (add_request / abort / step).

Everything here works in token ids. Tokenization, templating, detokenization and stop strings live in front of
the core (engine_server.frontend), so the core can run on its own thread or process without changing them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat

import structlog
import torch

from engine_server.config import EngineConfig
from engine_server.core.request import Priority, Request, RequestStatus, RequestTimeline
from engine_server.core.scheduler import Scheduler
from engine_server.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine_server.core.step_timing import StepTimeModel, default_step_targets
from engine_server.loader import ModelSource
from engine_server.model_loading import load_model
from engine_server.model_runner import CollectedTokens, LaunchedStep, ModelRunner, SampledToken
from engine_server.sampling import TokenLogprobs
from engine_server.speculative.speculator import Speculator
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from engine_server.workers import WorkerGroup, start_tensor_parallel

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class CoreOutput:
    """What one request produced in one step.

    `new_tokens` holds the token sampled this step (empty for a request that finished without sampling, e.g.
    aborted or expired). `status` is set once the request has finished; `stop_token_id` names the eos or stop
    token that ended it. `num_cached_tokens` is the number of prompt tokens served from the prefix cache.
    `pooled` is a pooling request's vector (a 1-D float32 host tensor), on its one output, which finishes it
    (FINISHED_STOPPED); a pooling request that ends otherwise (aborted, expired) has none.
    """

    request_id: str
    new_tokens: list[SampledToken] = field(default_factory=list)
    status: RequestStatus | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    pooled: torch.Tensor | None = None
    timeline: RequestTimeline | None = field(default=None, compare=False)  # on the last output only (traces)
    # Its prompt's log-probabilities (`Request.prompt_logprobs`), once, on the first output after they are all known.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # A transcription asking word timings: its alignment heads' attention over its clip, `[heads, output rows, frames]`
    # (`multimodal.whisper.WhisperCrossStates.alignment`), on its last output.
    alignment: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.status is not None


class HeldOutputs:
    """Outputs of choices that nobody needs to see before they finish, merged per core request until then.

    Delivering a choice once, at its finish (all tokens in order, the last status), saves the per-step host
    work of routing and applying it: the offline API and the engine's non-streaming calls use this.
    """

    def __init__(self) -> None:
        self._held: dict[str, CoreOutput] = {}

    def add(self, output: CoreOutput) -> CoreOutput | None:
        """Hold `output`; once its request has finished, the merged output of every step (and it is let go)."""
        earlier = self._held.pop(output.request_id, None)
        if earlier is not None:
            output = _merge(earlier, output)
        if output.status is None:
            self._held[output.request_id] = output
            return None
        return output

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._held.pop(request_id, None)


def coalesce(outputs: Iterable[CoreOutput]) -> list[CoreOutput]:
    """Outputs of consecutive steps merged into one per request (in order of first appearance): each with its
    tokens in step order and its last status, as if one step had produced them all. `outputs` are consumed."""
    merged: dict[str, CoreOutput] = {}
    for output in outputs:
        earlier = merged.get(output.request_id)
        merged[output.request_id] = output if earlier is None else _merge(earlier, output)
    return list(merged.values())


def _handing_prompt_logprobs(request: Request, output: CoreOutput) -> CoreOutput:
    """`output` with `request`'s prompt log-probabilities once they are all known (they move to it: the request
    keeps None, so they go out once and its prompt may come from the prefix cache again)."""
    found = request.prompt_logprobs
    if found is not None and len(found) >= request.num_prompt_tokens - 1:
        output.prompt_logprobs, request.prompt_logprobs = found, None
    return output


def _merge(earlier: CoreOutput, later: CoreOutput) -> CoreOutput:
    """`later` applied onto `earlier` (modified and returned): tokens appended, the later status."""
    earlier.new_tokens.extend(later.new_tokens)
    earlier.num_cached_tokens = max(earlier.num_cached_tokens, later.num_cached_tokens)
    earlier.status, earlier.stop_token_id = later.status, later.stop_token_id
    if later.pooled is not None:
        earlier.pooled = later.pooled
    if later.prompt_logprobs is not None:
        earlier.prompt_logprobs = later.prompt_logprobs
    if later.timeline is not None:
        earlier.timeline = later.timeline
    if later.alignment is not None:
        earlier.alignment = later.alignment
    return earlier


@dataclass(frozen=True)
class _Launched:
    """A scheduled step and its launch on the device."""

    scheduled: SchedulerOutput
    step: LaunchedStep


class EngineCore:
    """Owns the scheduler and the runner; one `step()` is one scheduled forward pass. Single-threaded."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.model_config = source.config
        limit = config.scheduler.max_model_len or source.config.max_position_embeddings
        self.max_model_len = min(limit, source.config.max_position_embeddings)
        chunk, block_size = source.config.attention_chunk, config.cache.block_size
        if chunk and self.max_model_len > chunk and chunk % block_size:  # Llama 4: AttentionMetadata.chunked
            raise ValueError(
                f"this model attends within chunks of {chunk} positions, which the KV block size {block_size} does "
                f"not divide: serve it with --max-model-len {chunk} or less"
            )
        if source.config.encoder:  # an encoder's input runs whole in one step: it must fit the step's budget
            self.max_model_len = min(self.max_model_len, config.scheduler.max_num_batched_tokens)
        # Under tensor parallelism this process is rank 0 and the other ranks are worker processes (`workers`).
        self.workers: WorkerGroup | None = None
        if config.tensor_parallel_size > 1:
            loaded, self.workers = start_tensor_parallel(source, config, self.max_model_len)
            self.runner = ModelRunner(loaded, fan_out=self.workers.sender)
        else:
            self.runner = ModelRunner(load_model(source, config, self.max_model_len))
        # Learned from this engine's own steps (see step()); it caps the prefill of steps of BATCH work.
        target, quiet = default_step_targets(config.scheduler.batch_step_target_s, self.runner.device.type)
        self.step_time = (
            StepTimeModel(target, config.scheduler.batch_min_prefill_chunk, quiet_factor=quiet / target)
            if target > 0
            else None
        )
        # Speculative decoding: drafts proposed before each step, verified by it (engine_server.speculative).
        spec = config.speculative
        # A model whose every layer is windowed frees the blocks outside the window, unless a draft model, which
        # attends over the same blocks, may read them.
        window = 0 if spec is not None and spec.method == "draft_model" else self.model_config.uniform_window
        # Recurrent layers (Qwen3-Next's and Qwen3.5's linear attention, LFM2's convolutions) keep a state per running
        # request, in a slot of its own; a state holds a whole prefix at once, not block by block, so a prefix is
        # served from the cache only where its states were saved at its end (`core.state_snapshots`): none without
        # snapshot rows.
        recurrent = self.model_config.recurrent is not None
        cache = (
            replace(config.cache, enable_prefix_caching=False)
            if recurrent and not self.runner.state_snapshots
            else config.cache
        )
        self.scheduler = Scheduler(
            config.scheduler, cache, self.runner.num_blocks, self.max_model_len, self.step_time, window,
            lora_slots=config.lora.max_loras if config.lora is not None else 0,
            state_slots=self.runner.state_slots, state_snapshots=self.runner.state_snapshots,
        )  # fmt: skip
        self.speculator = Speculator(spec, self.max_model_len) if spec is not None else None
        async_scheduling = config.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if async_scheduling is None else async_scheduling
        self._in_flight: _Launched | None = None  # the step launched by the last call, when it ran ahead
        # Set from another thread when an INTERACTIVE request arrives: stops a running BATCH step (`step()`). Only
        # where a step runs within its launch (the CPU) and steps do not run ahead.
        self.step_interrupt = StepInterrupt() if self.runner.can_interrupt and not self.async_scheduling else None
        self.num_interrupted_steps = 0  # since start, for metrics and tests
        self._last_batch_step_interrupted = False
        self._held = HeldOutputs()  # per-step outputs of final-only requests that want log-probabilities
        log.info(
            "engine core ready",
            device=self.runner.device.type,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            kv_blocks=self.runner.num_blocks,
            kv_cache_dtype=config.cache.dtype,
            block_size=self.runner.block_size,
            cuda_graphs=self.runner.decode_graphs is not None,
            async_scheduling=self.async_scheduling,
            batch_step_target_s=target,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the core runs no step afterwards). Idempotent."""
        if self.workers is not None:
            self.workers.stop()

    def check_workers(self) -> None:
        """After a failed step: if a tensor-parallel worker is gone, that is why, and the engine stops now
        (engine_server.workers) instead of reporting a failed step."""
        if self.workers is not None:
            self.workers.check()

    def add_request(self, request: Request) -> None:
        """Queue a validated request. Raises QueueFullError when the waiting queue is full."""
        self.add_requests([request])

    def add_requests(self, group: Sequence[Request]) -> None:
        """Queue the validated requests of one call together (`Scheduler.add_requests`): all or, raising
        QueueFullError when their class's queue is full (ValueError on a duplicate id), none."""
        self.scheduler.add_requests(group)
        if self.speculator is not None:
            for request in group:
                if request.pooling is None:
                    self.speculator.admit(request)

    def has_room(self, priority: Priority) -> bool:
        """Whether a call of `priority` would be admitted now (`Scheduler.has_room`)."""
        return self.scheduler.has_room(priority)

    def abort_requests(self, request_ids: list[str]) -> list[CoreOutput]:
        """Abort requests in any state; their blocks are free when this returns. Unknown ids are ignored."""
        outputs: list[CoreOutput] = []
        for request_id in request_ids:
            request = self.scheduler.abort_request(request_id)
            self.runner.release(request_id)
            if request is not None:
                outputs.append(self._finished_output(request))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[CoreOutput]:
        """Schedule, launch and sample once; return what the requests of the last completed step produced.

        Without async scheduling a step completes within its call. With it, a step whose requests may run
        ahead stays in flight: the next call schedules and launches the following step first and only then
        waits for this one's tokens, so the host's work overlaps the device's and outputs arrive one call
        later (a step with a request that needs its output history on the host still completes at once).

        A constrained request whose grammar ended with this step's token (SampledToken.grammar_finish) is
        finished here, after the scheduler's own stop rules, which take precedence when both apply.

        The call's duration feeds the step-time model, as the time of the last step it completed: in a
        synchronous step all of it is that step's, and with a step in flight, the call mostly waits for it.

        A step of BATCH work only stops between two layers once `step_interrupt` is set (an INTERACTIVE request
        arrived; the caller clears it before taking new requests in): its scheduling is undone and the call returns
        without its outputs, so the caller takes the new request in and steps again, and the arrival waits about
        one layer rather than the rest of the step. So that BATCH work always progresses, the BATCH step after a
        stopped one is not stopped.
        """
        started = time.perf_counter()
        try:
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running_requests)
            scheduled = self.scheduler.schedule()
            batch_only = self._stoppable(scheduled)
            interrupt = self.step_interrupt if batch_only and not self._last_batch_step_interrupted else None
            try:
                launch = self.runner.launch(scheduled, interrupt)
            except StepInterrupted:
                self.scheduler.undo(scheduled)
                self.num_interrupted_steps += 1
                self._last_batch_step_interrupted = True
                return [self._finished_output(request) for request in scheduled.finished]
            if batch_only:
                self._last_batch_step_interrupted = False
            current = _Launched(scheduled, launch)
            previous, self._in_flight = self._in_flight, None
            outputs = self._complete(previous) if previous is not None else []
            completed = previous
            # A speculating request's next drafts start from this step's tokens: no step runs ahead of them.
            runs_ahead = self.async_scheduling and not scheduled.is_empty and self.speculator is None
            if runs_ahead and not _needs_output_history(scheduled):
                self._in_flight = current
            else:
                outputs += self._complete(current)
                completed = current
        except BaseException:
            self._in_flight = None  # its requests are the caller's to abort; nothing waits on it any more
            raise
        if completed is not None:
            done, seconds = completed.scheduled, time.perf_counter() - started
            if self.step_time is not None:
                self.step_time.observe(done.num_prefill_tokens, done.num_decode_rows, seconds)
            if self.speculator is not None:
                self.speculator.observe_step(done, seconds)
        return outputs

    def _stoppable(self, scheduled: SchedulerOutput) -> bool:
        """Whether `step_interrupt` may stop the step: there is one, and the step carries BATCH work only."""
        if self.step_interrupt is None or scheduled.is_empty:
            return False
        if scheduled.steady is not None:
            return not scheduled.steady.any_interactive
        return not any(item.request.priority is Priority.INTERACTIVE for item in scheduled.scheduled)

    def _complete(self, launched: _Launched) -> list[CoreOutput]:
        """Bring a launched step's tokens to the host, apply them and report what each request produced.

        A `final_only` request is reported once, at its finish, with every token it produced (its per-step
        outputs are held only when they carry log-probabilities): no output object per step for it.
        """
        scheduled = launched.scheduled
        collected = self.runner.collect(launched.step)
        pooled = self._finish_pooled(collected.pooled) if collected.pooled else []
        if collected.runs is not None:
            return pooled + self._complete_verified(scheduled, launched.step.items, collected)
        tokens, details = collected.token_ids, collected.details
        finished = self.scheduler.update_from_output(scheduled, tokens)
        if details is not None:
            finished += self._finish_grammars(launched.step.items, details)
        outputs: list[CoreOutput] = []
        steady = scheduled.steady
        if steady is not None:
            # Every row samples: the rows' requests in order, and none to report per step when all are final-only.
            requests: Iterable[Request] = () if steady.all_final_quiet and details is None else steady.requests
        else:
            requests = (item.request for item in launched.step.items)
        for request, token_id, detail in zip(requests, tokens, details or repeat(None), strict=False):
            # Finished: since it was scheduled (its token is dropped), or by this token (reported below).
            if (request.final_only and not request.wants_logprobs) or request.status.is_finished:
                continue
            token = detail if detail is not None else SampledToken(token_id)
            output = _handing_prompt_logprobs(
                request, CoreOutput(request.request_id, [token], None, None, request.num_cached_tokens))
            if request.final_only:
                self._held.add(output)
            else:
                outputs.append(output)
        by_request = collected.by_request(launched.step.items) if finished and details is not None else None
        for request in finished:
            # This step's token is the last of its outputs (it finished by it, or by its grammar after it).
            token = by_request[request.request_id] if by_request else SampledToken(request.output_token_ids[-1])
            output = CoreOutput(request.request_id, [token], request.status, request.stop_token_id)
            outputs.append(self._final(request, output))
            self.runner.release(request.request_id)
        for request in scheduled.finished:
            outputs.append(self._finished_output(request))
            self.runner.release(request.request_id)  # it may have run (and sampled) before a preemption
        return pooled + outputs

    def _finish_pooled(self, pooled: dict[str, torch.Tensor]) -> list[CoreOutput]:
        """Finish the pooling requests the step pooled (those still unfinished: one aborted since is dropped) and
        report each with its vector."""
        outputs: list[CoreOutput] = []
        for request in self.scheduler.finish_requests(pooled, RequestStatus.FINISHED_STOPPED):
            output = CoreOutput(request.request_id, [], request.status, pooled=pooled[request.request_id])
            outputs.append(self._final(request, output))
            self.runner.release(request.request_id)
        return outputs

    def _complete_verified(
        self, scheduled: SchedulerOutput, sampling: list[ScheduledRequest], collected: CollectedTokens
    ) -> list[CoreOutput]:
        """`_complete` for a step that verified drafts: each request reports the tokens of its run it took (the
        stop rules may end it inside the run)."""
        assert collected.runs is not None and self.speculator is not None
        before = [item.request.num_output_tokens for item in sampling]
        finished = self.scheduler.update_from_output(scheduled, collected.token_ids, collected.runs)
        if collected.details is not None:
            finished += self._finish_grammars(sampling, collected.details)
        self.speculator.observe(sampling, collected.runs)
        ended = {request.request_id for request in finished}
        outputs: list[CoreOutput] = []
        for i, item in enumerate(sampling):
            request = item.request
            taken = request.output_token_ids[before[i] :]
            if not taken or (request.final_only and not request.wants_logprobs and request.request_id not in ended):
                continue
            if collected.run_details is not None:
                tokens = collected.run_details[i][: len(taken)]
            else:
                tokens = [SampledToken(token_id) for token_id in taken]
            if request.request_id in ended:
                output = CoreOutput(request.request_id, tokens, request.status, request.stop_token_id)
                outputs.append(self._final(request, output))
                self.runner.release(request.request_id)
            elif request.final_only:
                self._held.add(_handing_prompt_logprobs(
                    request, CoreOutput(request.request_id, tokens, None, None, request.num_cached_tokens)))
            else:
                outputs.append(_handing_prompt_logprobs(
                    request, CoreOutput(request.request_id, tokens, None, None, request.num_cached_tokens)))
        for request in scheduled.finished:
            outputs.append(self._finished_output(request))
            self.runner.release(request.request_id)
        return outputs

    def _finish_grammars(self, sampling: list[ScheduledRequest], details: list[SampledToken]) -> list[Request]:
        """Finish the still-running requests whose grammar ended with their token this step."""
        ended: dict[RequestStatus, list[str]] = {}
        for item, token in zip(sampling, details, strict=True):
            request_id = item.request.request_id
            if token.grammar_finish is not None and self.scheduler.get_request(request_id) is not None:
                ended.setdefault(token.grammar_finish, []).append(request_id)
        done: list[Request] = []
        for status, request_ids in ended.items():
            done += self.scheduler.finish_requests(request_ids, status)
        return done

    def _finished_output(self, request: Request) -> CoreOutput:
        """The output of a request that finished without sampling this step (aborted, expired)."""
        return self._final(request, CoreOutput(request.request_id, [], request.status, request.stop_token_id))

    def _final(self, request: Request, output: CoreOutput) -> CoreOutput:
        """A finished request's last output; for a `final_only` one, with every token it produced."""
        if self.speculator is not None:
            self.speculator.finish(request)
        output.num_cached_tokens = request.num_cached_tokens
        output.timeline = request.timeline()
        if request.multimodal is not None and request.multimodal.align_frames:
            output.alignment = self.runner.alignment(request.request_id)
        _handing_prompt_logprobs(request, output)
        if not request.final_only:
            return output
        merged = self._held.add(output)  # the steps held for their log-probabilities, in order
        assert merged is not None  # a finished output is always let go
        if not request.wants_logprobs:
            merged.new_tokens = [SampledToken(token_id) for token_id in request.output_token_ids]
        return merged


def _needs_output_history(output: SchedulerOutput) -> bool:
    """Whether a request of the step needs its output history on the host before its next step."""
    if output.steady is not None:
        return output.steady.any_output_history
    return any(item.request.needs_output_history for item in output.scheduled)
