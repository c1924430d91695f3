"""Per-step host work of the sampler: turn the batch's rows into the few device tensors the step needs.

Each feature is built only when some row uses it (`None` otherwise), so a batch of plain greedy requests costs
one pass over the rows and no device transfer. Token-list work (penalty counts) touches only the rows with
a penalty. Every host array of a step reaches the device in one copy (`_Stager`: one buffer, pinned on CUDA so
the copy does not wait on the forward pass) and the metadata's tensors are views of it, so staging is one op
whatever the batch size and however many features the batch uses.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from engine_server.sampling.noise import row_keys
from engine_server.sampling_params import SamplingParams, TimestampRules


@dataclass(frozen=True, eq=False)
class SamplingRow:
    """One row of the batch: one sequence that samples a token this step.

    `position` is the index of the token being sampled in the request's sequence (prompt then output tokens,
    from 0). `seed`, in [0, 2**64), gives a non-greedy row noise that is a function of (seed, position, token id)
    alone (`noise`): the same tokens in any batch, and again after a preemption; None draws from the sampler's
    shared generator. `allowed_token_bitmask` is [ceil(V/32)] int32 on the device, bit 1 = allowed (grammar).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int]
    position: int
    seed: int | None = None
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
class SeededRows:
    """The non-greedy rows with a seed: they race with `noise.SeededNoise` instead of the shared generator."""

    rows: torch.Tensor | None  # [S] int64 indices into the batch; None means every row, in order
    keys: torch.Tensor  # [S] int64: noise.row_keys(seed, position), the bits of a uint64
    row_indices: tuple[int, ...] = ()  # host copy of the rows (every row listed, even when `rows` is None)
    seeds: tuple[int, ...] = ()  # their seeds, so the keys can be redone for later positions


