"""Gemma 3n's text decoder (`ModelConfig.altup`): Gemma 4's layers (per-layer inputs, K/V shared by the last layers,
q/k/v norms, unscaled scores) over AltUp's streams, each layer's attention beside a low-rank residual (LAuReL), the
first layers' MLPs sparse (transformers' `Gemma3nTextModel`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.gemma4 import Gemma4DecoderLayer, Gemma4DecoderModel
from engine_server.layers.mlp import GatedMLP
from engine_server.layers.norm import RMSNorm
from engine_server.lora.slots import LayerLora, LoraBatch
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels.kernel_set import KernelOps

# The floor of a stream's mean square where it is rescaled to another's magnitude (transformers' clamp).
_MAGNITUDE_FLOOR = 1e-5


class AltUpRouter(nn.Module):
    """A layer's AltUp (its `altup.*` tensors): `predict` mixes the streams `[K, T, H]` into each stream's prediction,
    `stream[j] + sum_i P[j, i] stream[i]` with `P` the `prediction_coefs` of the active stream's modalities;
    `correct` adds to each prediction the block output's innovation over the active one, times `1 +
    correction_coefs` of the output's modalities. A stream's modalities are `tanh(modality_router(router_norm(x) /
    hidden))`, one per stream (in float32, as transformers computes the tanh)."""

    def __init__(self, hidden: int, streams: int, active: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.streams, self.active, self.scale = streams, active, 1.0 / hidden
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)
        self.correction_coefs = nn.Linear(streams, streams, bias=False, dtype=dtype)
        self.prediction_coefs = nn.Linear(streams, streams * streams, bias=False, dtype=dtype)
        self.modality_router = nn.Linear(hidden, streams, bias=False, dtype=dtype)
        self.router_norm = RMSNorm(hidden, eps, dtype)

    def modalities(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """x `[T, H]` -> `[T, K]`."""
        routed = self.modality_router(self.router_norm(x, ops) * self.scale)
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        coefs = self.prediction_coefs(self.modalities(streams[self.active], ops))
        mix = coefs.reshape(-1, self.streams, self.streams)  # [T, j, i]
        return streams + torch.einsum("tji,ith->jth", mix, streams)

    def correct(self, predictions: torch.Tensor, output: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        innovation = output - predictions[self.active]
        coefs = self.correction_coefs(self.modalities(output, ops)) + 1.0  # [T, K]
        return predictions + innovation.unsqueeze(0) * coefs.t().unsqueeze(-1)


class Laurel(nn.Module):
    """LAuReL (learned augmented residual layer): `x + norm(right(left(x)))`, `left` down to `rank` dims."""

    def __init__(self, hidden: int, rank: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_left = nn.Linear(hidden, rank, bias=False, dtype=dtype)
        self.linear_right = nn.Linear(rank, hidden, bias=False, dtype=dtype)
        self.post_laurel_norm = RMSNorm(hidden, eps, dtype)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)), ops)


class Gemma3nDecoderLayer(Gemma4DecoderLayer):
    """Gemma 3n's layer on AltUp's streams `[K, T, H]`: predict them, run Gemma's sandwich block on the active one
    (its attention's output joined by LAuReL's: `(h + post_attn(attn(x)) + laurel(x)) / sqrt(2)`, `x` the input norm
    of the active prediction `h`), correct them by its output, and add the per-layer input gated from the active
    corrected stream (times `correct_output_scale`) to every other stream. No per-layer output scale. Its MLP, where
    `AltUp.sparsity` gives it one, keeps only the gate values above `mean + norm.ppf(sparsity) * std` (population
    std, over the whole width: all-reduced over the ranks' blocks of it under tensor parallelism)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        altup = config.altup
        assert altup is not None
        del self.layer_scalar  # (Gemma 4's; the checkpoint has none)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.altup = AltUpRouter(hidden, altup.streams, altup.active, eps, dtype)
        self.laurel = Laurel(hidden, altup.laurel_rank, eps, dtype)
        self.correct_scale = altup.correct_scale
        sparsity = altup.sparsity[index]
        self.tp, self.width = tp, config.layer_intermediate_size(index)
        # The cutoff's multiple of the gates' std: the standard normal's quantile (in float32, as transformers).
        self.std_multiple = (
            float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity, dtype=torch.float32)))
            if sparsity > 0 else None
        )  # fmt: skip

    def forward(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        streams: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """streams `[K, T, H]` -> the next layer's; `per_layer_input` `[T, width]`: this layer's."""
        layer_lora = None if lora is None else lora.layer(self.index)
        predictions = self.altup.predict(streams, ops)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active, ops)
        attended = self.self_attn(positions, normed, kv_cache, cos_sin_cache, meta, ops, layer_lora)
        joined = (active + self.post_attention_layernorm(attended, ops) + self.laurel(normed, ops)) / math.sqrt(2)
        out = self.feed_forward(self.pre_feedforward_layernorm(joined, ops), ops, layer_lora)
        corrected = self.altup.correct(predictions, joined + self.post_feedforward_layernorm(out, ops), ops)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        assert per_layer_input is not None, "gemma3n's layers each take a per-layer input"
        gated = F.gelu(self.per_layer_input_gate(first), approximate="tanh") * per_layer_input
        added = self.post_per_layer_input_norm(self.per_layer_projection(gated), ops)
        return torch.cat((corrected[:1], corrected[1:] + added))

    def feed_forward(
        self, hidden: torch.Tensor, ops: KernelOps, lora: LayerLora | None, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MLP; a sparse one's gates cut to those above the cutoff before its GELU."""
        if self.std_multiple is None:
            return super().feed_forward(hidden, ops, lora, token_ids)
        mlp = self.mlp
        assert isinstance(mlp, GatedMLP)
        gate, up = mlp.gate_up_proj(hidden).chunk(2, dim=-1)
        mean, std = self._gate_statistics(gate)
        activated = F.gelu(torch.relu(gate - (mean + std * self.std_multiple)), approximate="tanh") * up
        result: torch.Tensor = self.tp.all_reduce_sum(mlp.down_proj(activated))
        return result

    def _gate_statistics(self, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's mean and population std over the MLP's whole width: torch's at one rank; under tensor
        parallelism (each rank its block of the gates) from the ranks' all-reduced sums and sums of squares."""
        if self.tp.size == 1:
            return gate.mean(dim=-1, keepdim=True), gate.std(dim=-1, keepdim=True, unbiased=False)
        sums = self.tp.all_reduce_sum(torch.cat((gate.sum(dim=-1, keepdim=True),
                                                 gate.square().sum(dim=-1, keepdim=True)), dim=-1))  # fmt: skip
        mean, mean_square = (sums / self.width).split(1, dim=-1)
        return mean, (mean_square - mean.square()).clamp(min=0.0).sqrt()


class Gemma3nDecoderModel(Gemma4DecoderModel):
    """`Gemma4DecoderModel` with Gemma 3n's layers over AltUp's streams: the embeddings' extra streams projected from
    them (`altup_projections`) at the embeddings' magnitude; at the end the streams after the first projected back
    (`altup_unembed_projections`) at the first's magnitude, and their mean normalised. Runs every layer on every
    row."""

    layer_class = Gemma3nDecoderLayer

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp)
        altup = config.altup
        assert altup is not None
        hidden = config.hidden_size
        self.altup_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(altup.streams - 1)
        )
        self.altup_unembed_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(altup.streams - 1)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
        interrupt: StepInterrupt | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.get_buffer("embedding_multiplier")
        per_layer = self.per_layer_inputs(input_ids, hidden, ops)
        streams = _streams_at_magnitude(hidden, [project(hidden) for project in self.altup_projections])
        cos_sin, local = self.get_buffer("cos_sin_cache"), self.get_buffer("local_cos_sin_cache")
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            table = local if self.local_rope_layers[index] else cos_sin
            streams = layer(positions, streams, kv_cache, table, meta, ops, lora, per_layer[:, index])
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        back = [project(stream) for project, stream in zip(self.altup_unembed_projections, streams[1:], strict=True)]
        return self.norm(_streams_at_magnitude(streams[0], back).mean(dim=0), ops)


def _streams_at_magnitude(first: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """`[first, *others]` stacked, each of `others` rescaled to `first`'s RMS magnitude per token."""
    target = first.square().mean(dim=-1, keepdim=True).sqrt()
    scaled = [x * target / x.square().mean(dim=-1, keepdim=True).clamp(min=_MAGNITUDE_FLOOR).sqrt() for x in others]
    return torch.stack([first, *scaled])
