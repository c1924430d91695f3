"""A kernel set: one backend's implementation of the primitive ops the decoder layers call (norm, rope,
activation, KV write, attention), and the torch reference set every backend must match.

The backends live beside it (`ladle_kernels.cpu_ops`, `ladle_kernels.triton_ops`); the engine picks one per device
(`engine_server.layers.kernel_choice.select_ops`) and never the other way round: nothing in `ladle_kernels` imports the
engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ladle_kernels import reference
from ladle_kernels.attention_inputs import AttentionInputs


@dataclass(frozen=True)
class KernelOps:
    """One backend's ops; each field has the signature and contract of the same name in `ladle_kernels.reference`."""

    rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    write_kv_cache: Callable[..., None]
    # Typed in full: the engine's metadata is checked against the kernels' own `AttentionInputs` where it calls.
    paged_attention: Callable[
        [torch.Tensor, torch.Tensor, AttentionInputs, float, int, float, torch.Tensor | None], torch.Tensor
    ]
    # LoRA adapters' two products over rows of many adapters (engine_server.lora): `reference.lora_shrink`'s and
    # `reference.lora_expand`'s contracts.
    lora_shrink: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = reference.lora_shrink
    lora_expand: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] = reference.lora_expand
    # Qwen3-Next and Qwen3.5: a Gated DeltaNet layer's core over a step's sequences (`gated_delta.gated_delta_net`)
    # and the attention's output gate (`reference.sigmoid_mul`).
    gated_delta_net: Callable[..., torch.Tensor] = reference.gated_delta_net
    sigmoid_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = reference.sigmoid_mul
    # LFM2: a short-convolution layer's convolution over a step's sequences (`causal_conv.short_convolution`).
    short_convolution: Callable[..., torch.Tensor] = reference.short_convolution
    # Granite 4.0's hybrids: a Mamba-2 layer's core over a step's sequences (`mamba2.mamba2_mixer`).
    mamba2_mixer: Callable[..., torch.Tensor] = reference.mamba2_mixer
    # Jamba, Mamba and Falcon Mamba: a Mamba-1 layer's convolution and its scan, gated, over a step's sequences
    # (`causal_conv.biased_convolution`, `mamba1.mamba1_scan`).
    mamba1_conv: Callable[..., torch.Tensor] = reference.mamba1_conv
    mamba1_scan: Callable[..., torch.Tensor] = reference.mamba1_scan
    # BLOOM, MPT, Falcon-RW: causal attention over the paged cache with a linear bias by distance
    # (`reference.alibi_attention`).
    alibi_attention: Callable[..., torch.Tensor] = reference.alibi_attention


REFERENCE_OPS = KernelOps(
    rms_norm=reference.rms_norm,
    rotary_embedding=reference.rotary_embedding,
    silu_and_mul=reference.silu_and_mul,
    write_kv_cache=reference.write_kv_cache,
    paged_attention=reference.paged_attention,
)
