"""Where an adapter's modules land in the engine's fused projections.

The decoder layers fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (engine_server.layers). A PEFT
adapter names the model's own modules: the separate ones of most families (`q_proj`, `gate_proj`, ...) or the
fused ones of Phi-3 (`qkv_proj`, `gate_up_proj`). Each lands in one *part* of a fused projection: its rows of the
output, and a block of the slot's rank (part p holds ranks `[p * max_rank, (p + 1) * max_rank)`), so an adapter
on q and v of one layer is one shrink and one expand over a block-diagonal B.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_server.config import ModelConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MLP_PROJECTIONS = frozenset({"gate_up_proj", "down_proj"})


@dataclass(frozen=True)
class Target:
    """One adapter module's place: `projection`'s output rows `[out_offset, out_offset + out_features)`, rank
    block `part`, reading `in_features` inputs."""

    projection: str
    part: int
    out_offset: int
    out_features: int
    in_features: int


@dataclass(frozen=True)
class ProjectionShape:
    """A fused projection's inputs, outputs and how many parts (rank blocks) it has."""

    in_features: int
    out_features: int
    parts: int


def projection_shapes(config: ModelConfig) -> dict[str, ProjectionShape]:
    """Each fused projection's shape in a dense layer of `config` (`config.intermediate_size` wide MLP)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": ProjectionShape(hidden, q + 2 * kv, 3),
        "o_proj": ProjectionShape(q, hidden, 1),
        "gate_up_proj": ProjectionShape(hidden, 2 * inner, 2),
        "down_proj": ProjectionShape(inner, hidden, 1),
    }


def module_targets(config: ModelConfig) -> dict[str, Target]:
    """Every module path an adapter may change (`self_attn.q_proj`, `mlp.gate_up_proj`, ...) and its place."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "self_attn.q_proj": Target("qkv_proj", 0, 0, q, hidden),
        "self_attn.k_proj": Target("qkv_proj", 1, q, kv, hidden),
        "self_attn.v_proj": Target("qkv_proj", 2, q + kv, kv, hidden),
        "self_attn.qkv_proj": Target("qkv_proj", 0, 0, q + 2 * kv, hidden),
        "self_attn.o_proj": Target("o_proj", 0, 0, hidden, q),
        "mlp.gate_proj": Target("gate_up_proj", 0, 0, inner, hidden),
        "mlp.up_proj": Target("gate_up_proj", 1, inner, inner, hidden),
        "mlp.gate_up_proj": Target("gate_up_proj", 0, 0, 2 * inner, hidden),
        "mlp.down_proj": Target("down_proj", 0, 0, hidden, inner),
    }
