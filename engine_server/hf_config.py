"""How a Hugging Face `config.json` becomes a `ModelConfig` (`model_config_from_hf`): which family serves each
`model_type` (`_HF_ARCHITECTURES`), and each family's quirks read into the config's fields, or refused by name."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine_server.config import (
    NEMOTRON_BLOCKS,
    Architecture,
    FalconH1Scales,
    Gemma4Assistant,
    Gemma4Layout,
    HyperConnections,
    LatentAttention,
    LinearAttention,
    LongRope,
    Mamba1,
    Mamba2,
    ModelConfig,
    RopeScaling,
    ShortConvolution,
    SparseIndexer,
    Yarn,
    nemotron_blocks,
)
from engine_server.hf_beam import BEAM_ARCHITECTURES, beam_config, beam_fields
from engine_server.hf_bitnet import BITNET_ARCHITECTURES, bitnet_config, bitnet_fields
from engine_server.hf_classic import CLASSIC_ARCHITECTURES, classic_config, classic_fields, json_float
from engine_server.hf_dbrx import DBRX_ARCHITECTURES, dbrx_config, dbrx_fields
from engine_server.hf_deepseek_v4 import DEEPSEEK_V4_ARCHITECTURES, deepseek_v4_model_config
from engine_server.hf_dory import DORY_ARCHITECTURES, dory_config, dory_fields
from engine_server.hf_ergo import ERGO_ARCHITECTURES, ergo_config, ergo_fields
from engine_server.hf_gemma3n import gemma3n_config, gemma3n_fields
from engine_server.hf_glm4_moe_kin import GLM4_MOE_KIN, glm4_moe_kin_config, glm4_moe_kin_fields
from engine_server.hf_jetmoe import JETMOE_ARCHITECTURES, jetmoe_config, jetmoe_fields
from engine_server.hf_kolibri1_1 import kolibri1_1_config, kolibri1_1_fields
from engine_server.hf_longcat import LONGCAT_ARCHITECTURES, longcat_config, longcat_fields
from engine_server.hf_mamba import MAMBA_ARCHITECTURES, mamba_config, mamba_fields
from engine_server.hf_minimax import MINIMAX_ARCHITECTURES, minimax_config, minimax_fields
from engine_server.hf_minimax_m3 import MINIMAX_M3_ARCHITECTURES, minimax_m3_config, minimax_m3_fields
from engine_server.hf_multimodal import (
    MULTIMODAL_ARCHITECTURES,
    MULTIMODAL_NOT_SERVED,
    mistral3_checkpoint,
    multimodal_text_config,
)
from engine_server.hf_qwen4_exp import QWEN4_EXP_ARCHITECTURES, qwen4_exp_config, qwen4_exp_fields
from engine_server.hf_recurrent_gemma import (
    RECURRENT_GEMMA_ARCHITECTURES,
    recurrent_gemma_config,
    recurrent_gemma_fields,
)
from engine_server.hf_rwkv import RWKV_ARCHITECTURES, rwkv_config, rwkv_fields
from engine_server.hf_whisper import WHISPER_ARCHITECTURES, whisper_text_config
from engine_server.hf_xlstm import XLSTM_ARCHITECTURES, xlstm_config, xlstm_fields
from engine_server.hf_zamba2 import ZAMBA2_ARCHITECTURES, zamba2_config, zamba2_fields

# Each served `model_type` and the family (`ModelConfig.architecture`) that serves it.
_HF_ARCHITECTURES: dict[str, Architecture] = {
    "llama": "llama",
    "diffllama": "llama",  # DiffLlama: Llama with differential attention (`layers.differential_attention`)
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
    # JetBrains' Mellum: Qwen3-MoE's attention and experts, windows and a rope base per layer type (`layer_types`,
    # `rope_parameters`), dense or sparse MLPs as `mlp_layer_types` says; its multi-token-prediction layer not read.
    "mellum": "qwen3_moe",
    "olmoe": "olmoe",
    "flex_olmo": "olmoe",  # FlexOlmo: OLMoE's experts and q/k norms under OLMo 2's post-norm block
    "gpt_oss": "gpt_oss",
    "smollm3": "smollm3",
    "granite": "granite",
    # HyperCLOVA X SEED (Naver): Granite's multipliers (its logits multiplied by `logits_scaling`, not divided) and
    # a norm after each sub-layer's output too, Gemma 2's sandwich (`_granite_fields`, `models.granite`)
    "hyperclovax": "granite",
    # Granite 3.0's mixtures of experts, with a shared MLP (granitemoeshared), and Granite 4.0: Mamba-2 layers and
    # attention ones (no rope in the H models), each with experts beside a shared MLP or the shared MLP alone.
    "granitemoe": "granitemoe",
    "granitemoeshared": "granitemoe",
    "granitemoehybrid": "granitemoe",
    # Granite SWA: Granite with windows on the layers `layer_types` names, per-head attention sinks and a rope base per
    # layer (0: no rope; `_granite_swa_theta`); Granite-MoE SWA, the same attention over Granite's experts.
    "granite_swa": "granite",
    "granitemoe_swa": "granitemoe",
    "bamba": "granitemoe",  # Bamba: Granite 4.0's hybrid layout without its multipliers (`_bamba_config`)
    "falcon_h1": "falcon_h1",
    "olmo2": "olmo2",
    "olmo3": "olmo2",
    # AI2's OLMo Hybrid: Gated DeltaNet layers (its own projections, the write strength doubled) in pre-norm blocks
    # between OLMo 3's post-norm attention layers (`_hybrid_fields`, `models.olmo_hybrid`).
    "olmo_hybrid": "olmo_hybrid",
    "exaone4": "olmo2",  # EXAONE 4.0: OLMo 2's post-norm block with per-head q/k norms, NoPE on its global layers
    "exaone4_5": "olmo2",  # EXAONE 4.5: EXAONE 4.0's text model beside a vision tower (`_exaone4_5_text`)
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",  # Kimi K2.5 / K2.6: Kimi K2's text model beside a vision tower (`_kimi_k25_text`)
    # Kimi Linear: DeepSeek-V3's latent attention without rope on one layer in four, Kimi Delta Attention on the rest
    # (`_kimi_linear_config`, `_kimi_linear_fields`)
    "kimi_linear": "deepseek_v3",
    # Ling 3 (inclusionAI's Ling-3.0): Kimi Delta Attention with whole decay and gate projections and a bounded decay
    # on five layers in six, DeepSeek-V3's latent attention with a gate per head on the sixth, its experts
    # (`_bailing_hybrid_config`)
    "bailing_hybrid": "deepseek_v3",
    # Tencent's HY-V4: DeepSeek-V3.2's indexed latent attention with a sigmoid gate per value dim and a sink per head,
    # layers sharing an indexer's choice, experts with a clamped SwiGLU, four residual streams (`_hy_v4_config`)
    "hy_v4": "deepseek_v3",
    "hy_v4_vl": "deepseek_v3",  # Hy4: HY-V4's text model beside a vision tower
    "youtu": "deepseek_v3",  # Tencent's Youtu-LLM: DeepSeek-V3's latent attention over dense Llama MLPs
    # MiniCPM3: that attention (rope over halves, not interleaved pairs) over dense MLPs, with muP's scales
    # (`_minicpm3_fields`).
    "minicpm3": "deepseek_v3",
    "mistral4": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
    "glm4_moe_lite": "deepseek_v3",  # GLM-4.7-Flash: DeepSeek-V3's latent attention and experts
    # SK Telecom's A.X K1: DeepSeek-V3's with an RMSNorm over each sparse layer's MoE output (`moe_output_norm`).
    "axk1": "deepseek_v3",
    # SK Telecom's A.X K2: DeepSeek-V3.2's indexed latent attention, its queries and a sigmoid gate per value dim
    # from the query latent beside its norm, gated norms (`_axk2_fields`); its routing over all experts by default.
    "axk2": "deepseek_v3",
    # DeepSeek-V3.2 and GLM-5: that latent attention over the positions a lightning indexer picks (`_sparse_indexer`).
    "deepseek_v32": "deepseek_v3",
    "glm_moe_dsa": "deepseek_v3",
    "glm4_moe": "glm4_moe",
    # Upstage's Solar Open: GLM-4.5's experts on every layer under Llama's attention (rope over each whole head).
    "solar_open": "glm4_moe",
    # LG's K-EXAONE: GLM-4.5's layout under EXAONE 4's attention (per-head q/k norms, windows on 3 layers in 4, no rope
    # on the global ones), a pre-norm block.
    "exaone_moe": "glm4_moe",
    # Kolibri-1 (Aleph Alpha): K-EXAONE's attention (per-head q/k norms, windows, NoPE on the full layers) in GLM-4's
    # sandwich, experts beside a shared one chosen by their logits plus a bias (`moe_choice_on_logits`)
    "kolibri1": "glm4_moe",
    "kolibri1_1": "glm4_moe",  # Kolibri-1's with indexed attention layers (`hf_kolibri1_1`)
    # Flint (RecursiveSI): Qwen3-MoE's attention with gpt-oss's sinks, windows and NoPE on the full layers; experts by
    # sigmoid score (no bias) beside an ungated shared one, the first layers dense (`_flint_config`)
    "flint": "glm4_moe",
    # Tencent's Hy3: GLM-4.5's layout under Apertus's attention (per-head q/k norms, rope over whole heads).
    "hy_v3": "glm4_moe",
    # rednote's dots.llm1: GLM-4.5's layout under Qwen3's attention (per-head q/k norms, rope over whole heads, o_proj
    # biased with q/k/v), DeepSeek-V3's router renormalising only when `norm_topk_prob` says, no dense layer by default.
    "dots1": "glm4_moe",
    # Poolside's Laguna: GLM-4.5's layout (DeepSeek-V3's sigmoid router in one group beside a shared expert, a dense
    # first layer) under attention with per-head q/k norms, windows and a rope base and share per layer type, and each
    # head's output gated by a softplus (`_laguna_fields`).
    "laguna": "glm4_moe",
    # Sarvam's 30B (GLM-4.5's model, rope over whole heads, q/k norms on by default) and 105B (DeepSeek-V3's); their
    # released configs' own names read too (`num_experts`, `num_shared_experts`, `use_qkv_bias`, "deepseek_yarn").
    "sarvam_moe": "glm4_moe",
    "sarvam_mla": "deepseek_v3",
    "glm4": "glm4",
    # GLM-4-9B (its transformers port, `glm`): GLM-4's attention and fused MLP in a plain pre-norm block
    "glm": "glm4",
    "minimax_m2": "minimax_m2",
    # Karpathy's NanoChat: Llama's block with RMSNorms without weights (the embeddings' too), q/k norms after a rope
    # turned the other way, an ungated relu² MLP and soft-capped logits (`models.nanochat`, `_nanochat_fields`).
    "nanochat": "nanochat",
    "arcee": "llama",  # Arcee AFM: Llama's block with an ungated relu² MLP (`_ungated_mlp_fields`)
    # Arcee's Trinity (AFMoE): gated attention with q/k norms, rope on its windowed layers alone, sandwich norms,
    # DeepSeek-V3's sigmoid routing in one group beside shared experts (`_afmoe_fields`).
    "afmoe": "afmoe",
    "jamba": "jamba",  # Jamba: Mamba-1 layers, attention without rope every few, experts every other layer
    # MiMo-V2-Flash: GLM-4.5's experts (no shared ones) under windowed attention with sinks and twice the KV heads,
    # full attention with its own rope base, values narrower than keys (`_mimo_v2_flash_config`, `_mimo_fields`).
    "mimo_v2_flash": "glm4_moe",
    "apertus": "apertus",  # Apertus: Qwen3's per-head q/k norms, an ungated MLP with xIELU learned per layer
    # Apertus 1.5: Apertus's text model over a vocabulary with image and audio codes, its LM head pruned to the text
    # rows (`output_vocab_size`); the multimodal checkpoint's text model (`text_config`), its tokenizers' towers unread
    "apertus1p5_text": "apertus",
    "apertus1p5": "apertus",
    # Hunyuan (0.5B-7B dense; Hunyuan-A13B): Llama's block with per-head q/k norms after rope, rope's base stretched
    # by NTK's alpha; the MoE's experts (Mixtral's routing) beside an ungated shared MLP.
    "hunyuan_v1_dense": "hunyuan",
    "hunyuan_v1_moe": "hunyuan",
    "seed_oss": "llama",  # Seed-OSS: Llama with q/k/v biases and o_proj's apart (`attention_out_bias`)
    "ernie4_5": "ernie4_5",
    "ernie4_5_moe": "ernie4_5_moe",
    "cohere": "cohere",  # Command R / R+: the attention and the MLP in parallel off one LayerNorm
    "cohere2": "cohere",  # Command R7B, Command A: that block, 3:1 windowed layers and global ones without rope
    "cohere2_moe": "cohere",  # Command A+: Command A's block and layers over experts (`_cohere2_moe_config`)
    # Cohere Compass (North): Command A's block with rope over halves, a rope (or none) per layer type; a multimodal
    # checkpoint's text model (its vision tower not read)
    "cohere_compass_text": "cohere",
    "cohere_compass": "cohere",
    "lfm2": "lfm2",  # LFM2: gated short convolutions (a state per sequence) between grouped-query attention layers
    "lfm2_moe": "lfm2",  # LFM2-MoE: those layers, experts after its first dense ones (DeepSeek-V3's router, one group)
    # LFM3: LFM2's layers in Gemma's sandwich, windowed attention layers too, each head's output gated (`_lfm3_fields`)
    "lfm3": "lfm2",
    # NVIDIA's Nemotron-H, Nemotron Nano 2 and Nemotron 3: one sublayer per block (Mamba-2, attention without rope, an
    # ungated relu² MLP or relu² experts), read as pre-norm layers of a mixer and the MLP after it (`nemotron_blocks`).
    "nemotron_h": "nemotron_h",
    "qwen3_next": "qwen3_next",
    # Lara Mini (Translated): Qwen3.5's Gated DeltaNet between Qwen3's attention layers (windowed with rope, or full
    # without), plain norms, no output gate; softmax-routed experts beside an ungated shared one
    "lara_mini": "qwen3_next",
    "qwen3_5_text": "qwen3_next",
    "qwen3_5_moe_text": "qwen3_next",
    "qwen3_5": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "vaultgemma": "gemma2",  # VaultGemma: Gemma 2 without the norms after the attention and the MLP (`models.gemma2`)
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    # Gemma 4 Unified (Gemma 4 12B): Gemma 4's text model without per-layer inputs or experts, its text tokens causal;
    # a multimodal `gemma4_unified` checkpoint's text model.
    "gemma4_unified_text": "gemma4",
    "gemma4_unified": "gemma4",
    # Gemma 3n (E2B, E4B): Gemma 4's layers under AltUp's streams, LAuReL and sparse MLPs (`hf_gemma3n`); a
    # multimodal `gemma3n` checkpoint's text model.
    "gemma3n_text": "gemma3n",
    "gemma3n": "gemma3n",
    "llama4_text": "llama4",
    "llama4": "llama4",
    "bert": "bert",
    **CLASSIC_ARCHITECTURES,  # GPT-NeoX, Phi, StableLM, StarCoder2, Nemotron, OLMo, EXAONE 3 (`hf_classic`)
    **MAMBA_ARCHITECTURES,  # Mamba, Falcon Mamba, Mamba-2: state space models alone (`hf_mamba`)
    # MiniMax-01 (Text-01, M1): lightning attention between softmax attention layers, Mixtral's experts, its blocks'
    # residuals normalised and scaled (`hf_minimax`)
    **MINIMAX_ARCHITECTURES,
    # MiniMax-M3: Gemma-normed grouped-query attention, block-sparse on some layers, over clamped-SwiGLU experts
    # beside a shared one or dense MLPs (`hf_minimax_m3`); a multimodal checkpoint's text model
    **MINIMAX_M3_ARCHITECTURES,
    # Qwen4-Exp: Qwen3.5-MoE's hybrid over hyper-connected streams, QSA attention, n-gram embeddings (`hf_qwen4_exp`)
    **QWEN4_EXP_ARCHITECTURES,
    # xLSTM: mLSTM layers (a matrix memory per head and sequence) before SwiGLU MLPs, no attention (`hf_xlstm`)
    **XLSTM_ARCHITECTURES,
    # RWKV-4: time mixes (a WKV recurrence) and channel mixes over a state per sequence, no attention (`hf_rwkv`)
    **RWKV_ARCHITECTURES,
    # Beam: sandwich norms with depth-scaled residual adds, gated heads, windowed rope layers and NoPE full ones whose
    # queries scale by position, DeepSeek-V3's grouped routing (`hf_beam`)
    **BEAM_ARCHITECTURES,
    # Ergo: sandwich norms with gated residual adds, windowed rope layers and NoPE full ones, relu² experts each
    # normalised beside a normalised shared one (`hf_ergo`)
    **ERGO_ARCHITECTURES,
    # Dory: nGPT blocks on the unit sphere, a middle section of its layers run several times (`hf_dory`)
    **DORY_ARCHITECTURES,
    # Zamba2: Mamba-2 layers, shared attention + MLP blocks over the state and the embeddings before some, each use
    # with adapters of its own (`hf_zamba2`)
    **ZAMBA2_ARCHITECTURES,
    # RecurrentGemma (Griffin): Griffin's recurrent blocks between local multi-query attention layers, Gemma's norms,
    # embedding scale and GeGLU (`hf_recurrent_gemma`)
    **RECURRENT_GEMMA_ARCHITECTURES,
    # JetMoE: mixtures of attention experts and of MLP experts (`hf_jetmoe`)
    **JETMOE_ARCHITECTURES,
    # BitNet b1.58: Llama with norms before o_proj and down_proj, gated relu², ternary projections (`hf_bitnet`)
    **BITNET_ARCHITECTURES,
    **LONGCAT_ARCHITECTURES,  # LongCat-Flash: latent attention blocks in pairs beside shortcut experts (`hf_longcat`)
    **DEEPSEEK_V4_ARCHITECTURES,  # DeepSeek-V4: compressed attention, mHC streams, hash routing (`hf_deepseek_v4`)
    **DBRX_ARCHITECTURES,  # DBRX: Mixtral's shape with LayerNorms and clamped q/k/v, its config nested (`hf_dbrx`)
    **GLM4_MOE_KIN,  # Param2, MiniCPM5-MoE: GLM-4.5's layout, their configs read first (`hf_glm4_moe_kin`)
}
# Gemma 4's assistants: drafters for a Gemma 4 target (speculative decoding), read by `_gemma4_assistant_config`.
_ASSISTANTS = ("gemma4_assistant", "gemma4_unified_assistant")
# Families people ask for that this engine does not serve yet, and what it lacks for them: the refusal says so.
_NOT_YET: dict[str, str] = {**MULTIMODAL_NOT_SERVED}
# Families whose attention RMS-normalises q and k (each head, or OLMoE's and OLMo 2's whole projection) before rope.
_QK_NORM_FAMILIES: tuple[Architecture, ...] = (
    "qwen3", "qwen3_moe", "gemma3", "olmoe", "olmo2", "qwen3_next", "gemma4", "gemma3n", "minimax_m2", "lfm2",
    "hunyuan", "apertus", "afmoe", "nanochat", "olmo_hybrid", "minimax_m3",
    "beam", "ergo", "qwen4_exp",
)  # fmt: skip
# The classic families whose q/k/v a config may clamp (`clip_qkv`; OLMoE's and DBRX's are their architectures').
_CLIPS_QKV = ("olmo", "mpt")
# Hugging Face activation names of an encoder's MLP, by whether they are the tanh approximation of GELU.
ENCODER_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def model_config_from_hf(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """The `ModelConfig` of a Hugging Face `config.json` dict (transformers 4.x or 5.x layout), named `name`;
    ValueError naming what is not served."""
    model_type = cfg.get("model_type", "llama")
    if model_type in WHISPER_ARCHITECTURES:  # its decoder, read as BioGPT's block (`hf_whisper`), served as Whisper's
        text, checkpoint = whisper_text_config(cfg)
        return dataclasses.replace(model_config_from_hf(text, name), architecture="whisper", multimodal=checkpoint)
    if model_type in MULTIMODAL_ARCHITECTURES:  # its text model, read as its family's own (`hf_multimodal`)
        text, checkpoint = multimodal_text_config(cfg)
        if text.get("model_type") in MULTIMODAL_ARCHITECTURES:
            raise ValueError(f"{model_type} text_config model_type {text['model_type']!r} is not a text model")
        return dataclasses.replace(model_config_from_hf(text, name), multimodal=checkpoint)
    if model_type not in _HF_ARCHITECTURES and model_type not in _ASSISTANTS:
        why = _NOT_YET.get(model_type, "no family of this engine implements it")
        raise ValueError(
            f"unsupported model_type {model_type!r} ({why}); supported: "
            f"{', '.join(sorted({*_HF_ARCHITECTURES, *MULTIMODAL_ARCHITECTURES, *WHISPER_ARCHITECTURES}))}"
        )
    if model_type == "bert":
        return _encoder_config(cfg, name)
    if model_type in _ASSISTANTS:  # a drafter for a Gemma 4 target (`speculative.gemma4_assistant`)
        return _gemma4_assistant_config(cfg, name)
    if model_type in DEEPSEEK_V4_ARCHITECTURES:  # its own attention, streams and routing (`hf_deepseek_v4`)
        return deepseek_v4_model_config(cfg, name, lambda rope: _yarn(cfg, rope))
    _refuse_unbuilt(model_type, cfg)
    multimodal = mistral3_checkpoint(cfg) if model_type == "mistral3" else None  # (where its images are served)
    kolibri = kolibri1_1_fields(cfg) if model_type == "kolibri1_1" else {}
    if model_type == "kolibri1_1":  # read as Kolibri-1, its indexed layers full ones
        cfg, model_type = kolibri1_1_config(cfg), "kolibri1"
    if model_type in ("qwen3_5", "qwen3_5_moe", "gemma4", "gemma4_unified", "gemma3n", "llama4", "mistral3",
                      "exaone4_5", "apertus1p5", "cohere_compass", "hy_v4_vl"):  # fmt: skip
        cfg = _text_config(cfg)  # multimodal: its text model
    if model_type in ("gemma3n", "gemma3n_text"):
        cfg = gemma3n_config(cfg)
    if model_type == "cohere_compass":  # read as its text model's family
        model_type = "cohere_compass_text"
    if cfg.get("model_type") == "apertus1p5_text":  # Apertus's, its head pruned (`_output_vocab_size`)
        cfg, model_type = {**cfg, "model_type": "apertus"}, "apertus"
        _refuse_unbuilt(model_type, cfg)
    if model_type == "exaone4_5":
        cfg = _exaone4_5_text(cfg)
        model_type = cfg["model_type"]
    if model_type == "mistral3":  # read as its text model's own family
        model_type = _mistral3_text_type(cfg)
    if model_type == "kimi_k25":
        cfg = _kimi_k25_text(cfg)
        model_type = cfg["model_type"]
    if model_type == "kimi_linear":
        cfg = _kimi_linear_config(cfg)
    if model_type == "bailing_hybrid":
        cfg = _bailing_hybrid_config(cfg)
    if model_type in ("hy_v4", "hy_v4_vl"):
        cfg, model_type = _hy_v4_config(cfg, vision=model_type == "hy_v4_vl"), "hy_v4"
    if model_type == "flint":
        cfg = _flint_config(cfg)
    if model_type == "lfm3":
        cfg = _lfm3_config(cfg)
    if model_type in ("lfm2", "lfm2_moe", "lfm3"):
        cfg = _lfm2_config(cfg)
    if model_type == "bamba":
        cfg = _bamba_config(cfg)
    if model_type in _GRANITE_SWA_TYPES:
        cfg = _granite_swa_config(cfg)
    if model_type == "cohere2_moe":
        cfg = _cohere2_moe_config(cfg)
    if model_type == "mimo_v2_flash":
        cfg = _mimo_v2_flash_config(cfg)
    cfg = classic_config(model_type, cfg)
    cfg = mamba_config(model_type, cfg)
    cfg = dbrx_config(model_type, cfg)
    cfg = longcat_config(model_type, cfg)
    cfg = minimax_config(model_type, cfg)
    cfg = minimax_m3_config(model_type, cfg)
    cfg = qwen4_exp_config(model_type, cfg)
    cfg = xlstm_config(model_type, cfg)
    cfg = rwkv_config(model_type, cfg)
    cfg = beam_config(model_type, cfg)
    cfg = ergo_config(model_type, cfg)
    cfg = dory_config(model_type, cfg)
    cfg = zamba2_config(model_type, cfg)
    cfg = recurrent_gemma_config(model_type, cfg)
    cfg = jetmoe_config(model_type, cfg)
    cfg = bitnet_config(model_type, cfg)
    cfg = glm4_moe_kin_config(model_type, cfg)
    nemotron = _nemotron_h_fields(cfg) if model_type == "nemotron_h" else {}
    if nemotron:  # its blocks paired into layers: the rest reads the pairs' count (without MLP blocks, its
        # dense width is its experts', as a file of it states: the config's own is unused)
        width = cfg["intermediate_size" if "-" in nemotron["block_pattern"] else "moe_intermediate_size"]
        cfg = {**cfg, "num_hidden_layers": len(nemotron_blocks(nemotron["block_pattern"])),
               "rms_norm_eps": cfg.get("layer_norm_epsilon") or 1e-5,
               "head_dim": cfg.get("head_dim") or cfg.get("attention_head_dim"), "intermediate_size": width}
    arch = _HF_ARCHITECTURES[model_type]
    gemma = _gemma_fields(model_type, cfg) if arch in ("gemma", "gemma2", "gemma3") else {}
    if arch in ("gemma4", "gemma3n"):
        gemma = _gemma4_fields(cfg) | (gemma3n_fields(cfg) if arch == "gemma3n" else {})
    rope = {} if gemma else cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local_rope: dict[str, Any] = {}
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5's rope per layer type (OLMo 3)
        rope, local_rope = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        if (local_rope.get("rope_type") or "default") != "default":
            raise ValueError(f"sliding_attention rope type {local_rope['rope_type']!r} is not supported")
    rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    if model_type in _GRANITE_SWA_TYPES:
        rope_theta = _granite_swa_theta(model_type, cfg, rope_theta)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "deepseek_yarn":  # Sarvam's released name for YaRN
        rope_type = "yarn"
    rotated_angles = 0
    if rope_type == "proportional" and model_type == "lfm3":  # over the whole head, its first angles alone turning
        whole = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        rotated_angles, rope_type = int(float(rope.get("partial_rotary_factor") or 1.0) * whole // 2), "default"
        rope = {key: value for key, value in rope.items() if key != "partial_rotary_factor"}
    if arch == "hunyuan" and rope_type == "dynamic" and rope.get("alpha"):
        rope_theta, rope_type = _ntk_alpha_theta(cfg, rope_theta, float(rope["alpha"])), "default"
    elif rope_type == "dynamic":  # dynamic NTK (InternLM3's): as transformers computes it, rope's base grows with
        rope_type = "default"  # a sequence past max_position_embeddings alone, which the engine does not serve
    scaling: RopeScaling | LongRope | Yarn | None = None
    hybrid = _hybrid_fields(arch, cfg)
    if arch == "qwen4_exp":  # its hyper-connections, QSA and n-gram embeddings; its linear layers' states hold them
        hybrid = qwen4_exp_fields(cfg, hybrid)
    # Qwen3-Next's rope turns a quarter of each head by default, GLM-4's and GLM-4.5's half (Solar Open's,
    # K-EXAONE's and Hy3's, in GLM-4.5's layout, all of it)
    halved = arch in ("glm4", "glm4_moe") and model_type not in _WHOLE_ROPE_GLM4_MOE
    default_partial = 0.25 if arch == "qwen3_next" and model_type != "lara_mini" else 0.5 if halved else 1.0
    partial = float(
        cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or _rotary_fraction(cfg)
        or default_partial
    )  # fmt: skip
    local_partial = local_rope.get("partial_rotary_factor")
    if model_type == "laguna" and local_rope:  # its windowed layers' share is their own (whole heads by default)
        local_partial = float(local_partial or 1.0)
    elif local_partial is not None and float(local_partial) != partial:
        raise ValueError(f"sliding_attention partial_rotary_factor {local_partial} differs from the full layers' "
                         f"{partial} (not supported)")  # fmt: skip
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
    own_share = float(local_partial) if local_partial is not None and float(local_partial) != partial else 0.0
    if local_rope and (local_theta != rope_theta or scaling is not None or rope_fields or own_share):
        # The windowed layers' own rope: a base (and with Laguna a share of each head) of its own and no scaling
        # (`DecoderModel`'s local table).
        rope_fields = {**rope_fields, "local_rope_theta": local_theta}
        if own_share:
            rope_fields["local_partial_rotary_factor"] = own_share
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if arch in ("deepseek_v3", "longcat_flash"):  # latent attention: a cache row per token, its latent and rope key
        latent = _latent_attention_fields(cfg, rope, model_type)
        rope_fields = {**rope_fields, **latent}
        mla: LatentAttention = latent["latent_attention"]
        head_dim, kv_heads = mla.kv_lora_rank + mla.qk_rope_head_dim, 1
        indexer = _sparse_indexer(cfg, model_type, mla)
        if indexer is not None:  # each cache row also holds the token's index key (`layers.sparse_indexer`)
            rope_fields = {**rope_fields, "sparse_indexer": indexer}
            head_dim = max(head_dim, mla.kv_lora_rank + indexer.head_dim)
    else:
        rope_fields = {**rope_fields, **_query_scale_fields(model_type, rope)}
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    if gemma:
        rope_theta = gemma.pop("rope_theta")
    return ModelConfig(
        architecture=arch,
        multimodal=multimodal,
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
        attention_out_bias=bool(cfg.get("attention_out_bias"))
        if model_type in ("seed_oss", "stablelm", "gpt_neo", "recurrent_gemma")
        else bool(cfg.get("attention_bias")) if model_type in ("phimoe", "hy_v3", "dots1") else None,
        qk_norm=arch in _QK_NORM_FAMILIES
        or (arch == "glm4_moe" and (model_type in ("exaone_moe", "hy_v3", "dots1", "laguna", "kolibri1", "flint")
                                    or bool(cfg.get("use_qk_norm", model_type == "sarvam_moe")))),
        attention_sinks=arch == "gpt_oss" or model_type in (*_GRANITE_SWA_TYPES, "mimo_v2_flash", "flint", "hy_v4"),
        qk_norm_whole=arch in ("olmoe", "olmo2", "minimax_m2", "olmo_hybrid") and model_type != "exaone4",
        qk_norm_after_rope=arch in ("hunyuan", "nanochat"),
        post_norms=arch in ("olmo2", "olmo_hybrid") or model_type == "flex_olmo",
        clip_qkv=float(cfg.get("clip_qkv") or 0.0) if arch in ("olmoe", "dbrx") or model_type in _CLIPS_QKV else 0.0,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
        layer_windows=_layer_windows(model_type, cfg),
        nope_layers=_nope_layers(model_type, cfg),
        **_llama4_fields(arch, cfg),
        **_granite_fields(arch, model_type, cfg),
        **_cohere_fields(arch, cfg),
        **_phimoe_fields(model_type, cfg),
        **_jais2_fields(model_type, cfg),
        **_minicpm3_fields(model_type, cfg),
        gated_norm_rank=int(cfg.get("gated_norm_rank") or 16) if model_type == "axk2" else 0,
        **_afmoe_fields(arch, cfg),
        **_nanochat_fields(arch, cfg),
        output_vocab_size=_output_vocab_size(cfg),
        **_laguna_fields(model_type, cfg),
        **_ungated_mlp_fields(model_type, cfg),
        **_experts_from_hf_config(arch, cfg),
        **rope_fields,
        **gemma,
        **hybrid,
        **_glm4_fields(arch, model_type),
        **_lfm2_fields(arch, cfg),
        **_lfm3_fields(model_type, rotated_angles),
        **_mamba2_fields(model_type, cfg),
        **_falcon_h1_fields(model_type, cfg),
        **_jamba_fields(model_type, cfg),
        **_mimo_fields(model_type, cfg),
        **_hy_v4_fields(model_type, cfg),
        **classic_fields(model_type, cfg),
        **mamba_fields(model_type, cfg),
        **dbrx_fields(model_type),
        **longcat_fields(model_type, cfg),
        **minimax_fields(model_type, cfg),
        **minimax_m3_fields(model_type, cfg),
        **kolibri,
        **_diffllama_fields(model_type, cfg),
        **xlstm_fields(model_type, cfg),
        **rwkv_fields(model_type, cfg),
        **beam_fields(model_type, cfg),
        **ergo_fields(model_type, cfg),
        **dory_fields(model_type, cfg),
        **zamba2_fields(model_type, cfg),
        **recurrent_gemma_fields(model_type, cfg),
        **jetmoe_fields(model_type, cfg),
        **bitnet_fields(model_type, cfg),
        **glm4_moe_kin_fields(model_type),
        **nemotron,
    )

def _gemma4_assistant_config(cfg: dict[str, Any], name: str) -> ModelConfig:
    """A Gemma 4 assistant's config: its text model's (a `gemma4_text` config whose every layer shares K/V, read as
    one whose layers attend over the target's: `Gemma4Layout.kv_sources` all -1; its windows one key wider), its
    embeddings tied, and its drafting shape (`Gemma4Assistant`). ValueError for a text model that is not Gemma 4's."""
    unified = cfg.get("model_type") == "gemma4_unified_assistant"  # (Gemma 4 12B's)
    text = dict(cfg.get("text_config") or {})
    text_type = text.get("model_type") or ("gemma4_unified_text" if unified else "gemma4_text")
    if text_type not in ("gemma4_text", "gemma4_unified_text"):
        raise ValueError(f"a Gemma 4 assistant's text model must be Gemma 4's, not {text_type!r}")
    layers = int(text.get("num_hidden_layers", 0))
    config = model_config_from_hf({**text, "model_type": text_type, "num_kv_shared_layers": 0}, name)
    assert config.gemma4 is not None
    ordered = bool(cfg.get("use_ordered_embeddings", False))
    shape = Gemma4Assistant(
        backbone_hidden_size=int(cfg.get("backbone_hidden_size", 3840 if unified else 1536)),
        centroids=int(cfg.get("num_centroids", 2048)) if ordered else 0,
        centroid_top_k=int(cfg.get("centroid_intermediate_top_k", 32)) if ordered else 0,
    )
    if shape.centroids and config.vocab_size % shape.centroids:
        raise ValueError(f"a Gemma 4 assistant's {config.vocab_size} tokens must split into {shape.centroids} "
                         "clusters")  # fmt: skip
    layout = dataclasses.replace(config.gemma4, kv_sources=(-1,) * layers)
    # Its windowed layers' one query sees the last `sliding_window + 1` of the target's keys (transformers' two-sided
    # window over the shared K/V, flipped), one more than a causal window's.
    windows = tuple(window + 1 if window else 0 for window in config.layer_windows)
    return dataclasses.replace(config, gemma4=layout, assistant=shape, tie_word_embeddings=True, layer_windows=windows)


def _hy_v4_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """HY-V4's residual streams (`HyperConnections`: `hc_mult`, `hc_magnitude`, `hc_eps`) and its experts' SwiGLU,
    clamped at `swiglu_limit` where that is positive (gpt-oss's form with alpha 1 and no offset on the up half); {}
    for other families."""
    if model_type != "hy_v4":
        return {}
    streams = HyperConnections(
        streams=int(cfg.get("hc_mult") or 4), post_scale=float(cfg.get("hc_magnitude", 2.0)),
        eps=float(cfg.get("hc_eps", 1e-6)),
    )  # fmt: skip
    if streams.streams < 1:
        raise ValueError(f"hy_v4 hc_mult {streams.streams} must be at least 1")
    limit = float(cfg["swiglu_limit"])
    clamp = {"swiglu_limit": limit, "swiglu_alpha": 1.0, "swiglu_up_offset": 0.0} if limit > 0 else {}
    return {"hyper_connections": streams, **clamp}


def _encoder_config(cfg: dict[str, Any], name: str) -> ModelConfig:
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
    return ModelConfig(
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


def _glm4_fields(arch: Architecture, model_type: str) -> dict[str, Any]:
    """GLM-4's `ModelConfig` fields ({} for the other families): Gemma's four norms around the attention and the MLP,
    under its own names (`models.glm4`, `models.glm4_moe` for Kolibri-1's), with plain weights; GLM-4-9B's (`glm`)
    block is a plain pre-norm one."""
    sandwich = (arch == "glm4" and model_type != "glm") or model_type == "kolibri1"
    return {"sandwich_norms": True} if sandwich else {}


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
    and A.X K1's transformers configs), else the first `first_k_dense_replace` (its checkpoints' and DeepSeek's), else
    as transformers defaults them: the first one (GLM-4.7-Flash, Sarvam, A.X K1), three (DeepSeek-V3 and V3.2, GLM-5),
    none. A.X K1's and K2's released configs also make dense every layer that `moe_layer_freq` does not divide."""
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        return tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    model_type = cfg.get("model_type")
    default = 1 if model_type in ("glm4_moe_lite", "sarvam_moe", "sarvam_mla", "axk1", "axk2") else 0
    default = 3 if model_type in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa") else default
    first = int(cfg.get("first_k_dense_replace", default) or 0)
    every = int(cfg.get("moe_layer_freq") or 1) if model_type in ("axk1", "axk2") else 1
    return tuple(i for i in range(int(cfg["num_hidden_layers"])) if i < first or i % every)


def _latent_attention_fields(cfg: dict[str, Any], rope: dict[str, Any], model_type: str) -> dict[str, Any]:
    """DeepSeek-V3's latent attention (`LatentAttention`) and its score scale: the key's head dim ** -0.5, times
    the square of YaRN's `mscale_all_dim` attention factor when its rope is scaled (transformers' `scaling`);
    Mistral 4's query scale (`_query_scale_fields`)."""
    mla = LatentAttention(
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        # (MiniCPM3's default: a head's share of the hidden size)
        v_head_dim=int(cfg.get("v_head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])),
        rope_interleave=bool(cfg.get("rope_interleave", model_type != "minicpm3")),
        rope=model_type != "kimi_linear",
        head_gate=model_type == "bailing_hybrid",
        value_gate=model_type in ("hy_v4", "axk2"),
        # (HY-V4's own; LongCat-Flash's latent norms at transformers' default, not its `rms_norm_eps`)
        latent_norm_eps=(float(cfg["hy_latent_norm_eps"]) if model_type == "hy_v4"
                         else 1e-6 if model_type == "longcat_flash" else 0.0),
        query_latent_pair=model_type == "axk2",
    )
    if model_type == "axk2" and not mla.q_lora_rank:
        raise ValueError("axk2 needs a positive q_lora_rank (its queries and gate read the query latent)")
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    all_dims = float(rope.get("mscale_all_dim") or 0.0)
    if (rope.get("rope_type") or rope.get("type") or "default") != "default" and all_dims and float(rope["factor"]) > 1:
        mscale = 0.1 * all_dims * math.log(float(rope["factor"])) + 1.0
        scale *= mscale * mscale
    fields: dict[str, Any] = {"latent_attention": mla, "attention_scale": scale}
    return {**fields, **_query_scale_fields(model_type, rope)}


def _sparse_indexer(cfg: dict[str, Any], model_type: str, mla: LatentAttention) -> SparseIndexer | None:
    """DeepSeek-V3.2's and GLM-5's lightning indexer (`SparseIndexer`), None for other latent-attention families.
    GLM-5's layers of `indexer_types` "shared" reuse the last full layer's choice; without the list, transformers'
    schedule from `index_topk_pattern` ("F"/"S" per layer) or `index_topk_freq` and `index_skip_topk_offset` (every
    layer full by default). ValueError for a first layer that is shared, or an index head narrower than its rope."""
    if model_type not in ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"):
        return None
    layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("indexer_types") if model_type in ("glm_moe_dsa", "hy_v4") else None
    if kinds is None and model_type == "glm_moe_dsa":
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            offset = cfg.get("index_skip_topk_offset")  # (0 is an offset: only None takes transformers' default)
            freq, offset = max(int(cfg.get("index_topk_freq") or 1), 1), 2 if offset is None else int(offset)
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    shared = tuple(i for i, kind in enumerate(kinds or ()) if kind == "shared")
    if 0 in shared:
        raise ValueError(f"{model_type}: layer 0's indexer is shared, but no layer before it has one")
    indexer = SparseIndexer(
        heads=int(cfg.get("index_n_heads") or 64), head_dim=int(cfg.get("index_head_dim") or 128),
        topk=int(cfg.get("index_topk") or 2048), shared_layers=shared, rope_last=model_type == "hy_v4",
        rope_interleave=model_type == "glm_moe_dsa" or (model_type == "hy_v4" and bool(cfg["rope_interleave"])),
        # (DeepSeek's and transformers' `nn.LayerNorm(head_dim, eps=1e-6)`; HY-V4's the model's epsilon)
        key_norm_eps=float(cfg.get("rms_norm_eps") or 1e-5) if model_type == "hy_v4" else 1e-6,
    )  # fmt: skip
    if indexer.head_dim < mla.qk_rope_head_dim or indexer.topk < 1:
        raise ValueError(f"{model_type}: index heads of {indexer.head_dim} dims (rope {mla.qk_rope_head_dim}) and "
                         f"index_topk {indexer.topk}")  # fmt: skip
    return indexer


def _query_scale_fields(model_type: str, rope: dict[str, Any]) -> dict[str, Any]:
    """Mistral 4's and Ministral 3's query scale by position (`ModelConfig.query_scale_beta`), from their rope's
    `llama_4_scaling_beta` over its `original_max_position_embeddings`; {} for other families or no beta."""
    beta = float(rope.get("llama_4_scaling_beta") or 0.0) if model_type in ("mistral4", "ministral3") else 0.0
    if not beta:
        return {}
    return {"query_scale_beta": beta, "query_scale_positions": int(rope["original_max_position_embeddings"])}


def _output_vocab_size(cfg: dict[str, Any]) -> int:
    """Apertus 1.5's LM head rows, `output_vocab_size` (0: the whole vocabulary, as without it); ValueError for one
    outside 1..vocab_size or beside tied embeddings (its released checkpoints tie none)."""
    rows, vocab = cfg.get("output_vocab_size"), int(cfg["vocab_size"])
    if rows is None or int(rows) == vocab:
        return 0
    if not 1 <= int(rows) <= vocab:
        raise ValueError(f"output_vocab_size {rows} must be in [1, vocab_size {vocab}]")
    if cfg.get("tie_word_embeddings"):
        raise ValueError("an LM head pruned to output_vocab_size with tied embeddings is not supported")
    return int(rows)


def _exaone4_5_text(text: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.5's text model: its `text_config`, EXAONE 4.0's (`exaone4`, or `exaone4_5_text` as its first release
    named it, which transformers reads as `exaone4`); ValueError for another."""
    model_type = text.get("model_type")
    if model_type not in ("exaone4", "exaone4_5_text"):
        raise ValueError(f"exaone4_5 text_config model_type {model_type!r} is not supported (exaone4 is)")
    return {**text, "model_type": "exaone4"}


def _mistral3_text_type(text: dict[str, Any]) -> str:
    """The family of a multimodal Mistral 3 checkpoint's text model: its `text_config`'s `model_type` (Mistral Small
    3.1's `mistral`, Ministral 3's `ministral3`, Mistral Small 4's `mistral4`); ValueError for another."""
    model_type = str(text.get("model_type") or "mistral")
    if model_type not in ("mistral", "ministral", "ministral3", "mistral4"):
        raise ValueError(f"mistral3 text_config model_type {model_type!r} is not supported "
                         "(mistral, ministral, ministral3 and mistral4 are)")
    return model_type


def _kimi_k25_text(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kimi K2.5's (and K2.6's) text model: its `text_config`, Kimi K2's DeepSeek-V3 layout (`model_type` `kimi_k2` or
    `deepseek_v3`), whose own embedding tie holds (its checkpoint has an LM head of its own, under
    `language_model.lm_head`; the multimodal config's top-level tie is its wrapper's default). ValueError for another
    text model."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("kimi_k25 config.json has no text_config")
    model_type = str(text.get("model_type") or "deepseek_v3")
    if model_type not in ("kimi_k2", "deepseek_v3"):
        raise ValueError(f"kimi_k25 text_config model_type {model_type!r} is not supported (kimi_k2, deepseek_v3 are)")
    return {**text, "model_type": model_type}


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
    (`norm_offset` 1) and the attention's output gate. OLMo Hybrid's (`_olmo_hybrid_fields`): its linear-attention
    layers alone."""
    if arch == "olmo_hybrid":
        return _olmo_hybrid_fields(cfg)
    if cfg.get("model_type") in ("kimi_linear", "bailing_hybrid"):
        return _kimi_linear_fields(cfg)
    if arch not in ("qwen3_next", "qwen4_exp"):
        return {}
    layers, lara = int(cfg["num_hidden_layers"]), cfg.get("model_type") == "lara_mini"
    types = _lara_mini_layer_types(cfg) if lara else cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    kinds = {"linear_attention", "full_attention", *(("sliding_attention",) if lara else ())}
    if len(types) != layers or set(types) - kinds:
        raise ValueError(f"layer_types must name {', '.join(sorted(kinds))} for each of the {layers} layers; got "
                         f"{types!r}")  # fmt: skip
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
    if lara:  # plain norms, no output gate
        return {"linear_attention": linear}
    return {"linear_attention": linear, "attention_output_gate": True, "norm_offset": 1.0}


# Lara Mini's released layer pattern, repeated (transformers' default where a config has no `layer_types`).
_LARA_MINI_PATTERN = (
    "linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention",
)  # fmt: skip


def _lara_mini_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Lara Mini's `layer_types`, or its released pattern repeated over its layers."""
    layers = int(cfg["num_hidden_layers"])
    return list(cfg.get("layer_types") or [_LARA_MINI_PATTERN[i % 5] for i in range(layers)])


def _flint_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Flint `config.json` as transformers fills it in: full attention on the first two layers, every fourth from
    the second and the last (windowed elsewhere) where `layer_types` is absent; its dense layers (`mlp_only_layers`,
    the first two by default) as `mlp_layer_types`."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention" for i in range(layers)
    ]
    dense = {int(i) for i in (cfg["mlp_only_layers"] if cfg.get("mlp_only_layers") is not None else (0, 1))}
    kinds = ["dense" if i in dense else "sparse" for i in range(layers)]
    return {**cfg, "layer_types": types, "mlp_layer_types": kinds}


def _kimi_linear_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Kimi Linear `config.json` under the keys the rest reads: its own names for the experts' settings (Moonshot's,
    which transformers' config keeps: `num_experts_per_token`, `moe_renormalize`, `num_expert_group`), its layer
    kinds from `layer_types` or the released files' `linear_attn_config` (`kda_layers` and `full_attn_layers`,
    counted from 1), else as transformers fills them in (full attention on every fourth layer from the fifth), and
    the first `first_k_dense_replace` (1) layers dense where `mlp_layer_types` is absent. ValueError for a router or
    an attention it does not build: scores other than sigmoid, latent attention with rope (`mla_use_nope` off)."""
    layers = int(cfg["num_hidden_layers"])
    linear = cfg.get("linear_attn_config") or {}
    types = cfg.get("layer_types")
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        kinds: dict[int, str] = {int(i) - 1: "linear_attention" for i in linear["kda_layers"]}
        kinds.update({int(i) - 1: "full_attention" for i in linear["full_attn_layers"]})
        types = [kinds.get(i, "") for i in range(layers)]
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if (cfg.get("moe_router_activation_func") or "sigmoid") != "sigmoid":
        raise ValueError(f"kimi_linear routing by {cfg['moe_router_activation_func']} scores is not supported")
    if cfg.get("mla_use_nope") is False:
        raise ValueError("kimi_linear with rope on its latent attention (mla_use_nope false) is not supported")
    first_dense = int(cfg.get("first_k_dense_replace", 1) or 0)
    renamed = {
        "num_experts_per_tok": cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token"),
        "norm_topk_prob": cfg.get("norm_topk_prob", cfg.get("moe_renormalize", True)),
        "n_group": cfg.get("n_group") or cfg.get("num_expert_group") or 1,
        "n_shared_experts": cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or 0,
        "linear_num_heads": linear.get("num_heads") or cfg.get("linear_num_heads") or 32,
        "linear_head_dim": linear.get("head_dim") or cfg.get("linear_head_dim") or 128,
        "linear_conv_kernel_dim": linear.get("short_conv_kernel_size") or cfg.get("linear_conv_kernel_dim") or 4,
        "mlp_layer_types": cfg.get("mlp_layer_types")
        or ["dense" if i < first_dense else "sparse" for i in range(layers)],
        "rope_interleave": False,
    }
    return {**cfg, "layer_types": types, **renamed}


def _kimi_linear_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kimi Linear's Kimi Delta Attention layers (`LinearAttention.kimi_delta`: as many key as value heads, both
    `linear_head_dim` wide) on the layers `layer_types` calls linear_attention (`_kimi_linear_config`); Ling 3's
    with whole decay and gate projections and its decay bounded by `kda_decay_bound` (`_bailing_hybrid_config`).
    ValueError for a list of other kinds or the wrong length, or without either kind."""
    layers, model_type = int(cfg["num_hidden_layers"]), cfg["model_type"]
    types = cfg["layer_types"]
    if len(types) != layers or set(types) != {"linear_attention", "full_attention"}:
        raise ValueError(f"{model_type} layer_types must name linear_attention or full_attention for each of the "
                         f"{layers} layers, both kinds; got {types!r}")  # fmt: skip
    heads, head_dim = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
    linear = LinearAttention(
        num_key_heads=heads,
        num_value_heads=heads,
        key_head_dim=head_dim,
        value_head_dim=head_dim,
        conv_kernel=int(cfg["linear_conv_kernel_dim"]),
        layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        kimi_delta=True,
        full_rank_gates=model_type == "bailing_hybrid",
        decay_bound=float(cfg.get("kda_decay_bound", 0.0)),
    )
    if linear.conv_kernel < 2:
        raise ValueError(f"{model_type} with a {linear.conv_kernel}-tap convolution is not supported")
    return {"linear_attention": linear}


def _bailing_hybrid_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Ling 3 (`bailing_hybrid`) `config.json` under the keys the rest reads, with transformers' defaults where a
    key is absent: its own names for the experts' settings (`num_experts`, `num_experts_per_token`,
    `num_shared_experts` (1), `num_expert_group` (8), `topk_group` (4), `moe_renormalize`), `model_max_length`, its
    layer kinds (`layer_types`, else full attention on the last layer of each `layer_group_size` (6)), the first
    `first_k_dense_replace` (2) layers dense where `mlp_layer_types` is absent, and Kimi Delta Attention of
    `num_attention_heads` heads of the original `head_dim` (transformers keeps it as `linear_head_dim` and sets
    `head_dim` to the rope dims when it saves), a `short_conv_kernel_size`-tap convolution, the safe gate's
    `kda_lower_bound` (-5) unless `kda_safe_gate` is false (as `kda_decay_bound`). ValueError for scores other than
    sigmoid, or a safe gate's bound not below zero."""
    layers = int(cfg["num_hidden_layers"])
    group = int(cfg.get("layer_group_size") or 6)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(layers)
    ]
    if (cfg.get("score_function") or "sigmoid") != "sigmoid":
        raise ValueError(f"bailing_hybrid routing by {cfg['score_function']} scores is not supported")
    first_dense = int(cfg.get("first_k_dense_replace", 2) or 0)
    bound = float(cfg.get("kda_lower_bound", -5.0))
    safe_gate = cfg.get("kda_safe_gate", True)
    if safe_gate and bound >= 0:  # (0 would be no decay at all, not Kimi's unbounded form)
        raise ValueError(f"bailing_hybrid kda_lower_bound {bound} must be negative (a log decay)")
    renamed = {
        "num_experts": cfg.get("num_experts") or cfg.get("num_local_experts") or 512,
        "num_experts_per_tok": cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or 8,
        "norm_topk_prob": cfg.get("norm_topk_prob", cfg.get("moe_renormalize", True)),
        "n_group": cfg.get("n_group") or cfg.get("num_expert_group") or 8,
        "topk_group": cfg.get("topk_group") or 4,
        "n_shared_experts": cfg.get("n_shared_experts", cfg.get("num_shared_experts", 1)) or 0,  # (0: none)
        "routed_scaling_factor": cfg.get("routed_scaling_factor") or 2.5,
        "max_position_embeddings": cfg.get("max_position_embeddings") or cfg.get("model_max_length") or 262144,
        "linear_num_heads": cfg.get("linear_num_heads") or cfg["num_attention_heads"],
        "linear_head_dim": cfg.get("linear_head_dim") or cfg.get("head_dim") or 128,
        "linear_conv_kernel_dim": cfg.get("linear_conv_kernel_dim") or cfg.get("short_conv_kernel_size") or 4,
        "rope_theta": cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 6_000_000.0,
        "kda_decay_bound": bound if safe_gate else 0.0,  # `LinearAttention.decay_bound` (0: Kimi's softplus form)
        "mlp_layer_types": cfg.get("mlp_layer_types")
        or ["dense" if i < first_dense else "sparse" for i in range(layers)],
    }
    return {**cfg, "layer_types": types, **renamed}


