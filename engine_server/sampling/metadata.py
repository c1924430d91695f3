"""Per-step host work of the sampler: turn the batch's rows into the few device tensors the step needs.

Each feature is built only when some row uses it (`None` otherwise), so a batch of plain requests costs
one pass over the rows and no device transfer. Token-list work (penalty counts) touches only the rows with
a penalty. Host tensors are staged in pinned memory on CUDA so the copies do not wait on the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine_server.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class SamplingRow:
    """One row of the batch: one sequence that samples a token this step.

    `generator` is the request's seeded generator on the sampler's device, owned by the caller and
    advanced here (V draws per non-greedy step); None draws from the sampler's shared generator.
    `allowed_token_bitmask` is [ceil(V/32)] int32 on the device, bit 1 = allowed (grammar).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    eos_token_ids: frozenset[int]
    allowed_token_bitmask: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class RowSubset:
    """Some rows of the batch and per-row tensors for them; `rows` None means all rows, in order."""

    rows: torch.Tensor | None  # [b] int64 indices into the batch
    values: tuple[torch.Tensor, ...]  # each [b] (a penalty) or [b, ...] (a bitmask)
    token_rows: torch.Tensor | None = None  # [N] int64, index into the subset, for sparse token lists
    token_ids: torch.Tensor | None = None  # [N] int64


@dataclass(frozen=True, eq=False)
class SparseTokens:
    """(row, token) pairs of the whole batch with an optional value each, for index_put_."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor | None = None  # [N] float32


@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    """What one step needs to know about its rows; a None field means no row uses that feature."""

    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [B] bool; None when no row or every row is greedy
    temperature: torch.Tensor | None  # [B]; 1.0 for greedy rows
    top_k: torch.Tensor | None  # [B] int64; V for rows without top-k
    top_k_max: int
    top_p: torch.Tensor | None  # [B]; 1.0 for rows without top-p
    min_p: torch.Tensor | None  # [B]; 0.0 for rows without min-p
    logit_bias: SparseTokens | None
    banned: SparseTokens | None  # min_tokens: eos / stop ids held at -inf
    repetition: RowSubset | None  # values (penalty,); tokens of prompt + output
    presence_frequency: RowSubset | None  # values (presence, frequency); tokens of the output
    bitmask: RowSubset | None  # values (masks [b, W] int32,)
    seeded: tuple[tuple[int, torch.Generator], ...]  # non-greedy rows with their own generator
    wants_logprobs: tuple[bool, ...]
    num_top_logprobs: tuple[int, ...]

    @property
    def modifies_logits(self) -> bool:
        """Whether any step before the greedy/sampling split changes logits (so they must be copied)."""
        return any(
            f is not None
            for f in (self.logit_bias, self.banned, self.repetition, self.presence_frequency, self.bitmask)
        )

    @property
    def any_logprobs(self) -> bool:
        return any(self.wants_logprobs)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
        """Collect per-row parameters; raises ValueError on a generator on the wrong device type."""
        stage = _Stager(device)
        greedy = [r.params.greedy for r in rows]
        sampled = [r for r, g in zip(rows, greedy, strict=True) if not g]
        top_k = [
            _effective_top_k(r.params.top_k, vocab_size) if not g else vocab_size
            for r, g in zip(rows, greedy, strict=True)
        ]
        top_k_max = max((k for k in top_k if k < vocab_size), default=0)
        seeded: list[tuple[int, torch.Generator]] = []
        for i, row in enumerate(rows):
            if row.generator is not None and not greedy[i]:
                if row.generator.device.type != device.type:
                    raise ValueError(f"row {i}'s generator is on {row.generator.device}, the sampler on {device}")
                seeded.append((i, row.generator))
        return cls(
            all_greedy=not sampled,
            greedy_mask=stage(greedy, np.bool_) if sampled and len(sampled) < len(rows) else None,
            temperature=_per_row(stage, rows, greedy, lambda p: p.temperature, 1.0),
            top_k=stage(top_k, np.int64) if top_k_max else None,
            top_k_max=top_k_max,
            top_p=_per_row(stage, rows, greedy, lambda p: p.top_p, 1.0),
            min_p=_per_row(stage, rows, greedy, lambda p: p.min_p, 0.0),
            logit_bias=_logit_bias(stage, rows),
            banned=_min_tokens_bans(stage, rows),
            repetition=_repetition(stage, rows),
            presence_frequency=_presence_frequency(stage, rows),
            bitmask=_bitmask(stage, rows, device),
            seeded=tuple(seeded),
            wants_logprobs=tuple(r.params.logprobs or r.params.top_logprobs > 0 for r in rows),
            num_top_logprobs=tuple(r.params.top_logprobs for r in rows),
        )


class _Stager:
    """Host list -> device tensor, through pinned memory on CUDA so the copy is asynchronous.

    Lists go through numpy: several times faster than torch.tensor on a Python list.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"

    def __call__(self, values: Sequence[float] | Sequence[int] | Sequence[bool], dtype: type) -> torch.Tensor:
        """`dtype` is a numpy scalar type (np.float32, np.int64, np.bool_); the tensor gets its torch twin."""
        return self.put(torch.from_numpy(np.asarray(values, dtype=dtype)))

    def put(self, host: torch.Tensor) -> torch.Tensor:
        if self.pin:
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 or top_k >= vocab_size else top_k


