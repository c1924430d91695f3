"""Zamba2 (Zyphra's): Mamba-2 layers `h += mamba(norm(h + t))`, where before some of them ("hybrid" layers) one of a
few shared blocks gives `t`: attention over `norm(cat(h, e))` (`e` the token's embedding; heads twice as wide as
`hidden / heads`, scores scaled by `(head_dim / 2) ** -0.5`, rope optional), then with no residual an MLP over its
normalised output, each projection of that use plus a low-rank adapter of its own (the MLP's gate/up always, q, k and
v where the config says), then a linear map of that use (`t` is 0 elsewhere). The model's layers are the uses and the
Mamba-2 layers unrolled (`config.SharedBlocks`): a use keeps K/V in the paged cache, a Mamba-2 layer its states."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig, SharedBlocks
from engine_server.layers.decoder import DecoderModel
from engine_server.layers.mamba1 import Mamba1Mixer
from engine_server.layers.mamba2 import Mamba2Mixer
from engine_server.layers.norm import RMSNorm
from engine_server.lora.slots import LoraBatch
from engine_server.models.base import CausalLM
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear, RowParallelLinear, read_whole
from engine_server.parallel.sharding import PartSlice, gate_up_slices, qkv_slices
from engine_server.step_interrupt import StepInterrupt
from ladle_kernels.kernel_set import KernelOps

# A hybrid layer's parts: its Mamba-2 layer (`mamba_decoder.`), its linear map and its shared block
# (`shared_transformer.`, the block's adapters for each use in lists indexed by use).
_HYBRID = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<part>mamba_decoder|linear|shared_transformer|shared_transf)"
                     r"\.(?P<rest>.+)")
_ADAPTER = re.compile(r"(?P<proj>self_attn\.linear_[qkv]_adapter_list|feed_forward\.gate_up_proj_adapter_list)"
                      r"\.(?P<use>\d+)\.(?P<rest>.+)")  # fmt: skip
_ADAPTER_NAMES = {"self_attn.linear_q_adapter_list": "q_adapter", "self_attn.linear_k_adapter_list": "k_adapter",
                  "self_attn.linear_v_adapter_list": "v_adapter",
                  "feed_forward.gate_up_proj_adapter_list": "gate_up_adapter"}  # fmt: skip
# The MLP adapter's two projections as `GateUpAdapter` names them.
_GATE_UP_ADAPTER = {"0.weight": "down.weight", "1.weight": "gate_up_proj.weight"}
_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class LowRank(nn.Sequential):
    """An adapter `up(down(x))` of rank `rank` (its checkpoint's `0.weight`, `1.weight`): `down` whole on every
    rank, `up` this rank's rows of the projection it adds to (`parts`)."""

    def __init__(self, width: int, rank: int, parts: list[PartSlice], dtype: torch.dtype) -> None:
        down = nn.Linear(width, rank, bias=False, dtype=dtype)
        super().__init__(down, ColumnParallelLinear(rank, parts, False, dtype))


class GateUpAdapter(nn.Module):
    """The MLP's adapter, `gate_up_proj(down(x))` (its checkpoint's `0.weight` and `1.weight`): `gate_up_proj` this
    rank's rows of the gate and of the up projection, loaded as a fused gate/up."""

    def __init__(self, width: int, rank: int, parts: list[PartSlice], dtype: torch.dtype) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False, dtype=dtype)
        self.gate_up_proj = ColumnParallelLinear(rank, parts, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.gate_up_proj(self.down(x))
        return out


class SharedUse(nn.Module):
    """One use of a shared block (a hybrid layer's): its adapters (this rank's rows of what they add to) and its
    linear map of the block's output (whole on every rank)."""

    def __init__(
        self, config: ModelConfig, blocks: SharedBlocks, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        width, rank = 2 * config.hidden_size, blocks.adapter_rank
        q, k, v = qkv_slices(config.num_attention_heads, config.num_key_value_heads, config.head_dim, tp.size, tp.rank)
        adapters = blocks.attention_adapters
        self.q_adapter = LowRank(width, rank, [q], dtype) if adapters else None
        self.k_adapter = LowRank(width, rank, [k], dtype) if adapters else None
        self.v_adapter = LowRank(width, rank, [v], dtype) if adapters else None
        gate_up = list(gate_up_slices(config.intermediate_size, tp.size, tp.rank))
        self.gate_up_adapter = GateUpAdapter(config.hidden_size, rank, gate_up, dtype) if rank else None
        self.linear = nn.Linear(config.hidden_size, config.hidden_size, bias=False, dtype=dtype)


class SharedBlock(nn.Module):
    """A shared attention + MLP block: `mlp(norm(attn(norm(cat(h, e)))))`, no residual; each use's adapters added
    to its projections (`SharedUse`). Under tensor parallelism a rank holds its heads (their rows of q, k and v,
    their columns of `o_proj`) and a block of the MLP's width, and all-reduces both outputs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        width = 2 * config.hidden_size
        parts = qkv_slices(config.num_attention_heads, config.num_key_value_heads, config.head_dim, tp.size, tp.rank)
        self.head_dim, self.sizes = config.head_dim, [len(part.rows) for part in parts]
        self.heads, self.kv_heads = self.sizes[0] // config.head_dim, self.sizes[1] // config.head_dim
        self.input_layernorm = RMSNorm(width, config.rms_norm_eps, dtype)
        self.qkv_proj = ColumnParallelLinear(width, list(parts), False, dtype)
        heads_width = config.num_attention_heads * config.head_dim
        self.o_proj = RowParallelLinear(heads_width, config.hidden_size, False, tp, dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        intermediate = config.intermediate_size
        gate_up = list(gate_up_slices(intermediate, tp.size, tp.rank))
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, gate_up, False, dtype)
        self.down_proj = RowParallelLinear(intermediate, config.hidden_size, False, tp, dtype)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.rope = config.uses_rope(0)
        self.scale = (config.head_dim / 2) ** -0.5

    def forward(
        self,
        hidden: torch.Tensor,
        embeddings: torch.Tensor,
        use: SharedUse,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """`use`'s output before its linear map, `[T, hidden]`; writes the step's K/V into `kv_cache`."""
        tokens = hidden.shape[0]
        x = self.input_layernorm(torch.cat([hidden, embeddings], dim=-1), ops)
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        if use.q_adapter is not None and use.k_adapter is not None and use.v_adapter is not None:
            q, k, v = q + use.q_adapter(x), k + use.k_adapter(x), v + use.v_adapter(x)
        q = q.reshape(tokens, self.heads, self.head_dim)
        k = k.reshape(tokens, self.kv_heads, self.head_dim)
        v = v.reshape(tokens, self.kv_heads, self.head_dim)
        if self.rope:
            q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache)
        ops.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        attended = ops.paged_attention(q.contiguous(), kv_cache, meta, self.scale, 0, 0.0, None)
        y = self.tp.all_reduce_sum(self.o_proj(attended.reshape(tokens, self.sizes[0])))
        y = self.pre_ff_layernorm(y, ops)
        gate_up = self.gate_up_proj(y)
        gate, up = (gate_up if use.gate_up_adapter is None else gate_up + use.gate_up_adapter(y)).chunk(2, dim=-1)
        # (its activation over a contiguous copy: torch's erf over a strided view rounds by the batch's shape)
        out: torch.Tensor = self.tp.all_reduce_sum(self.down_proj(self.act(gate.contiguous()) * up))
        return out


class Zamba2MambaLayer(nn.Module):
    """A Mamba-2 layer (Zamba's: a multi-head Mamba-1 one): `h + mamba(norm(h + t))`, `t` the shared block's
    output before it (0 where none)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mamba = Mamba1Mixer(config, dtype, tp) if config.mamba1 is not None else Mamba2Mixer(config, dtype, tp)


class Zamba2DecoderModel(DecoderModel):
    """Its Mamba-2 layers (`layers`, one a checkpoint layer), shared blocks (`blocks`) and their uses (`uses`, one a
    hybrid layer), run in the unrolled order (`SharedBlocks.layers`); `kv_caches` holds each unrolled layer's K/V or
    states. Runs its layers in Python (no decode stack)."""

    stackable = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        shared = config.shared_blocks
        assert shared is not None, "Zamba2's config has its shared blocks"
        checkpoint_layers = config.num_hidden_layers - len(shared.hybrid_layers)
        super().__init__(replace(config, num_hidden_layers=0), dtype, o_proj_bias, tp)  # (its own layers below)
        self.unrolled = shared.layers(checkpoint_layers)
        self.use_of = {layer: use for use, layer in enumerate(shared.hybrid_layers)}
        self.block_count = shared.blocks
        self.layers = nn.ModuleList(Zamba2MambaLayer(config, dtype, tp) for _ in range(checkpoint_layers))
        self.blocks = nn.ModuleList(SharedBlock(config, dtype, tp) for _ in range(shared.blocks))
        self.uses = nn.ModuleList(SharedUse(config, shared, dtype, tp) for _ in shared.hybrid_layers)

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
        """(A step with Mamba-2 states runs whole: `interrupt` is not read between layers.)"""
        hidden = embeddings = self.embed(input_ids, positions, ops)
        cos_sin = self.get_buffer("cos_sin_cache")
        shared: torch.Tensor | None = None
        for (layer, is_use), cache in zip(self.unrolled, kv_caches, strict=True):
            if is_use:
                use = self.use_of[layer]
                this_use = cast(SharedUse, self.uses[use])
                block = self.blocks[use % self.block_count]
                shared = this_use.linear(block(hidden, embeddings, this_use, positions, cache, cos_sin, meta, ops))
                continue
            mamba = cast(Zamba2MambaLayer, self.layers[layer])
            mixed = hidden if shared is None else hidden + shared
            hidden = hidden + mamba.mamba(positions, mamba.input_layernorm(mixed, ops), cache, cos_sin, meta, ops)
            shared = None
        normed: torch.Tensor = self.norm(hidden, ops)
        return normed


class Zamba2ForCausalLM(CausalLM):
    """Zamba2 (`zamba2`): its checkpoint's hybrid layers read as their Mamba-2 layer (`mamba_decoder.`), their use's
    linear map and adapters (`uses.<k>`: the shared block's adapter lists are indexed by use), and the shared block
    they run (`blocks.<k % blocks>`: a checkpoint may hold it under each use's layer or, as transformers saves it,
    under the first's; untied, each use's own, whose adapters for the other uses are not read); Mamba-2's `A_log`,
    `dt_bias` and `D` are `HeadSlice`s."""

    decoder_class = Zamba2DecoderModel
    checkpoint_renames = (
        *((f".mamba.{kind}", f".mamba.{kind}.weight") for kind in ("A_log", "dt_bias", "D")),
        ("model.final_layernorm.", "model.norm."),
        (".self_attn.o_proj.", ".o_proj."),
        (".feed_forward.down_proj.", ".down_proj."),
        (".feed_forward.gate_up_proj.", ".gate_up_proj."),
        (".feed_forward.gate_proj.", ".gate_proj."),  # (Zamba's, apart; its per-head Mamba-1 projections)
        (".mamba.x_proj_weight", ".mamba.x_proj.weight"),
        (".mamba.dt_proj_weight", ".mamba.dt_proj.weight"),
        (".mamba.dt_proj_bias", ".mamba.dt_proj.bias"),
        (".feed_forward.up_proj.", ".up_proj."),
        (".self_attn.q_proj.", ".q_proj."),
        (".self_attn.k_proj.", ".k_proj."),
        (".self_attn.v_proj.", ".v_proj."),
    )

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        return self._unrolled_names(weights)

    def _unrolled_names(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        shared = self.config.shared_blocks
        assert shared is not None
        use_of = {layer: use for use, layer in enumerate(shared.hybrid_layers)}
        for name, tensor in weights:
            if name.endswith((".mamba.A_log", ".mamba.D")) and tensor.dim() == (3 if name.endswith("A_log") else 2):
                tensor = read_whole(tensor).flatten(0, 1)  # Zamba's, by head: its channels' rows in turn
            elif name.endswith(".mamba.in_proj.weight") and self.config.mamba1 is not None:
                whole = read_whole(tensor)  # Zamba's x and z rows interleaved, channel by channel: x's, then z's
                tensor = torch.cat((whole[0::2], whole[1::2]))
            hybrid = _HYBRID.fullmatch(name)
            if hybrid is None:
                yield name, tensor
                continue
            layer, part, rest = int(hybrid["layer"]), hybrid["part"], hybrid["rest"]
            if layer not in use_of:
                raise ValueError(f"weight {name!r}: layer {layer} is not a hybrid layer of this config")
            if part == "mamba_decoder":
                yield f"model.layers.{layer}.{rest}", tensor
            elif part == "linear":
                yield f"model.uses.{use_of[layer]}.linear.{rest}", tensor
            elif (adapter := _ADAPTER.fullmatch(rest)) is not None:
                # a block holds adapters for each use of it; untied (each use a block), a use reads its own block's
                use = int(adapter["use"])
                if use % shared.blocks == use_of[layer] % shared.blocks:
                    kind, part = _ADAPTER_NAMES[adapter["proj"]], adapter["rest"]
                    part = _GATE_UP_ADAPTER.get(part, part) if kind == "gate_up_adapter" else part
                    yield f"model.uses.{use}.{kind}.{part}", tensor
            else:
                yield f"model.blocks.{use_of[layer] % shared.blocks}.{rest}", tensor
