"""DeepSeek-V4's `config.json` (`model_type` deepseek_v4: DeepSeek-V4-Flash, V4-Pro): its attention schedule
(`layer_types`, or the released `compress_ratios` 0 / 4 / 128 per layer), compression rates, mHC streams, the hash
routing of its first layers (`mlp_layer_types`, or `num_hash_layers`) and its two ropes (`rope_parameters` keyed
`main` / `compress`, or the released flat `rope_scaling` that applies to the compressing layers alone), read as
transformers' `DeepseekV4Config` fills them in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from engine_server.config import Architecture, CompressedAttention, HyperConnections, ModelConfig, Yarn

DEEPSEEK_V4_ARCHITECTURES: dict[str, Architecture] = {"deepseek_v4": "deepseek_v4"}
_KINDS: dict[str, Literal["sliding", "csa", "hca"]] = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def deepseek_v4_model_config(cfg: dict[str, Any], name: str, yarn: Callable[[dict[str, Any]], Yarn]) -> ModelConfig:
    """The `ModelConfig` of a DeepSeek-V4 config (module doc), `yarn` reading its compressing layers' YaRN dict;
    ValueError for what this engine does not build (a
    scoring function other than sqrtsoftplus, sigmoid and softmax; a hidden activation other than SiLU; a rope
    type other than default and YaRN)."""
    layers = int(cfg.get("num_hidden_layers", 43))
    head_dim = int(cfg.get("head_dim", 512))
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates.update({k: int(v) for k, v in (cfg.get("compress_rates") or {}).items()})
    if cfg.get("compress_rate_csa"):
        rates["compressed_sparse_attention"] = int(cfg["compress_rate_csa"])
    if cfg.get("compress_rate_hca"):
        rates["heavily_compressed_attention"] = int(cfg["compress_rate_hca"])
    layer_types = cfg.get("layer_types")
    if layer_types is None and cfg.get("compress_ratios") is not None:
        layer_types = [_RATIO_KINDS[int(r)] for r in cfg["compress_ratios"]]
    if layer_types is None:  # V4-Pro's default: two HCA layers, then CSA and HCA in turn
        interleaved = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                       for i in range(max(layers - 2, 0))]  # fmt: skip
        layer_types = ["heavily_compressed_attention"] * min(layers, 2) + interleaved
    layer_types = list(layer_types)[:layers]
    unknown = sorted({t for t in layer_types if t not in _KINDS})
    if unknown or len(layer_types) != layers:
        raise ValueError(f"deepseek_v4 layer_types must name each of the {layers} layers as one of {sorted(_KINDS)}")
    kinds = tuple(_KINDS[t] for t in layer_types)
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        hashed = int(cfg["num_hash_layers"]) if cfg.get("num_hash_layers") is not None else 3
        mlp_types = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    scoring = str(cfg.get("scoring_func", "sqrtsoftplus"))
    if scoring not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ValueError(f"deepseek_v4 scoring_func {scoring!r} is not supported (sqrtsoftplus, sigmoid, softmax are)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"deepseek_v4 hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    partial = cfg.get("partial_rotary_factor")
    if partial is None:
        partial = int(cfg["qk_rope_head_dim"]) / head_dim if cfg.get("qk_rope_head_dim") else 64 / 512
    rope_dim = int(head_dim * float(partial))
    main_theta, compress_theta, compress_yarn = _ropes(cfg, yarn)
    experts, shared = int(cfg.get("n_routed_experts", 256)), int(cfg.get("n_shared_experts", 1))
    # (transformers reads `intermediate_size` as another name of `moe_intermediate_size`, and before it)
    width = int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 2048)
    eos = cfg.get("eos_token_id", 1)
    layout = CompressedAttention(
        kinds=kinds,
        rates=tuple(0 if k == "sliding" else rates[t] for k, t in zip(kinds, layer_types, strict=True)),
        window=int(cfg.get("sliding_window", 128)),
        rope_dim=rope_dim,
        q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
        o_groups=int(cfg.get("o_groups", 8)),
        o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
        index_heads=int(cfg.get("index_n_heads", 64)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)),
        compress_rope_theta=compress_theta,
        compress_yarn=compress_yarn,
        hash_layers=tuple(i for i, t in enumerate(mlp_types[:layers]) if t == "hash_moe"),
    )
    heads = int(cfg.get("num_attention_heads", 64))
    if (heads * head_dim) % layout.o_groups:
        raise ValueError(f"deepseek_v4: {heads} heads of {head_dim} do not split into {layout.o_groups} o_groups")
    limit = float(cfg.get("swiglu_limit", 10.0))
    streams = HyperConnections(
        streams=int(cfg.get("hc_mult", 4)), eps=float(cfg.get("hc_eps", 1e-6)),
        sinkhorn_iters=max(1, int(cfg.get("hc_sinkhorn_iters", 20))),
    )  # fmt: skip
    return ModelConfig(
        architecture="deepseek_v4",
        vocab_size=int(cfg.get("vocab_size", 129280)),
        hidden_size=int(cfg.get("hidden_size", 4096)),
        intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=main_theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        partial_rotary_factor=rope_dim / head_dim,
        bos_token_id=cfg.get("bos_token_id", 0),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        name=name,
        attention_sinks=True,
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 6)),
        moe_intermediate_size=width,
        norm_topk_prob=True,
        shared_expert_intermediate_size=shared * width,
        shared_expert_gated=False,
        grouped_router=True,
        moe_scoring=scoring,  # type: ignore[arg-type]
        router_score_bias=True,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
        swiglu_limit=limit if limit > 0 else 0.0,
        swiglu_alpha=1.0,
        swiglu_up_offset=0.0,
        clamped_mlps=True,  # its shared experts clamped as its routed ones
        hyper_connections=streams,
        compressed_attention=layout,
    )


def _ropes(cfg: dict[str, Any], yarn: Callable[[dict[str, Any]], Yarn]) -> tuple[float, float, Yarn | None]:
    """(the sliding layers' rope base, the compressing layers' base, their YaRN or None): from `rope_parameters`
    keyed `main` / `compress` (transformers' form), or `rope_theta`, `compress_rope_theta` and a flat
    `rope_scaling` / `rope_parameters` that only the compressing layers apply (the released configs'). YaRN's
    attention factor is 1 unless given, as DeepSeek's reference computes it (transformers forces it too); `yarn`
    reads the rest of a YaRN dict with transformers' defaults (`hf_config`'s reader)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    nested = isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict)
    main = rope["main"] if nested else {}
    compress = rope["compress"] if nested else {k: v for k, v in rope.items() if k not in ("main", "compress")}
    main_theta = float(main.get("rope_theta") or cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    # (a flat dict's own base is the main rope's: transformers turns the compressing layers by `compress_rope_theta`)
    compress_theta = float((compress.get("rope_theta") if nested else None) or cfg.get("compress_rope_theta")
                           or 160000.0)  # fmt: skip
    if (main.get("rope_type") or "default") != "default":
        raise ValueError(f"deepseek_v4 main rope type {main['rope_type']!r} is not supported (default is)")
    kind = compress.get("rope_type") or compress.get("type") or "default"
    if kind == "default":
        return main_theta, compress_theta, None
    if kind != "yarn":
        raise ValueError(f"deepseek_v4 compress rope type {kind!r} is not supported (default and yarn are)")
    return main_theta, compress_theta, yarn({**compress, "attention_factor": compress.get("attention_factor", 1.0)})
