"""Images whose tokens attend both ways (Gemma 3's): after a layer's causal attention, each image token of the step
attends again over its causal keys and its image's later tokens, as transformers' Gemma 3 mask has it (a full layer:
causal or the same image; a windowed one: that, within the window: `p - window < key`).

The runner hands each image the step computes whole or finishes (`ImageBlock`; a prefill chunk never ends inside such
an image: `core.scheduler.whole_images`), so its K/V are all in the cache when the layer attends. Plain torch, float32
scores, one image at a time: its tokens are a few hundred rows of a prefill step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle_kernels.reference import fp8_kv_values, is_fp8_kv_cache


@dataclass(frozen=True)
class ImageBlock:
    """One image's tokens computed this step: its request's index in the step (`sequence`: its row of the step's
    block tables), its first token's row in the step and position, how many of its tokens the step computes (always
    through its last), and the image's end (its last token's position + 1). Plain integers, so tensor parallelism's
    step channel carries them as they are."""

    sequence: int
    first_row: int
    first_position: int
    count: int
    end: int


def attend_image_blocks(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    blocks: list[ImageBlock],
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`out` `[T, heads, head_dim]` (the layer's causal attention of queries `q` `[T, heads, head_dim]`) with each
    image token's row attended again over keys `[0 or p - window + 1, end)` of its image's block, read from
    `kv_cache` `[2, num_blocks, block_size, kv_heads, row]` through the step's `block_tables` `[B, W]`."""
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    for block in blocks:
        rows = torch.arange(block.first_row, block.first_row + block.count, device=q.device)
        positions = torch.arange(block.first_position, block.first_position + block.count, device=q.device)
        low = max(0, block.first_position - window + 1) if window else 0
        keys = torch.arange(low, block.end, device=q.device)
        table = block_tables[block.sequence].long()
        slots = table[keys // block_size] * block_size + keys % block_size
        k = kv_cache[0].reshape(-1, kv_heads, kv_cache.shape[-1])[slots]
        v = kv_cache[1].reshape(-1, kv_heads, kv_cache.shape[-1])[slots]
        if is_fp8_kv_cache(kv_cache):
            k, v = fp8_kv_values(k), fp8_kv_values(v)
        groups = q.shape[1] // kv_heads
        k = k.float().repeat_interleave(groups, dim=1)  # [K, heads, D]
        v = v.float().repeat_interleave(groups, dim=1)
        scores = torch.einsum("rhd,khd->hrk", q[rows].float(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if window:  # a key in the image but out of the query's window stays out, as the mask's AND with it has it
            outside = keys[None, :] <= positions[:, None] - window
            scores = scores.masked_fill(outside[None], float("-inf"))
        attended = torch.einsum("hrk,khd->rhd", torch.softmax(scores, dim=-1), v)
        out = out.index_copy(0, rows, attended.to(out.dtype))
    return out
