"""The Triton paged attention against `ladle_kernels.reference.paged_attention` on mixed batches.

Batches mix decodes, fresh prefills and prefill chunks after cached context of various lengths, none a
multiple of the block size; block tables come from a shuffled pool and every unused slot of the cache holds
random values, so reading one key too many shows up as a wrong result.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine_server.attention_metadata import AttentionMetadata
from ladle_kernels import reference
from ladle_kernels.paged_attention import paged_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both sides accumulate in float32 and round once; the kernel also rounds the probabilities to the input dtype
# before P @ V (as flash attention does).
TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}
# (query_len, seq_len) per sequence.
MIXED = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 40), (4, 13), (1, 33), (23, 60)]
DECODE = [(1, 1), (1, 17), (1, 40), (1, 16), (1, 5)]
LONG = [(1, 150), (20, 150), (130, 130)]  # several key tiles, and a prefill of several query tiles


def make_batch(
    spec: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q `[T, H, D]`, a random cache and the metadata for `spec`, blocks drawn from a shuffled pool."""
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim * 10 + len(spec))
    blocks = [-(-seq_len // block_size) for _, seq_len in spec]
    num_blocks = sum(blocks) + 2
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in blocks]
    meta = AttentionMetadata.build([q for q, _ in spec], [s for _, s in spec], tables, block_size, device)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen).to(device, dtype)
    return q, cache, meta


def check(
    spec: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int = 16,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    q, cache, meta = make_batch(spec, heads, kv_heads, head_dim, dtype, device, block_size)
    scale = head_dim**-0.5
    sinks = None if sinks is None else sinks.to(device)
    out = paged_attention(q, cache, meta, scale, window, softcap, sinks)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference.paged_attention(q, cache, meta, scale, window, softcap, sinks)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("spec", [MIXED, DECODE], ids=["mixed", "decode"])
def test_paged_attention_matches_reference(
    device: torch.device, spec: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    check(spec, heads, kv_heads, head_dim, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_long_contexts(device: torch.device, dtype: torch.dtype) -> None:
    check(LONG, 6, 2, 64, dtype, device)


@pytest.mark.parametrize("spec", [MIXED, DECODE], ids=["mixed", "decode"])
def test_paged_attention_wide_gqa_group(device: torch.device, spec: list[tuple[int, int]]) -> None:
    """8 query heads per KV head, and a head dim (96) padded to 128."""
    check(spec, 8, 1, 96, torch.float16, device)


@pytest.mark.parametrize(
    ("spec", "heads"), [(MIXED, 48), (DECODE, 128)], ids=["mixed-48-heads", "decode-128-heads"]
)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_paged_attention_over_latent_rows(
    device: torch.device, spec: list[tuple[int, int]], heads: int, fp8: bool
) -> None:
    """DeepSeek's latent attention (`engine_server.layers.mla`): every query head over one KV head of 576 dims,
    padded to 1,024; the group split over programs of 16 heads each (48 heads: 3 programs, V3's 128: 8)."""
    q, cache, meta = make_batch(spec, heads, 1, 576, torch.bfloat16, device)
    if fp8:
        cache = reference.fp8_kv_rows(cache.float())
    expected = reference.paged_attention(q, cache, meta, 192**-0.5)
    torch.testing.assert_close(paged_attention(q, cache, meta, 192**-0.5), expected, **TOLERANCES[torch.bfloat16])


def test_paged_attention_over_latent_rows_with_sinks(device: torch.device) -> None:
    """HY-V4's latent attention: a learned sink logit per query head (one more term of each softmax, weighting no
    value) over the one KV head of latent rows, 16 heads in one program; without the sinks the outputs are far off."""
    q, cache, meta = make_batch(MIXED, 16, 1, 576, torch.bfloat16, device)
    sinks = torch.randn(16, generator=torch.Generator().manual_seed(5)).to(device) * 2
    expected = reference.paged_attention(q, cache, meta, 192**-0.5, 0, 0.0, sinks)
    ours = paged_attention(q, cache, meta, 192**-0.5, 0, 0.0, sinks)
    torch.testing.assert_close(ours, expected, **TOLERANCES[torch.bfloat16])
    assert (ours.float() - paged_attention(q, cache, meta, 192**-0.5).float()).abs().max() > 0.05


@pytest.mark.parametrize("block_size", [1, 4])
def test_paged_attention_small_blocks(device: torch.device, block_size: int) -> None:
    """Key tiles span several cache blocks when blocks are smaller than a tile."""
    check(MIXED, 6, 2, 64, torch.float32, device, block_size)


def test_paged_attention_strided_queries(device: torch.device) -> None:
    q, cache, meta = make_batch(MIXED, 4, 2, 64, torch.float32, device)
    wide = torch.cat([q, torch.randn_like(q)], dim=1)[:, :4]  # heads 4..7 are not ours
    assert not wide.is_contiguous()
    torch.testing.assert_close(
        paged_attention(wide, cache, meta, 0.125),
        reference.paged_attention(q, cache, meta, 0.125),
        **TOLERANCES[torch.float32],
    )


def test_paged_attention_rejects_mismatched_arguments(device: torch.device) -> None:
    q, cache, meta = make_batch(DECODE, 6, 2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :5], cache, meta, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.half(), cache, meta, 0.125)
    with pytest.raises(ValueError, match="tokens"):
        paged_attention(q[:-1], cache, meta, 0.125)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_paged_attention_at_serving_sizes(dtype: torch.dtype) -> None:
    """Llama-8B-like heads over long contexts: the sizes the interpreter is too slow for."""
    spec = [(1, 3001), (1, 17), (512, 512), (300, 2000)] + [(1, 100 + 37 * i) for i in range(60)]
    check(spec, 32, 8, 128, dtype, torch.device("cuda"))


@pytest.mark.parametrize("window", [1, 5, 33, 100])
def test_paged_attention_sliding_window(device: torch.device, window: int) -> None:
    """Windows narrower than a key tile, wider than one, and wider than a query tile's first token's reach: the
    kernel starts each tile at its first token's window and masks the rest, as the reference does."""
    check([*MIXED, *LONG], 6, 2, 64, torch.float32, device, window=window)


@pytest.mark.parametrize("window", [0, 33])
def test_paged_attention_soft_capped(device: torch.device, window: int) -> None:
    """Gemma 2's soft-capping (a cap of 0.5 bends most of these scores), with and without a window."""
    check(MIXED, 6, 2, 64, torch.float32, device, window=window, softcap=0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("window", "sink_scale"), [(0, 1.0), (33, 1.0), (0, 30.0)])
def test_paged_attention_with_sinks(device: torch.device, dtype: torch.dtype, window: int, sink_scale: float) -> None:
    """gpt-oss's sink logits (one per query head, of the scores' size or far above them), with and without a
    window, over prefills of several key tiles too."""
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(2)) * sink_scale
    check([*MIXED, *LONG], 6, 2, 64, dtype, device, window=window, sinks=sinks)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "kind"), [(6, 6, "bloom"), (6, 2, "mpt"), (16, 16, "bloom")])
