"""Adapters' weights stacked in slots on the model's device, and their application to a step's rows.

For each layer and fused projection (`targets.PROJECTIONS`, in the layer's own shape: Gemma 4's differ) the slots
hold `a` `[S, P * R, in]` and, per segment (`targets.Segment`), `b` `[S, R, rows]` (S = --max-loras,
R = --max-lora-rank, P the projection's segments): slot s
is one adapter, each of its modules in its segments' rank blocks and rows, B transposed and already scaled,
everything else zero. A step's rows of many adapters then run as one shrink per projection and one expand per
segment (`KernelOps.lora_shrink` / `lora_expand`), indexed by each row's slot (-1: the base model alone).
Zero-padded ranks add exact zeros, so an adapter of rank 8 in a slot of rank 16 computes what it computes alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine_server.config import ModelConfig
from engine_server.lora.peft_format import LoraAdapter
from engine_server.lora.targets import MLP_PROJECTIONS, PROJECTIONS, ProjectionShape, projection_shapes
from ladle_kernels.kernel_set import KernelOps


class LoraSlots:
    """The slots' weights (zero until `load`). Owned by the model runner, written only between steps.

    Per layer and fused projection: `a` `[S, P * R, in]` (segment p's rank block holds the A of the module over
    its rows) and, per segment, `b` `[S, R, rows]`: B transposed and scaled, so that the expand of a segment is
    `out[:, rows] += y[:, block] @ b[slot]`.
    """

    def __init__(
        self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.shapes = [projection_shapes(config, layer) for layer in range(config.num_hidden_layers)]  # per layer
        # Per layer: projection -> (a, one b per segment). A mixture-of-experts layer has no dense MLP to adapt, a
        # linear-attention layer no attention.
        self.stacks: list[dict[str, tuple[torch.Tensor, list[torch.Tensor]]]] = []
        for layer in range(config.num_hidden_layers):
            stacks = {}
            for name in PROJECTIONS:
                if name in MLP_PROJECTIONS and config.is_moe_layer(layer):
                    continue
                if name not in MLP_PROJECTIONS and config.is_recurrent_layer(layer):
                    continue  # Gated DeltaNet (Qwen3.5), LFM2's convolution: no q/k/v/o projections to adapt
                shape = self.shapes[layer][name]
                a = torch.zeros(max_loras, shape.parts * max_rank, shape.in_features, dtype=dtype, device=device)
                b = [torch.zeros(max_loras, max_rank, seg.out_features, dtype=dtype, device=device)
                     for seg in shape.segments]  # fmt: skip
                stacks[name] = (a, b)
            self.stacks.append(stacks)
        # Per slot, the (projection, segment index) pairs its adapter changes in some layer: a step runs the kernels
        # of the pairs its adapters change, and no others (an adapter on q and v reads no o, gate, up or down).
        self.segments: list[frozenset[tuple[str, int]]] = [frozenset()] * max_loras

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.stacks
            for a, bs in layer.values()
            for t in (a, *bs)
        )

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` (whatever it held before is gone)."""
        self.clear(slot)
        rank = self.max_rank
        changed: set[tuple[str, int]] = set()
        for piece in adapter.pieces:
            target = piece.target
            a, bs = self.stacks[piece.layer][target.projection]
            r = piece.a.shape[0]
            first, last = target.out_offset, target.out_offset + target.out_features
            segments = self.shapes[piece.layer][target.projection].segments
            for index, (segment, b) in enumerate(zip(segments, bs, strict=True)):
                lo, hi = max(first, segment.out_offset), min(last, segment.out_offset + segment.out_features)
                if lo >= hi:
                    continue
                changed.add((target.projection, index))
                block = segment.part * rank
                a[slot, block : block + r].copy_(piece.a)
                rows = piece.b[lo - first : hi - first]  # [rows, r]
                b[slot, :r, lo - segment.out_offset : hi - segment.out_offset].copy_(rows.T)
        self.segments[slot] = frozenset(changed)

    def changed_by(self, slots: Iterable[int]) -> frozenset[tuple[str, int]]:
        """The (projection, segment index) pairs the adapters in `slots` change (-1, no adapter, changes none)."""
        return frozenset().union(*(self.segments[slot] for slot in set(slots) if slot >= 0))

    def clear(self, slot: int) -> None:
        for layer in self.stacks:
            for a, bs in layer.values():
                a[slot].zero_()
                for b in bs:
                    b[slot].zero_()
        self.segments[slot] = frozenset()


@dataclass(frozen=True)
class LoraBatch:
    """A step's adapters: `slots` `[T]` int64 on the model's device, each token's slot (-1: none); `changed`: the
    (projection, segment index) pairs to run (`LoraSlots.changed_by` of the step's slots), None: every one (a CUDA
    graph, recorded once for any adapters)."""

    weights: LoraSlots
    slots: torch.Tensor
    changed: frozenset[tuple[str, int]] | None = None

    def layer(self, index: int) -> LayerLora:
        """The step's adapters in layer `index`."""
        weights = self.weights
        return LayerLora(weights.stacks[index], weights.shapes[index], weights.max_rank, self.slots, self.changed)


@dataclass(frozen=True)
class LayerLora:
    """One layer's slot weights (`shapes`: its projections') and the step's per-token slots: what the layer's
    projections add."""

    stacks: dict[str, tuple[torch.Tensor, list[torch.Tensor]]]
    shapes: dict[str, ProjectionShape]
    max_rank: int
    slots: torch.Tensor
    changed: frozenset[tuple[str, int]] | None

    def add(self, projection: str, x: torch.Tensor, out: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """`out` (`projection` of `x`, `[T, out]`, the base model's) plus each token's adapter update, in place;
        returned."""
        stacks = self.stacks.get(projection)
        segments = list(enumerate(self.shapes[projection].segments))
        if self.changed is not None:
            segments = [(i, segment) for i, segment in segments if (projection, i) in self.changed]
        if stacks is None or not segments:
            return out
        a, bs = stacks
        y = ops.lora_shrink(x, a, self.slots)
        rank = self.max_rank
        for index, segment in segments:
            b = bs[index]
            rows = out[:, segment.out_offset : segment.out_offset + segment.out_features]
            ops.lora_expand(rows, y[:, segment.part * rank : (segment.part + 1) * rank], b, self.slots)
        return out
