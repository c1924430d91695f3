"""A GGUF file's quantized blocks parsed as they are (`parse_blocks`): Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and llama.cpp's
K-quants Q4_K, Q5_K and Q6_K, each type's block layout (`BLOCKS`), and their values (`dequantize_blocks`); and
MXFP4's (gpt-oss's experts), parsed as the Q5_0 blocks that hold the same values (`mxfp4_as_q5_0`).

Block layouts (32 elements each, float16 scales): Q4_0 `d, qs[16]` (element = d * (q - 8)); Q4_1 `d, m, qs[16]`
(element = d * q + m); Q8_0 `d, qs[32] int8` (element = d * q). A nibble byte j holds element j low and j + 16
high. The 5-bit and K-quant blocks are decoded by `layers.lowbit_weight.decode_blocks` (K-quant blocks are 256
wide). The values equal gguf's own dequantization bit for bit, in torch (2-3x gguf's numpy on two cores).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine_server.layers.lowbit_weight import LowBitWeight, decode_blocks
from engine_server.layers.quantized_linear import Q4Weight, Q8Weight, QuantizedWeight

# Each type's block: (elements, bytes); the low-bit ones' kind names (`layers.lowbit_weight`).
BLOCKS = {
    GGMLQuantizationType.Q4_0: (32, 18), GGMLQuantizationType.Q4_1: (32, 20), GGMLQuantizationType.Q8_0: (32, 34),
    GGMLQuantizationType.Q5_0: (32, 22), GGMLQuantizationType.Q5_1: (32, 24), GGMLQuantizationType.Q4_K: (256, 144),
    GGMLQuantizationType.Q5_K: (256, 176), GGMLQuantizationType.Q6_K: (256, 210),
}  # fmt: skip
# MXFP4 (llama.cpp's layout): per 32 elements an E8M0 exponent byte e, then 16 bytes of e2m1 codes (element j the low
# nibble of byte j, element j + 16 its high nibble); element = E2M1[code] * 2 ** (e - 127). Served as Q5_0 blocks
# (`mxfp4_as_q5_0`: the Q5_0 weight of its values), so `SERVED_BLOCKS` holds it beside `BLOCKS`.
MXFP4_BLOCK = (32, 17)
SERVED_BLOCKS = {**BLOCKS, GGMLQuantizationType.MXFP4: MXFP4_BLOCK}
# Twice each e2m1 code's value (an integer in -12..12) and the exponent bias that halving moves to: Q5_0's scale.
_DOUBLED_E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)
_HALF_SCALE_BIAS = 128
# The float16 powers of two (subnormal ones included): a Q5_0 scale outside them cannot hold the block's.
_FLOAT16_EXPONENTS = (-24, 15)


def _mxfp4_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per MXFP4 byte (the codes of elements j and j + 16), both elements' u = doubled value + 16 (Q5_0's unsigned
    5-bit value) as one little-endian uint16, element j's in its low byte; per exponent byte, the Q5_0 scale
    2 ** (e - 128) in float16 (0 below float16's powers of two)."""
    codes = np.arange(256)
    low, high = _DOUBLED_E2M1[codes & 0x0F] + 16, _DOUBLED_E2M1[codes >> 4] + 16
    exponents = codes - _HALF_SCALE_BIAS
    scales = np.where(exponents < _FLOAT16_EXPONENTS[0], 0.0, np.ldexp(1.0, np.minimum(exponents, 15)))
    return (low | (high << 8)).astype("<u2"), scales.astype(np.float16)


_MXFP4_PAIRS, _MXFP4_SCALES = _mxfp4_tables()


_LOW_BIT = {
    GGMLQuantizationType.Q5_0: "q5_0", GGMLQuantizationType.Q5_1: "q5_1", GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k",
}  # fmt: skip


def parse_blocks(blocks: np.ndarray, kind: GGMLQuantizationType) -> QuantizedWeight:
    """`[N, K / block elements, block bytes]` uint8 blocks of one type (`SERVED_BLOCKS`) -> its weight (copied out of
    the file; MXFP4's as Q5_0, `mxfp4_as_q5_0`)."""
    if kind == GGMLQuantizationType.MXFP4:
        return mxfp4_as_q5_0(blocks)
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


def mxfp4_as_q5_0(blocks: np.ndarray) -> LowBitWeight:
    """MXFP4 blocks `[N, K / 32, 17]` -> the `q5_0` `LowBitWeight` of the same values: each code's value doubled is
    an integer q in -12..12, held as u = q + 16 (Q5_0's element is scale * (u - 16)) under scale 2 ** (e - 128),
    exact in float16 for e in 104..143. A block with a smaller exponent (every value under 12 * 2 ** -25) reads as
    zeros; ValueError for a larger one (values past float16's range)."""
    exponents = blocks[..., 0]
    if (exponents > _HALF_SCALE_BIAS + _FLOAT16_EXPONENTS[1]).any():
        raise ValueError(f"MXFP4 scale exponents up to {int(exponents.max()) - 127} are past float16's range")
    pairs = np.take(_MXFP4_PAIRS, blocks[..., 1:17]).view(np.uint8)  # [..., 16 bytes j, 2]: u of j, of j + 16
    values = np.ascontiguousarray(pairs.reshape(*pairs.shape[:-1], 16, 2).swapaxes(-1, -2))  # 0..15, then 16..31
    scales = torch.from_numpy(_MXFP4_SCALES[exponents])
    shifts = (-16.0 * scales.float()).half()  # exact: a power of two
    return LowBitWeight("q5_0", torch.from_numpy(values.reshape(len(blocks), -1)),
                        torch.stack([scales, shifts], -1).contiguous())  # fmt: skip


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
