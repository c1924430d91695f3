"""Counter-based log-uniforms of seeded sampling rows (`ladle_kernels.reference.seeded_log_uniforms`) in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle_kernels._checks import check_same_device
from ladle_kernels.reference import SPLITMIX_GOLDEN, SPLITMIX_MIX_1, SPLITMIX_MIX_2

_BLOCK = 1024


@triton.jit
def _seeded_log_uniforms_kernel(
    keys_ptr,
    tokens_ptr,
    out_ptr,
    vocab,
    stride_out,
    GOLDEN: tl.constexpr,
    MIX_1: tl.constexpr,
    MIX_2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """For row r and column j < vocab, in uint64 arithmetic (wrapping products, logical shifts):

        z = key[r] + GOLDEN * tokens[j];  z = (z ^ (z >> 30)) * MIX_1;  z = (z ^ (z >> 27)) * MIX_2
        out[r, j] = log(0.5 + (2 s + 1) * 2**-24),  s = (z as int64) >> 41

    The torch reference's 13 passes over an [S, V] int64 tensor become one float32 write.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    tokens = tl.load(tokens_ptr + cols, mask=in_vocab, other=0).to(tl.uint64, bitcast=True)
    z = key + tokens * GOLDEN
    z = (z ^ (z >> 30)) * MIX_1
    z = (z ^ (z >> 27)) * MIX_2
    signed = z.to(tl.int64, bitcast=True) >> 41
    u = signed.to(tl.float32) * (2.0**-23) + (0.5 + 2.0**-24)
    tl.store(out_ptr + row * stride_out + cols, tl.log(u), mask=in_vocab)


def seeded_log_uniforms(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`ladle_kernels.reference.seeded_log_uniforms` on the GPU: log(u) `[S, V]` float32 for keys `[S]` and token ids
    `[V]`, both int64 on one device."""
    check_same_device(keys=keys, tokens=tokens)
    if keys.dim() != 1 or tokens.dim() != 1 or keys.dtype != torch.int64 or tokens.dtype != torch.int64:
        raise ValueError(f"expected int64 keys [S] and tokens [V]; got {keys.dtype} {tuple(keys.shape)}, "
                         f"{tokens.dtype} {tuple(tokens.shape)}")  # fmt: skip
    keys, tokens = keys.contiguous(), tokens.contiguous()
    out = torch.empty(keys.shape[0], tokens.shape[0], dtype=torch.float32, device=keys.device)
    if out.numel() == 0:
        return out
    grid = (keys.shape[0], triton.cdiv(tokens.shape[0], _BLOCK))
    _seeded_log_uniforms_kernel[grid](
        keys, tokens, out, tokens.shape[0], out.stride(0),
        GOLDEN=SPLITMIX_GOLDEN, MIX_1=SPLITMIX_MIX_1, MIX_2=SPLITMIX_MIX_2, BLOCK=_BLOCK,
    )  # fmt: skip
    return out
