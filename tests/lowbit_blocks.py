"""Random GGUF blocks of the 5-bit and K-quant types, for the tests of their decoding and kernels: every byte
random (any bit pattern is a valid block) but the float16 scales, drawn small and positive (dmin too), as a
quantizer writes them: narrowed by each kind's integer range (5-bit values; K-quants' 6-bit sub-block scales and
Q6_K's int8 ones), so the weights are as wide as the 4-bit kernels' tests draw theirs and the same tolerances
hold."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

KINDS = {
    "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1, "q4_k": GGMLQuantizationType.Q4_K,
    "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K,
}  # fmt: skip
# Byte offsets of each kind's float16 scales in its block.
_HALVES = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
_NARROWER = {"q5_0": 2, "q5_1": 2, "q4_k": 32, "q5_k": 64, "q6_k": 128}


def block_elements(kind: str) -> int:
    return GGML_QUANT_SIZES[KINDS[kind]][0]


def random_blocks(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[n, k / block elements, block bytes]` uint8 blocks of `kind` (see the module docstring)."""
    elements, size = GGML_QUANT_SIZES[KINDS[kind]]
    blocks = torch.randint(0, 256, (n, k // elements, size), dtype=torch.uint8, generator=gen)
    for at in _HALVES[kind]:
        scale = ((torch.rand(n, k // elements, generator=gen) * 0.02 + 0.001) / _NARROWER[kind]).half()
        blocks[..., at : at + 2] = scale.unsqueeze(-1).view(torch.uint8).reshape(n, k // elements, 2)
    return blocks


def gguf_dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The gguf package's reference dequantization of `blocks` -> `[n, k]` float32."""
    from gguf.quants import dequantize

    raw = np.ascontiguousarray(blocks.numpy()).reshape(blocks.shape[0], -1)
    return torch.from_numpy(dequantize(raw, KINDS[kind]).copy())
