"""The CPU kernel set: the C++ decode attention against `ladle_kernels.reference.paged_attention`, its input checks,
and the engine's dispatch to it."""

from __future__ import annotations

import fcntl
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.layers.kernel_choice import select_ops
from ladle_kernels import cpu_ops as cpu
from ladle_kernels import reference
from ladle_kernels.kernel_set import REFERENCE_OPS, KernelOps

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # q, cache, block tables, lengths
TOLERANCE: dict[str, Any] = dict(atol=2e-5, rtol=1e-5)


def make_batch(
    spec: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q `[T, H, D]`, a random float32 cache (unused slots random too) and the metadata for `spec`
    ((query_len, seq_len) per sequence), blocks drawn from a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-seq_len // block_size) for _, seq_len in spec]
    num_blocks = sum(blocks) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in blocks]
    meta = AttentionMetadata.build([q for q, _ in spec], [s for _, s in spec], tables, block_size, "cpu")
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen)
    return q, cache, meta


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (14, 2, 64), (16, 8, 128), (4, 4, 256), (12, 1, 32), (4, 2, 16), (8, 1, 512), (16, 1, 576)],
)
@pytest.mark.parametrize("block_size", [16, 32, 5])
def test_decode_rows_match_the_reference(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    """GQA groups of 1 to 16 (more than the 8 heads the kernel holds at once), head dims up to DeepSeek's latent
    rows (576, summed in passes that divide it), lengths of 1, within a vector, a vector and one more, and several
    blocks; block sizes that are and are not multiples of 16."""
    spec = [(1, n) for n in (1, 2, 15, 16, 17, 31, 64, 100, 257)]
    q, cache, meta = make_batch(spec, heads, kv_heads, head_dim, block_size, seed=heads + head_dim + block_size)
    scale = head_dim**-0.5
    torch.testing.assert_close(
        cpu.paged_attention(q, cache, meta, scale), reference.paged_attention(q, cache, meta, scale), **TOLERANCE
    )


@needs_kernels
def test_peaked_softmax_matches_the_reference() -> None:
    """Scores spread over hundreds of nats: exp underflows to 0 for most keys and must still sum right."""
    q, cache, meta = make_batch([(1, 300), (1, 40)], 8, 2, 64, 16, seed=7)
    q = q * 40
    torch.testing.assert_close(
        cpu.paged_attention(q, cache, meta, 0.125), reference.paged_attention(q, cache, meta, 0.125), **TOLERANCE
    )


@needs_kernels
def test_mixed_batches_run_decode_rows_in_the_kernel_and_prefills_in_the_reference() -> None:
    spec = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 40), (1, 33), (23, 60)]
    q, cache, meta = make_batch(spec, 6, 2, 64, 16, seed=3)
    torch.testing.assert_close(
        cpu.paged_attention(q, cache, meta, 0.125), reference.paged_attention(q, cache, meta, 0.125), **TOLERANCE
    )


@needs_kernels
def test_attention_by_token_matches_the_reference_and_ignores_how_a_prompt_was_split() -> None:
    spec = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 40), (23, 60)]
    q, cache, meta = make_batch(spec, 9, 3, 64, 16, seed=4)
    whole = cpu.paged_attention_by_token(q, cache, meta, 0.125)
    torch.testing.assert_close(whole, reference.paged_attention(q, cache, meta, 0.125), **TOLERANCE)
    tables, lens = meta.token_rows
    assert lens.tolist() == [1, 1, 2, 3, 4, 5, 9, 8, 9, 10, 17, *range(34, 41), *range(38, 61)]
    assert torch.equal(tables[7], meta.block_tables[3])
    # The last sequence's 23 tokens as a cached 20-token context plus 3 new ones, alone: the same bits.
    last = q[-23:]
    tail = AttentionMetadata.build([3], [60], [meta.block_tables[-1].tolist()], 16, "cpu")
    assert torch.equal(cpu.paged_attention_by_token(last[-3:], cache, tail, 0.125), whole[-3:])


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (16, 8, 128), (4, 2, 16)])
def test_rows_of_one_sequence_attended_together_give_each_row_alone_bit_for_bit(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """Consecutive rows with one block table share their key and value reads (groups of up to 16, cut to give
    every thread work); each row's result must still be what the row alone gives, bit for bit, for any thread
    count: a token's result never depends on its batch (the quantized path's promise, and drafts' verification)."""
    spec = [(1, 7), (40, 300), (9, 120), (1, 50), (2, 2), (33, 33)]
    q, cache, meta = make_batch(spec, heads, kv_heads, head_dim, 16, seed=heads)
    tables, lens = meta.token_rows
    alone = torch.cat(
        [cpu.paged_decode_attention(q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], 0.125) for i in
         range(q.shape[0])]
    )
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(cpu.paged_decode_attention(q, cache, tables, lens, 0.125), alone), count
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(alone, reference.paged_attention(q, cache, meta, 0.125), **TOLERANCE)


