"""The partition arithmetic of tensor parallelism: ranges that tile the weights, and errors that name the numbers."""

from __future__ import annotations

import pytest

from engine_server.parallel.sharding import (
    even_slice,
    gate_up_slices,
    heads_per_rank,
    kv_head_replicas,
    kv_heads_of_rank,
    kv_heads_per_rank,
    qkv_slices,
    query_heads_of_rank,
    vocab_shard,
)


def test_query_heads_tile_the_heads_in_rank_order() -> None:
    assert heads_per_rank(9, 3) == 3
    assert [query_heads_of_rank(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_query_heads_that_do_not_divide_name_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(14\).*size \(4\)"):
        heads_per_rank(14, 4)


@pytest.mark.parametrize(
    ("num_kv_heads", "size", "replicas", "heads"),
    [
        (8, 1, 1, [range(0, 8)]),
        (4, 2, 1, [range(0, 2), range(2, 4)]),
        (3, 3, 1, [range(0, 1), range(1, 2), range(2, 3)]),
        (2, 4, 2, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
        (1, 3, 3, [range(0, 1)] * 3),
    ],
)
def test_kv_heads_split_or_replicate(num_kv_heads: int, size: int, replicas: int, heads: list[range]) -> None:
    assert kv_head_replicas(num_kv_heads, size) == replicas
    assert kv_heads_per_rank(num_kv_heads, size) == len(heads[0])
    assert [kv_heads_of_rank(num_kv_heads, size, r) for r in range(size)] == heads


@pytest.mark.parametrize(("num_kv_heads", "size", "message"), [(4, 3, r"\(4\).*\(3\)"), (2, 3, r"\(3\).*\(2\)")])
def test_kv_heads_that_neither_divide_nor_replicate_evenly_are_refused(
    num_kv_heads: int, size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        kv_head_replicas(num_kv_heads, size)


def test_each_rank_holds_the_kv_heads_its_query_heads_use() -> None:
    for heads, kv_heads, size in [(9, 3, 3), (8, 2, 4), (8, 1, 8), (16, 4, 2), (4, 2, 1)]:
        group = heads // kv_heads
        for rank in range(size):
            q_rows, k_rows, v_rows = qkv_slices(heads, kv_heads, 2, size, rank)
            q_heads = query_heads_of_rank(heads, size, rank)
            assert q_rows.rows == range(q_heads.start * 2, q_heads.stop * 2)
            assert {j // group for j in q_heads} <= set(kv_heads_of_rank(kv_heads, size, rank))
            assert k_rows == v_rows and k_rows.full == kv_heads * 2


def test_qkv_refuses_query_heads_that_are_not_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*num_key_value_heads \(4\)"):
        qkv_slices(6, 4, 8, 2, 0)


def test_gate_and_up_keep_the_same_block_of_intermediate_rows() -> None:
    gate, up = gate_up_slices(12, 3, 2)
    assert gate == up and gate.full == 12 and gate.rows == range(8, 12)
    with pytest.raises(ValueError, match=r"intermediate_size \(10\).*size \(3\)"):
        gate_up_slices(10, 3, 0)


def test_ranks_outside_the_group_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is not in a group of size 2"):
        even_slice(4, 2, 2, "rows")
    with pytest.raises(ValueError, match="rank -1"):
        vocab_shard(10, 2, -1)


@pytest.mark.parametrize(
    ("vocab", "size", "padded", "valid"),
    [
        (10, 1, 10, [10]),
        (11, 2, 12, [6, 5]),
        (10, 3, 12, [4, 4, 2]),
        (4, 3, 6, [2, 2, 0]),
        (49152, 3, 49152, [16384] * 3),
    ],
)
def test_vocab_pads_to_a_multiple_of_the_size_and_masks_only_the_tail(
    vocab: int, size: int, padded: int, valid: list[int]
) -> None:
    shards = [vocab_shard(vocab, size, r) for r in range(size)]
    assert all(s.padded == padded and s.per_rank == padded // size for s in shards)
    assert [s.num_valid for s in shards] == valid
    assert [s.start for s in shards] == [r * padded // size for r in range(size)]
    assert shards[-1].valid_end == vocab
