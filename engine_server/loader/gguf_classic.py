"""The classic decoders' GGUF files as llama.cpp's converter writes them (`gpt2`, `starcoder` (GPT-BigCode), `gptneox`,
`falcon`, `phi2`, `stablelm`, `starcoder2`, `nemotron`, `olmo`, `exaone`, `bloom`, `mpt`): their metadata as each
family's own `config.json` keys (`classic_gguf_config`), so transformers loads the converted folder as the family it
is, and the tensor names and forms llama.cpp gives them (`CLASSIC_LAYER_NAMES`, `CLASSIC_GLOBAL_NAMES`; GPT-NeoX's,
Falcon's and BLOOM's q/k/v rows, which their converters group as `cat(q, k, v)`, given back grouped by KV head with
`kv_grouped_qkv_rows`)."""

from __future__ import annotations

from typing import Any

import numpy as np

# llama.cpp's architecture names of the classic families and the (model_type, architectures entry) each converts to.
CLASSIC_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
    "starcoder": ("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "gptneox": ("gpt_neox", "GPTNeoXForCausalLM"),
    "falcon": ("falcon", "FalconForCausalLM"),
    "phi2": ("phi", "PhiForCausalLM"),
    "stablelm": ("stablelm", "StableLmForCausalLM"),
    "starcoder2": ("starcoder2", "Starcoder2ForCausalLM"),
    "nemotron": ("nemotron", "NemotronForCausalLM"),
    "olmo": ("olmo", "OlmoForCausalLM"),
    "exaone": ("exaone", "ExaoneForCausalLM"),
    "bloom": ("bloom", "BloomForCausalLM"),
    "mpt": ("mpt", "MptForCausalLM"),
}
# Those whose norms are LayerNorms, their epsilon `attention.layer_norm_epsilon` (OLMo's weightless ones too).
CLASSIC_LAYER_NORMED = ("gpt2", "starcoder", "gptneox", "falcon", "phi2", "stablelm", "starcoder2", "nemotron", "olmo",
                        "bloom", "mpt")  # fmt: skip
# Each family's name for the LayerNorms' epsilon in its config (OLMo's is fixed: none).
_EPSILON_KEYS = {"gpt2": "layer_norm_epsilon", "gpt_bigcode": "layer_norm_epsilon", "gpt_neox": "layer_norm_eps",
                 "falcon": "layer_norm_epsilon", "phi": "layer_norm_eps", "stablelm": "layer_norm_eps",
                 "starcoder2": "norm_epsilon", "nemotron": "norm_eps", "bloom": "layer_norm_epsilon",
                 "mpt": "layer_norm_epsilon"}  # fmt: skip
# The MLP's activation, which llama.cpp fixes per architecture: GPT-NeoX's is the exact GELU its checkpoints were
# trained with (Pythia's `gelu`; llama.cpp runs its tanh form), Phi-2's and StarCoder2's the tanh form.
_ACTIVATIONS = {"gpt_neox": "gelu", "falcon": "gelu", "phi": "gelu_new", "starcoder2": "gelu_pytorch_tanh",
                "nemotron": "relu2", "gpt2": "gelu_new", "gpt_bigcode": "gelu_pytorch_tanh"}