@needs_kernels
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (13, 0.0), (0, 5.0), (29, 5.0)])
def test_rows_of_one_sequence_in_any_order_give_each_row_alone_bit_for_bit(window: int, softcap: float) -> None:
    """Rows of one block table whose lengths come in any order (a group's tiles run from its earliest position to
    its latest, each row masking the positions that are not its own): every row is the same bits as alone,
    windowed and soft-capped too."""
    generator = torch.Generator().manual_seed(window)
    lens = (torch.randperm(70, generator=generator)[:24] + 1).to(torch.int32)
    _, cache, meta = make_batch([(1, 80)], 9, 3, 64, 16, seed=window)
    q = torch.randn(lens.numel(), 9, 64, generator=generator)
    tables = meta.block_tables[:1].expand(lens.numel(), -1).contiguous()
    together = cpu.paged_decode_attention(q, cache, tables, lens, 0.125, window, softcap)
    for i in range(lens.numel()):
        alone = cpu.paged_decode_attention(q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], 0.125, window,
                                           softcap)
        assert torch.equal(together[i : i + 1], alone), i


@needs_kernels
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
def test_a_sliding_window_matches_the_reference_and_keeps_rows_independent(window: int) -> None:
    """Windows of one token, within a block, a block, several blocks and wider than every sequence: the decode
    kernel (by row, and by token for prompts) matches the reference's windowed attention, and a row attended
    with others of its sequence (whose windows start elsewhere) is the same bits as alone."""
    spec = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 40), (1, 33), (23, 60), (1, 257)]
    q, cache, meta = make_batch(spec, 9, 3, 64, 16, seed=window)
    expected = reference.paged_attention(q, cache, meta, 0.125, window)
    torch.testing.assert_close(cpu.paged_attention(q, cache, meta, 0.125, window), expected, **TOLERANCE)
    torch.testing.assert_close(cpu.paged_attention_by_token(q, cache, meta, 0.125, window), expected, **TOLERANCE)
    tables, lens = meta.token_rows
    together = cpu.paged_decode_attention(q, cache, tables, lens, 0.125, window)
    alone = torch.cat([cpu.paged_decode_attention(q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], 0.125,
                                                  window) for i in range(q.shape[0])])
    assert torch.equal(together, alone)
    if window >= 257:  # wider than every sequence: no different from no window
        assert torch.equal(together, cpu.paged_decode_attention(q, cache, tables, lens, 0.125))


@needs_kernels
@pytest.mark.parametrize("window", [0, 7])
def test_soft_capped_scores_match_the_reference(window: int) -> None:
    """Gemma 2's soft-capping (a cap of 0.3 bends most of these scores): the decode kernel by row and by token
    matches the reference, with and without a window, and the cap changes the result."""
    spec = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 40), (1, 257)]
    q, cache, meta = make_batch(spec, 9, 3, 64, 16, seed=3)
    expected = reference.paged_attention(q, cache, meta, 0.125, window, 0.3)
    torch.testing.assert_close(cpu.paged_attention(q, cache, meta, 0.125, window, 0.3), expected, **TOLERANCE)
    torch.testing.assert_close(cpu.paged_attention_by_token(q, cache, meta, 0.125, window, 0.3), expected, **TOLERANCE)
    uncapped = cpu.paged_attention(q, cache, meta, 0.125, window)
    assert (uncapped - expected).abs().max() > 1e-2


