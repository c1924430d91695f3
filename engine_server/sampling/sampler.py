"""The batched sampler: one token per row from a [B, V] logits tensor, on the logits' device.

Order of processing, each step only when some row of the batch uses it:
  1. logit_bias is added.
  2. min_tokens: while a row has fewer than min_tokens outputs, its eos ids (unless ignore_eos) and its
     stop_token_ids are set to -inf; its suppress_token_ids always, its begin_suppress_token_ids before its first
     output (Whisper's); Whisper's timestamp rules (`SamplingParams.timestamps`).
  3. repetition penalty (Hugging Face semantics) over the prompt and output tokens.
  4. presence / frequency penalties (OpenAI semantics) over the output tokens only.
  5. the grammar bitmask, then allowed_token_ids' (disallowed tokens to -inf).
  6. greedy rows take the argmax here; the other rows go on:
  7. temperature -> top_k -> top_p (one sort of the batch, skipped when no row needs it) -> min_p ->
     the exponential race: a row with a seed takes counter-based noise, a function of its (seed, position of the
     sampled token, token id) alone (`noise`), so its tokens do not depend on the batch, the step or a
     preemption; the other rows share one generator.
When every row is greedy and nothing above applies, the step is a single argmax.

The number of torch ops a step dispatches (each a kernel launch on CUDA) does not depend on the batch size or on
how many rows have a seed: the metadata comes in one host-to-device copy and every step works on the whole batch.

Log-probabilities are the raw model's: log_softmax of the incoming logits, before any of the steps above.
That is vLLM's default; it keeps every value finite (top-k/top-p/grammar masks would put -inf, which JSON
cannot carry) and makes a token's logprob independent of the request's sampling knobs. A row with
`processed_logprobs` (set by the engine: Whisper's temperature fallback judges a decode by them) has them of the
logits after steps 1-5, before the temperature, as Whisper's decoder computes them (masked tokens' are -inf).

The sampler never modifies the caller's `logits`: it copies them once when a step above needs to.
The caller must leave every row at least one token that is not -inf after steps 1-5.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_server.sampling import logits_transforms
from engine_server.sampling.metadata import RowSubset, SamplingMetadata, SamplingRow
from engine_server.sampling.noise import SeededNoise

_NEG_INF = float("-inf")
# Above this, torch.topk is slower than one full sort, so top-k alone takes the sort path too.
_TOPK_WITHOUT_SORT_MAX_K = 1024


@dataclass(frozen=True)
class TokenLogprobs:
    """Host copy of one row's log-probabilities: the sampled token's, then the row's top ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; len = the row's top_logprobs
    rank: int = 0  # among the vocabulary by logprob (1: the most likely); 0 where not computed (sampled tokens)


