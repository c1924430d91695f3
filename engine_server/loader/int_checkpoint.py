"""Integer-quantized checkpoints (GPTQ, AWQ, compressed-tensors' W4A16 / W8A16) read as the float weights they stand
for: a Hugging Face folder whose `config.json` has such a `quantization_config`.

Each quantized linear layer stores small integers `q`, a scale per group of `group_size` input columns (or one per
output row) and, asymmetric, a zero point per group; its weight is `(q - zero) * scale`. The layouts:
- `quant_method: "gptq"` (AutoGPTQ, GPTQModel): `qweight` int32 `[K / (32 / bits), N]`, `bits`-wide values packed
  along the input dim (lowest bits first); `qzeros` int32 `[groups, N / (32 / bits)]` packed along the output dim,
  each stored one less than the zero point in the original format (`checkpoint_format` "gptq"; "gptq_v2" stores it
  as it is); `scales` `[groups, N]`; `g_idx` `[K]`, each input column's group (act-order checkpoints permute them;
  without it, column k is in group k // group_size).
- `quant_method: "awq"` (AutoAWQ's GEMM version, 4 bits): `qweight` int32 `[K, N / 8]` and `qzeros` `[groups, N / 8]`
  packed along the output dim with AutoAWQ's interleave (word nibble p holds column `_AWQ_ORDER[p]` of its eight);
  `scales` `[groups, N]`.
- `quant_method: "compressed-tensors"` (llm-compressor's integer schemes): format `pack-quantized`, `weight_packed`
  int32 `[N, K / (32 / bits)]` packed along the input dim, each value stored plus `2 ** (bits - 1)`, `weight_shape`
  `[N, K]`, `weight_scale` `[N, groups]` (1 group: per channel), an asymmetric scheme's `weight_zero_point` packed
  likewise along the output dim, and an act-order scheme's `weight_g_idx`; or format `int-quantized` /
  `naive-quantized`, an int8 `weight` beside `weight_scale`.
Layers a config leaves unquantized (`modules_to_not_convert`, `ignore`: the LM head, routers) are stored in float
and pass through as they are. Activations are not quantized here: these are weight-only schemes.

`IntCheckpoint.dequantized` streams such a checkpoint as float32 weights, so every scheme loads it
(`ModelSource.weights`); `--quantization auto` then serves them as int8 on the CPU (`engine_server.quantization`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from engine_server.loader.lazy_tensor import LazyTensor, whole
from engine_server.loader.weight_files import tensor_files

IntMethod = Literal["gptq", "awq", "compressed-tensors"]
# Each method's tensors of one quantized layer (suffixes of `<layer>.`), the first of them its mark, and which of
# them a layer may lack.
_PARTS: dict[str, tuple[str, ...]] = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
    "int8": ("weight", "weight_scale", "weight_zero_point", "weight_g_idx"),  # compressed-tensors' int-quantized
}
_OPTIONAL = ("g_idx", "weight_zero_point", "weight_g_idx")
_BITS = (4, 8)
# AutoAWQ's GEMM packing: nibble p of a word holds column _AWQ_ORDER[p] of the eight it packs.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_COMPRESSED_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")

T = TypeVar("T", torch.Tensor, torch.Tensor | LazyTensor)


@dataclass(frozen=True)
class IntCheckpoint:
    """An integer-quantized checkpoint's layout (module doc): its `method`, `bits` per value, `group_size` input
    columns per scale (0: one scale per output row), whether its zero points are stored one less (`zeros_minus_one`:
    GPTQ's original format) and, for compressed-tensors, whether its weights are packed (`packed`: pack-quantized) or
    int8 tensors (int-quantized)."""

    method: IntMethod
    bits: int
    group_size: int
    zeros_minus_one: bool = False
    packed: bool = True

    @property
    def parts(self) -> tuple[str, ...]:
        """This layout's tensors of one layer (the first marks a quantized layer)."""
        return _PARTS["int8" if self.method == "compressed-tensors" and not self.packed else self.method]

    def quantized_layers(self, folder: Path) -> dict[str, set[str]]:
        """Each quantized layer (its name without the suffix) -> the parts the folder's files hold for it (their
        headers read, no tensor). A layer is quantized where its mark is there (and, int-quantized, its scale)."""
        names = set(tensor_files(folder))
        mark = self.parts[0]
        layers: dict[str, set[str]] = {}
        for name in names:
            layer, _, part = name.rpartition(".")
            if part == mark and (self.packed or f"{layer}.weight_scale" in names):
                layers[layer] = {p for p in self.parts if f"{layer}.{p}" in names}
        return layers

    def dequantized(self, folder: Path, weights: Iterator[tuple[str, T]]) -> Iterator[tuple[str, T]]:
        """`weights` (a folder's, any order) with every quantized layer's parts as its float32 `<layer>.weight`, which
        comes out once all of the parts the folder holds for it have been read. ValueError for a layer without a part
        it needs, or whose parts do not fit together."""
        layers = self.quantized_layers(folder)
        for layer, parts in layers.items():
            missing = [p for p in self.parts if p not in parts and p not in _OPTIONAL]
            if missing:
                raise ValueError(f"{self.method} checkpoint {folder}: {layer} has no {', '.join(missing)}")
        read: dict[str, dict[str, T]] = {}
        for name, tensor in weights:
            layer, _, part = name.rpartition(".")
            if layer not in layers or part not in layers[layer]:
                yield name, tensor
                continue
            held = read.setdefault(layer, {})
            held[part] = tensor
            if len(held) == len(layers[layer]):
                del read[layer]
                tensors = {p: whole(t) for p, t in held.items()}
                try:
                    yield f"{layer}.weight", self.weight(tensors)
                except ValueError as error:
                    raise ValueError(f"{self.method} checkpoint {folder}: {layer}: {error}") from None
        if read:
            raise ValueError(f"{self.method} checkpoint {folder}: {sorted(read)[:3]} lack some of their tensors")

    def weight(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One layer's float32 weight `[N, K]` from its parts (by `parts`' names); ValueError where they do not fit."""
        if self.method == "gptq":
            return _gptq_weight(parts, self.bits, self.group_size, self.zeros_minus_one)
        if self.method == "awq":
            return _awq_weight(parts, self.group_size)
        return _compressed_weight(parts, self.bits, self.packed)


def int_checkpoint(config: Mapping[str, Any]) -> IntCheckpoint | None:
    """The integer layout `config` (a config.json) declares; None when it declares none (or another kind: FP8,
    MXFP4, `loader.fp8_checkpoint`'s). ValueError for a form of these methods this engine does not read."""
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    if method == "gptq":
        bits = _bits(quantization.get("bits"), method)
        form = quantization.get("checkpoint_format") or "gptq"
        if form not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config: gptq checkpoint_format {form!r} is not read (gptq, gptq_v2 are)")
        return IntCheckpoint("gptq", bits, _group(quantization.get("group_size")), zeros_minus_one=form == "gptq")
    if method == "awq":
        version = str(quantization.get("version") or "gemm").lower()
        if version != "gemm" or not quantization.get("zero_point", True):
            raise ValueError(f"quantization_config: awq version {version!r} with zero_point "
                             f"{quantization.get('zero_point')} is not read (gemm with zero points is)")  # fmt: skip
        if _bits(quantization.get("bits") or quantization.get("w_bit"), method) != 4:
            raise ValueError("quantization_config: awq is read with 4 bits")
        return IntCheckpoint("awq", 4, _group(quantization.get("group_size") or quantization.get("q_group_size")))
    if method == "compressed-tensors" and _integer_groups(quantization):
        return _compressed_tensors(quantization)
    return None


def is_integer_quantization(config: Mapping[str, Any]) -> bool:
    """Whether `config`'s `quantization_config` is one `int_checkpoint` reads (not an FP8 one)."""
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    return method in ("gptq", "awq") or (method == "compressed-tensors" and _integer_groups(quantization))


def _integer_groups(quantization: Mapping[str, Any]) -> bool:
    groups = (quantization.get("config_groups") or {}).values()
    return any((group.get("weights") or {}).get("type") == "int" for group in groups)


def _compressed_tensors(quantization: Mapping[str, Any]) -> IntCheckpoint:
    """compressed-tensors' integer weight schemes: every group's weights `num_bits`-wide integers per group of
    `group_size` columns or per channel, no quantized activations (W4A16, W8A16) or dynamic ones read past."""
    form = quantization.get("format") or "pack-quantized"
    if form not in _COMPRESSED_FORMATS:
        raise ValueError(f"compressed-tensors format {form!r} is not read for integer weights "
                         f"({', '.join(_COMPRESSED_FORMATS)} are)")  # fmt: skip
    layouts: set[tuple[int, int]] = set()
    for name, group in (quantization.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        strategy = weights.get("strategy")
        if weights.get("type") != "int" or strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors group {name!r}: weights {weights} are not integers per group or "
                             "channel")  # fmt: skip
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic", False):
            raise ValueError(f"compressed-tensors group {name!r}: static activation scales are not read")
        bits = _bits(weights.get("num_bits"), "compressed-tensors")
        layouts.add((bits, _group(weights.get("group_size")) if strategy == "group" else 0))
    if len(layouts) != 1:
        raise ValueError(f"compressed-tensors: groups of different bits or group sizes {sorted(layouts)}")
    bits, group_size = layouts.pop()
    return IntCheckpoint("compressed-tensors", bits, group_size, packed=form == "pack-quantized")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The `bits`-wide unsigned values packed in int32 `packed` along `dim` (0: a word holds consecutive rows, 1:
    consecutive columns), lowest bits first, as int32: that dim `32 / bits` times longer."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, cols, per_word]
    if dim == 1:
        return values.reshape(packed.shape[0], packed.shape[1] * per_word)
    return values.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])