@needs_kernels
@pytest.mark.parametrize(("window", "sink_scale"), [(0, 1.0), (7, 1.0), (0, 30.0), (7, -30.0)])
def test_attention_sinks_match_the_reference(window: int, sink_scale: float) -> None:
    """gpt-oss's sink logits, of the scores' size and far above and below them: the decode kernel by row and by
    token matches the reference (a sink far above every score leaves almost nothing: the ratio must still be
    right), with and without a window; sinks change the result, and each row is the same bits as alone."""
    spec = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 40), (1, 257)]
    q, cache, meta = make_batch(spec, 9, 3, 64, 16, seed=5)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(1)) * sink_scale
    expected = reference.paged_attention(q, cache, meta, 0.125, window, 0.0, sinks)
    got = cpu.paged_attention(q, cache, meta, 0.125, window, 0.0, sinks)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    by_token = cpu.paged_attention_by_token(q, cache, meta, 0.125, window, 0.0, sinks)
    torch.testing.assert_close(by_token, expected, **TOLERANCE)
    if sink_scale > 0:
        assert (cpu.paged_attention(q, cache, meta, 0.125, window) - expected).abs().max() > 1e-2
    tables, lens = meta.token_rows
    alone = torch.cat([cpu.paged_decode_attention(q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], 0.125,
                                                  window, 0.0, sinks) for i in range(q.shape[0])])  # fmt: skip
    assert torch.equal(by_token, alone)


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "slopes_of"), [
    (9, 3, 64, "bloom"), (4, 4, 16, "mpt"), (16, 16, 128, "bloom"), (6, 2, 32, "mpt"),
])  # fmt: skip
def test_alibi_matches_the_reference_every_token_a_row_of_its_own(
    heads: int, kv_heads: int, head_dim: int, slopes_of: str
) -> None:
    """BLOOM's and MPT's ALiBi slopes (a head's bias `slope * (j - p)`) in the decode kernel, prompt tokens and
    decode rows alike: the reference's result (sequence by sequence in torch), each token the same bits as alone;
    the bias changes the result. Falcon-RW's bfloat16 bias stays the reference's."""
    from engine_server.layers.alibi import alibi_slopes

    spec = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 40), (1, 257)]
    q, cache, meta = make_batch(spec, heads, kv_heads, head_dim, 16, seed=heads + head_dim)
    slopes = alibi_slopes(slopes_of, heads, 8.0)
    expected = reference.alibi_attention(q, cache, meta, 0.125, slopes)
    got = cpu.alibi_attention(q, cache, meta, 0.125, slopes)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    assert (cpu.paged_attention_by_token(q, cache, meta, 0.125) - expected).abs().max() > 1e-2
    tables, lens = meta.token_rows
    alone = torch.cat([cpu.paged_decode_attention(q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], 0.125,
                                                  alibi_slopes=slopes) for i in range(q.shape[0])])  # fmt: skip
    assert torch.equal(got, alone)
    decode = AttentionMetadata.build([1] * 3, [9, 40, 257], [meta.block_tables[i].tolist() for i in (2, 5, 6)], 16,
                                     "cpu")  # fmt: skip
    rows = q[[6, 17, 18]]  # the last token of those sequences, as decode rows
    torch.testing.assert_close(cpu.alibi_attention(rows, cache, decode, 0.125, slopes),
                               reference.alibi_attention(rows, cache, decode, 0.125, slopes), **TOLERANCE)  # fmt: skip
    falcon = reference.alibi_attention(q, cache, meta, 0.125, slopes, True)
    assert torch.equal(cpu.alibi_attention(q, cache, meta, 0.125, slopes, True), falcon)


@needs_kernels
def test_alibi_slopes_of_the_wrong_shape_are_refused() -> None:
    q, cache, meta = make_batch([(1, 20)], 4, 2, 64, 16)
    for slopes in (torch.zeros(3), torch.zeros(4, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match=r"alibi_slopes must be \[H\] float32"):
            cpu.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125, alibi_slopes=slopes)


