"""The model runner: turns one SchedulerOutput into one forward pass and one batched sampling call.

It runs steps over a `LoadedModel` (`engine_server.model_loading`: the weights, the paged KV cache, the draft
model, the decode graphs), which it reads and never reloads, and owns the sampler, the grammar matchers of
constrained requests and what one step leaves for the next (the decode layout, the last launch's tokens, the
sampling metadata). The scheduler decides *what* runs; the runner only executes it.

On CUDA (unless `enforce_eager`) decode-only steps replay the CUDA graphs captured at load (`cuda_graphs`);
prefill and mixed steps, and batches above the largest graph, run eagerly. The graphs' padding rows write only
to the KV cache's scratch block, which the scheduler is never given.

Under tensor parallelism the runner is rank 0's: it hands each forward pass's inputs and each logits call's rows
to the workers (`fan_out`, engine_server.workers) right before running its own share of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.core.request import Request, RequestStatus
from engine_server.core.scheduler_output import ScheduledRequest, SchedulerOutput, StateCopies, SteadyDecode
from engine_server.cuda_graphs import DecodeGraphs, EagerCapture, GraphCapture
from engine_server.decode_rows import DecodeRows
from engine_server.lora.slots import LoraBatch
from engine_server.model_loading import LoadedModel, capture_decode_graphs
from engine_server.models import BertEncoder
from engine_server.multimodal.features import ImageFeatures, step_image_blocks, step_mrope_positions
from engine_server.multimodal.mllama import CrossStates, MllamaImageEncoder
from engine_server.multimodal.whisper import WhisperAudioEncoder, WhisperCrossStates
from engine_server.parallel.step_channel import PendingTokens, StepSender
from engine_server.pooling.pooler import Pooler
from engine_server.sampling import Sampler, SamplerOutput, SamplingMetadata, SamplingRow, TokenLogprobs
from engine_server.speculative.verify import sampled_positions, split_runs
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from engine_server.structured.matchers import GrammarMatchers, GrammarState
from engine_server.transfer import host_tensor, to_device

_SEED_MODULUS = 2**63
# How a grammar's state after the sampled token ends the choice (absent: it goes on).
_GRAMMAR_FINISH = {
    GrammarState.COMPLETE: RequestStatus.FINISHED_STOPPED,
    GrammarState.TERMINATED: RequestStatus.FINISHED_STOPPED,
    GrammarState.REJECTED: RequestStatus.FINISHED_ABORTED,
}
_PROMPT_LOGPROB_ROWS = 256  # prompt rows whose log-probabilities are computed at once (`_read_prompt_logprobs`)


@dataclass(slots=True)
class SampledToken:
    """The token sampled for one request in one step, with its log-probabilities when the request asked.

    `grammar_finish` is set when the request's grammar ends the choice with this token: FINISHED_STOPPED once
    the output is a complete sentence that cannot grow (or the grammar accepted a stop token after one),
    FINISHED_ABORTED if the token broke the grammar (an engine fault, logged). EngineCore applies it.
    Read-only once built (not frozen: one is built per sampling request per step, and frozen fields cost).
    """

    token_id: int
    logprobs: TokenLogprobs | None = None
    grammar_finish: RequestStatus | None = None


@dataclass(frozen=True)
class CollectedTokens:
    """A collected step's tokens: `token_ids[i]` is the token of sampling row i (`LaunchedStep.items[i]`).

    `details[i]` is row i's SampledToken when some row of the step asked for log-probabilities or is constrained
    (a grammar may end it), else `details` is None: a plain step builds no object per row.
    """

    token_ids: list[int]
    details: list[SampledToken] | None = None
    # A step that verified drafts (engine_server.speculative): per sampling row, every token it produced, in order
    # (its accepted drafts, then the target's token, which is `token_ids[i]`); with `details`, their SampledTokens.
    runs: list[list[int]] | None = None
    run_details: list[list[SampledToken]] | None = None
    # The vectors of the pooling requests whose prompt the step ended (engine_server.pooling), by request id: 1-D
    # float32 host tensors. Those requests sampled nothing; the engine core finishes them.
    pooled: dict[str, torch.Tensor] | None = None

    def by_request(self, items: list[ScheduledRequest]) -> dict[str, SampledToken]:
        """Each row's SampledToken by request id (`items`: the step's sampling rows)."""
        if self.details is not None:
            return {item.request_id: token for item, token in zip(items, self.details, strict=True)}
        return {item.request_id: SampledToken(token) for item, token in zip(items, self.token_ids, strict=True)}


class LaunchedStep:
    """A step queued on the device: the requests that sample and their tokens on the way to the host.

    `items` are the sampling rows (for a steady decode step, every row of `output`, built on first use);
    `sampled` holds host tensors (pinned, filled by non-blocking copies on CUDA) that are valid once `ready`
    (a CUDA event; None on the CPU, where they are valid at once) has completed; None when nothing samples.
    """

    __slots__ = ("_items", "num_rows", "output", "pooled", "ready", "sampled")

    def __init__(
        self,
        items: list[ScheduledRequest] | None,
        sampled: SamplerOutput | None,
        ready: torch.cuda.Event | None = None,
        *,
        output: SchedulerOutput | None = None,
        pooled: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`items` None: every row of `output` (a steady decode step) samples. `pooled`: the step's pooled vectors
        (CollectedTokens.pooled), host tensors valid once `ready` has completed."""
        if items is None and (output is None or output.steady is None):
            raise ValueError("a step's sampling rows come from a list or from a steady decode step's output")
        self._items = items
        self.output = output
        self.sampled = sampled
        self.ready = ready
        self.pooled = pooled
        self.num_rows = len(items) if items is not None else output.num_rows  # type: ignore[union-attr]

    @property
    def items(self) -> list[ScheduledRequest]:
        if self._items is None:
            assert self.output is not None
            self._items = self.output.scheduled
        return self._items


