"""Hugging Face parameter names and shapes of a Llama / Qwen2 / Qwen3 decoder and their mixture-of-experts
variants (Qwen2-MoE / Qwen3-MoE names; Mixtral's are read as these), DeepSeek-V3's latent attention, gpt-oss's
biased experts, Qwen3.5's linear-attention layers and Gemma 4, derived from a `ModelConfig` (an ungated MLP's up
and down, with Apertus's xIELU scalars)."""

from __future__ import annotations

from engine_server.config import ModelConfig


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of `cfg`'s model, HF-named, in checkpoint order.

    `lm_head.weight` is listed only for untied models; q/k/v biases only with `attention_bias`, o_proj's only with
    `ModelConfig.o_proj_bias`; per-head q/k norms only with `qk_norm`; the pre/post feed-forward norms only with
    `sandwich_norms` (Gemma 2 and 3); attention sinks only with `attention_sinks`; experts with biases (gpt-oss)
    as gpt-oss's checkpoints store them (`mlp.router` with a bias, each projection and its bias one bank for all
    the experts, `models.gpt_oss`), other experts one tensor per expert and projection.
    """
    if cfg.gemma4 is not None:
        return _gemma4_shapes(cfg)
    if cfg.architecture == "mamba":
        return _state_space_shapes(cfg)
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if not cfg.post_norms:  # (OLMo 2's blocks have none: each output is normalised instead)
            shapes[p + "input_layernorm.weight"] = (h,)
        if cfg.is_linear_layer(i) and cfg.linear_attention is not None and cfg.linear_attention.kimi_delta:
            shapes.update(_kimi_delta_shapes(p + "self_attn.", cfg))
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes.update(_mlp_block_shapes(p, cfg, i))
            continue
        if cfg.latent_attention is not None:
            shapes.update(_latent_attention_shapes(p + "self_attn.", cfg))
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes.update(_mlp_block_shapes(p, cfg, i))
            continue
        if cfg.is_linear_layer(i):  # Qwen3.5's Gated DeltaNet (its layout: q/k/v, z, b and a apart)
            shapes.update(_linear_attention_shapes(p + "linear_attn.", cfg))
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes.update(_mlp_block_shapes(p, cfg, i))
            continue
        # Qwen3-Next and Qwen3.5: each head's query rows, then its output gate's.
        shapes[p + "self_attn.q_proj.weight"] = (q_out * (2 if cfg.attention_output_gate else 1), h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if cfg.qk_norm:  # per head, or (OLMoE) over the whole projection
            shapes[p + "self_attn.q_norm.weight"] = (q_out,) if cfg.qk_norm_whole else (d,)
            shapes[p + "self_attn.k_norm.weight"] = (kv_out,) if cfg.qk_norm_whole else (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.attention_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
        if not cfg.parallel_block:  # Cohere's one norm feeds the attention and the MLP
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
        if cfg.sandwich_norms or cfg.post_norms:
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes.update(_mlp_block_shapes(p, cfg, i))
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _state_space_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Mamba's, Falcon Mamba's and Mamba-2's parameters as their checkpoints name them (`models.mamba`): the
    embeddings, each layer's norm and mixer (Mamba-1's `x_proj` and `dt_proj` with A per channel and entry, or
    Mamba-2's A, `dt_bias` and D per head and its gated norm), the final norm, an untied LM head."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
        shapes[p + "norm.weight"] = (h,)
        if cfg.mamba1 is not None:
            one = cfg.mamba1
            inner, kernel, bias = one.inner, one.conv_kernel, one.conv_bias
            shapes.update({
                m + "A_log": (inner, one.state_dim), m + "D": (inner,), m + "in_proj.weight": (2 * inner, h),
                m + "x_proj.weight": (one.dt_rank + 2 * one.state_dim, inner),
                m + "dt_proj.weight": (inner, one.dt_rank), m + "dt_proj.bias": (inner,),
            })  # fmt: skip
            channels = inner
        else:
            two = cfg.mamba2
            assert two is not None
            inner, kernel, bias, channels = two.inner, two.conv_kernel, two.conv_bias, two.conv_dim
            shapes.update({
                m + "dt_bias": (two.num_heads,), m + "A_log": (two.num_heads,), m + "D": (two.num_heads,),
                m + "in_proj.weight": (inner + channels + two.num_heads, h), m + "norm.weight": (inner,),
            })  # fmt: skip
        shapes[m + "conv1d.weight"] = (channels, 1, kernel)
        if bias:
            shapes[m + "conv1d.bias"] = (channels,)
        shapes[m + "out_proj.weight"] = (h, inner)
    shapes["backbone.norm_f.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _gemma4_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Gemma 4's parameters (`layers.gemma4`): each layer's attention of its own head shape (no k/v projections or
    key norm on a layer that attends over another's K/V, no v_proj where values are the keys' projection), its
    sandwich norms, MLP of its width, `layer_scalar`, per-layer input projections and experts; the per-layer input
    table and projection; tied embeddings. Gemma 3n's (`ModelConfig.altup`): each layer's AltUp and LAuReL in place
    of `layer_scalar`, and the streams' projections."""
    layout = cfg.gemma4
    assert layout is not None
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p, d, kv = f"model.layers.{i}.", cfg.layer_head_dim(i), cfg.layer_kv_heads(i) * cfg.layer_head_dim(i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * d, h)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        if cfg.kv_source(i) == i:
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            if not (layout.keys_as_values and cfg.is_global_layer(i)):
                shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * d)
        for norm in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[f"{p}{norm}.weight"] = (h,)
        shapes.update(_mlp_shapes(p + "mlp.", h, cfg.layer_intermediate_size(i)))
        if cfg.altup is None:
            shapes[p + "layer_scalar"] = (1,)
        else:
            shapes.update(_altup_layer_shapes(p, h, cfg.altup.streams, cfg.altup.laurel_rank))
        if layout.per_layer_input_size:
            shapes[p + "per_layer_input_gate.weight"] = (layout.per_layer_input_size, h)
            shapes[p + "per_layer_projection.weight"] = (h, layout.per_layer_input_size)
            shapes[p + "post_per_layer_input_norm.weight"] = (h,)
        if layout.experts:
            width = layout.expert_intermediate_size
            shapes.update({
                p + "router.proj.weight": (layout.experts, h), p + "router.scale": (h,),
                p + "router.per_expert_scale": (layout.experts,),
                p + "experts.gate_up_proj": (layout.experts, 2 * width, h),
                p + "experts.down_proj": (layout.experts, h, width),
                p + "pre_feedforward_layernorm_2.weight": (h,), p + "post_feedforward_layernorm_1.weight": (h,),
                p + "post_feedforward_layernorm_2.weight": (h,),
            })  # fmt: skip
    if layout.per_layer_input_size:
        packed = cfg.num_hidden_layers * layout.per_layer_input_size
        shapes["model.embed_tokens_per_layer.weight"] = (layout.per_layer_vocab_size, packed)
        shapes["model.per_layer_model_projection.weight"] = (packed, h)
        shapes["model.per_layer_projection_norm.weight"] = (layout.per_layer_input_size,)
    if cfg.altup is not None:
        for stack in ("altup_projections", "altup_unembed_projections"):
            shapes.update({f"model.{stack}.{i}.weight": (h, h) for i in range(cfg.altup.streams - 1)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _altup_layer_shapes(p: str, h: int, streams: int, rank: int) -> dict[str, tuple[int, ...]]:
    """A Gemma 3n layer's AltUp and LAuReL parameters (`layers.gemma3n`)."""
    return {
        p + "altup.correct_output_scale": (h,), p + "altup.correction_coefs.weight": (streams, streams),
        p + "altup.prediction_coefs.weight": (streams * streams, streams), p + "altup.modality_router.weight": (
            streams, h), p + "altup.router_norm.weight": (h,), p + "laurel.linear_left.weight": (rank, h),
        p + "laurel.linear_right.weight": (h, rank), p + "laurel.post_laurel_norm.weight": (h,),
    }  # fmt: skip


def _mlp_block_shapes(p: str, cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Layer `i`'s MLP under `p`: dense, or a mixture of experts (its router, experts and shared expert)."""
    h = cfg.hidden_size
    if not cfg.is_moe_layer(i) and cfg.ungated_mlp:  # up and down alone (Arcee, Apertus)
        width = cfg.intermediate_size
        ungated: dict[str, tuple[int, ...]] = {
            p + "mlp.up_proj.weight": (width, h), p + "mlp.down_proj.weight": (h, width)
        }  # fmt: skip
        if cfg.hidden_act == "xielu":  # its four learned scalars (`layers.mlp.XIELU`)
            ungated.update({p + "mlp.act_fn.alpha_p": (1,), p + "mlp.act_fn.alpha_n": (1,), p + "mlp.act_fn.beta": (),
                           p + "mlp.act_fn.eps": ()})  # fmt: skip
        return ungated
    if not cfg.is_moe_layer(i):
        return _mlp_shapes(p + "mlp.", h, cfg.intermediate_size)
    if cfg.expert_biases:
        return _biased_experts_shapes(p + "mlp.", cfg.num_experts, h, cfg.moe_intermediate_size)
    shapes: dict[str, tuple[int, ...]] = {p + "mlp.gate.weight": (cfg.num_experts, h)}
    if cfg.router_score_bias:
        shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
    for e in range(cfg.num_experts):
        shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", h, cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        shared = "mlp.shared_expert." if cfg.shared_expert_gated else "mlp.shared_experts."
        shapes.update(_mlp_shapes(p + shared, h, cfg.shared_expert_intermediate_size))
        if cfg.shared_expert_gated:
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def _linear_attention_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors under `prefix`, as Qwen3.5's checkpoints store them."""
    linear, h = cfg.linear_attention, cfg.hidden_size
    assert linear is not None
    heads = linear.num_value_heads
    return {
        prefix + "in_proj_qkv.weight": (linear.conv_dim, h),
        prefix + "in_proj_z.weight": (linear.value_dim, h),
        prefix + "in_proj_b.weight": (heads, h),
        prefix + "in_proj_a.weight": (heads, h),
        prefix + "conv1d.weight": (linear.conv_dim, 1, linear.conv_kernel),
        prefix + "dt_bias": (heads,),
        prefix + "A_log": (heads,),
        prefix + "norm.weight": (linear.value_head_dim,),
        prefix + "out_proj.weight": (h, linear.value_dim),
    }


def _kimi_delta_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Kimi Delta Attention layer's tensors under `prefix` (Kimi Linear's, Ling 3's; `layers.kimi_delta`)."""
    linear, h = cfg.linear_attention, cfg.hidden_size
    assert linear is not None
    rank = linear.key_head_dim
    gates: dict[str, tuple[int, ...]] = (
        {prefix + "f_proj.weight": (linear.key_dim, h), prefix + "g_proj.weight": (linear.value_dim, h)}
        if linear.full_rank_gates
        else {
            prefix + "f_a_proj.weight": (rank, h),
            prefix + "f_b_proj.weight": (linear.key_dim, rank),
            prefix + "g_a_proj.weight": (rank, h),
            prefix + "g_b_proj.weight": (linear.value_dim, rank),
        }
    )
    return {
        prefix + "q_proj.weight": (linear.key_dim, h),
        prefix + "k_proj.weight": (linear.key_dim, h),
        prefix + "v_proj.weight": (linear.value_dim, h),
        prefix + "conv1d.weight": (linear.conv_dim, 1, linear.conv_kernel),
        prefix + "b_proj.weight": (linear.num_value_heads, h),
        **gates,
        prefix + "dt_bias": (linear.key_dim,),
        prefix + "A_log": (linear.num_value_heads,),
        prefix + "o_norm.weight": (linear.value_head_dim,),
        prefix + "o_proj.weight": (h, linear.value_dim),
    }


def _latent_attention_shapes(prefix: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's latent attention projections and norms under `prefix`."""
    mla, h, heads = cfg.latent_attention, cfg.hidden_size, cfg.num_attention_heads
    assert mla is not None
    key = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if mla.q_lora_rank:
        shapes[prefix + "q_a_proj.weight"] = (mla.q_lora_rank, h)
        shapes[prefix + "q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes[prefix + "q_b_proj.weight"] = (heads * key, mla.q_lora_rank)
    else:
        shapes[prefix + "q_proj.weight"] = (heads * key, h)
    shapes[prefix + "kv_a_proj_with_mqa.weight"] = (mla.kv_lora_rank + mla.qk_rope_head_dim, h)
    shapes[prefix + "kv_a_layernorm.weight"] = (mla.kv_lora_rank,)
    shapes[prefix + "kv_b_proj.weight"] = (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    shapes[prefix + "o_proj.weight"] = (h, heads * mla.v_head_dim)
    if mla.head_gate:
        shapes[prefix + "g_proj.weight"] = (heads, h)
    return shapes


def _biased_experts_shapes(prefix: str, experts: int, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """gpt-oss's router and experts under `prefix`, in its checkpoints' names and layouts."""
    banks = prefix + "experts."
    return {
        prefix + "router.weight": (experts, hidden),
        prefix + "router.bias": (experts,),
        banks + "gate_up_proj": (experts, hidden, 2 * intermediate),
        banks + "gate_up_proj_bias": (experts, 2 * intermediate),
        banks + "down_proj": (experts, intermediate, hidden),
        banks + "down_proj_bias": (experts, hidden),
    }


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's three projections under `prefix`."""
    return {
        prefix + "gate_proj.weight": (intermediate, hidden),
        prefix + "up_proj.weight": (intermediate, hidden),
        prefix + "down_proj.weight": (hidden, intermediate),
    }


def is_norm_weight(name: str) -> bool:
    """True for RMSNorm scales (layer norms, final norm, Qwen3 q/k norms) and Gemma 4's other scales (its layers'
    output scale, its router's), which initialise to 1."""
    return name.endswith(("norm.weight", "layer_scalar", "router.scale", "router.per_expert_scale"))