@needs_kernels
def test_sinks_of_the_wrong_shape_are_refused() -> None:
    q, cache, meta = make_batch([(1, 20)], 4, 2, 64, 16)
    for sinks in (torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(4, 2)):
        with pytest.raises(RuntimeError, match=r"sinks must be \[H\] float32"):
            cpu.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125, 0, 0.0, sinks)


@needs_kernels
@pytest.mark.parametrize("window", [0, 70])
def test_slots_past_a_sequence_and_before_its_window_are_never_read(window: int) -> None:
    """The kernel scores whole tiles of 64 positions and masks what is not a row's: NaN in every cache slot outside
    the rows' positions (a block's tail past the longest row, the blocks before the earliest window) changes
    nothing, bit for bit, for rows alone and together."""
    spec = [(1, 100), (1, 300), (30, 150)]
    q, cache, meta = make_batch(spec, 9, 3, 64, 16, seed=window)
    tables, lens = meta.token_rows
    poisoned = cache.clone()
    for table, length in zip(meta.block_tables.tolist(), meta.seq_lens.tolist(), strict=True):
        slots = [table[p // 16] * 16 + p % 16 for p in range(-(-length // 16) * 16)]
        first = max(0, length - 30 - window) if window else length  # every row of a sequence starts after this
        outside = slots[length:] + slots[: min(first, length)] if window else slots[length:]
        poisoned.view(2, -1, 3, 64)[:, outside] = float("nan")
    clean = cpu.paged_decode_attention(q, cache, tables, lens, 0.125, window)
    assert torch.equal(cpu.paged_decode_attention(q, poisoned, tables, lens, 0.125, window), clean)
    assert not clean.isnan().any()
    torch.testing.assert_close(clean, reference.paged_attention(q, cache, meta, 0.125, window), **TOLERANCE)


def test_other_dtypes_and_head_dims_fall_back_to_the_reference() -> None:
    q, cache, meta = make_batch([(1, 20), (4, 9)], 4, 2, 24, 16)
    torch.testing.assert_close(cpu.paged_attention(q, cache, meta, 0.2), reference.paged_attention(q, cache, meta, 0.2))
    q, cache, meta = make_batch([(1, 20)], 4, 2, 64, 16)
    q, cache = q.to(torch.bfloat16), cache.to(torch.bfloat16)
    torch.testing.assert_close(cpu.paged_attention(q, cache, meta, 0.2), reference.paged_attention(q, cache, meta, 0.2))


def fp8_cache_of(cache: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """`cache`'s rows, each scaled by its own magnitude from 1e-3 to 4, as an FP8 cache (`reference.fp8_kv_rows`)."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.empty((*cache.shape[:-1], 1)).uniform_(-6.9, 1.4, generator=gen).exp()
    return reference.fp8_kv_rows(cache * magnitudes)


@needs_kernels
@pytest.mark.parametrize("window", [0, 30])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (16, 8, 128), (4, 2, 16), (4, 1, 512), (8, 1, 576)]
)
def test_attention_over_an_fp8_cache_is_attention_over_its_decoded_values(
    heads: int, kv_heads: int, head_dim: int, window: int
) -> None:
    """Bit for bit, decode rows and every prompt token as a row: the kernel decodes each tile's FP8 rows to the
    values `reference.fp8_kv_values` gives before the float32 arithmetic, which then runs as over a float cache."""
    q, floats, meta = make_batch([(1, 1), (1, 100), (1, 257), (70, 150)], heads, kv_heads, head_dim, 16, seed=4)
    cache = fp8_cache_of(floats)
    decoded = reference.fp8_kv_values(cache)
    tables, lens = meta.token_rows
    got = cpu.paged_decode_attention(q, cache, tables, lens, 0.125, window)
    assert torch.equal(got, cpu.paged_decode_attention(q, decoded, tables, lens, 0.125, window))
    torch.testing.assert_close(cpu.paged_attention_by_token(q, cache, meta, 0.125, window),
                               reference.paged_attention(q, cache, meta, 0.125, window), **TOLERANCE)  # fmt: skip


@needs_kernels
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(3, 64), (2, 128), (1, 16)])
def test_fp8_rows_are_packed_as_the_reference_packs_them(kv_heads: int, head_dim: int) -> None:
    """Bit for bit over rows of every kind: beyond e4m3's range before scaling, subnormal after it, all zeros,
    values that round into the next binade or tie, and K/V as strided views of one projection."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 40
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen)
    kv[:8] *= torch.logspace(-8, 6, 8).unsqueeze(1)
    kv[8, : kv_heads * head_dim] = 0.0
    kv[9, :8] = torch.tensor([448.0, 124.0, -124.0, 60.0, 0.0009765625, -0.00146484375, 232.0, 240.0])
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    cache = torch.randint(0, 256, (2, 5, 16, kv_heads, head_dim + 4), generator=gen, dtype=torch.uint8)
    expected = cache.clone()
    slots = torch.randperm(80, generator=gen)[:tokens]
    cpu.write_kv_cache(k, v, cache, slots)
    reference.write_kv_cache(k, v, expected, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.ladle_cpu.write_kv_cache(k.contiguous(), v.contiguous(), cache, slots + 80)


@needs_kernels
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda q, c, t, n: (q.double(), c, t, n), "q must be"),
        (lambda q, c, t, n: (q, c[:, :, :, :1], t, n), "kv_cache must be"),
        (lambda q, c, t, n: (q, c, t.long(), n), "block_tables must be"),
        (lambda q, c, t, n: (q, c, t, n + 100), "seq_lens out of"),
        (lambda q, c, t, n: (q, c, t, n * 0), "seq_lens out of"),
        (lambda q, c, t, n: (q, c, t.clone().fill_(10_000), n), "outside the cache"),
        (lambda q, c, t, n: (q, c, t.clone().fill_(-1), n), "outside the cache"),
        (lambda q, c, t, n: (q[:, :, :48].contiguous(), c[..., :48].contiguous(), t, n), "head dim 48"),
        (lambda q, c, t, n: (q[:, :3].contiguous(), c, t, n), "multiple of KV heads"),
    ],
)
def test_malformed_inputs_are_refused_before_any_read(mutate: Callable[..., Batch], message: str) -> None:
    q, cache, meta = make_batch([(1, 20), (1, 33)], 4, 2, 64, 16)
    q, cache, tables, lens = mutate(q, cache, meta.block_tables, meta.seq_lens)
    with pytest.raises(RuntimeError, match=message):
        cpu.paged_decode_attention(q, cache, tables, lens, 0.125)


