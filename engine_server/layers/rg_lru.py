"""RecurrentGemma's (Griffin's) recurrent block, over a state per sequence.

`linear_x` and `linear_y` give each token x and y (`config.RGLRU.width` channels each, with biases); a depthwise
causal convolution (with a bias, no activation) runs over x; then the RG-LRU: per block of `width / heads` channels,
an input gate `sigmoid(x W_x + b_x)` and a recurrence gate `sigmoid(x W_a + b_a)` (block-diagonal projections),
`log a = -8 * gate_a * softplus(recurrent_param)`, and `h_t = a_t h_{t-1} + sqrt(1 - a_t²) * x_t * gate_x` in float32
(at a sequence's position 0 the state restarts: `h = x * gate_x`); the output `h * gelu_tanh(y)` through `linear_out`.
Token by token on every device (a token's bits then do not depend on where its chunk starts). The state (the
convolution's last inputs, then `h`) lives in the layer's float32 state rows as every recurrent layer's does
(`layers.gated_deltanet`'s `advance_states`: the same slots, prefix snapshots and copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gated_deltanet import DepthwiseConv, advance_states
from engine_server.lora.slots import LayerLora
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice
from ladle_kernels.causal_conv import convolve
from ladle_kernels.kernel_set import KernelOps


class BlockGates(nn.Module):
    """The RG-LRU's gates and rates as checkpoints name them (`rg_lru.*`): `input_gate_weight` and
    `recurrent_gate_weight` `[heads, block, block]` with their biases `[heads, block]`, and `recurrent_param`
    `[width]`; a rank keeps its blocks (`kept`) of each."""

    def __init__(self, kept: range, block: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kept, self.block = kept, block
        heads = len(kept)

        def zeros(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.input_gate_weight, self.recurrent_gate_weight = zeros(heads, block, block), zeros(heads, block, block)
        self.input_gate_bias, self.recurrent_gate_bias = zeros(heads, block), zeros(heads, block)
        self.recurrent_param = zeros(heads * block)
        # Set on the quantized CPU path (`layers.quantized_experts.replace_routers`): each block's product row by row
        # through the C++ kernel (`rowwise_linear`), whose bits do not depend on the batch, as a batched GEMM's do.
        self.rowwise = False

    own_tensors = ("input_gate_weight", "recurrent_gate_weight", "input_gate_bias", "recurrent_gate_bias",
                   "recurrent_param")  # fmt: skip

    def load_tensor(self, kind: str, tensor: CheckpointTensor) -> None:
        """Copy this rank's blocks of the checkpoint's whole tensor; ValueError for another shape."""
        whole = read_whole(tensor)
        dest: torch.Tensor = getattr(self, kind)
        if kind == "recurrent_param":  # a block's channels together
            whole, dest = whole.reshape(-1, self.block), dest.view(-1, self.block)
        if whole.dim() != dest.dim() or whole.shape[0] < self.kept.stop or whole.shape[1:] != dest.shape[1:]:
            blocks = tuple(dest.shape[1:])
            raise ValueError(f"has shape {tuple(tensor.shape)}, not {self.kept.stop}+ blocks of {blocks}")
        with torch.no_grad():
            dest.copy_(whole[self.kept.start : self.kept.stop])

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, width]` -> (input gate, log of the rate `a`) `[T, width]`, as transformers' `RecurrentGemmaRglru`
        computes them."""
        blocks = x.view(-1, len(self.kept), self.block).transpose(0, 1)  # [heads, T, block]
        if self.rowwise:
            input_gate, recurrence_gate = (
                torch.stack([torch.ops.ladle_cpu.rowwise_linear(rows.float().contiguous(), w.t().float().contiguous())
                             for rows, w in zip(blocks, weight, strict=True)]).to(x.dtype) + bias[:, None, :]
                for weight, bias in ((self.input_gate_weight, self.input_gate_bias),
                                     (self.recurrent_gate_weight, self.recurrent_gate_bias))
            )  # fmt: skip
        else:
            input_gate = torch.baddbmm(self.input_gate_bias[:, None, :], blocks, self.input_gate_weight)
            recurrence_gate = torch.baddbmm(self.recurrent_gate_bias[:, None, :], blocks, self.recurrent_gate_weight)
        input_gate, recurrence_gate = (torch.sigmoid(g.transpose(0, 1).reshape(x.shape)) for g in (input_gate,
                                                                                                   recurrence_gate))
        return input_gate, -8.0 * recurrence_gate * F.softplus(self.recurrent_param)


