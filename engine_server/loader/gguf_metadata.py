"""GGUF metadata → a Hugging Face `config.json` dict (llama, Mixtral as llama with experts, llama4, qwen2 / qwen3 and
their MoE forms, phi3, gemma2 / gemma3 / gemma4, gpt-oss, glm4 / glm4moe / dots1, minimax-m2, deepseek2 (DeepSeek-V2 /
V3, Kimi K2, GLM-4.7-Flash), seed_oss, ernie4_5 / ernie4_5-moe, exaone4, olmo2, command-r / cohere2, the Gated
DeltaNet hybrids qwen35 / qwen35moe / qwen3next, the recurrent hybrids (lfm2, granitehybrid, nemotron_h, falcon-h1,
jamba), the classic decoders (`gguf_classic`) and the state space models mamba / mamba2 (`gguf_state_space`)
`<arch>.*` keys)."""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Container
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from engine_server.loader.gguf_classic import (
    CLASSIC_GGUF_ARCHITECTURES,
    CLASSIC_LAYER_NORMED,
    classic_gguf_config,
    short_float,
)
from engine_server.loader.gguf_dbrx import DBRX_GGUF_ARCHITECTURES, dbrx_gguf_config
from engine_server.loader.gguf_gemma3n import GEMMA3N_GGUF_ARCHITECTURES, gemma3n_gguf_config
from engine_server.loader.gguf_state_space import STATE_SPACE_GGUF_ARCHITECTURES, state_space_gguf_config
from engine_server.pooling.params import PoolingMethod

# GGUF `general.architecture` → (HF model_type, HF architectures entry).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "gemma4": ("gemma4_text", "Gemma4ForCausalLM"),
    "llama4": ("llama4_text", "Llama4ForCausalLM"),
    # Ministral 3 (and Mistral 3's text models in newer conversions): Llama's tensors under YaRN, with Llama 4's query
    # temperature over the original context (`_mistral3_config`).
    "mistral3": ("ministral3", "Ministral3ForCausalLM"),
    "arcee": ("arcee", "ArceeForCausalLM"),  # Arcee AFM: Llama's tensors, an ungated relu² MLP
    # Apertus: Llama's tensors (q/k rows as its checkpoints hold them), q/k norms, an ungated MLP whose xIELU scalars
    # are metadata (`_apertus_config`).
    "apertus": ("apertus", "ApertusForCausalLM"),
    # Hunyuan's dense models: the rope base as its converter writes it, NTK's alpha already applied.
    "hunyuan-dense": ("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "dots1": ("dots1", "Dots1ForCausalLM"),  # dots.llm1: GLM-4.5's experts under Qwen3's attention
    "glm4": ("glm4", "Glm4ForCausalLM"),
    "minimax-m2": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    # DeepSeek-V3's form (sigmoid routing); a file routed by softmax is DeepSeek-V2's (`_deepseek2_config`).
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "glm-dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),  # GLM-5: deepseek2's layers with a sparse-attention indexer
    "seed_oss": ("seed_oss", "SeedOssForCausalLM"),
    "ernie4_5": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "ernie4_5-moe": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "exaone4": ("exaone4", "Exaone4ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "command-r": ("cohere", "CohereForCausalLM"),
    "cohere2": ("cohere2", "Cohere2ForCausalLM"),
    "lfm2": ("lfm2", "Lfm2ForCausalLM"),
    "lfm2moe": ("lfm2_moe", "Lfm2MoeForCausalLM"),
    # Granite 3.x; Granite 3.0's mixtures of experts (a shared MLP beside: granitemoeshared); Granite 4.0's Mamba-2
    # hybrids (llama.cpp writes its dense, attention-only models as `granite` or `granitemoe`).
    "granite": ("granite", "GraniteForCausalLM"),
    "granitemoe": ("granitemoe", "GraniteMoeForCausalLM"),
    "granitehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    # Nemotron-H and Nemotron Nano 2: a block per Mamba-2 layer, attention layer or MLP (`_nemotron_h_config`); Nemotron
    # 3's experts blocks in place of the MLPs.
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM"),
    "nemotron_h_moe": ("nemotron_h", "NemotronHForCausalLM"),
    # Falcon-H1: its multipliers folded into the tensors by llama.cpp's converter (`_falcon_h1_config`).
    "falcon-h1": ("falcon_h1", "FalconH1ForCausalLM"),
    # Jamba: Mamba-1 layers (no KV heads) between attention ones, experts where a layer has a router (`_jamba_config`).
    "jamba": ("jamba", "JambaForCausalLM"),
    # GPT-NeoX, Phi-2, StableLM, StarCoder2, Nemotron-4, OLMo, EXAONE 3 (`gguf_classic`).
    **CLASSIC_GGUF_ARCHITECTURES,
    # Mamba (Falcon Mamba's too) and Mamba-2, without attention (`gguf_state_space`).
    **STATE_SPACE_GGUF_ARCHITECTURES,
    # DBRX: its nested config (`gguf_dbrx`), LayerNorms, q/k/v in one tensor clamped to `attention.clamp_kqv`.
    **DBRX_GGUF_ARCHITECTURES,
    # Gemma 3n: Gemma 4's layers under AltUp's streams, LAuReL, sparse MLPs (`gguf_gemma3n`).
    **GEMMA3N_GGUF_ARCHITECTURES,
}
# llama.cpp's converter writes this context length for a Mamba-2 hybrid without rope (no limit of its own); such a
# Granite 4.0 or Nemotron-H file is read with the released models' 128K context (Granite 4.0's, Nemotron Nano 2's:
# `_granite_config`, `_nemotron_h_config`), as a bound for --max-model-len.
_NO_CONTEXT_STATED = 2**20
_HYBRID_CONTEXT = 131072
# Architectures whose norms are LayerNorms (`attention.layer_norm_epsilon`), not RMSNorms.
_LAYER_NORMED = ("command-r", "cohere2", "dbrx", *CLASSIC_LAYER_NORMED)
# Cohere 2 as llama.cpp reads a `cohere2` file: every 4th layer global (its windows' pattern is fixed there).
_COHERE2_GLOBAL_EVERY = 4
# The hybrids of Gated DeltaNet linear attention and full attention (`gguf_convert` says how their tensors are laid).
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
# A `llama` file with experts is Mixtral (llama.cpp writes Mixtral under its llama architecture).
_MIXTRAL = ("mixtral", "MixtralForCausalLM")
# Whether llama.cpp renormalises the top-k routing weights (its `norm_w`, fixed per architecture): Mixtral and
# Qwen3-MoE do, Qwen2-MoE does not.
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "qwen3next": True, "qwen35moe": True}

# Gemma as llama.cpp reads it: which layers are global (every 2nd in Gemma 2, every 6th in Gemma 3, unless the file
# says), the windowed layers' rope base in Gemma 3, and the layer count of the 27B models, whose attention scale is
# sqrt(hidden / heads) rather than sqrt(head_dim) (llama.cpp derives it from the size: the files do not store it).
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# Llama 3.x and Llama 4 files carry their rope scaling only as a `rope_freqs` tensor of per-frequency divisors;
# these are the (low, high) band edges the released models use, each checked against the tensor before being
# trusted: Llama 3.1/3.2's, and Llama 4 Scout's single edge (no frequency between the bands).
_LLAMA3_FREQ_BANDS = ((1.0, 4.0), (1.0, 1.0))
_LLAMA3_ORIGINAL_CONTEXT = 8192

# Llama 4 as llama.cpp reads a `llama4` file: what its converter does not store is fixed there, as Scout and
# Maverick have it: every 4th layer turns no rope and attends to every position, the others within chunks of 8,192
# positions; the NoPE layers' attention temperature (floor 8,192, scale 0.1); weightless q/k norms on the rope
# layers, but in the 128-expert model (Maverick).
_LLAMA4_NOPE_EVERY = 4
_LLAMA4_CHUNK = 8192
_LLAMA4_TEMPERATURE = {"floor_scale": 8192, "attn_scale": 0.1}
_LLAMA4_EXPERTS_WITHOUT_QK_NORM = 128

# gpt-oss as llama.cpp reads a `gpt-oss` file: its experts' clamped SwiGLU (`swiglu_oai`: alpha 1.702, limit 7), every
# second layer windowed (unless the file's `attention.sliding_window_pattern` says); YaRN's betas where the file
# gives them (else the config's defaults, llama.cpp's too). The released config's YaRN keeps its correction range
# unrounded (`truncate` false); llama.cpp
# rounds it, but the model was trained without. Generation ends at `<|return|>` and `<|call|>` (llama.cpp's
# end-of-generation tokens for harmony), not at `<|end|>`, which closes each message, the reasoning's too.
_GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
_GPT_OSS_WINDOW_EVERY = 2
_HARMONY_STOPS = ("<|return|>", "<|call|>")
_HARMONY_MESSAGE_END = "<|end|>"


_U64 = struct.Struct("<Q")
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


