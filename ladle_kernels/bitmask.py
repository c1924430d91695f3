"""Grammar token bitmask on logits (xgrammar's packed int32 layout), in place: one Triton program per row block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle_kernels._checks import check_dtype, check_same_device

_WORDS_PER_PROGRAM = 64  # 2048 tokens per program: a 150k vocab is ~75 programs a row


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, stride_logits, stride_bitmask, vocab, WORDS: tl.constexpr):
    """For row b and token v < vocab, with word w = bitmask[b, v // 32]:

        logits[b, v] = -inf   where bit (v % 32) of w is 0

    Allowed tokens are not written at all. Each program unpacks WORDS words as a [WORDS, 32] tile.
    """
    row = tl.program_id(0).to(tl.int64)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    bits = tl.arange(0, 32)
    tokens = words[:, None] * 32 + bits[None, :]
    in_vocab = tokens < vocab
    packed = tl.load(bitmask_ptr + row * stride_bitmask + words, mask=words * 32 < vocab, other=-1)
    # Arithmetic shift of a negative word smears the sign bit, but `& 1` keeps only the bit asked for.
    allowed = (packed[:, None] >> bits[None, :]) & 1
    neg_inf = tl.full([WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, neg_inf, mask=in_vocab & (allowed == 0))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """`ladle_kernels.reference.apply_token_bitmask_` on the GPU: set disallowed tokens of logits `[B, V]` to -inf.

    `bitmask` is `[B, W]` int32 with `W >= ceil(V / 32)`; bit i of word j is token 32*j + i (xgrammar's
    layout), 1 = allowed; bits past V are ignored. Rows of either tensor may be strided.
    """
    check_dtype("logits", logits)
    check_dtype("bitmask", bitmask, (torch.int32,))
    check_same_device(logits=logits, bitmask=bitmask)
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        shapes = f"{tuple(logits.shape)}, {tuple(bitmask.shape)}"
        raise ValueError(f"expected logits [B, V] and bitmask [B, W] with the same B; got {shapes}")
    rows, vocab = logits.shape
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask width {bitmask.shape[1]} covers fewer than the {vocab} tokens of the logits")
    if logits.stride(1) != 1 and vocab > 1:
        raise ValueError("logits must have a unit stride over the vocab (the op writes in place)")
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    if rows == 0 or vocab == 0:
        return
    grid = (rows, triton.cdiv(triton.cdiv(vocab, 32), _WORDS_PER_PROGRAM))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, WORDS=_WORDS_PER_PROGRAM
    )