def _hy_v4_config(cfg: dict[str, Any], vision: bool) -> dict[str, Any]:
    """An HY-V4 (`hy_v4`) `config.json`, or Hy4's text model (`vision`: its `text_config`, read as `hy_v4`), with
    transformers' defaults where a key is absent: one shared expert, the routed scale 2.827, the first layer dense
    (`mlp_layer_types`), an indexer of its own on layer 0 and every fourth from layer 1 (`indexer_types`, the others
    "shared"), the experts' SwiGLU clamp 10 (0 or less: none). Both turn their attention's and indexer's rope dims
    as interleaved pairs (as transformers 5.25 does; 5.24 turned HY-V4's as halves: a config's `rope_interleave`
    false still says so); HY-V4 normalises its latents at 1e-6, Hy4 (whose M-RoPE turns a text token's three position
    components, all one position, as plain rope does) at `rms_norm_eps` (`hy_latent_norm_eps`). ValueError for layer
    kinds other than indexed attention."""
    layers = int(cfg["num_hidden_layers"])
    kinds = set(cfg.get("layer_types") or ["indexed_attention"])
    if kinds != {"indexed_attention"}:
        raise ValueError(f"hy_v4 layer_types {sorted(kinds)} are not supported (indexed_attention is)")
    return {
        **cfg,
        "model_type": "hy_v4",
        "rope_interleave": bool(cfg.get("rope_interleave", True)),
        "hy_latent_norm_eps": float(cfg.get("rms_norm_eps") or 1e-5) if vision else 1e-6,
        "n_shared_experts": cfg.get("n_shared_experts", 1),
        "routed_scaling_factor": cfg.get("routed_scaling_factor") or 2.827,
        "mlp_layer_types": cfg.get("mlp_layer_types") or ["dense" if i < 1 else "sparse" for i in range(layers)],
        "indexer_types": cfg.get("indexer_types")
        or ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)],
        "swiglu_limit": float(cfg.get("swiglu_limit", 10.0)),
    }


