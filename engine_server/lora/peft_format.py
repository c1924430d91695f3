"""Read a LoRA adapter in PEFT's format and check it against the base model.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (or PEFT's older `adapter_model.bin`), whose
tensors are named `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`. Each module's update is
`scaling * B @ A`, with `scaling = lora_alpha / r` (or `/ sqrt(r)` with rsLoRA), `r` and `lora_alpha` from
`rank_pattern` / `alpha_pattern` where a pattern matches the module. What PEFT can save but ladle does not apply
is refused by name (`modules_to_save`, DoRA, trained biases, embedding or LM-head adapters, experts' MLPs), so an
adapter is served exactly as PEFT runs it, or not at all.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_server.config import ModelConfig
from engine_server.errors import ValidationError
from engine_server.lora.targets import MLP_PROJECTIONS, Target, module_targets
from ladle_kernels.reference import grouped_qkv_rows, swapped_rope_halves, unpermute_rope_rows

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# `base_model.model.` + the module's path in the model (`model.layers.3.self_attn.q_proj`) + the side.
# (EXAONE 3's layers are `transformer.h.<n>`.)
_TENSOR_NAME = re.compile(r"(?:base_model\.model\.)?((?:.*\.)?(?:layers|h)\.(\d+)\.(.+))\.lora_([AB])\.weight")
# Settings that change what PEFT computes beyond `scaling * B @ A` on the served modules: refused when set.
_REFUSED_SETTINGS = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "target_parameters": "target_parameters (adapters on raw parameters, such as experts')",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "lora_bias": "lora_bias (a bias in lora_B)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D models)",
    "layer_replication": "layer_replication",
}

# Families whose checkpoints name or lay out projections apart from the shared layers, as their model classes load
# them (`models.llama4`, `models.interleaved_rope`, `models.gpt_neox`, `models.llama`): Llama 4's MLP is
# `feed_forward`, the GPT-NeoX lineage's projections and EXAONE 3's have names of their own, and Llama 4's q/k rows
# hold each head's rope pairs interleaved (ERNIE 4.5's and Cohere's too; GLM-4's those of the first `rotary_dim` rows
# of each head), so an adapter's q/k updates are reordered as the base rows are (GPT-NeoX's `query_key_value` rows,
# head by head, as `cat(q, k, v)`).
_MODULE_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "llama4": (("feed_forward.", "mlp."),),
    "nanochat": (("mlp.fc1", "mlp.up_proj"), ("mlp.fc2", "mlp.down_proj")),
    "gpt_neox": (
        ("attention.query_key_value", "self_attn.qkv_proj"), ("attention.dense", "self_attn.o_proj"),
        ("self_attention.query_key_value", "self_attn.qkv_proj"), ("self_attention.dense", "self_attn.o_proj"),
        ("attn.c_attn", "self_attn.qkv_proj"), ("attn.c_proj", "self_attn.o_proj"),
        ("self_attn.dense", "self_attn.o_proj"), ("mlp.dense_h_to_4h", "mlp.up_proj"),
        ("mlp.dense_4h_to_h", "mlp.down_proj"), ("mlp.fc1", "mlp.up_proj"), ("mlp.fc2", "mlp.down_proj"),
        ("mlp.c_fc", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj"),
    ),
    "gptj": (("attn.out_proj", "self_attn.o_proj"), ("attn.", "self_attn."), ("mlp.fc_in", "mlp.up_proj"),
             ("mlp.fc_out", "mlp.down_proj")),
    "llama": (
        ("attn.attention.out_proj", "self_attn.o_proj"), ("attn.attention.", "self_attn."),
        ("mlp.c_fc_0", "mlp.gate_proj"), ("mlp.c_fc_1", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj"),
    ),
}  # fmt: skip
_INTERLEAVED_ROPE_ROWS = ("llama4", "glm4", "ernie4_5", "ernie4_5_moe", "cohere", "gptj")


@dataclass(frozen=True)
class LoraPiece:
    """One module's update: `a` `[r, in]`, `b` `[out, r]` already times the module's scaling, placed at `target`
    of layer `layer`."""

    layer: int
    target: Target
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read and checked against the base model: its pieces in host memory. `key` is unique to this
    load (a reload under the same name gets another), so cached KV blocks and slots never mix two loads."""

    name: str
    path: str
    key: str
    rank: int
    target_modules: tuple[str, ...]
    pieces: tuple[LoraPiece, ...]

    @property
    def nbytes(self) -> int:
        """Host bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for piece in self.pieces for t in (piece.a, piece.b))


def read_peft_adapter(path: str, name: str, key: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter in folder `path`, checked against `config` with ranks up to `max_rank`, served as `name`;
    ValidationError (param "lora_path") naming what is missing or not served. Reads files: call off the event
    loop."""
    folder = Path(path)
    settings = _read_settings(folder)
    tensors = _read_tensors(folder)
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(tensor_name)
        if match is None:
            raise _invalid(f"tensor {tensor_name!r} is not a LoRA A/B weight of a decoder layer's projection; "
                           "ladle serves adapters on q/k/v/o and gate/up/down (not on embeddings or the LM head)")
        path_in_model, layer, module, side = match[1], int(match[2]), match[3], match[4]
        for theirs, ours in _MODULE_RENAMES.get(config.architecture, ()):
            module = ours + module.removeprefix(theirs) if module.startswith(theirs) else module
        pairs.setdefault((layer, module, path_in_model), {})[side] = tensor
    pieces = [
        _piece(layer, module, path_in_model, sides, config, settings, max_rank)
        for (layer, module, path_in_model), sides in sorted(pairs.items())
    ]
    if not pieces:
        raise _invalid("the adapter has no LoRA weights")
    modules = tuple(sorted({module.rsplit(".", 1)[-1] for _, module, _ in pairs}))
    return LoraAdapter(name, str(folder), key, max(p.a.shape[0] for p in pieces), modules, tuple(pieces))


