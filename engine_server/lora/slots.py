"""Adapters' weights stacked in slots on the model's device, and their application to a step's rows.

For each layer and fused projection (`targets.PROJECTIONS`) the slots hold `a` `[S, P * R, in]` and `b`
`[S, out, P * R]` (S = --max-loras, R = --max-lora-rank, P the projection's parts): slot s is one adapter, each of
its modules in its part's rank block and output rows, B already scaled, everything else zero. A step's rows of
many adapters then run as one shrink and one expand per projection (`KernelOps.lora_shrink` / `lora_expand`),
indexed by each row's slot (-1: the base model alone). Zero-padded ranks add exact zeros, so an adapter of rank 8
in a slot of rank 16 computes what it computes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_server.config import ModelConfig
from engine_server.lora.peft_format import LoraAdapter
from engine_server.lora.targets import MLP_PROJECTIONS, PROJECTIONS, projection_shapes
from kernels.kernel_set import KernelOps


class LoraSlots:
    """The slots' weights (zero until `load`). Owned by the model runner, written only between steps."""

    def __init__(
        self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        shapes = projection_shapes(config)
        # Per layer: projection -> (a, b). A mixture-of-experts layer has no dense MLP to adapt.
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in range(config.num_hidden_layers):
            stacks = {}
            for name in PROJECTIONS:
                if name in MLP_PROJECTIONS and config.is_moe_layer(layer):
                    continue
                shape = shapes[name]
                rank = shape.parts * max_rank
                a = torch.zeros(max_loras, rank, shape.in_features, dtype=dtype, device=device)
                b = torch.zeros(max_loras, shape.out_features, rank, dtype=dtype, device=device)
                stacks[name] = (a, b)
            self.stacks.append(stacks)
        self.keys: list[str | None] = [None] * max_loras  # the adapter each slot holds (LoraAdapter.key)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.stacks for pair in layer.values() for t in pair)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` (whatever it held before is gone)."""
        self.clear(slot)
        rank = self.max_rank
        for piece in adapter.pieces:
            a, b = self.stacks[piece.layer][piece.target.projection]
            r, start = piece.a.shape[0], piece.target.part * rank
            rows = slice(piece.target.out_offset, piece.target.out_offset + piece.target.out_features)
            a[slot, start : start + r].copy_(piece.a)
            b[slot, rows, start : start + r].copy_(piece.b)
        self.keys[slot] = adapter.key

    def clear(self, slot: int) -> None:
        for layer in self.stacks:
            for a, b in layer.values():
                a[slot].zero_()
                b[slot].zero_()
        self.keys[slot] = None


@dataclass(frozen=True)
class LoraBatch:
    """A step's adapters: `slots` `[T]` int64 on the model's device, each token's slot (-1: none)."""

    weights: LoraSlots
    slots: torch.Tensor

    def layer(self, index: int) -> LayerLora:
        """The step's adapters in layer `index`."""
        return LayerLora(self.weights.stacks[index], self.slots)


@dataclass(frozen=True)
class LayerLora:
    """One layer's slot weights and the step's per-token slots: what the layer's projections add."""

    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor

    def add(self, projection: str, x: torch.Tensor, out: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """`out` (`projection` of `x`, `[T, out]`, the base model's) plus each token's adapter update, in place;
        returned."""
        stacks = self.stacks.get(projection)
        if stacks is not None:
            a, b = stacks
            ops.lora_expand(out, ops.lora_shrink(x, a, self.slots), b, self.slots)
        return out