@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    """What one step needs to know about its rows; a None field means no row uses that feature."""

    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [B] bool; None when no row or every row is greedy
    temperature: torch.Tensor | None  # [B]; 1.0 for greedy rows
    top_k: torch.Tensor | None  # [B] int64; V for rows without top-k
    top_k_max: int
    top_p: torch.Tensor | None  # [B]; 1.0 for rows without top-p
    drop_mass: torch.Tensor | None  # [B] float32 1 - top_p (set with top_p): the mass top-p may drop
    min_p: torch.Tensor | None  # [B]; 0.0 for rows without min-p
    logit_bias: SparseTokens | None
    banned: SparseTokens | None  # min_tokens: eos / stop ids held at -inf; suppressed tokens
    timestamps: RowSubset | None  # values (bans [b, 3, 2] int64 [start, end) ranges, first timestamp ids [b])
    repetition: RowSubset | None  # values (penalty,); tokens of prompt + output
    presence_frequency: RowSubset | None  # values (presence, frequency); tokens of the output
    bitmask: RowSubset | None  # values (masks [b, W] int32,)
    allowed: RowSubset | None  # allowed_token_ids: values (masks [b, W] int32,), 1 = allowed
    seeded: SeededRows | None
    wants_logprobs: tuple[bool, ...]
    num_top_logprobs: tuple[int, ...]
    processed_logprobs: torch.Tensor | None = None  # [B] bool: rows whose logprobs are the processed logits'

    @property
    def modifies_logits(self) -> bool:
        """Whether any step before the greedy/sampling split changes logits (so they must be copied)."""
        return any(
            f is not None
            for f in (
                self.logit_bias, self.banned, self.timestamps, self.repetition, self.presence_frequency, self.bitmask,
                self.allowed,
            )
        )

    @property
    def any_logprobs(self) -> bool:
        return any(self.wants_logprobs)

    def at_positions(
        self, positions: Sequence[int] | np.ndarray[Any, np.dtype[np.int64]], device: torch.device
    ) -> SamplingMetadata:
        """This batch's metadata for a later step of the same rows, whose sampled tokens sit at `positions`
        (one per row): only the seeded rows' noise keys change (one copy when there are any)."""
        if self.seeded is None:
            return self
        stage = _Stager(device)
        keys = row_keys(self.seeded.seeds, np.asarray(positions, dtype=np.int64)[list(self.seeded.row_indices)])
        return stage.finish(dataclasses.replace(self, seeded=dataclasses.replace(self.seeded, keys=stage.array(keys))))

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
        """Collect per-row parameters; every staged tensor comes to `device` in one copy."""
        stage = _Stager(device)
        greedy = [r.params.greedy for r in rows]
        sampled = [r for r, g in zip(rows, greedy, strict=True) if not g]
        top_k = [
            _effective_top_k(r.params.top_k, vocab_size) if not g else vocab_size
            for r, g in zip(rows, greedy, strict=True)
        ]
        top_k_max = max((k for k in top_k if k < vocab_size), default=0)
        top_p = _per_row(rows, greedy, lambda p: p.top_p, 1.0)
        meta = cls(
            all_greedy=not sampled,
            greedy_mask=stage(greedy, np.bool_) if sampled and len(sampled) < len(rows) else None,
            temperature=_staged(stage, _per_row(rows, greedy, lambda p: p.temperature, 1.0)),
            top_k=stage(top_k, np.int64) if top_k_max else None,
            top_k_max=top_k_max,
            top_p=_staged(stage, top_p),
            # float32 arithmetic, as `1.0 - top_p` on the device would do it.
            drop_mass=_staged(stage, None if top_p is None else np.float32(1.0) - top_p),
            min_p=_staged(stage, _per_row(rows, greedy, lambda p: p.min_p, 0.0)),
            logit_bias=_logit_bias(stage, rows),
            banned=_min_tokens_bans(stage, rows),
            timestamps=_timestamps(stage, rows, vocab_size),
            repetition=_repetition(stage, rows),
            presence_frequency=_presence_frequency(stage, rows),
            bitmask=_bitmask(stage, rows),
            allowed=_allowed(stage, rows, vocab_size),
            seeded=_seeded(stage, rows, greedy),
            wants_logprobs=tuple(r.params.logprobs or r.params.top_logprobs > 0 for r in rows),
            num_top_logprobs=tuple(r.params.top_logprobs for r in rows),
            processed_logprobs=_processed_logprobs(stage, rows),
        )
        return stage.finish(meta)


class _Stager:
    """Host arrays -> device tensors in one host-to-device copy per step.

    `__call__` and `array` record a host array and hand out a CPU tensor that stands for it; `finish` packs
    every recorded array into one buffer (pinned on CUDA, so the copy is asynchronous; 8-byte aligned
    sections), copies it once and swaps the stand-ins for views of the copy. Lists go through numpy: several
    times faster than torch.tensor on a Python list.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staged: list[tuple[torch.Tensor, np.ndarray]] = []

    def __call__(self, values: Sequence[float] | Sequence[int] | Sequence[bool], dtype: type) -> torch.Tensor:
        """`dtype` is a numpy scalar type (np.float32, np.int64, np.bool_); the tensor gets its torch twin."""
        return self.array(np.asarray(values, dtype=dtype))

    def array(self, array: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(array)
        stand_in = torch.from_numpy(array)
        self._staged.append((stand_in, array))
        return stand_in

    def finish(self, meta: SamplingMetadata) -> SamplingMetadata:
        """`meta` with its stand-ins replaced by device tensors (itself when nothing was staged)."""
        if not self._staged:
            return meta
        offsets = np.cumsum([0] + [-(-array.nbytes // 8) * 8 for _, array in self._staged]).tolist()
        if self.device.type == "cuda":
            host = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True)
            packed = host.numpy()
        else:
            packed = np.empty(offsets[-1], dtype=np.uint8)
            host = torch.from_numpy(packed)
        for (_, array), start in zip(self._staged, offsets, strict=False):
            packed[start : start + array.nbytes] = array.reshape(-1).view(np.uint8)
        copy = host.to(self.device, non_blocking=True)
        views = {
            id(stand_in): copy[start : start + array.nbytes].view(stand_in.dtype).view(stand_in.shape)
            for (stand_in, array), start in zip(self._staged, offsets, strict=False)
        }
        swapped: SamplingMetadata = _swap(meta, views)
        return swapped


def _swap(value: Any, views: dict[int, torch.Tensor]) -> Any:
    """`value` with each tensor in `views` (by id) replaced, through dataclasses and tuples of tensors."""
    if isinstance(value, torch.Tensor):
        return views.get(id(value), value)
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return tuple(_swap(item, views) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _swap(getattr(value, f.name), views) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    return value


def _processed_logprobs(stage: _Stager, rows: Sequence[SamplingRow]) -> torch.Tensor | None:
    """[B] bool: the rows whose logprobs are the processed logits' (`SamplingParams.processed_logprobs`); None: none."""
    processed = [r.params.processed_logprobs for r in rows]
    return stage(processed, np.bool_) if any(processed) else None


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 or top_k >= vocab_size else top_k