@needs_kernels
def test_a_negative_window_or_softcap_is_refused() -> None:
    q, cache, meta = make_batch([(1, 20)], 4, 2, 64, 16)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        cpu.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125, -1)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        cpu.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125, 0, -1.0)


@needs_kernels
def test_one_openmp_runtime_serves_torch_and_the_kernels() -> None:
    """The extension links libgomp.so.1 by soname: it must resolve to the copy torch loaded, not a second
    runtime with its own spinning threads. Copies that a wheel vendors under a hashed name (scikit-learn's
    `libgomp-<hash>.so.1.0.0`, loaded on machines whose tests import it) carry that name as their soname too, so
    no `libgomp.so.1` lookup can reach them: only files named `libgomp.so*` count."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    loaded = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    runtimes = {path for path in loaded if Path(path).name.startswith("libgomp.so")}
    assert len(runtimes) == 1, loaded


def test_select_ops_on_cpu_picks_the_cpu_kernels_where_they_build() -> None:
    assert select_ops(torch.device("cpu")) is (cpu.cpu_ops() or REFERENCE_OPS)


def test_the_environment_switch_keeps_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.DISABLE_ENV, "0")
    cpu.cpu_ops.cache_clear()
    try:
        assert cpu.cpu_ops() is None
        assert select_ops(torch.device("cpu")) is REFERENCE_OPS
    finally:
        monkeypatch.delenv(cpu.DISABLE_ENV)
        cpu.cpu_ops.cache_clear()


@needs_kernels
@pytest.mark.parametrize("n", [576, 64, 37])
def test_rms_norm_matches_the_reference_on_strided_rows(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(33, 2 * n, generator=gen)[:, :n] * 3  # rows 2n apart
    weight = torch.randn(n, generator=gen)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **TOLERANCE)


@needs_kernels
def test_add_rms_norm_returns_the_exact_sum_and_the_normed_sum() -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual, weight = torch.randn(70, 576, generator=gen), torch.randn(70, 576, generator=gen), torch.rand(576)
    normed, summed = cpu.rms_norm(x, weight, 1e-6, residual)
    ref_normed, ref_summed = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **TOLERANCE)


@needs_kernels
@pytest.mark.parametrize(("q_heads", "k_heads", "dim"), [(9, 3, 64), (14, 2, 128), (2, 1, 24)])
def test_rotary_embedding_is_bit_identical_to_the_reference_on_a_fused_qkv_split(
    q_heads: int, k_heads: int, dim: int
) -> None:
    """q and k as the attention layer makes them: views into one [T, (Hq + 2 Hkv) * D] projection."""
    gen = torch.Generator().manual_seed(dim)
    tokens = 37
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=gen)
    q, k, _ = qkv.split([q_heads * dim, k_heads * dim, k_heads * dim], dim=-1)
    q, k = q.view(tokens, q_heads, dim), k.view(tokens, k_heads, dim)
    cache = reference.build_cos_sin_cache(dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    before = qkv.clone()
    ours, theirs = cpu.rotary_embedding(positions, q, k, cache), reference.rotary_embedding(positions, q, k, cache)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert torch.equal(qkv, before)  # inputs untouched


@needs_kernels
def test_rotary_embedding_refuses_a_position_outside_the_cache() -> None:
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    cache = reference.build_cos_sin_cache(16, 8, 10000.0)
    with pytest.raises(RuntimeError, match="outside the rope cache"):
        cpu.rotary_embedding(torch.tensor([0, 8]), q, k, cache)


@needs_kernels
@pytest.mark.parametrize("d", [1536, 40])
def test_silu_and_mul_matches_the_reference(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(19, 2 * d + 8, generator=gen)[:, : 2 * d] * 6  # strided rows, gates well into both tails
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    torch.testing.assert_close(cpu.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("d", [1536, 40])
def test_gelu_tanh_and_mul_matches_the_reference(d: int) -> None:
    """The C++ op the GELU experts run (`moe_packed(gelu=True)`) against `reference.gelu_tanh_and_mul`, gates far
    into both tails (where tanh is written through exp)."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(19, 2 * d + 8, generator=gen)[:, : 2 * d] * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    # Products up to ~500: a few float32 ulps apart (torch's tanh and this exp differ in their last bits).
    torch.testing.assert_close(torch.ops.ladle_cpu.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x), atol=5e-6,
                               rtol=1e-5)  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("d", [1536, 40])
