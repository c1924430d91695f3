"""The decoder stack shared by every family: embeddings, pre-norm attention + MLP blocks (Gemma's with sandwich
norms), final norm."""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import LongRope, ModelConfig, NormedResiduals, Yarn
from engine_server.layers.attention import PagedSelfAttention
from engine_server.layers.block_sparse_attention import BlockSparseAttention
from engine_server.layers.compressed_attention import CompressedAttention
from engine_server.layers.differential_attention import DifferentialAttention
from engine_server.layers.gated_deltanet import GatedDeltaNet
from engine_server.layers.kimi_delta import KimiDeltaAttention
from engine_server.layers.kolibri_attention import KolibriIndexedAttention
from engine_server.layers.lightning_attention import LightningAttention
from engine_server.layers.mamba1 import Mamba1Mixer
from engine_server.layers.mamba2 import Mamba2Mixer
from engine_server.layers.mixture_of_attention import MixtureOfAttention
from engine_server.layers.mla import MultiLatentAttention
from engine_server.layers.mlp import GatedMLP, UngatedMLP, clamped_swiglu_args
from engine_server.layers.mlstm import MLstmMixer
from engine_server.layers.moe import SparseMoE
from engine_server.layers.norm import BiasedLayerNorm, GatedRMSNorm, RMSNorm, norm_class
from engine_server.layers.qsa_attention import QsaAttention
from engine_server.layers.rg_lru import RecurrentBlock
from engine_server.layers.short_conv import ShortConv
from engine_server.lora.slots import LayerLora, LoraBatch, LoraSlots
from engine_server.lora.targets import PROJECTIONS
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import VocabParallelEmbedding
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import build_cos_sin_cache, build_longrope_cos_sin_cache, build_yarn_cos_sin_cache


