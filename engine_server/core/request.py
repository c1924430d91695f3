"""One sequence being generated: its immutable inputs and the state the scheduler advances.

A caller expands `n > 1` into n Requests, so the scheduler and the KV cache manager never see `n`. Token
state is append-only: prompt tokens never change and output tokens are only appended, which is what lets
the KV cache manager hash full blocks once and keep the hashes on the request (`block_hashes`).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_server.pooling.params import PoolingParams
from engine_server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_server.lora.peft_format import LoraAdapter
    from engine_server.multimodal.inputs import MultimodalInputs
    from engine_server.sampling.sampler import TokenLogprobs
    from engine_server.structured.compiler import CompiledConstraint


class Priority(enum.IntEnum):
    """Scheduling class; a lower value is served first."""

    INTERACTIVE = 0
    BATCH = 1


class RequestStatus(enum.Enum):
    """Life cycle: WAITING -> RUNNING (<-> PREEMPTED) -> one of the FINISHED_* states."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits at the front of its class to recompute
    FINISHED_STOPPED = "stop"  # eos or a stop token id (or a stop string, reported by the caller)
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"
    FINISHED_DEADLINE = "deadline"  # deadline passed while the request was still queued

    is_finished: bool  # read for every request every step: a plain attribute (an enum's hash runs in Python)

    def __init__(self, value: str) -> None:
        self.is_finished = value in ("stop", "length", "abort", "deadline")


def resolve_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens a request may generate: the caller's cap (else the model's default cap, raised to
    min_tokens), bounded by what fits in the context."""
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is not None:
        requested: float = params.max_tokens
    elif params.default_max_tokens is not None:
        requested = max(params.default_max_tokens, params.min_tokens)
    else:
        requested = math.inf
    return max(0, int(min(requested, room)))


@dataclass(frozen=True)
class RequestTimeline:
    """When a request arrived, was first scheduled, produced its first token and was preempted (each time), on
    the monotonic clock; None for what has not happened. Reported with its last output, for traces."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    preempted: tuple[float, ...]