class RecurrentBlock(nn.Module):
    """One Griffin recurrent block (module doc), parameters named as transformers names them under
    `temporal_block.`; same call as `PagedSelfAttention`, with this layer's state tensor in place of its KV cache.

    Under tensor parallelism a rank holds a block of the gates' blocks: their channels' rows of `linear_x` and
    `linear_y`, their convolution channels and states, their gates, and `linear_out`'s columns for them (all-reduced,
    its bias added once)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        whole = config.rg_lru
        assert whole is not None, "a recurrent block needs the model's RG-LRU shape"
        shape = whole.sharded(tp.size)
        self.tp, self.width, self.taps = tp, shape.width, whole.conv_width
        channels = range(tp.rank * shape.width, (tp.rank + 1) * shape.width)
        self.linear_x: nn.Module = ColumnParallelLinear(config.hidden_size, [PartSlice(whole.width, channels)], True,
                                                        dtype)  # fmt: skip
        self.linear_y: nn.Module = ColumnParallelLinear(config.hidden_size, [PartSlice(whole.width, channels)], True,
                                                        dtype)  # fmt: skip
        self.conv_1d = DepthwiseConv([channels], whole.conv_width, dtype, bias=True)
        block = whole.width // whole.heads
        self.rg_lru = BlockGates(range(tp.rank * shape.heads, (tp.rank + 1) * shape.heads), block, dtype)
        self.linear_out: nn.Module = RowParallelLinear(whole.width, config.hidden_size, True, tp, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> `[T, hidden]`; advances each sequence's state in `state` (its row
        `meta.state_slots[i]`) by its chunk. `positions` are read for the restart at 0 (no rope: its table is not
        read); LoRA adapters are refused."""
        if lora is not None:
            raise ValueError("LoRA adapters are not applied to RecurrentGemma's recurrent blocks")
        y = F.gelu(self.linear_y(hidden), approximate="tanh")
        x = self.linear_x(hidden)
        mixed = advance_states(meta, state, "a recurrent block", lambda slots, fresh: self._core(x, positions, state,
                                                                                                 slots, fresh, meta))
        result: torch.Tensor = self.tp.all_reduce_sum(self.linear_out(mixed * y))
        return result

    def _core(
        self, x: torch.Tensor, positions: torch.Tensor, state: torch.Tensor, slots: list[int], fresh: list[bool],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """The convolution and the RG-LRU over each sequence's chunk from its state row: `[T, width]`."""
        history = state[:, : (self.taps - 1) * self.width].view(-1, self.taps - 1, self.width)
        lens = meta.query_lens_cpu
        weight = self.conv_1d.weight.reshape(self.width, self.taps)
        convolved = convolve(x, weight, history, slots, lens, fresh, silu=False)
        assert self.conv_1d.bias is not None
        convolved = convolved + self.conv_1d.bias
        input_gate, log_rate = self.rg_lru.gates(convolved)
        restart = (positions == 0)[:, None]
        rate = torch.exp(log_rate).masked_fill(restart, 0.0)
        scale = torch.sqrt(1 - torch.exp(2 * log_rate)).masked_fill(restart, 1.0)
        inputs = (convolved * input_gate) * scale.to(x.dtype)
        out = torch.empty_like(inputs)
        rows = state[:, (self.taps - 1) * self.width :]
        first = 0
        for slot, count, starts in zip(slots, lens, fresh, strict=True):
            h = torch.zeros(self.width, dtype=torch.float32, device=x.device) if starts else rows[slot].clone()
            for t in range(first, first + count):
                h = rate[t].float() * h + inputs[t].float()
                out[t] = h.to(out.dtype)
            rows[slot] = h
            first += count
        return out
