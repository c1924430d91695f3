"""The vision-language (and speech) checkpoints whose text model the engine serves (`engine_server.hf_multimodal`):
each saved by transformers' own multimodal class, a tiny random text model beside a tiny tower, and served whole on
the float path: its greedy tokens on text prompts equal transformers' multimodal model's, alone and batched. Their
configs as released (a few keys over the class's defaults, or flat: the text model's keys at the top level) read as
transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_server.hf_config import model_config_from_hf
from engine_server.hf_multimodal import MULTIMODAL_ARCHITECTURES
from tests.families import _SHAPE, FAMILIES, HYBRIDS, GreedyReference
from tests.unit.pooling.embedding_models import copy_tokenizer
from tests.unit.test_family_engines import NUM_TOKENS, engine, prompts, tokens

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

# Tiny towers of each kind (never run: a text prompt does not reach them).
_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "image_size": 28, "patch_size": 14}  # fmt: skip
_SIGLIP_TYPED = {**_SIGLIP, "model_type": "siglip_vision_model"}
_CLIP = {**_SIGLIP, "model_type": "clip_vision_model", "projection_dim": 32}
_INTERNVL_VISION = {**_SIGLIP, "image_size": [28, 28], "patch_size": [14, 14]}
_QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
_QWEN3_VISION = {**_QWEN_VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": []}
_GLM_VISION = {**_QWEN_VISION, "image_size": 28, "patch_size": 14}
_MLLAMA_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_global_layers": 1,
                  "attention_heads": 2, "image_size": 28, "patch_size": 14, "intermediate_layers_indices": [0],
                  "vision_output_dim": 64}  # fmt: skip
_WHISPER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_mel_bins": 16, "max_source_positions": 8}  # fmt: skip
# A tower's config keys set where a class's own default tower has them (`"shrunk"`).
_SHRUNK = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1, "num_attention_heads": 2,
           "num_heads": 2, "out_hidden_size": 64, "num_key_value_heads": 2, "head_dim": 16,
           "encoder_layers": 1, "d_model": 32, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
           "output_dim": 64}  # fmt: skip
# M-RoPE over the 8 rotated pairs of a 16-wide head: 2 for time, 3 each for height and width (GLM-4.1V's over 4 of
# them where it turns half the head).
_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
_INTERLEAVED_MROPE = {**_MROPE, "mrope_interleaved": True}
_GLM_HALF_MROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
_GLM_WHOLE_MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}
_QWEN2 = {"model_type": "qwen2", "head_dim": 16}
_QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 16}  # (not square)
_COHERE2 = {"model_type": "cohere2", **FAMILIES["cohere2"][1]}
_GLM4 = {k: v for k, v in FAMILIES["glm4"][1].items() if k != "head_dim"}
_GLM4_MOE = {**FAMILIES["glm4-moe"][1], "use_qk_norm": False}

# (transformers' multimodal class, its config's keys: a text model of the tests' shape beside a tiny tower), by
# model type (a suffix after "-" names a variant).
WRAPPERS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": ("Gemma3", {"text_config": {"model_type": "gemma3_text", **FAMILIES["gemma3"][1]},
                          "vision_config": _SIGLIP, "mm_tokens_per_image": 4}),
    "qwen2_vl": ("Qwen2VL", {"text_config": {"head_dim": 16, "rope_parameters": _MROPE},
                             "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2}}),
    "qwen2_5_vl": ("Qwen2_5_VL", {"text_config": {"head_dim": 16, "rope_parameters": _MROPE},
                                  "vision_config": {**_QWEN_VISION, "fullatt_block_indexes": [0]}}),
    "qwen3_vl": ("Qwen3VL", {"text_config": {"head_dim": 16, "rope_parameters": _INTERLEAVED_MROPE},
                             "vision_config": _QWEN3_VISION}),
    "qwen3_vl_moe": ("Qwen3VLMoe", {"text_config": {**_QWEN3_MOE, "rope_parameters": _INTERLEAVED_MROPE},
                                    "vision_config": _QWEN3_VISION}),
    "llava": ("Llava", {"text_config": {"model_type": "llama"}, "vision_config": _CLIP}),
    "llava_next": ("LlavaNext", {"text_config": {"model_type": "mistral", "head_dim": 16}, "vision_config": _CLIP}),
    "llava_onevision": ("LlavaOnevision", {"text_config": _QWEN2, "vision_config": _SIGLIP_TYPED}),
    "internvl": ("InternVL", {"text_config": _QWEN2, "vision_config": _INTERNVL_VISION}),
    "idefics3": ("Idefics3", {"text_config": {"model_type": "llama"}, "vision_config": _SIGLIP, "scale_factor": 1}),
    "smolvlm": ("SmolVLM", {"text_config": {"model_type": "llama"}, "vision_config": _SIGLIP, "scale_factor": 1}),
    "aya_vision": ("AyaVision", {"text_config": _COHERE2, "vision_config": _SIGLIP_TYPED, "downsample_factor": 1}),
    "cohere2_vision": ("Cohere2Vision", {"text_config": _COHERE2, "vision_config": _SIGLIP_TYPED,
                                         "downsample_factor": 1}),
    "lfm2_vl": ("Lfm2Vl", {"text_config": {"model_type": "lfm2", **HYBRIDS["lfm2"][1]},
                           "vision_config": {**_SIGLIP, "model_type": "siglip2_vision_model", "num_patches": 4},
                           "downsample_factor": 1}),
    "glm4v": ("Glm4v", {"text_config": {**_GLM4, "rope_parameters": _GLM_HALF_MROPE}, "vision_config": _GLM_VISION}),
    # GLM-4.1V's rope turns the whole head where its parameters name no share (GLM-4's turns half by default).
    "glm4v-whole-rope": ("Glm4v", {"text_config": {**_GLM4, "rope_parameters": _GLM_WHOLE_MROPE},
                                   "vision_config": _GLM_VISION}),
    "glm4v_moe": ("Glm4vMoe", {"text_config": {**_GLM4_MOE, "rope_parameters": _GLM_HALF_MROPE},
                               "vision_config": _GLM_VISION}),
    "voxtral": ("Voxtral", {"text_config": {"model_type": "llama"}, "audio_config": _WHISPER}),
    "qwen2_audio": ("Qwen2Audio", {"text_config": _QWEN2, "audio_config": {
        "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "num_mel_bins": 16,
        "max_source_positions": 8}}),
    "audioflamingo3": ("AudioFlamingo3", {"text_config": _QWEN2, "audio_config": {
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
        "num_mel_bins": 16, "max_source_positions": 8}}),
    "idefics2": ("Idefics2", {"text_config": {"model_type": "mistral", "head_dim": 16}, "vision_config": _SIGLIP,
                              "perceiver_config": {"hidden_size": 64, "resampler_n_latents": 4,
                                                   "resampler_depth": 1, "resampler_n_heads": 2,
                                                   "resampler_head_dim": 16, "num_key_value_heads": 1}}),
    "llava_next_video": ("LlavaNextVideo", {"text_config": {"model_type": "llama"}, "vision_config": _CLIP}),
    # The rest in the image-text classes transformers maps them to, each beside its own default tower shrunk.
    **{kind: ("", {"text_config": text, "vision_config": "shrunk", "audio_config": "shrunk"}) for kind, text in (
        ("glm46v", {**_GLM4, "rope_parameters": _GLM_HALF_MROPE}),
        ("deepseek_vl", {"model_type": "llama"}),
        ("deepseek_vl_hybrid", {"model_type": "llama"}),
        ("janus", {"model_type": "llama"}),
        ("hyperclovax_vision_v2", {"model_type": "hyperclovax"}),
        ("lfm3_vl", {"model_type": "lfm3", **HYBRIDS["lfm3"][1]}),
        ("lighton_ocr", {"model_type": "qwen3", "head_dim": 16}),
        ("llava_onevision1_5", {"model_type": "qwen3", "head_dim": 16}),
        ("minicpmv4_6", {"model_type": "qwen3_5_text", **HYBRIDS["qwen3.5"][1]}),
        ("minicpmv4_7", {"model_type": "qwen3_5_text", **HYBRIDS["qwen3.5"][1]}),
        ("minicpm_ocr", {"model_type": "qwen3_5_text", **HYBRIDS["qwen3.5"][1]}),
        ("ovis2", _QWEN2),
        ("ovis2_5", {"model_type": "qwen3", "head_dim": 16}),
        ("video_llama_3", _QWEN2),
        ("video_llava", {"model_type": "llama"}),
        ("vipllava", {"model_type": "llama"}),
        ("qwen2_5_omni_thinker", {"head_dim": 16, "rope_parameters": _MROPE}),
        ("qwen3_omni_moe_thinker", {**_QWEN3_MOE, "rope_parameters": _INTERLEAVED_MROPE}),
    )},
    "mllama": ("Mllama", {"text_config": {"num_hidden_layers": 6, "cross_attention_layers": [1, 4], "pad_token_id": 0},
                          "vision_config": _MLLAMA_VISION}),
}  # fmt: skip


def _multimodal(kind: str) -> Any:
    """A tiny random `kind` model as transformers builds it, its text model (and LM head) drawn as the family tests
    draw theirs."""
    config, model_class = _multimodal_config(kind)
    torch.manual_seed(0)
    model = model_class(config).eval()
    _draw_text_model(model, ("vision", "visual", "multi_modal_projector", "connector", "audio", "image_newline"))
    return model


def _multimodal_config(kind: str, **text: Any) -> tuple[Any, Any]:
    """A tiny `kind`'s config (`text`: its text config's keys beside the tests' shape) and transformers' class."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    stem, keys = WRAPPERS[kind]
    base = kind.partition("-")[0]
    config_name = f"{stem}Config" if stem else CONFIG_MAPPING_NAMES[base]
    model_name = f"{stem}ForConditionalGeneration" if stem else MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[base]
    text = {**_SHAPE, **keys["text_config"], **text}
    config_class = getattr(transformers, config_name)
    shrunk = {}
    for part, sub in config_class().to_dict().items():  # a tower of the class's own kind, at the tests' width
        if part.endswith("_config") and part != "text_config" and isinstance(sub, dict) and keys.get(part) == "shrunk":
            shrunk[part] = {**sub, **{key: value for key, value in _SHRUNK.items() if key in sub}}
            if sub.get("layer_types"):  # (a tower's kinds of layer, one a layer)
                shrunk[part]["layer_types"] = sub["layer_types"][:1]
    config = config_class(**{**keys, **shrunk, "text_config": text})
    return config, getattr(transformers, model_name)


