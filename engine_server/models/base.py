"""`CausalLM`: the decoder stack plus LM head, Hugging Face weight loading and the step entry points."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.decoder import DecoderModel
from engine_server.layers.kernel_choice import select_ops
from engine_server.step_interrupt import StepInterrupt
from kernels.kernel_set import KernelOps

# Checkpoint projections that live as row slices of one fused parameter: (fused name, checkpoint name, shard).
FUSED_SHARDS: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
# Buffers some older checkpoints carry; we derive them from the config instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache. Subclasses name a family and its quirks.

    Construct on the target device (e.g. inside `with torch.device("cuda"):`), then `load_weights`. `forward`
    and `compute_logits` are meant to run under `torch.inference_mode()`. `ops` selects the kernel backend;
    None picks it from the input's device on every call.
    """

    o_proj_bias_from_config: ClassVar[bool] = False  # Llama puts `attention_bias` on o_proj too; Qwen2 not.

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.ops: KernelOps | None = None
        self.model = DecoderModel(config, dtype, o_proj_bias=self.o_proj_bias_from_config and config.attention_bias)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        interrupt: StepInterrupt | None = None,
    ) -> torch.Tensor:
        """input_ids, positions `[T]` (int64) -> final hidden states `[T, hidden]`; writes the step's K/V.
        With `interrupt`, StepInterrupted once it is set, between two layers (engine_server.step_interrupt)."""
        ops = self.ops if self.ops is not None else select_ops(input_ids.device)
        hidden: torch.Tensor = self.model(input_ids, positions, kv_caches, meta, ops, interrupt)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[N, hidden]` (only the rows that sample) -> logits `[N, vocab]` in float32."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; raise ValueError on any mismatch.

        Every parameter (and every shard of a fused one) must be provided exactly as shaped; unknown names are
        refused. With tied embeddings a checkpoint's `lm_head.weight` is ignored.
        """
        params = dict(self.named_parameters())
        offsets = self._shard_offsets()
        loaded: set[tuple[str, str]] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = name, ""
            for fused, part, shard_name in FUSED_SHARDS:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), shard_name
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            dest = params[target].data
            if shard:
                start, size = offsets[shard]
                dest = dest.narrow(0, start, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in self._expected_shards(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")

    def _shard_offsets(self) -> dict[str, tuple[int, int]]:
        """Row range `(start, size)` of each shard inside its fused parameter."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        inter = c.intermediate_size
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, inter), "up": (inter, inter)}

    @staticmethod
    def _expected_shards(params: dict[str, nn.Parameter]) -> set[tuple[str, str]]:
        expected: set[tuple[str, str]] = set()
        for name in params:
            shards = [s for fused, _, s in FUSED_SHARDS if f".{fused}." in name] or [""]
            expected.update((name, s) for s in shards)
        return expected
