"""The classic decoders' `config.json`: GPT-2, GPT-BigCode (StarCoder, SantaCoder, WizardCoder), GPT-NeoX (Pythia,
Dolly, RedPajama-INCITE), Falcon (7B, 40B, 180B, Falcon2 11B), Phi (Phi-1, 1.5, 2), StableLM
(StableLM 2, StableLM-3B-4E1T, Stable Code), StarCoder2, Nemotron (Nemotron-4, Minitron), OLMo (the first), EXAONE
(3.0, 3.5), OPT (125M to 66B), GPT-Neo (125M to 2.7B, the TinyStories models), CodeGen (350M to 16B),
Persimmon (8B), XGLM (564M to 7.5B), BioGPT, BLOOM (560M to 176B) and MPT (7B, 30B). Each is read as a Llama
config
(`classic_config`: their own key names given Llama's, what their transformers class fills in where a file leaves
it out) plus the fields of their blocks (`classic_fields`). Any family's reader takes a float of a config.json
through `json_float`."""

from __future__ import annotations

import math
from typing import Any

from engine_server.config import Architecture

# Each classic `model_type` and the family that serves it: the GPT-NeoX lineage's LayerNorms with biases, biased
# projections and GELU MLPs in `models.gpt_neox`, OLMo's and EXAONE 3's Llama blocks in `models.llama`.
CLASSIC_ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": "gpt_neox",
    "gpt_bigcode": "gpt_neox",
    "gptj": "gptj",
    "codegen": "gptj",  # CodeGen: GPT-J's block, q/k/v in one projection laid out by its 4 training shards
    "gpt_neox": "gpt_neox",
    "falcon": "gpt_neox",
    "phi": "gpt_neox",
    "stablelm": "gpt_neox",
    "starcoder2": "gpt_neox",
    "nemotron": "gpt_neox",
    "olmo": "llama",
    "exaone": "llama",
    "opt": "gpt_neox",
    "gpt_neo": "gpt_neox",
    # Persimmon (Adept's 8B, Fuyu's text model): GPT-NeoX's fused q/k/v and LayerNorms, a q/k LayerNorm with a bias
    # shared by every head, an ungated relu² MLP, a sequential block
    "persimmon": "gpt_neox",
    # XGLM (564M to 7.5B) and BioGPT: OPT's block (its names) with the token embeddings scaled by sqrt(hidden);
    # XGLM's positions sinusoidal (its table computed at load), BioGPT's learned
    "xglm": "gpt_neox",
    "biogpt": "gpt_neox",
    # BLOOM (560M to 176B, BLOOMZ): GPT-NeoX's fused q/k/v and biased LayerNorms, no rope but ALiBi, its embeddings
    # LayerNorm'd, a tanh-GELU MLP
    "bloom": "gpt_neox",
    # MPT (MosaicML's 7B and 30B, their chat, instruct and StoryWriter models): q/k/v in one projection `cat(q, k,
    # v)`, no biases anywhere (its LayerNorms' neither), ALiBi with its own slopes, a GELU MLP, a sequential block
    "mpt": "gpt_neox",
    # GPT-1 (OpenAI's first GPT): post-LN blocks, learned positions, GPT-2's Conv1D weights, no final norm
    "openai-gpt": "gpt_neox",
}
# The share of each head rope turns where a config does not say (their transformers classes' defaults).
_PARTIAL_ROTARY = {"gpt_neox": 0.25, "phi": 0.5, "stablelm": 0.25, "nemotron": 0.5, "persimmon": 0.5}
# Their MLP's activation: transformers' names and ours (`ModelConfig.hidden_act`), the default first.
_ACTIVATIONS = {
    "gpt_neox": {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"},
    "falcon": {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"},
    "gpt2": {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"},
    "gpt_bigcode": {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"},
    "gptj": {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"},
    "codegen": {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"},
    "phi": {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"},
    "starcoder2": {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"},
    "nemotron": {"relu2": "relu2"},
    "persimmon": {"relu2": "relu2"},
    "xglm": {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"},
    "bloom": {"bloom_gelu": "gelu_tanh"},  # (its config names none: its `BloomGelu`, GELU's tanh form)
    "biogpt": {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"},
    "mpt": {"gelu": "gelu"},  # (its config names none: exact GELU)
    "openai-gpt": {"gelu": "gelu_tanh", "relu": "relu"},  # (its "gelu" is transformers' `gelu_new`)
    "stablelm": {"silu": "silu"},
    "olmo": {"silu": "silu"},
    "exaone": {"silu": "silu"},
    "opt": {"relu": "relu"},
    "gpt_neo": {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"},
}
# Keys a family's config names its own way, and Llama's name for each.
_RENAMED_KEYS = {
    "gpt_neox": {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"},
    **{gpt2: {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
              "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
              "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"}
       for gpt2 in ("gpt2", "gpt_bigcode", "gptj", "codegen")},
    "falcon": {"n_embed": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
               "layer_norm_epsilon": "rms_norm_eps", "ffn_hidden_size": "intermediate_size", "bias": "attention_bias",
               "activation": "hidden_act"},
    "starcoder2": {"norm_epsilon": "rms_norm_eps", "use_bias": "attention_bias"},
    "nemotron": {"norm_eps": "rms_norm_eps"},
    "persimmon": {"layer_norm_eps": "rms_norm_eps"},
    "bloom": {"n_embed": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
              "layer_norm_epsilon": "rms_norm_eps", "seq_length": "max_position_embeddings"},
    "openai-gpt": {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                   "n_positions": "max_position_embeddings", "layer_norm_epsilon": "rms_norm_eps", "afn": "hidden_act"},
    "mpt": {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
            "max_seq_len": "max_position_embeddings", "layer_norm_epsilon": "rms_norm_eps"},
    "xglm": {"d_model": "hidden_size", "num_layers": "num_hidden_layers", "attention_heads": "num_attention_heads",
             "ffn_dim": "intermediate_size", "activation_function": "hidden_act"},
    "stablelm": {"use_qkv_bias": "attention_bias"},
    "exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"},
    "opt": {"ffn_dim": "intermediate_size", "activation_function": "hidden_act", "enable_bias": "attention_bias"},
    "gpt_neo": {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"},
}  # fmt: skip
# The families whose every head has its own K/V.
_OWN_KV_HEADS = ("gpt_neox", "gptj", "codegen", "opt", "gpt_neo", "persimmon", "xglm", "biogpt", "bloom", "mpt",
                 "openai-gpt")
# What a family's config may set that this engine does not build.
_UNBUILT = {
    "gpt2": ("scale_attn_by_inverse_layer_idx", "add_cross_attention"), "gpt_bigcode": ("add_cross_attention",),
    "bloom": ("apply_residual_connection_post_layernorm",),
}  # fmt: skip
# What their transformers classes fill in where a config leaves it out (and their modeling files fix).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_neox": {"attention_bias": True, "rope_theta": 10000.0},
    "persimmon": {"attention_bias": True, "rms_norm_eps": 1e-5, "qk_layernorm": True},
    # their LayerNorms take torch's default epsilon (BioGPT's whatever its `layer_norm_eps` says)
    "xglm": {"attention_bias": True, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 2048},
    "biogpt": {"attention_bias": True, "tie_word_embeddings": True, "max_position_embeddings": 1024},
    # BLOOM has no position limit of its own (ALiBi): its training context, 2,048, unless `--hf-overrides` says
    "bloom": {"attention_bias": True, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 2048},
    "mpt": {"attention_bias": False, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048},
    "openai-gpt": {"attention_bias": True, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
                   "max_position_embeddings": 512},
    **{gpt2: {"attention_bias": True, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 1024} for gpt2 in ("gpt2", "gpt_bigcode")},
    "falcon": {"rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 10000.0},
    **{gptj: {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0}
       for gptj in ("gptj", "codegen")},
    "phi": {"attention_bias": True},  # q/k/v and `dense` always have biases
    "starcoder2": {"attention_bias": True, "tie_word_embeddings": True},
    "olmo": {"rms_norm_eps": 1e-5},  # its LayerNorm's epsilon is fixed
    "stablelm": {"attention_out_bias": False},  # o_proj never has a bias
    # OPT's LayerNorms take torch's default epsilon (its config names none)
    "opt": {"attention_bias": True, "tie_word_embeddings": True, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    # GPT-Neo: q/k/v without biases, its `out_proj` with one
    "gpt_neo": {"attention_bias": False, "attention_out_bias": True, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 2048},
}


def json_float(value: Any) -> float:
    """A float of a config.json: a number, or transformers 5's tag for one JSON cannot spell (`{"__float__":
    "Infinity"}`, also "-Infinity" and "NaN")."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def classic_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with a classic family's own keys given Llama's names and its class's defaults filled in (the same dict
    for any other `model_type`): Falcon's, GPT-2's and GPT-BigCode's KV heads and MLP widths as transformers builds
    them, GPT-J's rope share from its `rotary_dim`. ValueError for what this engine does not build: Phi's q/k
    LayerNorms (`qk_layernorm`, which no release sets), GPT-2's scores scaled by layer
    (`scale_attn_by_inverse_layer_idx`) and cross-attention, OPT-350M's form (`_refuse_unbuilt_opt`), MPT's forms
    no release takes (`_refuse_unbuilt_mpt`)."""
    if model_type not in CLASSIC_ARCHITECTURES:
        return cfg
    if model_type == "phi" and cfg.get("qk_layernorm"):
        raise ValueError("phi with qk_layernorm is not supported")
    for key in _UNBUILT.get(model_type, ()):
        if cfg.get(key):
            raise ValueError(f"{model_type} with {key} is not supported")
    if model_type == "opt":
        _refuse_unbuilt_opt(cfg)
    if model_type == "mpt":
        _refuse_unbuilt_mpt(cfg)
    renamed = dict(cfg)
    for theirs, ours in _RENAMED_KEYS.get(model_type, {}).items():  # the family's own key over any under Llama's name
        if theirs in renamed:
            renamed[ours] = renamed.pop(theirs)
    if model_type in ("olmo", "biogpt"):  # a LayerNorm epsilon their modeling files fix
        renamed["rms_norm_eps"] = 1e-5
    if model_type in _OWN_KV_HEADS:  # every head its own K/V (a stray `num_key_value_heads` is not read)
        renamed["num_key_value_heads"] = renamed["num_attention_heads"]
    if model_type == "gpt_neo":
        renamed.update(_gpt_neo_layers(renamed))
    if model_type == "falcon":
        renamed.update(_falcon_shape(renamed))
    if model_type in ("gptj", "codegen"):  # rope over `rotary_dim` of each head (its base fixed), the MLP 4 x hidden
        # unless given
        hidden, heads = int(renamed["hidden_size"]), int(renamed["num_attention_heads"])
        renamed["partial_rotary_factor"] = int(renamed.get("rotary_dim") or hidden // heads) / (hidden // heads)
        renamed["intermediate_size"] = int(renamed.get("intermediate_size") or 4 * hidden)
        renamed["rope_theta"] = 10000.0
    if model_type in ("bloom", "openai-gpt"):  # their MLP 4 x hidden
        renamed["intermediate_size"] = 4 * int(renamed["hidden_size"])
    if model_type == "mpt":  # its MLP `expansion_ratio` x hidden (4; MosaicML's code reads it, transformers fixes
        # 4); its q/k/v clamped by `attn_config`
        renamed["intermediate_size"] = int(renamed.get("expansion_ratio") or 4) * int(renamed["hidden_size"])
        renamed["clip_qkv"] = (renamed.get("attn_config") or {}).get("clip_qkv")
    if model_type in ("gpt2", "gpt_bigcode"):  # the MLP 4 x hidden unless given; GPT-BigCode's one KV head
        multi_query = model_type == "gpt_bigcode" and renamed.get("multi_query", True)
        renamed["intermediate_size"] = int(renamed.get("intermediate_size") or 4 * int(renamed["hidden_size"]))
        renamed["num_key_value_heads"] = 1 if multi_query else renamed["num_attention_heads"]
    for key, value in _DEFAULTS.get(model_type, {}).items():
        if renamed.get(key) is None:
            renamed[key] = value
    rope = renamed.get("rope_parameters") or renamed.get("rope_scaling") or {}
    given = renamed.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
    if model_type in _PARTIAL_ROTARY and not given:
        renamed["partial_rotary_factor"] = _PARTIAL_ROTARY[model_type]
    return renamed


def _refuse_unbuilt_opt(cfg: dict[str, Any]) -> None:
    """ValueError for the OPT forms this engine does not build: a pre-LN model without its final norm
    (`_remove_final_layer_norm`) or LayerNorms without a weight and bias (`layer_norm_elementwise_affine` false).
    (OPT-350M's post-LN blocks and narrower embeddings are built: `classic_fields`.)"""
    if cfg.get("_remove_final_layer_norm") or not cfg.get("layer_norm_elementwise_affine", True):
        raise ValueError("opt without its final LayerNorm, or with LayerNorms without weights, is not supported")


# MPT's attention as its released configs set it (`attn_config`; MosaicML's llm-foundry builds others).
_MPT_ATTENTION = {"alibi": True, "qk_ln": False, "prefix_lm": False, "rope": False}


def _refuse_unbuilt_mpt(cfg: dict[str, Any]) -> None:
    """ValueError for the MPT forms this engine does not build (no released MPT takes them; transformers' MPT
    builds none either): attention other than multi-head ALiBi (`attn_config`: learned positions, rope, q/k
    LayerNorms, a prefix LM, grouped or multi-query K/V), biases (`no_bias` false), another norm or MLP."""
    attention = cfg.get("attn_config") or {}
    for key, released in _MPT_ATTENTION.items():
        if bool(attention.get(key, released)) != released:
            raise ValueError(f"mpt with attn_config {key} {attention[key]!r} is not supported")
    if attention.get("attn_type", "multihead_attention") != "multihead_attention":
        raise ValueError(f"mpt with attn_type {attention['attn_type']!r} is not supported (multihead_attention)")
    if not cfg.get("no_bias", True):
        raise ValueError("mpt with no_bias false (biased projections and LayerNorms) is not supported")
    norm = cfg.get("norm_type", "low_precision_layernorm")
    if norm not in ("low_precision_layernorm", "layernorm"):
        raise ValueError(f"mpt with norm_type {norm!r} is not supported (low_precision_layernorm, layernorm)")
    mlp = (cfg.get("ffn_config") or {}).get("ffn_type", "mptmlp")
    if mlp != "mptmlp":
        raise ValueError(f"mpt with ffn_type {mlp!r} is not supported (mptmlp)")


def _mpt_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MPT's attention and logits as `ModelConfig` fields (`attn_config`'s `alibi_bias_max` and `softmax_scale`;
    `logit_scale`, a number or "inv_sqrt_d_model"), as MosaicML's code reads them (transformers'
    MPT fixes the bias maximum at 8, its default, and ignores `logit_scale`)."""
    attention = cfg.get("attn_config") or {}
    fields: dict[str, Any] = {"alibi": "mpt", "alibi_bias_max": json_float(attention.get("alibi_bias_max") or 8)}
    if attention.get("softmax_scale"):
        fields["attention_scale"] = json_float(attention["softmax_scale"])
    scale = cfg.get("logit_scale")
    if scale == "inv_sqrt_d_model":
        fields["logit_scale"] = 1 / math.sqrt(int(cfg["hidden_size"]))
    elif scale is not None:
        fields["logit_scale"] = json_float(scale)
    return fields


# GPT-Neo's default layers: global and local in turn, over 24 layers (`GPTNeoConfig.attention_types`).
_GPT_NEO_ATTENTION_TYPES: list[tuple[list[str], int]] = [(["global", "local"], 12)]
_GPT_NEO_WINDOW = 256


def _gpt_neo_layers(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-Neo's layers as Llama's keys: each layer's kind (`attention_layers`, else its `attention_types` expanded,
    `[[kinds, repeats], ...]`) as `layer_types` ("local" a window of `window_size` positions, itself and those before
    it, "global" every position), the window as `sliding_window`, the MLP 4 x hidden unless given. ValueError for
    another kind, or a count of kinds other than the layers'."""
    types = cfg.get("attention_types") or _GPT_NEO_ATTENTION_TYPES
    kinds = cfg.get("attention_layers") or [kind for pattern, repeats in types for kind in pattern * repeats]
    layers = int(cfg["num_hidden_layers"])
    if set(kinds) - {"global", "local"} or len(kinds) != layers:
        raise ValueError(f"gpt_neo attention_layers must name global or local for each of the {layers} layers; got "
                         f"{kinds!r}")  # fmt: skip
    return {
        "layer_types": ["sliding_attention" if kind == "local" else "full_attention" for kind in kinds],
        "sliding_window": int(cfg.get("window_size") or _GPT_NEO_WINDOW),
        "intermediate_size": int(cfg.get("intermediate_size") or 4 * int(cfg["hidden_size"])),
    }


def falcon_kv_heads(cfg: dict[str, Any]) -> int:
    """Falcon's KV heads as transformers builds them from its `config.json` (`cfg`): `num_kv_heads` under its new
    decoder architecture (40B, 180B, Falcon2), one with `multi_query` (7B), else every head its own."""
    heads = int(cfg.get("num_attention_heads") or cfg["n_head"])
    if cfg.get("new_decoder_architecture"):
        return int(cfg.get("num_kv_heads") or heads)
    return 1 if cfg.get("multi_query", True) else heads


def _falcon_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """Falcon's KV heads (`falcon_kv_heads`) and MLP width (4 x hidden unless given) under Llama's names."""
    return {"num_key_value_heads": falcon_kv_heads(cfg),
            "intermediate_size": int(cfg.get("intermediate_size") or 4 * int(cfg["hidden_size"]))}


def classic_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig` fields of a classic family's blocks (`cfg` as `classic_config` gives it; {} for the other
    families): their LayerNorms (with biases; Nemotron's applying 1 + weight; OLMo's without a weight), ungated MLPs
    and their activation, GPT-NeoX's, Falcon's, GPT-J's, Phi's and StableLM 2 12B's parallel blocks, StableLM 2's
    q/k LayerNorms per head, GPT-2's, GPT-BigCode's, OPT's, GPT-Neo's and GPT-1's learned positions (GPT-2's and
    GPT-1's Conv1D weights), GPT-1's and OPT-350M's post-LN blocks (OPT-350M's narrower embeddings), GPT-Neo's
    unscaled scores, GPT-J's and Phi's LM head bias, BLOOM's, MPT's and Falcon-RW's ALiBi. ValueError for an
    activation the family's modeling file would not run as ours does."""
    if model_type not in CLASSIC_ARCHITECTURES:
        return {}
    activations = _ACTIVATIONS[model_type]
    activation = cfg.get("hidden_act") or next(iter(activations))
    if activation not in activations:
        raise ValueError(f"{model_type} hidden_act {activation!r} is not supported ({', '.join(activations)})")
    fields: dict[str, Any] = {"hidden_act": activations[activation]}
    if model_type in ("olmo", "exaone"):
        return {**fields, "layer_norm": True, "norm_weightless": True} if model_type == "olmo" else fields
    fields.update(layer_norm=True, layer_norm_bias=True, gated_mlp=model_type == "stablelm")
    if model_type in ("gpt2", "gpt_bigcode"):  # learned positions; GPT-2's Conv1D weights; unscaled scores by config
        unscaled = not cfg.get("scale_attn_weights", True)
        fields.update(mlp_bias=True, absolute_positions=True, transposed_weights=model_type == "gpt2",
                      **({"attention_scale": 1.0} if unscaled else {}))
    elif model_type in ("gptj", "codegen"):
        fields.update(mlp_bias=True, parallel_block=True, lm_head_bias=True)
    elif model_type == "gpt_neox":
        parallel = bool(cfg.get("use_parallel_residual", True))
        fields.update(mlp_bias=True, parallel_block=parallel, parallel_mlp_norm=parallel)
    elif model_type == "falcon":  # its new decoder architecture: the parallel block, by default off two norms
        new = bool(cfg.get("new_decoder_architecture"))
        two_norms = new and int(cfg.get("num_ln_in_parallel_attn") or 2) == 2
        parallel = new or bool(cfg.get("parallel_attn", True))
        fields.update(mlp_bias=bool(cfg.get("attention_bias")), parallel_block=parallel, parallel_mlp_norm=two_norms)
        if cfg.get("alibi"):  # Falcon-RW's positions
            fields.update(alibi="falcon")
    elif model_type == "mpt":  # LayerNorms without biases, no bias anywhere
        fields.update(layer_norm_bias=False, **_mpt_fields(cfg))
    elif model_type == "phi":
        fields.update(mlp_bias=True, parallel_block=True, lm_head_bias=True)
    elif model_type == "bloom":
        fields.update(mlp_bias=True, alibi="bloom", embedding_layer_norm=True)
    elif model_type in ("xglm", "biogpt"):  # OPT's block, the token embeddings (alone) times sqrt(hidden)
        scale = math.sqrt(int(cfg["hidden_size"])) if cfg.get("scale_embedding", True) else 1.0
        fields.update(mlp_bias=True, absolute_positions=True, embedding_multiplier=scale,
                      sinusoidal_positions=model_type == "xglm")
    elif model_type == "persimmon":  # its q/k LayerNorm one for every head, with a bias (`HeadLayerNorm.shared`)
        head_norms = bool(cfg.get("qk_layernorm"))
        fields.update(mlp_bias=True, qk_layer_norm=head_norms, qk_layer_norm_bias=head_norms)
    elif model_type == "stablelm":
        parallel, head_norms = bool(cfg.get("use_parallel_residual")), bool(cfg.get("qk_layernorm"))
        fields.update(parallel_block=parallel, qk_layer_norm=head_norms)
    elif model_type == "starcoder2":
        fields.update(mlp_bias=bool(cfg.get("attention_bias")))  # its `use_bias`, on every projection
    elif model_type == "opt":  # learned positions; its `enable_bias` on every projection; OPT-350M's post-LN blocks
        # and narrower embeddings
        width = int(cfg.get("word_embed_proj_dim") or cfg["hidden_size"])
        fields.update(mlp_bias=bool(cfg.get("attention_bias")), absolute_positions=True,
                      post_layer_norm=not cfg.get("do_layer_norm_before", True),
                      embedding_size=0 if width == int(cfg["hidden_size"]) else width)  # fmt: skip
    elif model_type == "openai-gpt":  # learned positions, Conv1D weights, post-LN blocks
        fields.update(mlp_bias=True, absolute_positions=True, transposed_weights=True, post_layer_norm=True)
    elif model_type == "gpt_neo":  # learned positions; unscaled scores (its modeling file's)
        fields.update(mlp_bias=True, absolute_positions=True, attention_scale=1.0)
    else:  # nemotron: LayerNorm1P, `(1 + weight)`, folded into the weight at load
        fields.update(mlp_bias=bool(cfg.get("mlp_bias")), norm_offset=1.0)
    return fields
