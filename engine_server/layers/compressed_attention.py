"""DeepSeek-V4's attention (`ModelConfig.compressed_attention`): sliding-window attention over one shared key-value
head, and on a compressing layer compressed entries of earlier positions beside it.

Each token has one key `kv = kv_norm(kv_proj(x))` of `head_dim`, which is also its value, rope turning its last
`rope_dim` dims in interleaved pairs; queries come from a low-rank projection (`q_a_proj`, `q_a_norm`, `q_b_proj`),
each head RMS-normalised without a weight, turned likewise. A query at position p attends over the keys of positions
(p - window, p] and, on a compressing layer of rate m, over entries e < (p + 1) // m (HCA: all of them; CSA: the
`index_topk` its lightning indexer scores highest), with a sink logit per head; the output's rope dims are turned
back by p, and the heads go through `o_groups` grouped projections (`o_a_proj`) and one more (`o_b_proj`).

Entry e pools positions [e m, (e + 1) m): each position's `compressor.kv_proj` and `compressor.gate_proj` rows, the
gate plus `position_bias` of its place in the window softmaxed over the window per dim (float32), weight the rows'
sum; the sum is RMS-normalised (`kv_norm`) and turned by rope at position e m. CSA's projections are twice as wide:
entry e pools the first halves of window e - 1 and the second halves of window e together (2m positions, window -1
absent). Its indexer pools entries of `index_head_dim` the same way (`compressor.indexer.*`) and scores entry e for
query t as `sum_h w[t, h] relu(q[t, h] . k[e]) / sqrt(index_head_dim)`, `w = weights_proj(x) / sqrt(heads)`.
This is transformers' `DeepseekV4Attention` without its cache: each entry is a function of its window's positions.

Everything a token leaves lives in its layer's paged cache row, so prefix caching, preemption, chunked prefill and
the cache's size hold it as they hold K/V (`CacheFields`): its key, its compressor's (and indexer's) raw rows, and
at the last position of each window that window's entry, written once the window closes. Attention runs in torch,
sequence by sequence, over the rows its queries see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import CompressedAttention as Layout
from engine_server.config import ModelConfig

_CHUNK_BYTES = 1 << 26  # the most float32 bytes one group of queries' scores takes (`_query_groups`)


@dataclass(frozen=True)
class Field:
    """Where one kind of per-token data lives in a layer's cache rows: cache half (0 or 1), first dim, width."""

    half: int
    offset: int
    width: int


@dataclass(frozen=True)
class CacheFields:
    """A layer's cache row layout (`CompressedAttention.cache_row` wide, D = head_dim, I = index_head_dim): the key
    `kv` (D); on a compressing layer its window `entry` (D, at a window's last position), the compressor's raw `raw_kv`
    and `raw_gate` rows (D each on HCA, 2D on CSA); on CSA the indexer's `index_entry` (I), `index_kv` and
    `index_gate` (2I each)."""

    kv: Field
    entry: Field | None = None
    raw_kv: Field | None = None
    raw_gate: Field | None = None
    index_entry: Field | None = None
    index_kv: Field | None = None
    index_gate: Field | None = None

    @classmethod
    def of(cls, kind: str, dim: int, index_dim: int) -> CacheFields:
        """The layout of a layer of `kind` ("sliding", "hca" or "csa")."""
        key = Field(0, 0, dim)
        if kind == "sliding":
            return cls(key)
        if kind == "hca":
            return cls(key, Field(0, dim, dim), Field(1, 0, dim), Field(1, dim, dim))
        return cls(
            key, Field(0, dim, dim), Field(0, 2 * dim, 2 * dim), Field(1, 0, 2 * dim),
            Field(1, 2 * dim, index_dim), Field(1, 2 * dim + index_dim, 2 * index_dim),
            Field(1, 2 * dim + 3 * index_dim, 2 * index_dim),
        )  # fmt: skip


def _write(kv_cache: torch.Tensor, field: Field, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` `[N, width]` into `field` of the rows at `slots` `[N]`."""
    flat = kv_cache[field.half].view(-1, kv_cache.shape[-1])
    flat[slots, field.offset : field.offset + field.width] = values.to(flat.dtype)


def _read(kv_cache: torch.Tensor, field: Field, slots: torch.Tensor) -> torch.Tensor:
    """`field` of the rows at `slots` (any shape) -> `[*slots.shape, width]`."""
    flat = kv_cache[field.half].view(-1, kv_cache.shape[-1])
    rows = flat.index_select(0, slots.reshape(-1))[:, field.offset : field.offset + field.width]
    return rows.reshape(*slots.shape, field.width)


def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` in float32, back in x's dtype (transformers' `DeepseekV4RMSNorm`)."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * hidden).to(x.dtype)


