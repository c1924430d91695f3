"""`tl.dot` as the kernels call it, shared so that every kernel runs bfloat16 under Triton's interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`acc + a @ b` with float32 accumulation (`acc` a float32 tile, or None). UPCAST does it on float32
    copies: Triton's interpreter cannot multiply bfloat16 (numpy has no such type), and the result is the same
    since bf16 products are exact in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
