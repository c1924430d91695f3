"""Qwen4-Exp: Qwen3.5-MoE's hybrid (Gated DeltaNet on three layers in four, gated attention on the rest, experts
beside a gated shared expert) over hyper-connected residual streams (`layers.gated_residual`), its attention QSA-
indexed (`layers.qsa_attention`), per-layer n-gram embeddings added to the streams before some linear layers
(`layers.ngram_embedding`), and no final norm: the last map's mix is the LM head's input."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from typing import cast

import torch

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import ModelConfig
from engine_server.layers.decoder import DecoderLayer, DecoderModel
from engine_server.layers.gated_deltanet import GatedDeltaNet, advance_states
from engine_server.layers.gated_residual import GatedResidual, inject
from engine_server.layers.ngram_embedding import NgramLayer
from engine_server.lora.slots import LoraBatch
from engine_server.models.qwen3_next import Qwen3NextForCausalLM
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.parallel.layers import CheckpointTensor, read_whole
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels.kernel_set import KernelOps

# A layer's n-gram table as transformers saves it: `split_ngram_parts` shards of rows, joined in order at load.
_NGRAM_SHARD = re.compile(r"(?P<table>.+\.ngram_embedding)\.shard_(?P<part>\d+)\.weight")


class Qwen4ExpDecoderLayer(DecoderLayer):
    """`DecoderLayer`'s token mixer and experts, each read and added through its own map of the streams
    (`attn_hyper_connection`, `mlp_hyper_connection`: they replace the block's norms), an n-gram layer (`ple`)
    first where the config says: run by `Qwen4ExpDecoderModel` through `streams_forward`."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        spec = config.qwen4_exp
        assert spec is not None and self.mlp is not None, "a Qwen4-Exp layer has streams and an MLP"
        del self.input_layernorm, self.post_attention_layernorm
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.attn_hyper_connection = GatedResidual(spec.streams, hidden, spec.rank, eps, dtype)
        self.mlp_hyper_connection = GatedResidual(spec.streams, hidden, spec.rank, eps, dtype)
        self.ple = (
            NgramLayer(spec, hidden, config.vocab_size, spec.ngram_layers.index(index), eps, dtype)
            if index in spec.ngram_layers else None
        )  # fmt: skip
        # A linear layer's part of each state row (this rank's heads'), before the n-gram layer's
        self.own_state = self.self_attn.shape.own_state_size if isinstance(self.self_attn, GatedDeltaNet) else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a Qwen4-Exp layer has no single residual stream: run it through streams_forward")

    def streams_forward(
        self,
        positions: torch.Tensor,
        streams: torch.Tensor,
        cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        token_ids: torch.Tensor,
    ) -> torch.Tensor:
        """streams `[T, N * hidden]` of tokens `token_ids` -> the streams after this layer; `cache` is the layer's
        KV cache, or on a linear layer its states (the n-gram layer's part after the linear attention's own)."""
        if self.own_state is None:
            block_input, weights = self.attn_hyper_connection(streams, ops)
            attended = self.self_attn(positions, block_input, cache, cos_sin_cache, meta, ops)
            streams = inject(streams, attended, weights)
        else:
            streams = advance_states(
                meta, cache, "Qwen4-Exp's linear attention",
                lambda slots, fresh: self._linear(streams, token_ids, cache, slots, fresh, meta, ops),
            )  # fmt: skip
        block_input, weights = self.mlp_hyper_connection(streams, ops)
        return inject(streams, self.feed_forward(block_input, ops, None), weights)

    def _linear(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        state: torch.Tensor,
        slots: list[int],
        fresh: list[bool],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """A linear layer's first half inside `advance_states`: the n-gram layer's addition, then Gated DeltaNet
        through the streams' map."""
        if self.ple is not None:
            streams = streams + self.ple(
                streams, token_ids, state[:, self.own_state :], slots, fresh, meta.query_lens_cpu, ops
            )
        block_input, weights = self.attn_hyper_connection(streams, ops)
        mixer = cast(GatedDeltaNet, self.self_attn)
        return inject(streams, mixer.advance(block_input, state, slots, fresh, meta, ops), weights)


class Qwen4ExpDecoderModel(DecoderModel):
    """`DecoderModel` over hyper-connected streams: the embedding copied into each, `Qwen4ExpDecoderLayer`s, the
    last map's mix (`hyper_connection_mixer`) out, with no final norm. No decode stack runs it."""

    layer_class = Qwen4ExpDecoderLayer
    stackable = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp)
        spec = config.qwen4_exp
        assert spec is not None
        del self.norm
        self.streams = spec.streams
        self.hyper_connection_mixer = GatedResidual(
            spec.streams, config.hidden_size, spec.rank, config.rms_norm_eps, dtype, combine=False
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
        """As `DecoderModel.forward`, over the streams (no LoRA adapters: refused at load)."""
        streams = self.embed(input_ids, positions, ops).repeat(1, self.streams)
        cos_sin, rope_rows = self.get_buffer("cos_sin_cache"), self.rope_rows(positions, meta)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            streams = cast(Qwen4ExpDecoderLayer, layer).streams_forward(
                rope_rows, streams, cache, cos_sin, meta, ops, input_ids
            )
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        mixed, _ = self.hyper_connection_mixer.mix(streams, ops)
        return mixed


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    """Qwen4-Exp (`qwen4_exp_text`, a multimodal `qwen4_exp` checkpoint's text model), read from transformers' names:
    Qwen3.5's (`linear_attn` read as `self_attn`, `in_proj_qkv` split), each layer's n-gram table joined from its
    shards (`ngram_embedding.shard_<i>`) and its hash constants checked against the config's (`NgramTable`)."""

    decoder_class = Qwen4ExpDecoderModel

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, CheckpointTensor]], replaced: Collection[str] = frozenset()
    ) -> Iterable[tuple[str, CheckpointTensor]]:
        """Qwen3.5's reading of the text model's weights, each n-gram table's shards joined."""
        return super().checkpoint_weights(self._joined_tables(weights), replaced)

    def _joined_tables(
        self, weights: Iterable[tuple[str, CheckpointTensor]]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        spec = self.config.qwen4_exp
        parts = 1 if spec is None else spec.ngram_parts
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            shard = _NGRAM_SHARD.fullmatch(name)
            if shard is None:
                yield name, tensor
                continue
            table = pending.setdefault(shard["table"], {})
            table[int(shard["part"])] = read_whole(tensor)
            if len(table) == parts:
                if sorted(table) != list(range(parts)):
                    raise ValueError(f"{shard['table']}: shards {sorted(table)}, expected 0 to {parts - 1}")
                yield f"{shard['table']}.weight", torch.cat([table[i] for i in range(parts)])
                del pending[shard["table"]]
        if pending:
            raise ValueError(f"n-gram tables with missing shards: {sorted(pending)} (split_ngram_parts {parts})")
