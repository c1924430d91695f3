"""Which weights an engine keeps quantized (`EngineConfig.quantization`), and swapping its layers to them.

- `none`: the float weights, the exact path (greedy output equal to transformers').
- `gguf`: a GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks (`loader.gguf_quant`), exactly the weights llama.cpp
  serves from that file; its other tensors (F32, F16, K-quants) stay float.
- `int8`: every linear layer of any model, its float weight quantized to 8-bit groups of 32 (`quantize_q8`).
- `auto`: `gguf` for a GGUF model on the CPU (where the kernels are built), otherwise `none`.
`auto` is the default: for the embedded model on the CPU that is its GGUF blocks, whose quality against the
float model `tests/unit/test_quantization.py` checks; `none` stays the exact path the engine-level tests check
against transformers. The quantized kernels multiply 8-bit activations (quantized per group of 32 on the fly)
by the 4/8-bit weights in exact integer dot products for any number of rows, so a row's result does not depend
on its batch, bit for bit; they stream ~5x fewer weight bytes per decode step than float32 and run ~1.3-2x the
float32 GEMMs' multiply-adds per second at prefill and batch sizes (`vpmaddubsw`, 32 per instruction).
Quantized layers run on the CPU kernels (`kernels/cpu/quant_matmul.cpp`); on CUDA `int8` runs on the Triton
kernel `kernels.int8_linear` (the weight dequantized to the model's dtype in registers, x kept as it is) and
`gguf` is refused at start-up, as it is for a model that is not a GGUF file. `auto` stays `none` on CUDA.
The LM head of a model with tied embeddings is quantized (from the embedding's stored blocks under `gguf`)
while the embedding lookup keeps its float table: a lookup reads one row per token, the head reads them all.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import torch
from torch import nn

from engine_server.layers.decode_stack import build_decode_stack
from engine_server.layers.quantized_linear import (
    QuantizedLinear,
    QuantizedWeight,
    concat_rows,
    quantize_q8,
    replace_linears,
)
from engine_server.loader.gguf_quant import read_quantized_weights
from engine_server.loader.source import ModelSource
from engine_server.models.base import FUSED_SHARDS, CausalLM
from kernels.reference import QUANT_GROUP

Scheme = Literal["none", "gguf", "int8"]


def resolve_quantization(
    mode: str, source: ModelSource, device: torch.device, dtype: torch.dtype, kernels: bool, tp_size: int = 1
) -> Scheme:
    """The scheme `mode` means for `source` in `dtype` on `device`; `kernels` says whether the device's own
    kernels are there (the C++ ones built on the CPU, triton on CUDA). Raises ValueError (naming the flag) for a
    scheme this engine cannot serve. Under tensor parallelism (`tp_size > 1`) weights stay float (yet): `auto` is
    then `none`, and `gguf` and `int8` are refused. (int8 of each rank's slices ran, but its greedy output did not
    match TP=1's int8 closely enough to ship: issue 26's notes.) An encoder (BERT) keeps float weights: `auto`
    is `none` for it, `gguf` and `int8` are refused.
    """
    cpu_float32 = device.type == "cpu" and dtype == torch.float32
    if source.config.encoder:
        if mode not in ("auto", "none"):
            raise ValueError(f"--quantization {mode}: an encoder model ({source.name!r}) keeps its float weights")
        return "none"
    if mode == "auto":
        gguf = cpu_float32 and kernels and source.gguf_path is not None and tp_size == 1
        return "gguf" if gguf else "none"
    if mode in ("gguf", "int8") and tp_size > 1:
        raise ValueError(
            f"--quantization {mode}: quantized weights are not sharded under --tensor-parallel-size > 1 yet; "
            "use --quantization none (or auto)"
        )
    if mode == "none":
        return "none"
    if mode not in ("gguf", "int8"):
        raise ValueError(f"--quantization {mode!r}: expected auto, none, gguf or int8")
    if device.type == "cuda":
        if mode != "int8":
            raise ValueError("--quantization gguf: CUDA serves int8 weights (or none), not a GGUF file's blocks")
        if not kernels:
            raise ValueError("--quantization int8: needs triton on CUDA, which could not be imported here")
        return "int8"
    if not cpu_float32:
        raise ValueError(
            f"--quantization {mode}: quantized weights run on the CPU in float32 only, not {device.type} {dtype}"
        )
    if not kernels:
        raise ValueError(f"--quantization {mode}: needs the CPU kernels, which could not be built here")
    if mode == "gguf" and source.gguf_path is None:
        raise ValueError(f"--quantization gguf: model {source.name!r} is not a GGUF file")
    return "gguf" if mode == "gguf" else "int8"


def quantize_model(model: CausalLM, source: ModelSource, scheme: Scheme) -> dict[str, int]:
    """Swap `model`'s linear layers for `QuantizedLinear`s under `scheme`, and give its decoder the C++ decode
    stack where every projection is quantized; returns layers per format (`q4`, `q8`, and `float` for those left
    as they were) and `decode_stack` (1 when attached).

    On the CPU the model also gets `kernels.cpu_ops.batch_invariant_cpu_ops` (every token's attention on the
    decode kernel), so that with the integer kernels a token's result does not depend on its batch or on the
    prefix cache, bit for bit (README, Quantized weights)."""
    if scheme == "none":
        return {}
    if scheme == "gguf":
        assert source.gguf_path is not None
        config = source.config
        stored = read_quantized_weights(
            source.gguf_path,
            model_type=config.architecture,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
        )
        tied = config.tie_word_embeddings
        replace_linears(model, lambda name, _linear: _stored_weight(stored, name, tied))
    else:
        replace_linears(model, _int8_weight)
    formats = Counter(
        module.format if isinstance(module, QuantizedLinear) else "float"
        for module in model.modules()
        if isinstance(module, QuantizedLinear | nn.Linear)
    )
    model.model.decode_stack = build_decode_stack(model.model)
    if not any(module.qs.is_cuda for module in model.modules() if isinstance(module, QuantizedLinear)):
        from kernels.cpu_ops import batch_invariant_cpu_ops  # the kernels are built: quantized layers need them

        model.ops = batch_invariant_cpu_ops()
    return {**formats, "decode_stack": int(model.model.decode_stack is not None)}


def _stored_weight(stored: dict[str, QuantizedWeight], name: str, tied: bool) -> QuantizedWeight | None:
    """The stored weight of layer `name`: its checkpoint shards' rows for a fused layer, the embedding's blocks
    for a tied LM head; None when any part is not stored quantized."""
    if name == "lm_head" and tied:
        return stored.get("model.embed_tokens.weight")
    for fused, _, _ in FUSED_SHARDS:
        if name.endswith(f".{fused}"):
            parts = [name.removesuffix(fused) + part for f, part, _ in FUSED_SHARDS if f == fused]
            shards = [stored.get(f"{part}.weight") for part in parts]
            if any(shard is None for shard in shards):
                return None
            return concat_rows([shard for shard in shards if shard is not None])
    return stored.get(f"{name}.weight")


def _int8_weight(name: str, linear: nn.Linear) -> QuantizedWeight | None:
    if linear.in_features % QUANT_GROUP:
        return None
    return quantize_q8(linear.weight)
