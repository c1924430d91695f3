"""Rounding to float8 e4m3 inside Triton kernels, the same on the hardware and under Triton's interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32 and with v's sign
    (-0 for a small negative v): |v|'s step at 3 mantissa bits (2^(e - 3) for its exponent e, at least the
    subnormals' 2^-9) from its bits, and the rounding by adding and taking away 1.5 * 2^23 steps. The cast to e4m3
    after it is then exact; Triton's interpreter rounds a cast whose mantissa carries into the exponent wrongly
    (124.3 -> 64), the hardware does not."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    inverse = ((257 - exponent) << 23).to(tl.float32, bitcast=True)
    magnitude = ((tl.abs(v) * inverse + 12582912.0) - 12582912.0) * step
    return (magnitude.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def scaled_to_e4m3(x, scale, MAX: tl.constexpr):
    """float32 x / scale, correctly rounded, clamped to +-MAX (448) and rounded to e4m3 (`round_to_e4m3`): how
    `ladle_kernels.reference.fp8_quantize_per_token` rounds each value against its row's scale."""
    return round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -MAX), MAX))


@triton.jit
def e4m3_bits(v):
    """The e4m3 byte (uint8) of float32 v, a value e4m3 holds exactly (`round_to_e4m3`'s): sign, then 4 exponent bits
    (bias 7) and 3 mantissa bits, or for |v| < 2^-6 a subnormal's multiple of 2^-9. Bit arithmetic, not Triton's
    float8 type: that needs sm_89 or newer, this runs on every GPU and under the interpreter."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    normal = ((exponent - 120) << 3) | ((bits >> 20) & 7)
    subnormal = (tl.abs(v) * 512.0).to(tl.int32)
    return (tl.where(exponent >= 121, normal, subnormal) | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def e4m3_value(byte):
    """The float32 value of an e4m3 byte (uint8), exactly (`e4m3_bits`' inverse; the byte 0x7F/0xFF, e4m3fn's NaN,
    is never written and reads as ±480)."""
    b = byte.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    magnitude = tl.where(exponent == 0, subnormal, normal)
    return (magnitude | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
