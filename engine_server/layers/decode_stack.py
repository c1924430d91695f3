"""The C++ decode stack (`kernels/cpu/decoder.cpp`): a quantized model's steps in one call on the CPU.

A step from Python is ~10 op calls per layer, each with a few microseconds of interpreter and dispatcher
overhead; for SmolLM2-135M with 4-bit weights that was a third of a single-stream token. `DecodeStack` runs the
same kernels in the same order from C++, so `DecoderModel.forward` hands it every step and gets the layers' result
bit for bit (tests/unit/test_decode_stack.py). The quantized CPU path's attention takes every token as a decode row
of its own (`kernels.cpu_ops.paged_attention_by_token`), so a step with prompt tokens is one of decode rows too:
each prompt token with its sequence's block table and its position + 1 as length (`AttentionMetadata.token_rows`).
"""

from __future__ import annotations

from typing import cast

import torch

from engine_server.layers.decoder import DecoderLayer, DecoderModel, DecodeStack
from engine_server.layers.mlp import GatedMLP
from engine_server.layers.quantized_linear import QuantizedLinear
from kernels.cpu_ops import HEAD_DIMS, cpu_ops


def build_decode_stack(model: DecoderModel) -> DecodeStack | None:
    """A `torch.classes.ladle_cpu.DecodeStack` over `model`'s weights (shared, not copied), or None where it does not
    apply: a projection that is not a `QuantizedLinear`, q/k norms (Qwen3), a mixture of experts, partial rotary or
    LongRoPE (Phi-3), Gemma's blocks (sandwich norms, GeGLU, soft-capping, Gemma 3's local rope), weights not on
    the CPU or not float32, a head dim the attention kernel is not built for, no C++ kernels, or tensor parallelism
    without the shared-memory all-reduce (which the stack then runs between its layers, on the same buffers)."""
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    weight = model.norm.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not layers or cpu_ops() is None:
        return None
    reduce = model.tp.shm_reduce
    if model.tp.size > 1 and reduce is None:
        return None
    first = layers[0].self_attn
    if first.head_dim not in HEAD_DIMS or first.rotary_dim != first.head_dim or model.long_rope_after is not None:
        return None
    if model.local_rope or not all(type(layer) is DecoderLayer for layer in layers):  # Gemma's blocks and rope
        return None
    projections: list[list[QuantizedLinear]] = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, GatedMLP) or mlp.activation != "silu":
            return None
        parts = [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if attention.q_norm is not None or not all(isinstance(part, QuantizedLinear) for part in parts):
            return None
        projections.append([cast(QuantizedLinear, part) for part in parts])
    stack = torch.classes.ladle_cpu.DecodeStack(
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        model.norm.eps,
        first.scale,
        model.get_buffer("cos_sin_cache"),
        model.norm.weight.detach(),
    )
    if reduce is not None:
        buffers = reduce.buffers
        stack.set_all_reduce(buffers.slots, buffers.arrivals, reduce.counters, reduce.rank)
    for layer, own in zip(layers, projections, strict=True):
        ids = [
            stack.add_linear(linear.qs, linear.scales, linear.mins, linear.out_features, linear.bias) for linear in own
        ]
        stack.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            *ids,
            layer.self_attn.window,
        )
    return cast(DecodeStack, stack)