class Request:
    """State of one sequence. Mutated only by the scheduler (and the KV cache manager: the hash cache, the block
    table and `num_slots_in_place`).

    Invariants: `0 <= num_computed_tokens <= num_tokens`; `all_token_ids == prompt_token_ids +
    output_token_ids`; `block_hashes[i]` is the chained hash of the full block i of `all_token_ids`.
    """

    __slots__ = (
        "_all_token_ids",
        "argmax_only",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "deadline",
        "draft_token_ids",
        "eos_token_ids",
        "final_only",
        "first_token_time",
        "grammar",
        "lora",
        "lora_slot",
        "max_tokens",
        "multimodal",
        "needs_output_history",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_pending_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_slots_in_place",
        "output_token_ids",
        "pooling",
        "preempted_times",
        "priority",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "scheduled_time",
        "snapshot_at",
        "speculative",
        "state_slot",
        "status",
        "stop_token_id",
        "stop_token_ids",
        "wants_logprobs",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        priority: Priority = Priority.INTERACTIVE,
        arrival_time: float | None = None,
        deadline: float | None = None,
        grammar: CompiledConstraint | None = None,
        pooling: PoolingParams | None = None,
        cache_salt: str = "",
        lora: LoraAdapter | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> None:
        """`arrival_time` and `deadline` are `time.monotonic()` values; arrival defaults to now.

        `grammar` is the compiled form of `sampling_params.constraint` (compiled before the request is
        built, so the core never waits on a compile); None for an unconstrained request.

        `pooling` makes it a pooling request (engine_server.pooling): its prompt is computed and pooled into one
        vector, nothing is sampled (`max_tokens` 0; its last chunk has `needs_sample` False), and the engine core
        finishes it once the runner has pooled it.

        `cache_salt` names the request's prefix-cache namespace: it seeds the chain of its block hashes (see
        engine_server.core.kv_cache_manager), so it shares cached blocks only with requests of the same salt.
        `lora`: the LoRA adapter it generates with (None: the base model); its key seeds the chain too, so
        requests of different adapters (or of none) never share cached blocks.
        `multimodal`: the prompt's images (their placeholder runs in `prompt_token_ids`); their digest seeds the
        chain too, so a prompt shares cached blocks only with prompts of the same images.
        """
        constraint = grammar.constraint if grammar is not None else None
        if constraint != sampling_params.constraint:
            raise ValueError(f"request {request_id!r}: the grammar does not match sampling_params.constraint")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)  # a plain attribute: the scheduler reads it every step
        self.sampling_params = sampling_params
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids)
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.deadline = deadline
        self.grammar = grammar
        self.pooling = pooling
        self.cache_salt = cache_salt
        self.lora = lora
        self.multimodal = multimodal
        self.lora_slot = -1  # the adapter's slot while the request runs (the scheduler's AdapterSlots), else -1
        self.state_slot = -1  # its linear-attention state's slot while it runs (the scheduler's StateSlots), else -1
        # Where its states are also saved, beside its prompt's last block boundary: the end of the cached prefix it
        # was admitted with, where no snapshot was (the scheduler's StateSnapshots); 0: nowhere else.
        self.snapshot_at = 0
        self.max_tokens = (
            0 if pooling is not None else resolve_max_tokens(sampling_params, len(self.prompt_token_ids), max_model_len)
        )

        self.output_token_ids: list[int] = []
        # Kept alongside the two parts so that reading all tokens never concatenates (it runs every step).
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        self.num_preemptions = 0
        # Its timeline on the monotonic clock (traces): first scheduled, first token, each preemption.
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.preempted_times: tuple[float, ...] = ()
        self.block_hashes: list[bytes] = []
        # Set by the KV cache manager: the live block table, and a bound below which tokens fit the blocks held
        # with nothing to allocate or publish (0: ask the manager). The scheduler reads both every step.
        self.block_ids: list[int] = []
        self.num_slots_in_place = 0
        # Tokens sampled by launched steps whose values have not reached the host yet (async scheduling): they
        # are not in all_token_ids, but the scheduler counts them, and the runner feeds them from the device.
        self.num_pending_tokens = 0
        params = sampling_params
        # Whether sampling this request needs every earlier output token on the host (a grammar's matcher,
        # penalties over the outputs, min_tokens counting them): then no step is scheduled while one is pending.
        self.needs_output_history = (
            grammar is not None
            or params.min_tokens > 0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
            or bool(params.begin_suppress_token_ids)
            or params.timestamps is not None
            or bool(params.bad_word_token_ids)
        )
        self.wants_logprobs = params.logprobs or params.top_logprobs > 0
        # With sampling_params.prompt_logprobs: entry i is prompt token i + 1's log-probability given the tokens
        # before it, filled by the runner as the prompt's chunks run (each position once, a preemption's rerun
        # adds nothing) and handed out by the engine core with the request's first output; None when not asked.
        self.prompt_logprobs: list[TokenLogprobs] | None = [] if params.prompt_logprobs is not None else None
        # Speculative decoding (engine_server.speculative): whether the engine proposes tokens for this request (the
        # engine core sets it at admission); then it never runs ahead of its tokens (async scheduling), since a
        # proposal starts from its last token. `draft_token_ids`: the tokens proposed to follow its last one, set by
        # the core before each step and verified by the next step that decodes it.
        self.speculative = False
        self.draft_token_ids: list[int] = []
        # Set by the caller before the request is queued: it wants the output once, at the finish, with every
        # token (no stop strings to match as the text grows). The core then builds no output per step.
        self.final_only = False
        # Whether its token is the argmax of the raw logits and nothing else is asked of the sampler (no
        # logit_bias, logprobs or any of the above): a batch of only such rows skips the sampler's set-up.
        self.argmax_only = (
            params.greedy and not self.needs_output_history and not params.logit_bias and not self.wants_logprobs
            and not params.suppress_token_ids and params.allowed_token_ids is None
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs. The live list: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_known_and_pending_tokens(self) -> int:
        """Tokens the request will have once the launched steps report: `num_tokens + num_pending_tokens`."""
        return len(self._all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def timeline(self) -> RequestTimeline:
        return RequestTimeline(self.arrival_time, self.scheduled_time, self.first_token_time, self.preempted_times)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


def receive_pending_tokens(requests: Sequence[Request], token_ids: Sequence[int]) -> None:
    """Request i's oldest pending token arrived as `token_ids[i]`: appended to its outputs, one fewer pending.

    The scheduler's update of a steady decode step, where every row receives one token: one loop, no call per row.
    """
    for request, token_id in zip(requests, token_ids, strict=True):
        request.num_pending_tokens -= 1
        request.output_token_ids.append(token_id)
        request._all_token_ids.append(token_id)