class _StepTokens:
    """A step's input token ids as the host knows them (0 where a token is still pending), and, for the
    pending ones, their row in the step and their request."""

    __slots__ = ("known", "pending_ids", "pending_rows")

    def __init__(self) -> None:
        self.known: list[int] = []
        self.pending_rows: list[int] = []
        self.pending_ids: list[str] = []

    def add(self, request: Request, start: int, count: int, drafts: tuple[int, ...] = ()) -> None:
        """The chunk's tokens: known ones from the request, then its `drafts` (which end it), or pending ones."""
        ids = request.all_token_ids
        end = start + count
        self.known.extend(ids[start:end])
        if drafts:
            self.known.extend(drafts)
            return
        for _ in range(max(start, len(ids)), end):  # beyond what the host has: sampled, on the way
            self.pending_rows.append(len(self.known))
            self.pending_ids.append(request.request_id)
            self.known.append(0)


def _step_tokens(scheduled: list[ScheduledRequest]) -> _StepTokens:
    """A decode step's input tokens as the host knows them (one per row)."""
    tokens = _StepTokens()
    known = tokens.known
    for item in scheduled:
        ids, start = item.request.all_token_ids, item.start_position
        if start < len(ids):
            known.append(ids[start])
        else:  # sampled by the step before, still on the way
            tokens.pending_rows.append(len(known))
            tokens.pending_ids.append(item.request.request_id)
            known.append(0)
    return tokens


def _pending_tokens(rows: list[int], values: torch.Tensor | None) -> PendingTokens | None:
    """The workers' pending inputs of a step: its `rows` whose ids the last launch sampled, and their `values`."""
    return None if values is None else PendingTokens(torch.tensor(rows, dtype=torch.int64), values)


def _host_decode_inputs(
    step_ids: list[int] | torch.Tensor, pending_rows: list[int], pending: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, PendingTokens | None]:
    """A decode step's input ids as the workers get them: those the host has, and the rows only the last launch
    has with their values on its device. `step_ids`: the host's ids (`pending_rows` of them placeholders, whose
    values are `pending[1]`), or that launch's tokens, which every row continues from, row for row."""
    if isinstance(step_ids, torch.Tensor):
        rows = step_ids.shape[0]
        return torch.zeros(rows, dtype=torch.int64), PendingTokens(torch.arange(rows), step_ids)
    values = None if pending is None else pending[1]
    return torch.tensor(step_ids, dtype=torch.int64), _pending_tokens(pending_rows, values)


