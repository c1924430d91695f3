"""Tiny random models of each decoder family, saved by transformers into a folder as a real checkpoint is (nothing
fetched), and transformers' own greedy decoding on them: the oracle the engine's float path must equal token for
token.

A folder holds the family's safetensors and config.json, and the embedded model's tokenizer (every id it emits fits
the 49,152-token vocabulary). Weights are drawn wider than transformers' init (std 0.02 leaves every logit near
every other), and routers wider still (though not so wide that one expert takes all the weight, which would hide
how the others' weights are combined), so that neither the next token nor an expert choice is a near-tie that
float rounding could flip.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from engine_server.loader import resolve_model

VOCAB_SIZE = 49152
_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
# Each family's transformers config class and what sets its quirks apart. MoE: Mixtral's top-2 of 4 renormalised;
# Qwen3-MoE's top-3 of 8 small experts renormalised, one dense layer; Qwen2-MoE's top-2 of 4 not renormalised,
# beside a sigmoid-gated shared expert, with q/k/v biases.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "mlp_only_layers": [1], "head_dim": 16},
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48},
    ),
}  # fmt: skip


def save_family(folder: Path, family: str, seed: int = 0) -> Path:
    """A random `family` model (FAMILIES) saved to `folder` with the embedded tokenizer; returns `folder`."""
    import transformers

    class_name, quirks = FAMILIES[family]
    config = getattr(transformers, class_name)(**{**_SHAPE, **quirks})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a router: logits ~N(0, 2.4²), spread but not one-hot
                parameter.normal_(0.0, 0.3)
            elif parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
            elif "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(folder)
    source = resolve_model("default").tokenizer_path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def load_reference(folder: Path) -> Any:
    """transformers' model on `folder`, float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


def hf_greedy(model: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Plain greedy decoding with transformers' KV cache, every prompt in one batch: argmax of each step's logits,
    nothing else. The prompts are left-padded, masked out and given their own positions (0 at each prompt's first
    token), so each row computes what it would alone; only float32 summation order can differ from a batch of one,
    by ~1e-6 relative, which moves an argmax only at an exact near-tie."""
    from transformers import DynamicCache

    width = max(map(len, prompts))
    step_input = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    steps: list[torch.Tensor] = []
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(
                input_ids=step_input, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            ).logits[:, -1]
            steps.append(logits.argmax(-1))
            step_input, positions = steps[-1][:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
    return torch.stack(steps, dim=1).tolist()
