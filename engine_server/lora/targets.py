"""Where an adapter's modules land in the engine's fused projections.

The decoder layers fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (engine_server.layers). A PEFT
adapter names the model's own modules: the separate ones of most families (`q_proj`, `gate_proj`, ...) or the
fused ones of Phi-3 (`qkv_proj`, `gate_up_proj`). A fused projection's output is cut into segments (q, k, v; gate
and up; the whole of o and of down), segment p updated from rank block p of the slot alone (ranks
`[p * max_rank, (p + 1) * max_rank)`): an adapter on q and v of one layer is then one shrink over the layer's
input and one expand per segment, and no module's rank meets another module's rows. A module that spans several
segments (Phi-3's fused ones) has its A in each of their rank blocks and its B cut along them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_server.config import ModelConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MLP_PROJECTIONS = frozenset({"gate_up_proj", "down_proj"})


@dataclass(frozen=True)
class Target:
    """One adapter module's place: `projection`'s output rows `[out_offset, out_offset + out_features)`, reading
    `in_features` inputs."""

    projection: str
    out_offset: int
    out_features: int
    in_features: int


@dataclass(frozen=True)
class Segment:
    """A block of a fused projection's output rows, `[out_offset, out_offset + out_features)`, updated from rank
    block `part` alone (q, k and v of `qkv_proj`; gate and up of `gate_up_proj`; the whole of the others)."""

    out_offset: int
    out_features: int
    part: int


@dataclass(frozen=True)
class ProjectionShape:
    """A fused projection's inputs and its segments (one rank block each)."""

    in_features: int
    segments: tuple[Segment, ...]

    @property
    def parts(self) -> int:
        return len(self.segments)


def _query_rows(config: ModelConfig, layer: int) -> tuple[int, int]:
    """(q_proj's rows, the attention output's width) in `layer`: the same, or with an output gate (Qwen3-Next,
    Qwen3.5) each head's query rows and then its gate's, twice the rows."""
    width = config.layer_q_heads(layer) * config.layer_head_dim(layer)
    return (2 * width if config.attention_output_gate else width), width


def projection_shapes(config: ModelConfig, layer: int) -> dict[str, ProjectionShape]:
    """Each fused projection's shape in dense layer `layer` of `config`: its heads' (Gemma 4's full-attention layers
    have their own), the q/k/v its `qkv_proj` holds (`ModelConfig.qkv_parts`), its MLP's width; an ungated MLP's up
    projection (`ModelConfig.ungated_mlp`) is `gate_up_proj`'s one segment."""
    q, width = _query_rows(config, layer)
    kv = config.layer_kv_heads(layer) * config.layer_head_dim(layer)
    hidden, inner = config.hidden_size, config.layer_intermediate_size(layer)
    qkv = (Segment(0, q, 0), Segment(q, kv, 1), Segment(q + kv, kv, 2))[: config.qkv_parts(layer)]
    return {
        "qkv_proj": ProjectionShape(hidden, qkv),
        "o_proj": ProjectionShape(width, (Segment(0, hidden, 0),)),
        "gate_up_proj": ProjectionShape(
            hidden, (Segment(0, inner, 0),) if config.ungated_mlp else (Segment(0, inner, 0), Segment(inner, inner, 1))
        ),
        "down_proj": ProjectionShape(inner, (Segment(0, hidden, 0),)),
    }


def module_targets(config: ModelConfig, layer: int) -> dict[str, Target]:
    """Every module path an adapter may change in layer `layer` (`self_attn.q_proj`, `mlp.gate_up_proj`, ...) and
    its place: k_proj and v_proj only where the layer has them (`ModelConfig.qkv_parts`); of an ungated MLP, up_proj
    and down_proj alone."""
    q, width = _query_rows(config, layer)
    kv = config.layer_kv_heads(layer) * config.layer_head_dim(layer)
    hidden, inner = config.hidden_size, config.layer_intermediate_size(layer)
    parts = config.qkv_parts(layer)
    attention = {"self_attn.q_proj": Target("qkv_proj", 0, q, hidden)}
    if parts > 1:
        attention["self_attn.k_proj"] = Target("qkv_proj", q, kv, hidden)
    if parts > 2:
        attention["self_attn.v_proj"] = Target("qkv_proj", q + kv, kv, hidden)
    attention.update({
        "self_attn.qkv_proj": Target("qkv_proj", 0, q + (parts - 1) * kv, hidden),
        "self_attn.o_proj": Target("o_proj", 0, hidden, width),
    })  # fmt: skip
    if config.ungated_mlp:
        return {**attention, "mlp.up_proj": Target("gate_up_proj", 0, inner, hidden),
                "mlp.down_proj": Target("down_proj", 0, hidden, inner)}  # fmt: skip
    return {
        **attention,
        "mlp.gate_proj": Target("gate_up_proj", 0, inner, hidden),
        "mlp.up_proj": Target("gate_up_proj", inner, inner, hidden),
        "mlp.gate_up_proj": Target("gate_up_proj", 0, 2 * inner, hidden),
        "mlp.down_proj": Target("down_proj", 0, hidden, inner),
    }
