"""DeepSeek-V3 (and R1, V3.1, Kimi K2, Moonlight; DeepSeek-V2 and Mistral 4 with their own routers): multi-head
latent attention over a mixture of many small experts, a router with group-limited choice, shared experts, the
first layers dense."""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Iterator

import torch

from engine_server.config import ModelConfig
from engine_server.models.base import CausalLM, joined_convolutions, reordered_tensor, text_model_weights
from engine_server.models.llama import MISTRAL3_TOWERS
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_ROUTING_BIAS = ".mlp.gate.e_score_correction_bias"
# What a multimodal checkpoint holds beside its DeepSeek-V3 text model, not read: Mistral 3's (Mistral Small 4's)
# towers, Kimi K2.5's vision tower and its projector (`mm_projector`), and Hy4's vision tower with its patch merger
# (released as `vit.`).
_TOWERS = (*MISTRAL3_TOWERS, "mm_projector.", "model.mm_projector.", "vit.")
_SHARED_EXPERTS = (".mlp.shared_experts.", ".mlp.shared_expert.")
# Kimi Linear's checkpoints: its experts and router under `block_sparse_moe` with Mixtral's w1 (gate), w3 (up) and
# w2 (down); its decay's projections and parameters on the layer or (transformers') on a `forget_gate` of it.
_KIMI_LINEAR_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
    _SHARED_EXPERTS,
    (".self_attn.forget_gate.", ".self_attn."),
)
# Ling 3's released checkpoints (transformers' conversion, reversed): `word_embeddings`, each layer's `attention`
# with its output projection `dense`, the routing bias `expert_bias`; transformers' own files hold the decay's
# projection and parameters on a `forget_gate` of the attention.
_BAILING_HYBRID_RENAMES = (
    ("model.word_embeddings.", "model.embed_tokens."),
    (".attention.", ".self_attn."),
    (".self_attn.dense.", ".self_attn.o_proj."),
    (".mlp.gate.expert_bias", _ROUTING_BIAS),
    (".self_attn.forget_gate.", ".self_attn."),
    _SHARED_EXPERTS,
)
# HY-V4's released checkpoints, read as transformers' conversion reads them (its renames, in its order): each
# block's hyper-connection map under `hc_pre.hc_attn_layer` / `hc_pre.hc_mlp_layer` with `hc_`-prefixed parameters,
# the last one's `hc_head_*` (beside an `hc_pre.` before or after `hc_head.`: transformers writes Hy4's the other way
# round), the attention's sinks `learnable_sink_param`, its value gate (and the shared expert's gate projection)
# `linear_gate`.
_HY_V4_RENAMES = (
    (".hc_pre.hc_", ".hc_"),
    (".self_attn.learnable_sink_param", ".self_attn.sinks"),
    (".linear_gate.", ".gate_proj."),
    (".hc_attn_layer.hc_", ".attn_hc."),
    (".hc_mlp_layer.hc_", ".ffn_hc."),
    (".hc_head.hc_head_", ".hc_head.hc_"),
    _SHARED_EXPERTS,
)
# A.X K2's checkpoints: each gated norm's RMSNorm weight under `norm.`, its gate's projections down to its rank and
# back up as its released files name them (`W_down`, `W_up`) or transformers does (`mlp.fc1`, `mlp.fc2`;
# `layers.norm.GatedRMSNorm`); its queries and their gate in one projection, released as `q_b_proj` and named
# `q_gate_proj` by transformers (`_query_and_gate`).
_AXK2_RENAMES = tuple(
    (f".{norm}.{theirs}", f".{norm}.{ours}")
    for norm in ("input_layernorm", "post_attention_layernorm")
    for theirs, ours in (("norm.", ""), ("W_down.", "gate_down."), ("W_up.", "gate_up."), ("mlp.fc1.", "gate_down."),
                         ("mlp.fc2.", "gate_up."))
)
_QUERY_GATE = re.compile(r"(?P<attention>model\.layers\.\d+\.self_attn)\.(?:q_gate_proj|q_b_proj)\.weight")
# A Kimi Delta Attention layer's convolution of q, k or v, as its checkpoints store them (one convolution here;
# Ling 3's released files and transformers' hold the layer as its `attention`).
_KDA_CONV_PART = re.compile(r"(?P<layer>.+\.(?:self_attn|attention))\.(?P<part>[qkv])_conv1d\.weight")