class Norm(nn.Module):
    """An RMSNorm with a float32 weight, as `weighted_rms_norm` computes it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weighted_rms_norm(x, self.weight, self.eps)


def turned(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rope_dim: int, inverse: bool = False
           ) -> torch.Tensor:  # fmt: skip
    """x `[T, ..., D]` with its last `rope_dim` dims turned in interleaved pairs by each token's position (`table`
    rows `cat(cos, sin)`, `[max_positions, rope_dim]`), backwards with `inverse`, in float32 (transformers'
    `apply_rotary_pos_emb` of DeepSeek-V4)."""
    rows = table.index_select(0, positions)
    cos, sin = rows.chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    kept, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    first, second = rope[..., 0::2].float(), rope[..., 1::2].float()
    out = torch.stack((first * cos + -second * sin, second * cos + first * sin), dim=-1).flatten(-2)
    return torch.cat((kept, out.to(x.dtype)), dim=-1)


class Pooling(nn.Module):
    """One compressor's pooling of windows (module doc): `kv_proj`, `gate_proj` (`width` = dim, or 2 dim when
    `overlap`: CSA's two series), `position_bias` `[rate, width]` (float32), `kv_norm`."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32), requires_grad=False)
        self.kv_norm = Norm(dim, eps)

    def entries(
        self, raw_kv: torch.Tensor, raw_gate: torch.Tensor, windows: torch.Tensor, table: torch.Tensor, rope_dim: int
    ) -> torch.Tensor:
        """The entries `[N, dim]` of windows `windows` `[N]` (int64) from their positions' raw rows: `raw_kv`,
        `raw_gate` `[N, rate, width]` (their window's), or with `overlap` `[N, 2 rate, width]` (the window before
        theirs, then theirs; the first half of window 0's unread)."""
        dtype, rate, dim = raw_kv.dtype, self.rate, self.dim
        if self.overlap:
            bias = self.position_bias
            kv = torch.cat((raw_kv[:, :rate, :dim], raw_kv[:, rate:, dim:]), dim=1)
            gate = torch.cat((raw_gate[:, :rate, :dim] + bias[:, :dim], raw_gate[:, rate:, dim:] + bias[:, dim:]),
                             dim=1)  # fmt: skip
            # window 0 has no window before it: its first half weighs nothing
            absent = (windows == 0)[:, None, None] & (torch.arange(2 * rate, device=kv.device) < rate)[None, :, None]
            kv, gate = kv.masked_fill(absent, 0.0), gate.masked_fill(absent, float("-inf"))
        else:
            kv, gate = raw_kv, raw_gate + self.position_bias
        pooled = (kv * torch.softmax(gate, dim=1, dtype=torch.float32).to(dtype)).sum(dim=1)
        return turned(self.kv_norm(pooled), windows * rate, table, rope_dim)


class Scorer(nn.Module):
    """The indexer's weight per head (`scorer.weights_proj`)."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False, dtype=dtype)


class Indexer(Pooling):
    """CSA's lightning indexer (`compressor.indexer.*`): its own pooling of index entries, queries from the
    attention's normalised low-rank query (`q_b_proj`) and a weight per head (`scorer.weights_proj`)."""

    def __init__(self, config: ModelConfig, layout: Layout, rate: int, dtype: torch.dtype) -> None:
        super().__init__(config.hidden_size, layout.index_head_dim, rate, True, config.rms_norm_eps, dtype)
        self.heads, self.topk = layout.index_heads, layout.index_topk
        self.q_b_proj = nn.Linear(layout.q_lora_rank, self.heads * self.dim, bias=False, dtype=dtype)
        self.scorer = Scorer(config.hidden_size, self.heads, dtype)


class Compressor(Pooling):
    """A compressing layer's pooling (`compressor.*`), with CSA's indexer."""

    def __init__(self, config: ModelConfig, layout: Layout, kind: str, rate: int, dtype: torch.dtype) -> None:
        super().__init__(config.hidden_size, config.head_dim, rate, kind == "csa", config.rms_norm_eps, dtype)
        self.indexer = Indexer(config, layout, rate, dtype) if kind == "csa" else None