class GgufFile(GGUFReader):
    """gguf's reader, its parse ~20x faster: it slices the file's mapping once per value it reads (a vocabulary's
    strings twice each: ~200,000 slices for the embedded model's 49,152 tokens and 48,900 merges, and as many again
    for its scores and token types), and a slice of a `numpy.memmap` runs that class's Python-level `__getitem__` and
    `__array_finalize__`, 2 s of a 2.7 s parse. Here the mapping is held as a plain array over the same pages
    (`data`), whose slices are numpy's own, and a little-endian file's arrays are cut in one pass each (`_array_parts`:
    a length read with `struct`, one slice per string, numbers sliced out of one view of the whole array) rather than
    by gguf's reader's per-element dtype probes and byte-order views; every field and tensor reads as gguf's reader
    gives it (its tensors' `data` plain read-only arrays over the file, not memmaps)."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._pages

    @data.setter
    def data(self, mapping: np.ndarray) -> None:
        self._pages: np.ndarray = mapping.view(np.ndarray)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if raw_type == GGUFValueType.ARRAY and self.byte_order == "I" and _LITTLE_ENDIAN_HOST:
            parts = self._array_parts(orig_offs)
            if parts is not None:
                return parts
        return super()._get_field_parts(orig_offs, raw_type)

    def _array_parts(
        self, offset: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]] | None:
        """An array of strings or numbers as gguf's reader parts it (its item type and length, then per item its
        length and bytes, or its one-element array), or None for an array of arrays (left to gguf's reader)."""
        pages = self._pages
        item_type = GGUFValueType(int(pages[offset : offset + 4].view(np.uint32)[0]))
        count = int(pages[offset + 4 : offset + 12].view(np.uint64)[0])
        parts: list[npt.NDArray[Any]] = [pages[offset : offset + 4].view(np.uint32), pages[offset + 4 : offset + 12]
                                         .view(np.uint64)]  # fmt: skip
        if count == 0:  # gguf's reader types an empty array by its own type alone
            return 12, parts, [], [GGUFValueType.ARRAY]
        cursor = offset + 12
        if item_type == GGUFValueType.STRING:
            buffer = pages.data  # the pages as a memoryview
            for _ in range(count):
                length = _U64.unpack_from(buffer, cursor)[0]
                parts.append(pages[cursor : cursor + 8].view(np.uint64))
                parts.append(pages[cursor + 8 : cursor + 8 + length])
                cursor += 8 + length
            return cursor - offset, parts, list(range(3, 2 + 2 * count, 2)), [GGUFValueType.ARRAY, item_type]
        dtype = self.gguf_scalar_to_np.get(item_type)
        if dtype is None:
            return None
        size = np.dtype(dtype).itemsize
        values = pages[cursor : cursor + size * count].view(dtype)
        parts += [values[i : i + 1] for i in range(count)]
        return 12 + size * count, parts, list(range(2, 2 + count)), [GGUFValueType.ARRAY, item_type]


# The fields gguf's reader adds ahead of a file's own metadata (its header's counts), which no metadata reader returns.
_HEADER_FIELDS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})


