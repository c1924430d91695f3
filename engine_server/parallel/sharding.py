"""The partition arithmetic of tensor parallelism, as pure functions of sizes and ranks.

Which rows of each weight a rank keeps: query heads, KV heads (replicated when there are more ranks than KV
heads, as vLLM does), the MLP's intermediate rows and the vocabulary (padded to a multiple of the group size).
Every function raises ValueError naming the numbers that do not divide. Ranges are of rows within one part of a
weight (`q`, `k`, `v`, `gate`, `up`), in the order the unsharded layers lay the part out.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class PartSlice:
    """One part of a fused weight (`full` rows of it), of which this rank keeps `rows` (relative to the part)."""

    full: int
    rows: range


def check_rank(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is not in a group of size {size}")


def split_evenly(total: int, size: int, what: str) -> int:
    """`total / size`, refusing a remainder: `what` names the quantity in the error."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    if total % size:
        raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel size ({size})")
    return total // size


def even_slice(total: int, size: int, rank: int, what: str) -> PartSlice:
    """Rank `rank`'s contiguous `total / size` rows of a part split evenly."""
    check_rank(rank, size)
    per_rank = split_evenly(total, size, what)
    return PartSlice(total, range(rank * per_rank, (rank + 1) * per_rank))


def heads_per_rank(num_attention_heads: int, size: int) -> int:
    """Query heads on each rank; they never replicate."""
    return split_evenly(num_attention_heads, size, "num_attention_heads")


def kv_head_replicas(num_kv_heads: int, size: int) -> int:
    """How many ranks hold each KV head: 1 when `size` divides them, `size / num_kv_heads` when it exceeds them."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    if size <= num_kv_heads:
        split_evenly(num_kv_heads, size, "num_key_value_heads")
        return 1
    if size % num_kv_heads:
        raise ValueError(
            f"the tensor-parallel size ({size}) exceeds num_key_value_heads ({num_kv_heads}) and must then be a "
            "multiple of it, so that each KV head is replicated on the same number of ranks"
        )
    return size // num_kv_heads


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads on each rank (and in its KV cache): `num_kv_heads / size`, at least 1 (a replicated head)."""
    return 1 if kv_head_replicas(num_kv_heads, size) > 1 else num_kv_heads // size


def kv_heads_of_rank(num_kv_heads: int, size: int, rank: int) -> range:
    """The KV heads rank `rank` holds: its own block of them, or the one head it replicates (rank // replicas)."""
    check_rank(rank, size)
    replicas = kv_head_replicas(num_kv_heads, size)
    if replicas > 1:
        head = rank // replicas
        return range(head, head + 1)
    per_rank = num_kv_heads // size
    return range(rank * per_rank, (rank + 1) * per_rank)


def heads_rows(heads: range, total_heads: int, per_head: int) -> PartSlice:
    """The rows of `heads` in a part laid out head by head, `per_head` rows each, `total_heads` heads in all."""
    return PartSlice(total_heads * per_head, range(heads.start * per_head, heads.stop * per_head))


def query_heads_of_rank(num_attention_heads: int, size: int, rank: int) -> range:
    check_rank(rank, size)
    per_rank = heads_per_rank(num_attention_heads, size)
    return range(rank * per_rank, (rank + 1) * per_rank)


def qkv_slices(
    num_attention_heads: int, num_kv_heads: int, head_dim: int, size: int, rank: int
) -> tuple[PartSlice, PartSlice, PartSlice]:
    """The rows of `q`, `k` and `v` (in `cat(q, k, v)`) that rank `rank` keeps.

    A rank's query heads only ever attend to the KV heads it holds: query head `j` uses KV head
    `j // (num_attention_heads / num_kv_heads)`, and both partitions advance by the same fraction per rank.
    """
    if num_attention_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    q_heads = query_heads_of_rank(num_attention_heads, size, rank)
    kv_heads = kv_heads_of_rank(num_kv_heads, size, rank)
    kv = heads_rows(kv_heads, num_kv_heads, head_dim)
    return heads_rows(q_heads, num_attention_heads, head_dim), kv, kv


def gate_up_slices(intermediate_size: int, size: int, rank: int) -> tuple[PartSlice, PartSlice]:
    """The rows of `gate` and `up` (in `cat(gate, up)`) that rank `rank` keeps: the same block of each."""
    part = even_slice(intermediate_size, size, rank, "intermediate_size")
    return part, part


def check_shardable(
    query_heads: Collection[int], num_kv_heads: int, mlp_widths: dict[str, int], size: int
) -> None:
    """ValueError (naming the numbers) unless a model of these sizes splits over `size` ranks: its attention layers'
    query heads (each count its layers have beside `num_kv_heads`; none in a model of states alone), and the
    intermediate width of each kind of MLP it has (`ModelConfig.mlp_widths`: dense, experts, shared expert)."""
    for num_attention_heads in query_heads:
        qkv_slices(num_attention_heads, num_kv_heads, 1, size, 0)
    for name, width in mlp_widths.items():
        split_evenly(width, size, name)


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows `[start, start + per_rank)` of the vocabulary padded to `padded` rows.

    Only `[start, valid_end)` are real tokens; the rest (on the last ranks only) is padding, zero in the embedding
    and dropped from the logits.
    """

    vocab_size: int
    padded: int
    per_rank: int
    start: int

    @property
    def valid_end(self) -> int:
        """One past the last real token id this rank holds (`start` when it holds only padding)."""
        return max(self.start, min(self.start + self.per_rank, self.vocab_size))

    @property
    def num_valid(self) -> int:
        return self.valid_end - self.start


def vocab_shard(vocab_size: int, size: int, rank: int) -> VocabShard:
    """Rank `rank`'s block of the vocabulary padded up to a multiple of `size`."""
    check_rank(rank, size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    padded = -(-vocab_size // size) * size
    per_rank = padded // size
    return VocabShard(vocab_size=vocab_size, padded=padded, per_rank=per_rank, start=rank * per_rank)
