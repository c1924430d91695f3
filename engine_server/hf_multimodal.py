"""The vision-language (and speech) checkpoints whose text model the engine serves on text prompts: Gemma 3 (4B to 27B),
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, LLaVA (1.5, NeXT, NeXT-Video, OneVision), Llama 3.2 Vision, InternVL,
Idefics 2 and 3, SmolVLM, Aya Vision, Command A Vision, LFM2-VL, GLM-4.1V / 4.5V / 4.6V, MiniCPM-V 4.6, DeepSeek-VL,
Janus, Ovis2 / 2.5, LLaVA-OneVision-1.5, VideoLLaMA3, Video-LLaVA, ViP-LLaVA, LightOnOCR, LFM3-VL, HyperCLOVA X
Vision, Voxtral, Qwen2-Audio, Audio Flamingo 3, Phi-4-multimodal (its text model Phi-4-mini's, without its vision and
speech LoRA adapters), and the thinkers of Qwen2.5-Omni and Qwen3-Omni (their speech talkers not read).

Their `config.json` is read as transformers reads it (its composite config class: a released config states only what
differs from the class's defaults, and early ones are flat, the text model's keys at the top level), and the text
model's config (`text_config`) is read as the family's own, under the embedding tie of the composite model (the one
transformers ties the LM head by). The towers and projectors beside the text model are read only where images are
served (`engine_server.multimodal`, `MultimodalCheckpoint.images`: LLaVA, LLaVA-NeXT (and NeXT-Video), LLaVA-OneVision,
ViP-LLaVA, Aya Vision, Gemma 3, Mistral 3, InternVL, Idefics 2, Idefics 3, SmolVLM, DeepSeek-VL and its hybrid, Janus
(its understanding path), the Qwen-VL and GLM-4.xV kinds, Llama 3.2 Vision (its tower, projector and cross-attention
layers); `MultimodalCheckpoint.audio`: Qwen2-Audio, Audio Flamingo 3); the other kinds serve text prompts, and a turn
with an image or an audio clip is refused by name.

A text prompt takes the text model alone in each of these: the M-RoPE of the Qwen-VL and GLM-V families turns a text
token's three position components, all its one position, as plain rope does; Llama 3.2 Vision skips its
cross-attention layers without an image (`MultimodalCheckpoint.dropped_layers`; a prompt with images runs them beside
the text model, `multimodal.mllama`), its head the first `vocab_size` rows
of an embedding 8 rows longer.
"""

from __future__ import annotations

from typing import Any

from engine_server.config import AudioInput, ImageInput, MultimodalCheckpoint

# A multimodal checkpoint's names for its text model's families, and the family the engine reads each as.
_TEXT_FAMILIES = {
    "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe",
    "mllama_text_model": "llama", "glm4v_text": "glm4", "glm4v_moe_text": "glm4_moe", "qwen2_5_omni_text": "qwen2",
    "qwen3_omni_moe_text": "qwen3_moe", "phi4_multimodal": "phi3",
}  # fmt: skip
# What sits beside the text model in each such checkpoint, by weight prefix (transformers 5's layout, then the one
# the checkpoints were released in), none of it read.
_TOWER_NAMES = (
    "vision_tower.", "multi_modal_projector.", "visual.", "vision_model.", "connector.", "image_newline",
    "audio_tower.", "aligner.", "high_res_vision_", "generation_aligner.", "generation_embeddings.",
    "generation_head.", "vqmodel.", "projector.", "vision_encoder.", "vision_projection.", "merger.",
    "visual_embeddings_table", "image_tower.", "video_tower.", "vision_projector.",
    "visual_tokenizer.", "vte.", "talker.", "token2wav.", "code2wav.", "embed_tokens_extend.",
)  # fmt: skip
_TOWERS = tuple(prefix + name for name in _TOWER_NAMES for prefix in ("model.", ""))
# The multimodal model types whose text model is served.
MULTIMODAL_ARCHITECTURES = frozenset({
    "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "llava_next", "llava_next_video",
    "llava_onevision", "mllama", "internvl", "idefics2", "idefics3", "smolvlm", "aya_vision", "cohere2_vision",
    "lfm2_vl", "glm4v", "glm4v_moe", "voxtral",
    "glm46v", "deepseek_vl", "deepseek_vl_hybrid", "janus", "hyperclovax_vision_v2", "lfm3_vl", "lighton_ocr",
    "llava_onevision1_5", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "ovis2", "ovis2_5", "video_llama_3",
    "video_llava", "vipllava", "qwen2_5_omni", "qwen2_5_omni_thinker", "qwen3_omni_moe", "qwen3_omni_moe_thinker",
    "phi4_multimodal", "qwen2_audio", "audioflamingo3",
})  # fmt: skip
# The kinds whose transformers class ties no weights (no `_tied_weights_keys`): the LM head is always the checkpoint's
# own, whatever the text config says (tests/unit/test_multimodal_text_models.py checks the set against transformers).
_HEAD_NEVER_TIED = frozenset({"qwen2_audio", "voxtral", "mllama", "audioflamingo3"})
# The vision towers LLaVA's images are served over, and the class tokens each puts before its patches' rows.
_CLASS_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}
# The kinds whose images are served as Qwen-VL's are (`multimodal.qwen_vl`: a tower over patches and their grid,
# M-RoPE), GLM-4.1V's, 4.5V's and 4.6V's among them.
_QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "glm46v")
# Multimodal model types people ask for whose text model alone is not what they are (the refusal says why).
MULTIMODAL_NOT_SERVED = {
    "paligemma": "PaliGemma attends both ways over its whole prompt (a prefix LM), which this engine does not serve",
    "florence2": "Florence-2 is an encoder-decoder model, which this engine does not serve",
}


