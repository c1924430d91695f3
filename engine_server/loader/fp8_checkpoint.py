"""FP8 checkpoints read as they are: a Hugging Face folder whose `config.json` has an FP8 `quantization_config`.

Two layouts, each linear layer's `weight` stored in float8 e4m3 with a float32 scale that multiplies it:
- `quant_method: "fp8"` (DeepSeek-V3, Qwen3-FP8, transformers' FineGrainedFP8): with `weight_block_size` [bn, bk]
  (128 x 128), `<layer>.weight_scale_inv` `[ceil(N/bn), ceil(K/bk)]`, one scale per block (named "inverse", it is
  the multiplier); without it, vLLM's per-tensor form, `<layer>.weight_scale` a scalar;
- `quant_method: "compressed-tensors"` (llm-compressor's FP8 schemes, format `float-quantized`): `config_groups`
  whose `weights` are `{num_bits: 8, type: float, strategy: channel | tensor | block}`, `<layer>.weight_scale`
  `[N, 1]`, a scalar, or per block of `block_structure`.
Layers a config leaves out (`ignore`, `modules_to_not_convert`: usually the LM head) are stored in float and read
as such: a weight is FP8 when the checkpoint holds a scale for it. Static activation scales (`input_scale`) and
KV-cache scales (`k_scale`, `v_scale`) are read past: activations are scaled per token, dynamically, as the
dynamic schemes do (at least as accurate as one static scale), and the KV cache is not FP8 here.

`dequantized` streams such a checkpoint as float32 weights (each e4m3 weight times its scale), so every scheme
loads it (`ModelSource.weights`); `read_fp8_weights` reads chosen layers' e4m3 values and scales as they are, for
`--quantization fp8` (`engine_server.quantization`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from engine_server.layers.fp8_linear import Fp8Weight
from engine_server.loader.int_checkpoint import is_integer_quantization
from engine_server.loader.lazy_tensor import LazyTensor, whole
from engine_server.loader.weight_files import tensor_files
from ladle_kernels.reference import FP8_DTYPE

# What multiplies `<layer>.weight`: one of these next to it.
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
# Scales read past (module doc).
_UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")
_STRATEGIES = ("channel", "tensor", "block")  # compressed-tensors' weight scales read

# A checkpoint's tensors: read (`ModelSource.weights`) or unread (`ModelSource.lazy_weights`).
T = TypeVar("T", torch.Tensor, torch.Tensor | LazyTensor)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """An FP8 checkpoint's layout: `method` its `quant_method`, `block` (bn, bk) when its scales are per block
    (None: per channel or per tensor, told apart by each scale's shape), `static_activations` whether it stores
    activation scales (read past: activations are scaled per token)."""

    method: str
    block: tuple[int, int] | None
    static_activations: bool

    def fp8_weights(self, folder: Path) -> dict[str, str]:
        """Each FP8 weight's name -> its scale's name, from the folder's safetensors headers (nothing read)."""
        names = list(tensor_files(folder))
        return {
            name.removesuffix(suffix) + ".weight": name
            for name in names
            for suffix in SCALE_SUFFIXES
            if name.endswith(suffix)
        }

    def weight(self, qs: torch.Tensor, scale: torch.Tensor, name: str) -> Fp8Weight:
        """The `Fp8Weight` of one stored weight and its scale: per block as the config says, else per channel
        (a per-tensor scalar repeated for every row). Raises ValueError on a scale of another shape or dtype."""
        if qs.dtype != FP8_DTYPE or qs.dim() != 2:
            raise ValueError(f"{name}: FP8 weights are 2-d float8_e4m3fn, not {qs.dtype} {tuple(qs.shape)}")
        rows, cols = qs.shape
        scale = scale.float()
        if self.block is not None and scale.dim() == 2 and scale.numel() > 1:
            expected = (-(-rows // self.block[0]), -(-cols // self.block[1]))
            if tuple(scale.shape) != expected:
                raise ValueError(f"{name}: block scale {tuple(scale.shape)}, expected {list(expected)}")
            return Fp8Weight(qs, scale.contiguous(), self.block)
        if scale.numel() == 1:
            return Fp8Weight(qs, scale.reshape(1, 1).expand(rows, 1).contiguous())
        if scale.numel() == rows and (scale.dim() == 1 or scale.shape[-1] == 1):
            return Fp8Weight(qs, scale.reshape(rows, 1).contiguous())
        raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} for a weight of {(rows, cols)}")

    def dequantized(
        self, folder: Path, weights: Iterator[tuple[str, T]], keep: Collection[str] = frozenset()
    ) -> Iterator[tuple[str, T]]:
        """`weights` (a folder's, any order) with every FP8 weight as its float32 values and no scales: a weight
        comes out once it and its scale have both been read. The weights named in `keep` come out as read (their
        scales dropped): the caller loads those as FP8 itself (`read_fp8_weights`)."""
        scale_of = self.fp8_weights(folder)
        owner = {scale: weight for weight, scale in scale_of.items()}
        read: dict[str, T] = {}
        for name, tensor in weights:
            if name.endswith(_UNUSED_SUFFIXES):
                continue
            weight = owner.get(name, name)
            if weight in keep:
                if name == weight:
                    yield name, tensor
                continue
            if weight not in scale_of:
                yield name, tensor
                continue
            read[name] = tensor
            if weight in read and scale_of[weight] in read:
                qs, scale = whole(read.pop(weight)), whole(read.pop(scale_of[weight]))
                yield weight, self.weight(qs, scale, weight).dequantize()
        if read:
            raise ValueError(f"FP8 checkpoint {folder}: {sorted(read)[:3]} without their weight or scale")


def fp8_checkpoint(config: Mapping[str, Any]) -> Fp8Checkpoint | None:
    """The FP8 layout `config` (a config.json) declares, None when it declares no quantization or an integer one
    (`loader.int_checkpoint`'s). Raises ValueError for a quantization this engine does not read (another method, or
    compressed-tensors that is neither FP8 nor integer)."""
    quantization = config.get("quantization_config")
    if not quantization or is_integer_quantization(config):
        return None
    method = quantization.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: dequantized by its model class as it loads (models.gpt_oss)
        if config.get("model_type") != "gpt_oss":
            raise ValueError("quantization_config: mxfp4 is read for gpt-oss's experts only")
        return None
    if method == "bitnet":  # BitNet's ternary projections: read by its model class as it loads (models.bitnet)
        if config.get("model_type") != "bitnet":
            raise ValueError("quantization_config: bitnet is read for BitNet models only")
        return None
    if method == "fp8":
        if quantization.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config: FP8 format {quantization['fmt']!r}; only e4m3 is read")
        block = quantization.get("weight_block_size")
        static = quantization.get("activation_scheme", "dynamic") == "static"
        return Fp8Checkpoint("fp8", _pair(block) if block else None, static)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization)
    raise ValueError(f"quantization_config: quant_method {method!r} is not read (fp8, gptq, awq, compressed-tensors, "
                     "and gpt-oss's mxfp4 and BitNet's bitnet are)")


def _compressed_tensors(quantization: Mapping[str, Any]) -> Fp8Checkpoint:
    """compressed-tensors' FP8 schemes: every group's weights 8-bit floats per channel, tensor or block, with
    dynamic or static 8-bit float activations (or none)."""
    if quantization.get("format", "float-quantized") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {quantization.get('format')!r}: only float-quantized is read")
    blocks: set[tuple[int, int] | None] = set()
    static = False
    for name, group in (quantization.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        strategy = weights.get("strategy")
        if weights.get("num_bits") != 8 or weights.get("type") != "float" or strategy not in _STRATEGIES:
            raise ValueError(f"compressed-tensors group {name!r}: weights {weights} are not 8-bit floats per "
                             "channel, tensor or block")  # fmt: skip
        blocks.add(_pair(weights.get("block_structure")) if strategy == "block" else None)
        activations = group.get("input_activations")
        if activations:
            if activations.get("num_bits") != 8 or activations.get("type") != "float":
                raise ValueError(f"compressed-tensors group {name!r}: activations {activations} are not 8-bit floats")
            static = static or not activations.get("dynamic", False)
    if not blocks:
        raise ValueError("compressed-tensors: no config_groups")
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors: groups of different blocks {sorted(map(str, blocks))}")
    return Fp8Checkpoint("compressed-tensors", blocks.pop(), static)


def read_fp8_weights(folder: Path, checkpoint: Fp8Checkpoint, names: Collection[str]) -> dict[str, Fp8Weight]:
    """The FP8 weights named (checkpoint names, `<layer>.weight`) as stored, with their scales, reading only
    those tensors of the folder's files. Raises ValueError for a name that is not an FP8 weight there."""
    scale_of = checkpoint.fp8_weights(folder)
    missing = [name for name in names if name not in scale_of]
    if missing:
        raise ValueError(f"FP8 checkpoint {folder}: {missing[:3]} are not stored in FP8")
    wanted = {name for weight in names for name in (weight, scale_of[weight])}
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if name in wanted:
                    tensors[name] = handle.get_tensor(name)
    return {name: checkpoint.weight(tensors[name], tensors[scale_of[name]], name) for name in names}



def _pair(value: Any) -> tuple[int, int]:
    if not isinstance(value, list | tuple) or len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"quantization_config: block size {value!r}, expected [rows, columns]")
    return int(value[0]), int(value[1])