def _draw_text_model(model: Any, towers: tuple[str, ...]) -> None:
    """`model`'s matrices but its towers' (names with one of `towers` in them) drawn as the family tests draw a text
    model's: N(0, 0.08), routers N(0, 0.3)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1 and not any(part in name for part in towers):
                parameter.normal_(0.0, 0.3 if name.endswith(("mlp.gate.weight", "router.weight")) else 0.08)


def _saved(model: Any, folder: Path) -> None:
    model.save_pretrained(folder)
    copy_tokenizer(folder)


def assert_serves_like(reference: Any, folder: Path, **overrides: Any) -> GreedyReference:
    """The engine on `folder` (a multimodal checkpoint) gives `reference`'s greedy tokens for the first four prompts,
    batched (each of `reference`'s decoded alone); returns those (`GreedyReference`, computed)."""
    batch = prompts()[:4]
    theirs = GreedyReference(reference, batch, NUM_TOKENS)
    with engine(folder, **overrides) as llm:
        assert llm.core.model_config.multimodal is not None
        ours = tokens(llm, batch)
        assert ours == theirs.of(ours)
    return theirs


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
def test_a_multimodal_checkpoint_serves_its_text_model(kind: str, tmp_path: Path) -> None:
    """Each multimodal checkpoint as transformers saves it: the engine's greedy tokens on text prompts, batched,
    equal transformers' multimodal model's, each prompt decoded alone."""
    model = _multimodal(kind)
    _saved(model, tmp_path)
    assert_serves_like(model, tmp_path)


# The omni checkpoints, by their thinker's kind: the thinker's names under `thinker.`, a speech talker beside it.
OMNI = {"qwen2_5_omni": "qwen2_5_omni_thinker", "qwen3_omni_moe": "qwen3_omni_moe_thinker"}


def test_every_multimodal_kind_is_tested() -> None:
    """Every multimodal kind served has its case above (an omni checkpoint its thinker's, Phi-4-multimodal its own
    below)."""
    assert {kind.partition("-")[0] for kind in WRAPPERS} | set(OMNI) | {"phi4_multimodal"} == MULTIMODAL_ARCHITECTURES


def test_the_lm_head_is_tied_exactly_where_transformers_ties_it() -> None:
    """A text config that ties its head (`tie_word_embeddings`) ties the engine's only where transformers' multimodal
    class ties weights at all: Qwen2-Audio's, Audio Flamingo 3's, Voxtral's and Llama 3.2 Vision's tie none, so their
    checkpoints' own heads are read."""
    from engine_server.hf_multimodal import multimodal_text_config

    for kind in WRAPPERS:
        cfg, model_class = _multimodal_config(kind, tie_word_embeddings=True)
        expected = bool(model_class._tied_weights_keys) and getattr(cfg, "tie_word_embeddings", None) is not False
        served, _ = multimodal_text_config(cfg.to_dict())
        assert served["tie_word_embeddings"] == expected, kind


@pytest.mark.parametrize("kind", sorted(OMNI))
def test_an_omni_checkpoint_serves_its_thinkers_text_model(kind: str, tmp_path: Path) -> None:
    """Qwen2.5-Omni's and Qwen3-Omni's checkpoints hold a thinker (a multimodal model that reads and writes text,
    under `thinker.`, in the names it was released with: `thinker.model.layers.`, `thinker.visual.`,
    `thinker.audio_tower.`) beside a speech talker and a vocoder, which are not read: the engine's tokens on text
    prompts equal the thinker's own."""
    from safetensors.torch import load_file, save_file

    thinker = _multimodal(OMNI[kind])
    _saved(thinker, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    released = {"thinker." + name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
                .replace("model.audio_tower.", "audio_tower."): tensor for name, tensor in state.items()}
    released["talker.codec_head.weight"] = torch.zeros(8, 4)
    released["code2wav.code_embedding.weight"] = torch.zeros(8, 4)
    save_file(released, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    composite = {"model_type": kind, "architectures": [], "thinker_config": config}
    (tmp_path / "config.json").write_text(json.dumps(composite))
    assert_serves_like(thinker, tmp_path)


# The names each kind's checkpoints were released under, from transformers 5's (which it reads both of).
RELEASED_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "gemma3": (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector.")),
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
    "llava": (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
              ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")),
    "mllama": (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
               ("model.vision_model.", "vision_model."), ("model.multi_modal_projector.", "multi_modal_projector.")),
    "qwen3_vl_moe": (),  # its banks hidden-first (below)
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(RELEASED_NAMES))
def test_a_multimodal_checkpoint_in_its_released_layout_serves_its_text_model(kind: str, tmp_path: Path) -> None:
    """A checkpoint under the names it was released with (`RELEASED_NAMES`; Qwen3-VL-MoE's expert banks stored
    hidden-first, `[E, H, 2 * I]` and `[E, I, H]`) serves the tokens transformers' own model gives for the same
    weights, and transformers reads that checkpoint as the same model (so the layout is the one it accepts)."""
    from safetensors.torch import load_file, save_file

    model = _multimodal(kind)
    _saved(model, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    released = {}
    for name, tensor in state.items():
        for ours, theirs in RELEASED_NAMES[kind]:
            if name.startswith(ours):
                name = theirs + name.removeprefix(ours)
                break
        if kind == "qwen3_vl_moe" and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            tensor = tensor.transpose(1, 2).contiguous()
        released[name] = tensor
    save_file(released, tmp_path / "model.safetensors", metadata={"format": "pt"})
    theirs = assert_serves_like(model, tmp_path)
    reread = type(model).from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert GreedyReference(reread, theirs.prompts, NUM_TOKENS).of() == theirs.of()


# Released configs, as published: Gemma 3 4B's (its text model's shape, the rest Gemma3TextConfig's defaults; the
# end-of-turn token at the top level), Qwen2.5-VL 3B's (flat: its text model's keys at the top level, its embeddings
# tied there) and Llama 3.2 11B Vision's (8 cross-attention layers among 40).
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}  # fmt: skip
QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}  # fmt: skip
LLAMA_3_2_11B_VISION = {
    "architectures": ["MllamaForConditionalGeneration"], "image_token_index": 128256, "model_type": "mllama",
    "text_config": {"model_type": "mllama_text_model", "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
                    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                    "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                    "rope_theta": 500000.0, "vocab_size": 128256, "eos_token_id": [128001, 128008, 128009],
                    "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "vision_config": {"model_type": "mllama_vision_model", "hidden_size": 1280, "image_size": 560,
                      "num_hidden_layers": 32, "num_global_layers": 8, "patch_size": 14,
                      "intermediate_layers_indices": [3, 7, 15, 23, 30], "vision_output_dim": 7680},
}  # fmt: skip


def test_released_multimodal_configs_read_as_transformers_builds_their_text_models() -> None:
    """Gemma 3 4B's, Qwen2.5-VL 3B's and Llama 3.2 11B Vision's released configs: their text models' shapes as
    transformers builds them (the defaults a released config leaves out included), their end tokens, their ties."""
    gemma = model_config_from_hf(GEMMA3_4B)
    assert gemma.architecture == "gemma3" and (gemma.num_attention_heads, gemma.num_key_value_heads) == (8, 4)
    assert gemma.head_dim == 256
    assert (gemma.vocab_size, gemma.num_hidden_layers, gemma.tie_word_embeddings) == (262208, 34, True)
    assert gemma.layer_windows == ((1024,) * 5 + (0,)) * 5 + (1024,) * 4
    assert (gemma.rope_theta, gemma.local_rope_theta, gemma.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert gemma.attention_scale == 256**-0.5 and gemma.eos_token_ids == (1, 106)
    assert gemma.multimodal is not None and gemma.multimodal.model_type == "gemma3"
    qwen = model_config_from_hf(QWEN2_5_VL_3B)
    assert qwen.architecture == "qwen2" and (qwen.hidden_size, qwen.num_hidden_layers) == (2048, 36)
    assert qwen.num_key_value_heads == 2
    assert qwen.tie_word_embeddings and qwen.attention_bias and qwen.layer_windows == ()
    assert (qwen.rope_theta, qwen.eos_token_ids, qwen.vocab_size) == (1e6, (151645,), 151936)
    llama = model_config_from_hf(LLAMA_3_2_11B_VISION)
    assert llama.architecture == "llama" and llama.num_hidden_layers == 32
    assert (llama.vocab_size, llama.output_vocab_size) == (128264, 128256)
    assert llama.multimodal is not None and llama.multimodal.dropped_layers == (3, 8, 13, 18, 23, 28, 33, 38)
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 8.0
    assert llama.eos_token_ids == (128001, 128008, 128009) and not llama.tie_word_embeddings


def test_multimodal_checkpoints_not_served_are_refused_by_name() -> None:
    """PaliGemma (a prefix LM: its prompt attends both ways) and Florence-2 (an encoder-decoder) say why."""
    with pytest.raises(ValueError, match="PaliGemma attends both ways over its whole prompt"):
        model_config_from_hf({"model_type": "paligemma"})
    with pytest.raises(ValueError, match="Florence-2 is an encoder-decoder model"):
        model_config_from_hf({"model_type": "florence2"})


@pytest.mark.parametrize("kind", ["mllama", "qwen3_vl_moe"])
def test_a_multimodal_checkpoint_over_two_ranks_serves_its_text_model(kind: str, tmp_path: Path) -> None:
    """Under tensor parallelism each rank reads its part of the text model from the multimodal checkpoint (Llama
    3.2 Vision's layers numbered on past its cross-attention ones, Qwen3-VL-MoE's experts split)."""
    model = _multimodal(kind)
    _saved(model, tmp_path)
    assert_serves_like(model, tmp_path, tensor_parallel_size=2)


@pytest.mark.parametrize("released", [False, True], ids=["transformers", "released"])
def test_phi4_multimodal_serves_its_text_model_without_its_adapters(released: bool, tmp_path: Path) -> None:
    """Phi-4-multimodal's config is flat (Phi-4-mini's text keys at the top level: LongRoPE over part of each head)
    beside its vision and speech towers (`model.embed_tokens_extend.`); as released, each adapted projection is a
    LoRA-wrapped layer (`<proj>.base_layer.weight` beside `<proj>.lora_A.vision.weight` ...), the adapters applied
    to images and speech alone. Its text output equals transformers' model's (whose checkpoint holds the base
    layers alone): here the released form's adapters are random, and would move every token if read."""
    import transformers
    from safetensors.torch import load_file, save_file

    from tests.families import FAMILIES

    quirks = {**FAMILIES["phi3-longrope"][1], "partial_rotary_factor": 0.75}
    defaults = transformers.Phi4MultimodalConfig().to_dict()
    towers = {part: {**defaults[part], **{key: value for key, value in _SHRUNK.items() if key in defaults[part]}}
              for part in ("vision_config", "audio_config")}  # fmt: skip
    towers["audio_config"].update(num_blocks=1, attention_dim=32, attention_heads=2, linear_units=64,
                                  nemo_conv_channels=32)  # fmt: skip
    config = transformers.Phi4MultimodalConfig(**{**_SHAPE, **quirks, **towers})
    torch.manual_seed(0)
    model = transformers.Phi4MultimodalForCausalLM(config).eval()
    _draw_text_model(model, ("embed_tokens_extend",))
    _saved(model, tmp_path)
    if released:
        state = load_file(tmp_path / "model.safetensors")
        wrapped = {}
        for name, tensor in state.items():
            if name.startswith("model.layers.") and name.endswith(("_proj.weight", "qkv_proj.weight")):
                stem = name.removesuffix(".weight")
                wrapped[f"{stem}.base_layer.weight"] = tensor
                for modality in ("vision", "speech"):
                    wrapped[f"{stem}.lora_A.{modality}.weight"] = torch.randn(4, tensor.shape[1])
                    wrapped[f"{stem}.lora_B.{modality}.weight"] = torch.randn(tensor.shape[0], 4)
            else:
                wrapped[name] = tensor
        save_file(wrapped, tmp_path / "model.safetensors", metadata={"format": "pt"})
    read = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert read.architecture == "phi3" and read.partial_rotary_factor == 0.75
    assert_serves_like(model, tmp_path)