def multimodal_text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], MultimodalCheckpoint]:
    """The text model's config (as a text-only checkpoint's `config.json` would state it, every default filled in)
    of a multimodal `config.json` of `MULTIMODAL_ARCHITECTURES`, and what its checkpoint holds beside it; ValueError
    for one transformers cannot read."""
    from transformers import CONFIG_MAPPING  # (only for these checkpoints: it imports every config class)

    model_type = cfg["model_type"]
    try:
        composite = CONFIG_MAPPING[model_type].from_dict(cfg)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{model_type} config.json cannot be read: {error}") from None
    text = composite.get_text_config(decoder=True).to_dict()
    stated = cfg.get("text_config") or {}
    for key in ("eos_token_id", "bos_token_id"):  # the text model's own where it states one, else the top level's
        if stated.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    tie = getattr(composite, "tie_word_embeddings", None)
    text["tie_word_embeddings"] = bool(text.get("tie_word_embeddings") if tie is None else tie)
    if model_type in _HEAD_NEVER_TIED:
        text["tie_word_embeddings"] = False
    text_type = str(text.get("model_type"))
    text["model_type"] = _TEXT_FAMILIES.get(text_type, text_type)
    if text_type in ("glm4v_text", "glm4v_moe_text"):  # rope over the whole head unless its parameters say less
        rope = dict(text.get("rope_parameters") or {})
        text["rope_parameters"] = {**rope, "partial_rotary_factor": rope.get("partial_rotary_factor", 1.0)}
    if text_type == "qwen3_vl_moe_text":  # its router always renormalises the chosen experts' weights
        text["norm_topk_prob"] = True
    dropped: tuple[int, ...] = ()
    banks: tuple[int, int] | None = None
    if text_type == "qwen3_vl_moe_text":  # released with its banks hidden-first (transformers transposes them)
        banks = (int(text["hidden_size"]), int(text["moe_intermediate_size"]))
    if text_type == "mllama_text_model":
        dropped = tuple(sorted(int(i) for i in text.get("cross_attention_layers") or ()))
        text = {**text, "num_hidden_layers": int(text["num_hidden_layers"]) - len(dropped),
                "vocab_size": int(text["vocab_size"]) + 8, "output_vocab_size": int(text["vocab_size"])}  # fmt: skip
    return text, MultimodalCheckpoint(model_type, _TOWERS, dropped, banks, _image_input(composite),
                                      _audio_input(composite))  # fmt: skip