# llama.cpp's tensor names and each family's checkpoint names for them, by the model_type the file converts to.
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_GPT2_LAYER = {
    "attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}  # fmt: skip
_GPT2_GLOBAL = {
    "token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
}  # fmt: skip
CLASSIC_LAYER_NAMES: dict[str, dict[str, str]] = {
    "gpt2": _GPT2_LAYER,
    "gpt_bigcode": _GPT2_LAYER,
    "gpt_neox": {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense", "ffn_up": "mlp.dense_h_to_4h",
        "ffn_down": "mlp.dense_4h_to_h",
    },
    "falcon": {  # (40B's and 180B's: `attn_norm` is `ln_mlp`, the one before the MLP: `classic_checkpoint_name`)
        "attn_norm": "input_layernorm", "attn_norm_2": "ln_attn", "attn_qkv": "self_attention.query_key_value",
        "attn_output": "self_attention.dense", "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h",
    },
    "phi": {**_LAYER, "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
    "stablelm": {**_LAYER, "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm"},
    "starcoder2": {**_LAYER, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "nemotron": _LAYER,
    "olmo": _LAYER,
    "bloom": {
        "attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
        "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.dense_h_to_4h",
        "ffn_down": "mlp.dense_4h_to_h",
    },
    "mpt": {
        "attn_norm": "norm_1", "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "ffn_norm": "norm_2",
        "ffn_up": "ffn.up_proj", "ffn_down": "ffn.down_proj",
    },
    "exaone": {
        "attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_q": "attn.attention.q_proj", "attn_k": "attn.attention.k_proj",
        "attn_v": "attn.attention.v_proj", "attn_output": "attn.attention.out_proj", "ffn_gate": "mlp.c_fc_0",
        "ffn_up": "mlp.c_fc_1", "ffn_down": "mlp.c_proj",
    },
}  # fmt: skip
CLASSIC_GLOBAL_NAMES: dict[str, dict[str, str]] = {
    "gpt2": _GPT2_GLOBAL,
    "gpt_bigcode": _GPT2_GLOBAL,
    "gpt_neox": {
        "token_embd.weight": "gpt_neox.embed_in.weight", "output_norm.weight": "gpt_neox.final_layer_norm.weight",
        "output_norm.bias": "gpt_neox.final_layer_norm.bias", "output.weight": "embed_out.weight",
    },
    "phi": {"output_norm.weight": "model.final_layernorm.weight", "output_norm.bias": "model.final_layernorm.bias",
            "output.bias": "lm_head.bias"},
    "exaone": {"token_embd.weight": "transformer.wte.weight", "output_norm.weight": "transformer.ln_f.weight"},
    "falcon": {
        "token_embd.weight": "transformer.word_embeddings.weight", "output_norm.weight": "transformer.ln_f.weight",
        "output_norm.bias": "transformer.ln_f.bias",
    },
    "bloom": {
        "token_embd.weight": "transformer.word_embeddings.weight",
        "token_embd_norm.weight": "transformer.word_embeddings_layernorm.weight",
        "token_embd_norm.bias": "transformer.word_embeddings_layernorm.bias",
        "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
    },
    "mpt": {"token_embd.weight": "transformer.wte.weight", "output_norm.weight": "transformer.norm_f.weight"},
}  # fmt: skip
CLASSIC_LAYERS_PREFIX = {"gpt_neox": "gpt_neox.layers.", "exaone": "transformer.h.", "falcon": "transformer.h.",
                         "gpt2": "transformer.h.", "gpt_bigcode": "transformer.h.", "bloom": "transformer.h.",
                         "mpt": "transformer.blocks."}  # fmt: skip
# GPT-2's Conv1D weights, `[in, out]` in its checkpoints and `[out, in]` in its files (its converter transposes them).
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# StableLM 2's per-head q/k LayerNorms, one `[heads, head_dim]` tensor each in the file, one tensor a head in its
# checkpoints (`headwise_norms`).
HEADWISE_NORMS = (".self_attn.q_layernorm.weight", ".self_attn.k_layernorm.weight")


def classic_gguf_config(arch: str, config: dict[str, Any], tensors: dict[str, Any], read: Any) -> dict[str, Any]:
    """The keys of a classic family's `config.json` from its file (`config` the generic keys read so far, whose
    `rms_norm_eps` holds the LayerNorms' epsilon; `read(key, default)` a metadata value): the epsilon under the
    family's own name, its MLP's activation, its biases and blocks as the file's tensors show them (StableLM's
    parallel block where a layer has no norm before its MLP; GPT-NeoX's as its metadata says), GPT-NeoX's rope share
    as `rotary_pct`, Phi-2's, GPT-2's and Falcon's MLP width from their tensors (their converters write 4 x hidden
    whatever it is), OLMo's `clip_qkv`, BLOOM's and MPT's blocks (`_alibi_gguf_keys`)."""
    model_type = CLASSIC_GGUF_ARCHITECTURES[arch][0]
    keys: dict[str, Any] = {}
    if model_type in _EPSILON_KEYS:
        keys[_EPSILON_KEYS[model_type]] = config.pop("rms_norm_eps")
    if model_type in _ACTIVATIONS:
        keys["hidden_act"] = _ACTIVATIONS[model_type]
    if model_type == "gpt_neox":  # two norms either way: parallel as its metadata says (llama.cpp's default, on)
        keys.update(use_parallel_residual=bool(read(f"{arch}.use_parallel_residual", True)),
                    attention_bias="blk.0.attn_qkv.bias" in tensors,
                    rotary_pct=config.pop("partial_rotary_factor", 1.0), rotary_emb_base=config["rope_theta"])
    elif model_type in ("gpt2", "gpt_bigcode"):  # their own keys; the MLP's width from its tensors (their
        # converters write 4 x hidden), GPT-BigCode's one KV head (llama.cpp reads no other)
        keys.update(activation_function=keys.pop("hidden_act"), n_inner=int(tensors["blk.0.ffn_up.weight"].shape[-1]))
        config.pop("head_dim")
        keys["attention_bias"] = "blk.0.attn_qkv.bias" in tensors
        if model_type == "gpt_bigcode":
            keys["multi_query"] = int(config["num_key_value_heads"]) == 1
    elif model_type == "falcon":  # its activation's key is `activation`
        keys.update(_falcon_gguf_shape(config, tensors), activation=keys.pop("hidden_act"))
    elif model_type == "phi":
        keys["intermediate_size"] = int(tensors["blk.0.ffn_up.weight"].shape[-1])
    elif model_type == "stablelm":
        keys.update(use_parallel_residual="blk.0.ffn_norm.weight" not in tensors,  # (12B's: one norm feeds both)
                    use_qkv_bias=config.pop("attention_bias"),
                    qk_layernorm="blk.0.attn_q_norm.weight" in tensors)
    elif model_type == "starcoder2":
        keys["use_bias"] = config.pop("attention_bias")
    elif model_type == "nemotron":
        keys["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    elif model_type == "olmo":
        config.pop("rms_norm_eps")
        clip = read(f"{arch}.attention.clamp_kqv", None)
        keys["clip_qkv"] = None if clip is None else short_float(clip)
    elif model_type in ("bloom", "mpt"):
        keys.update(_alibi_gguf_keys(model_type, config, tensors, read))
    return keys


def _alibi_gguf_keys(model_type: str, config: dict[str, Any], tensors: dict[str, Any], read: Any) -> dict[str, Any]:
    """BLOOM's and MPT's `config.json` keys from their files: their MLP's activation is their own (no `hidden_act`);
    BLOOM's biases as its q/k/v's show them; MPT's context as `max_seq_len`, its MLP's width from its tensors (its
    converter writes 4 x hidden), its `attn_config` (`attention.max_alibi_bias`, 0 without ALiBi, an integer in its
    config; `attention.clamp_kqv`; grouped K/V where its KV heads are fewer, q/k LayerNorms where the file has them)
    and `no_bias` as its tensors show them, so that what this engine does not build is refused by name
    (`hf_classic`)."""
    config.pop("hidden_act")
    if model_type == "bloom":
        return {"attention_bias": "blk.0.attn_qkv.bias" in tensors}
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    clip, bias_max = read("mpt.attention.clamp_kqv", None), short_float(read("mpt.attention.max_alibi_bias", 0.0))
    grouped = int(config["num_key_value_heads"]) != heads
    attention = {
        "alibi": bias_max > 0, "alibi_bias_max": int(bias_max) if bias_max.is_integer() else bias_max,
        "clip_qkv": None if clip is None else short_float(clip), "qk_ln": "blk.0.attn_q_norm.weight" in tensors,
        "attn_type": "grouped_query_attention" if grouped else "multihead_attention",
    }  # fmt: skip
    return {
        "max_seq_len": config.pop("max_position_embeddings"), "attn_config": attention,
        "expansion_ratio": int(tensors["blk.0.ffn_up.weight"].shape[-1]) // hidden,
        "no_bias": not any(name.endswith(".bias") for name in tensors),
    }


def short_float(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); keep the shortest decimal."""
    return float(str(np.float32(value)))


def _falcon_gguf_shape(config: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """A `falcon` file's Falcon as its config says it: llama.cpp runs every file's block in parallel, its attention
    off a second norm where a layer has one (`attn_norm_2`: 40B's and 180B's new decoder architecture), else both
    halves off the one (7B's multi-query attention with one KV head; Falcon2 11B's new architecture with one norm);
    MLP width and biases from its tensors (its converter writes 4 x hidden)."""
    kv_heads = int(config["num_key_value_heads"])
    config.pop("head_dim")  # hidden / heads, and read-only in transformers' FalconConfig
    two_norms = "blk.0.attn_norm_2.weight" in tensors
    new = two_norms or kv_heads > 1
    return {
        "new_decoder_architecture": new, "multi_query": not new, "parallel_attn": True,
        "num_kv_heads": kv_heads if new else config["num_attention_heads"],
        "num_ln_in_parallel_attn": (2 if two_norms else 1) if new else None,
        "ffn_hidden_size": int(tensors["blk.0.ffn_up.weight"].shape[-1]), "bias": "blk.0.attn_qkv.bias" in tensors,
        "alibi": False,
    }  # fmt: skip


def classic_checkpoint_name(name: str, config: dict[str, Any]) -> str:
    """HF tensor `name` (`hf_tensor_name`'s) as a classic family's checkpoint holds it where the config decides it:
    a Falcon file with two norms a layer (40B's, 180B's) holds `ln_mlp` as `attn_norm` (llama.cpp's MLP reads it) and
    `ln_attn` as `attn_norm_2` (its attention does)."""
    if config["model_type"] == "falcon" and config.get("num_ln_in_parallel_attn") == 2:
        return name.replace(".input_layernorm.", ".ln_mlp.")
    return name


def kv_grouped_qkv_rows(array: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """A GPT-NeoX or Falcon file's `attn_qkv` rows, `cat(q, k, v)` as their converters arrange them, grouped by KV
    head again as their checkpoints hold `query_key_value` (each group's queries, then its key and its value; a
    group a head in GPT-NeoX's)."""
    head_dim = array.shape[0] // (heads + 2 * kv_heads)
    q, k, v = np.split(array, [heads * head_dim, (heads + kv_heads) * head_dim])
    groups = [part.reshape(kv_heads, -1, head_dim, *array.shape[1:]) for part in (q, k, v)]
    return np.concatenate(groups, axis=1).reshape(array.shape)


def headwise_norms(name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A StableLM 2 file's `[heads, head_dim]` q or k LayerNorm weight (HF name `name`) as its checkpoints hold it:
    one `norms.<head>.weight` a head."""
    stem = name.removesuffix(".weight")
    return [(f"{stem}.norms.{head}.weight", row) for head, row in enumerate(array.reshape(array.shape[0], -1))]