def test_alibi_attention_matches_the_reference(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, kind: str
) -> None:
    """BLOOM's and MPT's ALiBi (`slopes[h] * (j - p)` added to each scaled score, in base 2 in the kernel) over
    prefills and decodes of several key tiles, one KV head a query head or three: `reference.alibi_attention`.
    Falcon-RW's bfloat16 bias runs through the reference itself."""
    from engine_server.layers.alibi import alibi_slopes
    from ladle_kernels.paged_attention import _paged_attention, alibi_attention

    q, cache, meta = make_batch([*MIXED, *LONG], heads, kv_heads, 64, dtype, device)
    slopes = alibi_slopes(kind, heads, 8.0).to(device)
    out = alibi_attention(q, cache, meta, 0.125, slopes)
    torch.testing.assert_close(out, reference.alibi_attention(q, cache, meta, 0.125, slopes), **TOLERANCES[dtype])
    assert not torch.allclose(out, paged_attention(q, cache, meta, 0.125), **TOLERANCES[dtype])  # the bias counts
    falcon = alibi_attention(q, cache, meta, 0.125, slopes, falcon=True)
    assert torch.equal(falcon, reference.alibi_attention(q, cache, meta, 0.125, slopes, falcon=True))
    with pytest.raises(ValueError, match="alibi_slopes must be a contiguous"):
        _paged_attention(q, cache, meta, 0.125, alibi_slopes=slopes[:2])


def test_paged_attention_refuses_sinks_of_the_wrong_shape(device: torch.device) -> None:
    q, cache, meta = make_batch(DECODE, 6, 2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="sinks must be a contiguous"):
        paged_attention(q, cache, meta, 0.125, 0, 0.0, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q, cache, meta, 0.125, 0, 0.0, torch.zeros(6, device=device, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("spec", "heads", "kv_heads", "head_dim", "window"),
    [(MIXED, 6, 2, 64, 0), (DECODE, 4, 4, 128, 0), (LONG, 8, 1, 96, 33)],
    ids=["mixed", "decode", "long-windowed"],
)
def test_paged_attention_reads_fp8_caches(
    device: torch.device, spec: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, window: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """An FP8 cache (`reference.fp8_kv_rows`' rows, each with its own scale: row magnitudes from 1e-3 to 4) read
    as the reference reads it, and the reference's reading is attention over the decoded values."""
    q, floats, meta = make_batch(spec, heads, kv_heads, head_dim, torch.float32, device)
    gen = torch.Generator().manual_seed(3)
    magnitudes = torch.empty((*floats.shape[:-1], 1)).uniform_(math.log(1e-3), math.log(4.0), generator=gen).exp()
    cache = reference.fp8_kv_rows(floats * magnitudes.to(device))
    q, scale = q.to(dtype), head_dim**-0.5
    expected = reference.paged_attention(q, cache, meta, scale, window)
    torch.testing.assert_close(paged_attention(q, cache, meta, scale, window), expected, **TOLERANCES[dtype])
    decoded = reference.fp8_kv_values(cache, dtype)
    assert torch.equal(reference.paged_attention(q, decoded, meta, scale, window), expected)


def test_paged_attention_rejects_an_unaligned_fp8_cache(device: torch.device) -> None:
    q, floats, meta = make_batch(DECODE, 2, 1, 18, torch.float32, device)
    with pytest.raises(ValueError, match="multiple of 4"):
        paged_attention(q, reference.fp8_kv_rows(floats), meta, 0.125)
