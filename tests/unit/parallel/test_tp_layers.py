"""Each sharded layer, run on 2 and 3 gloo ranks, equals its unsharded torch reference; at TP=1 it is that reference.

One spawn per world size runs every check in each rank (a failing assert in a rank fails the test with that rank's
traceback). All ranks draw the same full weights from one seeded generator, so each can slice them itself; the
references are nn.Linear / F.embedding over the full tensors. Sums over ranks change the summation order, so the
sharded results are compared with tight float32 tolerances, not bitwise; TP=1 is compared bitwise.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine_server.parallel.group import SINGLE, TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from engine_server.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab,
)
from engine_server.parallel.sharding import kv_heads_of_rank
from tests.unit.parallel.ranks import run_ranks


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 summation order (the reference sums in one GEMM, the ranks in parts)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Unit-scale values: weights of a fan-in `shape[-1]` keep outputs near 1, where the tolerances are tight."""
    return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5


def _check_linear_pair(tp: TensorParallel, gen: torch.Generator) -> None:
    """A plain column-parallel layer feeding a row-parallel one (both with bias), against nn.Linear's F.linear."""
    x, column_w, column_b, row_w, row_b = (
        _randn(gen, 5, 8),
        _randn(gen, 12, 8),
        _randn(gen, 12),
        _randn(gen, 7, 12),
        _randn(gen, 7),
    )
    column = ColumnParallelLinear.from_full(column_w, column_b, tp)
    row = RowParallelLinear.from_full(row_w, row_b, tp)
    with torch.inference_mode():
        hidden, expected_hidden = column(x), F.linear(x, column_w, column_b)
        per_rank = 12 // tp.size
        _close(hidden, expected_hidden[:, tp.rank * per_rank : (tp.rank + 1) * per_rank])
        gathered = tp.gather_last_dim(hidden)
        if tp.is_driver:
            assert gathered is not None
            _close(gathered, expected_hidden)
        else:
            assert gathered is None
        _close(tp.all_reduce_sum(row(hidden)), F.linear(expected_hidden, row_w, row_b))
        assert (row.bias is not None) == tp.is_driver  # the sum adds it once


def _check_mlp(tp: TensorParallel, gen: torch.Generator) -> None:
    """gate/up keep `cat(gate_r, up_r)`, so SwiGLU applies per rank and down's all-reduce completes the block."""
    hidden_size, inter = 8, 12
    x, gate_up_w, down_w = (
        _randn(gen, 4, hidden_size),
        _randn(gen, 2 * inter, hidden_size),
        _randn(gen, hidden_size, inter),
    )
    gate_up = ColumnParallelLinear.gate_up_from_full(gate_up_w, None, inter, tp)
    down = RowParallelLinear.from_full(down_w, None, tp)
    with torch.inference_mode():
        gate, up = gate_up(x).split(gate_up.output_sizes, dim=-1)
        expected_gate, expected_up = F.linear(x, gate_up_w).chunk(2, dim=-1)
        expected = F.linear(F.silu(expected_gate) * expected_up, down_w)
        _close(tp.all_reduce_sum(down(F.silu(gate) * up)), expected)


