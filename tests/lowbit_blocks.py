"""Random GGUF blocks of the 5-bit, K-quant, IQ4, IQ2 / IQ3 grid and MXFP4 types, for the tests of their decoding and
kernels: every byte random (any bit pattern is a valid block) but the float16 scales, drawn small and positive as a
quantizer writes them (a min or dmin so that the weights average zero), and narrowed by each kind's integer range
(5-bit values; K-quants' 6-bit sub-block scales and Q6_K's int8 ones), so the weights are as wide as the 4-bit
kernels' tests draw theirs and the same tolerances hold; MXFP4's exponent bytes likewise (values up to 6 * 2 ** -5)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

KINDS = {
    "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1, "q4_k": GGMLQuantizationType.Q4_K,
    "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K, "mxfp4": GGMLQuantizationType.MXFP4,
    "iq4_nl": GGMLQuantizationType.IQ4_NL, "iq4_xs": GGMLQuantizationType.IQ4_XS, "q3_k": GGMLQuantizationType.Q3_K,
    "q2_k": GGMLQuantizationType.Q2_K, "iq3_xxs": GGMLQuantizationType.IQ3_XXS, "iq3_s": GGMLQuantizationType.IQ3_S,
    "iq2_xxs": GGMLQuantizationType.IQ2_XXS, "iq2_xs": GGMLQuantizationType.IQ2_XS, "iq2_s": GGMLQuantizationType.IQ2_S,
    "iq1_s": GGMLQuantizationType.IQ1_S, "iq1_m": GGMLQuantizationType.IQ1_M,
}  # fmt: skip
# Byte offsets of each kind's float16 scales in its block.
_HALVES = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,),
           "q3_k": (108,), "q2_k": (80, 82), "iq3_xxs": (0,), "iq3_s": (0,), "iq2_xxs": (0,),
           "iq2_xs": (0,), "iq2_s": (0,), "iq1_s": (0,)}
_NARROWER = {"q5_0": 2, "q5_1": 2, "q4_k": 32, "q5_k": 64, "q6_k": 128, "iq4_nl": 8, "iq4_xs": 128, "q3_k": 4,
             "q2_k": 2, "iq3_xxs": 16, "iq3_s": 16, "iq2_xxs": 8,
             "iq2_xs": 8, "iq2_s": 8, "iq1_s": 0.5, "iq1_m": 0.5}
MXFP4_EXPONENTS = (118, 123)  # the exponent bytes drawn: 2 ** (e - 127) from 2 ** -9 to 2 ** -5
# Of u (a K-quant's m averages sc's mean, so d * mean u).
_MEAN_VALUE = {"q5_1": 15.5, "q4_k": 7.5, "q5_k": 15.5, "q2_k": 1.5}


def block_elements(kind: str) -> int:
    return GGML_QUANT_SIZES[KINDS[kind]][0]


def random_blocks(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[n, k / block elements, block bytes]` uint8 blocks of `kind` (see the module docstring)."""
    elements, size = GGML_QUANT_SIZES[KINDS[kind]]
    blocks = torch.randint(0, 256, (n, k // elements, size), dtype=torch.uint8, generator=gen)
    if kind == "mxfp4":
        blocks[..., 0] = torch.randint(*MXFP4_EXPONENTS, (n, k // elements), dtype=torch.uint8, generator=gen)
        return blocks
    scale = (torch.rand(n, k // elements, generator=gen) * 0.02 + 0.001) / _NARROWER[kind]
    # The second float16 (a min or dmin) centres the weights on zero, as a quantizer's do: the values' mean times
    # the scale (a Q5_1 min is subtracted as a negative one).
    halves = [scale, scale * _MEAN_VALUE.get(kind, 0.0) * (-1.0 if kind == "q5_1" else 1.0)]
    if kind == "iq1_m":  # d's float16 bits are the top nibbles of the 4 scale words (bytes 48..55), word j's at 4j
        bits = scale.half().view(torch.int16).int() & 0xFFFF
        for j in range(4):
            high = 49 + 2 * j
            blocks[..., high] = (blocks[..., high] & 0x0F) | (((bits >> (4 * j)) & 0x0F) << 4).to(torch.uint8)
        return blocks
    for at, value in zip(_HALVES[kind], halves, strict=False):
        blocks[..., at : at + 2] = value.half().unsqueeze(-1).view(torch.uint8).reshape(n, k // elements, 2)
    return blocks


def gguf_dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The gguf package's reference dequantization of `blocks` -> `[n, k]` float32."""
    from gguf.quants import dequantize

    raw = np.ascontiguousarray(blocks.numpy()).reshape(blocks.shape[0], -1)
    return torch.from_numpy(dequantize(raw, KINDS[kind]).copy())