def _per_row(
    stage: _Stager,
    rows: Sequence[SamplingRow],
    greedy: list[bool],
    get: Callable[[SamplingParams], float],
    neutral: float,
) -> torch.Tensor | None:
    """A [B] float tensor of one parameter, neutral for greedy rows; None when every row is neutral."""
    values = [neutral if g else float(get(r.params)) for r, g in zip(rows, greedy, strict=True)]
    return stage(values, np.float32) if any(v != neutral for v in values) else None


def _logit_bias(stage: _Stager, rows: Sequence[SamplingRow]) -> SparseTokens | None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias.items():
            row_ids.append(i)
            token_ids.append(token_id)
            values.append(bias)
    if not row_ids:
        return None
    return SparseTokens(stage(row_ids, np.int64), stage(token_ids, np.int64), stage(values, np.float32))


def _min_tokens_bans(stage: _Stager, rows: Sequence[SamplingRow]) -> SparseTokens | None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids) if params.ignore_eos else row.eos_token_ids | set(params.stop_token_ids)
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    if not row_ids:
        return None
    return SparseTokens(stage(row_ids, np.int64), stage(token_ids, np.int64))


def _token_subset(
    stage: _Stager,
    n_rows: int,
    picked: list[int],
    token_lists: Sequence[tuple[Sequence[int], ...]],
    values: list[list[float]],
) -> RowSubset:
    """Flatten each picked row's token lists on the host, in C (numpy), then copy once."""
    lengths = [sum(len(part) for part in parts) for parts in token_lists]
    total = sum(lengths)
    token_rows = torch.from_numpy(np.repeat(np.arange(len(picked), dtype=np.int64), lengths))
    flat = chain.from_iterable(chain.from_iterable(token_lists))
    token_ids = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=total))
    return RowSubset(
        rows=None if len(picked) == n_rows else stage(picked, np.int64),
        values=tuple(stage(v, np.float32) for v in values),
        token_rows=stage.put(token_rows),
        token_ids=stage.put(token_ids),
    )


def _repetition(stage: _Stager, rows: Sequence[SamplingRow]) -> RowSubset | None:
    picked = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not picked:
        return None
    token_lists = [(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in picked]
    penalties = [rows[i].params.repetition_penalty for i in picked]
    return _token_subset(stage, len(rows), picked, token_lists, [penalties])


def _presence_frequency(stage: _Stager, rows: Sequence[SamplingRow]) -> RowSubset | None:
    picked = [
        i
        for i, r in enumerate(rows)
        if (r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0) and r.output_token_ids
    ]
    if not picked:
        return None
    token_lists = [(rows[i].output_token_ids,) for i in picked]
    presence = [rows[i].params.presence_penalty for i in picked]
    frequency = [rows[i].params.frequency_penalty for i in picked]
    return _token_subset(stage, len(rows), picked, token_lists, [presence, frequency])


def _bitmask(stage: _Stager, rows: Sequence[SamplingRow], device: torch.device) -> RowSubset | None:
    picked: list[int] = []
    masks: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        if row.allowed_token_bitmask is not None:
            picked.append(i)
            masks.append(row.allowed_token_bitmask.to(device, non_blocking=True))
    if not picked:
        return None
    subset = None if len(picked) == len(rows) else stage(picked, np.int64)
    return RowSubset(rows=subset, values=(torch.stack(masks),))