@dataclass(frozen=True, eq=False)
class SamplerOutput:
    """The step's tokens, and log-probabilities when some row asked for them (all on the device).

    Log-probability tensors cover every row; rows that did not ask hold values the caller ignores,
    which is what the `*_list` helpers do. K is the largest top_logprobs of the batch.
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, of the sampled token
    top_token_ids: torch.Tensor | None = None  # [B, K] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [B, K] float32
    wants_logprobs: tuple[bool, ...] = ()  # per row
    num_top_logprobs: tuple[int, ...] = ()  # per row, <= K

    def token_id_list(self) -> list[int]:
        """The sampled tokens on the host (one device sync)."""
        tokens: list[int] = self.token_ids.tolist()  # an integer tensor: Python ints
        return tokens

    def logprob_list(self) -> list[TokenLogprobs | None]:
        """Per row: its log-probabilities, or None when the row did not ask (or no row did)."""
        if self.logprobs is None or not any(self.wants_logprobs):
            return [None] * self.token_ids.shape[0]
        tokens = self.token_id_list()
        sampled = self.logprobs.tolist()
        top_ids = self.top_token_ids.tolist() if self.top_token_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        result: list[TokenLogprobs | None] = []
        for i, wants in enumerate(self.wants_logprobs):
            if not wants:
                result.append(None)
                continue
            k = self.num_top_logprobs[i]
            top = tuple(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if top_ids and top_lps and k else ()
            result.append(TokenLogprobs(tokens[i], sampled[i], top))
        return result


class Sampler:
    """Samples one token per row; stateless across steps except for its shared random generator.

    Seeded rows need no state here: their noise is a function of the row's seed and position.
    Logits may be wider than `vocab_size` (a padded lm_head); the extra columns are never sampled.
    """

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # The CPU-only top-p shortcut (logits_transforms.apply_top_k_top_p). Off: the CPU runs the ops a GPU step would.
        self.cpu_shortcuts = True
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._noise = SeededNoise(vocab_size, self.device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample for `rows`; `logits` is [B, >=V] with row i belonging to rows[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows of vocab {self.vocab_size}")
        if not rows:
            return SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64, device=logits.device))
        return self.sample(logits, SamplingMetadata.build(rows, self.vocab_size, self.device))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """`__call__` with the rows' metadata already built (the caller may reuse it across steps of the same
        rows: `SamplingMetadata.at_positions`)."""
        if logits.dim() != 2 or logits.shape[0] != len(meta.wants_logprobs) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(meta.wants_logprobs)} rows")
        raw = _float32(logits[:, : self.vocab_size])
        if meta.all_greedy and not meta.modifies_logits:
            tokens = raw.argmax(dim=-1)
            processed = raw
        else:
            processed = self._process(raw.clone(), meta) if meta.modifies_logits else raw
            tokens = self._pick(processed, meta)
        if meta.processed_logprobs is not None and processed is not raw:  # (`_pick` leaves `processed` as it was)
            raw = torch.where(meta.processed_logprobs.unsqueeze(1), processed, raw)
        return _with_logprobs(raw, tokens, meta)

    @torch.inference_mode()
    def argmax(self, logits: torch.Tensor) -> SamplerOutput:
        """Greedy tokens alone, for rows that ask nothing else: what `__call__` gives for such rows."""
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not cover vocab {self.vocab_size}")
        rows = logits[:, : self.vocab_size]
        if rows.device.type == "cpu":
            # The same indices (the first of tied maxima; a NaN wins), but torch's CPU argmax takes 2-3x as long as
            # max: 2.1 ms against 0.8 for 64 rows of a 49,152-token vocabulary on 2 cores.
            return SamplerOutput(token_ids=rows.max(dim=-1).indices)
        return SamplerOutput(token_ids=rows.argmax(dim=-1))

    @torch.inference_mode()
    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 1-5 alone, on a copy: the logits the greedy argmax sees. For tests and debugging."""
        raw = _float32(logits[:, : self.vocab_size])
        return self._process(raw.clone(), SamplingMetadata.build(rows, self.vocab_size, self.device))

    def _process(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Steps 1-5, in place on the sampler's own copy."""
        if meta.logit_bias is not None:
            bias = meta.logit_bias
            assert bias.values is not None
            logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
        if meta.banned is not None:
            # new_full fills on the device; torch.tensor(-inf, device=cuda) would be a blocking host copy.
            neg_inf = logits.new_full((1,), _NEG_INF)
            logits.index_put_((meta.banned.rows, meta.banned.token_ids), neg_inf)
        if meta.timestamps is not None:
            _on_subset(logits, meta.timestamps, _timestamps_)
        if meta.repetition is not None:
            _on_subset(logits, meta.repetition, _repetition_)
        if meta.presence_frequency is not None:
            _on_subset(logits, meta.presence_frequency, _presence_frequency_)
        if meta.bitmask is not None:
            _on_subset(logits, meta.bitmask, lambda sub, s: logits_transforms.apply_token_bitmask_(sub, s.values[0]))
        if meta.allowed is not None:
            _on_subset(logits, meta.allowed, lambda sub, s: logits_transforms.apply_token_bitmask_(sub, s.values[0]))
        return logits

    def _pick(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Step 6-7: argmax for greedy rows, the filtered exponential race for the others."""
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        x = logits
        if meta.temperature is not None:
            x = x / meta.temperature.unsqueeze(1)
        if meta.top_p is not None or (meta.top_k is not None and meta.top_k_max > _TOPK_WITHOUT_SORT_MAX_K):
            # The quotient is ours to overwrite; `logits` is needed below for the greedy rows.
            own = x if x is not logits else None
            x = logits_transforms.apply_top_k_top_p(
                x, meta.top_k, meta.top_p, drop_mass=meta.drop_mass, out=own, from_candidates=self.cpu_shortcuts
            )
        elif meta.top_k is not None:
            x = logits_transforms.apply_top_k(x, meta.top_k, meta.top_k_max)
        probs = x.softmax(dim=-1)
        if meta.min_p is not None:
            logits_transforms.apply_min_p_(probs, meta.min_p)
        seeded = meta.seeded
        log_uniforms = self._noise.log_uniforms(seeded.keys) if seeded is not None else None
        seeded_rows = seeded.rows if seeded else None
        sampled = logits_transforms.exponential_race(probs, self._generator, log_uniforms, seeded_rows)
        if meta.greedy_mask is None:
            return sampled
        return torch.where(meta.greedy_mask, logits.argmax(dim=-1), sampled)


def _float32(logits: torch.Tensor) -> torch.Tensor:
    """`logits` in float32: itself when it already is (`.float()` would dispatch a no-op)."""
    return logits if logits.dtype == torch.float32 else logits.float()


def _on_subset(logits: torch.Tensor, subset: RowSubset, fn: Callable[[torch.Tensor, RowSubset], None]) -> None:
    """Apply an in-place transform to the subset's rows only (gather, transform, scatter back)."""
    if subset.rows is None:
        fn(logits, subset)
        return
    sub = logits.index_select(0, subset.rows)
    fn(sub, subset)
    logits.index_copy_(0, subset.rows, sub)


def _token_counts(sub: torch.Tensor, subset: RowSubset) -> torch.Tensor:
    """[b, V] float counts of the subset's token lists, by one scatter_add over the flattened tensor."""
    assert subset.token_rows is not None and subset.token_ids is not None
    counts = torch.zeros_like(sub)
    flat = subset.token_rows * sub.shape[1] + subset.token_ids
    counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=sub.dtype))
    return counts