def _check_attention_projections(
    tp: TensorParallel, gen: torch.Generator, heads: int, kv_heads: int, head_dim: int, hidden_size: int
) -> None:
    """QKV (with Qwen2's bias) split by heads: over the ranks, the q slices tile q and each rank's k/v are the full
    k/v's heads that rank holds (replicated when there are more ranks than KV heads); O's all-reduce is o_proj."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    x = _randn(gen, 3, hidden_size)
    weight, bias, o_weight = (
        _randn(gen, q_size + 2 * kv_size, hidden_size),
        _randn(gen, q_size + 2 * kv_size),
        _randn(gen, hidden_size, q_size),
    )
    qkv = ColumnParallelLinear.qkv_from_full(weight, bias, heads, kv_heads, head_dim, tp)
    o_proj = RowParallelLinear.from_full(o_weight, None, tp)
    with torch.inference_mode():
        full_q, full_k, full_v = F.linear(x, weight, bias).split([q_size, kv_size, kv_size], dim=-1)
        local = qkv(x)
        gathered = tp.gather_last_dim(local)
        # o_proj over this rank's q heads stands in for attention's output, which has q's layout.
        _close(tp.all_reduce_sum(o_proj(local.split(qkv.output_sizes, -1)[0])), F.linear(full_q, o_weight))
    if gathered is None:
        return
    by_rank = [part.split(qkv.output_sizes, dim=-1) for part in gathered.split(local.shape[-1], dim=-1)]
    _close(torch.cat([q for q, _, _ in by_rank], -1), full_q)
    for rank, (_, k, v) in enumerate(by_rank):
        held = kv_heads_of_rank(kv_heads, tp.size, rank)
        rows = slice(held.start * head_dim, held.stop * head_dim)
        _close(k, full_k[:, rows])
        _close(v, full_v[:, rows])
    if kv_heads >= tp.size:
        _close(torch.cat([k for _, k, _ in by_rank], -1), full_k)


def _check_vocab(tp: TensorParallel, gen: torch.Generator, vocab: int) -> None:
    """Embedding rows and LM-head logits over a vocabulary padded up to a multiple of the size (odd tails)."""
    table, hidden = _randn(gen, vocab, 6), _randn(gen, 4, 6)
    ids = torch.tensor([0, vocab - 1, *range(vocab)])
    embedding = VocabParallelEmbedding.from_full(table, tp)
    head, tied = ParallelLMHead.from_full(table, tp), ParallelLMHead.tied_to(embedding)
    assert tied.weight is embedding.weight and not embedding.weight[embedding.shard.num_valid :].any()
    with torch.inference_mode():
        _close(embedding(ids), F.embedding(ids, table))
        for lm_head in (head, tied):
            logits = gather_vocab(lm_head(hidden), lm_head.shard, tp)
            if tp.is_driver:
                assert logits is not None and logits.shape == (4, vocab) and logits.is_contiguous()
                _close(logits, F.linear(hidden, table))
            else:
                assert logits is None


def _all_checks(tp: TensorParallel) -> None:
    gen = torch.Generator().manual_seed(26)
    _check_linear_pair(tp, gen)
    _check_mlp(tp, gen)
    if tp.size == 2:
        for heads, kv_heads in [(4, 1), (4, 2), (8, 4)]:  # 2 ranks per KV head; one each; two each
            _check_attention_projections(tp, gen, heads, kv_heads, 4, 16)
        vocabs = [11, 2]
    else:
        _check_attention_projections(tp, gen, 9, 3, 64, 576)  # SmolLM2-135M, the embedded model
        _check_attention_projections(tp, gen, 6, 1, 4, 16)  # one KV head on all 3 ranks
        vocabs = [10, 4]  # padded to 12 and to 6 (the last rank holds only padding)
    for vocab in vocabs:
        _check_vocab(tp, gen, vocab)


def _rank_main(rank: int, size: int, init_method: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method, torch.device("cpu"), timeout=timedelta(seconds=60))
    try:
        _all_checks(tp)
    finally:
        destroy_tensor_parallel(tp)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_sharded_layers_equal_the_unsharded_references(size: int, tmp_path: Path) -> None:
    run_ranks(_rank_main, (size, f"file://{tmp_path / 'rendezvous'}"), size)


def _second_rank(rank: int, init_method: str) -> None:
    tp = init_tensor_parallel(1, 2, init_method, torch.device("cpu"), timeout=timedelta(seconds=60))
    try:
        tp.all_reduce_sum(torch.ones(3))
    finally:
        destroy_tensor_parallel(tp)


@pytest.mark.timeout(120)
def test_a_failed_join_leaves_the_process_free_to_join_its_next_group(tmp_path: Path) -> None:
    """A join whose peers never come fails after its timeout, and this process then leads a new group with a fresh
    worker (torch.distributed names groups by a count a failed join would leave raised: the two ranks would look
    for each other under different keys and wait until their timeout)."""
    with pytest.raises(Exception, match=r"(?i)time.?out"):
        init_tensor_parallel(0, 2, f"file://{tmp_path / 'deserted'}", torch.device("cpu"), timedelta(seconds=1))
    assert not torch.distributed.is_initialized()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    worker = mp.get_context("forkserver").Process(target=_second_rank, args=(1, init_method))
    worker.start()
    tp = init_tensor_parallel(0, 2, init_method, torch.device("cpu"), timeout=timedelta(seconds=60))
    try:
        assert torch.equal(tp.all_reduce_sum(torch.ones(3)), torch.full((3,), 2.0))
    finally:
        destroy_tensor_parallel(tp)
        worker.join(30)
    assert worker.exitcode == 0


def test_at_size_one_every_layer_is_the_unsharded_op_bitwise() -> None:
    gen = torch.Generator().manual_seed(1)
    x, ids = _randn(gen, 5, 16), torch.tensor([0, 3, 10, 10])
    qkv_w, qkv_b, o_w, table = _randn(gen, 64, 16), _randn(gen, 64), _randn(gen, 16, 32), _randn(gen, 11, 16)
    qkv = ColumnParallelLinear.qkv_from_full(qkv_w, qkv_b, 4, 2, 8, SINGLE)
    assert qkv.output_sizes == (32, 16, 16)
    with torch.inference_mode():
        assert torch.equal(qkv(x), F.linear(x, qkv_w, qkv_b))
        assert torch.equal(
            RowParallelLinear.from_full(o_w, None, SINGLE)(x[:, :8].repeat(1, 4)), F.linear(x[:, :8].repeat(1, 4), o_w)
        )
        assert torch.equal(VocabParallelEmbedding.from_full(table, SINGLE)(ids), F.embedding(ids, table))
        head = ParallelLMHead.from_full(table, SINGLE)
        logits = gather_vocab(head(x), head.shard, SINGLE)
        assert logits is not None and torch.equal(logits, F.linear(x, table))
    assert all(isinstance(layer, torch.nn.Linear) for layer in (qkv, head))  # packing and quantization swap them
    y = torch.ones(3)
    assert SINGLE.all_reduce_sum(y) is y and SINGLE.gather_last_dim(y) is y


def test_loading_refuses_shapes_that_are_neither_the_full_tensor_nor_this_ranks_slice() -> None:
    layer = ColumnParallelLinear.gate_up_from_full(torch.zeros(8, 4), None, 4, SINGLE)
    with pytest.raises(ValueError, match="part 1 has 3 along dim 0: expected the full 4"):
        layer.load_part(1, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="part 0: a 1-D tensor is neither the weight nor a bias"):
        layer.load_part(0, torch.zeros(4))
    row = RowParallelLinear.from_full(torch.zeros(4, 6), torch.zeros(4), SINGLE)
    row.load(torch.ones(4))
    assert row.bias is not None and torch.equal(row.bias, torch.ones(4))
    with pytest.raises(ValueError, match=r"tensor has shape \(5,\), expected \(4,\)"):
        row.load(torch.ones(5))
    with pytest.raises(ValueError, match="fused weight has 8 rows"):
        ColumnParallelLinear.from_full_fused(torch.zeros(8, 4), None, layer.parts[:1])
    with pytest.raises(ValueError, match="needs a process group"):
        TensorParallel(rank=0, size=2)