def _copy_to_host(sampled: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """The sampled tensors as host tensors, and the event after which they hold their values.

    On CUDA the copies are queued now, right behind this step's sampling (so waiting for them never waits for
    a step launched later), into pinned memory (`non_blocking` device-to-host copies allocate it). On the
    CPU the tensors are already on the host: returned as they are, with no event.
    """
    if sampled.token_ids.device.type != "cuda":
        return sampled, None

    def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to("cpu", non_blocking=True)

    on_host = replace(
        sampled,
        token_ids=sampled.token_ids.to("cpu", non_blocking=True),
        logprobs=host(sampled.logprobs),
        top_token_ids=host(sampled.top_token_ids),
        top_logprobs=host(sampled.top_logprobs),
    )
    ready = torch.cuda.Event()
    ready.record()
    return on_host, ready


class ModelRunner:
    """Executes scheduled steps on one device over a loaded model: `ModelRunner(load_model(source, config,
    max_model_len))`. Not thread-safe: the engine core's step loop owns it.

    `num_blocks` is what the KV cache manager may hand out (ids `0..num_blocks-1`); `kv_caches` holds one more,
    `scratch_block == num_blocks`, which only padding rows of the decode graphs touch.
    """

    def __init__(self, loaded: LoadedModel, fan_out: StepSender | None = None) -> None:
        """`fan_out`: the tensor-parallel workers' step channel, exactly when `loaded` is rank 0 of a group."""
        if (fan_out is None) != (loaded.tp.size == 1):
            raise ValueError("a tensor-parallel model runs steps with its workers' step channel, and only then")
        self.loaded = loaded
        self.fan_out = fan_out
        # Copied to plain attributes: steps read them often (a null device for benchmarks swaps `model`).
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = loaded.block_size
        self.model = loaded.model
        self.quantization = loaded.quantization
        self.num_blocks = loaded.num_blocks
        self.scratch_block = loaded.scratch_block
        self.kv_caches = loaded.kv_caches
        self.draft = loaded.draft  # speculative decoding's draft model, when configured
        self.decode_graphs = loaded.decode_graphs
        self.lora_slots = loaded.lora_slots  # the LoRA adapters' slot weights (None: the engine serves no adapter)
        # The running requests' images as the text model's embeddings (None: the model reads no images, or reads
        # them through cross-attention layers: `cross_states`).
        multimodal = loaded.model_config.multimodal
        transcribes = multimodal is not None and multimodal.transcribes
        cross = transcribes or (multimodal is not None and multimodal.images is not None
                                and multimodal.images.cross_attention)  # fmt: skip
        self.image_features = (
            None if loaded.vision is None or cross else ImageFeatures(loaded.vision, loaded.device, loaded.dtype)
        )
        # Llama 3.2 Vision's: the running requests' images' K/V for its cross-attention layers; a step with a row of
        # a request with images runs eagerly, those layers between the text model's (`multimodal.mllama`).
        # Whisper's: the running transcriptions' clips' K/V, read inside every decoder layer (`multimodal.whisper`).
        self.cross_states: CrossStates | WhisperCrossStates | None = None
        if transcribes and loaded.vision is not None:
            assert isinstance(loaded.vision, WhisperAudioEncoder)
            self.cross_states = WhisperCrossStates(loaded.vision, loaded.device, loaded.dtype)
        elif cross and loaded.vision is not None:
            assert isinstance(loaded.vision, MllamaImageEncoder) and multimodal is not None
            self.cross_states = CrossStates(loaded.vision, multimodal.dropped_layers, loaded.device, loaded.dtype)
        # Requests whose outputs turn by their index plus a delta (M-RoPE after images: `MultimodalInputs`), whose
        # decode rows' positions are shifted so (`_position_shifts`): filled as their prompts run.
        self._shifted_rope: set[str] = set()
        # A step runs within `launch` here, so another thread can stop it (engine_server.step_interrupt); not under
        # tensor parallelism, where every rank would have to stop at the same layer.
        # Linear attention's states (`layers.gated_deltanet`): one row per running request (`Request.state_slot`);
        # a step advances them as it goes, so it is never stopped half way.
        self.state_slots = loaded.state_slots
        self.state_snapshots = loaded.state_snapshots
        self.can_interrupt = self.device.type == "cpu" and fan_out is None and not self.state_slots
        self.sampler = Sampler(loaded.model_config.vocab_size, self.device)
        self.grammars = GrammarMatchers(loaded.model_config.vocab_size, self.device)
        model = loaded.model
        self.pooler = Pooler(model.classify if isinstance(model, BertEncoder) and model.config.num_labels else None)
        # The last launch's sampled token ids (on the device) and the requests that sampled them, row by row.
        self._last_sampled: tuple[torch.Tensor, LaunchedStep] | None = None
        self._decode_rows = DecodeRows(self.block_size)  # the last decode step's layout, updated step to step
        # The last sampling step's request ids and metadata, when it may serve the next step (_sampling_metadata).
        self._sampling_cache: tuple[list[Request], SamplingMetadata] | None = None

    def capture_decode_graphs(self, capture: GraphCapture) -> DecodeGraphs:
        """Record the decode graphs over the loaded model with `capture` and replay them from now on: tests pass
        `EagerCapture` to run the padded static-buffer path on the CPU (loading captures them on CUDA). Under
        tensor parallelism the workers record theirs beside rank 0 (with the eager stand-in where it is one)."""
        if self.fan_out is not None:
            self.fan_out.capture(eager=isinstance(capture, EagerCapture))
        self.decode_graphs = capture_decode_graphs(self.loaded, capture)
        return self.decode_graphs

    def alignment(self, request_id: str) -> torch.Tensor | None:
        """A finished transcription's word-timing attention (`WhisperCrossStates.alignment`), once; None for others."""
        if isinstance(self.cross_states, WhisperCrossStates):
            return self.cross_states.alignment(request_id)
        return None

    def release(self, request_id: str) -> None:
        """Forget per-request state (the grammar matcher, a pooling request's partial sum) of a finished or aborted
        request."""
        self.grammars.release(request_id)
        self.pooler.release(request_id)
        if self.image_features is not None:
            self.image_features.release(request_id)
            self._shifted_rope.discard(request_id)
        if self.cross_states is not None:
            self.cross_states.release(request_id)

    @torch.inference_mode()
    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Float32 logits `[T, vocab]` of every token of one forward over the KV cache as `meta` lays it out,
        outside the scheduler (tools that read a model's logits: benchmarks.quality). Under tensor parallelism
        the workers run the same forward and logits gather, in step."""
        return self._logits(self._run_model(input_ids, positions, meta, None), None)

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the scheduled tokens through the model and sample for every request that `needs_sample`."""
        launched = self.launch(output)
        return self.collect(launched).by_request(launched.items)

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, interrupt: StepInterrupt | None = None) -> LaunchedStep:
        """Queue the step's forward pass and sampling on the device, and the copy of its tokens to the host.

        Returns at once on CUDA (the host may schedule and launch the next step meanwhile); `collect` waits.
        A scheduled token that is still pending (async scheduling: sampled by the previous launch, not yet
        collected) is read from that launch's device tensor; steps must be launched in scheduling order.
        With `interrupt` (the CPU only: `can_interrupt`), raises StepInterrupted once it is set during the
        forward: nothing is sampled, and the runner is as if the step had never been launched.
        """
        if self.lora_slots is not None:
            for slot, adapter in output.lora_loads:  # before the forward, which may be the first to read them
                self.lora_slots.load(slot, adapter)
        if output.steady is not None:
            return self._launch_steady(output, output.steady, interrupt)
        items = output.scheduled
        sampling = [item for item in items if item.needs_sample]
        if not items:
            return LaunchedStep(sampling, None)
        try:
            hidden, last_rows = self._forward(output, interrupt)
        except StepInterrupted:
            self._decode_rows.invalidate()  # it holds the stopped step's layout
            raise
        if output.reads_prompts:
            self._read_prompt_logprobs(items, hidden, last_rows)
        # A pooling request's row samples nothing: its vector is pooled from the hidden states (engine_server.pooling).
        pooled = self.pooler.pool(items, hidden, last_rows) if output.has_pooling else None
        step = self._launch_sampling(output, sampling, hidden, last_rows) if sampling else LaunchedStep(sampling, None)
        if pooled:
            self._attach_pooled(step, pooled)
        return step

    def _launch_sampling(
        self,
        output: SchedulerOutput,
        sampling: list[ScheduledRequest],
        hidden: torch.Tensor,
        last_rows: list[int] | None,
    ) -> LaunchedStep:
        """`launch`'s sampling, once the step's forward has run (`sampling`: its rows that sample, at least one)."""
        items = output.scheduled
        if output.num_draft_tokens:
            assert last_rows is not None  # rows with drafts take the eager path
            return self._launch_verification(sampling, items, hidden, last_rows)
        if last_rows is not None or len(sampling) < len(items):  # a decode step where every row samples: no gather
            last = last_rows if last_rows is not None else range(len(items))
            wanted = [last[i] for i, item in enumerate(items) if item.needs_sample]
            logits = self._logits(hidden, to_device(host_tensor(wanted, torch.long, self.device), self.device))
        else:
            logits = self._logits(hidden, None)
        if all(item.request.argmax_only for item in sampling):
            sampled = self.sampler.argmax(logits)  # no per-row set-up: a step's host time matters on a GPU
        else:
            # Built after the forward is launched: on CUDA the host-side work overlaps the GPU's.
            requests = [item.request for item in sampling]
            positions = [item.start_position + item.num_new_tokens for item in sampling]
            sampled = self.sampler.sample(logits, self._sampling_metadata(sampling, requests, positions))
        step = LaunchedStep(sampling, *_copy_to_host(sampled))
        self._last_sampled = (sampled.token_ids, step)
        self._decode_rows.mark_launched(len(sampling) == len(items))
        return step

    def _read_prompt_logprobs(
        self, items: list[ScheduledRequest], hidden: torch.Tensor, last_rows: list[int] | None
    ) -> None:
        """Append to `Request.prompt_logprobs` what the step's chunks give: the row at prompt position p predicts
        prompt token p + 1, its log-probability (float32 log_softmax of the raw logits, as the sampler's) and rank,
        with the request's `prompt_logprobs` best alternatives. Positions a request has already (a preemption's
        rerun) are skipped. Blocking: the values go to the host at once (only such requests pay it)."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Request] = []
        for i, item in enumerate(items):
            request = item.request
            found = request.prompt_logprobs
            if found is None:
                continue
            first_row = (last_rows[i] if last_rows is not None else i) - item.num_new_tokens + 1
            for offset in range(item.num_new_tokens):
                position = item.start_position + offset
                if len(found) <= position < request.num_prompt_tokens - 1:
                    rows.append(first_row + offset)
                    targets.append(request.prompt_token_ids[position + 1])
                    owners.append(request)
        if not rows:
            return
        k = max(owner.sampling_params.prompt_logprobs or 0 for owner in owners)
        # A slice of rows at a time: a whole prefill chunk's [rows, vocab] float32 would be gigabytes.
        for begin in range(0, len(rows), _PROMPT_LOGPROB_ROWS):
            end = begin + _PROMPT_LOGPROB_ROWS
            index = to_device(host_tensor(rows[begin:end], torch.long, self.device), self.device)
            logprobs = torch.log_softmax(self._logits(hidden, index)[:, : self.sampler.vocab_size].float(), dim=-1)
            wanted_ids = to_device(host_tensor(targets[begin:end], torch.long, self.device), self.device)
            chosen = logprobs.gather(1, wanted_ids[:, None])
            ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # 1 + the tokens more likely than the prompt's
            top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            chosen_list = chosen[:, 0].tolist()
            top_value_list = top_values.tolist() if top_values is not None else None
            top_id_list = top_ids.tolist() if top_ids is not None else None
            for j, (owner, target) in enumerate(zip(owners[begin:end], targets[begin:end], strict=True)):
                wanted = owner.sampling_params.prompt_logprobs or 0
                top: tuple[tuple[int, float], ...] = ()
                if wanted and top_id_list is not None and top_value_list is not None:
                    top = tuple(zip(top_id_list[j][:wanted], top_value_list[j][:wanted], strict=True))
                assert owner.prompt_logprobs is not None
                owner.prompt_logprobs.append(TokenLogprobs(target, chosen_list[j], top, ranks[j]))

    def _attach_pooled(self, step: LaunchedStep, pooled: dict[str, torch.Tensor]) -> None:
        """Give `step` the vectors it pooled, on their way to the host (on CUDA `step.ready` then covers them too:
        recorded after their copies and the sampled tokens')."""
        if self.device.type == "cuda":
            pooled = {request_id: vector.to("cpu", non_blocking=True) for request_id, vector in pooled.items()}
            step.ready = torch.cuda.Event()
            step.ready.record()
        step.pooled = pooled

    def _launch_steady(
        self, output: SchedulerOutput, steady: SteadyDecode, interrupt: StepInterrupt | None
    ) -> LaunchedStep:
        """`launch` for a steady decode step: the rows' columns throughout, no object per row."""
        try:
            hidden, _ = self._forward(output, interrupt)
        except StepInterrupted:
            self._decode_rows.invalidate()
            raise
        logits = self._logits(hidden, None)
        if steady.all_argmax_only:
            sampled = self.sampler.argmax(logits)
        else:
            positions = steady.starts + 1
            sampled = self.sampler.sample(logits, self._sampling_metadata(output, steady.requests, positions))
        step = LaunchedStep(None, *_copy_to_host(sampled), output=output)
        self._last_sampled = (sampled.token_ids, step)
        self._decode_rows.mark_launched(True)
        return step

    def collect(self, step: LaunchedStep) -> CollectedTokens:
        """Wait for a launched step's tokens; constrained requests' matchers accept them here (and only here)."""
        if step.ready is not None:
            step.ready.synchronize()
        if step.sampled is None:
            collected = CollectedTokens([])
        elif step.sampled.token_ids.shape[0] != step.num_rows:
            collected = self._collect_verification(step.items, step.sampled)
        else:
            collected = self._collect(step, step.sampled)
        if step.pooled:
            collected = replace(collected, pooled=step.pooled)
        return collected

    def _launch_verification(
        self,
        sampling: list[ScheduledRequest],
        items: list[ScheduledRequest],
        hidden: torch.Tensor,
        last_rows: list[int],
    ) -> LaunchedStep:
        """`launch` for a step with drafts: the target's token at every draft position too (speculative.verify)."""
        wanted = sampled_positions(items, last_rows)
        logits = self._logits(hidden, to_device(host_tensor(wanted, torch.long, self.device), self.device))
        if all(item.request.argmax_only for item in sampling):
            sampled = self.sampler.argmax(logits)
        else:
            rows = [row for item in sampling for row in self._verification_rows(item)]
            sampled = self.sampler.sample(logits, SamplingMetadata.build(rows, self.sampler.vocab_size, self.device))
        self._last_sampled = None  # its rows are positions, not requests: no later step reads its tokens
        self._decode_rows.mark_launched(False)
        return LaunchedStep(sampling, *_copy_to_host(sampled))

    def _verification_rows(self, item: ScheduledRequest) -> list[SamplingRow]:
        """An item's sampling rows: one per position it samples, each with the drafts before it as its history
        (penalties, min_tokens), its own position (seeded noise) and its grammar's mask after those drafts."""
        request, drafts = item.request, item.draft_token_ids
        masks: list[torch.Tensor | None]
        if request.grammar is not None:
            masks = list(self.grammars.draft_bitmasks(request, drafts))
        else:
            masks = [None] * (len(drafts) + 1)
        first = item.start_position + item.num_new_tokens - len(drafts)
        seed = None if request.sampling_params.seed is None else request.sampling_params.seed % _SEED_MODULUS
        outputs = request.output_token_ids
        return [
            SamplingRow(
                params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=[*outputs, *drafts[:j]] if j and request.needs_output_history else outputs,
                eos_token_ids=request.eos_token_ids,
                position=first + j,
                seed=seed,
                allowed_token_bitmask=mask,
            )
            for j, mask in enumerate(masks)
        ]

    def _collect_verification(self, items: list[ScheduledRequest], sampled: SamplerOutput) -> CollectedTokens:
        """The runs the drafts' verification keeps; a constrained request's matcher accepts its run, which ends early
        where the grammar ends the choice."""
        runs = split_runs(items, sampled.token_id_list())
        logprobs = sampled.logprob_list()
        if not any(logprobs) and not any(item.request.grammar is not None for item in items):
            return CollectedTokens([run[-1] for run in runs], runs=runs)
        run_details: list[list[SampledToken]] = []
        row = 0
        for item, run in zip(items, runs, strict=True):
            details: list[SampledToken] = []
            for j, token in enumerate(run):
                finish = None
                if item.request.grammar is not None:
                    finish = _GRAMMAR_FINISH.get(self.grammars.accept(item.request.request_id, token))
                details.append(SampledToken(token, logprobs[row + j], finish))
                if finish is not None:
                    del run[j + 1 :]
                    break
            run_details.append(details)
            row += len(item.draft_token_ids) + 1
        return CollectedTokens(
            [run[-1] for run in runs], [d[-1] for d in run_details], runs=runs, run_details=run_details
        )

    def _forward(
        self, output: SchedulerOutput, interrupt: StepInterrupt | None
    ) -> tuple[torch.Tensor, list[int] | None]:
        """Hidden states of the step's tokens `[T, hidden]` and, per scheduled request, the row of its last token
        (None for a decode step, where row i is request i's)."""
        steady = output.steady
        if steady is not None and self.cross_states is not None and self._has_images(steady.requests):
            steady = None  # (its rows as a list: a row with images runs eagerly, below)
        if steady is not None:
            layout, continues = self._decode_rows.layout_columns(steady.requests, steady.tables, steady.starts)
        else:
            scheduled = output.scheduled
            if any(item.num_new_tokens != 1 for item in scheduled) or self._reaches_images(scheduled):
                self._decode_rows.invalidate()
                # Whether the step reads each sequence's last token alone (`AttentionMetadata.last_rows_only`).
                last_only = not (output.reads_prompts or output.has_pooling or output.num_draft_tokens)
                return self._forward_eager(scheduled, interrupt, last_only, output.state_copies)
            layout, continues = self._decode_rows.layout(scheduled)
        num_rows = len(layout.seq_lens)
        shifts = None
        if self._shifted_rope:
            rows = steady.requests if steady is not None else [item.request for item in output.scheduled]
            shifts = self._position_shifts(rows)
        adapter_slots = None
        if self.lora_slots is not None:
            rows = steady.requests if steady is not None else [item.request for item in output.scheduled]
            adapter_slots = self._adapter_slots(rows)
        # A step that continues the last one reads its tokens from that launch's device tensor, row for row; any
        # other has its ids on the host, but for the rows the last launch sampled (`pending`).
        step_ids: list[int] | torch.Tensor
        if continues and self._last_sampled:
            step_ids, pending_rows, pending = self._last_sampled[0], [], None
        else:
            tokens = _step_tokens(output.scheduled)
            step_ids, pending_rows, pending = tokens.known, tokens.pending_rows, self._pending_inputs(tokens)
        graphs = self.decode_graphs
        bucket = None if graphs is None else graphs.bucket_for(num_rows)
        if graphs is not None and bucket is not None:  # graphs with LoRA slots apply the adapters (cuda_graphs)
            if self.fan_out is not None:  # every rank replays its graph of this bucket
                host_ids, sent_pending = _host_decode_inputs(step_ids, pending_rows, pending)
                self.fan_out.decode_graph(host_ids, layout, bucket, sent_pending, shifts)
            return graphs.run_layout(step_ids, layout, pending, adapter_slots, shifts), None
        lora = self._lora_batch(adapter_slots)
        meta = AttentionMetadata.from_decode_layout(layout, self.block_size, self.device)
        if self.state_slots:
            rows = steady.requests if steady is not None else [item.request for item in output.scheduled]
            self._set_state_slots(meta, rows, output.state_copies)
        host_positions = torch.from_numpy(layout.seq_lens - 1 if shifts is None else layout.seq_lens - 1 + shifts)
        if self.fan_out is not None:  # before the index_copy_ below, which on the CPU writes the host tensor
            host_ids, sent_pending = _host_decode_inputs(step_ids, pending_rows, pending)
            self.fan_out.forward(host_ids, host_positions, meta, sent_pending)
        if isinstance(step_ids, torch.Tensor):
            input_ids = step_ids
        else:
            input_ids = to_device(torch.from_numpy(np.asarray(step_ids, dtype=np.int64)), self.device)
            if pending is not None:
                input_ids.index_copy_(0, *pending)
        positions = to_device(host_positions, self.device)
        hidden = self._run_model(input_ids, positions, meta, interrupt, sent=self.fan_out is not None, lora=lora)
        if self.draft is not None:
            self._follow_draft(input_ids, positions, meta, hidden)
        return hidden, None

    def _forward_eager(
        self, scheduled: list[ScheduledRequest], interrupt: StepInterrupt | None, last_rows_only: bool = False,
        state_copies: StateCopies | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        if self.draft is not None:  # the drafts are the draft model's own: decoded now, verified by this step
            speculating = [item for item in scheduled if item.draft_token_ids]
            for item, drafts in zip(speculating, self.draft.propose(speculating), strict=True):
                item.draft_token_ids = drafts
        tokens = _StepTokens()
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        mrope = False
        for item in scheduled:
            start, count = item.start_position, item.num_new_tokens
            tokens.add(item.request, start, count, item.draft_token_ids)
            images = item.request.multimodal
            if images is not None and images.positions is not None:  # (M-RoPE: past the prompt, index + delta)
                shift = images.position_delta
                positions.extend(range(start + shift, start + count + shift))
                mrope = mrope or start < item.request.num_prompt_tokens
                if shift:
                    self._shifted_rope.add(item.request.request_id)
            else:
                positions.extend(range(start, start + count))
            query_lens.append(count)
            seq_lens.append(start + count)
            last_rows.append(len(tokens.known) - 1)
        meta = AttentionMetadata.build(
            query_lens, seq_lens, [item.block_ids for item in scheduled], self.block_size, self.device
        )
        meta.last_rows_only = last_rows_only and self.draft is None
        if self.cross_states is not None:
            chunks = [(item.request, item.start_position, item.num_new_tokens) for item in scheduled]
            meta.cross_attention = self.cross_states.step(chunks)
        if self.image_features is not None:
            chunks = [(item.request, item.start_position, item.num_new_tokens) for item in scheduled]
            image_rows = self.image_features.step_rows(chunks)
            if image_rows is not None:
                meta.host_image_rows = image_rows[0]
                meta.image_embeds = (to_device(image_rows[0], self.device), image_rows[1])
            if mrope:
                meta.host_mrope_positions = step_mrope_positions(chunks)
                meta.mrope_positions = to_device(meta.host_mrope_positions, self.device)
            meta.image_blocks = step_image_blocks(chunks)
        if self.state_slots:
            self._set_state_slots(meta, [item.request for item in scheduled], state_copies)
        host_ids, host_positions = (
            host_tensor(tokens.known, torch.long, self.device),
            host_tensor(positions, torch.long, self.device),
        )
        pending = self._pending_inputs(tokens)
        if self.fan_out is not None:  # before the index_copy_ below, which on the CPU writes the host tensor
            values = None if pending is None else pending[1]
            self.fan_out.forward(host_ids, host_positions, meta, _pending_tokens(tokens.pending_rows, values))
        input_ids = to_device(host_ids, self.device)
        if pending is not None:
            input_ids.index_copy_(0, *pending)
        position_ids = to_device(host_positions, self.device)
        lora = None
        if self.lora_slots is not None:
            lora = self._lora_batch(self._adapter_slots([item.request for item in scheduled]), query_lens)
        hidden = self._run_model(input_ids, position_ids, meta, interrupt, sent=self.fan_out is not None, lora=lora)
        if self.draft is not None:
            self._follow_draft(input_ids, position_ids, meta, hidden)
        return hidden, last_rows

    def _follow_draft(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor
    ) -> None:
        """The target's step (run already: `meta` is not read again) through the draft model, as a text model reads
        it: without the target's images (their rows, M-RoPE's positions, two-way blocks, Llama 3.2 Vision's
        cross-attention), at its tokens' own positions where the target's were shifted (M-RoPE's delta), as the
        draft's own proposals read them. A draft reads an image's placeholders as the tokens they are; the target
        verifies what it drafts."""
        assert self.draft is not None
        if meta.mrope_positions is not None or self._shifted_rope:
            positions = torch.cat([torch.arange(seq - query, seq) for query, seq in
                                   zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)]).to(positions.device)
        meta.image_embeds = meta.mrope_positions = meta.image_blocks = meta.cross_attention = None
        self.draft.follow(input_ids, positions, meta, hidden)

    def _position_shifts(self, requests: list[Request]) -> np.ndarray[Any, np.dtype[np.int64]] | None:
        """Each decode row's rope position past its token's index (`_shifted_rope`'s delta, else 0); None for none."""
        shifted = self._shifted_rope
        shifts = [
            request.multimodal.position_delta if request.multimodal is not None and request.request_id in shifted
            else 0
            for request in requests
        ]  # fmt: skip
        return np.asarray(shifts, dtype=np.int64) if any(shifts) else None

    def _reaches_images(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether a step of one-token rows computes a prompt token of a request with images (a prefill's last
        token alone, or a chunk the token budget cut to one), which takes the eager path and its image rows."""
        if self.cross_states is not None:  # (Llama 3.2 Vision's: its decode tokens read the images too)
            return self._has_images([item.request for item in scheduled])
        return self.image_features is not None and any(
            item.request.multimodal is not None and item.start_position < item.request.num_prompt_tokens
            for item in scheduled
        )

    @staticmethod
    def _has_images(requests: Sequence[Request]) -> bool:
        """Whether a request of `requests` has images."""
        return any(request.multimodal is not None for request in requests)

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        interrupt: StepInterrupt | None,
        sent: bool = False,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """The model's forward over the KV cache (the workers' too, under tensor parallelism: sent to them here
        from the tensors given, unless `sent` says the caller sent them its host copies already)."""
        if self.fan_out is not None and not sent:
            self.fan_out.forward(input_ids, positions, meta)
        hidden: torch.Tensor = self.model(input_ids, positions, self.kv_caches, meta, interrupt, lora)
        return hidden

    def _set_state_slots(
        self, meta: AttentionMetadata, requests: list[Request], copies: StateCopies | None = None
    ) -> None:
        """Give `meta` each row's linear-attention state slot (`Request.state_slot`; `requests`: the rows') and the
        step's copies of state rows (`copies`)."""
        slots = [request.state_slot for request in requests]
        if min(slots, default=0) < 0:
            raise RuntimeError("a request runs without a state slot on a model with linear attention")
        meta.state_slots_cpu = slots
        meta.state_slots = to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        meta.state_copies = copies

    @staticmethod
    def _adapter_slots(requests: list[Request]) -> list[int] | None:
        """Each row's LoRA slot (`Request.lora_slot`), or None when no row has an adapter."""
        slots = [request.lora_slot for request in requests]
        return slots if max(slots, default=-1) >= 0 else None

    def _lora_batch(self, slots: list[int] | None, query_lens: list[int] | None = None) -> LoraBatch | None:
        """The step's LoRA rows: each token's slot (row i's, `query_lens[i]` times; once each without them); None
        when no row has an adapter (a step of the base model alone, which the decode stack runs)."""
        if self.lora_slots is None or slots is None:
            return None
        per_token = torch.tensor(slots, dtype=torch.int64)
        if query_lens is not None:
            per_token = per_token.repeat_interleave(torch.tensor(query_lens, dtype=torch.int64))
        return LoraBatch(self.lora_slots, to_device(per_token, self.device), self.lora_slots.changed_by(slots))

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Logits of the last forward's `hidden` rows `rows` (a device index tensor; None: every row)."""
        if self.fan_out is not None:
            self.fan_out.logits(rows)
        return self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows))

    def _pending_inputs(self, tokens: _StepTokens) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) on the device for the step's input tokens that the previous launch sampled."""
        if not tokens.pending_rows:
            return None
        if self._last_sampled is None:
            raise RuntimeError("a scheduled token is pending, but no step was launched before")
        last_ids, last_step = self._last_sampled
        last_rows = {item.request_id: j for j, item in enumerate(last_step.items)}
        sources = [last_rows[request_id] for request_id in tokens.pending_ids]
        rows = to_device(host_tensor(tokens.pending_rows, torch.long, self.device), self.device)
        values = last_ids.index_select(0, to_device(host_tensor(sources, torch.long, self.device), self.device))
        return rows, values

    def _sampling_metadata(
        self,
        rows: list[ScheduledRequest] | SchedulerOutput,
        requests: list[Request],
        positions: Sequence[int] | np.ndarray[Any, np.dtype[np.int64]],
    ) -> SamplingMetadata:
        """The sampling metadata of a step's sampling rows (`rows`, or every row of a steady decode step's output;
        `requests` and `positions`: each row's request and sampled token's position). Reused from the step before
        when it sampled the same requests in the same order and none of them changes what it asks from step to
        step (a grammar's mask, min_tokens, penalties: `needs_output_history`), then only the seeded rows'
        positions are redone: a steady decode batch builds no per-row Python objects for sampling."""
        cached = self._sampling_cache
        if cached is not None and cached[0] == requests:  # the lists compare by identity, row by row
            meta = cached[1]
            if meta.seeded is None:
                return meta
            return meta.at_positions(positions, self.device)
        sampling = rows.scheduled if isinstance(rows, SchedulerOutput) else rows
        bitmasks = self.grammars.bitmasks(requests)
        sampling_rows = [self._row(item, mask) for item, mask in zip(sampling, bitmasks, strict=True)]
        meta = SamplingMetadata.build(sampling_rows, self.sampler.vocab_size, self.device)
        steady = not any(request.needs_output_history for request in requests)
        self._sampling_cache = (requests, meta) if steady else None
        return meta

    def _row(self, item: ScheduledRequest, bitmask: torch.Tensor | None = None) -> SamplingRow:
        request = item.request
        return SamplingRow(
            params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            position=item.start_position + item.num_new_tokens,
            # The frontend already gave choice i of an n>1 request the seed seed+i.
            seed=None if request.sampling_params.seed is None else request.sampling_params.seed % _SEED_MODULUS,
            allowed_token_bitmask=bitmask,
        )

    def _collect(self, step: LaunchedStep, sampled: SamplerOutput) -> CollectedTokens:
        """The rows' tokens; constrained requests' matchers accept theirs here (and only here)."""
        tokens = sampled.token_id_list()
        if sampled.logprobs is None and not len(self.grammars):  # no row asked, and no grammar is alive
            return CollectedTokens(tokens)
        items = step.items
        logprobs = sampled.logprob_list()
        if not any(logprobs) and not any(item.request.grammar is not None for item in items):
            return CollectedTokens(tokens)
        details: list[SampledToken] = []
        for item, token, lps in zip(items, tokens, logprobs, strict=True):
            finish = None
            if item.request.grammar is not None:
                finish = _GRAMMAR_FINISH.get(self.grammars.accept(item.request.request_id, token))
            details.append(SampledToken(token, lps, finish))
        return CollectedTokens(tokens, details)