def _gptq_weight(parts: Mapping[str, torch.Tensor], bits: int, group_size: int, minus_one: bool) -> torch.Tensor:
    q = unpack_int32(parts["qweight"], bits, dim=0)  # [K, N]
    # (the original format's zero of 0, stored as -1, wraps to 0 again as its kernels read it)
    zeros = (unpack_int32(parts["qzeros"], bits, dim=1) + int(minus_one)) & ((1 << bits) - 1)  # [groups, N]
    scales = parts["scales"].float()
    columns, rows = q.shape
    if scales.shape[1] != rows or zeros.shape[1] < rows:
        raise ValueError(f"qweight {tuple(parts['qweight'].shape)}, qzeros {tuple(parts['qzeros'].shape)} and scales "
                         f"{tuple(scales.shape)} do not fit together")  # fmt: skip
    groups = _column_groups(parts.get("g_idx"), columns, group_size, scales.shape[0])
    return ((q - zeros[groups, :rows]).float() * scales[groups]).t().contiguous()


def _awq_weight(parts: Mapping[str, torch.Tensor], group_size: int) -> torch.Tensor:
    order = [8 * word + p for word in range(parts["qweight"].shape[1]) for p in _AWQ_ORDER]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    q = unpack_int32(parts["qweight"], 4, dim=1)[:, inverse]  # [K, N], columns in order
    zeros = unpack_int32(parts["qzeros"], 4, dim=1)[:, inverse]
    scales = parts["scales"].float()
    if scales.shape != zeros.shape or scales.shape[1] != q.shape[1]:
        raise ValueError(f"qweight {tuple(parts['qweight'].shape)}, qzeros {tuple(parts['qzeros'].shape)} and scales "
                         f"{tuple(scales.shape)} do not fit together")  # fmt: skip
    groups = _column_groups(None, q.shape[0], group_size, scales.shape[0])
    return ((q - zeros[groups]).float() * scales[groups]).t().contiguous()


