"""BitNet b1.58's `config.json` (`model_type` bitnet): Llama's keys, and its `quantization_config` (quant_method
"bitnet": `linear_class` "bitlinear" packed ternary weights, "autobitlinear" offline ternary ones or online float
ones, the inputs of every projection rounded to int8 per token either way)."""

from __future__ import annotations

from typing import Any

from engine_server.config import Architecture, TernaryForm

BITNET_ARCHITECTURES: dict[str, Architecture] = {"bitnet": "bitnet"}


def bitnet_form(cfg: dict[str, Any]) -> TernaryForm | None:
    """How a BitNet checkpoint stores its projections (`models.bitnet`), None for float weights served as they are
    (no `quantization_config`); ValueError for another quantization, or BitNet's with an RMSNorm in each layer
    (`use_rms_norm`)."""
    quantization = cfg.get("quantization_config")
    if not quantization:
        return None
    if quantization.get("quant_method") != "bitnet":
        raise ValueError(f"bitnet quant_method {quantization.get('quant_method')!r} is not supported (bitnet is)")
    if quantization.get("use_rms_norm"):
        raise ValueError("bitnet quantization with use_rms_norm is not supported")
    if quantization.get("linear_class", "bitlinear") == "bitlinear":
        return "packed"
    return "online" if quantization.get("quantization_mode", "offline") == "online" else "scaled"


def bitnet_config(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' `BitNetConfig` defaults where it leaves them out (norms at 1e-5, rope base 500,000);
    the same dict for another `model_type`."""
    if model_type not in BITNET_ARCHITECTURES:
        return cfg
    return {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, **cfg}


def bitnet_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """BitNet's sub-norms, its gated relu² (`hidden_act` "relu2" only) and whether its projections are ternary; {} for
    other families."""
    if model_type not in BITNET_ARCHITECTURES:
        return {}
    activation = cfg.get("hidden_act", "relu2")
    if activation != "relu2":
        raise ValueError(f"bitnet hidden_act {activation!r} is not supported (relu2 is)")
    return {"sub_norms": True, "hidden_act": "relu2", "ternary_projections": bitnet_form(cfg) or ""}