def _olmo_hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMo Hybrid's linear-attention layers (`layer_types`, or every layer but each fourth, the last attention if
    none is, as transformers fills them in), of `linear_num_key_heads` key and as many value heads (the attention's
    head count by default; its Gated DeltaNet repeats no key head), `linear_key_head_dim` (0.75 * hidden / heads)
    and `linear_value_head_dim` (twice that), their write strength doubled where `linear_allow_neg_eigval` (the
    default) and their gated norm's epsilon 1e-5 (FLA's). ValueError for what it does not build."""
    layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    types = cfg.get("layer_types")
    if types is None:
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    if len(types) != layers or set(types) != {"linear_attention", "full_attention"}:
        raise ValueError(f"olmo_hybrid layer_types must name linear_attention or full_attention for each of the "
                         f"{layers} layers, both kinds; got {types!r}")  # fmt: skip
    key_heads = int(cfg.get("linear_num_key_heads") or heads)
    value_heads = int(cfg.get("linear_num_value_heads") or heads)
    key_dim = int(cfg.get("linear_key_head_dim") or int(0.75 * int(cfg["hidden_size"]) / key_heads))
    if key_heads != value_heads:
        raise ValueError(f"olmo_hybrid with {value_heads} linear value heads over {key_heads} key heads is not "
                         "supported (transformers' layer repeats no key head)")  # fmt: skip
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"olmo_hybrid: hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    linear = LinearAttention(
        num_key_heads=key_heads,
        num_value_heads=value_heads,
        key_head_dim=key_dim,
        value_head_dim=int(cfg.get("linear_value_head_dim") or 2 * key_dim),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
        layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0,
        norm_eps=1e-5,
    )
    return {"linear_attention": linear}


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
    return {"mamba2": _mamba2_shape(model_type, cfg, mamba)}


def _mamba2_shape(model_type: str, cfg: dict[str, Any], layers: tuple[int, ...], **fields: bool) -> Mamba2:
    """The `Mamba2` of a Granite 4.0, Bamba or Falcon-H1 `config.json` (their `mamba_*` keys) on `layers`: heads
    `mamba_d_head` wide ("auto": the inner width, `mamba_d_ssm` or `mamba_expand * hidden_size`, over the heads);
    `fields`: `Mamba2`'s own (`gated_norm`, `beside_attention`). ValueError for what the layer does not build: biases on
    its projections, a time step clamped to a range, an activation other than SiLU."""
    if cfg.get("mamba_proj_bias"):
        raise ValueError(f"{model_type} with mamba_proj_bias is not supported")
    limit = [json_float(bound) for bound in cfg.get("time_step_limit") or (0.0, math.inf)]
    if limit != [0.0, math.inf]:
        raise ValueError(f"{model_type} with time_step_limit {limit} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    heads, hidden = int(cfg.get("mamba_n_heads") or 128), int(cfg["hidden_size"])
    head_dim = cfg.get("mamba_d_head") or "auto"
    inner = int(cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand") or 2) * hidden)
    shape = Mamba2(
        num_heads=heads,
        head_dim=inner // heads if head_dim == "auto" else int(head_dim),
        state_dim=int(cfg.get("mamba_d_state") or 256),
        groups=int(cfg.get("mamba_n_groups") or 1),
        conv_kernel=int(cfg.get("mamba_d_conv") or 4),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        layers=layers,
        **fields,
    )
    if shape.num_heads % shape.groups or shape.conv_kernel < 2:
        raise ValueError(f"Mamba-2 of {shape.num_heads} heads in {shape.groups} groups with a {shape.conv_kernel}-tap "
                         "convolution is not supported")  # fmt: skip
    return shape


# MiMo-V2-Flash as transformers fills in what its config.json leaves out: every 6th layer (and the first) full
# attention, the first layer dense, each layer type's rope (a third of each head turned).
_MIMO_FULL_EVERY = 6
_MIMO_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
}


def _mimo_v2_flash_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A MiMo-V2-Flash `config.json` with what transformers fills in where it is absent (`_MIMO_*`), its
    `sliding_window_size` (the reference's: the positions before the query) read as a window one longer, and its
    `routed_scaling_factor` of null as 1."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "full_attention" if i == 0 or (i + 1) % _MIMO_FULL_EVERY == 0 else "sliding_attention" for i in range(layers)
    ]
    window = cfg.get("sliding_window")
    if cfg.get("sliding_window_size") is not None:
        window = int(cfg["sliding_window_size"]) + 1
    return {
        **cfg,
        "layer_types": types,
        "mlp_layer_types": cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1),
        "rope_parameters": cfg.get("rope_parameters") or _MIMO_ROPE,
        "sliding_window": 129 if window is None else window,
        "routed_scaling_factor": cfg.get("routed_scaling_factor") or 1.0,
    }


def _mimo_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """MiMo-V2-Flash's `ModelConfig` fields ({} for the other families): twice `num_key_value_heads` on its windowed
    layers, its values `v_head_dim` wide and scaled by `attention_value_scale`. ValueError for values wider than the
    keys (the cache row is the keys')."""
    if model_type != "mimo_v2_flash":
        return {}
    kv = int(cfg["num_key_value_heads"])
    head_dim, value_dim = int(cfg.get("head_dim") or 192), int(cfg.get("v_head_dim") or 128)
    if value_dim > head_dim:
        raise ValueError(f"mimo_v2_flash with v_head_dim {value_dim} wider than head_dim {head_dim} is not supported")
    scale = cfg.get("attention_value_scale")
    return {
        "layer_kv_head_counts": tuple(2 * kv if kind == "sliding_attention" else kv for kind in cfg["layer_types"]),
        "value_head_dim": value_dim,
        "value_scale": 1.0 if scale is None else float(scale),
    }


def _jamba_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Jamba's layer kinds: its `layers_block_type`, or (without it) attention on every `attn_layer_period`-th layer
    from `attn_layer_offset` and Mamba on the rest, as transformers builds them."""
    layers = int(cfg["num_hidden_layers"])
    period, offset = int(cfg.get("attn_layer_period") or 8), int(cfg.get("attn_layer_offset") or 4)
    return list(cfg.get("layers_block_type") or ("attention" if i % period == offset else "mamba"
                                                 for i in range(layers)))  # fmt: skip


def _jamba_expert_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Jamba's layers with experts: every `expert_layer_period`-th from `expert_layer_offset` (none with one expert)."""
    if int(cfg.get("num_experts") or 16) <= 1:
        return ()
    period, offset = int(cfg.get("expert_layer_period") or 2), int(cfg.get("expert_layer_offset") or 1)
    return tuple(i for i in range(int(cfg["num_hidden_layers"])) if i % period == offset)


def _jamba_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Jamba's Mamba-1 layers (`Mamba1`; {} for the other families): those its layer types call "mamba", `mamba_expand`
    times the hidden size wide, a time-step rank of `mamba_dt_rank` ("auto": hidden / 16, rounded up), with Jamba's
    RMSNorms on the time step, B and C. ValueError for what the layer does not build: biases on its projections,
    another activation, a model of Mamba layers only or of attention only."""
    if model_type != "jamba":
        return {}
    types = _jamba_layer_types(cfg)
    layers = int(cfg["num_hidden_layers"])
    if len(types) != layers or set(types) - {"mamba", "attention"}:
        raise ValueError(f"jamba layers_block_type must name mamba or attention for each of the {layers} layers; "
                         f"got {types!r}")  # fmt: skip
    mamba = tuple(i for i, kind in enumerate(types) if kind == "mamba")
    if not mamba or len(mamba) == layers:
        raise ValueError("a jamba model of Mamba layers only, or of attention only, is not supported")
    if cfg.get("mamba_proj_bias"):
        raise ValueError("jamba with mamba_proj_bias is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"jamba hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
    hidden = int(cfg["hidden_size"])
    rank = cfg.get("mamba_dt_rank") or "auto"
    return {
        "mamba1": Mamba1(
            inner=int(cfg.get("mamba_expand") or 2) * hidden,
            state_dim=int(cfg.get("mamba_d_state") or 16),
            conv_kernel=int(cfg.get("mamba_d_conv") or 4),
            dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            layers=mamba,
            inner_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        )
    }


def _falcon_h1_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1's `ModelConfig` fields ({} for the other families): Mamba-2 beside attention in every layer, gated
    by `silu(z)` alone or RMS-normalised after the gate where `mamba_rms_norm` (`Mamba2.gated_norm`), and its
    multipliers (`FalconH1Scales`; the embeddings' and the logits' as `embedding_multiplier` and `logit_scale`).
    ValueError for what its releases do not set and the layers do not build: a norm before the gate
    (`mamba_norm_before_gate` with `mamba_rms_norm`), biases on the MLP or on Mamba-2's projections
    (`projectors_bias`), a layer without its MLP (`mamba_use_mlp` false)."""
    if model_type != "falcon_h1":
        return {}
    rms_norm = bool(cfg.get("mamba_rms_norm", False))
    if rms_norm and cfg.get("mamba_norm_before_gate", True):
        raise ValueError("falcon_h1 with mamba_rms_norm and mamba_norm_before_gate (the norm before the gate) is not "
                         "supported; with mamba_norm_before_gate false it is")  # fmt: skip
    if not cfg.get("mamba_use_mlp", True):
        raise ValueError("falcon_h1 with mamba_use_mlp false is not supported")
    layers = tuple(range(int(cfg["num_hidden_layers"])))
    ssm = tuple(float(m) for m in cfg.get("ssm_multipliers") or (1.0,) * 5)
    gate, down = (float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0))
    if len(ssm) != 5:
        raise ValueError(f"falcon_h1 ssm_multipliers must be 5 numbers (z, x, B, C, dt); got {ssm!r}")
    scales = FalconH1Scales(
        attention_in=float(cfg.get("attention_in_multiplier") or 1.0),
        key=float(cfg.get("key_multiplier") or 1.0),
        attention_out=float(cfg.get("attention_out_multiplier") or 1.0),
        ssm_in=float(cfg.get("ssm_in_multiplier") or 1.0),
        ssm=(ssm[0], ssm[1], ssm[2], ssm[3], ssm[4]),
        ssm_out=float(cfg.get("ssm_out_multiplier") or 1.0),
        mlp_gate=gate,
        mlp_down=down,
    )
    return {
        "mamba2": _mamba2_shape(model_type, cfg, layers, gated_norm=rms_norm, beside_attention=True),
        "falcon_h1": scales,
        "embedding_multiplier": float(cfg.get("embedding_multiplier") or 1.0),
        "logit_scale": float(cfg.get("lm_head_multiplier") or 1.0),
    }


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
    unknown = [kind for kind in source if kind not in NEMOTRON_BLOCKS]
    if not source or unknown:
        raise ValueError(f"nemotron_h blocks {source!r} are not a hybrid_override_pattern of M, *, - and E")
    pattern = "".join(NEMOTRON_BLOCKS[kind] for kind in source)
    if "M" not in pattern or "*" not in pattern:
        raise ValueError(f"nemotron_h blocks {pattern!r}: a hybrid of Mamba-2 and attention blocks is supported")
    for key in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias", "sliding_window"):
        if cfg.get(key):
            raise ValueError(f"nemotron_h with {key} is not supported")
    limit = [json_float(bound) for bound in cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0, math.inf)]
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