class GroupedLinear(nn.Module):
    """`o_a_proj`: `groups` projections, group g's `[rank, in / groups]` (rows `g rank : (g + 1) rank` of the
    checkpoint's one `weight`: `models.deepseek_v4` splits it) applied to its slice of the input (transformers'
    `DeepseekV4GroupedLinear`). Each is an `nn.Linear` of its own (`parts.<g>`), so quantization takes it as any
    other projection (and its int8 product is the same whatever the batch, which a float `bmm`'s is not)."""

    def __init__(self, in_features: int, groups: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(in_features // groups, rank, bias=False, dtype=dtype)
                                   for _ in range(groups))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` -> `[T, groups * rank]`."""
        slices = x.chunk(len(self.parts), dim=-1)
        return torch.cat([part(piece) for part, piece in zip(self.parts, slices, strict=True)], dim=-1)


class CompressedAttention(nn.Module):
    """Layer `index`'s attention (module doc), parameters named as transformers names them under `self_attn.`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        layout = config.compressed_attention
        assert layout is not None
        self.kind, self.rate, self.window = layout.kinds[index], layout.rates[index], layout.window
        self.heads, self.dim, self.rope_dim, self.eps = (
            config.num_attention_heads, config.head_dim, layout.rope_dim, config.rms_norm_eps
        )
        self.fields = CacheFields.of(self.kind, self.dim, layout.index_head_dim)
        hidden = config.hidden_size
        self.q_a_proj = nn.Linear(hidden, layout.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_norm = Norm(layout.q_lora_rank, self.eps)
        self.q_b_proj = nn.Linear(layout.q_lora_rank, self.heads * self.dim, bias=False, dtype=dtype)
        self.kv_proj = nn.Linear(hidden, self.dim, bias=False, dtype=dtype)
        self.kv_norm = Norm(self.dim, self.eps)
        self.o_a_proj = GroupedLinear(self.heads * self.dim, layout.o_groups, layout.o_lora_rank, dtype)
        self.o_b_proj = nn.Linear(layout.o_groups * layout.o_lora_rank, hidden, bias=False, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32), requires_grad=False)
        self.compressor = None if self.kind == "sliding" else Compressor(config, layout, self.kind, self.rate, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
        meta: AttentionMetadata, ops: object = None, lora: object = None,
    ) -> torch.Tensor:  # fmt: skip
        """hidden `[T, hidden]` -> `[T, hidden]`; writes the step's rows (and the entries of the windows its tokens
        close) first. `table`: this layer's rope rows (the compressing layers' own). It runs in torch whatever the
        kernel set (`ops`), and takes no LoRA adapters (ValueError with any)."""
        if lora is not None:
            raise ValueError("DeepSeek-V4's attention takes no LoRA adapters")
        q_resid = self.q_a_norm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(-1, self.heads, self.dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = turned(q, positions, table, self.rope_dim)
        kv = turned(self.kv_norm(self.kv_proj(hidden)), positions, table, self.rope_dim)
        slots = meta.slot_mapping
        _write(kv_cache, self.fields.kv, slots, kv)
        index_queries = None
        if self.compressor is not None:
            self._write_raw(hidden, kv_cache, slots)
            self._close_windows(positions, kv_cache, table, meta)
            indexer = self.compressor.indexer
            if indexer is not None:
                iq = indexer.q_b_proj(q_resid).view(-1, indexer.heads, indexer.dim)
                weights = indexer.scorer.weights_proj(hidden).float() * indexer.heads**-0.5
                index_queries = (turned(iq, positions, table, self.rope_dim), weights)
        out = self._attend(q, kv_cache, meta, index_queries)
        out = turned(out, positions, table, self.rope_dim, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.reshape(out.shape[0], -1)))

    def _write_raw(self, hidden: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """The step's tokens' compressor (and indexer) projections into their rows."""
        assert self.compressor is not None
        fields, pooling = self.fields, self.compressor
        assert fields.raw_kv is not None and fields.raw_gate is not None
        _write(kv_cache, fields.raw_kv, slots, pooling.kv_proj(hidden))
        _write(kv_cache, fields.raw_gate, slots, pooling.gate_proj(hidden))
        indexer = self.compressor.indexer
        if indexer is not None:
            assert fields.index_kv is not None and fields.index_gate is not None
            _write(kv_cache, fields.index_kv, slots, indexer.kv_proj(hidden))
            _write(kv_cache, fields.index_gate, slots, indexer.gate_proj(hidden))

    def _close_windows(
        self, positions: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Pool the windows the step's tokens close (a token at position p closes one where (p + 1) % rate == 0)
        and write each entry into its last position's row."""
        assert self.compressor is not None
        closing = ((positions + 1) % self.rate == 0).nonzero().flatten()
        if closing.numel() == 0:
            return
        rate, fields = self.rate, self.fields
        windows = (positions.index_select(0, closing) + 1) // rate - 1
        overlap = self.compressor.overlap
        first = (windows - 1 if overlap else windows) * rate
        span = torch.arange(2 * rate if overlap else rate, device=positions.device)
        window_positions = (first[:, None] + span).clamp(min=0)  # window 0's absent half: position 0, unread
        sequences = _token_sequences(meta).index_select(0, closing)
        row_slots = _slots(meta, sequences, window_positions)
        end_slots = meta.slot_mapping.index_select(0, closing)
        assert fields.raw_kv is not None and fields.raw_gate is not None and fields.entry is not None
        entries = self.compressor.entries(
            _read(kv_cache, fields.raw_kv, row_slots), _read(kv_cache, fields.raw_gate, row_slots), windows, table,
            self.rope_dim,
        )  # fmt: skip
        _write(kv_cache, fields.entry, end_slots, entries)
        indexer = self.compressor.indexer
        if indexer is not None:
            assert fields.index_kv is not None and fields.index_gate is not None and fields.index_entry is not None
            index_entries = indexer.entries(
                _read(kv_cache, fields.index_kv, row_slots), _read(kv_cache, fields.index_gate, row_slots), windows,
                table, self.rope_dim,
            )  # fmt: skip
            _write(kv_cache, fields.index_entry, end_slots, index_entries)

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        index_queries: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        """q `[T, H, D]` -> each query's attention output `[T, H, D]` over its window's keys and the entries it sees
        (module doc), sequence by sequence, its queries in groups under `_CHUNK_BYTES`."""
        out = torch.empty_like(q)
        device, rate, window = q.device, self.rate, self.window
        first = 0
        for seq, (count, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            start = length - count
            entries = (length // rate) if rate else 0
            width = window + count - 1 + entries
            step = max(1, _CHUNK_BYTES // (4 * self.heads * max(width, 1)))
            for lo in range(0, count, step):
                hi = min(count, lo + step)
                rows = slice(first + lo, first + hi)
                query_positions = torch.arange(start + lo, start + hi, device=device)
                out[rows] = self._attend_rows(
                    q[rows], kv_cache, meta, seq, query_positions,
                    None if index_queries is None else (index_queries[0][rows], index_queries[1][rows]),
                )  # fmt: skip
            first += count
        return out

    def _attend_rows(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seq: int, query_positions: torch.Tensor,
        index_queries: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:  # fmt: skip
        """Attention of one sequence's consecutive queries `[R, H, D]` at `query_positions` `[R]`."""
        device, rate, window = q.device, self.rate, self.window
        last = int(query_positions[-1])
        low = max(0, int(query_positions[0]) - window + 1)
        key_positions = torch.arange(low, last + 1, device=device)
        sequence = torch.full((1,), seq, dtype=torch.int64, device=device)
        keys = _read(kv_cache, self.fields.kv, _slots(meta, sequence, key_positions[None])[0])
        distance = query_positions[:, None] - key_positions[None, :]
        visible = (distance >= 0) & (distance < window)
        count = (last + 1) // rate if rate else 0
        if count:
            assert self.fields.entry is not None
            ends = torch.arange(count, device=device) * rate + rate - 1
            end_slots = _slots(meta, sequence, ends[None])[0]
            entries = _read(kv_cache, self.fields.entry, end_slots)
            seen = torch.arange(count, device=device)[None, :] < ((query_positions + 1) // rate)[:, None]
            if index_queries is not None:
                assert self.fields.index_entry is not None
                seen = self._chosen(index_queries, _read(kv_cache, self.fields.index_entry, end_slots), seen)
            keys = torch.cat((keys, entries))
            visible = torch.cat((visible, seen), dim=1)
        scores = torch.einsum("rhd,kd->rhk", q, keys.to(q.dtype)) * self.dim**-0.5
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        sinks = self.sinks.to(scores.dtype)[None, :, None].expand(q.shape[0], -1, 1)
        logits = torch.cat((scores, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.einsum("rhk,kd->rhd", probs.to(q.dtype), keys.to(q.dtype))

    def _chosen(
        self, index_queries: tuple[torch.Tensor, torch.Tensor], index_entries: torch.Tensor, seen: torch.Tensor
    ) -> torch.Tensor:
        """The entries each query attends (`[R, N]` bool): the indexer's `topk` best of those it may see (`seen`),
        equal scores taken earliest first (a stable sort: relu's exact zeros tie often on few index heads, and
        `torch.topk` breaks ties by how many rows it is given, so a prompt's token and its decode step would choose
        otherwise)."""
        assert self.compressor is not None and self.compressor.indexer is not None
        indexer = self.compressor.indexer
        queries, weights = index_queries
        scores = torch.relu(torch.matmul(queries.float(), index_entries.float().t())) * indexer.dim**-0.5
        index = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~seen, float("-inf"))  # [R, N]
        picked = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, : indexer.topk]
        chosen = torch.zeros_like(seen).scatter_(1, picked, True)
        return chosen & seen


def _token_sequences(meta: AttentionMetadata) -> torch.Tensor:
    """The sequence of each of the step's tokens, `[T]` int64 on the metadata's device."""
    counts = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(counts)), counts).to(meta.block_tables.device)


def _slots(meta: AttentionMetadata, sequences: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The flat cache slots of `positions` `[N, W]` of `sequences` `[N]` (row n's of sequence n)."""
    blocks = meta.block_tables.index_select(0, sequences).to(torch.int64)
    block_index = positions // meta.block_size
    return blocks.gather(1, block_index) * meta.block_size + positions % meta.block_size