def _per_row(
    rows: Sequence[SamplingRow], greedy: list[bool], get: Callable[[SamplingParams], float], neutral: float
) -> np.ndarray | None:
    """A [B] float32 array of one parameter, neutral for greedy rows; None when every row is neutral."""
    values = [neutral if g else float(get(r.params)) for r, g in zip(rows, greedy, strict=True)]
    return np.asarray(values, dtype=np.float32) if any(v != neutral for v in values) else None


def _staged(stage: _Stager, array: np.ndarray | None) -> torch.Tensor | None:
    return None if array is None else stage.array(array)


def _seeded(stage: _Stager, rows: Sequence[SamplingRow], greedy: list[bool]) -> SeededRows | None:
    seeds = [(i, r.seed) for i, (r, g) in enumerate(zip(rows, greedy, strict=True)) if r.seed is not None and not g]
    if not seeds:
        return None
    keys = row_keys([seed for _, seed in seeds], [rows[i].position for i, _ in seeds])
    picked = None if len(seeds) == len(rows) else stage([i for i, _ in seeds], np.int64)
    indices, seed_values = zip(*seeds, strict=True)
    return SeededRows(rows=picked, keys=stage.array(keys), row_indices=indices, seeds=seed_values)


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
    """The tokens each row holds at -inf: its eos and stop ids while it has fewer than min_tokens outputs, its
    `suppress_token_ids` always, its `begin_suppress_token_ids` before its first output, its bad words'
    (`bad_word_bans`)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        begins = bool(params.begin_suppress_token_ids) and not row.output_token_ids
        if (not params.suppress_token_ids and not begins and len(row.output_token_ids) >= params.min_tokens
                and not params.bad_word_token_ids):
            continue  # (most rows: nothing held)
        banned: set[int] = set(params.suppress_token_ids)
        banned.update(bad_word_bans(params.bad_word_token_ids, row.output_token_ids))
        if begins:
            banned.update(params.begin_suppress_token_ids)
        if len(row.output_token_ids) < params.min_tokens:
            banned.update(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(row.eos_token_ids)
        row_ids.extend([i] * len(banned))
        token_ids.extend(banned)
    if not row_ids:
        return None
    return SparseTokens(stage(row_ids, np.int64), stage(token_ids, np.int64))


def bad_word_bans(words: Sequence[Sequence[int]], outputs: Sequence[int]) -> list[int]:
    """The tokens bad words' token sequences (`SamplingParams.bad_word_token_ids`) hold at -inf after `outputs`: a
    one-token word's always, a longer one's last token where the outputs end with its tokens before it (vLLM's
    rule)."""
    banned = []
    for word in words:
        before = len(word) - 1
        if before == 0 or (len(outputs) >= before and list(outputs[len(outputs) - before:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def _timestamps(stage: _Stager, rows: Sequence[SamplingRow], vocab_size: int) -> RowSubset | None:
    """The rows decoding with Whisper's timestamps (`SamplingParams.timestamps`): the token ranges their rules hold
    at -inf this step (`timestamp_bans`) and their first timestamp ids; the likelihood rule needs the logits and
    runs in the sampler."""
    picked = [(i, row.params.timestamps) for i, row in enumerate(rows) if row.params.timestamps is not None]
    if not picked:
        return None
    bans = np.asarray([timestamp_bans(rules, rows[i].output_token_ids, vocab_size) for i, rules in picked],
                      dtype=np.int64)  # fmt: skip
    subset = None if len(picked) == len(rows) else stage([i for i, _ in picked], np.int64)
    return RowSubset(rows=subset, values=(stage.array(bans), stage([rules.begin for _, rules in picked], np.int64)))


def timestamp_bans(rules: TimestampRules, outputs: Sequence[int], vocab_size: int) -> list[tuple[int, int]]:
    """The three [start, end) token ranges that `rules` hold at -inf after `outputs` ((0, 0): none), as transformers'
    `WhisperTimeStampLogitsProcessor` masks them: `<|notimestamps|>`; then at the first output every text token and
    the timestamps past `max_initial`; later, after an opening timestamp (one after another, or the first output)
    every timestamp, after a closing one every text token below eos, and the timestamps below the last one (below it
    plus one where it opened a segment)."""
    begin = rules.begin
    banned = [(rules.no_timestamps, rules.no_timestamps + 1)]
    if not outputs:
        last = vocab_size if rules.max_initial is None else min(begin + rules.max_initial + 1, vocab_size)
        return [*banned, (0, begin), (last, vocab_size)]
    last_timestamp = outputs[-1] >= begin
    after_timestamp = len(outputs) < 2 or outputs[-2] >= begin
    if last_timestamp:
        banned.append((begin, vocab_size) if after_timestamp else (0, rules.eos))
    else:
        banned.append((0, 0))
    latest = next((token for token in reversed(outputs) if token >= begin), None)
    if latest is None:
        banned.append((0, 0))
    else:
        banned.append((begin, latest if last_timestamp and not after_timestamp else latest + 1))
    return banned


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
    token_rows = np.repeat(np.arange(len(picked), dtype=np.int64), lengths)
    flat = chain.from_iterable(chain.from_iterable(token_lists))
    token_ids = np.fromiter(flat, dtype=np.int64, count=total)
    return RowSubset(
        rows=None if len(picked) == n_rows else stage(picked, np.int64),
        values=tuple(stage(v, np.float32) for v in values),
        token_rows=stage.array(token_rows),
        token_ids=stage.array(token_ids),
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


def _allowed(stage: _Stager, rows: Sequence[SamplingRow], vocab_size: int) -> RowSubset | None:
    """The rows with `allowed_token_ids`: their masks in one [b, W] int32 array, xgrammar's layout (bit i of word j
    is token 32 j + i; 1 = allowed), staged with the step's other host arrays."""
    picked = [(i, row.params.allowed_token_ids) for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if not picked:
        return None
    masks = np.stack([allowed_mask(ids, vocab_size) for _, ids in picked])
    subset = None if len(picked) == len(rows) else stage([i for i, _ in picked], np.int64)
    return RowSubset(rows=subset, values=(stage.array(masks),))


@functools.lru_cache(maxsize=256)
def allowed_mask(token_ids: tuple[int, ...], vocab_size: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    """[ceil(vocab_size / 32)] int32 with the bits of `token_ids` set (xgrammar's layout), made once per id list."""
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    ids = np.asarray(token_ids, dtype=np.int64)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


def _bitmask(stage: _Stager, rows: Sequence[SamplingRow]) -> RowSubset | None:
    """The rows' masks in one [b, W] tensor; they are on the device already (no per-row `.to`, an op each)."""
    picked: list[int] = []
    masks: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        if row.allowed_token_bitmask is not None:
            picked.append(i)
            masks.append(row.allowed_token_bitmask)
    if not picked:
        return None
    subset = None if len(picked) == len(rows) else stage(picked, np.int64)
    return RowSubset(rows=subset, values=(torch.stack(masks),))
