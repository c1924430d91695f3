"""Dory (NVIDIA's Nemotron-Labs Dory: a looped nGPT). Every hidden state lives on the unit sphere: each block's
update is an interpolation towards its output, normalised, at a learned rate per channel (`h += |λ| (norm(f(h)) -
h)`); queries and keys are unit vectors per head, the queries scaled per channel after rope, the attention's output
gated and normalised before `o_proj`, the MLP's gate and up scaled per channel and their product normalised before
`down_proj`, the logits scaled per token. Its middle section runs `loops` times (`config.LoopedNGpt`), each pass from
the normalised output of the one before plus the input section's: the model's layers are those passes unrolled, the
passes of one checkpoint layer the same module, each with its own KV cache. Every norm is `unit_norm` (no weight);
its learned scales are stored as `s` and read as `s * scale / initializer_range`, as transformers reads them."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import LoopedNGpt, ModelConfig
from engine_server.layers.decoder import DecoderModel
from engine_server.lora.slots import LoraBatch
from engine_server.models.base import CausalLM
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear
from engine_server.parallel.sharding import PartSlice
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels.kernel_set import KernelOps

_EPS = 1e-6  # its `DoryL2Norm`'s
_LAYER = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)")
# Its released checkpoints' layers as pairs, an attention block `layers.{2i}` and an MLP block `layers.{2i+1}`, each
# block's module `mixer` and its rate `attn_alpha` or `mlp_alpha` (transformers' `LayerPairCollapse`).
_PAIRED = re.compile(r"layers\.(?P<block>\d+)\.(?P<part>mixer|attn_alpha|mlp_alpha)(?=\.|$)")
# Its released and saved names, and transformers' in-memory ones.
_RENAMES = ((re.compile(r"\.self_attn\.g_proj\."), ".self_attn.gate_proj."), (re.compile(r"^backbone\."), "model."),
            (re.compile(r"\.embeddings\."), ".embed_tokens."))  # fmt: skip


def unit_norm(x: torch.Tensor) -> torch.Tensor:
    """`x` projected onto the unit sphere along its last dim, in float32 (`x / sqrt(sum(x²) + 1e-6)`), in its
    dtype."""
    wide = x.float()
    return (wide * torch.rsqrt(wide.pow(2).sum(-1, keepdim=True) + _EPS)).to(x.dtype)


def _whole(width: int) -> PartSlice:
    return PartSlice(width, range(width))


class DoryAttention(nn.Module):
    """Grouped-query attention of unit queries and keys per head, the queries turned by rope and then scaled per
    channel by `(sqk * sqrt(head_dim) / initializer_range)²`, the scores by `head_dim ** -0.5`; its output times
    `sigmoid(gate_proj(h) * (s_gate * hidden ** 0.25 / initializer_range)²)`, normalised, through `o_proj`. `window`:
    the layer's sliding window (0: none)."""

    def __init__(self, config: ModelConfig, loops: LoopedNGpt, dtype: torch.dtype, window: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, width = config.head_dim, config.num_attention_heads * config.head_dim
        self.q_width, self.kv_width = width, config.num_key_value_heads * config.head_dim
        parts = [_whole(width), _whole(self.kv_width), _whole(self.kv_width)]
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, config.attention_bias, dtype)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, [_whole(width)], False, dtype)
        self.o_proj = RowParallelLinear(width, config.hidden_size, config.attention_bias, SINGLE, dtype)
        self.sqk = nn.Parameter(torch.ones(width, dtype=dtype), requires_grad=False)
        self.s_gate = nn.Parameter(torch.ones(width, dtype=dtype), requires_grad=False)
        self.sqk_scale = self.head_dim**0.5 / loops.initializer_range
        self.s_gate_scale = config.hidden_size**0.25 / loops.initializer_range
        self.scale, self.window = self.head_dim**-0.5, window

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """hidden `[T, hidden]` -> `[T, hidden]`; writes this step's K/V into `kv_cache` before attending."""
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = unit_norm(q.reshape(tokens, self.num_heads, self.head_dim))
        k = unit_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache)
        q = q * (self.sqk * self.sqk_scale).view(self.num_heads, self.head_dim).square()
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        ops.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = ops.paged_attention(q.contiguous(), kv_cache, meta, self.scale, self.window, 0.0, None)
        gate = self.gate_proj(hidden) * (self.s_gate * self.s_gate_scale).square()
        out = out.reshape(tokens, self.q_width) * torch.sigmoid(gate)
        projected: torch.Tensor = self.o_proj(unit_norm(out))
        return projected