def _timestamps_(sub: torch.Tensor, subset: RowSubset) -> None:
    """Whisper's timestamp rules (`metadata.timestamp_bans`' ranges to -inf), then: where a row's timestamps together
    are likelier than its likeliest other token, its other tokens to -inf (transformers'
    `WhisperTimeStampLogitsProcessor`)."""
    bans, begins = subset.values
    columns = torch.arange(sub.shape[1], device=sub.device)
    banned = ((columns >= bans[:, :, :1]) & (columns < bans[:, :, 1:])).any(dim=1)
    sub.masked_fill_(banned, _NEG_INF)
    timestamp = columns >= begins.unsqueeze(1)
    logprobs = sub.log_softmax(dim=-1)
    timestamps_logprob = logprobs.masked_fill(~timestamp, _NEG_INF).logsumexp(dim=-1)
    best_other = logprobs.masked_fill(timestamp, _NEG_INF).amax(dim=-1)
    sub.masked_fill_(~timestamp & (timestamps_logprob > best_other).unsqueeze(1), _NEG_INF)


def _repetition_(sub: torch.Tensor, subset: RowSubset) -> None:
    logits_transforms.apply_repetition_penalty_(sub, _token_counts(sub, subset) > 0, subset.values[0])


def _presence_frequency_(sub: torch.Tensor, subset: RowSubset) -> None:
    logits_transforms.apply_presence_frequency_(sub, _token_counts(sub, subset), subset.values[0], subset.values[1])


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    if not meta.any_logprobs:
        return SamplerOutput(token_ids=tokens)
    logprobs = raw.log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = max(meta.num_top_logprobs)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    return SamplerOutput(
        token_ids=tokens,
        logprobs=sampled,
        top_token_ids=top_ids,
        top_logprobs=top_values,
        wants_logprobs=meta.wants_logprobs,
        num_top_logprobs=meta.num_top_logprobs,
    )
