"""Whisper's `config.json` (`WhisperForConditionalGeneration`, model_type "whisper"): its decoder read as the GPT/OPT
lineage's fields (`whisper_text_config`: LayerNorms with biases, learned positions without an offset, an ungated GELU
MLP, q/v/o biases, the LM head tied to the token embeddings as transformers ties `proj_out`), its encoder and each
decoder layer's `encoder_attn` left to `multimodal.whisper`."""

from __future__ import annotations

from typing import Any

from engine_server.config import MultimodalCheckpoint

WHISPER_ARCHITECTURES = frozenset({"whisper"})
# What sits beside the decoder, read by `multimodal.whisper.WhisperAudioEncoder` (its encoder) and skipped by the
# decoder's loading (the layers' `encoder_attn` too: `models.whisper`).
_TOWERS = ("model.encoder.",)


def whisper_text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], MultimodalCheckpoint]:
    """The decoder of a Whisper `config.json` as a BioGPT-like text config (OPT's block and names; learned positions
    `max_target_positions` long, no embedding scale: transformers' `WhisperDecoder` scales none; LayerNorm eps 1e-5),
    and what its checkpoint holds beside it. ValueError for what is not served: a stored-quantized checkpoint."""
    from transformers import WhisperConfig  # (only for these checkpoints)

    if cfg.get("quantization_config"):
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(f"whisper checkpoints stored quantized ({method}) are not served; use a float checkpoint")
    whisper = WhisperConfig.from_dict(cfg)  # (its defaults where the file states none)
    if whisper.activation_function not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"whisper activation_function {whisper.activation_function!r} is not supported (gelu)")
    text = {
        "model_type": "biogpt", "vocab_size": whisper.vocab_size, "hidden_size": whisper.d_model,
        "num_hidden_layers": whisper.decoder_layers, "num_attention_heads": whisper.decoder_attention_heads,
        "intermediate_size": whisper.decoder_ffn_dim, "hidden_act": whisper.activation_function,
        "max_position_embeddings": whisper.max_target_positions, "scale_embedding": False,
        "attention_bias": True, "tie_word_embeddings": True, "eos_token_id": whisper.eos_token_id,
        "bos_token_id": whisper.bos_token_id,
    }  # fmt: skip
    return text, MultimodalCheckpoint("whisper", _TOWERS, transcribes=True)