class DoryMLP(nn.Module):
    """`down(norm(silu(gate(x) * s_gate) * (up(x) * s_up)))`, `s_*` its `suv_*` times sqrt(hidden)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        width = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [_whole(width)] * 2, config.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(width, config.hidden_size, config.mlp_bias, SINGLE, dtype)
        self.suv_gate = nn.Parameter(torch.ones(width, dtype=dtype), requires_grad=False)
        self.suv_up = nn.Parameter(torch.ones(width, dtype=dtype), requires_grad=False)
        self.suv_scale = config.hidden_size**0.5

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        gate = gate * (self.suv_gate * self.suv_scale)
        up = up * (self.suv_up * self.suv_scale)
        out: torch.Tensor = self.down_proj(unit_norm(F.silu(gate) * up))
        return out


class DoryDecoderLayer(nn.Module):
    """`h = norm(h); h += |λ1| (norm(attn(h)) - h); h = norm(h); h += |λ2| (norm(mlp(h)) - h)`, `λ` its `lambda_*`
    times `alpha_init / initializer_range`."""

    def __init__(self, config: ModelConfig, loops: LoopedNGpt, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.self_attn = DoryAttention(config, loops, dtype, config.attention_window(index))
        self.mlp = DoryMLP(config, dtype)
        self.lambda_1 = nn.Parameter(torch.ones(config.hidden_size, dtype=dtype), requires_grad=False)
        self.lambda_2 = nn.Parameter(torch.ones(config.hidden_size, dtype=dtype), requires_grad=False)
        self.lambda_scale = loops.alpha_init / loops.initializer_range

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        hidden = unit_norm(hidden)
        attended = unit_norm(self.self_attn(positions, hidden, kv_cache, cos_sin_cache, meta, ops))
        hidden = hidden + (self.lambda_1 * self.lambda_scale).abs() * (attended - hidden)
        hidden = unit_norm(hidden)
        fed = unit_norm(self.mlp(hidden))
        out: torch.Tensor = hidden + (self.lambda_2 * self.lambda_scale).abs() * (fed - hidden)
        return out


class DoryDecoderModel(DecoderModel):
    """The unrolled layers (`ModelConfig.num_hidden_layers` of them, `LoopedNGpt.layer_of` the checkpoint layer
    each runs: the passes of one are the same module), each pass of the recurrent section from `norm(h) + x`, `x`
    the input section's normalised output; the final state normalised. Runs its layers in Python (no decode stack)."""

    stackable = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        loops = config.looped_ngpt
        assert loops is not None, "Dory's config has its loops"
        super().__init__(replace(config, num_hidden_layers=0), dtype, o_proj_bias, tp)  # (its own layers below)
        self.loops = loops
        first_pass: dict[int, DoryDecoderLayer] = {}
        layers = []
        for index in range(config.num_hidden_layers):
            layer = loops.layer_of(index)
            if layer not in first_pass:
                first_pass[layer] = DoryDecoderLayer(config, loops, dtype, index)
            layers.append(first_pass[layer])
        self.layers = nn.ModuleList(layers)
        self.register_module("norm", nn.Identity())  # (its final norm is `unit_norm`, without a weight)
        self.local_rope_layers = [
            self.local_rope and config.attention_window(i) > 0 for i in range(config.num_hidden_layers)
        ]

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
        hidden = self.embed(input_ids, positions, ops)
        cos_sin = self.get_buffer("cos_sin_cache")
        local = self.get_buffer("local_cos_sin_cache") if self.local_rope else cos_sin
        inputs: torch.Tensor | None = None  # the input section's output, normalised
        for index, (layer, kv_cache, reads_local) in enumerate(
            zip(self.layers, kv_caches, self.local_rope_layers, strict=True)
        ):
            if self.loops.loop_start(index):
                if inputs is None:
                    inputs = unit_norm(hidden)
                hidden = unit_norm(hidden) + inputs
            hidden = layer(positions, hidden, kv_cache, local if reads_local else cos_sin, meta, ops)
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        return unit_norm(hidden)


class LogitScale(nn.Module):
    """Dory's per-token logit scale (its LM head's `logit_scale`, read as `weight * factor`), on float32 logits."""

    def __init__(self, vocab_size: int, factor: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(vocab_size, dtype=dtype), requires_grad=False)
        self.factor = factor

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * (self.weight.float() * self.factor)


class DoryForCausalLM(CausalLM):
    """Dory (`dory`): its checkpoint's layers (its released layout's pairs of blocks, `backbone.` and `g_proj` as
    transformers saves them, or transformers' in-memory names) read into the first pass of each (the output section's
    after every pass of the recurrent one), the LM head's per-token scale (`lm_head.logit_scale`, times `1 /
    initializer_range`) applied to the float32 logits. One rank only (its norms span every head and the MLP's
    width)."""

    decoder_class = DoryDecoderModel

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        loops = config.looped_ngpt
        assert loops is not None, "Dory's config has its loops"
        self.logit_scale = LogitScale(config.vocab_size, 1 / loops.initializer_range, dtype)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        return self._first_passes(weights)

    def _first_passes(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        """Each checkpoint layer's tensors under its first pass's index; the LM head's scale as `logit_scale`'s
        weight."""
        loops = self.config.looped_ngpt
        assert loops is not None
        shift = loops.recurrent_layers * (loops.loops - 1)
        for name, tensor in weights:
            name = _transformers_name(name)
            layer = _LAYER.fullmatch(name)
            if name == "lm_head.logit_scale":
                name = "logit_scale.weight"
            elif layer is not None and int(layer["layer"]) >= loops.input_layers + loops.recurrent_layers:
                name = f"model.layers.{int(layer['layer']) + shift}.{layer['rest']}"
            yield name, tensor

    def sharded_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().sharded_logits(hidden)
        if logits is None:
            return None
        scaled: torch.Tensor = self.logit_scale(logits)
        return scaled


def _transformers_name(name: str) -> str:
    """A Dory checkpoint tensor's name as transformers' model holds it: a released pair of blocks one layer
    (`layers.{2i}.mixer.` its `self_attn.`, `layers.{2i+1}.mixer.` its `mlp.`, `attn_alpha` and `mlp_alpha` its
    `lambda_1` and `lambda_2`), `backbone.` as `model.`, `embeddings` as `embed_tokens`, `g_proj` as `gate_proj`."""
    paired = _PAIRED.search(name)
    if paired is not None:
        block, part = int(paired["block"]), paired["part"]
        ours = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(part, ("self_attn", "mlp")[block % 2])
        name = f"{name[: paired.start()]}layers.{block // 2}.{ours}{name[paired.end() :]}"
    for theirs, ours in _RENAMES:
        name = theirs.sub(ours, name)
    return name
