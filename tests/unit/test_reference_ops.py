"""The plain-torch reference ops against naive formulas and Hugging Face's own modules."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import RopeScaling, Yarn
from engine_server.hf_config import model_config_from_hf
from ladle_kernels import reference


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    chunk: int = 0,
) -> torch.Tensor:
    """q `[n, H, D]` at positions context..context+n-1 over k, v `[context+n, Hkv, D]`, causally, head by head;
    with a sliding `window`, the token at position p over the `window` positions up to p only; with `softcap`,
    scores s replaced by softcap * tanh(s / softcap) (Gemma 2); with `chunk`, over its own chunk's positions only,
    `[p - p % chunk, p]` (Llama 4)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        end = context + t + 1
        begin = max(0, end - window) if window else 0
        if chunk:
            begin = max(begin, (end - 1) - (end - 1) % chunk)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = scale * (k[begin:end, kv] @ q[t, h])
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            weights = torch.softmax(scores, dim=0)
            out[t, h] = weights @ v[begin:end, kv]
    return out


# (query_len, seq_len): decodes, fresh prefills, and prefill chunks after cached context, in one batch.
MIXED_BATCH = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 7), (4, 13), (1, 4)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 8), (6, 2, 12), (9, 3, 64), (8, 1, 5)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 1, 3, 8])  # 8: wider than some sequences, narrower than others
@pytest.mark.parametrize("softcap", [0.0, 0.7])  # 0.7: bends the randn scores (std ~1 after scaling)
def test_paged_attention_matches_naive_causal_attention(
    heads: int, kv_heads: int, head_dim: int, block_size: int, window: int, softcap: float
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    num_blocks = sum(-(-s // block_size) for _, s in MIXED_BATCH) + 3
    pool = list(range(num_blocks))
    random.Random(block_size).shuffle(pool)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    keys = [torch.randn(s, kv_heads, head_dim, generator=gen) for _, s in MIXED_BATCH]
    values = [torch.randn(s, kv_heads, head_dim, generator=gen) for _, s in MIXED_BATCH]
    tables = [[pool.pop() for _ in range(-(-s // block_size))] for _, s in MIXED_BATCH]
    # The earlier context is written by a previous "step"; the new tokens by this one.
    context_meta = AttentionMetadata.build(
        [s - q for q, s in MIXED_BATCH], [s - q for q, s in MIXED_BATCH], tables, block_size, "cpu"
    )
    reference.write_kv_cache(
        torch.cat([k[: s - q] for k, (q, s) in zip(keys, MIXED_BATCH, strict=True)]),
        torch.cat([v[: s - q] for v, (q, s) in zip(values, MIXED_BATCH, strict=True)]),
        cache,
        context_meta.slot_mapping,
    )
    meta = AttentionMetadata.build([q for q, _ in MIXED_BATCH], [s for _, s in MIXED_BATCH], tables, block_size, "cpu")
    reference.write_kv_cache(
        torch.cat([k[s - q :] for k, (q, s) in zip(keys, MIXED_BATCH, strict=True)]),
        torch.cat([v[s - q :] for v, (q, s) in zip(values, MIXED_BATCH, strict=True)]),
        cache,
        meta.slot_mapping,
    )
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = reference.paged_attention(q, cache, meta, scale, window, softcap)
    start = 0
    for (qlen, slen), k, v in zip(MIXED_BATCH, keys, values, strict=True):
        expected = naive_attention(q[start : start + qlen], k, v, slen - qlen, scale, window, softcap)
        torch.testing.assert_close(out[start : start + qlen], expected, atol=1e-5, rtol=1e-5)
        start += qlen


@pytest.mark.parametrize(("block_size", "chunk"), [(1, 3), (4, 4), (4, 8), (16, 16)])
def test_chunked_metadata_attends_within_chunks(block_size: int, chunk: int) -> None:
    """`AttentionMetadata.chunked`: each sequence split at its chunks, which plain paged attention then serves as
    attention within chunks: prefills from the start and after context (across one chunk or several), decodes at
    and past a chunk's first position; then a decode-only step (`build`'s shortcut). The split metadata leaves the
    slot mapping and the tokens' order as they were, and is the step's own once no sequence passes a chunk."""
    batch = [(1, 1), (5, 5), (1, 9), (3, 10), (1, 17), (7, 7), (12, 13), (1, 4), (9, 16), (1, 8)]
    heads, kv_heads, head_dim = 4, 2, 8
    gen = torch.Generator().manual_seed(block_size * 10 + chunk)
    pool = list(range(sum(-(-s // block_size) for _, s in batch)))
    random.Random(chunk).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-s // block_size))] for _, s in batch]
    cache = torch.zeros(2, sum(map(len, tables)), block_size, kv_heads, head_dim)
    keys = [torch.randn(s, kv_heads, head_dim, generator=gen) for _, s in batch]
    values = [torch.randn(s, kv_heads, head_dim, generator=gen) for _, s in batch]
    everything = AttentionMetadata.build([s for _, s in batch], [s for _, s in batch], tables, block_size, "cpu")
    reference.write_kv_cache(torch.cat(keys), torch.cat(values), cache, everything.slot_mapping)
    for step in (batch, [(1, s) for _, s in batch]):
        meta = AttentionMetadata.build([q for q, _ in step], [s for _, s in step], tables, block_size, "cpu")
        q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen)
        split = meta.chunked(chunk)
        assert split is meta.chunked(chunk) and split.slot_mapping is meta.slot_mapping
        assert split.num_tokens == meta.num_tokens
        assert split is not meta and len(split.query_lens_cpu) >= len(meta.query_lens_cpu)
        out = reference.paged_attention(q, cache, split, head_dim**-0.5)
        start = 0
        for (query_len, seq_len), k, v in zip(step, keys, values, strict=True):
            expected = naive_attention(q[start : start + query_len], k, v, seq_len - query_len, head_dim**-0.5,
                                       chunk=chunk)  # fmt: skip
            torch.testing.assert_close(out[start : start + query_len], expected, atol=1e-5, rtol=1e-5)
            start += query_len
    short = AttentionMetadata.build([2, 1], [3, 2], [[0], [1]], block_size=4, device="cpu")
    assert short.chunked(4) is short  # no sequence past its first chunk
    with pytest.raises(ValueError, match="not a multiple of the block size 4"):
        AttentionMetadata.build([9], [9], [[0, 1, 2]], block_size=4, device="cpu").chunked(6)


def test_metadata_slot_mapping_follows_block_tables() -> None:
    meta = AttentionMetadata.build([2, 1, 3], [5, 1, 3], [[7, 2], [4], [0, 9]], block_size=4, device="cpu")
    # seq 0: positions 3, 4 -> block 7 offset 3, block 2 offset 0; seq 1: position 0; seq 2: positions 0..2.
    assert meta.slot_mapping.tolist() == [31, 8, 16, 0, 1, 2]
    assert meta.query_start_loc.tolist() == [0, 2, 3, 6]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0], [0, 9]]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 5)
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build([5], [5], [[1]], block_size=4, device="cpu")


def test_decode_metadata_matches_the_general_build() -> None:
    """A decode-only step takes `build`'s shortcut; as the tail of a mixed step it takes the general path."""
    tables, lens = [[7, 2], [4], [0, 9, 3]], [5, 1, 9]
    decode = AttentionMetadata.build([1, 1, 1], lens, tables, block_size=4, device="cpu")
    mixed = AttentionMetadata.build([2, 1, 1, 1], [2, *lens], [[5], *tables], block_size=4, device="cpu")
    assert decode.slot_mapping.tolist() == mixed.slot_mapping.tolist()[2:] == [8, 16, 12]
    assert decode.query_start_loc.tolist() == [0, 1, 2, 3]
    assert decode.block_tables.tolist() == mixed.block_tables.tolist()[1:]
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert getattr(decode, name).dtype == getattr(mixed, name).dtype, name
    assert (decode.max_query_len, decode.max_seq_len, decode.query_lens_cpu) == (1, 9, [1, 1, 1])


def test_write_kv_cache_stores_each_token_in_its_slot() -> None:
    cache = torch.zeros(2, 3, 2, 1, 4)
    k, v = torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    reference.write_kv_cache(k, v, cache, torch.tensor([5, 0]))
    torch.testing.assert_close(cache[0, 2, 1], k[0])
    torch.testing.assert_close(cache[1, 0, 0], v[1])
    assert cache[:, 1].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_and_fuses_the_residual_add(dtype: torch.dtype) -> None:
    x, residual = torch.randn(5, 48).to(dtype), torch.randn(5, 48).to(dtype)
    hf_norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(torch.randn(48))
        torch.testing.assert_close(reference.rms_norm(x, hf_norm.weight, 1e-5), hf_norm(x))
        out, new_residual = reference.rms_norm(x, hf_norm.weight, 1e-5, residual)
        torch.testing.assert_close(new_residual, x + residual)
        torch.testing.assert_close(out, hf_norm(x + residual))


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 500000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ],
)
def test_rotary_embedding_matches_hf(rope_parameters: dict[str, float | str]) -> None:
    head_dim, max_positions = 32, 1024
    hf_config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters=rope_parameters,
    )
    scaling = None
    if rope_parameters["rope_type"] == "llama3":
        scaling = RopeScaling(8.0, 1.0, 4.0, 128)
    cache = reference.build_cos_sin_cache(head_dim, max_positions, float(rope_parameters["rope_theta"]), scaling)
    positions = torch.tensor([0, 1, 7, 200, 513, 1023])
    q, k = torch.randn(6, 4, head_dim), torch.randn(6, 2, head_dim)
    q_out, k_out = reference.rotary_embedding(positions, q, k, cache)

    cos, sin = LlamaRotaryEmbedding(hf_config)(q, positions[None])
    # HF rotates [batch, heads, seq, dim]; ours is [seq, heads, dim].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},  # Qwen's long-context setting
        # gpt-oss's: no truncation of the ramp, betas given
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,  # DeepSeek's attention factor
         "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5, "original_max_position_embeddings": 512},
    ],
)  # fmt: skip
def test_yarn_rope_matches_hf(rope: dict[str, Any]) -> None:
    head_dim, theta = 64, 150000.0
    hf_config = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=1024,
        rope_parameters={**rope, "rope_theta": theta},
    )  # fmt: skip
    config = model_config_from_hf(hf_config.to_dict())
    yarn = config.rope_scaling
    assert isinstance(yarn, Yarn)
    # vLLM's context length under YaRN: the original one times the factor, when that is longer.
    assert config.max_position_embeddings == max(1024, int(rope["original_max_position_embeddings"] * rope["factor"]))
    rotary = LlamaRotaryEmbedding(hf_config)
    torch.testing.assert_close(reference.yarn_inv_freq(head_dim, theta, yarn), rotary.inv_freq, rtol=0, atol=0)
    assert yarn.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    cache = reference.build_yarn_cos_sin_cache(head_dim, 2048, theta, yarn)
    positions = torch.tensor([0, 3, 100, 1023, 2047])
    q, k = torch.randn(5, 4, head_dim), torch.randn(5, 4, head_dim)
    q_out, k_out = reference.rotary_embedding(positions, q, k, cache)
    cos, sin = rotary(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_llama3_scaling_changes_only_low_frequencies() -> None:
    plain = reference.rope_inv_freq(64, 500000.0)
    scaled = reference.rope_inv_freq(64, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192))
    torch.testing.assert_close(scaled[:4], plain[:4])  # short wavelengths are kept
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8)  # long ones divided by the factor


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(reference.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])
    with pytest.raises(ValueError, match="sequence 1 is too short for 6"):
        AttentionMetadata.build_decode([4, 6], [[1], [2]], block_size=4, device="cpu")
    with pytest.raises(ValueError, match="sequence 0 is too short for 0"):
        AttentionMetadata.build_decode([0], [[1]], block_size=4, device="cpu")