def _head_rows(weight: torch.Tensor, heads: int, start: int, width: int) -> torch.Tensor:
    """Rows `start:start + width` of each of `heads` equal blocks of `weight`'s rows, head by head."""
    return weight.view(heads, -1, weight.shape[1])[:, start : start + width].reshape(-1, weight.shape[1]).contiguous()


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 (and the `deepseek_v2`, `kimi_k2` and `mistral4` model types, their quirks read into
    `ModelConfig`): each layer's attention is `layers.mla.MultiLatentAttention`, its MLP dense for the first
    `first_k_dense_replace` layers and otherwise a mixture of experts with `layers.moe.GroupedTopkRouter` and
    ungated shared experts (checkpoint `mlp.shared_experts`, read as `mlp.shared_expert`). The multi-token-prediction
    layers some checkpoints carry after the last layer (`model.layers.61` of V3) are not used and not read. A
    multimodal Mistral 3 checkpoint's Mistral 4 text model, and Kimi K2.5's Kimi K2 one (`kimi_k25`), are read as a
    text-only checkpoint's, their vision towers and projectors left out.

    A.X K1 (`ModelConfig.moe_output_norm`): its checkpoints hold each layer's MoE output norm on the layer
    (`post_mlp_layernorm`, read as `mlp.post_mlp_layernorm`; a dense layer's, which nothing applies, not read), and
    its released ones no routing bias (`e_score_correction_bias`: zeros where absent, as transformers leaves it).

    Kimi Linear (`kimi_linear`): its latent attention without rope, and Kimi Delta Attention on the layers
    `ModelConfig.linear_attention` names (`layers.kimi_delta`, under its own names; the q, k and v convolutions its
    files hold apart read as one), its experts under Mixtral's names in `block_sparse_moe`. Ling 3 (`bailing_hybrid`):
    the same layers with a gate per head on the latent attention, read from transformers' files or its released
    ones (`_BAILING_HYBRID_RENAMES`; the q, k and v convolutions joined likewise).

    HY-V4 (`hy_v4`): DeepSeek-V3.2's indexed latent attention with a sigmoid gate per value dim and a sink per head,
    clamped SwiGLU experts, over four residual streams (`layers.hyper_connections`, the decoder `CausalLM` picks for
    `ModelConfig.hyper_connections`), read from transformers' files or its released ones (`_HY_V4_RENAMES`); its
    multi-token-prediction layers (`model.mtp_layers`) are not read."""

    checkpoint_renames: tuple[tuple[str, str], ...] = (_SHARED_EXPERTS,)
    ignored_prefixes: tuple[str, ...] = ("model.mtp_layers.",)  # HY-V4's multi-token-prediction layers, not used

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, dtype, tp)
        self.kimi_linear = config.linear_attention is not None and config.linear_attention.kimi_delta
        if self.kimi_linear:
            assert config.linear_attention is not None
            ling = config.linear_attention.full_rank_gates
            self.checkpoint_renames = _BAILING_HYBRID_RENAMES if ling else _KIMI_LINEAR_RENAMES
        if config.hyper_connections is not None:
            self.checkpoint_renames = _HY_V4_RENAMES
        if config.gated_norm_rank:
            self.checkpoint_renames = (*self.checkpoint_renames, *_AXK2_RENAMES)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """The text model's weights without the layers past `num_hidden_layers` (the prediction layers); Kimi
        Linear's q, k and v convolutions of a layer as its one `conv1d`."""
        layers = self._decoder_layers(weights)
        if self.kimi_linear:
            layers = joined_convolutions(layers, _KDA_CONV_PART)
        mla = self.config.latent_attention
        if mla is not None and mla.query_latent_pair:
            layers = self._query_and_gate(layers, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
        return super().checkpoint_weights(layers, replaced)

    def _query_and_gate(
        self, weights: Iterable[tuple[str, CheckpointTensor]], query_dim: int, value_dim: int
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """A.X K2's joint query and gate projection (`q_gate_proj`, released as `q_b_proj`: each head's query rows,
        then its gate's) as `q_b_proj` (the query rows of every head) and `gate_proj` (the gate rows), unread while it
        is."""
        heads = self.config.num_attention_heads
        for name, tensor in weights:
            match = _QUERY_GATE.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            columns = int(tensor.shape[1])
            for part, start, width in (("q_b_proj", 0, query_dim), ("gate_proj", query_dim, value_dim)):
                rows = functools.partial(_head_rows, heads=heads, start=start, width=width)
                split = reordered_tensor(tensor, rows, shape=(heads * width, columns))
                yield f"{match['attention']}.{part}.weight", split

    def _decoder_layers(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        config = self.config
        biased: set[int] = set()  # the sparse layers whose routing bias the checkpoint holds
        for name, tensor in text_model_weights(weights, _TOWERS):
            layer = _LAYER.match(name)
            index = -1 if layer is None else int(layer.group(1))
            if index >= config.num_hidden_layers:
                continue
            if config.moe_output_norm and name.endswith("post_mlp_layernorm.weight"):
                if not config.is_moe_layer(index):
                    continue
                name = f"model.layers.{index}.mlp.post_mlp_layernorm.weight"
            if name.endswith(_ROUTING_BIAS):
                biased.add(index)
            yield name, tensor
        if config.moe_output_norm:
            for index in range(config.num_hidden_layers):
                if config.is_moe_layer(index) and index not in biased:
                    yield f"model.layers.{index}{_ROUTING_BIAS}", torch.zeros(config.num_experts)
