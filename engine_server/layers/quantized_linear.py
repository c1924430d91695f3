"""Weight-only quantized linear layers: 4- and 8-bit weights in groups of 32, kept packed (8-bit also on CUDA).

A decode step on the CPU streams every weight once per token, so its time is the weights' bytes over the memory
bandwidth: float32 SmolLM2-135M streams ~540 MB per token, its GGUF Q4_1 form ~96 MB (scales kept in float16, as
GGUF stores them: float32 ones would add 16 MB). `QuantizedLinear`
keeps a weight in one of two packed forms and multiplies with the C++ kernels of `ladle_kernels/cpu/quant_matmul.cpp`
(contracts: `ladle_kernels.reference.q4_linear` / `q8_linear`), which quantize the activations to 8 bits per group of
32 on the fly, as llama.cpp does, so each group's dot product is an exact integer one, for any number of rows:
a row's result does not depend on the rows beside it. On the CPU the weight is repacked once, at construction,
into the kernels' blocks of 8 output features (`torch.ops.ladle_cpu.pack_q4` / `pack_q8`).

- `Q4Weight`: element = scale * q + min, q in 0..15 (GGUF Q4_1; Q4_0 is min = -8 * scale).
- `Q8Weight`: element = scale * q, q in -127..127 (GGUF Q8_0, and `quantize_q8` of any float weight).
- `LowBitWeight` (`layers.lowbit_weight`): GGUF's Q5_0 / Q5_1 and llama.cpp's K-quants Q4_K / Q5_K / Q6_K, packed
  into the kernels' layout of `ladle_kernels/cpu/lowbit_tiles.h`.
All are row-major over the output features, so a fused projection (q/k/v, gate/up) is its shards' rows
concatenated (`concat_rows`); shards a file stores in different formats stay apart (`StackedWeight`), each
multiplied in its own and the products concatenated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine_server.layers.lowbit_weight import (
    LowBitWeight,
    concat_lowbit,
    pack_lowbit,
    pad_lowbit,
    unpack_lowbit_rows,
    unpack_nibbles,
)
from ladle_kernels.reference import QUANT_GROUP, unpack_q4


@dataclass(frozen=True)
class Q4Weight:
    """A 4-bit weight `[N, K]`: `qs` `[N, K/2]` uint8 (`ladle_kernels.reference.unpack_q4` order), `scales` and `mins`
    `[N, K/32]` float16."""

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        q = unpack_q4(self.qs).reshape(self.qs.shape[0], -1, QUANT_GROUP).float()
        return (q * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)).reshape(self.shape)


@dataclass(frozen=True)
class Q8Weight:
    """An 8-bit weight `[N, K]`: `qs` `[N, K]` int8, `scales` `[N, K/32]` float16."""

    qs: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1]

    def dequantize(self) -> torch.Tensor:
        q = self.qs.reshape(self.qs.shape[0], -1, QUANT_GROUP).float()
        return (q * self.scales.float().unsqueeze(-1)).reshape(self.shape)


@dataclass(frozen=True)
class StackedWeight:
    """A fused projection whose shards a file stores in different formats (a Q4_K_M file's q and k in Q5_0, its v
    in Q8_0): each shard kept in its own, their rows one after another."""

    parts: tuple[Q4Weight | Q8Weight | LowBitWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


QuantizedWeight = Q4Weight | Q8Weight | LowBitWeight | StackedWeight


def weight_format(weight: QuantizedWeight) -> str:
    """How a layer of this weight reports its format: `q4`, `q8`, a GGUF kind (`q5_0`, `q4_k`, ...), or its
    shards' joined by "+"."""
    if isinstance(weight, StackedWeight):
        return "+".join(weight_format(p) for p in weight.parts)
    if isinstance(weight, LowBitWeight):
        return weight.kind
    return "q4" if isinstance(weight, Q4Weight) else "q8"