def _compressed_weight(parts: Mapping[str, torch.Tensor], bits: int, packed: bool) -> torch.Tensor:
    offset = 1 << (bits - 1)
    if packed:
        rows, columns = (int(v) for v in parts["weight_shape"].reshape(-1).tolist())
        q = unpack_int32(parts["weight_packed"], bits, dim=1)[:, :columns] - offset
    else:
        q = parts["weight"].to(torch.int32)
        rows, columns = q.shape
    scale = parts["weight_scale"].float().reshape(rows, -1)
    zero = parts.get("weight_zero_point")
    if zero is None:
        zeros = torch.zeros_like(scale, dtype=torch.int32)
    elif packed and zero.dtype == torch.int32 and zero.shape[0] != rows:
        zeros = unpack_int32(zero, bits, dim=0)[:rows] - offset
    else:
        zeros = zero.to(torch.int32).reshape(rows, -1)
    if q.shape[0] != rows or zeros.shape != scale.shape:
        raise ValueError(f"weight {tuple(q.shape)}, scale {tuple(scale.shape)} and zero point {tuple(zeros.shape)} "
                         "do not fit together")  # fmt: skip
    groups = _column_groups(parts.get("weight_g_idx"), columns, columns // scale.shape[1], scale.shape[1])
    return ((q - zeros[:, groups]).float() * scale[:, groups]).contiguous()


def _column_groups(g_idx: torch.Tensor | None, columns: int, group_size: int, groups: int) -> torch.Tensor:
    """Each input column's group: `g_idx` where stored, else `column // group_size` (every column in the one group
    where the size is 0, per channel). ValueError for groups past the scales'."""
    if g_idx is not None:
        index = g_idx.to(torch.long).reshape(-1)
        if index.numel() != columns:
            raise ValueError(f"g_idx of {index.numel()} columns for {columns}")
    else:
        index = torch.arange(columns) // (group_size or columns)
    if int(index.min()) < 0 or int(index.max()) >= groups:
        raise ValueError(f"columns in groups up to {int(index.max())}, but {groups} groups of scales")
    return index


def _bits(value: Any, method: str) -> int:
    if value not in _BITS:
        raise ValueError(f"quantization_config: {method} with {value} bits is not read (4 and 8 are)")
    return int(value)


def _group(value: Any) -> int:
    """A group size from a config: a positive number of input columns, or 0 (-1 / None: one group per row)."""
    if value in (None, -1, 0):
        return 0
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"quantization_config: group_size {value!r}")
    return value