def _lfm2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """An LFM2 `config.json` under the keys the rest of `model_config_from_hf` reads, as transformers' `Lfm2Config` and
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
    kinds = {"conv", "full_attention", "sliding_attention"} if cfg.get("model_type") == "lfm3" else {"conv",
                                                                                                       "full_attention"}
    if len(types) != layers or set(types) - kinds:
        raise ValueError(f"layer_types must name {', '.join(sorted(kinds))} for each of the {layers} layers; "
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
                 "ernie4_5": ("use_bias",), "ernie4_5_moe": ("use_bias",),
                 "falcon_h1": ("mlp_bias", "projectors_bias")}  # fmt: skip


def _refuse_unbuilt(model_type: str, cfg: dict[str, Any]) -> None:
    """ValueError for a config of `_UNBUILT_KEYS`' families (Seed-OSS, Arcee, Apertus, Bamba, Helium, InternLM3,
    IQuest-Coder, ERNIE 4.5, Falcon-H1) that sets one of its keys."""
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
_UNGATED_ACTIVATIONS = {
    "arcee": ("relu2",), "apertus": ("xielu", "relu2"), "jais2": ("relu2",), "nanochat": ("relu2",),
}  # fmt: skip


def _ungated_mlp_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The activation of Arcee AFM's, Jais 2's and NanoChat's MLP (relu²) and of Apertus's (xIELU, or relu² as
    transformers builds it too), ungated; {} for the other families. ValueError for another activation."""
    supported = _UNGATED_ACTIVATIONS.get(model_type)
    if supported is None:
        return {}
    activation = cfg.get("hidden_act") or supported[0]
    if activation not in supported:
        raise ValueError(f"{model_type} hidden_act {activation!r} is not supported ({' or '.join(supported)})")
    return {"hidden_act": activation}


