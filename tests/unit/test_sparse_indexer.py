"""DeepSeek Sparse Attention's reads of the paged cache (`layers.sparse_indexer`) against its formula written out over
each sequence's positions: the indexer's choice, and latent attention over what it chose, on a float cache and on
an FP8 one (whose formula reads the same rows decoded)."""

from __future__ import annotations

import pytest
import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.layers import sparse_indexer
from engine_server.layers.sparse_indexer import attend_positions, select_positions
from ladle_kernels.reference import fp8_kv_rows, fp8_kv_values, write_kv_cache

BLOCK, ROW, RANK, ROPE, INDEX_DIM, INDEX_HEADS, HEADS, TOPK = 4, 20, 12, 4, 8, 3, 2, 6
SEQ_LENS = [23, 7, 9, 15]
STEPS = {  # each sequence's new tokens
    "mixed": [5, 1, 9, 1],  # a chunk after cached context, decode rows, a whole prompt
    "decode": [1, 1, 1, 1],
}


def _step(query_lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """(metadata with scattered block tables, each new token's position, every position's slot per sequence)."""
    order = torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()
    tables, used = [], 0
    for length in SEQ_LENS:
        blocks = -(-length // BLOCK)
        tables.append(order[used : used + blocks])
        used += blocks
    meta = AttentionMetadata.build(query_lens, SEQ_LENS, tables, BLOCK, "cpu")
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, SEQ_LENS, strict=True)])
    slots = torch.cat([torch.tensor(t).repeat_interleave(BLOCK) * BLOCK + torch.arange(len(t) * BLOCK) % BLOCK
                       for t in tables])  # fmt: skip
    return meta, positions, slots


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "a-row-a-group"])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("cache_dtype", ["float", "fp8"])
def test_the_chosen_positions_and_their_attention_follow_the_formula(
    cache_dtype: str, step: str, grouped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row's choice and attention as the formula gives them, whether the rows are grouped (decode rows of
    several sequences in one batch, a sequence's new tokens in one) or, with room for one row's work alone, each row
    a group of its own."""
    if not grouped:
        monkeypatch.setattr(sparse_indexer, "_CHUNK_BYTES", 1)
    torch.manual_seed(0)
    query_lens = STEPS[step]
    meta, positions, slots = _step(query_lens)
    every = sum(-(-s // BLOCK) * BLOCK for s in SEQ_LENS)
    keys, values = torch.randn(every, 1, ROW), torch.randn(every, 1, ROW)
    fp8 = cache_dtype == "fp8"
    cache = torch.zeros(2, 32, BLOCK, 1, ROW + 4 if fp8 else ROW, dtype=torch.uint8 if fp8 else torch.float32)
    write_kv_cache(keys, values, cache, slots)
    if fp8:  # the formula reads what the cache holds
        keys, values = fp8_kv_values(fp8_kv_rows(keys)), fp8_kv_values(fp8_kv_rows(values))
    tokens = sum(query_lens)
    queries, weights = torch.randn(tokens, INDEX_HEADS, INDEX_DIM), torch.randn(tokens, INDEX_HEADS)
    q = torch.randn(tokens, HEADS, RANK + ROPE)

    chosen = select_positions(queries, weights, positions, cache, meta, RANK, TOPK)
    out = attend_positions(q, cache, meta, chosen, 0.3, RANK)

    # each sequence's first row of `keys`, whose rows are its positions' (its last block's padding too)
    starts = [sum(-(-s // BLOCK) * BLOCK for s in SEQ_LENS[:i]) for i in range(len(SEQ_LENS))]
    row = 0
    for seq, (count, length) in enumerate(zip(query_lens, SEQ_LENS, strict=True)):
        mine_k, mine_v = keys[starts[seq] : starts[seq] + length, 0], values[starts[seq] : starts[seq] + length, 0]
        for t in range(row, row + count):
            visible = int(positions[t]) + 1
            index_keys = mine_v[:visible, RANK : RANK + INDEX_DIM]
            scores = (weights[t, :, None] * torch.relu(queries[t] @ index_keys.T * INDEX_DIM**-0.5)).sum(0)
            expected = set(scores.topk(min(TOPK, visible)).indices.tolist())
            assert set(chosen[t][chosen[t] >= 0].tolist()) == expected
            picked = torch.tensor(sorted(expected))
            attention = torch.softmax(q[t] @ mine_k[picked, : RANK + ROPE].T * 0.3, dim=-1)
            torch.testing.assert_close(out[t], attention @ mine_v[picked, :RANK], rtol=1e-5, atol=1e-5)
        row += count
