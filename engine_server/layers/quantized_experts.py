"""A mixture of experts kept quantized on the CPU, and its routers computed so that no row depends on its batch.

`QuantizedExperts` takes a `ParallelExperts`' place under `--quantization gguf` (a GGUF file's `ffn_*_exps`
blocks, `quantization.stored_weights`: Q4_0, Q4_1, Q8_0, and Q5_0, Q5_1, Q4_K, Q5_K, Q6_K as `LowBitWeight`s) or
`int8` (each expert's float weights as 8-bit groups of 32): every expert's gate and up rows as one packed weight,
its down rows as another (each in its own format), stacked over the experts, and the whole block
(the experts grouped by token, gate/up, SiLU, down, the weighted sum) in one C++ call,
`torch.ops.ladle_cpu.moe_packed` (`ladle_kernels/cpu/moe.cpp`; contract: `ladle_kernels.reference.quantized_moe`). Each
expert's products are `QuantizedLinear`'s on the same blocks, so a token's result does not depend on the tokens
beside it. Under tensor parallelism a rank holds every expert's slice of the intermediate rows, as
`ParallelExperts` does.

`RowwiseLinear` keeps a router's float weight (its logits choose the experts: a rounding step could change the
choice) but multiplies in one fixed order per row (`torch.ops.ladle_cpu.rowwise_linear`): a float GEMM's blocking
may change with the number of rows, and then which experts a token gets could depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from engine_server.layers.lowbit_weight import LowBitWeight
from engine_server.layers.moe import GroupedTopkRouter
from engine_server.layers.quantized_linear import (
    Q4Weight,
    Q8Weight,
    QuantizedWeight,
    concat_rows,
    pack_for_cpu,
    quantize_q8,
    weight_format,
)
from engine_server.layers.rg_lru import BlockGates
from engine_server.parallel.layers import ParallelExperts
from ladle_kernels.reference import QUANT_GROUP

# A mixture of experts' router and its shared expert's one-output gate: their logits stay float.
ROUTER_SUFFIXES = (".mlp.gate", ".mlp.shared_expert_gate", ".router.proj")  # the last: Gemma 4's


# The formats of the experts' kernels (ladle_kernels/cpu/moe.cpp): those of `packed_linear`, one per weight.
ExpertWeight = Q4Weight | Q8Weight | LowBitWeight


@dataclass(frozen=True)
class ExpertWeights:
    """One bank's experts as this rank keeps them, in expert order: `gate_up[e]` expert e's gate rows then its up
    rows (`[2 * I_r, H]`), `down[e]` its down projection (`[H, I_r]`); where the experts have biases (gpt-oss),
    `b13` `[E, 2 * I_r]` and `b2` `[E, H]` (`ParallelExperts`'), float."""

    gate_up: tuple[ExpertWeight, ...]
    down: tuple[ExpertWeight, ...]
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    # The same experts as two weights of the whole bank, every expert's rows in expert order (gate_up's, then
    # down's), where a reader has them so (`bank_weights`): packed at once instead of expert by expert and stacked.
    whole: tuple[ExpertWeight, ExpertWeight] | None = None

    @property
    def format(self) -> str:
        """`q4`, `q8`, a GGUF kind (`q4_k`, ...), or gate/up's and down's joined by "+" where they differ
        (`q4_k+q6_k`)."""
        formats = dict.fromkeys(weight_format(w) for w in (self.gate_up[0], self.down[0]))
        return "+".join(formats)


def _stacked(weights: tuple[ExpertWeight, ...], whole: ExpertWeight | None = None) -> list[torch.Tensor]:
    """Each weight packed for the CPU kernels (`pack_for_cpu`), stacked over the experts: packed, scales, mins.
    Given `whole` (all of them as one weight, rows in expert order) and experts of whole blocks of 8 rows, `whole`
    packed at once: the kernels' blocks of 8 rows are each expert's, so it is the same stack without the copy (a
    table that is not per block, a grid kind's codebook, repeated for each expert)."""
    experts, rows = len(weights), weights[0].shape[0]
    if whole is None or rows % 8:
        return [torch.stack(parts) for parts in zip(*(pack_for_cpu(weight) for weight in weights), strict=True)]

    def per_expert(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.numel():
            return tensor.new_empty(experts, 0)
        if tensor.dim() == 1:
            return tensor.expand(experts, -1).contiguous()
        return tensor.reshape(experts, rows // 8, *tensor.shape[1:])

    return [per_expert(tensor) for tensor in pack_for_cpu(whole)]


def row_slice(weight: ExpertWeight, start: int, stop: int) -> ExpertWeight:
    """Rows `start` to `stop` of `weight`, as views of its tensors."""
    return replace(weight, **{  # every tensor field is per row
        f.name: getattr(weight, f.name)[start:stop]
        for f in fields(weight)
        if isinstance(getattr(weight, f.name), torch.Tensor)
    })


def bank_weights(gate_up: ExpertWeight, down: ExpertWeight, experts: int) -> ExpertWeights:
    """`ExpertWeights` of a whole bank's `gate_up` (every expert's gate rows then up rows, expert after expert) and
    `down` (every expert's rows likewise): each expert's weights are views of them, and they stay `whole`."""
    per_gate_up, per_down = gate_up.shape[0] // experts, down.shape[0] // experts
    return ExpertWeights(
        tuple(row_slice(gate_up, e * per_gate_up, (e + 1) * per_gate_up) for e in range(experts)),
        tuple(row_slice(down, e * per_down, (e + 1) * per_down) for e in range(experts)),
        whole=(gate_up, down),
    )


class QuantizedExperts(nn.Module):
    """`ParallelExperts`' forward over quantized experts (CPU, float32; needs the C++ kernels).

    Every expert of the bank must hold gate/up in one format and down in one format (`ExpertWeights.format`). With
    `gelu` the experts' activation is GELU's tanh form (Gemma 4's), with `swiglu` (alpha, limit, up_offset) a clamped
    SwiGLU (gpt-oss's, HY-V4's), with `relu2` relu² of ungated experts (Nemotron-H's: `gate_up` holds each expert's up
    rows alone), else SiLU; each in the kernel, as are the weights' biases."""

    def __init__(
        self,
        weights: ExpertWeights,
        gelu: bool = False,
        swiglu: tuple[float, float, float] | None = None,
        relu2: bool = False,
    ) -> None:
        super().__init__()
        self.gelu = gelu
        self.swiglu = swiglu
        self.relu2 = relu2
        if len({weight_format(w) for w in weights.gate_up}) != 1 or len({weight_format(w) for w in weights.down}) != 1:
            raise ValueError("every expert of a bank must be stored in the same formats")
        self.num_experts = len(weights.gate_up)
        self.intermediate = weights.down[0].shape[1]
        self.hidden = weights.down[0].shape[0]
        self.format = weights.format
        whole_gate_up, whole_down = weights.whole or (None, None)
        stacked = (("w13", _stacked(weights.gate_up, whole_gate_up)), ("w2", _stacked(weights.down, whole_down)))
        for name, tensors in stacked:
            for suffix, tensor in zip(("", "_scales", "_mins"), tensors, strict=True):
                self.register_buffer(name + suffix, tensor, persistent=False)
        for name, bias in (("b13", weights.b13), ("b2", weights.b2)):
            self.register_buffer(name, None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x `[T, H]`, each token's routing `weights` and chosen `experts` `[T, k]` -> `[T, H]` (this rank's partial
        sum under tensor parallelism). The activation is the bank's (`gelu`, `swiglu`), in the kernel (`activation`
        is not used)."""
        alpha, limit, up_offset = self.swiglu or (0.0, 0.0, 1.0)
        out: torch.Tensor = torch.ops.ladle_cpu.moe_packed(
            x.contiguous(), experts.contiguous(), weights.float().contiguous(),
            self.w13, self.w13_scales, self.w13_mins, self.w2, self.w2_scales, self.w2_mins, self.intermediate,
            self.gelu, self.b13, self.b2, alpha, limit, self.relu2, up_offset,
        )  # fmt: skip
        return out

    def extra_repr(self) -> str:
        shape = f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}"
        return f"{shape}, format={self.format}, biases={self.b13 is not None}"


class RowwiseLinear(nn.Module):
    """`F.linear(x, weight, bias)` in float32 with each row's dot products summed in one fixed order (the bias, if
    any, added to each after it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out: torch.Tensor = torch.ops.ladle_cpu.rowwise_linear(rows.contiguous(), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.shape[0])


def quantize_experts(bank: ParallelExperts) -> ExpertWeights | None:
    """`bank`'s float experts (this rank's slices) as 8-bit groups of 32 (`quantize_q8`); None (the bank stays
    float) when its hidden size or this rank's intermediate rows are not a multiple of 32. Its biases, if any, are
    `replace_experts`' to add."""
    if bank.w13.shape[2] % QUANT_GROUP or bank.w2.shape[2] % QUANT_GROUP:
        return None
    gate_up, down = (quantize_q8(w.detach().reshape(-1, w.shape[2])) for w in (bank.w13, bank.w2))
    return bank_weights(gate_up, down, bank.num_experts)


def expert_weights(
    gate: list[QuantizedWeight], up: list[QuantizedWeight], down: list[QuantizedWeight]
) -> ExpertWeights:
    """Per-expert gate, up and down weights (this rank's slices) as one bank's `ExpertWeights`; no gate weights: the
    up rows alone (ungated experts, Nemotron-H's). Raises ValueError when an expert's gate and up are stored in
    different formats (a `StackedWeight`, which the kernel does not take)."""
    gate_up = tuple(concat_rows([g, u]) for g, u in zip(gate, up, strict=True)) if gate else tuple(up)
    kept = [w for w in (*gate_up, *down) if isinstance(w, Q4Weight | Q8Weight | LowBitWeight)]
    if len(kept) != len(gate_up) + len(down):
        raise ValueError("an expert's gate and up are served in one format")
    return ExpertWeights(tuple(kept[: len(gate_up)]), tuple(kept[len(gate_up) :]))


def replace_experts(model: nn.Module, weights_for: Callable[[str, ParallelExperts], ExpertWeights | None]) -> int:
    """Swap each `ParallelExperts` of `model` for a `QuantizedExperts` of `weights_for(name, bank)` with the bank's
    biases (this rank's) and activation; None keeps that bank float. Returns how many were swapped."""

    def layer_for(name: str, bank: ParallelExperts) -> nn.Module | None:
        weights = weights_for(name, bank)
        if weights is None:
            return None
        if len(weights.gate_up) != bank.num_experts or weights.gate_up[0].shape != tuple(bank.w13.shape[1:]):
            raise ValueError(f"{name}: quantized experts do not match the bank's {tuple(bank.w13.shape)}")
        weights = replace(weights, b13=bank.b13, b2=bank.b2)
        return QuantizedExperts(weights, gelu=not bank.gated_silu, swiglu=bank.swiglu, relu2=not bank.gated)

    return swap_experts(model, layer_for)


def swap_experts(model: nn.Module, layer_for: Callable[[str, ParallelExperts], nn.Module | None]) -> int:
    """Put `layer_for(name, bank)` in each `ParallelExperts`' place in `model` (by its `named_modules` name); None
    keeps that bank. Returns how many were swapped."""
    banks = [
        (parent, f"{prefix}.{name}" if prefix else name, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, ParallelExperts)
    ]
    swapped = 0
    for parent, full_name, name, bank in banks:
        layer = layer_for(full_name, bank)
        if layer is not None:
            setattr(parent, name, layer)
            swapped += 1
    return swapped


def replace_routers(model: nn.Module) -> int:
    """Swap every float router of `model` (`ROUTER_SUFFIXES`' `nn.Linear`s; gpt-oss's with a bias) for a
    `RowwiseLinear` of the same weight and bias, and route each `GroupedTopkRouter` (DeepSeek-V3's, GLM-4.5's) row
    by row too (its `rowwise`), as RecurrentGemma's RG-LRU gates (`layers.rg_lru.BlockGates`); returns how many."""
    grouped = [module for module in model.modules() if isinstance(module, GroupedTopkRouter | BlockGates)]
    for router in grouped:
        router.rowwise = True
    targets = [
        (parent, name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and f"{prefix}.{name}".endswith(ROUTER_SUFFIXES)
    ]
    for parent, name, child in targets:
        setattr(parent, name, RowwiseLinear(child.weight, child.bias))
    return len(targets) + len(grouped)