def _image_input(composite: Any) -> ImageInput | None:
    """How a checkpoint whose images are served reads them: LLaVA's, LLaVA-NeXT's, ViP-LLaVA's and Aya Vision's over a
    CLIP or SigLIP tower, whose class token (CLIP's) the "default" feature strategy drops (ViP-LLaVA's always);
    LLaVA-OneVision's over SigLIP (every patch: the "full" strategy);
    Gemma 3's; Mistral 3's over Pixtral; InternVL's, Idefics 3's and SmolVLM's tiles; Idefics 2's (its perceiver's
    `resampler_n_latents` tokens a tile); DeepSeek-VL's, its hybrid's and Janus's (a fixed count an image); the Qwen-VL
    kinds' (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE; GLM-4.1V, 4.5V and 4.6V), their text model's M-RoPE sections
    (Qwen3-VL's interleaved) and Qwen3-VL's DeepStack layers; Llama 3.2 Vision's (its image token one token, its
    images read by its cross-attention layers). None for every other kind (text prompts alone)."""
    if composite.model_type == "mllama":
        return ImageInput("mllama", int(composite.image_token_index), int(composite.vision_config.patch_size),
                          cross_attention=True)  # fmt: skip
    if composite.model_type in _QWEN_VL:
        vision = composite.vision_config
        rope = composite.get_text_config(decoder=True).rope_parameters or {}
        qwen3 = composite.model_type.startswith("qwen3")  # (the default sections: transformers' text rope's)
        default = (24, 20, 20) if qwen3 else (8, 12, 12) if composite.model_type.startswith("glm") else ()
        section = tuple(int(n) for n in rope.get("mrope_section") or default)
        deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        return ImageInput(composite.model_type, int(composite.image_token_id), int(vision.patch_size),
                          merge_size=int(vision.spatial_merge_size), mrope_section=section, mrope_interleaved=qwen3,
                          deepstack_layers=deepstack)  # fmt: skip
    if composite.model_type == "mistral3":
        if composite.vision_config.model_type != "pixtral":
            return None
        return ImageInput("mistral3", int(composite.image_token_id), int(composite.vision_config.patch_size),
                          merge_size=int(composite.spatial_merge_size), row_marks=("[IMG_BREAK]", "[IMG_END]"))
    if composite.model_type == "internvl":
        patch = composite.vision_config.patch_size
        side = int(patch[0] if isinstance(patch, list | tuple) else patch)
        return ImageInput("internvl", int(composite.image_token_id), side, extra_tokens=int(composite.image_seq_length),
                          image_marks=("<img>", "</img>"), tiles=True)  # fmt: skip
    if composite.model_type == "gemma3":
        vision = composite.vision_config
        return ImageInput("gemma3", int(composite.image_token_id), int(vision.patch_size),
                          extra_tokens=int(composite.mm_tokens_per_image),
                          text_marks=("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
                          bidirectional=True)  # fmt: skip
    if composite.model_type in ("idefics3", "smolvlm"):
        vision = composite.vision_config
        per_tile = (int(vision.image_size) // int(vision.patch_size)) ** 2 // int(composite.scale_factor) ** 2
        return ImageInput(composite.model_type, int(composite.image_token_id), int(vision.patch_size),
                          extra_tokens=per_tile, split_rows=True)  # fmt: skip
    if composite.model_type == "idefics2":
        return ImageInput("idefics2", int(composite.image_token_id), int(composite.vision_config.patch_size),
                          extra_tokens=int(composite.perceiver_config.resampler_n_latents))  # fmt: skip
    if composite.model_type == "aya_vision" and composite.vision_config.model_type == "siglip_vision_model":
        return ImageInput("aya_vision", int(composite.image_token_id), int(composite.vision_config.patch_size),
                          merge_size=int(composite.downsample_factor), placeholder="<image>")  # fmt: skip
    if composite.model_type == "llava_onevision":
        vision = composite.vision_config
        if vision.model_type != "siglip_vision_model" or composite.vision_feature_select_strategy != "full":
            return None  # (released checkpoints' alone: SigLIP's every patch)
        per_tile = (int(vision.image_size) // int(vision.patch_size)) ** 2
        return ImageInput("llava_onevision", int(composite.image_token_id), int(vision.patch_size),
                          extra_tokens=per_tile, vision_aspect_ratio=str(composite.vision_aspect_ratio))  # fmt: skip
    if composite.model_type in ("deepseek_vl", "janus", "deepseek_vl_hybrid"):  # (a token a patch of its square image)
        vision = composite.vision_config
        tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
        if composite.model_type == "janus":  # (its vision config states its processor's count)
            tokens = int(vision.num_image_tokens)
        return ImageInput(composite.model_type, int(composite.image_token_id), int(vision.patch_size),
                          extra_tokens=tokens)  # fmt: skip
    if composite.model_type not in ("llava", "llava_next", "llava_next_video", "vipllava"):
        return None
    vision = composite.vision_config
    class_tokens = _CLASS_TOKENS.get(vision.model_type)
    if class_tokens is None:
        return None
    dropped = 1 if getattr(composite, "vision_feature_select_strategy", "default") == "default" else 0
    image_token, patch = int(composite.image_token_id), int(vision.patch_size)
    return ImageInput(composite.model_type, image_token, patch, class_tokens - dropped)


def _audio_input(composite: Any) -> AudioInput | None:
    """How a checkpoint whose audio is served hears it: Qwen2-Audio's, Audio Flamingo 3's. None for every other kind."""
    if composite.model_type in ("qwen2_audio", "audioflamingo3"):
        return AudioInput(composite.model_type, int(composite.audio_token_id))
    return None


def mistral3_checkpoint(cfg: dict[str, Any]) -> MultimodalCheckpoint | None:
    """What a multimodal Mistral 3 `config.json` (read as its text model's family by `hf_config`) holds beside its text
    model where its images are served (a Pixtral tower); None otherwise."""
    from transformers import CONFIG_MAPPING

    try:
        composite = CONFIG_MAPPING["mistral3"].from_dict(cfg)
    except (KeyError, TypeError, ValueError):
        return None  # (its text model is read as before; images are not served)
    images = _image_input(composite)
    return None if images is None else MultimodalCheckpoint("mistral3", _TOWERS, images=images)

