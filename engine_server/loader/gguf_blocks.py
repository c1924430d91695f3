"""A GGUF file's quantized blocks parsed as they are (`parse_blocks`): Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, llama.cpp's
K-quants Q2_K .. Q6_K, its non-linear IQ4_NL and IQ4_XS, its grid types IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S,
IQ1_S and IQ1_M, and MXFP4 (gpt-oss's experts), each type's block layout (`BLOCKS`), and their values
(`dequantize_blocks`).

Block layouts (32 elements each, float16 scales): Q4_0 `d, qs[16]` (element = d * (q - 8)); Q4_1 `d, m, qs[16]`
(element = d * q + m); Q8_0 `d, qs[32] int8` (element = d * q). A nibble byte j holds element j low and j + 16
high. The 5-bit, K-quant, IQ4 and MXFP4 blocks are decoded by `layers.lowbit_weight.decode_blocks` (K-quant blocks are
256 wide). The values equal gguf's own dequantization bit for bit, in torch (2-3x gguf's numpy on two cores).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine_server.layers.lowbit_weight import decode_blocks
from engine_server.layers.quantized_linear import Q4Weight, Q8Weight, QuantizedWeight

# Each type's block: (elements, bytes); the low-bit ones' kind names (`layers.lowbit_weight`).
BLOCKS = {
    GGMLQuantizationType.Q4_0: (32, 18), GGMLQuantizationType.Q4_1: (32, 20), GGMLQuantizationType.Q8_0: (32, 34),
    GGMLQuantizationType.Q5_0: (32, 22), GGMLQuantizationType.Q5_1: (32, 24), GGMLQuantizationType.Q4_K: (256, 144),
    GGMLQuantizationType.Q5_K: (256, 176), GGMLQuantizationType.Q6_K: (256, 210), GGMLQuantizationType.Q3_K: (256, 110),
    GGMLQuantizationType.MXFP4: (32, 17), GGMLQuantizationType.IQ4_NL: (32, 18),
    GGMLQuantizationType.IQ4_XS: (256, 136), GGMLQuantizationType.Q2_K: (256, 84),
    GGMLQuantizationType.IQ3_XXS: (256, 98), GGMLQuantizationType.IQ3_S: (256, 110),
    GGMLQuantizationType.IQ2_XXS: (256, 66), GGMLQuantizationType.IQ2_XS: (256, 74),
    GGMLQuantizationType.IQ2_S: (256, 82), GGMLQuantizationType.IQ1_S: (256, 50), GGMLQuantizationType.IQ1_M: (256, 56),
}  # fmt: skip
_LOW_BIT = {
    GGMLQuantizationType.Q5_0: "q5_0", GGMLQuantizationType.Q5_1: "q5_1", GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k", GGMLQuantizationType.MXFP4: "mxfp4",
    GGMLQuantizationType.IQ4_NL: "iq4_nl", GGMLQuantizationType.IQ4_XS: "iq4_xs", GGMLQuantizationType.Q3_K: "q3_k",
    GGMLQuantizationType.Q2_K: "q2_k", GGMLQuantizationType.IQ3_XXS: "iq3_xxs", GGMLQuantizationType.IQ3_S: "iq3_s",
    GGMLQuantizationType.IQ2_XXS: "iq2_xxs", GGMLQuantizationType.IQ2_XS: "iq2_xs",
    GGMLQuantizationType.IQ2_S: "iq2_s", GGMLQuantizationType.IQ1_S: "iq1_s", GGMLQuantizationType.IQ1_M: "iq1_m",
}  # fmt: skip


def parse_blocks(blocks: np.ndarray, kind: GGMLQuantizationType) -> QuantizedWeight:
    """`[N, K / block elements, block bytes]` uint8 blocks of one type (`BLOCKS`) -> its weight (copied out of the
    file)."""
    if kind in _LOW_BIT:
        return decode_blocks(torch.from_numpy(np.array(blocks)), _LOW_BIT[kind])
    rows = blocks.shape[0]
    scales = _float16(blocks, 0)
    if kind == GGMLQuantizationType.Q8_0:
        qs = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(rows, -1)
        return Q8Weight(torch.from_numpy(qs.copy()), torch.from_numpy(scales))
    if kind == GGMLQuantizationType.Q4_1:
        mins, nibbles = _float16(blocks, 2), blocks[..., 4:20]
    else:
        mins, nibbles = (-8.0 * scales).astype(np.float16), blocks[..., 2:18]  # exact: a power of two
    qs = np.ascontiguousarray(nibbles).reshape(rows, -1)
    return Q4Weight(torch.from_numpy(qs.copy()), torch.from_numpy(scales), torch.from_numpy(mins))


def _float16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block, as a contiguous `[N, K/32]` float16 array."""
    raw = np.ascontiguousarray(blocks[..., offset : offset + 2])
    return np.ascontiguousarray(raw.view(np.float16)[..., 0])


def dequantize_blocks(data: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor | None:
    """The fp32 values of a matrix's blocks `data` (`[rows, bytes a row]`, a GGUF tensor's bytes), or None when its
    type is not one of `BLOCKS` or it is not a matrix."""
    if kind not in BLOCKS or data.ndim != 2:
        return None
    return parse_blocks(data.reshape(data.shape[0], -1, BLOCKS[kind][1]), kind).dequantize()