def _cohere_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """Cohere's `ModelConfig` fields ({} for the other families): its LayerNorms (Cohere2-MoE's RMSNorms where its
    config sets `rms_norm_eps`), parallel block and `logit_scale`. ValueError for Command R+'s per-head q/k
    LayerNorms (`use_qk_norm`), which this engine does not build yet."""
    if arch != "cohere":
        return {}
    if cfg.get("use_qk_norm"):
        raise ValueError("cohere with use_qk_norm (per-head q/k LayerNorms) is not supported")
    layer_norm = cfg.get("model_type") != "cohere2_moe" or cfg.get("rms_norm_eps") is None
    scale = cfg.get("logit_scale")  # (Cohere Compass's null: none)
    return {"layer_norm": layer_norm, "parallel_block": True, "logit_scale": float(1.0 if scale is None else scale),
            "rope_halves": cfg.get("model_type") == "cohere_compass_text"}


# Cohere2-MoE's routers (`expert_selection_fn`) and its ways of adding the shared experts' output
# (`shared_expert_combination_strategy`).
_COHERE2_MOE_ROUTERS = ("softmax", "sigmoid")
_COHERE2_MOE_COMBINATIONS = ("sum", "average")


def _cohere2_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Cohere2-MoE `config.json` with what transformers fills in where it is absent: the first
    `first_k_dense_replace` layers dense (`mlp_layer_types`), windows on all but every
    `prefix_dense_sliding_window_pattern`-th of them (1: none) and all but every `sliding_window_pattern`-th (4) of
    the rest (`layer_types`); the dense layers `prefix_dense_intermediate_size` wide (as `intermediate_size`, the
    experts' width then `moe_intermediate_size`)."""
    layers = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    prefix, pattern = int(cfg.get("prefix_dense_sliding_window_pattern") or 1), int(cfg.get("sliding_window_pattern")
                                                                                    or 4)  # fmt: skip
    types = cfg.get("layer_types")
    if types is None:  # (the rest's pattern counts from the first layer after the prefix, as transformers counts it)
        types = [_windowed_or_full((i + 1) % prefix) for i in range(first_dense)]
        types += [_windowed_or_full((i + 1) % pattern) for i in range(layers - first_dense)]
    kinds = cfg.get("mlp_layer_types") or ["dense" if i < first_dense else "sparse" for i in range(layers)]
    experts_width = int(cfg["intermediate_size"])
    return {
        **cfg,
        "layer_types": types,
        "mlp_layer_types": kinds,
        "intermediate_size": int(cfg.get("prefix_dense_intermediate_size") or experts_width),
        "moe_intermediate_size": experts_width,
    }


def _windowed_or_full(remainder: int) -> str:
    """A layer type by its place in a pattern: full attention on the pattern's last layer (remainder 0)."""
    return "sliding_attention" if remainder else "full_attention"


def _cohere2_moe_forced_rope(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Cohere2-MoE's layers that turn rope without a window: its dense ones where `prefix_dense_sliding_window_pattern`
    is 1 (transformers' `force_rope`)."""
    if int(cfg.get("prefix_dense_sliding_window_pattern") or 1) != 1:
        return ()
    return tuple(i for i, kind in enumerate(cfg.get("mlp_layer_types") or ()) if kind == "dense")


def _cohere2_moe_experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """Cohere2-MoE's experts on the layers `mlp_layer_types` calls "sparse" (`_cohere2_moe_config`): the top-k router
    logits softmaxed (the renormalised top-k of the softmax) or their sigmoids (renormalised with `norm_topk_prob`),
    one group of DeepSeek-V3's router without a bias; `num_shared_experts` shared experts as one MLP that many times
    `moe_intermediate_size` wide, added to the routed output (`sum`) or averaged with it (`average`: each half,
    `routed_scaling_factor` and `shared_expert_scale`). ValueError for another router or combination."""
    experts, top_k = int(cfg.get("num_experts") or 8), int(cfg.get("num_experts_per_tok") or 2)
    selection = cfg.get("expert_selection_fn") or "softmax"
    combination = cfg.get("shared_expert_combination_strategy") or "average"
    if selection not in _COHERE2_MOE_ROUTERS or combination not in _COHERE2_MOE_COMBINATIONS:
        raise ValueError(f"cohere2_moe with expert_selection_fn {selection!r} and shared_expert_combination_strategy "
                         f"{combination!r} is not supported (softmax or sigmoid; sum or average)")  # fmt: skip
    if not 1 <= top_k <= experts:
        raise ValueError(f"cohere2_moe: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]")
    shared = int(cfg.get("num_shared_experts") or 0)
    halves = 0.5 if shared and combination == "average" else 1.0
    width = int(cfg["moe_intermediate_size"])
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=selection == "softmax" or bool(cfg.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=width * shared,
        shared_expert_gated=False,
        shared_expert_scale=halves,
        dense_layers=_dense_layers(cfg),
        grouped_router=True,
        moe_scoring=selection,
        router_score_bias=False,
        routed_scaling_factor=halves,
    )


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


# LFM3 as transformers fills in what its config.json leaves out: the layers' kinds (a full-attention layer in every 4
# from the third, a windowed one from the fifth, convolutions between) and each kind's rope.
_LFM3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}


def _lfm3_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """An LFM3 `config.json` with what transformers fills in (`_LFM3_ROPE`, its layer kinds, a 256-position window),
    its attention gate and sandwich norms on (refused off: `use_attention_gate`, `use_sandwich_norm`)."""
    layers = int(cfg["num_hidden_layers"])
    for key in ("use_attention_gate", "use_sandwich_norm"):
        if not cfg.get(key, True):
            raise ValueError(f"lfm3 with {key} false is not supported")
    types = cfg.get("layer_types") or [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
        for i in range(layers)
    ]
    return {**cfg, "layer_types": types, "rope_parameters": cfg.get("rope_parameters") or _LFM3_ROPE,
            "sliding_window": cfg.get("sliding_window", 256)}  # fmt: skip


def _lfm3_fields(model_type: str, rotated_angles: int) -> dict[str, Any]:
    """LFM3's `ModelConfig` fields ({} for the other families): Gemma's sandwich norms, each attention head's output
    gated (its `g_proj` read into q_proj, `models.lfm2`), its full layers' proportional rope (`rotated_angles`)."""
    if model_type != "lfm3":
        return {}
    return {"sandwich_norms": True, "attention_output_gate": True, "rope_rotated_angles": rotated_angles}


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


def _nanochat_fields(arch: Architecture, cfg: dict[str, Any]) -> dict[str, Any]:
    """NanoChat's embedding norm and its logits' soft cap (`final_logit_softcapping`, 15 by default as transformers
    fills it in; None: no cap); {} for the other families."""
    if arch != "nanochat":
        return {}
    cap = cfg.get("final_logit_softcapping", 15.0)
    return {"embedding_norm": True, "final_logit_softcap": float(cap or 0.0)}


def _laguna_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Laguna's softplus gate on each head's output (`gating`: true or "per-head", one value a head; "per-element" or
    false, one a dim) and its query heads per layer (`num_attention_heads_per_layer`, each a multiple of the KV
    heads); {} for the other families. ValueError for a head list that does not fit, and for what transformers'
    Laguna builds and this engine does not: router logits soft-capped, router weights on the experts' input."""
    if model_type != "laguna":
        return {}
    layers, kv_heads = int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    heads = [int(n) for n in cfg.get("num_attention_heads_per_layer") or ()]
    if heads and (len(heads) != layers or any(n < 1 or n % kv_heads for n in heads)):
        raise ValueError(f"laguna num_attention_heads_per_layer {heads} must give each of the {layers} layers a "
                         f"multiple of its {kv_heads} KV heads")  # fmt: skip
    per_layer = tuple(heads) if len(set(heads) | {int(cfg["num_attention_heads"])}) > 1 else ()
    if float(cfg.get("moe_router_logit_softcapping") or 0.0) or cfg.get("moe_apply_router_weight_on_input"):
        raise ValueError("laguna with moe_router_logit_softcapping or moe_apply_router_weight_on_input is not "
                         "supported")
    gating = cfg.get("gating", True)
    if gating not in (True, False, "per-head", "per-element"):
        raise ValueError(f"laguna gating {gating!r} is not supported (true, false, per-head or per-element)")
    # (as transformers builds it, false gates each element too)
    gate = "head" if gating in (True, "per-head") else "element"
    return {"attention_softplus_gate": gate, "layer_q_head_counts": per_layer}


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


def _minicpm3_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniCPM3's muP scales as `ModelConfig` fields ({} for the other families): its embeddings times `scale_emb`,
    each residual branch times `scale_depth / sqrt(num_hidden_layers)`, the logits divided by `hidden_size /
    dim_model_base` (a `None` of either: 1, as transformers reads it)."""
    if model_type != "minicpm3":
        return {}
    layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    depth = cfg.get("scale_depth", 1.4)
    base = cfg.get("dim_model_base", 256)
    return {
        "embedding_multiplier": float(cfg.get("scale_emb", 12)),
        "residual_multiplier": 1.0 if depth is None else float(depth) / math.sqrt(layers),
        "logits_scaling": 1.0 if base is None else hidden / float(base),
    }


def _jais2_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Jais 2's `ModelConfig` fields ({} for the other families): LayerNorms with biases (`layer_norm_eps` their
    epsilon) and its ungated MLP's biases (`mlp_bias`, on in its config's default and releases)."""
    if model_type != "jais2":
        return {}
    return {"layer_norm": True, "layer_norm_bias": True, "mlp_bias": bool(cfg.get("mlp_bias", True))}


def _granite_fields(arch: Architecture, model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers as `ModelConfig` fields (Granite's and Granite MoE's; {} for the other families);
    ValueError for a Granite whose MLP has biases (`mlp_bias`), which no Granite release sets and this engine does
    not build. HyperCLOVA X SEED's (`hyperclovax`): its logits times `logits_scaling` (`logit_scale`), its scores
    scaled by head_dim ** -0.5 where `attention_multiplier` is null, its sandwich norms where `use_post_norm` (its
    default) is on."""
    if arch not in ("granite", "granitemoe"):
        return {}
    if cfg.get("mlp_bias"):
        raise ValueError(f"{model_type} with mlp_bias is not supported")
    if model_type == "hyperclovax":
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        scale = cfg.get("attention_multiplier")
        return {
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "attention_scale": float(head_dim**-0.5 if scale is None else scale),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "logit_scale": float(cfg.get("logits_scaling", 1.0)),
            "sandwich_norms": bool(cfg.get("use_post_norm", True)),
        }
    return {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }


# Granite SWA and Granite-MoE SWA: windows, attention sinks and a rope base per layer (`_granite_swa_config`).
_GRANITE_SWA_TYPES = ("granite_swa", "granitemoe_swa")
_GRANITE_SWA_WINDOW = 128  # transformers' default `sliding_window` for them
_GRANITE_SWA_GLOBAL_EVERY = 4  # without `layer_types`, every 4th layer (from the first) attends to all


def _granite_swa_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Granite SWA or Granite-MoE SWA `config.json` with what transformers fills in where it is absent: a window of
    128 (`sliding_window`), and layer types with every 4th layer, from the first, full attention."""
    layers = int(cfg["num_hidden_layers"])
    default_types = ["full_attention" if i % _GRANITE_SWA_GLOBAL_EVERY == 0 else "sliding_attention"
                     for i in range(layers)]  # fmt: skip
    return {
        **cfg,
        "sliding_window": cfg.get("sliding_window", _GRANITE_SWA_WINDOW),
        "layer_types": cfg.get("layer_types") or default_types,
    }


def _granite_swa_theta(model_type: str, cfg: dict[str, Any], theta: float) -> float:
    """Granite SWA's rope base: the one its `layer_rope_theta` gives every layer with rope (0 there: no rope,
    `_nope_layers`), or `theta` without the list. ValueError for layers of different bases, which the shared rope
    table (one base, and a windowed layers' one only as Gemma 3's) does not build."""
    bases = {float(base) for base in cfg.get("layer_rope_theta") or () if base}
    if len(bases) > 1:
        raise ValueError(f"{model_type} with layer_rope_theta of several bases {sorted(bases)} is not supported")
    return bases.pop() if bases else theta


def _nope_layers(model_type: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's and Llama 4's layers without rope: where `no_rope_layers` is 0, or (without that list) every
    `no_rope_layer_interval`-th layer (4), as transformers builds them; EXAONE 4's global (unwindowed) layers when
    it has windows at all; Cohere 2's unwindowed layers (all of them without a window, as transformers turns rope
    on windowed layers alone); every layer of a Granite 4.0 whose `position_embedding_type` is not "rope" (its H
    models' "nope", or none); every layer of an OLMo Hybrid whose rope base is null; every layer of Nemotron-H and
    of the ALiBi models (BLOOM, MPT, Falcon-RW); () for the other families."""
    # (Zamba2's shared blocks' rope is optional; Zamba's have none)
    no_mem_rope = model_type in ("zamba2", "zamba") and not cfg.get("use_mem_rope")
    if model_type in ("nemotron_h", "bloom", "mpt") or (model_type == "falcon" and cfg.get("alibi")) or no_mem_rope:
        return tuple(range(int(cfg["num_hidden_layers"])))  # their attention turns no rope (BLOOM's, MPT's: ALiBi)
    if model_type in ("beam", "ergo"):  # the kinds of layer their rope parameters leave null
        rope = cfg["rope_parameters"]
        return tuple(i for i, kind in enumerate(cfg["layer_types"]) if rope.get(kind) is None)
    if model_type in _MAMBA2_HYBRIDS:
        rope = cfg.get("position_embedding_type") == "rope"
        return () if rope else tuple(range(int(cfg["num_hidden_layers"])))
    if model_type == "lara_mini":  # its full-attention layers turn no rope, its windowed ones do
        return tuple(i for i, kind in enumerate(_lara_mini_layer_types(cfg)) if kind == "full_attention")
    if model_type in ("exaone4", "exaone_moe", "kolibri1", "flint"):
        windows = _layer_windows(model_type, cfg)
        return tuple(i for i, window in enumerate(windows) if not window)
    if model_type in _GRANITE_SWA_TYPES:  # its layers of rope base 0
        return tuple(i for i, base in enumerate(cfg.get("layer_rope_theta") or ()) if not base)
    if model_type == "jamba":  # its attention turns no rope
        return tuple(range(int(cfg["num_hidden_layers"])))
    if model_type == "olmo_hybrid":  # no rope where its rope base is null (its released checkpoints'), in
        # `rope_parameters` or, without them, at the top as transformers reads it into them; else rope (10,000)
        rope = cfg.get("rope_parameters")
        base = rope if isinstance(rope, dict) else cfg
        nope = "rope_theta" in base and base["rope_theta"] is None
        return tuple(range(int(cfg["num_hidden_layers"]))) if nope else ()
    if model_type == "afmoe":  # rope on its windowed layers alone
        return tuple(i for i, kind in enumerate(_afmoe_layer_types(cfg)) if kind == "full_attention")
    if model_type == "cohere_compass_text":  # no rope on the layers of a type whose rope parameters are null
        by_type = cfg.get("rope_parameters") or {}
        return tuple(i for i, kind in enumerate(cfg.get("layer_types") or ()) if by_type.get(kind, {}) is None)
    if model_type in ("cohere2", "cohere2_moe"):  # rope on its windowed layers only: with no window, on none
        windows = _layer_windows(model_type, cfg) or (0,) * int(cfg["num_hidden_layers"])
        # Cohere2-MoE's dense layers turn rope too when its prefix pattern is 1 (each of them global)
        forced = _cohere2_moe_forced_rope(cfg) if model_type == "cohere2_moe" else ()
        return tuple(i for i, window in enumerate(windows) if not window and i not in forced)
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
    experts', which has no dense layer and no `intermediate_size`, its experts' width; a model without MLPs (state
    space models, `hf_mamba`), its 0."""
    if arch == "llama4":
        return int(cfg["intermediate_size_mlp"])
    if arch == "granitemoe" and not cfg.get("num_local_experts"):
        return int(cfg["shared_intermediate_size"])
    width = cfg.get("intermediate_size")
    return int(width if width is not None else cfg["moe_intermediate_size"])


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
_GLOBAL_EVERY = {"gemma3_text": 6, "cohere2": 4, "cohere2_moe": 4, "kolibri1": 5}


def _afmoe_layer_types(cfg: dict[str, Any]) -> list[str]:
    """AFMoE's `layer_types`, or (a config without them) every `global_attn_every_n_layers`-th layer full attention
    and the others windowed, as transformers fills them in."""
    every = int(cfg.get("global_attn_every_n_layers") or 4)
    layers = int(cfg["num_hidden_layers"])
    return list(cfg.get("layer_types") or
                ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)])  # fmt: skip


# The families in GLM-4.5's layout (`glm4_moe`) whose rope turns each whole head (GLM-4.5's: half).
_WHOLE_ROPE_GLM4_MOE = ("solar_open", "exaone_moe", "hy_v3", "sarvam_moe", "dots1", "laguna", "kolibri1", "flint",
                        "param2moe", "minicpm5_moe")


# Families transformers builds as Llama, which reads no `sliding_window` (their configs may still carry one).
_WINDOWLESS = ("internlm3", "iquestcoder")


def _layer_windows(model_type: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's attention window, as transformers builds the model: where `layer_types` is given, its
    "sliding_attention" layers get `sliding_window`; otherwise Qwen's layers from `max_window_layers` on do when
    `use_sliding_window` is set (dots.llm1's whether or not it is), Gemma 3's and Cohere 2's but every
    `sliding_window_pattern`-th (6, 4: `_GLOBAL_EVERY`), and every layer of any other family does when
    `sliding_window` is set. () when no layer has a window. ValueError for a window that is not a positive integer or
    a layer type not known."""
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
    if model_type == "lara_mini":  # (its linear layers attend to nothing: no window)
        types = ["full_attention" if kind == "linear_attention" else kind for kind in _lara_mini_layer_types(cfg)]
    if types is not None and model_type == "lfm3":  # its convolution layers attend to nothing: no window
        types = ["full_attention" if kind == "conv" else kind for kind in types]
    if types is not None:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown or len(types) != layers:
            raise ValueError(f"layer_types must name one of sliding_attention, full_attention for each of the "
                             f"{layers} layers; got {types!r}")
        windowed = [kind == "sliding_attention" for kind in types]
    elif model_type.startswith("qwen") or model_type == "dots1":  # (dots.llm1's whatever `use_sliding_window` says)
        first = int(cfg.get("max_window_layers", layers))
        windowed = [i >= first for i in range(layers)]
    elif model_type in _GLOBAL_EVERY:  # an earlier config: every `sliding_window_pattern`-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or _GLOBAL_EVERY[model_type])
        windowed = [(i + 1) % pattern != 0 for i in range(layers)]
    elif model_type in ("gemma2", "vaultgemma", "gpt_oss"):  # an earlier config: the even layers are local, the odd
        # ones global
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
    """The `ModelConfig` fields a Gemma (`gemma`), Gemma 2 (`gemma2`; VaultGemma's, `vaultgemma`, without its sandwich
    norms) or Gemma 3 text (`gemma3_text`) `config.json` sets apart, with `rope_theta` (Gemma 3: the global layers'
    base), from either layout: transformers 5's `rope_parameters` (per layer type for Gemma 3), or the earlier
    `rope_theta`, `rope_local_base_freq` and `rope_scaling`. ValueError for what is not implemented: logit
    soft-capping on Gemma 3 (it sets none), bidirectional attention, a Gemma 3 without a sliding window, a rope type
    other than default (and linear on Gemma 3's global layers), another activation. Gemma (1) is the pre-norm block
    of Llama with Gemma's norms, embeddings and GeGLU: no sandwich norms, no soft-caps, no windows, queries scaled by
    the head dim."""
    gemma3, gemma1, vault = model_type == "gemma3_text", model_type == "gemma", model_type == "vaultgemma"
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
        "sandwich_norms": not (gemma1 or vault),
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
    # (Gemma 4 Unified's "vision": its image tokens attend both ways, its text tokens causally, as served here)
    if cfg.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise ValueError(f"gemma4_text with use_bidirectional_attention {cfg['use_bidirectional_attention']!r} is not "
                         "supported")  # fmt: skip
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
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen4_exp", "llama4",
        "glm4_moe", "minimax_m2", "ernie4_5_moe", "lfm2", "granitemoe", "hunyuan", "afmoe", "cohere", "jamba", "dbrx",
    ):  # fmt: skip
        return {}
    if arch == "hunyuan":
        return _hunyuan_experts(cfg)
    if arch == "afmoe":
        return _afmoe_experts(cfg)
    if arch == "jamba":  # the top-k of the softmax, not renormalised, on its expert layers (none: all dense)
        moe = _jamba_expert_layers(cfg)
        layers = int(cfg["num_hidden_layers"])
        return {} if not moe else dict(
            num_experts=int(cfg.get("num_experts") or 16),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 2),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=False,
            dense_layers=tuple(i for i in range(layers) if i not in moe),
        )
    if arch == "cohere":  # Cohere2-MoE's experts; Command R's and Command A's dense models
        return _cohere2_moe_experts(cfg) if cfg.get("model_type") == "cohere2_moe" else {}
    if cfg.get("model_type") in ("youtu", "minicpm3"):  # DeepSeek-V3's attention, no experts
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
        if model_type == "flint":  # the top-k of its sigmoid scores, no bias
            method = "greedy"
        served = (("sigmoid", "noaux_tc"), ("softmax", "group_limited_greedy"), ("softmax", "greedy"),
                  ("sigmoid", "greedy"))  # fmt: skip
        if (scoring, method) not in served:
            raise ValueError(f"{model_type} routing by {scoring} scores with {method} is not supported")
        groups, top_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if experts % groups or not 1 <= top_groups <= groups:
            raise ValueError(f"{model_type}: {experts} experts in {groups} groups, {top_groups} of them chosen")
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type not in ("deepseek_v2", "dots1", "kolibri1"))),
            shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"])
            if model_type in ("laguna", "kolibri1", "flint")
            else int(cfg["moe_intermediate_size"])
            * int(cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or 0),  # (K-EXAONE's name for it)
            shared_expert_gated=False,
            dense_layers=_dense_layers(cfg),
            grouped_router=True,
            moe_scoring=scoring,
            router_score_bias=method == "noaux_tc",
            moe_groups=groups if method != "greedy" else 1,
            moe_topk_groups=top_groups if method != "greedy" else 1,
            moe_group_score="max" if model_type == "deepseek_v2" else "top2",
            moe_output_norm=model_type == "axk1",
            moe_choice_on_logits=model_type == "kolibri1",
            # (Hy3's `router_scaling_factor`)
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or cfg.get("router_scaling_factor")
                                        or cfg.get("moe_routed_scaling_factor") or 1.0),  # (Laguna's name)
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
    if arch in ("mixtral", "olmoe", "dbrx"):  # (DBRX's renormalisation as `hf_dbrx.dbrx_config` reads it)
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        )
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_mlp = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    if cfg.get("model_type") == "mellum":  # its own per-layer MLP kinds (all sparse where unset)
        only_mlp, step = _mlp_kind_layers(cfg, "dense"), 1
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        # Qwen3.5's MoE router always renormalises (its config has no norm_topk_prob).
        norm_topk_prob=bool(cfg.get("norm_topk_prob", arch in ("qwen3_next", "qwen4_exp"))),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch in ("qwen2_moe", "qwen3_next", "qwen4_exp")
        else 0,
        shared_expert_gated=cfg.get("model_type") != "lara_mini",  # (Lara Mini's is added whole)
        dense_layers=tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step != 0),
    )


def _mlp_kind_layers(cfg: dict[str, Any], kind: str) -> set[int]:
    """The layers `mlp_layer_types` says are `kind` ("dense" or "sparse"; none where the config has no list).
    ValueError for a list of another length or with another kind."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        return set()
    layers = int(cfg["num_hidden_layers"])
    if len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must name dense or sparse for each of the {layers} layers; got {kinds!r}")
    return {i for i, each in enumerate(kinds) if each == kind}


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


def _diffllama_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """DiffLlama's differential attention ({} for other families); ValueError for an odd count of KV heads (its
    values split into two halves of them, as transformers refuses too)."""
    if model_type != "diffllama":
        return {}
    kv_heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or 32)
    if kv_heads % 2:
        raise ValueError(f"diffllama needs an even count of KV heads (its values in two halves); got {kv_heads}")
    return {"differential_attention": True}