def test_clamped_swiglu_matches_the_reference(d: int) -> None:
    """The C++ op gpt-oss's quantized experts run (`moe_packed`'s `swiglu_limit`) against `reference.clamped_swiglu`:
    gates and ups both sides of the limit (the gate clamped above only, the up both ways), far into the tails."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(19, 2 * d + 8, generator=gen)[:, : 2 * d] * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    x[0, d : d + 2] = torch.tensor([-100.0, 100.0])
    ours = torch.ops.ladle_cpu.clamped_swiglu(x, 1.702, 7.0)
    torch.testing.assert_close(ours, reference.clamped_swiglu(x, 1.702, 7.0), atol=5e-6, rtol=1e-5)
    assert (ours - reference.clamped_swiglu(x, 1.702, 70.0)).abs().max() > 1.0  # the clamp bites
    with pytest.raises(RuntimeError, match="limit must be positive"):
        torch.ops.ladle_cpu.clamped_swiglu(x, 1.702, 0.0)
    plain = torch.ops.ladle_cpu.clamped_swiglu(x, 1.0, 7.0, 0.0)  # HY-V4's: no offset on the up half
    torch.testing.assert_close(plain, reference.clamped_swiglu(x, 1.0, 7.0, 0.0), atol=5e-6, rtol=1e-5)
    assert (plain - reference.clamped_swiglu(x, 1.0, 7.0)).abs().max() > 1.0


def test_pointwise_ops_fall_back_to_the_reference_where_the_kernels_do_not_apply() -> None:
    heads = torch.randn(5, 4, 16)  # Qwen3's per-head q/k norm is 3-D
    weight = torch.rand(16)
    torch.testing.assert_close(cpu.rms_norm(heads, weight, 1e-6), reference.rms_norm(heads, weight, 1e-6))
    half = torch.randn(5, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(cpu.silu_and_mul(half), reference.silu_and_mul(half))


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    """A build killed half-way leaves torch's lock file, on which every later start would wait forever."""
    lock = tmp_path / "lock"
    assert not cpu.clear_stale_build_lock(tmp_path)  # no lock: nothing to do
    lock.touch()
    assert not cpu.clear_stale_build_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - cpu.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert cpu.clear_stale_build_lock(tmp_path) and not lock.exists()