def transformers_metadata(
    reader: GGUFReader, string_arrays: Container[str] = ()
) -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """What transformers' own GGUF reader (`transformers.integrations.gguf.read_gguf_metadata`, transformers 5)
    returns for `reader`'s file, from the fields already parsed: each metadata key's value (an array of strings as
    its length unless named in `string_arrays`, a vocabulary or merge table then decoded) and the tensors' names.
    None where that reader would refuse the file (an array of arrays; no `general.architecture`), or where the parsed
    fields do not say what it would return (an empty array's item type), for the caller to let it read the file.
    transformers walks the file's strings in Python: 0.45 s of a 1.1 s conversion of a 49,152-token
    vocabulary."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _HEADER_FIELDS:
            continue
        kinds = field.types
        if kinds[0] == GGUFValueType.ARRAY and (len(kinds) == 1 or kinds[1] == GGUFValueType.ARRAY):
            return None
        if kinds[0] == GGUFValueType.ARRAY and kinds[-1] == GGUFValueType.STRING and key not in string_arrays:
            metadata[key] = len(field.data)
        else:
            metadata[key] = field.contents()
    if "general.architecture" not in metadata:
        return None
    return metadata, tuple(tensor.name for tensor in reader.tensors)


def read_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata `key`, or `default` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _arch_field(reader: GGUFReader, arch: str, spec: str, key: str) -> Any:
    """The decoded value of the architecture's metadata key `<arch>.<key>`; ValueError naming the file `spec` and the
    key when it lacks it."""
    value = read_field(reader, f"{arch}.{key}")
    if value is None:
        raise ValueError(f"model {spec!r}: GGUF metadata lacks {arch}.{key}")
    return value


def _per_layer(value: Any) -> list[int]:
    """A metadata value that is one count for every layer or a count per layer, as a list of counts."""
    return [int(count) for count in value] if isinstance(value, list) else [int(value)]


def _kv_heads_by_layer(reader: GGUFReader, arch: str, layers: int, recurrent: str, spec: str) -> list[int]:
    """Each of a hybrid file's `layers` KV head counts (`attention.head_count_kv`, one for all or one per layer): 0
    on its `recurrent` layers, how llama.cpp marks them. ValueError unless the attention layers have one count."""
    kv_heads = _per_layer(_arch_field(reader, arch, spec, "attention.head_count_kv"))
    kv_heads = kv_heads * layers if len(kv_heads) == 1 else kv_heads
    if len(kv_heads) != layers or len({count for count in kv_heads if count}) != 1:
        raise ValueError(f"model {spec!r}: {arch}.attention.head_count_kv {kv_heads} is not one KV head count on the "
                         f"attention layers and 0 on the {recurrent} layers of {layers}")  # fmt: skip
    return kv_heads


def _lfm2_config(
    reader: GGUFReader, arch: str, config: dict[str, Any], experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """The keys of an LFM2 or LFM2-MoE `config.json` from an `lfm2` / `lfm2moe` file: its convolution layers are those
    with no KV heads in `attention.head_count_kv` (a count per layer), their taps `shortconv.l_cache`; the MLP's width
    is the file's `feed_forward_length` as it stands (llama.cpp's converter wrote it after LFM2's adjustment); the
    norms' epsilon under LFM2's key. LFM2-MoE's experts (`expert_*` keys, sigmoid routing, renormalised as llama.cpp
    fixes it) follow its `leading_dense_block_count` dense layers, chosen with the routing bias where the file has
    `exp_probs_b`. ValueError for attention layers of different KV head counts (LFM2 has one), a file whose
    convolution taps are missing, or an `lfm2moe` file without experts or routed otherwise."""
    required = functools.partial(_arch_field, reader, arch, spec)
    kv_heads = _kv_heads_by_layer(reader, arch, int(config["num_hidden_layers"]), "convolution", spec)
    keys: dict[str, Any] = {
        "layer_types": ["full_attention" if count else "conv" for count in kv_heads],
        "conv_L_cache": int(required("shortconv.l_cache")),
        "block_auto_adjust_ff_dim": False,
        "norm_eps": config["rms_norm_eps"],
    }
    if arch == "lfm2moe":
        dense = int(read_field(reader, f"{arch}.leading_dense_block_count", 0) or 0)
        keys.update(
            num_experts=experts,
            num_experts_per_tok=_sigmoid_routed_experts(reader, arch, experts, spec),
            moe_intermediate_size=int(required("expert_feed_forward_length")),
            num_dense_layers=dense,
            use_expert_bias=f"blk.{dense}.exp_probs_b.bias" in tensors,
            norm_topk_prob=True,
            routed_scaling_factor=float(read_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0),
        )
    return keys


def _granite_config(
    reader: GGUFReader, arch: str, config: dict[str, Any], experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """The keys of a Granite `config.json` from a `granite`, `granitemoe` or `granitehybrid` file: its multipliers
    (`embedding_scale`, `residual_scale`, `attention.scale`, whose absence llama.cpp reads as `head_dim ** -0.5`,
    `logit_scale`); Granite MoE's experts (`expert_feed_forward_length` wide: transformers' `intermediate_size`) and
    shared MLP (`expert_shared_feed_forward_length`: then `granitemoeshared`); Granite 4.0's Mamba-2 layers, those
    with no KV heads in `attention.head_count_kv`, from the `ssm.*` keys (the heads are its time-step rank, their
    width its inner size over them), the convolution's bias where the file has it, rope only where
    `rope.scaling.finetuned` says (llama.cpp turns none in a hybrid of Mamba-2 layers), and without experts the
    dense MLP as its shared MLP. ValueError for what does not add up."""
    required = functools.partial(_arch_field, reader, arch, spec)
    head_dim = int(config["head_dim"])
    keys: dict[str, Any] = {
        "embedding_multiplier": short_float(read_field(reader, f"{arch}.embedding_scale", 1.0)),
        "residual_multiplier": short_float(read_field(reader, f"{arch}.residual_scale", 1.0)),
        "attention_multiplier": short_float(read_field(reader, f"{arch}.attention.scale", 0.0)) or head_dim**-0.5,
        "logits_scaling": short_float(read_field(reader, f"{arch}.logit_scale", 1.0)),
    }
    shared = int(read_field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    if experts:
        keys.update(
            num_local_experts=experts,
            num_experts_per_tok=_experts_used(reader, arch, experts, spec),
            intermediate_size=int(required("expert_feed_forward_length")),
        )
        if shared:
            keys["shared_intermediate_size"] = shared
    elif arch == "granitemoe":
        raise ValueError(f"model {spec!r}: a granitemoe file without experts is not supported")
    if arch == "granitemoe":
        return {**keys, "model_type": "granitemoeshared" if shared else "granitemoe",
                "architectures": ["GraniteMoeSharedForCausalLM" if shared else "GraniteMoeForCausalLM"]}  # fmt: skip
    if arch == "granite":
        return keys
    layers = int(config["num_hidden_layers"])
    kv_heads = _kv_heads_by_layer(reader, arch, layers, "Mamba-2", spec)
    mamba = [i for i, count in enumerate(kv_heads) if not count]
    heads, inner, hidden = int(required("ssm.time_step_rank")), int(required("ssm.inner_size")), config["hidden_size"]
    if not mamba or inner % heads or inner % hidden:
        raise ValueError(f"model {spec!r}: a granitehybrid file of Mamba-2 layers {mamba}, {heads} heads over an inner "
                         f"size of {inner} is not supported")  # fmt: skip
    if not experts:  # the dense MLP is Granite 4.0's shared MLP
        keys.update(num_local_experts=0, shared_intermediate_size=config["intermediate_size"])
    rope = bool(read_field(reader, f"{arch}.rope.scaling.finetuned", False))
    if not rope and config["max_position_embeddings"] == _NO_CONTEXT_STATED:
        keys["max_position_embeddings"] = _HYBRID_CONTEXT
    return {
        **keys,
        "layer_types": ["mamba" if i in mamba else "attention" for i in range(layers)],
        "position_embedding_type": "rope" if rope else "nope",
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_expand": inner // hidden,
        "mamba_d_state": int(required("ssm.state_size")),
        "mamba_n_groups": int(required("ssm.group_count")),
        "mamba_d_conv": int(required("ssm.conv_kernel")),
        "mamba_conv_bias": f"blk.{mamba[0]}.ssm_conv1d.bias" in tensors,
    }


def _jamba_config(
    reader: GGUFReader, config: dict[str, Any], experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """The keys of a Jamba `config.json` from a `jamba` file: its Mamba-1 layers, those with no KV heads in
    `attention.head_count_kv`, from the `ssm.*` keys (the time-step rank, the state, the convolution; the inner width
    over the hidden size as `mamba_expand`), its expert layers those with a router (`ffn_gate_inp`), both sets as
    transformers' Jamba states them: a period and an offset. ValueError for layers that no period and offset give,
    or an inner width that is not a multiple of the hidden size."""
    required = functools.partial(_arch_field, reader, "jamba", spec)
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    kv_heads = _kv_heads_by_layer(reader, "jamba", layers, "Mamba", spec)
    attention = [i for i, count in enumerate(kv_heads) if count]
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    inner = int(required("ssm.inner_size"))
    if inner % hidden:
        raise ValueError(f"model {spec!r}: a jamba file of inner size {inner} over {hidden} is not supported")
    attention_period, attention_offset = _period_of(attention, layers, "attention", spec)
    keys: dict[str, Any] = {
        "num_key_value_heads": max(kv_heads),
        "attn_layer_period": attention_period,
        "attn_layer_offset": attention_offset,
        "mamba_expand": inner // hidden,
        "mamba_d_state": int(required("ssm.state_size")),
        "mamba_d_conv": int(required("ssm.conv_kernel")),
        "mamba_dt_rank": int(required("ssm.time_step_rank")),
        "mamba_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensors),
        "num_experts": experts or 1,
        "num_experts_per_tok": _experts_used(reader, "jamba", experts, spec) if experts else 1,
    }
    if routed:
        keys["expert_layer_period"], keys["expert_layer_offset"] = _period_of(routed, layers, "expert", spec)
    return keys


def _period_of(chosen: list[int], layers: int, what: str, spec: str) -> tuple[int, int]:
    """(period, offset) of the layers `chosen` of `layers`: every period-th from the offset (offset < period, as
    transformers' Jamba takes them). ValueError where none gives exactly those layers."""
    if chosen:
        offset = chosen[0]
        period = chosen[1] - chosen[0] if len(chosen) > 1 else layers
        period = max(period, offset + 1)
        if [i for i in range(layers) if i % period == offset] == chosen:
            return period, offset
    raise ValueError(f"model {spec!r}: jamba {what} layers {chosen} are not every n-th layer from one offset")


def _falcon_h1_config(reader: GGUFReader, tensors: dict[str, Any], spec: str) -> dict[str, Any]:
    """The keys of a Falcon-H1 `config.json` from a `falcon-h1` file: Mamba-2 beside attention in every layer, its
    shape from the `ssm.*` keys (the heads are its time-step rank, their width its inner size over them), the
    convolution's bias and the gated norm where the file has their tensors (llama.cpp normalises after the gate).
    llama.cpp's converter folds every multiplier of Falcon-H1's (embeddings, attention, Mamba-2, MLP, logits) into
    the tensors they multiply, so the config states none: transformers' defaults, 1. Biases on the MLP (which
    llama.cpp would read) come through as `mlp_bias`, refused by name. ValueError for an inner size the heads do not
    divide."""
    required = functools.partial(_arch_field, reader, "falcon-h1", spec)
    heads, inner = int(required("ssm.time_step_rank")), int(required("ssm.inner_size"))
    if not heads or inner % heads:
        raise ValueError(f"model {spec!r}: a falcon-h1 file of {heads} Mamba-2 heads over an inner size of {inner} is "
                         "not supported")  # fmt: skip
    return {
        "mamba_d_ssm": inner,
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_d_state": int(required("ssm.state_size")),
        "mamba_n_groups": int(required("ssm.group_count")),
        "mamba_d_conv": int(required("ssm.conv_kernel")),
        "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in tensors,
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in tensors,
        "mamba_norm_before_gate": False,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
    }


# A `nemotron_h` / `nemotron_h_moe` file's blocks by the tensor each kind has: Mamba-2's input projection, attention's
# queries, the MLP's up projection, or the experts' bank (Nemotron 3's); their characters in Nemotron-H's pattern.
_NEMOTRON_BLOCK_TENSORS = {"ssm_in": "M", "attn_q": "*", "ffn_up": "-", "ffn_up_exps": "E"}


def _nemotron_h_config(
    reader: GGUFReader, arch: str, config: dict[str, Any], experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """The keys of a Nemotron-H `config.json` from a `nemotron_h` or `nemotron_h_moe` file: its blocks' pattern
    (`hybrid_override_pattern`) from the tensors each block has (`_NEMOTRON_BLOCK_TENSORS`), the MLP's width (its up
    projection's rows: a `nemotron_h_moe` file's `feed_forward_length` states the experts' alone), Mamba-2 from the
    `ssm.*` keys (its heads the time-step rank, their width the inner size over them), the convolution's bias where
    the file has it, the released models' context where the converter wrote none of its own (2^20), and Nemotron 3's
    experts from the `expert_*` keys (`_nemotron_h_experts`). ValueError for a block of none of these kinds or
    Mamba-2 heads that do not divide its inner size."""
    required = functools.partial(_arch_field, reader, arch, spec)
    blocks = int(config["num_hidden_layers"])
    pattern = ""
    for block in range(blocks):
        kinds = [kind for tensor, kind in _NEMOTRON_BLOCK_TENSORS.items() if f"blk.{block}.{tensor}.weight" in tensors]
        if len(kinds) != 1:
            raise ValueError(f"model {spec!r}: nemotron_h block {block} is not one Mamba-2, attention, MLP or "
                             "experts block")  # fmt: skip
        pattern += kinds[0]
    heads, inner = int(required("ssm.time_step_rank")), int(required("ssm.inner_size"))
    if "M" not in pattern or inner % heads:
        raise ValueError(f"model {spec!r}: a nemotron_h file of blocks {pattern!r}, {heads} Mamba-2 heads over an "
                         f"inner size of {inner} is not supported")  # fmt: skip
    keys: dict[str, Any] = {
        "hybrid_override_pattern": pattern,
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "ssm_state_size": int(required("ssm.state_size")),
        "n_groups": int(required("ssm.group_count")),
        "conv_kernel": int(required("ssm.conv_kernel")),
        "use_conv_bias": f"blk.{pattern.index('M')}.ssm_conv1d.bias" in tensors,
        "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": config["rms_norm_eps"],
    }
    if "-" in pattern:  # (llama.cpp's shapes are innermost first: [hidden, width])
        keys["intermediate_size"] = int(tensors[f"blk.{pattern.index('-')}.ffn_up.weight"].shape[-1])
    if config["max_position_embeddings"] == _NO_CONTEXT_STATED:
        keys["max_position_embeddings"] = _HYBRID_CONTEXT
    if "E" in pattern:
        keys.update(_nemotron_h_experts(reader, arch, experts, spec))
    return keys


def _nemotron_h_experts(reader: GGUFReader, arch: str, experts: int, spec: str) -> dict[str, Any]:
    """Nemotron 3's experts keys from a `nemotron_h_moe` file, as its converter writes them: their count, the used
    count, widths (the shared expert's too), renormalisation, scale and groups (routed by sigmoid with the `exp_probs_b`
    bias, as llama.cpp reads it where `expert_gating_func` is absent). ValueError for a file without experts, gated
    otherwise, or with several groups and no count of those used (its converter writes none: the released models
    have one group)."""
    required = functools.partial(_arch_field, reader, arch, spec)
    groups = int(read_field(reader, f"{arch}.expert_group_count", 1) or 1)
    used_groups = read_field(reader, f"{arch}.expert_group_used_count")
    if groups > 1 and used_groups is None:
        raise ValueError(f"model {spec!r}: {arch}.expert_group_count {groups} without expert_group_used_count")
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": _sigmoid_routed_experts(reader, arch, experts, spec),
        "moe_intermediate_size": int(required("expert_feed_forward_length")),
        "moe_shared_expert_intermediate_size": int(required("expert_shared_feed_forward_length")),
        "norm_topk_prob": bool(read_field(reader, f"{arch}.expert_weights_norm", True)),
        "routed_scaling_factor": short_float(read_field(reader, f"{arch}.expert_weights_scale", 1.0)),
        "n_group": groups,
        "topk_group": int(used_groups or 1),
    }


def gguf_architecture(reader: GGUFReader, spec: str) -> str:
    """`general.architecture`, checked against the supported set."""
    arch = read_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"model {spec!r}: unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return str(arch)


def hf_config_from_gguf(reader: GGUFReader, spec: str) -> dict[str, Any]:
    """Build a transformers-loadable `config.json` dict from the file's metadata and tensor list."""
    arch = gguf_architecture(reader, spec)
    if arch == "gemma4":
        return _gemma4_config(reader, spec)
    experts = int(read_field(reader, f"{arch}.expert_count", 0) or 0)
    model_type, hf_class = _MIXTRAL if arch == "llama" and experts else GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    required = functools.partial(_arch_field, reader, arch, spec)

    if "token_embd.weight" not in tensors:
        raise ValueError(f"model {spec!r}: GGUF file has no token_embd.weight tensor")
    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))  # (0 in a state space model's file: no attention)
    head_dim = int(read_field(reader, f"{arch}.attention.key_length", hidden // heads if heads else 0))
    rope_theta = short_float(read_field(reader, f"{arch}.rope.freq_base", 10000.0))
    eos = int(read_field(reader, "tokenizer.ggml.eos_token_id", 2))
    eot = read_field(reader, "tokenizer.ggml.eot_token_id")
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        # GGUF shapes are listed innermost-first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        # A mixture of experts' file may have no dense width (Qwen3.5-MoE's): its experts' then.
        # A width per layer in a `nemotron_h` file, 0 on the layers without an MLP (`_nemotron_h_config`).
        "intermediate_size": max(_per_layer(read_field(reader, f"{arch}.feed_forward_length", 0) or 0)) or int(
            required("expert_feed_forward_length" if experts else "feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": heads,
        # A count per layer in an `lfm2` file, 0 on its convolution layers (`_lfm2_config`).
        "num_key_value_heads": max(_per_layer(read_field(reader, f"{arch}.attention.head_count_kv", heads))),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": short_float(required(
            "attention.layer_norm_epsilon" if arch in _LAYER_NORMED else "attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(required("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": int(read_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": [eos, int(eot)] if eot is not None and int(eot) != eos else eos,
        # The file's, or none: a transformers config's default (GLM-4's 151329) may lie past a smaller vocabulary.
        "pad_token_id": None if (pad := read_field(reader, "tokenizer.ggml.padding_token_id")) is None else int(pad),
        "torch_dtype": "float32",
    }
    rope_dims = read_field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        config["partial_rotary_factor"] = int(rope_dims) / head_dim
    window = read_field(reader, f"{arch}.attention.sliding_window")
    # llama4: its chunks' size, fixed (`_llama4_config`); dots1: llama.cpp windows none of its layers
    if window and arch not in ("llama4", "dots1"):
        config["sliding_window"] = int(window)
    if "rope_factors_long.weight" in tensors:
        config.update(_long_rope_config(reader, arch, tensors, spec))
    if "rope_freqs.weight" in tensors:
        freqs = dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        original = int(read_field(reader, f"{arch}.rope.scaling.original_context_length", 0)) or None
        config["rope_scaling"] = llama3_scaling_from_factors(
            np.asarray(freqs, dtype=np.float64).ravel(), rope_theta, head_dim, original, spec
        )
    if arch in _GEMMA_GLOBAL_EVERY:
        config.update(_gemma_config(reader, arch, config, spec))
    if arch in HYBRID_ARCHITECTURES:
        config.update(_linear_attention_config(reader, arch, config, spec))
    if arch == "llama4":
        config.update(_llama4_config(reader, config, experts, window, spec))
    elif arch == "gpt-oss":
        config.update(_gpt_oss_config(reader, config, experts, spec))
    elif arch == "glm4moe":
        config.update(_glm4_moe_config(reader, config, experts, tensors, spec))
    elif arch == "dots1":
        config.update(_dots1_config(reader, experts, spec))
    elif arch == "glm4":  # rope over `rope.dimension_count` dims, stated when whole too (the config's default: half)
        config["partial_rotary_factor"] = config.get("partial_rotary_factor", 1.0)
    elif arch == "minimax-m2":
        config.update(_minimax_m2_config(reader, experts, spec))
    elif arch == "deepseek2":
        config.update(_deepseek2_config(reader, config, experts, tensors, spec))
    elif arch == "glm-dsa":
        config.update(_glm_dsa_config(reader, config, experts, tensors, spec))
    elif arch == "mistral3":
        config.update(_mistral3_config(reader, config, spec))
    elif arch == "arcee":  # its MLP's activation, fixed by llama.cpp; YaRN (or none) as the file states
        config.update(hidden_act="relu2", rope_parameters=_yarn_rope(reader, arch, config, spec))
    elif arch == "apertus":
        config.update(_apertus_config(reader, config["num_hidden_layers"], spec))
    elif arch == "seed_oss":  # o_proj's bias apart from q/k/v's
        config["attention_out_bias"] = "blk.0.attn_output.bias" in tensors
    elif arch == "exaone4":
        config.update(_exaone4_config(reader, config, spec))
    elif arch == "olmo2":
        config.update(_olmo2_config(reader, config, spec))
    elif arch in ("lfm2", "lfm2moe"):
        config.update(_lfm2_config(reader, arch, config, experts, tensors, spec))
    elif arch in ("granite", "granitemoe", "granitehybrid"):
        config.update(_granite_config(reader, arch, config, experts, tensors, spec))
    elif arch in ("nemotron_h", "nemotron_h_moe"):
        config.update(_nemotron_h_config(reader, arch, config, experts, tensors, spec))
    elif arch == "falcon-h1":
        config.update(_falcon_h1_config(reader, tensors, spec))
    elif arch == "jamba":
        config.update(_jamba_config(reader, config, experts, tensors, spec))
    elif arch in CLASSIC_GGUF_ARCHITECTURES:
        config.update(classic_gguf_config(arch, config, tensors, functools.partial(read_field, reader)))
    elif arch in STATE_SPACE_GGUF_ARCHITECTURES:
        return state_space_gguf_config(arch, config, tensors, functools.partial(read_field, reader), spec)
    elif arch in GEMMA3N_GGUF_ARCHITECTURES:
        return gemma3n_gguf_config(config, tensors, functools.partial(read_field, reader), spec)
    elif arch in DBRX_GGUF_ARCHITECTURES:
        return dbrx_gguf_config(config, experts, functools.partial(read_field, reader), spec)
    elif arch in _LAYER_NORMED:
        config.update(_cohere_config(reader, arch, config, tensors))
    elif arch in ("ernie4_5", "ernie4_5-moe"):
        config.update(_ernie4_5_config(reader, arch, config, experts, tensors, spec))
    elif experts:
        config.update(_experts_config(reader, arch, experts, tensors, spec))
    return config


def _llama4_config(
    reader: GGUFReader, config: dict[str, Any], experts: int, window: Any, spec: str
) -> dict[str, Any]:
    """The keys of a Llama 4 text `config.json` (transformers' `Llama4TextConfig`) from a `llama4` file: the experts'
    width (`intermediate_size`) beside the dense layers' (`intermediate_size_mlp`, the file's `feed_forward_length`),
    which layers have experts (every `interleave_moe_layer_step`-th), and what llama.cpp fixes (`_LLAMA4_*`).
    ValueError for what llama.cpp reads otherwise: a file without experts, or with `attention.sliding_window` 0
    (MobileLLM's form: no chunks, no temperature, rope on other layers)."""
    required = functools.partial(_arch_field, reader, "llama4", spec)
    if window is not None and int(window) == 0:
        raise ValueError(f"model {spec!r}: a llama4 file with attention.sliding_window 0 (MobileLLM's form) is not "
                         "supported")  # fmt: skip
    if not experts:
        raise ValueError(f"model {spec!r}: a llama4 file without experts is not supported")
    used = int(read_field(reader, "llama4.expert_used_count", 0) or 0)
    layers = int(config["num_hidden_layers"])
    step = int(required("interleave_moe_layer_step"))
    if not 0 < used <= experts or not 0 < step <= layers:
        raise ValueError(f"model {spec!r}: llama4.expert_used_count {used} of {experts} experts, experts every "
                         f"{step} of {layers} layers is not Llama 4's shape")  # fmt: skip
    return {
        "intermediate_size": int(required("expert_feed_forward_length")),
        "intermediate_size_mlp": int(required("feed_forward_length")),
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "interleave_moe_layer_step": step,
        "no_rope_layers": [int((i + 1) % _LLAMA4_NOPE_EVERY != 0) for i in range(layers)],
        "attention_chunk_size": _LLAMA4_CHUNK,
        "attn_temperature_tuning": True,
        **_LLAMA4_TEMPERATURE,
        "use_qk_norm": experts != _LLAMA4_EXPERTS_WITHOUT_QK_NORM,
    }


def _gpt_oss_config(reader: GGUFReader, config: dict[str, Any], experts: int, spec: str) -> dict[str, Any]:
    """The keys of a gpt-oss `config.json` from a `gpt-oss` file: its experts (`expert_feed_forward_length` wide),
    which layers are windowed (`attention.sliding_window_pattern`: every n-th layer full, or a flag per layer),
    YaRN from `rope.scaling.*`, and what llama.cpp fixes (`_GPT_OSS_*`, the harmony stop tokens). ValueError for a
    file without experts or a window, or with a rope scaling other than YaRN."""
    arch = "gpt-oss"
    required = functools.partial(_arch_field, reader, arch, spec)
    used = _experts_used(reader, arch, experts, spec)
    if not config.get("sliding_window"):
        raise ValueError(f"model {spec!r}: a gpt-oss file without attention.sliding_window is not supported")
    layers = int(config["num_hidden_layers"])
    pattern = read_field(reader, f"{arch}.attention.sliding_window_pattern", _GPT_OSS_WINDOW_EVERY)
    if isinstance(pattern, list):
        windowed = _windowed_layers(pattern, arch, layers, spec)
    elif isinstance(pattern, int) and pattern >= 1:
        windowed = [i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise ValueError(f"model {spec!r}: {arch}.attention.sliding_window_pattern {pattern!r} is not supported")
    rope = _yarn_rope(reader, arch, config, spec, truncate=False)
    return {
        "intermediate_size": int(required("expert_feed_forward_length")),
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed],
        "rope_parameters": rope,
        **_GPT_OSS_SWIGLU,
        "eos_token_id": _harmony_stops(reader, config["eos_token_id"]),
    }


# llama.cpp's `expert_gating_func` values (its `llama_expert_gating_func_type`): a GLM-4.5 file's router is sigmoid.
_GATING_SIGMOID = 2


def _sigmoid_routed_experts(reader: GGUFReader, arch: str, experts: int, spec: str) -> int:
    """The experts each token uses (`expert_used_count`) in a file of `arch` whose router llama.cpp gates by sigmoid
    (GLM-4.5's, MiniMax-M2's). ValueError for a file without experts, with another `expert_gating_func` (sigmoid
    when the file omits it, as llama.cpp takes it), or using none or more than it has."""
    used = _experts_used(reader, arch, experts, spec)
    gating = int(read_field(reader, f"{arch}.expert_gating_func", _GATING_SIGMOID))
    if gating != _GATING_SIGMOID:
        raise ValueError(f"model {spec!r}: {arch}.expert_gating_func {gating} is not supported (2, sigmoid, is)")
    return used


def _experts_used(reader: GGUFReader, arch: str, experts: int, spec: str) -> int:
    """`expert_used_count` of a file of `arch` with `experts` experts; ValueError for a file without experts or one
    whose tokens use none or more than it has."""
    if not experts:
        raise ValueError(f"model {spec!r}: a {arch} file without experts is not supported")
    used = int(_arch_field(reader, arch, spec, "expert_used_count"))
    if not 0 < used <= experts:
        raise ValueError(f"model {spec!r}: {arch}.expert_used_count {used} is not in 1..{experts}")
    return used


def _glm4_moe_config(
    reader: GGUFReader, config: dict[str, Any], experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """The keys of a GLM-4.5 `config.json` (transformers' `Glm4MoeConfig`) from a `glm4moe` file: its layers less the
    multi-token-prediction ones after them (`nextn_predict_layers`, counted in `block_count`; never read), DeepSeek-V3's
    experts from the `expert_*` keys (sigmoid scores, `expert_weights_scale`, `expert_weights_norm`, the shared
    experts' count, groups where the file has them) after `leading_dense_block_count` dense layers, q/k norms where
    the file has their tensors, and rope over `rope.dimension_count` dims of each head (stated even when whole:
    the config's default is half). ValueError for a file without experts, with a router other than sigmoid, or
    with no layer left but its prediction layers."""
    arch = "glm4moe"
    used = _sigmoid_routed_experts(reader, arch, experts, spec)
    layers, predicting = _decoder_layers(reader, arch, config, spec)
    return {
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": predicting,
        **_deepseek_experts(reader, arch, experts, used, spec),
        "n_group": int(read_field(reader, f"{arch}.expert_group_count", 0) or 1),
        "topk_group": int(read_field(reader, f"{arch}.expert_group_used_count", 0) or 1),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "partial_rotary_factor": config.get("partial_rotary_factor", 1.0),
    }


def _dots1_config(reader: GGUFReader, experts: int, spec: str) -> dict[str, Any]:
    """The keys of a dots.llm1 `config.json` (transformers' `Dots1Config`) from a `dots1` file: DeepSeek-V3's experts
    from the `expert_*` keys (sigmoid scores with the routing bias `exp_probs_b`, the file's `expert_weights_scale`,
    renormalised where `expert_weights_norm` says) after `leading_dense_block_count` dense layers, in one group (as
    llama.cpp routes them), no window on any layer (llama.cpp's `dots1` runs none). ValueError for a file without
    experts or with a router other than sigmoid."""
    arch = "dots1"
    used = _sigmoid_routed_experts(reader, arch, experts, spec)
    return {**_deepseek_experts(reader, arch, experts, used, spec), "n_group": 1, "topk_group": 1,
            "sliding_window": None}


def _deepseek_experts(reader: GGUFReader, arch: str, experts: int, used: int, spec: str) -> dict[str, Any]:
    """DeepSeek's expert keys of a `config.json` (GLM-4.5's and DeepSeek's files): `experts` experts of which `used`
    per token, `expert_feed_forward_length` wide, `expert_shared_count` shared ones, after
    `leading_dense_block_count` dense layers, weighted by `expert_weights_scale` (1 when absent) and renormalised
    where `expert_weights_norm` says."""
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(_arch_field(reader, arch, spec, "expert_feed_forward_length")),
        "n_shared_experts": int(read_field(reader, f"{arch}.expert_shared_count", 0) or 0),
        "first_k_dense_replace": int(read_field(reader, f"{arch}.leading_dense_block_count", 0) or 0),
        "routed_scaling_factor": short_float(read_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(read_field(reader, f"{arch}.expert_weights_norm", False)),
    }


def _decoder_layers(reader: GGUFReader, arch: str, config: dict[str, Any], spec: str) -> tuple[int, int]:
    """(decoder layers, multi-token-prediction layers) of a file whose converter writes the latter after the former
    and counts them in `block_count` (`nextn_predict_layers`); ValueError when they leave no decoder layer."""
    predicting = int(read_field(reader, f"{arch}.nextn_predict_layers", 0) or 0)
    layers = int(config["num_hidden_layers"]) - predicting
    if predicting < 0 or layers < 1:
        raise ValueError(f"model {spec!r}: {arch}.nextn_predict_layers {predicting} of "
                         f"{config['num_hidden_layers']} blocks leaves no decoder layer")  # fmt: skip
    return layers, predicting


def _minimax_m2_config(reader: GGUFReader, experts: int, spec: str) -> dict[str, Any]:
    """The keys of a MiniMax-M2 `config.json` from a `minimax-m2` file: its experts (`expert_feed_forward_length`
    wide, every layer's) and their sigmoid routing (`expert_gating_func`, sigmoid when the file omits it, as
    llama.cpp takes it). ValueError for a file without experts or with a router other than sigmoid."""
    arch = "minimax-m2"
    return {
        "num_local_experts": experts,
        "num_experts_per_tok": _sigmoid_routed_experts(reader, arch, experts, spec),
        "intermediate_size": int(_arch_field(reader, arch, spec, "expert_feed_forward_length")),
        "scoring_func": "sigmoid",
    }


# EXAONE 4 as llama.cpp reads an `exaone4` file with a window but no pattern: every 4th layer global.
_EXAONE4_GLOBAL_EVERY = 4


def _cohere_config(reader: GGUFReader, arch: str, config: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The keys of a Cohere `config.json` from a `command-r` or `cohere2` file: its LayerNorms' epsilon (read as
    `layer_norm_eps`), `logit_scale`, per-head q/k norms where the file has them (`use_qk_norm`: refused when the config
    is read), and Cohere 2's windows (every 4th layer global, as llama.cpp fixes them)."""
    keys: dict[str, Any] = {
        "layer_norm_eps": config.pop("rms_norm_eps"),
        "logit_scale": short_float(read_field(reader, f"{arch}.logit_scale", 1.0)),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
    }
    if arch == "cohere2" and config.get("sliding_window"):
        layers = int(config["num_hidden_layers"])
        keys["layer_types"] = ["full_attention" if (i + 1) % _COHERE2_GLOBAL_EVERY == 0 else "sliding_attention"
                               for i in range(layers)]  # fmt: skip
    return keys


def _olmo2_config(reader: GGUFReader, config: dict[str, Any], spec: str) -> dict[str, Any]:
    """The keys of an OLMo 2 `config.json` from an `olmo2` file; one with windows (its layers flagged by
    `attention.sliding_window_pattern`) is OLMo 3's (`olmo3`). ValueError for a windowed file with a scaled rope:
    OLMo 3 scales its full-attention layers' rope alone, which such a file does not say."""
    if not config.get("sliding_window"):
        return {}
    if read_field(reader, "olmo2.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"model {spec!r}: an olmo2 file with windows and a scaled rope (OLMo 3's YaRN) is not "
                         "supported")  # fmt: skip
    layers = int(config["num_hidden_layers"])
    flags = read_field(reader, "olmo2.attention.sliding_window_pattern")
    if not isinstance(flags, list):
        raise ValueError(f"model {spec!r}: an olmo2 file with a window flags no layers "
                         "(attention.sliding_window_pattern)")  # fmt: skip
    windowed = _windowed_layers(flags, "olmo2", layers, spec)
    return {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"],
            "layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed]}  # fmt: skip


def _exaone4_config(reader: GGUFReader, config: dict[str, Any], spec: str) -> dict[str, Any]:
    """The keys of an EXAONE 4 `config.json` from an `exaone4` file: each layer's type, windowed where
    `attention.sliding_window_pattern` flags it (or, a number, every n-th layer global; every 4th without the key),
    all full without a window (the global layers turn no rope: `config`)."""
    layers = int(config["num_hidden_layers"])
    if not config.get("sliding_window"):
        return {"sliding_window": None, "layer_types": ["full_attention"] * layers}
    pattern = read_field(reader, "exaone4.attention.sliding_window_pattern", _EXAONE4_GLOBAL_EVERY)
    if isinstance(pattern, list):
        windowed = _windowed_layers(pattern, "exaone4", layers, spec)
    else:  # every n-th layer global
        windowed = [(i + 1) % max(int(pattern), 1) != 0 for i in range(layers)]
    return {"layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed]}


def _ernie4_5_config(
    reader: GGUFReader, arch: str, config: dict[str, Any], experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """The keys of an ERNIE 4.5 `config.json` from an `ernie4_5` or `ernie4_5-moe` file: no biases (`use_bias`),
    and the experts (`ernie4_5-moe`) on every `interleave_moe_layer_step`-th layer after
    `leading_dense_block_count` dense ones, to the last, as llama.cpp builds them, with `expert_shared_count` shared
    experts as wide as the routed ones (the file's `expert_shared_feed_forward_length`, where it has one, must say
    so). ValueError for a file with biases, or with experts llama.cpp would build otherwise than transformers."""
    if "blk.0.attn_q.bias" in tensors:
        raise ValueError(f"model {spec!r}: an {arch} file with biases is not supported")
    keys: dict[str, Any] = {"use_bias": False}
    if arch == "ernie4_5":
        return keys
    required = functools.partial(_arch_field, reader, arch, spec)
    used = _experts_used(reader, arch, experts, spec)
    width = int(required("expert_feed_forward_length"))
    shared = int(read_field(reader, f"{arch}.expert_shared_count", 0))
    shared_width = int(read_field(reader, f"{arch}.expert_shared_feed_forward_length", width * shared))
    if shared and shared_width != width * shared:
        raise ValueError(f"model {spec!r}: {shared} shared experts {shared_width} wide in all, not {shared} of the "
                         f"routed experts' {width}")  # fmt: skip
    return {
        **keys,
        "moe_num_experts": experts,
        "moe_k": used,
        "moe_intermediate_size": width,
        "moe_num_shared_experts": shared,
        "moe_layer_start_index": int(read_field(reader, f"{arch}.leading_dense_block_count", 0)),
        "moe_layer_end_index": -1,
        "moe_layer_interval": int(read_field(reader, f"{arch}.interleave_moe_layer_step", 1) or 1),
    }


def _yarn_rope(reader: GGUFReader, arch: str, config: dict[str, Any], spec: str, **extra: Any) -> dict[str, Any]:
    """The `rope_parameters` of a file of `arch` whose rope is plain or YaRN (`rope.scaling.*`: its factor, original
    context and, where the file gives them, betas; with `extra` keys then), its base taken out of `config`.
    ValueError for another rope scaling."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    scaling = read_field(reader, f"{arch}.rope.scaling.type")
    if scaling == "yarn":
        required = functools.partial(_arch_field, reader, arch, spec)
        betas = {name: short_float(value) for name in ("beta_fast", "beta_slow")
                 if (value := read_field(reader, f"{arch}.rope.scaling.yarn_{name}")) is not None}  # fmt: skip
        rope.update(rope_type="yarn", factor=short_float(required("rope.scaling.factor")), **betas, **extra,
                    original_max_position_embeddings=int(required("rope.scaling.original_context_length")))
    elif scaling not in (None, "none"):
        raise ValueError(f"model {spec!r}: {arch} rope scaling {scaling!r} is not supported (yarn is)")
    return rope


# Apertus's xIELU scalars, as its checkpoints name them; an `apertus` file's metadata keys are `xielu.<name>`.
_XIELU_SCALARS = ("alpha_p", "alpha_n", "beta", "eps")


def _apertus_config(reader: GGUFReader, layers: int, spec: str) -> dict[str, Any]:
    """An `apertus` file's MLP activation, xIELU, with its four scalars per layer as the file's `xielu.*` keys give
    them (one for all layers or one per layer, as llama.cpp reads them; stored as the checkpoint's, before softplus)
    under `xielu_parameters`, which `gguf_convert` gives back as each layer's `mlp.act_fn.*` tensors. ValueError
    for a missing key or a list of another length."""
    scalars: dict[str, list[float]] = {}
    for name in _XIELU_SCALARS:
        value = read_field(reader, f"xielu.{name}")
        if value is None:
            raise ValueError(f"model {spec!r}: GGUF metadata lacks xielu.{name}")
        values = [float(item) for item in value] if isinstance(value, list) else [float(value)] * layers
        if len(values) != layers:
            raise ValueError(f"model {spec!r}: xielu.{name} has {len(values)} values for {layers} layers")
        scalars[name] = values
    return {"hidden_act": "xielu", "xielu_parameters": scalars}


def _mistral3_config(reader: GGUFReader, config: dict[str, Any], spec: str) -> dict[str, Any]:
    """A `mistral3` file's rope and query scale as llama.cpp reads them: YaRN (or none) with the attention factor of
    `mscale` 1 over `rope.scaling.yarn_log_multiplier` (the checkpoint's `mscale_all_dim`; absent: 1), and the
    queries scaled by `1 + beta * ln(1 + floor(p / original))`, beta `attention.temperature_scale` (absent or 0:
    none) over the rope's original context."""
    arch = "mistral3"
    log_multiplier = read_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")
    all_dims = 1.0 if log_multiplier is None else short_float(log_multiplier)
    rope = _yarn_rope(reader, arch, config, spec, mscale=1.0, mscale_all_dim=all_dims)
    beta = short_float(read_field(reader, f"{arch}.attention.temperature_scale", 0.0) or 0.0)
    if beta:
        original = _arch_field(reader, arch, spec, "rope.scaling.original_context_length")
        rope.update(llama_4_scaling_beta=beta, original_max_position_embeddings=int(original))
    return {"rope_parameters": rope}


# llama.cpp's `expert_gating_func` for softmax; a `deepseek2` file without the key is routed by softmax there (the
# DeepSeek-V2 files written before the key).
_GATING_SOFTMAX = 1
# llama.cpp's DeepSeek YaRN: `rope.scaling.yarn_log_multiplier` is 0.1 * the checkpoint's `mscale_all_dim`.
_YARN_LOG_MULTIPLIER = 0.1


def _deepseek2_config(
    reader: GGUFReader,
    config: dict[str, Any],
    experts: int,
    tensors: dict[str, Any],
    spec: str,
    arch: str = "deepseek2",
    gating_default: int = _GATING_SOFTMAX,
) -> dict[str, Any]:
    """The keys of a DeepSeek-V3 (`deepseek_v3`: sigmoid routing with the `exp_probs_b` bias) or DeepSeek-V2
    (`deepseek_v2`: softmax routing, groups' best scores) `config.json` from a `deepseek2` file, as llama.cpp reads it:
    - latent attention from `attention.q_lora_rank` (absent: one q projection), `kv_lora_rank`, rope over
      `rope.dimension_count` dims, and each head's key and value widths from `attention.key_length_mla` /
      `value_length_mla` (files converted since llama.cpp keeps the latent as one KV head, `key_length` its row) or,
      in older files, `key_length` / `value_length`; rope pairs interleaved, as the checkpoints hold them;
    - experts after `leading_dense_block_count` dense layers (`expert_*`: counts, width, shared experts, groups, the
      weights' scale and renormalisation);
    - YaRN with DeepSeek's attention scale (`rope.scaling.yarn_log_multiplier`, `mscale_all_dim` / 10);
    - its multi-token-prediction layers (`nextn_predict_layers`, GLM-4.7-Flash's), not read.
    ValueError for a file without experts, with a router other than softmax or sigmoid, or sigmoid without its bias.
    `arch`: the file's (`glm-dsa` reads these keys too), `gating_default` its router without the key."""
    required = functools.partial(_arch_field, reader, arch, spec)
    used = _experts_used(reader, arch, experts, spec)
    gating = int(read_field(reader, f"{arch}.expert_gating_func", gating_default))
    if gating not in (_GATING_SOFTMAX, _GATING_SIGMOID):
        raise ValueError(f"model {spec!r}: {arch}.expert_gating_func {gating} is not supported (1, softmax, and 2, "
                         "sigmoid, are)")  # fmt: skip
    dense = int(read_field(reader, f"{arch}.leading_dense_block_count", 0) or 0)
    sigmoid = gating == _GATING_SIGMOID
    if sigmoid and f"blk.{dense}.exp_probs_b.bias" not in tensors:
        raise ValueError(f"model {spec!r}: a {arch} file routed by sigmoid has no exp_probs_b (its routing bias)")
    rope_dims = int(required("rope.dimension_count"))
    if read_field(reader, f"{arch}.attention.key_length_mla") is not None:
        key, value = int(required("attention.key_length_mla")), int(required("attention.value_length_mla"))
    else:
        key, value = int(required("attention.key_length")), int(required("attention.value_length"))
    groups = int(read_field(reader, f"{arch}.expert_group_count", 0) or 1)
    layers, predicting = _decoder_layers(reader, arch, config, spec)
    config.pop("partial_rotary_factor", None)
    log_multiplier = read_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")
    if log_multiplier is None:  # no DeepSeek scale: llama.cpp turns YaRN's without its attention factor
        rope = _yarn_rope(reader, arch, config, spec, attention_factor=1.0)
    else:
        all_dims = short_float(float(np.float32(log_multiplier) / np.float32(_YARN_LOG_MULTIPLIER)))
        rope = _yarn_rope(reader, arch, config, spec, mscale=all_dims, mscale_all_dim=all_dims)
    return {
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": predicting,
        "num_key_value_heads": config["num_attention_heads"],
        "head_dim": rope_dims,
        "q_lora_rank": int(read_field(reader, f"{arch}.attention.q_lora_rank", 0) or 0) or None,
        "kv_lora_rank": int(required("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": key - rope_dims,
        "v_head_dim": value,
        "rope_interleave": True,
        "rope_parameters": rope,
        **_deepseek_experts(reader, arch, experts, used, spec),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
        "n_group": groups,
        "topk_group": int(read_field(reader, f"{arch}.expert_group_used_count", 0) or 1),
    }


# GLM-5.2's indexers, which llama.cpp assumes for a `glm-dsa` file of a context of at least 2^20 positions that
# names none: layers 0 and 1 and every fourth from 2 have their own, the others reuse the last one's choice.
_GLM_5_2_CONTEXT = 1 << 20


def _glm_dsa_config(
    reader: GGUFReader, config: dict[str, Any], experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """GLM-5's `config.json` keys (`glm_moe_dsa`) from a `glm-dsa` file, as llama.cpp reads it: `deepseek2`'s
    (`_deepseek2_config`; its router sigmoid without `expert_gating_func`), the indexer's
    `attention.indexer.head_count`, `key_length` and `top_k`, and which layers have their own indexer,
    `attention.indexer.types` (true: full), or without it every layer (GLM-5.2's pattern from a context of 2^20 on).
    ValueError when that list is shorter than the layers."""
    arch = "glm-dsa"
    fields = _deepseek2_config(reader, config, experts, tensors, spec, arch, gating_default=_GATING_SIGMOID)
    required = functools.partial(_arch_field, reader, arch, spec)
    layers = fields["num_hidden_layers"]
    full = read_field(reader, f"{arch}.attention.indexer.types")
    if full is None:
        newer = int(config.get("max_position_embeddings") or 0) >= _GLM_5_2_CONTEXT
        full = [not newer or i < 2 or (i - 2) % 4 == 0 for i in range(layers)]
    elif len(full) < layers:
        raise ValueError(f"model {spec!r}: {arch}.attention.indexer.types has {len(full)} entries for {layers} "
                         "layers")  # fmt: skip
    return {
        **fields,
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "index_n_heads": int(required("attention.indexer.head_count")),
        "index_head_dim": int(required("attention.indexer.key_length")),
        "index_topk": int(required("attention.indexer.top_k")),
        "indexer_types": ["full" if kind else "shared" for kind in list(full)[:layers]],
    }


def _windowed_layers(flags: list[Any], arch: str, layers: int, spec: str) -> list[bool]:
    """`<arch>.attention.sliding_window_pattern` as a flag per layer (true: windowed); ValueError naming `spec` when
    it is not one per layer."""
    if len(flags) != layers:
        raise ValueError(f"model {spec!r}: {arch}.attention.sliding_window_pattern has {len(flags)} entries, "
                         f"not one per each of {layers} layers")  # fmt: skip
    return [bool(flag) for flag in flags]


def _harmony_stops(reader: GGUFReader, eos: int | list[int]) -> int | list[int]:
    """The file's end-of-sequence ids with harmony's stop tokens (`_HARMONY_STOPS`) where its vocabulary has them, and
    without `<|end|>` (a file may name it its end-of-turn token)."""
    tokens = read_field(reader, "tokenizer.ggml.tokens") or []
    ids = {token: index for index, token in enumerate(tokens) if token in (*_HARMONY_STOPS, _HARMONY_MESSAGE_END)}
    stops = [i for i in ([eos] if isinstance(eos, int) else eos) if i != ids.get(_HARMONY_MESSAGE_END)]
    stops += [ids[token] for token in _HARMONY_STOPS if token in ids and ids[token] not in stops]
    return stops[0] if len(stops) == 1 else stops


def _experts_config(
    reader: GGUFReader, arch: str, experts: int, tensors: dict[str, Any], spec: str
) -> dict[str, Any]:
    """The mixture-of-experts keys of a Mixtral, Qwen2-MoE or Qwen3-MoE `config.json`: how many experts, how many
    each token uses, whether their weights are renormalised (as llama.cpp does for the architecture), the experts'
    and the shared expert's sizes. Every layer must have experts, as llama.cpp assumes."""
    if arch not in _NORM_TOPK:
        raise ValueError(f"model {spec!r}: experts in a {arch} GGUF file are not supported")
    used = int(read_field(reader, f"{arch}.expert_used_count", 0) or 0)
    if not 0 < used <= experts:
        raise ValueError(f"model {spec!r}: {arch}.expert_used_count {used} is not in 1..{experts}")
    layers = int(read_field(reader, f"{arch}.block_count"))
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if dense:  # llama.cpp builds every layer of these architectures with experts
        raise ValueError(f"model {spec!r}: layers {dense} of a {arch} file with experts have no router")
    if arch == "llama":  # Mixtral: its experts are intermediate_size wide
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    keys: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "norm_topk_prob": _NORM_TOPK[arch],
        "moe_intermediate_size": int(read_field(reader, f"{arch}.expert_feed_forward_length", 0)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if not keys["moe_intermediate_size"]:
        raise ValueError(f"model {spec!r}: GGUF metadata lacks {arch}.expert_feed_forward_length")
    if arch in ("qwen2moe", "qwen3next", "qwen35moe"):  # a sigmoid-gated shared expert beside the routed ones
        shared = read_field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
        keys["shared_expert_intermediate_size"] = int(shared)
    return keys


def _linear_attention_config(reader: GGUFReader, arch: str, config: dict[str, Any], spec: str) -> dict[str, Any]:
    """The Gated DeltaNet keys of a Qwen3.5 / Qwen3-Next `config.json` from llama.cpp's `ssm.*` keys (the key
    heads are its group count, the value heads its time-step rank, a value head's width its inner size over them)
    and which layers are full attention (every `full_attention_interval`-th). The rope stays plain: on text,
    Qwen3.5's multimodal rope (`rope.dimension_sections`) gives each section the same position."""

    def required(key: str) -> int:
        return int(_arch_field(reader, arch, spec, key))

    value_heads = required("ssm.time_step_rank")
    inner = required("ssm.inner_size")
    key_heads = required("ssm.group_count")
    if not value_heads or inner % value_heads or not key_heads or value_heads % key_heads:
        raise ValueError(f"model {spec!r}: {arch}.ssm.inner_size {inner} over {value_heads} value heads in groups "
                         f"of {key_heads} key heads is not a Gated DeltaNet's shape")
    interval = int(read_field(reader, f"{arch}.full_attention_interval", 4))
    layers = int(config["num_hidden_layers"])
    partial = float(config.pop("partial_rotary_factor", 1.0))
    return {
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": required("ssm.state_size"),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": required("ssm.conv_kernel"),
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                            "partial_rotary_factor": partial},
    }  # fmt: skip


def _gemma_config(reader: GGUFReader, arch: str, config: dict[str, Any], spec: str) -> dict[str, Any]:
    """The keys of a Gemma 2 / Gemma 3 text `config.json` that a llama.cpp file implies rather than stores
    (transformers 5's layout: `layer_types` and `rope_parameters`, per layer type for Gemma 3): GELU-tanh, the
    attention scale, which layers are windowed, the rope of each, and Gemma 2's soft-capping."""
    layers = int(config["num_hidden_layers"])
    largest = layers == _GEMMA_27B_LAYERS[arch]
    every = read_field(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA_GLOBAL_EVERY[arch])
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"model {spec!r}: {arch}.attention.sliding_window_pattern {every!r} is not supported")
    theta = config.pop("rope_theta")
    scalar = config["hidden_size"] // config["num_attention_heads"] if largest else config["head_dim"]
    keys: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)],
    }
    if arch == "gemma2":
        keys["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = read_field(reader, f"{arch}.{key}")
            keys[key] = None if cap is None else short_float(cap)
        return keys
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = read_field(reader, f"{arch}.rope.scaling.type")
    if scaling == "linear":
        full = {"rope_type": "linear", "factor": short_float(read_field(reader, f"{arch}.rope.scaling.factor")),
                "rope_theta": theta}  # fmt: skip
    elif scaling not in (None, "none"):
        raise ValueError(f"model {spec!r}: {arch} rope scaling {scaling!r} is not supported (linear is)")
    keys["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE},
    }
    return keys


def _gemma4_config(reader: GGUFReader, spec: str) -> dict[str, Any]:
    """A Gemma 4 text `config.json` from llama.cpp's `gemma4` keys and tensors: per-layer arrays for the KV heads (the
    windowed layers' and the full-attention layers') and the MLP width (twice as wide on the sharing layers with
    `use_double_wide_mlp`), `key_length` (full-attention) beside `key_length_swa`, `sliding_window_pattern`, the
    proportional rope's turning angles from `rope_freqs` (1 for those that turn, 1e30 for the rest), values from the
    keys' projection where a full-attention layer has no `attn_v`, per-layer inputs and experts."""
    arch = "gemma4"
    tensors = {t.name: t for t in reader.tensors}
    required = functools.partial(_arch_field, reader, arch, spec)

    layers = int(required("block_count"))
    pattern = _windowed_layers(list(np.atleast_1d(required("attention.sliding_window_pattern"))), arch, layers, spec)

    def per_layer(key: str) -> list[int]:
        value = np.atleast_1d(required(key))
        return [int(v) for v in (value if len(value) == layers else [value[0]] * layers)]

    kv_heads, widths = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
    shared = int(read_field(reader, f"{arch}.attention.shared_kv_layers", 0) or 0)
    full = [i for i, windowed in enumerate(pattern) if not windowed]
    swa_kv = next((kv_heads[i] for i in range(layers) if pattern[i]), kv_heads[0])
    global_kv = kv_heads[full[0]] if full else swa_kv
    global_head_dim = int(required("attention.key_length"))
    head_dim = int(read_field(reader, f"{arch}.attention.key_length_swa") or global_head_dim)
    angles = global_head_dim // 2
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type))
        angles = int((factors.ravel() == 1.0).sum())
    owners = [i for i in full if i < layers - shared]
    keys_as_values = bool(owners) and all(f"blk.{i}.attn_v.weight" not in tensors for i in owners)
    per_layer_width = int(read_field(reader, f"{arch}.embedding_length_per_layer_input", 0) or 0)
    full_rope = {"rope_type": "proportional", "partial_rotary_factor": 2 * angles / global_head_dim,
                 "rope_theta": short_float(read_field(reader, f"{arch}.rope.freq_base", 1e6))}  # fmt: skip
    local_rope = {"rope_type": "default", "rope_theta": short_float(read_field(reader, f"{arch}.rope.freq_base_swa",
                                                                               1e4))}  # fmt: skip
    softcap = read_field(reader, f"{arch}.final_logit_softcapping")
    config: dict[str, Any] = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": int(required("embedding_length")),
        "intermediate_size": min(widths),
        "use_double_wide_mlp": max(widths) == 2 * min(widths),
        "num_hidden_layers": layers,
        "num_attention_heads": int(np.atleast_1d(required("attention.head_count"))[0]),
        "num_key_value_heads": swa_kv,
        "head_dim": head_dim,
        "per_layer_config": {str(i): {"head_dim": global_head_dim, "num_key_value_heads": global_kv} for i in full},
        "attention_k_eq_v": keys_as_values,
        "num_kv_shared_layers": shared,
        "layer_types": ["sliding_attention" if windowed else "full_attention" for windowed in pattern],
        "sliding_window": int(required("attention.sliding_window")),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": short_float(required("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"full_attention": full_rope, "sliding_attention": local_rope},
        "max_position_embeddings": int(required("context_length")),
        "final_logit_softcapping": None if softcap is None else short_float(softcap),
        "hidden_size_per_layer_input": per_layer_width,
        "vocab_size_per_layer_input": int(tensors["per_layer_token_embd.weight"].shape[-1]) if per_layer_width else 0,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": int(read_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": int(read_field(reader, "tokenizer.ggml.eos_token_id", 1)),
        "torch_dtype": "float32",
    }
    experts = int(read_field(reader, f"{arch}.expert_count", 0) or 0)
    if experts:
        config.update({"enable_moe_block": True, "num_experts": experts,
                       "top_k_experts": int(required("expert_used_count")),
                       "moe_intermediate_size": int(required("expert_feed_forward_length"))})  # fmt: skip
    return config


def _long_rope_config(reader: GGUFReader, arch: str, tensors: dict[str, Any], spec: str) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp stores it (`rope_factors_long` / `rope_factors_short` tensors, the original
    context length and the attention factor) -> config.json's `rope_scaling` and `original_max_position_embeddings`."""
    original = read_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None or "rope_factors_short.weight" not in tensors:
        raise ValueError(f"model {spec!r}: LongRoPE factors without short factors or an original context length")

    def factors(name: str) -> list[float]:
        tensor = tensors[name]
        return [short_float(x) for x in np.asarray(dequantize(tensor.data, tensor.tensor_type)).ravel()]

    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": factors("rope_factors_long.weight"),
        "short_factor": factors("rope_factors_short.weight"),
        "original_max_position_embeddings": int(original),
    }
    attention = read_field(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = short_float(attention)
    return {"rope_scaling": scaling, "original_max_position_embeddings": int(original)}


def llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling, as llama.cpp stores them in `rope_freqs` (with `low` equal to
    `high` no frequency lies between the bands)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high: the medium band is empty
        smooth = (original / wavelen - low) / (high - low)
        medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, original: int | None, spec: str
) -> dict[str, Any]:
    """Recover the HF `rope_scaling` dict from a `rope_freqs` tensor (the first of `_LLAMA3_FREQ_BANDS` it matches),
    or refuse if it is not llama3's."""
    original = original or _LLAMA3_ORIGINAL_CONTEXT
    factor = float(factors.max())
    for low, high in _LLAMA3_FREQ_BANDS:
        expected = llama3_rope_factors(theta, head_dim, factor, low, high, original)
        if factors.shape == expected.shape and np.allclose(factors, expected, rtol=1e-3):
            return {
                "rope_type": "llama3",
                "factor": short_float(factor),
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ValueError(f"model {spec!r}: rope_freqs tensor does not match llama3 rope scaling; unsupported")


# llama.cpp's `{arch}.pooling_type` values that ladle pools with (0 is none, 4 a reranker's: not an embedding model).
_GGUF_POOLING = {1: PoolingMethod.MEAN, 2: PoolingMethod.CLS, 3: PoolingMethod.LAST}


def gguf_pooling(reader: GGUFReader) -> PoolingMethod | None:
    """How an embedding model's GGUF file says to pool its hidden states (`{arch}.pooling_type`); None for a
    generative model."""
    arch = read_field(reader, "general.architecture")
    value = read_field(reader, f"{arch}.pooling_type")
    return None if value is None else _GGUF_POOLING.get(int(value))