class DecoderLayer(nn.Module):
    """`h += attn(norm(h)); h += mlp(norm(h))`, with the residual adds fused into the following norm. The MLP is a
    mixture of experts where the config says so for layer `index` (`ModelConfig.is_moe_layer`), else dense; a layer
    of Nemotron-H's may have none (`ModelConfig.has_mlp`: `h += attn(norm(h))` alone, `mlp` None and no
    post-attention norm). A step's cross-attention that runs inside the layers (Whisper's over a clip:
    `AttentionMetadata.cross_attention` with `inside`) adds its output to the stream between the two halves."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__()
        self.index = index
        self.residual_multiplier = config.residual_multiplier
        self.normed_residuals = config.normed_residuals
        # The token mixer: attention, or on a hybrid's recurrent layers Gated DeltaNet (whose checkpoints call it
        # `linear_attn`: `models.qwen3_next` reads it under this name), LFM2's short convolution (`conv`:
        # `models.lfm2`), Mamba-2 (`mamba`: `models.granitemoe`) or Mamba-1 (`mamba`: `models.jamba`).
        self.self_attn: (
            PagedSelfAttention
            | MultiLatentAttention
            | GatedDeltaNet
            | KimiDeltaAttention
            | ShortConv
            | Mamba2Mixer
            | Mamba1Mixer
            | CompressedAttention
            | LightningAttention
            | RecurrentBlock
            | MixtureOfAttention
            | QsaAttention
            | MLstmMixer
        ) = (
            (KimiDeltaAttention if config.linear_attention.kimi_delta else GatedDeltaNet)(config, dtype, tp)
            if config.is_linear_layer(index) and config.linear_attention is not None
            else Mamba2Mixer(config, dtype, tp)
            if config.mamba2 is not None and config.is_recurrent_layer(index)
            else Mamba1Mixer(config, dtype, tp)
            if config.mamba1 is not None and config.is_recurrent_layer(index)
            else LightningAttention(config, dtype, tp, index)
            if config.lightning is not None and config.is_recurrent_layer(index)
            else RecurrentBlock(config, dtype, tp)
            if config.rg_lru is not None and config.is_recurrent_layer(index)
            else MLstmMixer(config, dtype, tp)
            if config.mlstm is not None and config.is_recurrent_layer(index)
            else ShortConv(config, dtype, tp)
            if config.is_recurrent_layer(index)
            else MultiLatentAttention(config, dtype, tp, index)
            if config.latent_attention is not None
            else CompressedAttention(config, dtype, index)
            if config.compressed_attention is not None
            else BlockSparseAttention(config, dtype, tp, index)
            if config.block_sparse is not None and index in config.block_sparse.layers
            else QsaAttention(config, dtype, tp, index)
            if config.qwen4_exp is not None
            else KolibriIndexedAttention(config, dtype, tp, index)
            if config.kolibri_index is not None and index in config.kolibri_index.layers
            else MixtureOfAttention(config, dtype)
            if config.mixture_of_attention
            else DifferentialAttention(config, dtype, tp, index)
            if config.differential_attention
            else PagedSelfAttention(
                config, dtype, o_proj_bias, tp, config.attention_window(index), config.uses_rope(index), index
            )
        )
        width = config.layer_intermediate_size(index)
        self.mlp: GatedMLP | SparseMoE | UngatedMLP | None = (
            None
            if not config.has_mlp(index)
            else SparseMoE(config, dtype, tp, hashed=config.is_hash_routed(index))
            if config.is_moe_layer(index)
            else UngatedMLP(config.hidden_size, width, dtype, tp, config.hidden_act, config.mlp_bias)
            if config.ungated_mlp
            else GatedMLP(config.hidden_size, width, dtype, tp, config.hidden_act,
                          sub_norm_eps=config.rms_norm_eps if config.sub_norms else 0.0,
                          int8_inputs=bool(config.ternary_projections), bias=config.mlp_bias,
                          **clamped_swiglu_args(config))
        )
        norm = norm_class(config)
        # A.X K2 (`gated_norm_rank`): the input norm gated, and a sparse layer's norm before its MLP
        gated = functools.partial(GatedRMSNorm, rank=config.gated_norm_rank) if config.gated_norm_rank else norm
        self.input_layernorm = gated(config.hidden_size, config.rms_norm_eps, dtype)
        mlp_norm = gated if config.is_moe_layer(index) else norm
        self.post_attention_layernorm = mlp_norm(config.hidden_size, config.rms_norm_eps, dtype)
        if self.mlp is None:
            del self.post_attention_layernorm  # nothing to normalise for: the checkpoint has no such norm

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp output, residual stream)`; their sum is the layer's output hidden state. `lora`: the
        step's LoRA adapters (engine_server.lora), added to each projection."""
        layer_lora = None if lora is None else lora.layer(self.index)
        attended, residual = self.attend(positions, hidden, residual, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        if self.residual_multiplier != 1.0:  # Granite: each output scaled before its residual add
            attended = attended * self.residual_multiplier
        cross = meta.cross_attention
        if cross is not None and cross.inside and self.index in cross.positions:  # (Whisper's, over a clip)
            attended, residual = cross.apply(self.index, attended, residual)
        if self.mlp is None:  # (Nemotron-H) the next layer's norm adds the mixer's output to the stream
            return attended, residual
        hidden, residual = self.post_attention_layernorm.add_and_norm(attended, residual, ops)
        out = self.feed_forward(hidden, ops, layer_lora)
        return (out * self.residual_multiplier if self.residual_multiplier != 1.0 else out), residual

    def feed_forward(
        self, hidden: torch.Tensor, ops: KernelOps, lora: LayerLora | None, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MLP (a gated one with the step's adapters; experts take none: engine_server.lora.peft_format), experts
        routed by the tokens' ids `token_ids` where the config says so (DeepSeek-V4's first layers)."""
        assert self.mlp is not None, "a layer without an MLP feeds nothing forward"
        if lora is not None and isinstance(self.mlp, GatedMLP | UngatedMLP):
            return self.mlp(hidden, ops, lora)
        if isinstance(self.mlp, SparseMoE):
            return self.mlp(hidden, ops, token_ids)
        return self.mlp(hidden, ops)

    def attend(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LayerLora | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's first half: `(attention output, residual stream)` from the previous layer's pair (the
        input norm fuses their add; the first layer gets no residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, ops)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, ops)
        return self.self_attn(positions, hidden, kv_cache, cos_sin_cache, meta, ops, lora), residual


class ResidualGate(nn.Module):
    """Ergo's gated residual add of an output to the stream h: `out * g + h * sqrt(1 + g) * exp(-softplus(w) / 2)`,
    `g = sigmoid(w)`, w a learned vector (float32, as trained; the scales in float32)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=torch.float32), requires_grad=False)

    def forward(self, out: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the output's share, the stream's), whose sum is the add."""
        weight = self.weight.float()
        gate = torch.sigmoid(weight)
        kept = torch.sqrt(1.0 + gate) * torch.exp(-0.5 * F.softplus(weight))
        return (out * gate).to(out.dtype), (stream * kept).to(stream.dtype)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2 and 3's block: `h += post_attn(attn(input(h))); h += post_ff(mlp(pre_ff(h)))`, each output normalised
    before its residual add (and then scaled by `residual_multiplier`: HyperCLOVA X SEED's; with
    `ModelConfig.depth_scaled_residuals`, Beam's, each add `out / sqrt(k) + h * sqrt((k - 1) / k)`, k its count; with
    `ModelConfig.residual_gates`, Ergo's, each add gated by a `ResidualGate` of its own).
    Same interface as `DecoderLayer`: it takes the previous layer's `(output, residual stream)`, adds them, and
    returns its MLP's normalised (and scaled) output beside the stream it adds to."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Beam's depth-scaled residual adds: (output, stream) scales of the attention's and of the MLP's
        def scales(k: int) -> tuple[float, float]:
            return 1 / math.sqrt(k), math.sqrt((k - 1) / k)

        self.depth_scales: tuple[tuple[float, float], tuple[float, float]] | None = (
            (scales(2 * index + 2), scales(2 * index + 3)) if config.depth_scaled_residuals else None
        )
        # Ergo's gated residual adds: the attention's and the MLP's own
        self.attention_residual_gate = ResidualGate(config.hidden_size) if config.residual_gates else None
        self.feedforward_residual_gate = ResidualGate(config.hidden_size) if config.residual_gates else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer_lora = None if lora is None else lora.layer(self.index)
        attended, residual = self.attend(positions, hidden, residual, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        normed = self.post_attention_layernorm(attended, ops)
        if self.residual_multiplier != 1.0:
            normed = normed * self.residual_multiplier
        if self.depth_scales is not None:
            (out_scale, stream_scale), _ = self.depth_scales
            normed, residual = normed * out_scale, residual * stream_scale
        if self.attention_residual_gate is not None:
            normed, residual = self.attention_residual_gate(normed, residual)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(normed, residual, ops)
        out = self.post_feedforward_layernorm(self.feed_forward(hidden, ops, layer_lora), ops)
        if self.depth_scales is not None:  # the next layer's input norm adds the pair
            _, (out_scale, stream_scale) = self.depth_scales
            return out * out_scale, residual * stream_scale
        if self.feedforward_residual_gate is not None:
            return self.feedforward_residual_gate(out, residual)
        return (out * self.residual_multiplier if self.residual_multiplier != 1.0 else out), residual


class PostNormDecoderLayer(DecoderLayer):
    """OLMo 2's block: `h += post_attn(attn(h)); h += post_ff(mlp(h))`, no norm before the attention or the MLP,
    each output normalised before its residual add. Same interface as `DecoderLayer`: it takes the previous layer's
    `(output, residual stream)`, adds them, and returns its MLP's normalised output beside the stream it adds to."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        del self.input_layernorm  # no pre-norms: the checkpoint has none to load
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer_lora = None if lora is None else lora.layer(self.index)
        stream = hidden if residual is None else hidden + residual
        attended = self.self_attn(positions, stream, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        stream = stream + self.post_attention_layernorm(attended, ops)
        return self.post_feedforward_layernorm(self.feed_forward(stream, ops, layer_lora), ops), stream


class NormedResidualDecoderLayer(DecoderLayer):
    """MiniMax-01's block (`ModelConfig.normed_residuals`): `n = norm(x); y = a n + b mixer(n); m = norm2(y);
    x' = a' m + b' mlp(m)`, each sublayer's residual its normalised input, scaled (the attention's (a, b) its kind's:
    full or lightning). Returned as the pair `(b' mlp(m), a' m)`, whose sum the next norm takes."""

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scales = self.scales
        layer_lora = None if lora is None else lora.layer(self.index)
        if residual is None:
            normed = self.input_layernorm(hidden, ops)
        else:
            normed, _ = self.input_layernorm.add_and_norm(hidden, residual, ops)
        mixed = self.self_attn(positions, normed, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        alpha, beta = scales.linear if isinstance(self.self_attn, LightningAttention) else scales.full
        normed = self.post_attention_layernorm(normed * alpha + mixed * beta, ops)
        alpha, beta = scales.mlp
        return self.feed_forward(normed, ops, layer_lora) * beta, normed * alpha

    @property
    def scales(self) -> NormedResiduals:
        assert self.normed_residuals is not None
        return self.normed_residuals


class ParallelDecoderLayer(DecoderLayer):
    """Cohere's, Phi's and StableLM 2 12B's block: `h += attn(norm(h)) + mlp(norm(h))`, the attention and the MLP both
    reading the one input norm; GPT-NeoX's (`ModelConfig.parallel_mlp_norm`) `h += attn(ln1(h)) + mlp(ln2(h))`, the
    MLP reading `post_attention_layernorm`. Same interface as `DecoderLayer`: it takes the previous layer's `(output,
    residual stream)`, adds them, and returns the sum of its attention's and MLP's outputs beside the stream it adds
    to."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        self.mlp_norm = config.parallel_mlp_norm
        if not self.mlp_norm:
            del self.post_attention_layernorm  # one norm feeds both: the checkpoint has no second

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer_lora = None if lora is None else lora.layer(self.index)
        stream = hidden if residual is None else hidden + residual
        normed = self.input_layernorm(stream, ops)
        attended = self.self_attn(positions, normed, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        mlp_input = self.post_attention_layernorm(stream, ops) if self.mlp_norm else normed
        return attended + self.feed_forward(mlp_input, ops, layer_lora), stream


def _tokens_of_long_sequences(meta: AttentionMetadata, longer_than: int, tokens: int) -> torch.Tensor:
    """`[T]` bool: whether each token's sequence is longer than `longer_than` as of this step."""
    long = meta.seq_lens > longer_than
    if meta.max_query_len == 1:
        return long  # one token per sequence (a decode step): no gather, so a CUDA graph records it as it is
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    return torch.repeat_interleave(long, query_lens, output_size=tokens)


def lora_segment_bits(changed: frozenset[tuple[str, int]] | None) -> int:
    """`LoraBatch.changed` as `DecodeStack.forward` takes it: bit `4 * p + s` set for segment s of projection p
    (`lora.targets.PROJECTIONS[p]`); -1, every bit, for None (every segment)."""
    if changed is None:
        return -1
    return sum(1 << (4 * PROJECTIONS.index(projection) + segment) for projection, segment in changed)


class DecodeStack(Protocol):
    """All layers of a step in one native call (`torch.classes.ladle_cpu.DecodeStack`, built by
    `layers.decode_stack.build_decode_stack`): the same kernels in the same order as `DecoderModel`'s layers, so
    the same bits. Every row is a decode row (a prompt token is one too: `AttentionMetadata.token_rows`)."""

    def set_lora(
        self,
        layer: int,
        projection: int,
        a: torch.Tensor,
        bs: list[torch.Tensor],
        offsets: list[int],
        parts: list[int],
        rank: int,
    ) -> None:
        """Holds (not copies) layer `layer`'s LoRA slots of `PROJECTIONS[projection]` (`LoraSlots.stacks`' `a`
        and `bs`, each segment's output offset and rank block), read at every step given `lora_slots`."""
        ...

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        stop: torch.Tensor | None,
        lora_slots: torch.Tensor | None = None,
        lora_segments: int = -1,
    ) -> torch.Tensor:
        """The final hidden states, after the model's norm (as the layers' path returns them); fewer rows than
        `hidden` when `stop` was set between two layers (the step was interrupted). With `lora_slots` (each
        token's slot, `LoraBatch.slots`), each projection gets the adapters of the segments in `lora_segments`
        (`lora_segment_bits`) as `LayerLora.add` adds them."""
        ...


class DecoderModel(nn.Module):
    """Token ids -> final normalised hidden states, reading and writing the paged KV cache.

    Under tensor parallelism (`tp.size > 1`) every rank runs this forward on the same inputs, in step: the hidden
    states are the same on every rank (each all-reduce hands every rank the same sum), the KV cache each rank's own.
    """

    # A family's own block (Gemma 4's), else the one the config's norms pick.
    layer_class: type[DecoderLayer] | None = None
    # Whether the C++ decode stack (`layers.decode_stack`) may run its layers (Dory's are its own).
    stackable = True

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        # GPT-2's and GPT-BigCode's learned positions, added to the tokens' (`ModelConfig.absolute_positions`).
        self.embed_positions = (
            VocabParallelEmbedding(config.max_position_embeddings, config.hidden_size, tp, dtype)
            if config.absolute_positions else None
        )  # fmt: skip
        # Gemma: the embeddings times sqrt(hidden_size), a float32 scalar rounded to the weights' dtype (as
        # transformers does); a buffer, so it moves with the module (and a CUDA graph reads it in place).
        self.scales_embeddings = config.embedding_multiplier != 1.0
        if self.scales_embeddings:
            multiplier = torch.tensor(config.embedding_multiplier, dtype=torch.float32).to(dtype)
            self.register_buffer("embedding_multiplier", multiplier, persistent=False)
        # BLOOM: the embeddings LayerNorm'd with a weight and a bias (`word_embeddings_layernorm`).
        self.embed_layernorm = BiasedLayerNorm(config.hidden_size, config.rms_norm_eps, dtype) \
            if config.embedding_layer_norm else None  # fmt: skip
        # NanoChat: the embeddings RMS-normalised without a weight (a buffer of ones, as `ops.rms_norm` takes one).
        self.norm_eps = config.rms_norm_eps
        self.embedding_norm = config.embedding_norm
        if self.embedding_norm:
            self.register_buffer("embedding_norm_weight", torch.ones(config.hidden_size, dtype=dtype), persistent=False)
        block = self.layer_class or (
            NormedResidualDecoderLayer if config.normed_residuals is not None
            else SandwichDecoderLayer if config.sandwich_norms else PostNormDecoderLayer if config.post_norms
            else ParallelDecoderLayer if config.parallel_block else DecoderLayer
        )  # fmt: skip
        # OLMo Hybrid: post-norm blocks around its attention, pre-norm ones around its linear attention.
        self.layers = nn.ModuleList(
            (DecoderLayer if config.post_norms and config.is_linear_layer(index) else block)(
                config, dtype, o_proj_bias, tp, index
            )
            for index in range(config.num_hidden_layers)
        )
        norm = norm_class(config)
        self.norm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        scaling = config.rope_scaling
        # LongRoPE: a second table of rows for the tokens of sequences past `original_max_position_embeddings`.
        self.long_rope_after: int | None = None
        if isinstance(scaling, LongRope):
            self.long_rope_after = scaling.original_max_position_embeddings
            cache = build_longrope_cos_sin_cache(
                config.rotary_dim, config.max_position_embeddings, config.rope_theta, scaling.short_factor,
                scaling.long_factor, scaling.attention_factor, dtype,
            )  # fmt: skip
        elif isinstance(scaling, Yarn):
            cache = build_yarn_cos_sin_cache(
                config.rotary_dim, config.max_position_embeddings, config.rope_theta, scaling, dtype
            )
        else:
            cache = build_cos_sin_cache(
                config.rotary_dim, config.max_position_embeddings, config.rope_theta, scaling, dtype,
                config.rope_linear_factor, rotated_angles=config.rope_rotated_angles or None,
            )  # fmt: skip
        # Derived from the config, not loaded: kept out of the state dict but moved with the module.
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        # Gemma 3: the windowed layers' rope has a base of its own (and no scaling); which layers read it is fixed.
        self.local_rope = bool(config.local_rope_theta)
        images = None if config.multimodal is None else config.multimodal.images
        self.mrope_section = () if images is None else images.mrope_section  # the rotated pairs' M-RoPE sections
        self.mrope_interleaved = images is not None and images.mrope_interleaved
        self.deepstack_layers = 0 if images is None else images.deepstack_layers
        self.local_rope_layers = [
            self.local_rope and config.attention_window(i) > 0 for i in range(config.num_hidden_layers)
        ]
        if self.local_rope:
            local = build_cos_sin_cache(config.local_rotary_dim, config.max_position_embeddings,
                                        config.local_rope_theta, None, dtype)  # fmt: skip
            self.register_buffer("local_cos_sin_cache", local, persistent=False)
        # The second forward path: `layers.decode_stack.build_decode_stack(self)`, set once the weights are final
        # (quantization.quantize_model sets it only with ops whose attention takes every token as a decode row of
        # its own). When set, it runs every step in place of the layers below, a step with LoRA adapters only where
        # the stack holds their slots' weights: `decode_stack_lora` (`layers.decode_stack.register_lora`).
        self.decode_stack: DecodeStack | None = None
        self.decode_stack_lora: LoraSlots | None = None

    def rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The `cos_sin_cache` row of each token: its position, or with LongRoPE its position in the long factors'
        table for the tokens of sequences longer than `original_max_position_embeddings` as of this step."""
        if self.long_rope_after is None:
            return positions
        long = _tokens_of_long_sequences(meta, self.long_rope_after, positions.shape[0])
        long_table_start = self.get_buffer("cos_sin_cache").shape[0] // 2
        return positions + long.to(positions.dtype) * long_table_start

    def _mrope_rows(self, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """M-RoPE's `cos_sin_cache` rows `[T, D]` of tokens at (temporal, height, width) `positions` `[3, T]`: each
        rotated pair's cos and sin from the row of the position its section turns it by (`ImageInput.mrope_section`:
        the first pairs by time, the next by height, the last by width; interleaved, Qwen3-VL's), as transformers'
        Qwen-VL models rotate them."""
        assert self.mrope_section, "only a model with M-RoPE sections takes 3-D positions"
        section = torch.tensor(self.mrope_section)
        component = torch.repeat_interleave(torch.arange(3), section)  # [D / 2]: a pair's
        if self.mrope_interleaved:  # Qwen3-VL's: pair i by height where i % 3 == 1, by width where 2, within their
            component = torch.zeros_like(component)  # sections' share (3 x its size), else by time
            for axis in (1, 2):
                component[axis : 3 * self.mrope_section[axis] : 3] = axis
        component = component.to(table.device)
        if component.shape[0] * 2 != table.shape[1]:
            raise ValueError(f"M-RoPE sections {section.tolist()} do not cover the {table.shape[1] // 2} rotated pairs")
        rows = table[positions]  # [3, T, D]
        index = torch.cat((component, component)).view(1, 1, -1).expand(1, rows.shape[1], -1)
        return rows.gather(0, index)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """The tokens' embeddings `[T, hidden]`, with learned positions added, scaled or normalised as the family
        does."""
        hidden = self.embed_tokens(input_ids)
        if self.scales_embeddings:  # (the tokens' alone: XGLM's and BioGPT's positions are not scaled)
            hidden = hidden * self.get_buffer("embedding_multiplier")
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(positions)
        if self.embedding_norm:
            hidden = ops.rms_norm(hidden, self.get_buffer("embedding_norm_weight"), self.norm_eps)
        if self.embed_layernorm is not None:
            hidden = self.embed_layernorm(hidden, ops)
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
        interrupt: StepInterrupt | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """With `interrupt`, raises `StepInterrupted` after the first layer that ends with it set (the layers
        before wrote their K/V; engine_server.step_interrupt). `lora`: the step's LoRA adapters (run in the
        decode stack when it holds their slots, `decode_stack_lora`; else the step runs the layers)."""
        hidden = self.embed(input_ids, positions, ops)
        deepstack: list[torch.Tensor] = []
        if meta.image_embeds is not None:  # images' rows: the encoder's embeddings, as they are (never scaled)
            rows, embeds = meta.image_embeds
            width = hidden.shape[1]
            hidden = hidden.index_copy(0, rows, embeds[:, :width].to(hidden.dtype))
            deepstack = [embeds[:, width * (i + 1) : width * (i + 2)] for i in range(self.deepstack_layers)]
        # (Not with M-RoPE's table, DeepStack's adds or images attended both ways: the layers do those.)
        cross = meta.cross_attention
        plain = meta.mrope_positions is None and not deepstack and not meta.image_blocks and cross is None
        stack = self.decode_stack if plain else None
        if stack is not None and (lora is None or lora.weights is self.decode_stack_lora):
            # Prompt tokens go in as decode rows of their own (`token_rows`), as the layers' attention takes them.
            tables, lens = (meta.block_tables, meta.seq_lens) if meta.max_query_len == 1 else meta.token_rows
            stop = None if interrupt is None else interrupt.tensor
            slots, segments = (None, -1) if lora is None else (lora.slots, lora_segment_bits(lora.changed))
            stacked = stack.forward(  # (its positions are rope's rows: LongRoPE's long tokens in its second table)
                hidden, self.rope_rows(positions, meta), kv_caches, tables, lens, meta.slot_mapping, stop, slots,
                segments,
            )
            if stacked.shape[0] != hidden.shape[0]:
                raise StepInterrupted
            return stacked
        residual: torch.Tensor | None = None
        cos_sin = self.get_buffer("cos_sin_cache")
        local = self.get_buffer("local_cos_sin_cache") if self.local_rope else cos_sin
        rope_rows = self.rope_rows(positions, meta)
        if meta.mrope_positions is not None:  # a table of the step's own rows, each mixed from its three positions
            cos_sin = self._mrope_rows(meta.mrope_positions, cos_sin)
            rope_rows = torch.arange(cos_sin.shape[0], device=cos_sin.device)
        for index, (layer, kv_cache, reads_local) in enumerate(
            zip(self.layers, kv_caches, self.local_rope_layers, strict=True)
        ):
            table = local if reads_local else cos_sin
            if cross is not None and not cross.inside and index in cross.positions:  # (Llama 3.2 Vision's layers)
                hidden, residual = cross.apply(index, hidden, residual)
            hidden, residual = layer(rope_rows, hidden, residual, kv_cache, table, meta, ops, lora)
            if index < len(deepstack):  # DeepStack: the layer's output, summed, plus the images' features there
                assert meta.image_embeds is not None and residual is not None
                residual = (hidden + residual).index_add(0, meta.image_embeds[0], deepstack[index].to(hidden.dtype))
                hidden = torch.zeros_like(hidden)  # (the next norm adds it: the sum, exactly)
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        assert residual is not None, "a model has at least one layer"
        if cross is not None and not cross.inside and len(self.layers) in cross.positions:  # (one after the last)
            hidden, residual = cross.apply(len(self.layers), hidden, residual)
        hidden, _ = self.norm.add_and_norm(hidden, residual, ops)
        return hidden