def test_a_build_lock_no_loading_process_holds_is_removed_at_once(tmp_path: Path) -> None:
    """A fresh lock left by a build killed a second ago: with no process loading the kernels it goes at the next
    start; while another process loads (holds the loaders' flock shared) it stays, as that process may be building."""
    lock = tmp_path / "lock"
    lock.touch()
    with (tmp_path / cpu.LOADERS_LOCK).open("a") as other:  # another open file description: another loader
        fcntl.flock(other, fcntl.LOCK_SH)
        with cpu.loading_guard(tmp_path):
            assert lock.exists()
        fcntl.flock(other, fcntl.LOCK_UN)
    with cpu.loading_guard(tmp_path):
        assert not lock.exists()
        lock.touch()  # this load's own build: a second loader now sees a loader and waits
        with cpu.loading_guard(tmp_path):
            assert lock.exists()


@needs_kernels
def test_cpu_ops_mirror_the_reference_signatures() -> None:
    ops = cpu.cpu_ops()
    assert ops is not None
    for field in fields(KernelOps):
        ours, ref = getattr(ops, field.name), getattr(reference, field.name)
        assert ours.__name__ == field.name
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(ref).parameters)


@needs_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 100), (9, 1025), (40, 4099)])
def test_seeded_noise_is_the_reference_bit_for_bit(rows: int, vocab: int) -> None:
    """Keys over the whole int64 range (the sign bit included), token ids in any order; u is exact and the log
    is the reference's own op, so the C++ kernel equals the reference exactly."""
    gen = torch.Generator().manual_seed(vocab)
    edge = [0, 1, -1, 2**63 - 1, -(2**63), 0x5DEECE66D, -0x61C8864680B583EB]
    random_keys = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen, dtype=torch.int64).tolist()
    keys = torch.tensor((edge + random_keys)[:rows], dtype=torch.int64)
    for tokens in (torch.arange(vocab), torch.randperm(2 * vocab, generator=gen)[:vocab]):
        got = cpu.seeded_log_uniforms(keys, tokens)
        assert got.dtype == torch.float32 and got.shape == (rows, vocab)
        assert torch.equal(got, reference.seeded_log_uniforms(keys, tokens))
    strided = torch.tensor(edge * 2, dtype=torch.int64)[::2]
    tokens = torch.arange(7)
    assert torch.equal(cpu.seeded_log_uniforms(strided, tokens), reference.seeded_log_uniforms(strided, tokens))


@needs_kernels
def test_seeded_noise_checks_its_inputs_and_the_sampler_uses_it() -> None:
    from engine_server.sampling.noise import SeededNoise

    with pytest.raises(RuntimeError, match="int64"):
        cpu.seeded_log_uniforms(torch.zeros(2, dtype=torch.int32), torch.arange(4))
    assert cpu.seeded_log_uniforms(torch.zeros(0, dtype=torch.int64), torch.arange(4)).shape == (0, 4)
    assert SeededNoise(100, torch.device("cpu"))._kernel is cpu.seeded_log_uniforms