def _piece(
    layer: int,
    module: str,
    path_in_model: str,
    sides: dict[str, torch.Tensor],
    config: ModelConfig,
    settings: dict[str, Any],
    max_rank: int,
) -> LoraPiece:
    where = f"layers.{layer}.{module}"
    if not 0 <= layer < config.num_hidden_layers:
        raise _invalid(f"{where}: the model has {config.num_hidden_layers} layers")
    targets = module_targets(config, layer)
    if module not in targets:
        raise _invalid(f"{where}: ladle serves adapters on {', '.join(sorted(targets))} in layer {layer}, "
                       f"not {module!r}")
    target = targets[module]
    if target.projection in MLP_PROJECTIONS and config.is_moe_layer(layer):
        raise _invalid(f"{where}: layer {layer}'s MLP is a mixture of experts; adapters on experts are not served")
    if target.projection not in MLP_PROJECTIONS and config.is_recurrent_layer(layer):
        kind = ("linear attention (Gated DeltaNet)" if config.is_linear_layer(layer)
                else "Mamba-2" if config.mamba2 is not None else "a short convolution")  # fmt: skip
        raise _invalid(f"{where}: layer {layer} is {kind}, which has no {module}")
    if set(sides) != {"A", "B"}:
        raise _invalid(f"{where}: lora_A and lora_B come in pairs; only lora_{''.join(sides)} is there")
    a, b = sides["A"], sides["B"]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise _invalid(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make an [out, in] update")
    if tuple(a.shape) != (rank, target.in_features) or b.shape[0] != target.out_features:
        raise _invalid(f"{where}: the update is [{b.shape[0]}, {a.shape[1]}] but the base model's {module} is "
                       f"[{target.out_features}, {target.in_features}]: the adapter was trained on another model")
    if rank > max_rank:
        raise _invalid(f"{where}: rank {rank} is above the engine's --max-lora-rank {max_rank}")
    alpha = float(_pattern_value(settings.get("alpha_pattern") or {}, path_in_model, settings.get("lora_alpha", 8)))
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    b = (b.float() * scaling).to(b.dtype)
    if path_in_model.endswith(("attention.query_key_value", "attn.c_attn")):  # grouped by KV head: GPT-NeoX's,
        # Falcon's, GPT-BigCode's (GPT-2's Conv1D adapters are refused: `fan_in_fan_out`)
        b = grouped_qkv_rows(b, config.num_attention_heads, config.num_key_value_heads)
    elif (config.architecture in _INTERLEAVED_ROPE_ROWS and not config.rope_halves
          and module in ("self_attn.q_proj", "self_attn.k_proj")):  # (Cohere Compass's rows already are halves)
        b = unpermute_rope_rows(b, b.shape[0] // config.layer_head_dim(layer), config.rotary_dim)
    elif config.architecture == "nanochat" and module in ("self_attn.q_proj", "self_attn.k_proj"):
        b = swapped_rope_halves(b, b.shape[0] // config.head_dim)  # as `models.nanochat` reads its rows
    elif config.architecture in (*_INTERLEAVED_ROPE_ROWS, "nanochat") and module == "self_attn.qkv_proj":
        raise _invalid(f"{where}: a fused q/k/v adapter on {config.architecture}, whose q/k rows are reordered at "
                       "load, is not served; adapters on q_proj, k_proj and v_proj are")  # fmt: skip
    return LoraPiece(layer, target, a.contiguous(), b.contiguous())


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's per-module override: the value of the first pattern the module's path ends with (as a regex)."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module_path):
            return value
    return default


def _read_settings(folder: Path) -> dict[str, Any]:
    config_file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise _invalid(f"{str(folder)!r} is not a folder on the engine's host")
    if not config_file.is_file():
        raise _invalid(f"{str(folder)!r} has no {CONFIG_FILE}: not a PEFT adapter")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise _invalid(f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(settings, dict):
        raise _invalid(f"{CONFIG_FILE} is not a JSON object")
    if str(settings.get("peft_type", "LORA")).upper() != "LORA":
        raise _invalid(f"the adapter is {settings['peft_type']}; ladle serves LoRA adapters")
    for setting, what in _REFUSED_SETTINGS.items():
        if settings.get(setting):
            raise _invalid(f"{what} are not served ({CONFIG_FILE} sets {setting})")
    if settings.get("bias", "none") != "none":
        raise _invalid(f"trained biases are not served ({CONFIG_FILE} sets bias {settings['bias']!r})")
    return settings


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file = folder / file_name
        if not file.is_file():
            continue
        try:
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: the caller's mistake, said plainly
            raise _invalid(f"{file_name} cannot be read: {exc}") from None
        if not isinstance(loaded, dict):
            raise _invalid(f"{file_name} does not hold a dict of tensors")
        return loaded
    raise _invalid(f"{str(folder)!r} has neither of {', '.join(WEIGHT_FILES)}")


def _invalid(message: str) -> ValidationError:
    return ValidationError(f"LoRA adapter: {message}", "lora_path")
