"""The C++ decode stack (`ladle_kernels/cpu/decoder.cpp`): a quantized model's steps in one call on the CPU.

A step from Python is ~10 op calls per layer, each with a few microseconds of interpreter and dispatcher
overhead; for SmolLM2-135M with 4-bit weights that was a third of a single-stream token. `DecodeStack` runs the
same kernels in the same order from C++, so `DecoderModel.forward` hands it every step and gets the layers' result
bit for bit (tests/unit/test_decode_stack.py). The quantized CPU path's attention takes every token as a decode row
of its own (`ladle_kernels.cpu_ops.paged_attention_by_token`), so a step with prompt tokens is one of decode rows too:
each prompt token with its sequence's block table and its position + 1 as length (`AttentionMetadata.token_rows`).
Qwen3's and OLMoE's q/k norms (and OLMoE's clamp) and mixtures of experts (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE, OLMoE) over quantized experts (any of `QuantizedExperts`' formats, K-quants included) run in it too: their
routers, softmax and top-k through the same ATen calls as `layers.moe.route`. So do Gemma's blocks (Gemma 1's GeGLU;
Gemma 2's and 3's sandwich norms, soft-capped scores and windowed layers' own rope: `set_gemma_block`). With LoRA
adapters (engine_server.lora) the stack holds the slots' weights (`register_lora`) and a step with adapters runs in it
too, their kernels called as `LayerLora.add` calls them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine_server.layers.attention import PagedSelfAttention
from engine_server.layers.decoder import (
    DecoderLayer,
    DecoderModel,
    DecodeStack,
    ParallelDecoderLayer,
    PostNormDecoderLayer,
    SandwichDecoderLayer,
)
from engine_server.layers.hyper_connections import HyperConnectedDecoderModel
from engine_server.layers.mlp import GatedMLP
from engine_server.layers.moe import SparseMoE
from engine_server.layers.norm import LayerNorm, RMSNorm
from engine_server.layers.quantized_experts import QuantizedExperts, RowwiseLinear
from engine_server.layers.quantized_linear import QuantizedLinear
from engine_server.lora.slots import LoraSlots
from engine_server.lora.targets import PROJECTIONS
from ladle_kernels.cpu_ops import HEAD_DIMS, cpu_ops

# A mixture of experts as the stack takes it: its quantized experts, its router, its shared expert's projections.
MoeParts = tuple[QuantizedExperts, RowwiseLinear, list[QuantizedLinear] | None]


def _moe_parts(mlp: SparseMoE) -> MoeParts | None:
    """A mixture of experts' quantized experts, its router and its shared expert's projections (None without one),
    or None where the stack does not run it (float experts, GELU ones, Nemotron-H's relu² ones or gpt-oss's, with
    biases and the clamped SwiGLU; a float or biased router, a shared expert not quantized or not SiLU)."""
    experts, router = mlp.experts, mlp.gate
    if not isinstance(experts, QuantizedExperts) or not isinstance(router, RowwiseLinear) or experts.gelu:
        return None
    if experts.relu2 or experts.swiglu is not None or experts.b13 is not None or router.bias is not None:
        return None
    if mlp.sparsemixer:  # PhiMoE's router, which the stack's softmax top-k is not
        return None
    shared, shared_gate = mlp.shared_expert, mlp.shared_expert_gate
    if shared is None:
        return experts, router, None
    if not isinstance(shared, GatedMLP):
        return None
    parts = [shared.gate_up_proj, shared.down_proj]
    if shared.activation != "silu" or shared.limit or not isinstance(shared_gate, RowwiseLinear):
        return None
    if not all(isinstance(part, QuantizedLinear) for part in parts):
        return None
    return experts, router, [cast(QuantizedLinear, part) for part in parts]


# The blocks the stack runs as they are: the pre-norm block, OLMo 2's post-norm one (`set_post_norm_block`).
_PRE_OR_POST_NORM = (DecoderLayer, PostNormDecoderLayer)


def _plain_sandwich(layer: nn.Module) -> bool:
    """Whether `layer` is Gemma 2 and 3's block alone (`SandwichDecoderLayer` without Beam's depth scales or Ergo's
    residual gates, which the stack does not run)."""
    return (
        type(layer) is SandwichDecoderLayer
        and layer.depth_scales is None
        and layer.attention_residual_gate is None
        and layer.feedforward_residual_gate is None
    )


def _cohere_block(layer: nn.Module) -> bool:
    """Whether `layer` is Cohere's parallel block (one LayerNorm, weight alone, feeding the attention and a gated
    MLP), which the stack runs (`set_parallel_blocks`); not Phi's or GPT-NeoX's (biased norms, a second norm)."""
    return (
        type(layer) is ParallelDecoderLayer
        and not layer.mlp_norm
        and type(layer.input_layernorm) is LayerNorm
        and isinstance(layer.mlp, GatedMLP)
    )


def _attends_otherwise(attention: PagedSelfAttention) -> bool:
    """Whether `attention` does what the stack's does not: ALiBi (BLOOM's, MPT's, Baichuan's), an output gate
    (AFMoE's), weightless value norms, another layer's K/V (Gemma 4's), chunked attention (Llama 4's), int8 inputs
    (BitNet's)."""
    return bool(
        attention.alibi or attention.output_gate or attention.value_norm or attention.shares_kv or attention.chunk
        or attention.int8_inputs
    )  # fmt: skip


def build_decode_stack(model: DecoderModel) -> DecodeStack | None:
    """A `torch.classes.ladle_cpu.DecodeStack` over `model`'s weights (shared, not copied), or None where it does not
    apply: a projection that is not a `QuantizedLinear`, a mixture of experts not over `QuantizedExperts` with a
    `RowwiseLinear` router (`_moe_parts`), rope over a share of the head that differs between layers (Laguna),
    Beam's or Ergo's blocks (it runs Gemma's sandwich norms, GeGLU, soft-capping and windowed layers' own rope, as
    Phi-3's partial rotary and LongRoPE, SmolLM3's NoPE layers, Granite's multipliers, Ministral 3's query
    temperatures, Cohere's parallel blocks and OLMo 2's post-norm ones), attention sinks (gpt-oss), weightless q/k
    norms (Llama 4), q/k norms after rope (Hunyuan), Llama 4's router, PhiMoE's, Jais 2's and OLMo's LayerNorms,
    hyper-connections (HY-V4), ALiBi and the other attentions of `_attends_otherwise`, weights not on the CPU or not
    float32, a head dim the attention kernel is not built for, no C++ kernels, or tensor parallelism without the
    shared-memory all-reduce (which the stack then runs between its layers, on the same buffers)."""
    if not model.stackable:
        return None
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    weight = model.norm.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not layers or cpu_ops() is None:
        return None
    reduce = model.tp.shm_reduce
    if model.tp.size > 1 and reduce is None:
        return None
    if isinstance(model, HyperConnectedDecoderModel):
        return None  # residual streams (HY-V4): the stack keeps one residual
    if not all(type(layer.self_attn) is PagedSelfAttention for layer in layers):
        return None  # latent attention (DeepSeek-V3), MiniMax-M3's block-sparse attention
    attentions = [cast(PagedSelfAttention, layer.self_attn) for layer in layers]
    first = attentions[0]
    if first.head_dim not in HEAD_DIMS or any(attention.rotary_dim != first.rotary_dim for attention in attentions):
        return None  # (Laguna's windowed layers turn a share of their own)
    if any(attention.g_proj is not None for attention in attentions):  # Laguna's softplus gate on each head
        return None
    if first.sinks is not None or any(attention.qk_unit_norm for attention in attentions):
        return None
    if any(_attends_otherwise(attention) for attention in attentions):
        return None
    if any(attention.scale != first.scale for attention in attentions):  # the stack scales every layer's alike
        return None
    if any(attention.attn_sub_norm is not None for attention in attentions):  # BitNet's norm before o_proj
        return None
    if first.qk_norm_after_rope:  # Hunyuan's q/k norms, which the stack runs before rope
        return None
    if model.tp.size > 1 and first.qk_norm_whole:  # its q/k norms all-reduce their squares (`ShardedRMSNorm`)
        return None
    if any(isinstance(layer.mlp, SparseMoE) and layer.mlp.input_scaled for layer in layers):
        return None  # Llama 4's router, which scales the experts' inputs
    parallel = all(_cohere_block(layer) for layer in layers) and type(model.norm) is LayerNorm
    if not parallel and not all(type(layer) in _PRE_OR_POST_NORM or _plain_sandwich(layer) for layer in layers):
        return None  # Beam's and Ergo's blocks, the other forms'
    if type(model.norm) is not RMSNorm and not parallel:  # PhiMoE's, Jais 2's, OLMo's LayerNorms
        return None
    plans: list[tuple[list[QuantizedLinear], MoeParts | None]] = []
    for layer, attention in zip(layers, attentions, strict=True):
        mlp = layer.mlp
        parts: list[nn.Module] = [attention.qkv_proj, attention.o_proj]
        moe = None
        if isinstance(mlp, SparseMoE):
            moe = _moe_parts(mlp)
            if moe is None:
                return None
        elif isinstance(mlp, GatedMLP) and mlp.activation in ("silu", "gelu_tanh") and not mlp.limit:
            parts += [mlp.gate_up_proj, mlp.down_proj]
        else:
            return None
        if not all(isinstance(part, QuantizedLinear) for part in parts):
            return None
        plans.append(([cast(QuantizedLinear, part) for part in parts], moe))
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

    def add(linear: QuantizedLinear) -> int:
        (packed, scales, mins, rows), *more = linear.parts
        index: int = stack.add_linear(packed, scales, mins, rows, linear.bias)
        for part in more:  # the shards of a fused projection stored in different formats
            stack.add_linear_part(index, *part)
        return index

    if model.local_rope:
        stack.set_local_rope(model.get_buffer("local_cos_sin_cache"))
    if first.rotary_dim != first.head_dim:  # Phi-3's partial rotary (LongRoPE's rows are `forward`'s positions)
        stack.set_rotary_dim(first.rotary_dim)
    for layer, attention, (own, moe), reads_local in zip(layers, attentions, plans, model.local_rope_layers,
                                                          strict=True):  # fmt: skip
        ids = [add(linear) for linear in own] + ([-1, -1] if moe is not None else [])
        if isinstance(layer, PostNormDecoderLayer):  # OLMo 2's: no input norm (the stack reads none for it)
            post_norm = layer.post_attention_layernorm.weight.detach()
            stack.add_layer(post_norm, post_norm, *ids, attention.window)
            stack.set_post_norm_block(layer.post_feedforward_layernorm.weight.detach())
        else:  # (Cohere's one norm feeds both halves)
            input_norm = layer.input_layernorm.weight.detach()
            post_norm = input_norm if parallel else layer.post_attention_layernorm.weight.detach()
            stack.add_layer(input_norm, post_norm, *ids, attention.window)
        if attention.q_norm is not None and attention.k_norm is not None:
            q_weight, k_weight = attention.q_norm.weight.detach(), attention.k_norm.weight.detach()
            stack.set_qk_norms(q_weight, k_weight, attention.q_norm.eps, attention.qk_norm_whole)
        if attention.clip_qkv:
            stack.set_clip_qkv(attention.clip_qkv)
        if not attention.rope or layer.residual_multiplier != 1.0:  # SmolLM3's NoPE layers, Granite's scales
            stack.set_layer_options(attention.rope, layer.residual_multiplier)
        if attention.temperature:  # Ministral 3's query scale by position
            temperatures = attention.get_buffer("temperatures")
            stack.set_query_temperature(temperatures, attention.temperature_floor, attention.temperature_offset)
        gelu = isinstance(layer.mlp, GatedMLP) and layer.mlp.activation == "gelu_tanh"
        norms = (
            (layer.pre_feedforward_layernorm.weight.detach(), layer.post_feedforward_layernorm.weight.detach())
            if isinstance(layer, SandwichDecoderLayer) else (None, None)
        )  # fmt: skip
        if norms[0] is not None or gelu or attention.softcap or reads_local:  # Gemma's block (Gemma 1's GeGLU)
            stack.set_gemma_block(*norms, gelu, float(attention.softcap or 0.0), reads_local)
        if moe is not None:
            experts, router, shared = moe
            sparse = cast(SparseMoE, layer.mlp)
            stack.set_experts(
                router.weight.detach(), experts.w13, experts.w13_scales, experts.w13_mins, experts.w2,
                experts.w2_scales, experts.w2_mins, experts.intermediate, sparse.top_k, sparse.renormalize,
            )  # fmt: skip
            if shared is not None:
                gate = cast(RowwiseLinear, sparse.shared_expert_gate)
                stack.set_shared_expert(gate.weight.detach(), add(shared[0]), add(shared[1]))
    if parallel:
        stack.set_parallel_blocks()
    return cast(DecodeStack, stack)


def register_lora(model: DecoderModel, slots: LoraSlots) -> bool:
    """Hands `model`'s decode stack the LoRA `slots`' weights, shared (the runner's later loads into them are read
    by the next step), so that steps with adapters run in it too (`DecoderModel.decode_stack_lora`); False, doing
    nothing, where the model has no stack."""
    stack = model.decode_stack
    if stack is None:
        return False
    for layer, projections in enumerate(slots.stacks):
        for name, (a, bs) in projections.items():
            segments = slots.shapes[layer][name].segments
            offsets, parts = [segment.out_offset for segment in segments], [segment.part for segment in segments]
            stack.set_lora(layer, PROJECTIONS.index(name), a, bs, offsets, parts, slots.max_rank)
    model.decode_stack_lora = slots
    return True
