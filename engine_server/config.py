"""Frozen configuration for the engine: built once at the entry point and passed down.

Values discovered at run time do not live here: the number of KV blocks is sized when the model is loaded
(`engine_server.model_loading.num_kv_blocks`, held as `LoadedModel.num_blocks`), the eos ids are read from the model and
its tokenizer where the engine is built (`engine_server.llm.engine_eos_ids`, for `LLM` and the gRPC server).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

Architecture = Literal[
    "llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "gemma", "gemma2",
    "gemma3", "smollm3", "granite", "olmo2", "deepseek_v3", "qwen3_next", "gemma4", "llama4", "glm4_moe", "glm4",
    "minimax_m2", "ernie4_5", "ernie4_5_moe", "cohere", "lfm2", "granitemoe", "nemotron_h", "hunyuan", "apertus",
    "afmoe", "bert",
]  # fmt: skip

_HF_ARCHITECTURES: dict[str, Architecture] = {
    "llama": "llama",
    "mistral": "llama",
    "internlm3": "llama",  # InternLM3: Llama (q/k/v/o biases by `qkv_bias`), dynamic NTK rope
    "iquestcoder": "llama",  # IQuest-Coder-V1: Llama
    "helium": "ernie4_5",  # Kyutai's Helium: Llama with rope over interleaved pairs (ERNIE 4.5's), q/k/v biases
    "jais2": "llama",  # Jais 2: Llama with biased LayerNorms and an ungated relu² MLP with biases (`_jais2_fields`)
    "cwm": "llama",  # Meta's Code World Model: Llama with windows on the layers `layer_types` names (3 in 4)
    "ministral": "llama",  # Ministral 8B (2410): Mistral with windowed layers by `layer_types`
    # Ministral 3: Mistral under YaRN with Llama 4's query temperature over its original context
    # (`query_scale_beta`); Mistral 3 (Mistral Small 3.1 / 3.2, Magistral Small, Ministral 3, Mistral Small 4): a
    # multimodal checkpoint whose text model (`mistral`, `ministral3` or `mistral4`) is served, read as that family
    # (`_mistral3_text_type`), its Pixtral vision tower not read.
    "ministral3": "llama",
    "mistral3": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    # PhiMoE (Phi-3.5-MoE, Phi-mini-MoE, Phi-tiny-MoE): Mixtral's layout with biased LayerNorms, q/k/v/o biases, an LM
    # head bias and its sparsemixer's top-2 routing (`_phimoe_fields`).
    "phimoe": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "flex_olmo": "olmoe",  # FlexOlmo: OLMoE's experts and q/k norms under OLMo 2's post-norm block
    "gpt_oss": "gpt_oss",
    "smollm3": "smollm3",
    "granite": "granite",
    # Granite 3.0's mixtures of experts, with a shared MLP (granitemoeshared), and Granite 4.0: Mamba-2 layers and
    # attention ones (no rope in the H models), each with experts beside a shared MLP or the shared MLP alone.
    "granitemoe": "granitemoe",
    "granitemoeshared": "granitemoe",
    "granitemoehybrid": "granitemoe",
    "bamba": "granitemoe",  # Bamba: Granite 4.0's hybrid layout without its multipliers (`_bamba_config`)
    "olmo2": "olmo2",
    "olmo3": "olmo2",
    "exaone4": "olmo2",  # EXAONE 4.0: OLMo 2's post-norm block with per-head q/k norms, NoPE on its global layers
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "youtu": "deepseek_v3",  # Tencent's Youtu-LLM: DeepSeek-V3's latent attention over dense Llama MLPs
    "mistral4": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
    "glm4_moe_lite": "deepseek_v3",  # GLM-4.7-Flash: DeepSeek-V3's latent attention and experts
    "glm4_moe": "glm4_moe",
    # Upstage's Solar Open: GLM-4.5's experts on every layer under Llama's attention (rope over each whole head).
    "solar_open": "glm4_moe",
    # LG's K-EXAONE: GLM-4.5's layout under EXAONE 4's attention (per-head q/k norms, windows on 3 layers in 4, no rope
    # on the global ones), a pre-norm block.
    "exaone_moe": "glm4_moe",
    # Tencent's Hy3: GLM-4.5's layout under Apertus's attention (per-head q/k norms, rope over whole heads).
    "hy_v3": "glm4_moe",
    # Sarvam's 30B (GLM-4.5's model, rope over whole heads, q/k norms on by default) and 105B (DeepSeek-V3's); their
    # released configs' own names read too (`num_experts`, `num_shared_experts`, `use_qkv_bias`, "deepseek_yarn").
    "sarvam_moe": "glm4_moe",
    "sarvam_mla": "deepseek_v3",
    "glm4": "glm4",
    "minimax_m2": "minimax_m2",
    "arcee": "llama",  # Arcee AFM: Llama's block with an ungated relu² MLP (`_ungated_mlp_fields`)
    # Arcee's Trinity (AFMoE): gated attention with q/k norms, rope on its windowed layers alone, sandwich norms,
    # DeepSeek-V3's sigmoid routing in one group beside shared experts (`_afmoe_fields`).
    "afmoe": "afmoe",
    "apertus": "apertus",  # Apertus: Qwen3's per-head q/k norms, an ungated MLP with xIELU learned per layer
    # Hunyuan (0.5B-7B dense; Hunyuan-A13B): Llama's block with per-head q/k norms after rope, rope's base stretched
    # by NTK's alpha; the MoE's experts (Mixtral's routing) beside an ungated shared MLP.
    "hunyuan_v1_dense": "hunyuan",
    "hunyuan_v1_moe": "hunyuan",
    "seed_oss": "llama",  # Seed-OSS: Llama with q/k/v biases and o_proj's apart (`attention_out_bias`)
    "ernie4_5": "ernie4_5",
    "ernie4_5_moe": "ernie4_5_moe",
    "cohere": "cohere",  # Command R / R+: the attention and the MLP in parallel off one LayerNorm
    "cohere2": "cohere",  # Command R7B, Command A: that block, 3:1 windowed layers and global ones without rope
    "lfm2": "lfm2",  # LFM2: gated short convolutions (a state per sequence) between grouped-query attention layers
    "lfm2_moe": "lfm2",  # LFM2-MoE: those layers, experts after its first dense ones (DeepSeek-V3's router, one group)
    # NVIDIA's Nemotron-H, Nemotron Nano 2 and Nemotron 3: one sublayer per block (Mamba-2, attention without rope, an
    # ungated relu² MLP or relu² experts), read as pre-norm layers of a mixer and the MLP after it (`nemotron_blocks`).
    "nemotron_h": "nemotron_h",
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_next",
    "qwen3_5_moe_text": "qwen3_next",
    "qwen3_5": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    "llama4_text": "llama4",
    "llama4": "llama4",
    "bert": "bert",
}
# Families people ask for that this engine does not serve yet, and what it lacks for them: the refusal says so.
_NOT_YET: dict[str, str] = {
    "gemma3": "the multimodal Gemma 3's vision tower is not implemented; its text model (gemma3_text) is served",
}
# Families whose attention has a bias on o_proj too when `attention_bias` is set (as transformers builds them).
_O_PROJ_BIAS_FAMILIES: tuple[Architecture, ...] = (
    "llama", "qwen3", "qwen3_moe", "olmoe", "gpt_oss", "smollm3", "granite", "llama4", "granitemoe", "hunyuan",
    "apertus", "afmoe",
)  # fmt: skip
# Families whose attention RMS-normalises q and k (each head, or OLMoE's and OLMo 2's whole projection) before rope.
_QK_NORM_FAMILIES: tuple[Architecture, ...] = (
    "qwen3", "qwen3_moe", "gemma3", "olmoe", "olmo2", "qwen3_next", "gemma4", "minimax_m2", "lfm2", "hunyuan",
    "apertus", "afmoe",
)  # fmt: skip
# Hugging Face activation names of an encoder's MLP, by whether they are the tanh approximation of GELU.
ENCODER_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope frequency scaling (rope_type "llama3"); other types are refused at load."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE (rope_type "longrope"): inverse frequencies divided per dimension by `short_factor`, or by
    `long_factor` for a sequence longer than `original_max_position_embeddings`, and cos/sin scaled by
    `attention_factor`. Which factors a token gets follows transformers: the long ones when its sequence, as of the
    step that computes it, is longer than `original_max_position_embeddings` (so a prompt prefilled in one step is
    all long or all short, and a sequence that grows past the limit gets the long ones from there on)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class Yarn:
    """YaRN (rope_type "yarn": Qwen's long-context setting, gpt-oss, DeepSeek): each inverse frequency is blended
    between itself (extrapolated, the fast-turning dims) and itself divided by `factor` (interpolated, the slow
    ones) along a linear ramp over the dims between the correction dims of `beta_fast` and `beta_slow` rotations in
    `original_max_position_embeddings` positions (`truncate`: the ramp's ends rounded to whole dims), and cos/sin
    are multiplied by `attention_factor`, as transformers' `_compute_yarn_parameters` computes them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's shape (DeepSeek-V2/V3; `layers.mla`): queries through a rank-`q_lora_rank`
    projection (0: one `q_proj`), keys and values from a `kv_lora_rank` latent; each head's key is
    `qk_nope_head_dim` dims without positions and `qk_rope_head_dim` turned by rope (shared by every head), its
    value `v_head_dim`; `rope_interleave`: the rope dims come in interleaved pairs (DeepSeek-V3's layout)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet's shape (Qwen3-Next, Qwen3.5; `layers.gated_deltanet`): the linear attention of `layers`,
    whose state per sequence is a short convolution's last `conv_kernel - 1` inputs over q, k and v
    (`conv_dim` channels) and one `key_head_dim x value_head_dim` matrix per value head, in place of a KV cache.
    Each of `num_key_heads` key heads serves `num_value_heads / num_key_heads` value heads."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[int, ...]

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: the convolution's inputs, then the matrices."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_value_heads * self.key_head_dim * self.value_head_dim

    def sharded(self, size: int) -> LinearAttention:
        """One rank's share under tensor parallelism over `size` ranks: its block of the key heads and of the value
        heads (each value head with the key head it reads); ValueError unless `size` divides both."""
        if self.num_key_heads % size or self.num_value_heads % size:
            raise ValueError(f"linear attention's {self.num_key_heads} key and {self.num_value_heads} value heads "
                             f"must both be divisible by the tensor-parallel size ({size})")  # fmt: skip
        return replace(self, num_key_heads=self.num_key_heads // size, num_value_heads=self.num_value_heads // size)


@dataclass(frozen=True)
class ShortConvolution:
    """LFM2's gated short convolution (`layers.short_conv`) on `layers`: `in_proj` gives B, C and x, each `channels`
    wide; the layer's output is `out_proj(C * conv(B * x))`, conv a depthwise causal convolution of `conv_kernel`
    taps without a bias or an activation. Its state per sequence is the last `conv_kernel - 1` values of `B * x`."""

    channels: int
    conv_kernel: int
    layers: tuple[int, ...]

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer."""
        return self.channels * (self.conv_kernel - 1)

    def sharded(self, size: int) -> ShortConvolution:
        """One rank's share under tensor parallelism over `size` ranks: a block of the channels; ValueError unless
        `size` divides them."""
        if self.channels % size:
            raise ValueError(f"the short convolution's {self.channels} channels must be divisible by the "
                             f"tensor-parallel size ({size})")  # fmt: skip
        return replace(self, channels=self.channels // size)


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2's shape (Granite 4.0's hybrids; `layers.mamba2`) on `layers`: `in_proj` gives the gate z (`inner`
    wide), x (`num_heads` heads `head_dim` wide), B and C (`groups` groups `state_dim` wide; each group serves
    `num_heads / groups` consecutive heads) and a time step per head; a depthwise causal convolution of
    `conv_kernel` taps (with a bias where `conv_bias`) and SiLU over x, B and C. Its state per sequence is the
    convolution's last `conv_kernel - 1` inputs and one `head_dim x state_dim` matrix per head (`kernels.mamba2`)."""

    num_heads: int
    head_dim: int
    state_dim: int
    groups: int
    conv_kernel: int
    conv_bias: bool
    layers: tuple[int, ...]

    @property
    def inner(self) -> int:
        """Width of x, of z and of the output projection's input."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner + 2 * self.groups * self.state_dim

    @property
    def state_size(self) -> int:
        """Float32 values one sequence's state holds in one layer: the convolution's inputs, then the matrices."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.head_dim * self.state_dim

    def sharded(self, size: int) -> Mamba2:
        """One rank's share under tensor parallelism over `size` ranks: a block of the heads and the groups they read
        (a block of the groups, or where there are fewer groups than ranks the one group its heads share, then held by
        several ranks); ValueError unless `size` divides the heads, and the groups or by them."""
        if self.num_heads % size or (self.groups % size and size % self.groups):
            raise ValueError(f"Mamba-2's {self.num_heads} heads in {self.groups} groups cannot be split over "
                             f"{size} tensor-parallel ranks")  # fmt: skip
        return replace(self, num_heads=self.num_heads // size, groups=max(self.groups // size, 1))


# The shapes of the layers that keep a fixed-size state per running sequence in place of a KV cache.
RecurrentShape = LinearAttention | ShortConvolution | Mamba2


@dataclass(frozen=True)
class Gemma4Layout:
    """What Gemma 4's text model (`layers.gemma4`) changes in Gemma 3's block, beyond plain `w` norms (no offset),
    unscaled attention scores and each head's values RMS-normalised without a weight:

    - its full-attention layers (those without a window) have heads `global_head_dim` wide, `global_kv_heads` KV
      heads, and with `keys_as_values` no v_proj: a head's values are its key projection (before the key's norm
      and rope); their rope is "proportional": the first `global_rope_angles` of the head's `global_head_dim / 2`
      angles turn at `theta^(-2i / global_head_dim)` (`ModelConfig.rope_theta`), the rest not at all;
    - layer i attends over the K/V of layer `kv_sources[i]`: its own, or, for the last layers, those of the last
      earlier layer of its kind (KV sharing: such a layer has no K/V projection and writes no cache);
    - the layers in `wide_mlp_layers` have an MLP twice `intermediate_size` wide;
    - per-layer inputs (`per_layer_input_size` > 0): each token gets a `per_layer_input_size`-wide input per layer,
      looked up in a table of `per_layer_vocab_size` rows and mixed with a projection of its embedding, which each
      layer gates into its output after the MLP; every layer's output is then scaled by its `layer_scalar`;
    - a mixture of experts beside every layer's dense MLP (`experts` > 0): `experts_per_token` of `experts` GELU
      experts `expert_intermediate_size` wide, chosen by a router of its own from the residual stream."""

    global_head_dim: int
    global_kv_heads: int
    keys_as_values: bool
    global_rope_angles: int
    kv_sources: tuple[int, ...]
    wide_mlp_layers: tuple[int, ...] = ()
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a transformer, independent of where its weights come from: a decoder (Llama, Qwen2, Qwen3), or
    an encoder (BERT: `encoder` set), which attends both ways, has no KV cache to keep and only pools.
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2/2.5: bias on the q, k and v projections (`o_proj_bias`: and o_proj's).
    attention_out_bias: bool | None = None  # Seed-OSS: o_proj's bias, set apart from q/k/v's (None: `o_proj_bias`)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope.
    qk_norm_after_rope: bool = False  # Hunyuan: those norms after rope (which mixes the weighted dims' pairs)
    # OLMoE: the q/k norms span the whole projection (all heads at once), and q, k and v are clamped to
    # [-clip_qkv, clip_qkv] after them (0: not clamped).
    qk_norm_whole: bool = False
    clip_qkv: float = 0.0
    rope_scaling: RopeScaling | LongRope | Yarn | None = None
    # Phi-3 / Phi-4-mini: rope rotates only the first `partial_rotary_factor` of each head's dims; the rest pass.
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # Encoders (BERT): post-norm LayerNorms with this eps, learned absolute positions, token types, a GELU MLP.
    encoder: bool = False
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    gelu_tanh: bool = False  # the MLP's GELU is the tanh approximation (hidden_act gelu_new)
    # A cross-encoder (`BertForSequenceClassification`): its classifier's outputs over the CLS token; 0 without one.
    num_labels: int = 0
    # Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss; `layers.moe`): a layer's MLP is `num_experts`
    # experts of `moe_intermediate_size` each, `num_experts_per_tok` of them chosen per token by a softmax router
    # (top-k weights renormalised to sum to 1 with `norm_topk_prob`), plus, with `shared_expert_intermediate_size`, an
    # expert every token goes through, scaled by a sigmoid gate (Qwen2-MoE). `dense_layers` keep a dense MLP of
    # `intermediate_size` (Qwen's `mlp_only_layers` and `decoder_sparse_step`). 0 experts: a dense model. gpt-oss:
    # the router and the experts' projections have biases (`expert_biases`), and with `swiglu_limit` > 0 the experts'
    # activation is its clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], then
    # `gate * sigmoid(swiglu_alpha * gate) * (up + 1)` (`kernels.reference.clamped_swiglu`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    expert_biases: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # gpt-oss: a learned sink logit per query head, one more term of each attention softmax's denominator.
    attention_sinks: bool = False
    # SmolLM3 and Llama 4: the layers whose attention uses no rope at all (NoPE; `no_rope_layers` holds 0 for them).
    nope_layers: tuple[int, ...] = ()
    # Llama 4: on its rope layers each head of q and k is RMS-normalised without a weight (`qk_unit_norm`;
    # transformers' L2 norm after rope, the same since rope keeps a head's norm); on its NoPE layers each query is
    # scaled by `1 + nope_temperature_scale * ln(1 + floor((position + 1) / nope_temperature_floor))` (its
    # attention temperature tuning; 0: none); its rope layers attend within chunks of `attention_chunk` positions
    # (0: none; `AttentionMetadata.chunked`).
    qk_unit_norm: bool = False
    nope_temperature_scale: float = 0.0
    nope_temperature_floor: int = 1
    attention_chunk: int = 0
    # Granite: each block's attention and MLP outputs are scaled by `residual_multiplier` before their residual
    # adds, and the logits divided by `logits_scaling` (its embeddings by `embedding_multiplier` and its scores by
    # `attention_scale`, the fields above, from its `embedding_multiplier` and `attention_multiplier`).
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # OLMo 2: no norm before the attention or the MLP; each one's output normalised before its residual add.
    post_norms: bool = False
    # Cohere: mean-centred LayerNorms (no bias) in place of RMSNorms (`rms_norm_eps` is their epsilon), one per block
    # feeding the attention and the MLP in parallel (`parallel_block`), and the logits times `logit_scale`.
    layer_norm: bool = False
    parallel_block: bool = False
    logit_scale: float = 1.0
    # PhiMoE: its LayerNorms have a bias (`layer_norm_bias`), its LM head too (`lm_head_bias`). Jais 2: biased
    # LayerNorms and biases on its ungated MLP's projections (`mlp_bias`).
    layer_norm_bias: bool = False
    lm_head_bias: bool = False
    mlp_bias: bool = False
    # DeepSeek-V3 (and Kimi K2, Mistral 4): multi-head latent attention (`head_dim` is then the cache's, a latent
    # and its rope key, under one KV head: `layers.mla`), and its router (`grouped_router`,
    # `layers.moe.GroupedTopkRouter`): sigmoid scores (`moe_scoring`; Mistral 4's softmax), a learned bias added to
    # them for the choice only (`router_score_bias`), the top-k taken within the best `moe_topk_groups` of
    # `moe_groups` groups of experts (each group scored by the sum of its two best, or DeepSeek-V2's best:
    # `moe_group_score`), the chosen scores renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`;
    # its shared experts have no gate (`shared_expert_gated` off).
    latent_attention: LatentAttention | None = None
    # Mistral 4 and Ministral 3: their queries scaled by `1 + beta * ln(1 + floor(position / positions))` (Llama 4's
    # attention temperature) on every layer, beta `query_scale_beta` (0: none) and `query_scale_positions` its rope's
    # original context.
    query_scale_beta: float = 0.0
    query_scale_positions: int = 1
    grouped_router: bool = False
    # PhiMoE's sparsemixer ("sparsemixer", `layers.moe.sparsemixer_route`): the top-2 logits, each weighted by the
    # softmax over the logits within `2 * router_jitter` of it (relatively), the first's taken out for the second.
    moe_scoring: Literal["softmax", "sigmoid", "sparsemixer"] = "softmax"
    router_jitter: float = 0.0
    router_score_bias: bool = False
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_group_score: Literal["top2", "max"] = "top2"
    routed_scaling_factor: float = 1.0
    moe_renorm_epsilon: float = 1e-20  # added to the chosen scores' sum that renormalises them (LFM2-MoE: 1e-6)
    shared_expert_gated: bool = True
    # Llama 4's router: the sigmoid of each chosen expert's logit scales that expert's input (not its output).
    moe_input_scaled: bool = False
    # Sliding-window attention (Mistral, Mixtral, Phi-3, Qwen's `use_sliding_window`, Gemma 2/3): layer i's token at
    # position p attends to positions (p - layer_windows[i], p] only; 0 (or no entry): to all of [0, p].
    layer_windows: tuple[int, ...] = ()
    # Gemma 2 and 3: RMSNorm weights stored as w and applied as `norm_offset + w`; embeddings times
    # `embedding_multiplier` (sqrt(hidden_size), rounded to the weights' dtype); a GELU (tanh) gate; "sandwich" norms
    # (the attention's and the MLP's outputs normalised before their residual adds, beside the usual pre-norms);
    # attention scores scaled by `attention_scale` (0: head_dim ** -0.5). Gemma 3: windowed layers' rope with base
    # `local_rope_theta` (0: `rope_theta`) and the others' positions divided by `rope_linear_factor` (linear rope
    # scaling). Gemma 2: attention scores s soft-capped to `c * tanh(s / c)` with c = `attention_softcap`, and the
    # logits likewise with `final_logit_softcap` (0: no cap).
    norm_offset: float = 0.0
    embedding_multiplier: float = 1.0
    # The dense MLP's activation: gated, `down(act(gate(x)) * up(x))` with SiLU or GELU (tanh); or ungated
    # `down(act(up(x)))` (`layers.mlp.UngatedMLP`) with Nemotron-H's and Arcee's relu² ("relu2") or Apertus's xIELU,
    # whose four scalars each layer's checkpoint holds ("xielu").
    hidden_act: Literal["silu", "gelu_tanh", "relu2", "xielu"] = "silu"
    sandwich_norms: bool = False
    attention_scale: float = 0.0
    local_rope_theta: float = 0.0
    rope_linear_factor: float = 1.0
    attention_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Qwen3-Next and Qwen3.5: hybrids whose `linear_attention.layers` run Gated DeltaNet (a state per sequence, no
    # KV cache) and the rest gated attention: q_proj gives each head its query and as many gate values
    # (`attention_output_gate`), and the attention's output is multiplied by their sigmoid before o_proj.
    linear_attention: LinearAttention | None = None
    attention_output_gate: bool = False
    # LFM2: hybrids whose `short_convolution.layers` run a gated short convolution (a state per sequence, no KV cache).
    short_convolution: ShortConvolution | None = None
    # Granite 4.0's and Nemotron-H's hybrids: `mamba2.layers` run Mamba-2 (a state per sequence, no KV cache).
    mamba2: Mamba2 | None = None
    # Nemotron-H: its checkpoint's blocks, one character each as its `hybrid_override_pattern` writes them ("M"
    # Mamba-2, "*" attention, "-" MLP, "E" Nemotron 3's experts), which `nemotron_blocks` pairs into this config's
    # layers; the layers without an MLP (a mixer not followed by one) are `mlp_free_layers`.
    block_pattern: str = ""
    mlp_free_layers: tuple[int, ...] = ()
    # Gemma 4: its layers' departures from Gemma 3's (per-layer head shapes, shared K/V, per-layer inputs).
    gemma4: Gemma4Layout | None = None

    def is_global_layer(self, index: int) -> bool:
        """Whether layer `index` is one of Gemma 4's full-attention layers, which have a head shape of their own."""
        return self.gemma4 is not None and self.attention_window(index) == 0

    def layer_head_dim(self, index: int) -> int:
        """Layer `index`'s head dim: `head_dim`, or a Gemma 4 full-attention layer's own."""
        return self.gemma4.global_head_dim if self.gemma4 is not None and self.is_global_layer(index) else self.head_dim

    def layer_kv_heads(self, index: int) -> int:
        """Layer `index`'s KV heads: `num_key_value_heads`, or a Gemma 4 full-attention layer's own."""
        if self.gemma4 is not None and self.is_global_layer(index):
            return self.gemma4.global_kv_heads
        return self.num_key_value_heads

    def kv_source(self, index: int) -> int:
        """The layer whose K/V layer `index` attends over: itself, unless it shares an earlier one's (Gemma 4)."""
        return self.gemma4.kv_sources[index] if self.gemma4 is not None else index

    def qkv_parts(self, index: int) -> int:
        """How many of q, k and v layer `index`'s fused `qkv_proj` holds, in that order: 1 where it attends over an
        earlier layer's K/V (`kv_source`: the queries alone), 2 on a Gemma 4 full-attention layer whose values are
        its keys' projection (`Gemma4Layout.keys_as_values`), else 3."""
        if self.kv_source(index) != index:
            return 1
        keys_as_values = self.gemma4 is not None and self.gemma4.keys_as_values and self.is_global_layer(index)
        return 2 if keys_as_values else 3

    def layer_intermediate_size(self, index: int) -> int:
        """Layer `index`'s dense MLP width: `intermediate_size`, twice that for Gemma 4's wide layers."""
        wide = self.gemma4 is not None and index in self.gemma4.wide_mlp_layers
        return 2 * self.intermediate_size if wide else self.intermediate_size

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer `index` is linear attention (`linear_attention`: Gated DeltaNet)."""
        return self.linear_attention is not None and index in self.linear_attention.layers

    @property
    def recurrent(self) -> RecurrentShape | None:
        """The shape of the layers that keep a fixed-size state per running sequence and no KV cache: Gated
        DeltaNet's (`linear_attention`), LFM2's short convolution's (`short_convolution`) or Mamba-2's (`mamba2`);
        None for a model without such layers."""
        return self.linear_attention or self.short_convolution or self.mamba2

    def is_recurrent_layer(self, index: int) -> bool:
        """Whether layer `index` keeps a state per sequence (`recurrent`) and no KV cache."""
        recurrent = self.recurrent
        return recurrent is not None and index in recurrent.layers

    @property
    def attention_layers(self) -> int:
        """Layers that keep K/V in the paged cache of their own (all but the recurrent ones and those that attend
        over another layer's: `kv_source`)."""
        recurrent = self.recurrent
        own = sum(self.kv_source(i) == i for i in range(self.num_hidden_layers))
        return own - (len(recurrent.layers) if recurrent is not None else 0)

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: `attention_out_bias` where a config sets it apart (Seed-OSS); else
        `attention_bias` puts one there too for Llama and Qwen3 (as transformers' modeling files do), never for Qwen2
        and Qwen2-MoE, whose configs set it for q/k/v only."""
        if self.attention_out_bias is not None:
            return self.attention_out_bias
        return self.attention_bias and self.architecture in _O_PROJ_BIAS_FAMILIES

    @property
    def mlp_widths(self) -> dict[str, int]:
        """The intermediate width of each kind of MLP the model has, by its config name (what tensor parallelism
        splits): `intermediate_size` where any layer is dense, the experts' and the shared expert's where present."""
        with_mlp = [i for i in range(self.num_hidden_layers) if self.has_mlp(i)]
        moe_layers = sum(self.is_moe_layer(i) for i in with_mlp)
        widths = {"intermediate_size": self.intermediate_size} if moe_layers < len(with_mlp) else {}
        if moe_layers:
            widths["moe_intermediate_size"] = self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                widths["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return widths

    @property
    def rotary_dim(self) -> int:
        """How many of each head's leading dims rope rotates (`head_dim` unless `partial_rotary_factor` < 1; latent
        attention's rope key dims)."""
        if self.latent_attention is not None:
            return self.latent_attention.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_window(self, index: int) -> int:
        """How many positions, its own included, a token of layer `index` attends to (`layer_windows`); 0: all."""
        return self.layer_windows[index] if index < len(self.layer_windows) else 0

    @property
    def uniform_window(self) -> int:
        """The window every layer attends through, when all have the same one (Mistral, Phi-3 with
        `sliding_window`); 0 when any layer attends to all positions (Gemma's global layers, Qwen2's below
        `max_window_layers`) or the windows differ."""
        windows = {self.attention_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else 0

    def uses_rope(self, index: int) -> bool:
        """Whether layer `index`'s attention turns q and k by their positions (all but `nope_layers`)."""
        return index not in self.nope_layers

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index`'s MLP is a mixture of experts (`layers.moe.SparseMoE`) rather than a dense one."""
        return self.num_experts > 0 and index not in self.dense_layers

    def has_mlp(self, index: int) -> bool:
        """Whether layer `index` has an MLP after its token mixer (all but Nemotron-H's `mlp_free_layers`)."""
        return index not in self.mlp_free_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in _HF_ARCHITECTURES:
            why = _NOT_YET.get(model_type, "no family of this engine implements it")
            raise ValueError(
                f"unsupported model_type {model_type!r} ({why}); supported: {', '.join(sorted(_HF_ARCHITECTURES))}"
            )
        if model_type == "bert":
            return cls._encoder_from_hf_config(cfg, name)
        _refuse_unbuilt(model_type, cfg)
        if model_type in ("qwen3_5", "qwen3_5_moe", "gemma4", "llama4", "mistral3"):  # multimodal: its text model
            cfg = _text_config(cfg)
        if model_type == "mistral3":  # read as its text model's own family
            model_type = _mistral3_text_type(cfg)
        if model_type in ("lfm2", "lfm2_moe"):
            cfg = _lfm2_config(cfg)
        if model_type == "bamba":
            cfg = _bamba_config(cfg)
        nemotron = _nemotron_h_fields(cfg) if model_type == "nemotron_h" else {}
        if nemotron:  # its blocks paired into layers: the rest reads the pairs' count (without MLP blocks, its
            # dense width is its experts', as a file of it states: the config's own is unused)
            width = cfg["intermediate_size" if "-" in nemotron["block_pattern"] else "moe_intermediate_size"]
            cfg = {**cfg, "num_hidden_layers": len(nemotron_blocks(nemotron["block_pattern"])),
                   "rms_norm_eps": cfg.get("layer_norm_epsilon") or 1e-5,
                   "head_dim": cfg.get("head_dim") or cfg.get("attention_head_dim"), "intermediate_size": width}
        arch = _HF_ARCHITECTURES[model_type]
        gemma = _gemma_fields(model_type, cfg) if arch in ("gemma", "gemma2", "gemma3") else {}
        if arch == "gemma4":
            gemma = _gemma4_fields(cfg)
        rope = {} if gemma else cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        local_rope: dict[str, Any] = {}
        if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5's rope per layer type (OLMo 3)
            rope, local_rope = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
            if (local_rope.get("rope_type") or "default") != "default":
                raise ValueError(f"sliding_attention rope type {local_rope['rope_type']!r} is not supported")
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type == "deepseek_yarn":  # Sarvam's released name for YaRN
            rope_type = "yarn"
        if arch == "hunyuan" and rope_type == "dynamic" and rope.get("alpha"):
            rope_theta, rope_type = _ntk_alpha_theta(cfg, rope_theta, float(rope["alpha"])), "default"
        elif rope_type == "dynamic":  # dynamic NTK (InternLM3's): as transformers computes it, rope's base grows with
            rope_type = "default"  # a sequence past max_position_embeddings alone, which the engine does not serve
        scaling: RopeScaling | LongRope | Yarn | None = None
        hybrid = _hybrid_fields(arch, cfg)
        # Qwen3-Next's rope turns a quarter of each head by default, GLM-4's and GLM-4.5's half (Solar Open's,
        # K-EXAONE's and Hy3's, in GLM-4.5's layout, all of it)
        halved = arch in ("glm4", "glm4_moe") and model_type not in _WHOLE_ROPE_GLM4_MOE
        default_partial = 0.25 if hybrid else 0.5 if halved else 1.0
        partial = float(
            cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or _rotary_fraction(cfg)
            or default_partial
        )  # fmt: skip
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        rope_fields: dict[str, Any] = {}
        if rope_type in ("longrope", "su"):  # "su": the name early Phi-3 configs gave it
            scaling = _long_rope(cfg, rope)
        elif rope_type == "yarn":
            scaling = _yarn(cfg, rope)
            # vLLM's context length under YaRN: the original one times the factor (Qwen's configs keep the short one).
            max_positions = max(max_positions, int(scaling.original_max_position_embeddings * scaling.factor))
        elif rope_type == "linear" and not gemma:
            rope_fields = {"rope_linear_factor": float(rope["factor"])}
        elif rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise ValueError(
                f"unsupported rope type {rope_type!r} (default, dynamic, linear, llama3, longrope and yarn are)"
            )
        local_theta = float(local_rope.get("rope_theta") or rope_theta)
        if local_rope and (local_theta != rope_theta or scaling is not None or rope_fields):
            # The windowed layers' own rope: a base of its own and no scaling (`DecoderModel`'s local table).
            rope_fields = {**rope_fields, "local_rope_theta": local_theta}
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if arch == "deepseek_v3":  # latent attention: the cache holds one row per token, its latent and rope key
            latent = _latent_attention_fields(cfg, rope, model_type)
            rope_fields = {**rope_fields, **latent}
            mla: LatentAttention = latent["latent_attention"]
            head_dim, kv_heads = mla.kv_lora_rank + mla.qk_rope_head_dim, 1
        else:
            rope_fields = {**rope_fields, **_query_scale_fields(model_type, rope)}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        if gemma:
            rope_theta = gemma.pop("rope_theta")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=_dense_width(arch, cfg),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps") or cfg.get("layer_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(arch, cfg),
            attention_out_bias=bool(cfg.get("attention_out_bias")) if model_type == "seed_oss"
            else bool(cfg.get("attention_bias")) if model_type in ("phimoe", "hy_v3") else None,
            qk_norm=arch in _QK_NORM_FAMILIES
            or (arch == "glm4_moe" and (model_type in ("exaone_moe", "hy_v3")
                                        or bool(cfg.get("use_qk_norm", model_type == "sarvam_moe")))),
            attention_sinks=arch == "gpt_oss",
            qk_norm_whole=arch in ("olmoe", "olmo2", "minimax_m2") and model_type != "exaone4",
            qk_norm_after_rope=arch == "hunyuan",
            post_norms=arch == "olmo2" or model_type == "flex_olmo",
            clip_qkv=float(cfg.get("clip_qkv") or 0.0) if arch == "olmoe" else 0.0,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            layer_windows=_layer_windows(model_type, cfg),
            nope_layers=_nope_layers(model_type, cfg),
            **_llama4_fields(arch, cfg),
            **_granite_fields(arch, cfg),
            **_cohere_fields(arch, cfg),
            **_phimoe_fields(model_type, cfg),
            **_jais2_fields(model_type, cfg),
            **_afmoe_fields(arch, cfg),
            **_ungated_mlp_fields(model_type, cfg),
            **_experts_from_hf_config(arch, cfg),
            **rope_fields,
            **gemma,
            **hybrid,
            **_glm4_fields(arch),
            **_lfm2_fields(arch, cfg),
            **_mamba2_fields(model_type, cfg),
            **nemotron,
        )

    @classmethod
    def _encoder_from_hf_config(cls, cfg: dict[str, Any], name: str) -> ModelConfig:
        """A BERT `config.json`: absolute positions (no rope), LayerNorm, a GELU MLP."""
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT position_embedding_type {cfg['position_embedding_type']!r} is not supported")
        activation = cfg.get("hidden_act", "gelu")
        if activation not in ENCODER_ACTIVATIONS:
            supported = sorted(ENCODER_ACTIVATIONS)
            raise ValueError(f"BERT hidden_act {activation!r} is not supported; supported: {supported}")
        heads = int(cfg["num_attention_heads"])
        classifies = any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ())
        num_labels = (len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))) if classifies else 0
        return cls(
            architecture="bert",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=int(cfg["hidden_size"]) // heads,
            rms_norm_eps=0.0,
            rope_theta=0.0,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            tie_word_embeddings=False,
            attention_bias=True,
            name=name,
            encoder=True,
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            gelu_tanh=ENCODER_ACTIVATIONS[activation],
            num_labels=num_labels,
        )


def _long_rope(cfg: dict[str, Any], rope: dict[str, Any]) -> LongRope:
    """A LongRoPE `rope_scaling` (`rope_parameters`), with transformers' default attention factor:
    `sqrt(1 + ln(s) / ln(original))` for `s = max_position_embeddings / original` (1 when `s` <= 1), or PhiMoE's
    `short_mscale` (ValueError where its `long_mscale` differs)."""
    original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
    factor = rope.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
    attention = rope.get("attention_factor")
    if "short_mscale" in rope:  # PhiMoE's own factors for each regime, one and the same in its releases
        if rope["short_mscale"] != rope.get("long_mscale"):
            raise ValueError(f"longrope short_mscale {rope['short_mscale']} and long_mscale {rope.get('long_mscale')} "
                             "differ (not supported)")  # fmt: skip
        attention = rope["short_mscale"]
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(
        short_factor=tuple(float(x) for x in rope["short_factor"]),
        long_factor=tuple(float(x) for x in rope["long_factor"]),
        original_max_position_embeddings=original,
        attention_factor=float(attention),
    )


def _yarn(cfg: dict[str, Any], rope: dict[str, Any]) -> Yarn:
    """A YaRN `rope_scaling` (`rope_parameters`) with transformers' defaults: `factor` from the context lengths when
    unset, betas 32 and 1, `truncate` on, and the attention factor `0.1 * ln(factor) + 1` (with DeepSeek's `mscale`
    and `mscale_all_dim`, the ratio of two such) unless given."""
    original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
    factor = float(rope.get("factor") or int(cfg.get("max_position_embeddings", original)) / original)

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        ratio, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(float(ratio)) / mscale(float(all_dims)) if ratio and all_dims else mscale()
    return Yarn(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        attention_factor=float(attention),
        truncate=bool(rope.get("truncate", True)),
    )


def _rotary_fraction(cfg: dict[str, Any]) -> float:
    """The share of each head rope turns from a legacy `rotary_dim` (MiniMax-M2's released configs), else 0."""
    if not cfg.get("rotary_dim"):
        return 0.0
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return int(cfg["rotary_dim"]) / head_dim


def _glm4_fields(arch: Architecture) -> dict[str, Any]:
    """GLM-4's `ModelConfig` fields ({} for the other families): Gemma's four norms around the attention and the MLP,
    under its own names (`models.glm4`), with plain weights."""
    return {"sandwich_norms": True} if arch == "glm4" else {}


def _ernie4_5_moe_fields(cfg: dict[str, Any], experts: int, top_k: int) -> dict[str, Any]:
    """ERNIE 4.5's experts as `ModelConfig` fields: softmax scores, the choice by score plus its load-balancing bias
    (`moe_statics`), the chosen scores renormalised (transformers' `Ernie4_5_MoeTopKRouter`; its `moe_norm_min`
    floor of 1e-12 under the sum never binds: a softmax's top-k sum to more); ungated shared experts; experts on every
    `moe_layer_interval`-th layer from `moe_layer_start_index` to `moe_layer_end_index` (-1: the last)."""
    layers = int(cfg["num_hidden_layers"])
    start, interval = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_interval") or 1)
    end = int(cfg.get("moe_layer_end_index", -1))
    end = layers - 1 if end == -1 else end
    width = int(cfg["moe_intermediate_size"])
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        shared_expert_intermediate_size=width * int(cfg.get("moe_num_shared_experts") or 0),
        shared_expert_gated=False,
        dense_layers=tuple(i for i in range(layers) if not ((i + 1) % interval == 0 and start <= i <= end)),
        grouped_router=True,
        moe_scoring="softmax",
        router_score_bias=True,
    )


def _dense_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """A DeepSeek-V3-style model's layers with a dense MLP: those `mlp_layer_types` calls "dense" (GLM-4.7-Flash's
    transformers config), else the first `first_k_dense_replace` (its checkpoints' and DeepSeek's), else (GLM-4.7-Flash
    and Sarvam with neither) the first one, as transformers defaults them."""
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        return tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    default = 1 if cfg.get("model_type") in ("glm4_moe_lite", "sarvam_moe", "sarvam_mla") else 0
    return tuple(range(int(cfg.get("first_k_dense_replace", default) or 0)))


def _latent_attention_fields(cfg: dict[str, Any], rope: dict[str, Any], model_type: str) -> dict[str, Any]:
    """DeepSeek-V3's latent attention (`LatentAttention`) and its score scale: the key's head dim ** -0.5, times
    the square of YaRN's `mscale_all_dim` attention factor when its rope is scaled (transformers' `scaling`);
    Mistral 4's query scale (`_query_scale_fields`)."""
    mla = LatentAttention(
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    all_dims = float(rope.get("mscale_all_dim") or 0.0)
    if (rope.get("rope_type") or rope.get("type") or "default") != "default" and all_dims and float(rope["factor"]) > 1:
        mscale = 0.1 * all_dims * math.log(float(rope["factor"])) + 1.0
        scale *= mscale * mscale
    fields: dict[str, Any] = {"latent_attention": mla, "attention_scale": scale}
    return {**fields, **_query_scale_fields(model_type, rope)}


def _query_scale_fields(model_type: str, rope: dict[str, Any]) -> dict[str, Any]:
    """Mistral 4's and Ministral 3's query scale by position (`ModelConfig.query_scale_beta`), from their rope's
    `llama_4_scaling_beta` over its `original_max_position_embeddings`; {} for other families or no beta."""
    beta = float(rope.get("llama_4_scaling_beta") or 0.0) if model_type in ("mistral4", "ministral3") else 0.0
    if not beta:
        return {}
    return {"query_scale_beta": beta, "query_scale_positions": int(rope["original_max_position_embeddings"])}


def _mistral3_text_type(text: dict[str, Any]) -> str:
    """The family of a multimodal Mistral 3 checkpoint's text model: its `text_config`'s `model_type` (Mistral Small
    3.1's `mistral`, Ministral 3's `ministral3`, Mistral Small 4's `mistral4`); ValueError for another."""
    model_type = str(text.get("model_type") or "mistral")
    if model_type not in ("mistral", "ministral", "ministral3", "mistral4"):
        raise ValueError(f"mistral3 text_config model_type {model_type!r} is not supported "
                         "(mistral, ministral, ministral3 and mistral4 are)")
    return model_type


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal `config.json`'s text model (`text_config`), with the top level's
    word-embedding tie."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{cfg.get('model_type')} config.json has no text_config")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "tie_word_embeddings": tie}


def _hybrid_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5's `ModelConfig` fields ({} for the other families): the linear-attention layers
    (`layer_types`, or every layer but each `full_attention_interval`-th, 4), their shape, zero-centred norms
    (`norm_offset` 1) and the attention's output gate."""
    if arch != "qwen3_next":
        return {}
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must name linear_attention or full_attention for each of the {layers} "
                         f"layers; got {types!r}")  # fmt: skip
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg.get('model_type')}: hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    linear = LinearAttention(
        num_key_heads=int(cfg.get("linear_num_key_heads") or 16),
        num_value_heads=int(cfg.get("linear_num_value_heads") or 32),
        key_head_dim=int(cfg.get("linear_key_head_dim") or 128),
        value_head_dim=int(cfg.get("linear_value_head_dim") or 128),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
        layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
    )
    if linear.num_value_heads % linear.num_key_heads or linear.conv_kernel < 2:
        raise ValueError(f"linear attention of {linear.num_value_heads} value heads over {linear.num_key_heads} key "
                         f"heads with a {linear.conv_kernel}-tap convolution is not supported")  # fmt: skip
    if len(linear.layers) == layers:
        raise ValueError("a model of linear-attention layers only (no full_attention layer) is not supported")
    return {"linear_attention": linear, "attention_output_gate": True, "norm_offset": 1.0}


# The families of Mamba-2 layers between attention layers (`_mamba2_fields`): Granite 4.0's hybrids and Bamba, read as
# one (`_bamba_config`).
_MAMBA2_HYBRIDS = ("granitemoehybrid", "bamba")


def _bamba_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Bamba `config.json` under the keys of the Granite 4.0 hybrid it is laid out as (`granitemoehybrid`'s, which
    came from it; its checkpoint names are read by `models.granitemoe`): Mamba-2 layers but those
    `attn_layer_indices` names, each layer's dense SwiGLU MLP (`intermediate_size`) as Granite's shared MLP without
    experts, rope over half of each head (transformers' Bamba fixes `partial_rotary_factor` at 0.5), and none of
    Granite's multipliers (its attention scaled by `head_dim ** -0.5`)."""
    layers, hidden, heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    attention = {int(i) for i in cfg.get("attn_layer_indices") or ()}
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return {
        **cfg,
        "layer_types": ["attention" if i in attention else "mamba" for i in range(layers)],
        "position_embedding_type": "rope",
        "partial_rotary_factor": 0.5,
        "shared_intermediate_size": int(cfg["intermediate_size"]),
        "num_local_experts": 0,
        "embedding_multiplier": 1.0,
        "attention_multiplier": head_dim**-0.5,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
    }


def _mamba2_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0's Mamba-2 layers (`Mamba2`; {} for the other families and for a Granite 4.0 of attention layers
    only): those `layer_types` (`layers_block_type`) calls "mamba" (transformers 5: "linear_attention"), their heads
    `mamba_d_head` wide ("auto": `mamba_expand * hidden_size` over the heads). ValueError for what the layer does not
    build: biases on its projections, a time step clamped to a range, an activation other than SiLU."""
    if model_type not in _MAMBA2_HYBRIDS:
        return {}
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    if len(types) != layers or set(types) - {"mamba", "linear_attention", "attention", "full_attention"}:
        raise ValueError(f"layer_types must name mamba or attention for each of the {layers} layers; got {types!r}")
    mamba = tuple(i for i, kind in enumerate(types) if kind in ("mamba", "linear_attention"))
    if not mamba:
        return {}
    if len(mamba) == layers:
        raise ValueError("a model of Mamba-2 layers only (no attention layer) is not supported")
    if cfg.get("mamba_proj_bias"):
        raise ValueError(f"{model_type} with mamba_proj_bias is not supported")
    limit = [_json_float(bound) for bound in cfg.get("time_step_limit") or (0.0, math.inf)]
    if limit != [0.0, math.inf]:
        raise ValueError(f"{model_type} with time_step_limit {limit} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    heads, hidden = int(cfg.get("mamba_n_heads") or 128), int(cfg["hidden_size"])
    head_dim = cfg.get("mamba_d_head") or "auto"
    inner = int(cfg.get("mamba_expand") or 2) * hidden
    shape = Mamba2(
        num_heads=heads,
        head_dim=inner // heads if head_dim == "auto" else int(head_dim),
        state_dim=int(cfg.get("mamba_d_state") or 256),
        groups=int(cfg.get("mamba_n_groups") or 1),
        conv_kernel=int(cfg.get("mamba_d_conv") or 4),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        layers=mamba,
    )
    if shape.num_heads % shape.groups or shape.conv_kernel < 2:
        raise ValueError(f"Mamba-2 of {shape.num_heads} heads in {shape.groups} groups with a {shape.conv_kernel}-tap "
                         "convolution is not supported")  # fmt: skip
    return {"mamba2": shape}


# Nemotron-H's block kinds in its `hybrid_override_pattern`, and what `layers_block_type` lists call them (transformers
# 5's names, and the older ones).
_NEMOTRON_BLOCKS = {
    "M": "M", "mamba": "M", "linear_attention": "M", "*": "*", "attention": "*", "full_attention": "*", "-": "-",
    "mlp": "-", "E": "E", "moe": "E",
}  # fmt: skip


def nemotron_blocks(pattern: str) -> tuple[tuple[int, int | None], ...]:
    """Nemotron-H's checkpoint blocks (`pattern`, one character each: "M" Mamba-2, "*" attention, "-" MLP, "E"
    experts) as this engine's layers: `(mixer block, MLP block)` per layer, a mixer and the MLP or experts block right
    after it, or None where the next block is another mixer (or there is none). `h += mixer(norm(h)); h +=
    mlp(norm(h))` is the block pair's sum as the checkpoint runs it, so each layer is a pre-norm block as any other
    family's. ValueError for an MLP block that follows no mixer (no release has one) or a character of another
    kind."""
    layers: list[tuple[int, int | None]] = []
    for block, kind in enumerate(pattern):
        if kind in "M*":
            layers.append((block, None))
        elif kind in "-E" and layers and layers[-1][1] is None and block == layers[-1][0] + 1:
            layers[-1] = (layers[-1][0], block)
        elif kind in "-E":
            raise ValueError(f"nemotron_h block {block} is an MLP that follows no Mamba-2 or attention block "
                             f"(pattern {pattern!r}): not supported")  # fmt: skip
        else:
            raise ValueError(f"nemotron_h block {block} of kind {kind!r} (pattern {pattern!r}) is not supported: "
                             "M (Mamba-2), * (attention), - (MLP) and E (experts) are")  # fmt: skip
    return tuple(layers)


def _nemotron_h_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's `ModelConfig` fields from its config.json: its blocks (`hybrid_override_pattern`, or
    `layers_block_type` / `layer_types` as transformers 5 writes them), the layers they pair into (`nemotron_blocks`)
    and those of them that run Mamba-2 (`mamba_num_heads` heads `mamba_head_dim` wide, `n_groups` groups of
    `ssm_state_size`, `conv_kernel` taps with a bias where `use_conv_bias`) or have no MLP; the MLP's relu²; where
    blocks are experts ("E", Nemotron 3's), those layers' mixture of experts (`_nemotron_h_experts`). ValueError for
    what this engine does not build: biases on the projections, a window, a clamped time step, another activation,
    latent expert projections, no attention or no Mamba-2 block. (transformers' own Nemotron-H clamps the time
    step at `time_step_min` in its chunked form alone; its one-token form, vLLM and llama.cpp clamp none.)"""
    listed = cfg.get("layers_block_type") or cfg.get("layer_types")
    source = cfg.get("hybrid_override_pattern") or listed or ""
    unknown = [kind for kind in source if kind not in _NEMOTRON_BLOCKS]
    if not source or unknown:
        raise ValueError(f"nemotron_h blocks {source!r} are not a hybrid_override_pattern of M, *, - and E")
    pattern = "".join(_NEMOTRON_BLOCKS[kind] for kind in source)
    if "M" not in pattern or "*" not in pattern:
        raise ValueError(f"nemotron_h blocks {pattern!r}: a hybrid of Mamba-2 and attention blocks is supported")
    for key in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias", "sliding_window"):
        if cfg.get(key):
            raise ValueError(f"nemotron_h with {key} is not supported")
    limit = [_json_float(bound) for bound in cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0, math.inf)]
    if limit != [0.0, math.inf]:
        raise ValueError(f"nemotron_h with time_step_limit {limit} is not supported")
    activations = (cfg.get("mlp_hidden_act") or "relu2", cfg.get("mamba_hidden_act") or "silu")
    if activations != ("relu2", "silu"):
        raise ValueError(f"nemotron_h with mlp_hidden_act {activations[0]!r} and mamba_hidden_act {activations[1]!r} "
                         "is not supported (relu2 and silu are)")  # fmt: skip
    layers = nemotron_blocks(pattern)
    shape = Mamba2(
        num_heads=int(cfg.get("mamba_num_heads") or 128),
        head_dim=int(cfg.get("mamba_head_dim") or 64),
        state_dim=int(cfg.get("ssm_state_size") or 128),
        groups=int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 8),
        conv_kernel=int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4),
        conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
        layers=tuple(i for i, (mixer, _) in enumerate(layers) if pattern[mixer] == "M"),
    )
    if shape.num_heads % shape.groups or shape.conv_kernel < 2:
        raise ValueError(f"Mamba-2 of {shape.num_heads} heads in {shape.groups} groups with a {shape.conv_kernel}-tap "
                         "convolution is not supported")  # fmt: skip
    return {
        "block_pattern": pattern,
        "mamba2": shape,
        "mlp_free_layers": tuple(i for i, (_, mlp) in enumerate(layers) if mlp is None),
        "hidden_act": "relu2",
        **(_nemotron_h_experts(cfg, pattern, layers) if "E" in pattern else {}),
    }


def _nemotron_h_experts(
    cfg: dict[str, Any], pattern: str, layers: tuple[tuple[int, int | None], ...]
) -> dict[str, Any]:
    """Nemotron 3's mixture of experts on the layers whose MLP block is "E": `n_routed_experts` ungated relu² experts
    `moe_intermediate_size` wide, `num_experts_per_tok` of them chosen by DeepSeek-V3's router (sigmoid scores, the
    routing bias for the choice, `topk_group` of `n_group` groups, renormalised with `norm_topk_prob`, times
    `routed_scaling_factor`), beside a relu² shared expert `moe_shared_expert_intermediate_size` wide (which
    transformers always builds); the layers whose MLP block is "-" dense. ValueError for latent expert projections
    (`moe_latent_size`, Nemotron 3 Super's) or routing that does not add up."""
    if cfg.get("moe_latent_size") is not None:
        raise ValueError("nemotron_h with moe_latent_size (latent expert projections) is not supported")
    experts, top_k = int(cfg.get("n_routed_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    groups, top_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if not 1 <= top_k <= experts or experts % groups or not 1 <= top_groups <= groups:
        raise ValueError(f"nemotron_h: {top_k} of {experts} experts in {groups} groups, {top_groups} of them chosen, "
                         "is not a routing")  # fmt: skip
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "shared_expert_intermediate_size": int(cfg["moe_shared_expert_intermediate_size"]),
        "shared_expert_gated": False,
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "dense_layers": tuple(i for i, (_, mlp) in enumerate(layers) if mlp is not None and pattern[mlp] == "-"),
        "grouped_router": True,
        "moe_scoring": "sigmoid",
        "router_score_bias": True,
        "moe_groups": groups,
        "moe_topk_groups": top_groups,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
    }


def _json_float(value: Any) -> float:
    """A float of a config.json: a number, or transformers 5's tag for one JSON cannot spell (`{"__float__":
    "Infinity"}`, also "-Infinity" and "NaN")."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _lfm2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """An LFM2 `config.json` under the keys the rest of `from_hf_config` reads, as transformers' `Lfm2Config` and
    `Lfm2MLP` read it: the MLP's width from `block_ff_dim` (else `intermediate_size`), which with
    `block_auto_adjust_ff_dim` becomes two thirds of it, times `block_ffn_dim_multiplier` and rounded up to a multiple
    of `block_multiple_of` where a multiplier is set; `norm_eps` as every norm's epsilon; embeddings tied unless
    `tie_embedding` (or `tie_word_embeddings`) says not. ValueError for biases on the convolution layers' projections
    (`conv_bias`), which no release sets."""
    if cfg.get("conv_bias"):
        raise ValueError("lfm2 with conv_bias is not supported")
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("model_type") == "lfm2" and cfg.get("block_auto_adjust_ff_dim", True):  # (LFM2-MoE's is as stated)
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            width = int(float(multiplier) * width)
            multiple = int(cfg.get("block_multiple_of") or 256)
            width = multiple * ((width + multiple - 1) // multiple)
    tie = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))
    return {**cfg, "intermediate_size": width, "rms_norm_eps": float(cfg.get("norm_eps") or 1e-5),
            "tie_word_embeddings": bool(tie)}  # fmt: skip


def _lfm2_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's short-convolution layers (`ShortConvolution`; {} for the other families): those `layer_types` calls
    "conv", else those not in `full_attn_idxs` (no list: every layer attends)."""
    if arch != "lfm2":
        return {}
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        attending = cfg.get("full_attn_idxs")
        attending = range(layers) if attending is None else attending
        types = ["full_attention" if i in attending else "conv" for i in range(layers)]
    if len(types) != layers or set(types) - {"conv", "full_attention"}:
        raise ValueError(f"layer_types must name conv or full_attention for each of the {layers} layers; "
                         f"got {types!r}")  # fmt: skip
    conv = ShortConvolution(
        channels=int(cfg["hidden_size"]),
        conv_kernel=int(cfg.get("conv_L_cache") or 3),
        layers=tuple(i for i, kind in enumerate(types) if kind == "conv"),
    )
    if conv.conv_kernel < 2:
        raise ValueError(f"lfm2 conv_L_cache {conv.conv_kernel}: a convolution of at least 2 taps is supported")
    if len(conv.layers) == layers:
        raise ValueError("a model of convolution layers only (no full_attention layer) is not supported")
    return {"short_convolution": conv} if conv.layers else {}


# Config keys that, set, ask for what no release of these families sets and the shared layers do not build: biases on
# the MLP's projections (ERNIE 4.5's `use_bias`: on every projection; InternLM3's released configs call it `bias`,
# transformers `mlp_bias`), IQuest-Coder's clamped q/k/v (which transformers refuses too).
_UNBUILT_KEYS = {"seed_oss": ("mlp_bias",), "arcee": ("mlp_bias",), "apertus": ("mlp_bias",), "bamba": ("mlp_bias",),
                 "helium": ("mlp_bias",), "internlm3": ("mlp_bias", "bias"), "iquestcoder": ("clip_qkv",),
                 "ernie4_5": ("use_bias",), "ernie4_5_moe": ("use_bias",)}  # fmt: skip


def _refuse_unbuilt(model_type: str, cfg: dict[str, Any]) -> None:
    """ValueError for a config of `_UNBUILT_KEYS`' families (Seed-OSS, Arcee, Apertus, Bamba, Helium, InternLM3,
    IQuest-Coder, ERNIE 4.5) that sets one of its keys."""
    for key in _UNBUILT_KEYS.get(model_type, ()):
        if cfg.get(key):
            raise ValueError(f"{model_type} with {key} is not supported")


def _ntk_alpha_theta(cfg: dict[str, Any], theta: float, alpha: float) -> float:
    """Hunyuan's rope base under its NTK scaling with a fixed `alpha` (its configs' `dynamic` rope with an `alpha`,
    which transformers turns as `ntk_alpha`): `theta * alpha ** (d / (d - 2))` over the head dim `d`; the
    frequencies then do not depend on the sequence's length."""
    dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return theta * alpha ** (dim / (dim - 2))


def _uniform(cfg: dict[str, Any], key: str, default: int) -> int:
    """A Hunyuan MoE config value given once or per layer (`moe_topk`, `num_experts`, `num_shared_expert`); ValueError
    for a list whose layers differ, which this engine does not build."""
    value = cfg.get(key, default)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"{cfg.get('model_type')}: {key} {value!r} differs between layers (not supported)")
        value = value[0]
    return int(value)


# The families whose MLP is ungated, `down(act(up(x)))`: their activations, the default first.
_UNGATED_ACTIVATIONS = {"arcee": ("relu2",), "apertus": ("xielu", "relu2"), "jais2": ("relu2",)}


def _ungated_mlp_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The activation of Arcee AFM's and Jais 2's MLP (relu²) and of Apertus's (xIELU, or relu² as transformers builds
    it too), ungated; {} for the other families. ValueError for another activation."""
    supported = _UNGATED_ACTIVATIONS.get(model_type)
    if supported is None:
        return {}
    activation = cfg.get("hidden_act") or supported[0]
    if activation not in supported:
        raise ValueError(f"{model_type} hidden_act {activation!r} is not supported ({' or '.join(supported)})")
    return {"hidden_act": activation}


def _cohere_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """Cohere's `ModelConfig` fields ({} for the other families): its LayerNorms, parallel block and `logit_scale`.
    ValueError for Command R+'s per-head q/k LayerNorms (`use_qk_norm`), which this engine does not build yet."""
    if arch != "cohere":
        return {}
    if cfg.get("use_qk_norm"):
        raise ValueError("cohere with use_qk_norm (per-head q/k LayerNorms) is not supported")
    return {"layer_norm": True, "parallel_block": True, "logit_scale": float(cfg.get("logit_scale", 1.0))}


def _phimoe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """PhiMoE's `ModelConfig` fields ({} for the other families): LayerNorms with biases (`rms_norm_eps` their
    epsilon), the LM head's bias (`lm_head_bias`), and its sparsemixer's routing with `router_jitter_noise` as its
    epsilon. ValueError for other than two experts a token (sparsemixer takes two)."""
    if model_type != "phimoe":
        return {}
    if int(cfg.get("num_experts_per_tok", 2)) != 2:
        raise ValueError(f"phimoe num_experts_per_tok {cfg['num_experts_per_tok']} is not supported (sparsemixer: 2)")
    return {
        "layer_norm": True,
        "layer_norm_bias": True,
        "lm_head_bias": bool(cfg.get("lm_head_bias", False)),
        "moe_scoring": "sparsemixer",
        "router_jitter": float(cfg.get("router_jitter_noise", 0.01)),
    }


def _afmoe_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """AFMoE's (Arcee Trinity's) `ModelConfig` fields ({} for the other families): norms before and after the
    attention and the MLP (plain weights), each head's attention output gated by the sigmoid of its `gate_proj` rows
    (read into q_proj's, `models.afmoe`), and with `mup_enabled` its embeddings times `sqrt(hidden_size)`."""
    if arch != "afmoe":
        return {}
    fields: dict[str, Any] = {"sandwich_norms": True, "attention_output_gate": True}
    if cfg.get("mup_enabled"):
        fields["embedding_multiplier"] = float(cfg["hidden_size"]) ** 0.5
    return fields


def _afmoe_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """AFMoE's experts (after its first `num_dense_layers` dense layers): DeepSeek-V3's sigmoid scores with a
    load-balancing bias (`expert_bias`) for the choice, in one group, the chosen scores renormalised and times
    `route_scale`, beside `num_shared_experts` ungated shared experts, each `moe_intermediate_size` wide."""
    experts, top_k = int(cfg.get("num_experts") or 64), int(cfg.get("num_experts_per_tok") or 6)
    if not 1 <= top_k <= experts:
        raise ValueError(f"afmoe: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]")
    width = int(cfg["moe_intermediate_size"])
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        shared_expert_intermediate_size=width * int(cfg.get("num_shared_experts") or 0),
        shared_expert_gated=False,
        dense_layers=tuple(range(int(cfg.get("num_dense_layers") or 0))),
        grouped_router=True,
        moe_scoring="sigmoid",
        router_score_bias=True,
        routed_scaling_factor=float(cfg.get("route_scale") or 1.0),
    )


def _jais2_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Jais 2's `ModelConfig` fields ({} for the other families): LayerNorms with biases (`layer_norm_eps` their
    epsilon) and its ungated MLP's biases (`mlp_bias`, on in its config's default and releases)."""
    if model_type != "jais2":
        return {}
    return {"layer_norm": True, "layer_norm_bias": True, "mlp_bias": bool(cfg.get("mlp_bias", True))}


def _granite_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers as `ModelConfig` fields (Granite's and Granite MoE's; {} for the other families);
    ValueError for a Granite whose MLP has biases (`mlp_bias`), which no Granite release sets and this engine does
    not build."""
    if arch not in ("granite", "granitemoe"):
        return {}
    if cfg.get("mlp_bias"):
        raise ValueError("granite with mlp_bias is not supported")
    return {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }


def _nope_layers(model_type: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's and Llama 4's layers without rope: where `no_rope_layers` is 0, or (without that list) every
    `no_rope_layer_interval`-th layer (4), as transformers builds them; EXAONE 4's global (unwindowed) layers when
    it has windows at all; Cohere 2's unwindowed layers (all of them without a window, as transformers turns rope
    on windowed layers alone); every layer of a Granite 4.0 whose `position_embedding_type` is not "rope" (its H
    models' "nope", or none); () for the other families."""
    if model_type == "nemotron_h":  # its attention turns no rope
        return tuple(range(int(cfg["num_hidden_layers"])))
    if model_type in _MAMBA2_HYBRIDS:
        rope = cfg.get("position_embedding_type") == "rope"
        return () if rope else tuple(range(int(cfg["num_hidden_layers"])))
    if model_type in ("exaone4", "exaone_moe"):
        windows = _layer_windows(model_type, cfg)
        return tuple(i for i, window in enumerate(windows) if not window)
    if model_type == "afmoe":  # rope on its windowed layers alone
        return tuple(i for i, kind in enumerate(_afmoe_layer_types(cfg)) if kind == "full_attention")
    if model_type == "cohere2":  # rope on its windowed layers only: with no window, on none
        windows = _layer_windows(model_type, cfg) or (0,) * int(cfg["num_hidden_layers"])
        return tuple(i for i, window in enumerate(windows) if not window)
    if model_type not in ("smollm3", "llama4", "llama4_text"):
        return ()
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers must have one entry for each of the {layers} layers; got {len(flags)}")
    return tuple(i for i, uses in enumerate(flags) if not uses)


def _dense_width(arch: Architecture, cfg: dict[str, Any]) -> int:
    """A dense MLP's intermediate width: `intermediate_size`; Llama 4's `intermediate_size_mlp` (its
    `intermediate_size` is the experts'); a Granite 4.0 without experts, its shared MLP's; a Qwen3.5 mixture of
    experts', which has no dense layer and no `intermediate_size`, its experts' width."""
    if arch == "llama4":
        return int(cfg["intermediate_size_mlp"])
    if arch == "granitemoe" and not cfg.get("num_local_experts"):
        return int(cfg["shared_intermediate_size"])
    return int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"])


def _llama4_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's attention quirks (`ModelConfig.qk_unit_norm` and the fields after it); {} for other families."""
    if arch != "llama4":
        return {}
    tuning = bool(cfg.get("attn_temperature_tuning", True))
    return dict(
        qk_unit_norm=bool(cfg.get("use_qk_norm", True)),
        nope_temperature_scale=float(cfg.get("attn_scale") or 0.1) if tuning else 0.0,
        nope_temperature_floor=int(cfg.get("floor_scale") or 8192),
        attention_chunk=int(cfg.get("attention_chunk_size") or 0),
    )


# The families whose configs written before `layer_types` make every `sliding_window_pattern`-th layer global, and
# that pattern's default (Command R7B's released config.json has the pattern and no `layer_types`).
_GLOBAL_EVERY = {"gemma3_text": 6, "cohere2": 4}


def _afmoe_layer_types(cfg: dict[str, Any]) -> list[str]:
    """AFMoE's `layer_types`, or (a config without them) every `global_attn_every_n_layers`-th layer full attention
    and the others windowed, as transformers fills them in."""
    every = int(cfg.get("global_attn_every_n_layers") or 4)
    layers = int(cfg["num_hidden_layers"])
    return list(cfg.get("layer_types") or
                ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)])  # fmt: skip


# The families in GLM-4.5's layout (`glm4_moe`) whose rope turns each whole head (GLM-4.5's: half).
_WHOLE_ROPE_GLM4_MOE = ("solar_open", "exaone_moe", "hy_v3", "sarvam_moe")


# Families transformers builds as Llama, which reads no `sliding_window` (their configs may still carry one).
_WINDOWLESS = ("internlm3", "iquestcoder")


def _layer_windows(model_type: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's attention window, as transformers builds the model: where `layer_types` is given, its
    "sliding_attention" layers get `sliding_window`; otherwise Qwen's layers from `max_window_layers` on do when
    `use_sliding_window` is set, Gemma 3's and Cohere 2's but every `sliding_window_pattern`-th (6, 4:
    `_GLOBAL_EVERY`), and every layer of any other family does when `sliding_window` is set. () when no layer has a
    window. ValueError for a window that is not a
    positive integer or a layer type not known."""
    window = cfg.get("sliding_window")
    layers = int(cfg["num_hidden_layers"])
    if (model_type.startswith("qwen") or model_type == "smollm3") and not cfg.get("use_sliding_window"):
        window = None
    if model_type in _WINDOWLESS:
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{model_type} with use_sliding_window is not supported (transformers builds none)")
        window = None
    if window is None:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer; got {window!r}")
    types = _afmoe_layer_types(cfg) if model_type == "afmoe" else cfg.get("layer_types")
    if types is not None:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown or len(types) != layers:
            raise ValueError(f"layer_types must name one of sliding_attention, full_attention for each of the "
                             f"{layers} layers; got {types!r}")
        windowed = [kind == "sliding_attention" for kind in types]
    elif model_type.startswith("qwen"):
        first = int(cfg.get("max_window_layers", layers))
        windowed = [i >= first for i in range(layers)]
    elif model_type in _GLOBAL_EVERY:  # an earlier config: every `sliding_window_pattern`-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or _GLOBAL_EVERY[model_type])
        windowed = [(i + 1) % pattern != 0 for i in range(layers)]
    elif model_type in ("gemma2", "gpt_oss"):  # an earlier config: the even layers are local, the odd ones global
        windowed = [i % 2 == 0 for i in range(layers)]
    elif model_type in ("exaone4", "exaone_moe"):  # its pattern: "LLLG" (local, local, local, global, repeated) or
        # every n-th global
        windowed = _exaone4_windowed(cfg.get("sliding_window_pattern") or 4, layers)
    else:
        windowed = [True] * layers
    return tuple(window if on else 0 for on in windowed) if any(windowed) else ()


def _exaone4_windowed(pattern: str | int, layers: int) -> list[bool]:
    """EXAONE 4's windowed layers by its `sliding_window_pattern`: a string of `L` (local) and `G` (global) repeated
    over the layers, or every `pattern`-th layer global; ValueError for another string."""
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise ValueError(f"sliding_window_pattern {pattern!r} is not a string of L and G")
        return [pattern[i % len(pattern)] == "L" for i in range(layers)]
    return [(i + 1) % int(pattern) != 0 for i in range(layers)]


def _gemma_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields a Gemma (`gemma`), Gemma 2 (`gemma2`) or Gemma 3 text (`gemma3_text`) `config.json` sets
    apart, with `rope_theta` (Gemma 3: the global layers' base), from either layout: transformers 5's `rope_parameters`
    (per layer type for Gemma 3), or the earlier `rope_theta`, `rope_local_base_freq` and `rope_scaling`. ValueError for
    what is not implemented: logit soft-capping on Gemma 3 (it sets none), bidirectional attention, a Gemma 3 without a
    sliding window, a rope type other than default (and linear on Gemma 3's global layers), another activation. Gemma
    (1) is the pre-norm block of Llama with Gemma's norms, embeddings and GeGLU: no sandwich norms, no soft-caps, no
    windows, queries scaled by the head dim."""
    gemma3, gemma1 = model_type == "gemma3_text", model_type == "gemma"
    if gemma3:
        for field_name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(field_name) is not None:
                raise ValueError(f"gemma3_text with {field_name} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type} with use_bidirectional_attention is not supported")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if gemma1 and activation == "gelu":  # the released Gemma configs' legacy value, which transformers reads as tanh
        activation = "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"{model_type} hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    by_type = cfg.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        full, local = by_type.get("full_attention") or {}, by_type.get("sliding_attention") or {}
    elif gemma3:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta")}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq")}
    else:  # Gemma and Gemma 2: one rope for every layer
        rope = by_type or cfg.get("rope_scaling") or {}
        full = local = {**rope, "rope_theta": rope.get("rope_theta") or cfg.get("rope_theta")}
    factor = 1.0
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type == "linear" and kind == "full_attention" and gemma3:
            factor = float(params["factor"])
        elif rope_type != "default":
            raise ValueError(f"{model_type} {kind} rope type {rope_type!r} is not supported")
    if gemma3 and not cfg.get("sliding_window"):  # its local layers' rope is chosen by their window
        raise ValueError("gemma3_text without a sliding_window is not supported")
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    fields: dict[str, Any] = {
        "rope_theta": float(full.get("rope_theta") or (1_000_000.0 if gemma3 else 10_000.0)),
        "norm_offset": 1.0,
        "embedding_multiplier": hidden**0.5,
        "hidden_act": "gelu_tanh",
        "sandwich_norms": not gemma1,
        "attention_scale": float(head_dim if gemma1 else cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
    }
    if gemma3:
        fields["local_rope_theta"] = float(local.get("rope_theta") or 10_000.0)
        fields["rope_linear_factor"] = factor
    else:
        fields["attention_softcap"] = float(cfg.get("attn_logit_softcapping") or 0.0)
        fields["final_logit_softcap"] = float(cfg.get("final_logit_softcapping") or 0.0)
    return fields


def _gemma4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields of a Gemma 4 text `config.json` (`gemma4_text`, or a multimodal one's
    `text_config`): Gemma 3's block with `w` norms, unscaled scores, windowed layers on their own rope, and the
    `Gemma4Layout`. The full-attention layers' shape comes from `per_layer_config` (transformers 5's, one entry per
    such layer) or `global_head_dim` / `num_global_key_value_heads`. ValueError for what is not implemented: a
    mixture-of-experts block, bidirectional attention, per-layer shapes other than one for every full-attention
    layer, rope types other than default (windowed) and proportional or default (full)."""
    experts = int(cfg.get("num_experts") or 0) if cfg.get("enable_moe_block") else 0
    chosen = int(cfg.get("top_k_experts") or 0) if experts else 0
    if experts and not 0 < chosen <= experts:
        raise ValueError(f"gemma4_text: top_k_experts {chosen} must be in 1..num_experts ({experts})")
    if cfg.get("enable_moe_block") and not experts:
        raise ValueError("gemma4_text with enable_moe_block needs num_experts")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma4_text with use_bidirectional_attention is not supported")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"gemma4_text hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    types = list(cfg.get("layer_types") or [])
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"} or not cfg.get("sliding_window"):
        raise ValueError("gemma4_text needs layer_types (sliding_attention or full_attention per layer) and a "
                         "sliding_window")  # fmt: skip
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    keys_as_values = bool(cfg.get("attention_k_eq_v", False))
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    if overrides:
        shapes = {(v.get("head_dim", head_dim), v.get("num_key_value_heads", kv_heads)) for v in overrides.values()}
        if set(overrides) != set(full) or len(shapes) > 1:
            raise ValueError(f"gemma4_text per_layer_config {cfg['per_layer_config']!r}: only one shape, for the "
                             "full-attention layers, is supported")  # fmt: skip
        global_head_dim, global_kv_heads = shapes.pop()
    else:
        global_head_dim = int(cfg.get("global_head_dim") or 512)
        global_kv = cfg.get("num_global_key_value_heads") if keys_as_values else None
        global_kv_heads = int(global_kv or kv_heads)
    # transformers' defaults where a config names no rope for a layer type.
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
    full_rope = rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1_000_000.0}  # fmt: skip
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"gemma4_text sliding_attention rope type {local.get('rope_type')!r} is not supported")
    full_type = full_rope.get("rope_type") or "default"
    if full_type not in ("default", "proportional") or float(full_rope.get("factor") or 1.0) != 1.0:
        raise ValueError(f"gemma4_text full_attention rope {full_rope!r} is not supported (default and proportional "
                         "without a factor are)")  # fmt: skip
    fraction = float(full_rope.get("partial_rotary_factor") or 1.0) if full_type == "proportional" else 1.0
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared
    sources = list(range(layers))
    for index in range(first_shared, layers):  # the last earlier layer of its kind that keeps its own K/V
        earlier = [i for i in range(first_shared) if types[i] == types[index]]
        if not earlier:
            raise ValueError(f"gemma4_text num_kv_shared_layers {shared}: layer {index} ({types[index]}) has no "
                             "earlier layer of its kind to share")  # fmt: skip
        sources[index] = earlier[-1]
    per_layer = int(cfg.get("hidden_size_per_layer_input") or 0)
    layout = Gemma4Layout(
        global_head_dim=int(global_head_dim),
        global_kv_heads=int(global_kv_heads),
        keys_as_values=keys_as_values,
        global_rope_angles=int(fraction * int(global_head_dim) // 2),
        kv_sources=tuple(sources),
        wide_mlp_layers=tuple(range(first_shared, layers)) if cfg.get("use_double_wide_mlp") else (),
        per_layer_input_size=per_layer,
        per_layer_vocab_size=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if per_layer else 0,
        experts=experts,
        experts_per_token=chosen,
        expert_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
    )
    softcap = cfg.get("final_logit_softcapping")
    return {
        "rope_theta": float(full_rope.get("rope_theta") or 1_000_000.0),
        "local_rope_theta": float(local.get("rope_theta") or 10_000.0),
        "embedding_multiplier": int(cfg["hidden_size"]) ** 0.5,
        "hidden_act": "gelu_tanh",
        "sandwich_norms": True,
        "attention_scale": 1.0,
        "final_logit_softcap": float(softcap or 0.0),
        "gemma4": layout,
    }


def _attention_bias(arch: Architecture, cfg: dict[str, Any]) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE by `qkv_bias` (default on), Mixtral never (PhiMoE, in its layout, by
    `attention_bias`); the others by `attention_bias` (default on for gpt-oss and GLM-4, as transformers' configs
    have it)."""
    if arch == "qwen2":
        return True
    if arch == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))
    if arch == "mixtral" and cfg.get("model_type") != "phimoe":
        return False
    if cfg.get("model_type") == "internlm3" and "attention_bias" not in cfg:  # its released configs' name for it
        return bool(cfg.get("qkv_bias", False))
    if cfg.get("model_type") == "sarvam_moe" and "attention_bias" not in cfg:  # Sarvam 30B's released name
        return bool(cfg.get("use_qkv_bias", False))
    return bool(cfg.get("attention_bias", arch in ("gpt_oss", "glm4")))


def _experts_from_hf_config(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / gpt-oss /
    DeepSeek-V3 / GLM-4.5 / Llama 4 / Qwen3-Next `config.json` ({} for a dense family). Mixtral's, OLMoE's and
    gpt-oss's experts are `intermediate_size` wide; Mixtral always renormalises its top-k weights, OLMoE as
    `norm_topk_prob` says; gpt-oss softmaxes the top-k logits (the same weights), with biases and its clamped
    SwiGLU."""
    if arch not in (
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "qwen3_next", "llama4", "glm4_moe",
        "minimax_m2", "ernie4_5_moe", "lfm2", "granitemoe", "hunyuan", "afmoe",
    ):  # fmt: skip
        return {}
    if arch == "hunyuan":
        return _hunyuan_experts(cfg)
    if arch == "afmoe":
        return _afmoe_experts(cfg)
    if cfg.get("model_type") == "youtu":  # DeepSeek-V3's attention, no experts
        return {}
    if arch in ("qwen3_next", "lfm2") and not cfg.get("num_experts"):
        return {}  # Qwen3.5's and LFM2's dense models
    if arch == "granitemoe" and not cfg.get("num_local_experts"):
        return {}  # Granite 4.0's dense models: the shared MLP alone
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
                  or cfg.get("moe_num_experts") or 0)  # fmt: skip
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("moe_k") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act {cfg['hidden_act']!r} is not supported (experts run SwiGLU)")
    if arch in ("deepseek_v3", "glm4_moe"):  # GLM-4.5's experts and router are DeepSeek-V3's
        model_type = cfg.get("model_type")
        softmax = model_type in ("mistral4", "deepseek_v2")  # softmax scores, no load-balancing bias
        scoring = cfg.get("scoring_func", "softmax" if softmax else "sigmoid")
        method = cfg.get("topk_method") or ("group_limited_greedy" if softmax else "noaux_tc")
        served = (("sigmoid", "noaux_tc"), ("softmax", "group_limited_greedy"), ("softmax", "greedy"))
        if (scoring, method) not in served:
            raise ValueError(f"{model_type} routing by {scoring} scores with {method} is not supported")
        groups, top_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if experts % groups or not 1 <= top_groups <= groups:
            raise ValueError(f"{model_type}: {experts} experts in {groups} groups, {top_groups} of them chosen")
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type != "deepseek_v2")),
            shared_expert_intermediate_size=int(cfg["moe_intermediate_size"])
            * int(cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or 0),  # (K-EXAONE's name for it)
            shared_expert_gated=False,
            dense_layers=_dense_layers(cfg),
            grouped_router=True,
            moe_scoring=scoring,
            router_score_bias=method == "noaux_tc",
            moe_groups=groups if method != "greedy" else 1,
            moe_topk_groups=top_groups if method != "greedy" else 1,
            moe_group_score="max" if model_type == "deepseek_v2" else "top2",
            # (Hy3's `router_scaling_factor`)
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or cfg.get("router_scaling_factor") or 1.0),
        )
    if arch == "ernie4_5_moe":
        return _ernie4_5_moe_fields(cfg, experts, top_k)
    if arch == "lfm2":  # LFM2-MoE: DeepSeek-V3's router in one group, its bias optional, the sum's epsilon 1e-6
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=tuple(range(int(cfg.get("num_dense_layers", 2)))),
            grouped_router=True,
            moe_scoring="sigmoid",
            router_score_bias=bool(cfg.get("use_expert_bias", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            moe_renorm_epsilon=1e-6,
        )
    if arch == "minimax_m2":  # DeepSeek-V3's router in one group: sigmoid scores, a bias for the choice, renormalised
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
            grouped_router=True,
            moe_scoring="sigmoid",
            router_score_bias=True,
        )
    if arch == "llama4":
        layers = int(cfg["num_hidden_layers"])
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        moe_layers = cfg.get("moe_layers")
        if moe_layers is None:  # as transformers' Llama4TextConfig derives them
            moe_layers = list(range(step - 1, layers, step))
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            shared_expert_intermediate_size=int(cfg["intermediate_size"]),
            shared_expert_gated=False,
            dense_layers=tuple(i for i in range(layers) if i not in set(moe_layers)),
            moe_input_scaled=True,
        )
    if arch == "gpt_oss":
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
            expert_biases=True,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        )
    if arch == "granitemoe":  # softmax over the top-k logits (Mixtral's renormalised weights), a shared MLP beside
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
            shared_expert_intermediate_size=int(cfg.get("shared_intermediate_size") or 0)
            if cfg.get("model_type") != "granitemoe" else 0,
            shared_expert_gated=False,
        )
    if arch in ("mixtral", "olmoe"):
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        )
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        # Qwen3.5's MoE router always renormalises (its config has no norm_topk_prob).
        norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "qwen3_next")),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch in ("qwen2_moe", "qwen3_next")
        else 0,
        dense_layers=tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step != 0),
    )


def _hunyuan_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan MoE's fields ({} for the dense models): Mixtral's softmax top-`moe_topk` of `num_experts` experts,
    renormalised, each `intermediate_size` wide (as transformers builds them), beside an ungated shared MLP of that
    width on every layer. ValueError for counts that differ between layers, more than one shared MLP, and (dense or
    not) what the released models' configs can switch that this engine does not build: no q/k norms (`use_qk_norm`
    false) or Hunyuan-Large's cross-layer attention (`use_cla`)."""
    if cfg.get("use_qk_norm") is False or cfg.get("use_cla"):
        raise ValueError(f"{cfg.get('model_type')} with use_qk_norm false or use_cla is not supported")
    if cfg.get("model_type") != "hunyuan_v1_moe":
        return {}
    experts, top_k = _uniform(cfg, "num_experts", 1), _uniform(cfg, "moe_topk", 1)
    if not 1 <= top_k <= experts:
        raise ValueError(f"hunyuan_v1_moe: moe_topk {top_k} must be in [1, num_experts {experts}]")
    if _uniform(cfg, "num_shared_expert", 1) != 1:
        raise ValueError(f"hunyuan_v1_moe: num_shared_expert {cfg['num_shared_expert']!r} is not supported (1 is)")
    width = int(cfg["intermediate_size"])
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        shared_expert_intermediate_size=width,
        shared_expert_gated=False,
    )


# What the KV cache stores: "auto" the model's own dtype; "fp8" each token's key and value per KV head in e4m3 with
# a float32 scale (`kernels.reference.fp8_kv_rows`), about half a 16-bit cache's bytes (a quarter of float32's).
KVCacheDType = Literal["auto", "fp8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDType)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings. The block count is derived at start-up from `memory_bytes`."""

    block_size: int = 16
    memory_bytes: int = 2 * 1024**3  # KV pool size; on CUDA the runner may size from free memory instead.
    enable_prefix_caching: bool = True
    dtype: KVCacheDType = "auto"
    # A hybrid's (recurrent layers: Qwen3.5, Qwen3-Next, LFM2, Granite 4.0, Nemotron-H) prefix cache: how many
    # snapshots of its states at prompts' block boundaries to keep (engine_server.core.state_snapshots). None: as many
    # as fit an eighth of the memory left beside the running requests' states, at most max_num_seqs; 0: none, and no
    # prefix served from the cache.
    state_snapshots: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decodes and chunked prefills."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's context length
    max_waiting: int = 4096  # admission limit; beyond it new requests are refused (RESOURCE_EXHAUSTED)
    # An INTERACTIVE request arriving during a step waits for it (on the CPU a step of BATCH work only is stopped
    # for it instead: engine_server.step_interrupt, but not one with INTERACTIVE rows, nor the BATCH step right
    # after a stopped one, nor any on CUDA). So while INTERACTIVE requests are about, a step without INTERACTIVE
    # prefill carries only the decode rows and prefill tokens that the engine's measured step times say fit this
    # many seconds
    # (engine_server.core.scheduler, step_timing); a step without decode rows at least batch_min_prefill_chunk
    # tokens. None: by device (0.015 s on the CPU, 0.02 s on CUDA; while none is about, 0.15 s / 0.06 s, or 3x a
    # configured target, for the prefill beside every row); 0: no cap.
    batch_step_target_s: float | None = None
    batch_min_prefill_chunk: int = 64


SpeculativeMethod = Literal["ngram", "suffix", "draft_model"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine_server.speculative), spelled as vLLM's `--speculative-config` JSON.

    Each step a decoding sequence may carry up to `num_speculative_tokens` proposed tokens, verified in the same
    forward pass; the output is the one decoding without them gives (greedy: token for token). Methods:
    - "ngram": prompt lookup: the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) matched
      earlier in the prompt and output, proposing what followed;
    - "suffix": suffix decoding: a suffix tree over the sequence's own tokens and the outputs of the last
      `suffix_decoding_max_cached_requests` requests, proposing the most frequent continuation of the longest
      match (at most `suffix_decoding_max_tree_depth` tokens deep; up to `suffix_decoding_max_spec_factor` times
      the match length; a branch below `suffix_decoding_min_token_prob` ends the proposal);
    - "draft_model": `model` (a model spec sharing the target's tokenizer, e.g. a `dummy:` preset) decodes the
      proposals greedily beside the target, with a KV cache of its own.
    `adaptive`: each sequence's proposal length follows its measured acceptance and the cost of a verified token,
    so speculation switches itself off where it would not pay (engine_server.speculative.policy).
    """

    method: SpeculativeMethod
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": the draft model to load')
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1, suffix_decoding_max_cached_requests >= 0")
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob < 1:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0, suffix_decoding_min_token_prob in [0, 1)")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config`: a JSON object with "method" and any of the fields above. Raises ValueError
        naming what is wrong (not JSON, an unknown key, a bad value). vLLM's "num_speculative_tokens" is optional
        here (default 4); a "prompt_lookup_max" alone also sets the minimum when it is smaller than the default."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict) or "method" not in raw:
            raise ValueError('--speculative-config must be a JSON object with a "method"')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if "prompt_lookup_max" in raw and "prompt_lookup_min" not in raw:
            raw["prompt_lookup_min"] = min(cls.prompt_lookup_min, raw["prompt_lookup_max"])
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ValueError(f"--speculative-config: {exc}") from None


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served on the base model (engine_server.lora), spelled as vLLM's flags.

    `modules`: (name, folder) pairs loaded at start (`--lora-modules name=path`); more load at run time.
    `max_loras`: slots, the most adapters one step runs (a request of another adapter waits for a slot);
    `max_lora_rank`: the largest rank an adapter may have (the slots are this wide); `max_cpu_loras`: adapters
    whose weights stay in host memory (the rest are read from their folders again when next asked for).
    """

    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.max_loras <= 256:
            raise ValueError(f"--max-loras must be in [1, 256], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"--max-lora-rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules names each adapter once")


# The command line's --async-scheduling choices as EngineConfig.async_scheduling values.
ASYNC_SCHEDULING_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
QuantizationMode = Literal["auto", "none", "gguf", "int8", "fp8"]  # EngineConfig.quantization
# EngineConfig.tool_call_parser: "auto" (read off the chat template) or a format (engine_server.tools.ToolFormat).
# "openai" is vLLM's name for gpt-oss's harmony calls (engine_server.harmony), which "auto" also picks for its template.
ToolCallParserName = Literal[
    "auto", "hermes", "llama3_json", "mistral", "mistral_v11", "pythonic", "qwen3_coder", "openai", "glm45", "glm47",
    "deepseek_v3", "deepseek_v31", "kimi_k2", "minimax_m2", "seed_oss", "nemotron_json", "lfm2", "granite",
    "cohere", "gemma4", "olmo3",
    # other names of these formats: vLLM's, then SGLang's (engine_server.tools.template.FORMAT_ALIASES)
    "llama4_pythonic", "llama4_json", "qwen3_xml", "ernie45",
    "deepseekv3", "deepseekv31", "glm", "gpt-oss", "llama3", "llama4", "qwen", "qwen25", "minimax-m2",
]
TOOL_CALL_PARSERS: tuple[str, ...] = get_args(ToolCallParserName)  # the command line's --tool-call-parser choices
# EngineConfig.reasoning_parser: "auto" (on when the chat template mentions a known opening tag: <think>,
# <seed:think>, [THINK], <|START_THINKING|>, <|channel>thought), "none", or a family (vLLM's names) whose reasoning
# is split off between its tags (engine_server.reasoning: seed_oss <seed:think>, mistral [THINK], cohere
# <|START_THINKING|>, gemma4 <|channel>thought, the others <think>).
# "openai_gptoss" (vLLM's name) reads gpt-oss's harmony channels, as "auto" does for its template.
ReasoningParserName = Literal[
    "auto", "none", "qwen3", "deepseek_r1", "glm45", "kimi_k2", "minimax_m2", "seed_oss", "mistral", "cohere",
    "gemma4", "openai_gptoss",
]
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParserName)
QUANTIZATION_MODES: tuple[str, ...] = get_args(QuantizationMode)  # the command line's --quantization choices


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, fixed at start-up."""

    model: str = "default"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    cache_dir: str | None = None  # where converted models live (`cache_path`); default $LADLE_CACHE_DIR, ~/.cache/ladle
    # CUDA graphs replay decode steps when the device is CUDA, unless enforce_eager (vLLM's name) is set. One
    # graph per batch-size bucket up to min(max_num_seqs, max_cuda_graph_batch); larger batches run eagerly.
    enforce_eager: bool = False
    max_cuda_graph_batch: int = 512
    # Schedule and launch step N+1 before step N's tokens reach the host, so the host's work overlaps the
    # device's (see EngineCore). None: on for CUDA, where the device runs ahead; off on the CPU, where every op
    # is synchronous and the overlap would only cost a discarded row per finished request.
    async_scheduling: bool | None = None
    # How the linear layers' weights are kept (engine_server.quantization): "none" (float: the exact path,
    # greedy output equal to transformers'), "gguf" (a GGUF file's own 4/8-bit blocks), "int8" (8-bit groups of
    # 32 of any model's weights), "fp8" (e4m3 weights with per-channel or block scales, activations per token) or
    # "auto", the default: gguf for a GGUF file on the CPU, where its quality was measured to hold and it is faster
    # at every batch size (docs/models.md, Quantized weights), int8 for an MXFP4 checkpoint there (gpt-oss's experts
    # served as stored), fp8 for an FP8 checkpoint on a GPU with e4m3 tensor cores, none everywhere else.
    quantization: QuantizationMode = "auto"
    # How tool calls are read from the output: "auto" picks the format the chat template implies
    # (engine_server/tools/template.py), a format's name forces it (vLLM's --tool-call-parser).
    tool_call_parser: ToolCallParserName = "auto"
    # Whether a chat's <think>...</think> reasoning comes back apart from its content (reasoning_content): "auto"
    # when the chat template mentions <think> (Qwen3, DeepSeek-R1), "none", or a parser's name (vLLM's flag).
    reasoning_parser: ReasoningParserName = "auto"
    # Sampling values for the fields a request leaves unset (engine_server.generation_defaults): "auto" (the
    # model's own), "ladle" (OpenAI's) or the path of a generation_config.json (or of a folder holding one);
    # then override_generation_config, a JSON object such as '{"temperature": 0.7}', on top. vLLM's names.
    generation_config: str = "auto"
    override_generation_config: str | None = None
    # A JSON object laid over the model's config.json before it is read (vLLM's --hf-overrides), e.g.
    # '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}' for
    # Qwen's long context; `hf_override_values` parses it.
    hf_overrides: str | None = None
    # The chat template used instead of the model's (vLLM's --chat-template): the path of a file holding it, or the
    # template itself; `chat_template_text` reads it.
    chat_template: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # Tensor parallelism (engine_server.parallel): the model split over this many ranks, this process being rank 0
    # (scheduler, sampling, gRPC) and N-1 spawned workers; on the CPU the cores are shared out between the ranks.
    tensor_parallel_size: int = 1
    lora: LoraConfig | None = None  # None: no LoRA adapters (vLLM's --enable-lora off)

    def __post_init__(self) -> None:
        self.hf_override_values()
        self.chat_template_text()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.lora is not None and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served under tensor parallelism yet: use --tensor-parallel-size 1")

    def cache_path(self) -> Path | None:
        """`cache_dir` as a path; None: the loader's default (`$LADLE_CACHE_DIR`, else ~/.cache/ladle)."""
        return Path(self.cache_dir) if self.cache_dir else None

    def chat_template_text(self) -> str | None:
        """`chat_template` as template text (a file's contents when it names a file; None when unset). ValueError
        when it looks like a path (one line ending .jinja, .j2 or .txt) that is not a readable file."""
        if not self.chat_template:
            return None
        path = Path(self.chat_template)
        if "\n" not in self.chat_template and len(self.chat_template) < 4096 and path.is_file():
            try:
                return path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--chat-template {self.chat_template!r} cannot be read: {exc}") from None
        if "\n" not in self.chat_template and path.suffix in (".jinja", ".j2", ".txt"):
            raise ValueError(f"--chat-template {self.chat_template!r} is not a file")
        return self.chat_template

    def hf_override_values(self) -> dict[str, Any]:
        """`hf_overrides` as a dict ({} when unset); ValueError unless it is a JSON object."""
        if not self.hf_overrides:
            return {}
        try:
            values = json.loads(self.hf_overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-overrides is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"--hf-overrides must be a JSON object, got {self.hf_overrides!r}")
        return values
