"""Qwen4-Exp's per-layer n-gram embeddings (PLE; transformers' `Qwen4ExpTextPLELayer`), added to the residual streams
before some linear-attention layers (`config.Qwen4Exp.ngram_layers`).

Each token's 2- to n-grams (n `ngram_size`: the token and up to n - 1 before it, an end-of-sequence token ending the
context: a position before the last `eos_token_id` reads as that token) are hashed, `heads_per_ngram` ways each:
`t0 * m0 ^ t1 * m1 ^ ...` with the layer's odd multipliers (splitmix64 of its seed), modulo each head's prime table
size (the primes from `ngram_vocab_base` on, numbered across the layers' heads), offset into one table of all heads'
rows. The rows side by side are projected to a value and to one key per stream; each stream's key against the
stream (both normed) gives a signed-square-root gate, the value gated per stream is added together with a depthwise
convolution (`ngram_conv_kernel` taps `ngram_size` positions apart, SiLU) of its normed form.

Each sequence's state (after the linear attention's own in its row, `LinearAttention.extra_state`): the
convolution's last `(taps - 1) * ngram_size` inputs, then its last `ngram_size - 1` token ids (as float32: exact for
ids below 2^24); a fresh sequence starts from zeros and a context of end-of-sequence tokens.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.config import Qwen4Exp
from engine_server.layers.gated_residual import HyperNorm, grouped_rms_norm
from engine_server.parallel.layers import CheckpointTensor, read_whole
from ladle_kernels.kernel_set import KernelOps

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment and mixing constants
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GOLDEN_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ngram_layer: int, seed: int) -> list[int]:
    """The odd multipliers of one n-gram layer's hash (the `ngram_layer`-th such layer), one per position of an
    n-gram, each below 2^63 / `vocab_size` so that a token id times it stays within int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_SEED_STRIDE * ngram_layer
    return [2 * (_splitmix64((base + _GOLDEN_GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % divisor for divisor in range(3, math.isqrt(value) + 1, 2))


def head_table_sizes(base: int, first: int, count: int) -> list[int]:
    """The table sizes of `count` hash heads numbered from `first` across the model: head g's is the (g + 1)-th
    prime at or above `base`."""
    return list(_primes_from(base, first + count)[first:])


@functools.cache
def _primes_from(base: int, count: int) -> tuple[int, ...]:
    """The first `count` primes at or above `base` (each layer's heads continue the numbering: computed once)."""
    primes: list[int] = []
    prime = base - 1
    while len(primes) < count:
        prime += 1
        while not _is_prime(prime):
            prime += 1
        primes.append(prime)
    return tuple(primes)


class NgramTable(nn.Module):
    """All hash heads' rows of one layer (`ple_embedding`), named as checkpoints name it once its shards are joined
    (`ngram_embedding.weight`)."""

    def __init__(self, spec: Qwen4Exp, vocab_size: int, ngram_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        heads = (spec.ngram_size - 1) * spec.heads_per_ngram
        sizes = head_table_sizes(spec.ngram_vocab_base, ngram_layer * heads, heads)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        rows = -(-sum(sizes) // spec.ngram_vocab_divisor) * spec.ngram_vocab_divisor
        self.ngram_embedding = nn.Embedding(rows, spec.ngram_embed_dim // heads, dtype=dtype)
        self.ngram_embedding.weight.requires_grad_(False)
        self.register_buffer("multipliers", torch.tensor(layer_multipliers(
            vocab_size, spec.ngram_size, ngram_layer, spec.ngram_seed)), persistent=False)  # fmt: skip
        self.register_buffer("sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets), persistent=False)
        self.ngram_size, self.heads_per_ngram = spec.ngram_size, spec.heads_per_ngram

    # A checkpoint's hash constants (transformers saves them), checked against those computed from the config.
    own_tensors = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """ValueError unless the checkpoint's `kind` of hash constants equals this layer's."""
        ours = self.get_buffer({"layer_multipliers": "multipliers", "ngram_heads_vocab_sizes": "sizes",
                                "ngram_heads_offsets": "offsets"}[kind])  # fmt: skip
        theirs = read_whole(tensor)
        if theirs.shape != ours.shape or not torch.equal(theirs.to(ours.dtype), ours):
            raise ValueError(f"the checkpoint's {kind} {theirs.tolist()} are not the config's {ours.tolist()}")

    def forward(self, shifted: list[torch.Tensor]) -> torch.Tensor:
        """shifted[s] `[T]` int64: each token's s-th predecessor (EOS past its context; shifted[0] the tokens) ->
        the rows of every head side by side, `[T, ngram_embed_dim]`."""
        multipliers, ids = self.get_buffer("multipliers"), []
        for order in range(2, self.ngram_size + 1):
            mixed = shifted[0] * multipliers[0]
            for back in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[back] * multipliers[back])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            sizes, offsets = self.get_buffer("sizes")[heads], self.get_buffer("offsets")[heads]
            ids.append(torch.remainder(mixed.unsqueeze(-1), sizes) + offsets)
        return self.ngram_embedding(torch.cat(ids, dim=-1)).flatten(1)


class NgramLayer(nn.Module):
    """One layer's n-gram embeddings over the streams (module doc); parameters named as Qwen4-Exp's checkpoints
    name them (`layers.<i>.ple.*`)."""

    def __init__(
        self, spec: Qwen4Exp, hidden: int, vocab_size: int, ngram_layer: int, eps: float, dtype: torch.dtype
    ) -> None:
        super().__init__()
        wide = spec.streams * hidden
        self.streams, self.hidden, self.eps = spec.streams, hidden, eps
        self.ngram_size, self.eos = spec.ngram_size, spec.eos_token_id
        self.history = (spec.ngram_conv_kernel - 1) * spec.ngram_size  # the convolution's rows kept per sequence
        self.ple_embedding = NgramTable(spec, vocab_size, ngram_layer, dtype)
        self.key_proj = nn.Linear(spec.ngram_embed_dim, wide, bias=False, dtype=dtype)
        self.value_proj = nn.Linear(spec.ngram_embed_dim, hidden, bias=False, dtype=dtype)
        self.norm_key, self.norm_query, self.norm_conv = (HyperNorm(wide, dtype) for _ in range(3))
        self.conv1d = nn.Conv1d(wide, wide, spec.ngram_conv_kernel, dilation=spec.ngram_size, groups=wide,
                                bias=False, dtype=dtype)  # fmt: skip
        self.conv1d.weight.requires_grad_(False)

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        state: torch.Tensor,
        slots: list[int],
        fresh: list[bool],
        query_lens: list[int],
        ops: KernelOps,
    ) -> torch.Tensor:
        """What this layer adds to the streams `[T, N * hidden]` of tokens `token_ids` `[T]`, sequence i's
        `query_lens[i]` tokens in turn; its state is row `slots[i]` of `state` (this layer's part of each row, module
        doc), read from zeros where `fresh[i]` and advanced in place. Sigmoids through the kernel set's
        `sigmoid_mul` (row by row on the CPU)."""
        context = self.ngram_size - 1
        shifted = [torch.empty_like(token_ids) for _ in range(self.ngram_size)]
        start = 0
        for slot, is_fresh, count in zip(slots, fresh, query_lens, strict=True):
            ids = token_ids[start : start + count]
            before = (
                ids.new_full((context,), self.eos) if is_fresh
                else state[slot, -context:].to(torch.int64)
            )  # fmt: skip
            history = torch.cat((before, ids))
            for back, rows in enumerate(shifted):
                rows[start : start + count] = self._predecessors(history, back)[context:]
            state[slot, -context:] = history[-context:].to(state.dtype)
            start += count
        embedded = self.ple_embedding(shifted)
        tokens = streams.shape[0]
        keys = grouped_rms_norm(self.key_proj(embedded), self.norm_key.weight, self.streams, self.eps)
        queries = grouped_rms_norm(streams, self.norm_query.weight, self.streams, self.eps)
        value = self.value_proj(embedded)
        gate = (keys.view(tokens, self.streams, -1) * queries.view(tokens, self.streams, -1)).sum(-1, keepdim=True)
        gate = gate / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        shape = (tokens, self.streams, self.hidden)
        gated = ops.sigmoid_mul(value.unsqueeze(1).expand(shape).reshape(-1, self.hidden),
                                gate.expand(shape).reshape(-1, self.hidden)).view(tokens, -1)  # fmt: skip
        normed = grouped_rms_norm(gated, self.norm_conv.weight, self.streams, self.eps)
        convolved = self._convolve(normed, state, slots, fresh, query_lens)
        return gated + ops.sigmoid_mul(convolved, convolved)

    def _predecessors(self, history: torch.Tensor, back: int) -> torch.Tensor:
        """Each position's `back`-th predecessor in `history` `[L]`, or EOS where an EOS lies between (the
        predecessor itself included) or none is there."""
        if back == 0:
            return history
        positions = torch.arange(history.shape[0], device=history.device)
        eos_at = torch.where(history == self.eos, positions, -1)
        last_eos = torch.cat((eos_at.new_full((1,), -1), torch.cummax(eos_at, dim=0).values[:-1]))
        valid = positions - back > last_eos
        return torch.where(valid, history[(positions - back).clamp(min=0)], history.new_full((), self.eos))

    def _convolve(
        self, normed: torch.Tensor, state: torch.Tensor, slots: list[int], fresh: list[bool], query_lens: list[int]
    ) -> torch.Tensor:
        """The dilated depthwise convolution of each sequence's rows `normed` after its kept rows (zeros where
        fresh), the kept rows advanced in place."""
        wide, history = normed.shape[1], self.history
        out, start = torch.empty_like(normed), 0
        for slot, is_fresh, count in zip(slots, fresh, query_lens, strict=True):
            kept = state[slot, : history * wide].view(history, wide)
            before = normed.new_zeros(history, wide) if is_fresh else kept.to(normed.dtype)
            rows = torch.cat((before, normed[start : start + count]))
            out[start : start + count] = F.conv1d(rows.t().unsqueeze(0), self.conv1d.weight, None, 1, 0,
                                                  self.conv1d.dilation, wide)[0].t()  # fmt: skip
            kept.copy_(rows[-history:].float())
            start += count
        return out