Q8_CHUNK_VALUES = 1 << 22  # `quantize_q8`'s rows at a time: ~16 MB of float32 per temporary


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Symmetric 8-bit groups of 32 along K, GGUF Q8_0's scheme: scale = max|w| / 127, q = round(w / scale) in
    float32, the scale then stored in float16.

    Quantized Q8_CHUNK_VALUES values at a time, so that the float temporaries stay small beside a large matrix (a
    200k-entry vocabulary's table or LM head: 2.3 GB each in float32).

    Raises ValueError when K is not a multiple of 32.
    """
    rows, cols = weight.shape
    if cols % QUANT_GROUP:
        raise ValueError(f"cannot quantize a weight with {cols} input features: not a multiple of {QUANT_GROUP}")
    qs = torch.empty(rows, cols, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, cols // QUANT_GROUP, dtype=torch.float16, device=weight.device)
    step = max(1, Q8_CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        groups = weight[start : start + step].detach().float().reshape(-1, cols // QUANT_GROUP, QUANT_GROUP)
        chunk_scales = groups.abs().amax(-1) / 127.0
        inverse = torch.where(chunk_scales > 0, 1.0 / chunk_scales, torch.zeros_like(chunk_scales))
        qs[start : start + step] = torch.round(groups * inverse.unsqueeze(-1)).clamp_(-127, 127).flatten(1)
        scales[start : start + step] = chunk_scales
    return Q8Weight(qs, scales)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """The shards of a fused projection as one weight (rows in order): one of their format where they share it,
    else a `StackedWeight` of runs of one format each."""
    flat = [p for w in weights for p in (w.parts if isinstance(w, StackedWeight) else (w,))]
    runs: list[list[Q4Weight | Q8Weight | LowBitWeight]] = []
    for part in flat:
        if runs and weight_format(runs[-1][0]) == weight_format(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    merged = tuple(_merge(run) for run in runs)
    return merged[0] if len(merged) == 1 else StackedWeight(merged)


def _merge(weights: list[Q4Weight | Q8Weight | LowBitWeight]) -> Q4Weight | Q8Weight | LowBitWeight:
    """Shards of one format as one weight."""
    if len(weights) == 1:
        return weights[0]
    if all(isinstance(w, LowBitWeight) for w in weights):
        return concat_lowbit([w for w in weights if isinstance(w, LowBitWeight)])
    if all(isinstance(w, Q4Weight) for w in weights):
        q4 = [w for w in weights if isinstance(w, Q4Weight)]
        return Q4Weight(
            torch.cat([w.qs for w in q4]).contiguous(),
            torch.cat([w.scales for w in q4]).contiguous(),
            torch.cat([w.mins for w in q4]).contiguous(),
        )
    q8 = [w for w in weights if isinstance(w, Q8Weight)]
    return Q8Weight(torch.cat([w.qs for w in q8]).contiguous(), torch.cat([w.scales for w in q8]).contiguous())


def pad_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    """`weight` with `rows` zero rows after its own (every element 0: a vocab-parallel LM head's padding)."""
    if rows == 0:
        return weight
    if isinstance(weight, StackedWeight):
        return StackedWeight((*weight.parts[:-1], _pad_one(weight.parts[-1], rows)))
    return _pad_one(weight, rows)


def _pad_one(weight: Q4Weight | Q8Weight | LowBitWeight, rows: int) -> Q4Weight | Q8Weight | LowBitWeight:
    def padded(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_zeros(rows, tensor.shape[1])])

    if isinstance(weight, LowBitWeight):
        return pad_lowbit(weight, rows)
    if isinstance(weight, Q4Weight):
        return Q4Weight(padded(weight.qs), padded(weight.scales), padded(weight.mins))
    return Q8Weight(padded(weight.qs), padded(weight.scales))


def pack_for_cpu(weight: Q4Weight | Q8Weight | LowBitWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` in the CPU kernels' blocks (`ladle_kernels/cpu/quant_matmul.cpp`, `lowbit_tiles.h`): (packed, scales,
    mins) for `torch.ops.ladle_cpu.packed_linear`. Raises RuntimeError where the CPU kernels cannot be built."""
    from ladle_kernels.cpu_ops import cpu_ops  # builds (or loads) the extension that registers the ops

    if cpu_ops() is None:
        raise RuntimeError("quantized weights on the CPU need the C++ CPU kernels, which could not be built here")
    if isinstance(weight, LowBitWeight):
        return pack_lowbit(weight, torch.ops.ladle_cpu.lowbit_planes)
    if isinstance(weight, Q4Weight):
        packed = torch.ops.ladle_cpu.pack_q4(weight.qs, weight.scales, weight.mins)
    else:
        packed = torch.ops.ladle_cpu.pack_q8(weight.qs, weight.scales)
    return packed[0], packed[1], packed[2]


def unpack_rows(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, fmt: str, index: torch.Tensor
) -> Q4Weight | Q8Weight | LowBitWeight:
    """Rows `index` (a 1-D long tensor) of a weight of format `fmt` (`weight_format`) that `pack_for_cpu` packed
    into (packed, scales, mins), in that order: its inverse, for those rows only."""
    if fmt not in ("q4", "q8"):
        return unpack_lowbit_rows(packed, scales, mins, fmt, index)
    block, feature = index // 8, index % 8
    planes = [unpack_nibbles(packed[block, :, p], feature) for p in range(packed.shape[2])]  # [R, groups, 32] each
    scale = scales[block, :, feature]
    if fmt == "q4":
        return Q4Weight(_repack_q4(planes[0]), scale, mins[block, :, feature])
    values = ((planes[0] << 4) | planes[1]).to(torch.int16) - 128  # q8 stores u = q + 128 in two nibble planes
    return Q8Weight(values.to(torch.int8).reshape(len(index), -1), scale)


def _repack_q4(values: torch.Tensor) -> torch.Tensor:
    """`[R, groups, 32]` values 0..15 -> `Q4Weight.qs` `[R, K/2]`: byte j of a group holds j and j + 16."""
    half = QUANT_GROUP // 2
    return (values[..., :half] | (values[..., half:] << 4)).reshape(values.shape[0], -1)


class QuantizedLinear(nn.Module):
    """`F.linear(x, W, bias)` with W a `QuantizedWeight` (any leading dims of x).

    On the CPU (float32 x, the C++ kernels) the result differs from `F.linear(x, weight.dequantize())` by x's
    8-bit rounding (about 0.4% of each group's largest value per element, averaging out over K), not by the
    weight's: that is stored exactly. There `qs`, `scales` and `mins` hold the kernels' packed blocks (built
    once here; needs the CPU kernels), and `parts` each shard's of a `StackedWeight` (x quantized once, each
    shard's product written into its columns: `packed_linear_parts`).
    On CUDA (a `Q8Weight` only, x in the model's dtype) they hold the weight as given and the Triton kernel
    `ladle_kernels.int8_linear` dequantizes W to x's dtype, keeping x as it is.
    """

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = weight_format(weight)
        # On the CPU, each shard's packed blocks and rows (one shard but for a `StackedWeight`); the first's are
        # also `qs`, `scales` and `mins`.
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        if isinstance(weight, Q8Weight) and weight.qs.is_cuda:
            qs, scales, mins = weight.qs, weight.scales, None
        else:
            shards = weight.parts if isinstance(weight, StackedWeight) else (weight,)
            self.parts = [(*pack_for_cpu(shard), shard.shape[0]) for shard in shards]
            qs, scales, mins, _ = self.parts[0]
        self.register_buffer("qs", qs, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("mins", mins, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if self.qs.is_cuda:
            from ladle_kernels.int8_linear import int8_linear  # triton: imported only where it runs

            out = int8_linear(rows, self.qs, self.scales)
        elif len(self.parts) == 1:
            out = torch.ops.ladle_cpu.packed_linear(rows, self.qs, self.scales, self.mins, self.out_features)
        else:
            packed, scales, mins, counts = (list(column) for column in zip(*self.parts, strict=True))
            out = torch.ops.ladle_cpu.packed_linear_parts(rows, packed, scales, mins, counts)
        if self.bias is not None:
            out.add_(self.bias)  # (the product's own tensor: no second one for the sum)
        result: torch.Tensor = out.reshape(*x.shape[:-1], self.out_features)
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class QuantizedEmbedding(nn.Module):
    """`F.embedding(ids, W)` with W a `QuantizedWeight` kept as a file stores it (one rank, the CPU): each call
    dequantizes only the rows it looks up, the values a float table of the same blocks holds, bit for bit (the
    converted folder's is the gguf package's dequantization, which the weights' `dequantize` equals).

    Given a tied LM head's `QuantizedLinear` (one shard, packed for the CPU) instead, it reads the head's packed
    blocks (`unpack_rows`): the same values, and no second copy of the table (29 MB of the embedded model's 101 MB
    file). Raises ValueError for a head of several shards or one not packed for the CPU."""

    def __init__(self, weight: Q4Weight | Q8Weight | LowBitWeight | QuantizedLinear) -> None:
        super().__init__()
        self.stored: Q4Weight | Q8Weight | LowBitWeight | None = None
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if isinstance(weight, QuantizedLinear):
            if len(weight.parts) != 1:
                raise ValueError("a tied embedding needs an LM head of one shard packed for the CPU")
            packed, scales, mins, _ = weight.parts[0]
            self.packed = (packed, scales, mins)  # a plain attribute: the head owns these buffers
            self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
            self.format = weight.format
        else:
            self.stored = weight
            self.num_embeddings, self.embedding_dim = weight.shape
            self.format = weight_format(weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        index = input_ids.reshape(-1)
        if self.packed is not None and self.format == "q8":  # one C++ pass; ~15 torch ops through unpack_rows
            rows = torch.ops.ladle_cpu.q8_packed_rows(self.packed[0], self.packed[1], index.to(torch.int64))
        elif self.packed is not None:
            rows = unpack_rows(*self.packed, self.format, index).dequantize()
        else:
            assert self.stored is not None
            rows = _rows(self.stored, index).dequantize()
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        tied = ", tied to the LM head" if self.packed is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format}{tied}"


def _rows(weight: Q4Weight | Q8Weight | LowBitWeight, index: torch.Tensor) -> Q4Weight | Q8Weight | LowBitWeight:
    """The rows `index` of `weight`, in that order."""
    if isinstance(weight, LowBitWeight):
        return weight.rows(index)
    if isinstance(weight, Q4Weight):
        return Q4Weight(weight.qs[index], weight.scales[index], weight.mins[index])
    return Q8Weight(weight.qs[index], weight.scales[index])


def swap_linears(model: nn.Module, layer_for: Callable[[str, nn.Linear], nn.Module | None]) -> int:
    """Swap each `nn.Linear` of `model` (named as in `named_modules`) for the layer `layer_for(name, linear)` builds
    (its `out_features` and `in_features` the linear's); None keeps that linear. Returns how many were swapped.
    Raises ValueError when a built layer's shape is not its linear's."""
    targets = [
        (parent, f"{prefix}.{name}" if prefix else name, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    swapped = 0
    for parent, full_name, name, child in targets:
        layer = layer_for(full_name, child)
        if layer is None:
            continue
        shape = (layer.out_features, layer.in_features)
        if shape != tuple(child.weight.shape):
            raise ValueError(f"{full_name}: a {shape} weight for a {tuple(child.weight.shape)} layer")
        setattr(parent, name, layer)
        swapped += 1
    return swapped


def replace_linears(model: nn.Module, weight_for: Callable[[str, nn.Linear], QuantizedWeight | None]) -> int:
    """`swap_linears` to a `QuantizedLinear` of each weight `weight_for` returns (None keeps the linear).

    A swapped layer lets its float weight go unless another module still holds it (a tied embedding)."""

    def layer_for(name: str, linear: nn.Linear) -> nn.Module | None:
        weight = weight_for(name, linear)
        return None if weight is None else QuantizedLinear(weight, linear.bias)

    return swap_linears(model, layer_for)
