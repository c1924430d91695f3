"""GGUF's 5-bit groups (Q5_0, Q5_1), llama.cpp's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), its non-linear IQ4_NL and
IQ4_XS, its grid types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M), and MXFP4, as the CPU kernels serve
them.

A `LowBitWeight` holds what a file's blocks say, element by element: each value `u` (unsigned, 0..31 or 0..63) and
the scales that make it a weight, in the forms the blocks store them, so `dequantize` gives the gguf package's
reference values bit for bit and the kernels multiply the very weights llama.cpp does:
- `q5_0` / `q5_1` (groups of 32): `groups` [N, K/32, 2] float16 (scale, min): element = scale * u + min (Q5_0's
  min is -16 * scale, exact: a power of two);
- `q4_k` / `q5_k` (super-blocks of 256, eight groups of 32): `supers` [N, K/256, 2] float16 (d, dmin) and `groups`
  [N, K/32, 2] uint8 (the 6-bit sc, m): element = (d * sc) * u - dmin * m, in float32;
- `q6_k` (super-blocks of 256, sixteen groups of 16): `supers` [N, K/256, 2] float16 (d, 0) and `groups` [N, K/32,
  2] int8 (the scales of each group of 32's two halves): element = (d * sc) * (u - 32), in float32; `q3_k` likewise
  with 3-bit values (0..7) and each half's 6-bit scale less 32: element = (d * sc) * (u - 4);
- `q2_k` (super-blocks of 256, sixteen groups of 16): 2-bit values (0..3), `supers` [N, K/256, 2] float16 (d, dmin)
  and `groups` [N, K/32, 2] uint8 (each half's byte as stored: sc | m << 4, both 4-bit): element = (d * sc) * u -
  dmin * m, in float32;
- `mxfp4` (groups of 32; gpt-oss's experts): `u` the e2m1 codes (0..15) and `groups` [N, K/32, 1] uint8 (the E8M0
  exponent e): element = E2M1[u] * 2 ** (e - 127), computed as gguf does, twice the value times 2 ** (e - 128);
- `iq4_nl` (groups of 32): `u` the codes (0..15) of IQ4's codebook `IQ4_VALUES` and `groups` [N, K/32, 1] float16
  (d): element = d * IQ4_VALUES[u];
- `iq4_xs` (super-blocks of 256): the same codes, `supers` [N, K/256, 1] float16 (d) and `groups` [N, K/32, 1] int8
  (each group's 6-bit scale less 32): element = (d * sc) * IQ4_VALUES[u], in float32;
- `iq3_xxs`, `iq3_s`, `iq2_xxs` (super-blocks of 256 whose groups of 32 pick runs of 4 or 8 values from a grid of
  magnitudes, each with its sign): `u` each element's code in the kind's 16-entry `CODEBOOKS` (its magnitude's index
  in the grid's values, plus 8 when negative) and `groups` [N, K/32, 1] float32, each group's scale as gguf computes
  it from d and the group's scale bits: element = scale * CODEBOOKS[kind][u]; `iq1_s` likewise, its runs of 8 from
  a grid of -1, 0, 1 shifted by the group's delta (+-1/8): its codebook holds 8 (g + delta), its scale is gguf's over
  8;
- `iq2_xs`, `iq2_s` (likewise, runs of 8 from grids of 512 and 1024 entries of 8, 25, 43, scaled per half of a group):
  `u` the codes of `IQ2_CODEBOOK`, `supers` [N, K/256, 1] float16 (d) and `groups` [N, K/32, 2] uint8 (each half's
  4-bit scale s): element = (d * (0.5 + s) * 0.25) * IQ2_CODEBOOK[u], in float32; `iq1_m` likewise (IQ1_S's grid
  and codebook, a delta per run of 8, 3-bit s): element = (d * (2s + 1)) * (CODEBOOKS["iq1_s"][u] / 8).
`pack_lowbit` lays one out in the kernels' blocks of 8 output features (ladle_kernels/cpu/lowbit_tiles.h): Q2_K's values
in a 2-bit plane of their own, the others' in a nibble plane with their high bits after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ladle_kernels.reference import QUANT_GROUP

SUPER_BLOCK = 256
# Each kind's high bits a value (over the nibble) and whether its scales are per super-block (K-quants).
HIGH_BITS = {
    "q5_0": 1, "q5_1": 1, "q2_k": 0, "q3_k": 0, "q4_k": 0, "q5_k": 1, "q6_k": 2, "mxfp4": 0, "iq4_nl": 0, "iq4_xs": 0,
    "iq3_xxs": 0, "iq3_s": 0, "iq2_xxs": 0, "iq2_xs": 0, "iq2_s": 0, "iq1_s": 0, "iq1_m": 0,
}  # fmt: skip
K_QUANTS = frozenset({"q2_k", "q3_k", "q4_k", "q5_k", "q6_k"})
TWO_BIT_KINDS = frozenset({"q2_k"})  # values 0..3, packed 2 bits each with no nibble plane
TWO_BIT_PLANE = 64  # bytes of a 2-bit group of 8 features: the layout of a nibble plane's two high-bit planes
# The value offsets of the kinds scaled per half of a group (16 elements): element = (d * sc) * (u - offset).
HALF_GROUP_OFFSETS = {"q6_k": 32, "q3_k": 4}
# The kinds whose file blocks are 256 wide (scaled per super-block, or grid kinds): slices fall on them.
SUPER_KINDS = K_QUANTS | {"iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m"}
# IQ4_NL's (and IQ4_XS's) non-linear codebook (llama.cpp's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The grid types' magnitudes (gguf's `grid_map`s, llama.cpp's grids' values); a code is a magnitude's index, plus 8
# for its negative.
GRID_VALUES = {"iq3_xxs": (4, 12, 20, 28, 36, 44, 52, 62), "iq3_s": (1, 3, 5, 7, 9, 11, 13, 15), "iq2_xxs": (8, 25, 43)}
CODEBOOKS = {kind: (*v, *[0] * (8 - len(v)), *[-x for x in v], *[0] * (8 - len(v))) for kind, v in GRID_VALUES.items()}
# IQ1_S's: a code is (g + 1) + 3 (delta < 0) for its grid value g in -1, 0, 1 and its group's delta +-1/8, the
# value 8 (g + delta).
CODEBOOKS["iq1_s"] = (-7, 1, 9, -9, -1, 7, *[0] * 10)
GRID_KINDS = frozenset(CODEBOOKS)
# IQ2_XS's and IQ2_S's magnitudes and codebook (ladle_kernels/cpu/lowbit_tiles.h's kIQ2Values): scaled per half of a
# group.
HALF_GRID_KINDS = frozenset({"iq2_xs", "iq2_s", "iq1_m"})
IQ2_CODEBOOK = CODEBOOKS["iq2_xxs"]
# Twice each e2m1 code's value: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negative (code 8 is -0).
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass(frozen=True)
class LowBitWeight:
    """A weight `[N, K]` of one of `HIGH_BITS`' kinds (see the module docstring): `values` `[N, K]` uint8, `groups`
    `[N, K/32, 2]`, `supers` `[N, K/256, 2]` float16 for the K-quants (None otherwise)."""

    kind: str
    values: torch.Tensor
    groups: torch.Tensor
    supers: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1]

    @property
    def column_step(self) -> int:
        """The columns a slice of this weight must start and end on: its block's width."""
        return SUPER_BLOCK if self.kind in SUPER_KINDS else QUANT_GROUP

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, op for op as the gguf package's dequantizer computes it."""
        rows = self.values.shape[0]
        if self.kind == "mxfp4":
            doubled = torch.tensor(E2M1_DOUBLED, dtype=torch.float32)[self.values.long()]
            scale = _e8m0_half_scales(self.groups[..., 0]).repeat_interleave(QUANT_GROUP, dim=1)
            return doubled * scale
        if self.kind in HALF_GRID_KINDS:  # as gguf: (d * (0.5 + s) * 0.25 * magnitude) * sign; IQ1_M's d (2s + 1)
            assert self.supers is not None
            codebook = torch.tensor(CODEBOOKS["iq1_s"] if self.kind == "iq1_m" else IQ2_CODEBOOK, dtype=torch.float32)
            v = codebook[self.values.long()].reshape(rows, -1, 16)
            d = self.supers[..., 0].float().repeat_interleave(SUPER_BLOCK // 16, dim=1)
            s = self.groups.reshape(rows, -1)
            if self.kind == "iq1_m":  # times g + delta, exactly v / 8
                return ((d * (2 * s + 1).float()).unsqueeze(-1) * (v * 0.125)).reshape(self.shape)
            scale = d * (0.5 + s.float()) * 0.25
            return (scale.unsqueeze(-1) * v).reshape(self.shape)
        if self.kind in GRID_KINDS:  # as gguf: (scale * magnitude) * sign, the same bits as scale * (sign * magnitude)
            v = torch.tensor(CODEBOOKS[self.kind], dtype=torch.float32)[self.values.long()]
            return (self.groups[..., 0].unsqueeze(-1) * v.reshape(rows, -1, QUANT_GROUP)).reshape(self.shape)
        if self.kind in ("iq4_nl", "iq4_xs"):
            v = torch.tensor(IQ4_VALUES, dtype=torch.float32)[self.values.long()].reshape(rows, -1, QUANT_GROUP)
            scale = self.groups[..., 0].float()
            if self.kind == "iq4_xs":
                assert self.supers is not None
                per_group = SUPER_BLOCK // QUANT_GROUP
                scale = self.supers[..., 0].float().repeat_interleave(per_group, dim=1) * scale
            return (scale.unsqueeze(-1) * v).reshape(self.shape)
        if self.kind not in K_QUANTS:
            u = self.values.reshape(rows, -1, QUANT_GROUP).float()
            scale, shift = self.groups.float().unbind(-1)
            if self.kind == "q5_0":  # scale * (u - 16), as gguf: the same value, and -0.0 where it is zero
                return (scale.unsqueeze(-1) * (u - 16.0)).reshape(self.shape)
            return (scale.unsqueeze(-1) * u + shift.unsqueeze(-1)).reshape(self.shape)
        assert self.supers is not None
        d, dmin = self.supers.float().unbind(-1)
        if self.kind == "q2_k":  # as gguf: (d * sc) * u - dmin * m per half of 16
            u = self.values.reshape(rows, -1, QUANT_GROUP // 2).float()
            halves = self.groups.reshape(rows, -1)
            scale = d.repeat_interleave(16, dim=1) * (halves & 0x0F).float()
            shift = dmin.repeat_interleave(16, dim=1) * (halves >> 4).float()
            return (scale.unsqueeze(-1) * u - shift.unsqueeze(-1)).reshape(self.shape)
        if self.kind in HALF_GROUP_OFFSETS:
            u = self.values.reshape(rows, -1, QUANT_GROUP // 2).float() - float(HALF_GROUP_OFFSETS[self.kind])
            sc = self.groups.reshape(rows, -1).float()
            return ((d.repeat_interleave(16, dim=1) * sc).unsqueeze(-1) * u).reshape(self.shape)
        u = self.values.reshape(rows, -1, QUANT_GROUP).float()
        sc, m = self.groups.float().unbind(-1)
        per_group = SUPER_BLOCK // QUANT_GROUP
        scale = d.repeat_interleave(per_group, dim=1) * sc
        shift = dmin.repeat_interleave(per_group, dim=1) * m
        return (scale.unsqueeze(-1) * u - shift.unsqueeze(-1)).reshape(self.shape)

    def rows(self, index: torch.Tensor) -> LowBitWeight:
        """The weight of rows `index` (a 1-D long tensor), in that order."""
        supers = None if self.supers is None else self.supers[index]
        return replace(self, values=self.values[index], groups=self.groups[index], supers=supers)

    def columns(self, start: int, stop: int) -> LowBitWeight:
        """Columns [start, stop), which must fall on `column_step`. Raises ValueError where they do not."""
        step = self.column_step
        if start % step or stop % step:
            raise ValueError(f"columns {start}..{stop} of a {self.kind} weight do not fall on blocks of {step}")
        supers = None if self.supers is None else self.supers[:, start // SUPER_BLOCK : stop // SUPER_BLOCK]
        groups = self.groups[:, start // QUANT_GROUP : stop // QUANT_GROUP]
        return replace(self, values=self.values[:, start:stop], groups=groups, supers=supers)


def _e8m0_half_scales(exponents: torch.Tensor) -> torch.Tensor:
    """2 ** (e - 128) in float32 for uint8 exponents e, built as a float's bits (subnormal below e = 2), as gguf's
    `e8m0_to_fp32_half` builds them."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def concat_lowbit(weights: list[LowBitWeight]) -> LowBitWeight:
    """Shards of one kind as one weight, rows in order. Raises ValueError on mixed kinds."""
    kinds = {w.kind for w in weights}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse shards of different kinds {sorted(kinds)}")
    supers = None if weights[0].supers is None else torch.cat([w.supers for w in weights if w.supers is not None])
    return replace(
        weights[0],
        values=torch.cat([w.values for w in weights]),
        groups=torch.cat([w.groups for w in weights]),
        supers=supers,
    )


def pad_lowbit(weight: LowBitWeight, rows: int) -> LowBitWeight:
    """`weight` with `rows` rows of zeros after its own (every element 0)."""
    if rows == 0:
        return weight

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_zeros(rows, *tensor.shape[1:])])

    supers = None if weight.supers is None else padded(weight.supers)
    return replace(weight, values=padded(weight.values), groups=padded(weight.groups), supers=supers)


def pack_lowbit(
    weight: LowBitWeight, planes: Callable[[torch.Tensor, int], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, scales, mins) in ladle_kernels/cpu/lowbit_tiles.h's layout, for `torch.ops.ladle_cpu.packed_linear`:
    packed `[N/8, K/32, 1, 128 + 32 * high bits]` uint8; for `q5_*` scales and mins `[N/8, K/32, 8]` float16; for
    the K-quants scales `[N/8, K/256, 16]` float16 (8 features' d, then their dmin) and mins `[N/8, K/32, 16]` (8
    features' sc, then their m; Q6_K, Q3_K: the halves' int8 scales); Q5_0's mins empty (the kernel takes -16 *
    scale); for `mxfp4` scales `[N/8, K/32, 8]` uint8 (the exponents), mins an empty uint8 tensor; for `iq4_nl`
    scales `[N/8, K/32, 8]` float16, mins an empty int8 tensor; for `iq4_xs` scales `[N/8, K/256, 8]` float16 and
    mins `[N/8, K/32, 8]` int8; for the grid kinds scales `[N/8, K/32, 8]` float32 and mins the kind's codebook, 16
    int8 values; for IQ2_XS, IQ2_S and IQ1_M scales `[N/8, K/256, 8]` float32 (d) and mins `[N/8, K/32, 16]` (each
    half's 2s + 1: int8, IQ1_M's uint8).
    For `q2_k` packed is `[N/8, K/32, 1, 64]`: the values' 2-bit plane alone (laid out as the two high-bit planes of
    `u << 4`, whose nibbles are empty), scales and mins as the other K-quants' (mins: the halves' uint8 sc | m << 4).
    Rows past N are zero. `planes(values, high bits)` makes packed where given (the C++ `lowbit_planes`, ~10x
    faster than the torch ops here, which are its reference)."""
    n = weight.shape[0]
    padded = pad_lowbit(weight, -(-n // 8) * 8 - n)
    two_bit = weight.kind in TWO_BIT_KINDS
    bits = 2 if two_bit else HIGH_BITS[weight.kind]
    if planes is not None:
        values = weight.values << 4 if two_bit else weight.values
        packed = planes(values.contiguous(), bits)
    else:
        packed = _planes(padded.values << 4 if two_bit else padded.values, bits)
    if two_bit:  # the nibble plane is empty: drop it
        packed = packed[..., -TWO_BIT_PLANE:].contiguous()
    return _lowbit_tables(weight.kind, padded, packed)


def _planes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The torch reference of the C++ `lowbit_planes`: values `[N, K]` (N a multiple of 8) with `bits` high bits over
    each nibble -> `[N/8, K/32, 1, 128 + 32 * bits]` uint8 (ladle_kernels/cpu/lowbit_tiles.h's layout)."""
    blocks, groups = values.shape[0] // 8, values.shape[1] // QUANT_GROUP
    # [block, feature j, group, half, chunk c, byte i]: element 32g + 16 half + 4c + i of feature j.
    u = values.reshape(blocks, 8, groups, 2, 4, 4)
    nibbles = (u[:, :, :, 0] & 0x0F) | ((u[:, :, :, 1] & 0x0F) << 4)
    made = [nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 128)]
    high = u >> 4
    if bits == 1:  # byte 4j + i: bit 2c that of element 4c + i, bit 2c + 1 that of 16 + 4c + i
        shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)  # uint8 throughout: no widening
        byte = ((high[:, :, :, 0] << shifts) | (high[:, :, :, 1] << (shifts + 1))).sum(3, dtype=torch.uint8)
        made.append(byte.permute(0, 2, 1, 3).reshape(blocks, groups, 32))
    elif bits == 2:  # chunks 2v and 2v + 1 in bytes 32v ..: bits 4(c % 2) .. +1 of 4c + i, +2 .. +3 of 16 + 4c + i
        shifts = (4 * (torch.arange(4, dtype=torch.uint8) % 2)).view(1, 1, 1, 4, 1)
        parts = (high[:, :, :, 0] << shifts) | (high[:, :, :, 1] << (shifts + 2))  # [block, j, group, c, i]
        byte = parts.reshape(blocks, 8, groups, 2, 2, 4).sum(4, dtype=torch.uint8)  # [block, j, group, v, i]
        made.append(byte.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 64))
    return torch.cat(made, -1).to(torch.uint8).reshape(blocks, groups, 1, -1).contiguous()


def _lowbit_tables(
    kind: str, padded: LowBitWeight, packed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_lowbit`'s result: `packed` with the scale tables of `padded` (the weight with its rows padded to whole
    blocks of 8) laid out as the kernels read them."""
    blocks, groups = packed.shape[0], packed.shape[1]

    def by_feature(table: torch.Tensor) -> torch.Tensor:  # [N, ..., 1] -> [block, ..., feature j]
        return table.reshape(blocks, 8, -1).permute(0, 2, 1).contiguous()

    if kind in HALF_GRID_KINDS:  # d per super-block; each half's 2s + 1, 8 features' first halves then second
        assert padded.supers is not None
        halves = padded.groups.reshape(blocks, 8, groups, 2).permute(0, 2, 3, 1).reshape(blocks, groups, 16)
        # d in float32 (no K-quant's float16 table reads as one), the halves int8 for the IQ2 kinds and uint8 for
        # IQ1_M (the dtype tells the kernels which codebook)
        scales = by_feature(padded.supers).float()
        return packed, scales, (2 * halves + 1).to(torch.uint8 if kind == "iq1_m" else torch.int8)
    if kind in GRID_KINDS:  # each group's float32 scale; the kind's codebook in place of mins
        return packed, by_feature(padded.groups), torch.tensor(CODEBOOKS[kind], dtype=torch.int8)
    if kind in ("mxfp4", "iq4_nl"):  # the exponents, or d, per group; no mins (their empty table's dtype: the kind)
        return packed, by_feature(padded.groups), torch.empty(0, dtype=torch.uint8 if kind == "mxfp4" else torch.int8)
    if kind == "iq4_xs":  # d per super-block; the groups' int8 scales
        assert padded.supers is not None
        return packed, by_feature(padded.supers), by_feature(padded.groups)
    # Tables: [N, ..., 2] -> [block, ..., 2, feature j] -> [block, ..., 16] (or the two halves [block, ..., 8]).
    table = padded.groups.reshape(blocks, 8, groups, 2).permute(0, 2, 3, 1)
    if padded.supers is None:  # Q5_0's mins are -16 * its scales: the kernel computes them (an empty table)
        mins = table[:, :, 1].contiguous() if kind == "q5_1" else torch.empty(0, dtype=torch.float16)
        return packed, table[:, :, 0].contiguous(), mins
    supers = padded.supers.reshape(blocks, 8, -1, 2).permute(0, 2, 3, 1).reshape(blocks, -1, 16)
    return packed, supers.contiguous(), table.reshape(blocks, groups, 16).contiguous()


def unpack_nibbles(blocks: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """Feature `feature[r]` of `blocks[r]` (`[R, K/32, 128]` uint8, the kernels' nibble plane) -> `[R, K/32, 32]`
    nibbles: byte 4j + i of a group's 32-byte chunk c holds feature j's element 4c + i (low nibble) and 16 + 4c + i
    (high)."""
    rows = torch.arange(len(feature))
    chunks = blocks.reshape(len(feature), blocks.shape[1], 4, 8, 4)[rows, :, :, feature]  # [R, groups, c, i]
    return torch.cat([(chunks & 0x0F).flatten(2), (chunks >> 4).flatten(2)], -1)


def unpack_lowbit_rows(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, kind: str, index: torch.Tensor
) -> LowBitWeight:
    """Rows `index` of a weight `pack_lowbit` packed into (packed, scales, mins): its inverse, row by row."""
    block, feature = index // 8, index % 8
    rows = torch.arange(len(index))
    planes = packed[block, :, 0]  # [R, groups, bytes]
    count, groups = planes.shape[:2]
    two_bit = kind in TWO_BIT_KINDS
    if two_bit:  # the 2-bit plane holds u as two high-bit planes hold u >> 4: unpack u << 4 (an empty nibble)
        planes = torch.cat([planes.new_zeros(count, groups, 128), planes], -1)
    u = unpack_nibbles(planes[..., :128], feature).reshape(count, groups, 2, 4, 4)  # [R, g, half, c, i]
    bits = 2 if two_bit else HIGH_BITS[kind]
    if bits == 1:  # byte 4j + i: bit 2c that of element 4c + i, bit 2c + 1 that of 16 + 4c + i
        byte = planes[..., 128:].reshape(count, groups, 8, 4)[rows, :, feature].unsqueeze(2)  # [R, g, 1, i]
        shifts = (2 * torch.arange(4)).view(1, 1, 4, 1)
        high = torch.stack([(byte >> shifts) & 1, (byte >> (shifts + 1)) & 1], 2)
    elif bits == 2:  # byte 32v + 4j + i: bits 4w .. +1 of element 4(2v + w) + i, bits 4w + 2 .. +3 of 16 + that
        byte = planes[..., 128:].reshape(count, groups, 2, 8, 4)[rows, :, :, feature].unsqueeze(3)  # [R, g, v, 1, i]
        shifts = (4 * torch.arange(2)).view(1, 1, 1, 2, 1)
        pairs = [((byte >> (shifts + 2 * half)) & 3).reshape(count, groups, 4, 4) for half in (0, 1)]
        high = torch.stack(pairs, 2)
    else:
        high = torch.zeros_like(u)
    values = (u | (high << 4)).reshape(count, -1)
    if two_bit:
        values = values >> 4
    if kind in ("mxfp4", "iq4_nl") or kind in GRID_KINDS:  # scales [blocks, groups, 8]: the exponents, d or scale
        return LowBitWeight(kind, values, scales[block, :, feature].unsqueeze(-1))
    if kind == "iq4_xs":  # scales [blocks, supers, 8]: d; mins [blocks, groups, 8]: sc
        supers = scales[block, :, feature].unsqueeze(-1)
        return LowBitWeight(kind, values, mins[block, :, feature].unsqueeze(-1), supers)
    if kind in HALF_GRID_KINDS:  # scales [blocks, supers, 8]: d (float32); mins [blocks, groups, 16]: 2s + 1
        halves = torch.stack([mins[block, :, feature], mins[block, :, 8 + feature]], -1)
        supers = scales[block, :, feature].half().unsqueeze(-1)  # float16's values, held in float32
        return LowBitWeight(kind, values, ((halves - 1) // 2).to(torch.uint8), supers)
    if kind in K_QUANTS:  # scales [blocks, supers, 16]: 8 features' d then their dmin; mins likewise sc then m
        supers = torch.stack([scales[block, :, feature], scales[block, :, 8 + feature]], -1)
        table = torch.stack([mins[block, :, feature], mins[block, :, 8 + feature]], -1)
        return LowBitWeight(kind, values, table, supers.reshape(count, -1, 2))
    scale = scales[block, :, feature]
    shift = mins[block, :, feature] if kind == "q5_1" else -16 * scale  # Q5_0's min, exact in float16
    return LowBitWeight(kind, values, torch.stack([scale, shift], -1))


def _nibble_codes(qs: torch.Tensor) -> torch.Tensor:
    """Bytes `[..., 16]` each holding codes j (low nibble) and j + 16 (high) -> the 32 codes `[..., 32]`, uint8."""
    codes = torch.empty(*qs.shape[:-1], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=codes[..., :16])
    torch.bitwise_right_shift(qs, 4, out=codes[..., 16:])
    return codes


@functools.cache
def _grid_codes(kind: str) -> torch.Tensor:
    """A grid kind's grid as codes: `[entries, 4 or 8]` uint8, each value's index in the kind's magnitudes (the gguf
    package's grids and `grid_map`s, llama.cpp's grids)."""
    from gguf import quants

    quant = getattr(quants, kind.upper())
    quant.init_grid()
    grid = quant.grid
    assert grid is not None
    values = torch.from_numpy(grid.reshape(grid.shape[-2], grid.shape[-1]).copy())
    magnitudes = torch.tensor(quant.grid_map, dtype=torch.float32)  # IQ1's -1, 0, 1: its index is g + 1
    return (values.unsqueeze(-1) == magnitudes).int().argmax(-1).byte()


@functools.cache
def _sign_patterns() -> torch.Tensor:
    """llama.cpp's `ksigns_iq2xs`: 7 stored sign bits -> the 8 signs of a run (the eighth makes the count of
    negatives even), as `[128, 8]` uint8 (1: negative)."""
    from gguf import quants

    patterns = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)
    return (patterns.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1


def _grid_signs(words: torch.Tensor) -> torch.Tensor:
    """The signs of the four runs of 8 that each uint32 of `words` (as int64) holds in 7-bit indices at bits 0, 7, 14,
    21 -> `[..., 32]` uint8 (1: negative)."""
    index = (words.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21])) & 0x7F
    return _sign_patterns()[index].flatten(-2)


def _decode_grid(blocks: torch.Tensor, kind: str, half: Callable[[int], torch.Tensor]) -> LowBitWeight:
    """IQ3_XXS `d, qs[64], words[8] (uint32)`: group i's 8 grid indices qs[8i ..] (4 values each), its signs and 4-bit
    scale s (bits 28..31) in words[i], scale d * (0.5 + s) * 0.5; IQ2_XXS `d, then per group 4 grid indices (8 values
    each) and a uint32 as IQ3_XXS's`, scale d * (0.5 + s) * 0.25; IQ3_S `d, qs[64], qh[8], signs[32], scales[4]`:
    grid index qs[j] | bit j % 8 of qh[j / 8] << 8 (4 values each), one sign bit an element, group i's 4-bit scale
    s the nibble i of scales (low first), scale d * (1 + 2 * s). Element = scale * magnitude * sign, gguf's order."""
    rows, count = blocks.shape[0], blocks.shape[1]
    grid, d = _grid_codes(kind), half(0).float().unsqueeze(-1)  # d: [N, blocks, 1]

    def words(part: torch.Tensor) -> torch.Tensor:  # little-endian uint32s as int64
        return (part.reshape(*part.shape[:-1], -1, 4).long() << torch.tensor([0, 8, 16, 24])).sum(-1)

    if kind == "iq3_xxs":
        magnitudes = grid[blocks[..., 2:66].long()].reshape(rows, count, 8, 32)
        scale_words = words(blocks[..., 66:98])  # [N, blocks, 8]
        signs = _grid_signs(scale_words)
        scale = d * (0.5 + (scale_words >> 28).float()) * 0.5
    elif kind == "iq2_xxs":
        parts = blocks[..., 2:66].reshape(rows, count, 8, 8)
        magnitudes = grid[parts[..., :4].long()].reshape(rows, count, 8, 32)
        scale_words = words(parts[..., 4:8]).squeeze(-1)
        signs = _grid_signs(scale_words)
        scale = d * (0.5 + (scale_words >> 28).float()) * 0.25
    else:  # iq3_s
        high = (blocks[..., 66:74].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        index = blocks[..., 2:66].long() | (high.reshape(rows, count, 64).long() << 8)
        magnitudes = grid[index].reshape(rows, count, 8, 32)
        bits = (blocks[..., 74:106].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        signs = bits.reshape(rows, count, 8, 32)
        nibbles = (blocks[..., 106:110].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0x0F
        scale = d * (1 + 2 * nibbles.reshape(rows, count, 8)).float()
    codes = (magnitudes | (signs << 3)).reshape(rows, -1)
    return LowBitWeight(kind, codes, scale.reshape(rows, -1, 1).contiguous())


def _decode_iq1_s(blocks: torch.Tensor, half: Callable[[int], torch.Tensor]) -> LowBitWeight:
    """IQ1_S `d, qs[32], qh[8] (uint16)`: group i's run j of 8 is grid entry qs[4i + j] | bits 3j .. 3j + 2 of qh[i]
    << 8, its scale s bits 12..14 of qh[i], its delta's sign bit 15; scale d (2s + 1) / 8, gguf's d (2s + 1) over 8
    (exact), for the codebook's 8 (g + delta)."""
    rows, count = blocks.shape[0], blocks.shape[1]
    qh = blocks[..., 34:50].reshape(rows, count, 8, 2).long()
    qh = qh[..., 0] | (qh[..., 1] << 8)  # [N, blocks, 8]
    high = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9])) & 7  # each run's index bits 8..10
    runs = _grid_codes("iq1_s")[blocks[..., 2:34].long() | (high.reshape(rows, count, 32) << 8)]  # [N, blocks, 32, 8]
    negative = (qh >> 15).to(torch.uint8)  # the group's delta -1/8
    codes = runs.reshape(rows, count, 8, 32) + 3 * negative.unsqueeze(-1)
    scale = half(0).float().unsqueeze(-1) * (2 * ((qh >> 12) & 7) + 1).float() * 0.125
    return LowBitWeight("iq1_s", codes.reshape(rows, -1), scale.reshape(rows, -1, 1).contiguous())


def _decode_iq1_m(blocks: torch.Tensor) -> LowBitWeight:
    """IQ1_M `qs[32], qh[16], scales[4] (uint16)`: run j of 8 is IQ1_S's grid entry qs[j] | (nibble j of qh, low
    first) & 7 << 8, its delta's sign that nibble's bit 3; the 16 3-bit scales of the halves are bits 3i .. 3i + 2 of
    each scales word (i < 4); d's float16 bits are the words' top nibbles, word k's at bits 4k."""
    rows, count = blocks.shape[0], blocks.shape[1]
    words = blocks[..., 48:56].reshape(rows, count, 4, 2).long()
    words = words[..., 0] | (words[..., 1] << 8)  # [N, blocks, 4]
    bits = ((words >> 12) << torch.tensor([0, 4, 8, 12])).sum(-1)  # d's float16 bits
    d = torch.stack([bits & 0xFF, bits >> 8], -1).to(torch.uint8).view(torch.float16)  # [N, blocks, 1]
    scales = ((words.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9])) & 7).reshape(rows, -1, 2).to(torch.uint8)
    nibbles = (blocks[..., 32:48].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0x0F
    nibbles = nibbles.reshape(rows, count, 32)
    runs = _grid_codes("iq1_m")[blocks[..., 0:32].long() | ((nibbles & 7).long() << 8)]  # [N, blocks, 32, 8]
    codes = runs + 3 * (nibbles >> 3).unsqueeze(-1)
    return LowBitWeight("iq1_m", codes.reshape(rows, -1), scales, d.contiguous())


def _decode_half_grid(blocks: torch.Tensor, kind: str, half: Callable[[int], torch.Tensor]) -> LowBitWeight:
    """IQ2_XS `d, qs[32] (uint16), scales[8]`: run j of 8 elements is grid entry qs[j] & 511 with the signs of the 7
    bits qs[j] >> 9; IQ2_S `d, qs[32], signs[32], qh[8], scales[8]`: run j is entry qs[j] | bits 2 (j % 4) .. +1 of
    qh[j / 4] << 8, signed by the bits of signs[j]. Either's 16 4-bit scales (one a half of a group) are the nibbles of
    scales, low first."""
    rows, count = blocks.shape[0], blocks.shape[1]
    grid = _grid_codes(kind)
    if kind == "iq2_xs":
        words = blocks[..., 2:66].reshape(rows, count, 32, 2).long()
        words = words[..., 0] | (words[..., 1] << 8)
        magnitudes, signs = grid[words & 511], _sign_patterns()[words >> 9]  # [N, blocks, 32, 8] each
        scales = blocks[..., 66:74]
    else:  # iq2_s
        high = (blocks[..., 66:74].unsqueeze(-1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)) & 3
        magnitudes = grid[blocks[..., 2:34].long() | (high.reshape(rows, count, 32).long() << 8)]
        signs = (blocks[..., 34:66].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        scales = blocks[..., 74:82]
    codes = (magnitudes | (signs << 3)).reshape(rows, -1)
    nibbles = (scales.unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 0x0F
    return LowBitWeight(kind, codes, nibbles.reshape(rows, -1, 2), half(0).unsqueeze(-1).contiguous())


def decode_blocks(blocks: torch.Tensor, kind: str) -> LowBitWeight:
    """A GGUF tensor's raw blocks `[N, blocks a row, block bytes]` uint8 of `kind` as a `LowBitWeight` (copied).

    Layouts (llama.cpp's ggml-common.h): Q5_0 `d, qh[4], qs[16]`; Q5_1 `d, m, qh[4], qs[16]` (qs byte j: element j
    low, j + 16 high; bit j of qh: element j's fifth bit); Q4_K `d, dmin, scales[12], qs[128]`; Q5_K `d, dmin,
    scales[12], qh[32], qs[128]` (qs by 32 bytes: elements 64c + l low, 64c + 32 + l high; bit s of qh[l]: element
    32s + l's fifth; scales: eight 6-bit sc and m packed in 12 bytes); Q6_K `ql[128], qh[64], scales[16] int8, d`
    (ql by 64 bytes per half h of 128: elements 128h + l low, 128h + 64 + l high; qh by 32 per half: bits 2s .. of
    byte l are element 128h + 32s + l's two high bits); MXFP4 `e, qs[16]` (qs byte j: code j low, j + 16 high);
    Q3_K `hmask[32], qs[64], scales[12], d` (element 128h + 32j + l: bits 2j .. 2j + 1 of qs[32h + l], over them bit
    4h + j of hmask[l]; sixteen 6-bit scales of 16 elements: their low 4 bits the nibbles of scales[0..7], low ones
    first, their high 2 bits 2k .. 2k + 1 of scales[8..11], less 32); Q2_K `scales[16], qs[64], d, dmin` (element
    128h + 32j + l: bits 2j .. 2j + 1 of qs[32h + l]; scales[s] the sc (low nibble) and m (high) of elements 16s ..
    16s + 15); the grid kinds as `_decode_grid`, `_decode_half_grid`, `_decode_iq1_s` and `_decode_iq1_m` read
    them; IQ4_NL `d, qs[16]` (as Q4_0's); IQ4_XS `d,
    scales_h (uint16), scales_l[4], qs[128]` (qs by 16 bytes a group of 32, as IQ4_NL's; group i's scale: nibble i
    of scales_l, low first, with bits 2i .. 2i + 1 of scales_h over it, less 32)."""
    rows = blocks.shape[0]
    if kind == "mxfp4":
        return LowBitWeight(kind, _nibble_codes(blocks[..., 1:17]).reshape(rows, -1), blocks[..., :1].clone())
    b = blocks.to(torch.int32)

    def half(at: int) -> torch.Tensor:  # the float16 at byte `at` of every block: [N, blocks]
        return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0]

    if kind == "iq4_nl":
        values = _nibble_codes(blocks[..., 2:18]).reshape(rows, -1)
        return LowBitWeight(kind, values, half(0).unsqueeze(-1).contiguous())
    if kind == "iq4_xs":  # per group i of 8: low 4 bits in scales_l's nibble i, high 2 at bit 2i of scales_h
        scales_h = (b[..., 2] | (b[..., 3] << 8)).unsqueeze(-1) >> (2 * torch.arange(8))
        scales_l = b[..., 4:8].repeat_interleave(2, -1) >> (4 * (torch.arange(8) % 2))
        sc = ((scales_l & 0x0F) | ((scales_h & 3) << 4)) - 32
        values = _nibble_codes(blocks[..., 8:136].reshape(rows, -1, 8, 16)).reshape(rows, -1)
        groups = sc.to(torch.int8).reshape(rows, -1, 1)
        return LowBitWeight(kind, values, groups, half(0).unsqueeze(-1).contiguous())
    if kind in ("q5_0", "q5_1"):
        base = 2 if kind == "q5_0" else 4
        qh = b[..., base] | (b[..., base + 1] << 8) | (b[..., base + 2] << 16) | (b[..., base + 3] << 24)
        qs = b[..., base + 4 : base + 20]
        low = torch.cat([qs & 0x0F, qs >> 4], -1)
        fifth = (qh.unsqueeze(-1) >> torch.arange(32)) & 1
        values = (low | (fifth << 4)).to(torch.uint8).reshape(rows, -1)
        scale = half(0)
        shift = (-16.0 * scale.float()).half() if kind == "q5_0" else half(2)
        return LowBitWeight(kind, values, torch.stack([scale, shift], -1).contiguous())
    if kind in ("q4_k", "q5_k"):
        d, dmin = half(0), half(2)
        s = b[..., 4:16]
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], -1)
        m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        qs = b[..., -128:].reshape(rows, -1, 4, 32)
        low = torch.stack([qs & 0x0F, qs >> 4], 3).reshape(rows, -1, 256)  # [chunk, nibble, l] -> 64c + 32 nib + l
        if kind == "q5_k":
            qh = b[..., 16:48]
            low = low | (((qh.unsqueeze(-2) >> torch.arange(8).view(8, 1)) & 1).reshape(rows, -1, 256) << 4)
        groups = torch.stack([sc, m], -1).to(torch.uint8).reshape(rows, -1, 2)
        return LowBitWeight(kind, low.to(torch.uint8).reshape(rows, -1), groups, torch.stack([d, dmin], -1))
    if kind == "iq1_s":
        return _decode_iq1_s(blocks, half)
    if kind == "iq1_m":
        return _decode_iq1_m(blocks)
    if kind in GRID_KINDS:
        return _decode_grid(blocks, kind, half)
    if kind in HALF_GRID_KINDS:
        return _decode_half_grid(blocks, kind, half)
    if kind == "q2_k":  # element 128h + 32j + l: bits 2j of qs[32h + l]; each half's byte sc | m << 4 as stored
        qs = blocks[..., 16:80].reshape(rows, -1, 2, 1, 32)
        values = (qs >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3  # [h, j, l], uint8 throughout
        halves = blocks[..., 0:16].reshape(rows, -1, 2).clone()
        return LowBitWeight(kind, values.reshape(rows, -1), halves, torch.stack([half(80), half(82)], -1))
    if kind == "q3_k":  # element 128h + 32j + l: bits 2j of qs[32h + l], bit 4h + j of hmask[l]; scales as below
        qs = b[..., 32:96].reshape(rows, -1, 2, 1, 32)
        low = (qs >> (2 * torch.arange(4)).view(4, 1)) & 3  # [h, j, l]
        high = (b[..., 0:32].unsqueeze(-2) >> torch.arange(8).view(8, 1)) & 1  # [4h + j, l]
        values = (low.reshape(rows, -1, 256) | (high.reshape(rows, -1, 256) << 2)).to(torch.uint8).reshape(rows, -1)
        s = b[..., 96:108]  # 16 scales: low 4 bits in nibbles of bytes 0..7 (low first), high 2 in bits 2k of 8..11
        low_bits = torch.cat([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], -1)
        high_bits = torch.cat([(s[..., 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], -1)
        sc = ((low_bits | (high_bits << 4)) - 32).to(torch.int8).reshape(rows, -1, 2)
        d = half(108)
        return LowBitWeight(kind, values, sc, torch.stack([d, torch.zeros_like(d)], -1))
    if kind == "q6_k":
        ql = b[..., 0:128].reshape(rows, -1, 2, 2, 32)  # [half h, 32-byte part p, l]
        qh = b[..., 128:192].reshape(rows, -1, 2, 32)
        # element 128h + 32s + l: s = 0, 1 low nibbles of ql parts 0, 1; s = 2, 3 their high nibbles
        low = torch.cat([ql & 0x0F, ql >> 4], 3)  # [h, s, l]
        high = torch.stack([(qh >> (2 * s)) & 3 for s in range(4)], 3)  # [h, s, l]
        values = (low | (high << 4)).to(torch.uint8).reshape(rows, -1)
        sc = blocks[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1, 2)
        d = half(208)
        return LowBitWeight(kind, values, sc, torch.stack([d, torch.zeros_like(d)], -1))
    raise ValueError(f"no low-bit decoding for {kind!r}")
