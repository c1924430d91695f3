"""Hyper-connections (HY-V4's independent form; `ModelConfig.hyper_connections`): the residual stream is N copies of
the hidden state, `[T, N * hidden]`, and each attention and MLP reads and writes them through weights computed per
token from the streams themselves.

A map (`HyperMix`: `fn` `[2N, N * hidden]`, `base` `[2N]`, `scale` `[2]`) of the streams, flattened and
RMS-normalised without a weight, gives N `pre` logits and N `post` logits; `pre = sigmoid(pre * scale[0] +
base[:N]) + eps` sums the streams into the block's input, `post = post_scale * sigmoid(post * scale[1] + base[N:]) +
eps` weighs the block's output added to each stream: `streams[n] += post[n] * block(norm(sum_m pre[m] *
streams[m]))`. The model's last map (`HyperHead`: `hc_fn` `[N, N * hidden]`, `hc_base`, `hc_scale`) computes `pre`
alone and sums the streams into the final norm's input. Everything here is float32 whatever the model's dtype, as
transformers computes it (its `HYV4HyperConnection`); the maps are few parameters and stay float under every
quantization (they are not `nn.Linear`s).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine_server.attention_metadata import AttentionMetadata
from engine_server.config import HyperConnections, ModelConfig
from engine_server.layers.decoder import DecoderLayer, DecoderModel
from engine_server.lora.slots import LoraBatch
from engine_server.parallel.group import SINGLE, TensorParallel
from engine_server.step_interrupt import StepInterrupt, StepInterrupted
from ladle_kernels.kernel_set import KernelOps
from ladle_kernels.reference import build_cos_sin_cache, build_yarn_cos_sin_cache


def _mixes(flat: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """A map's logits `[T, rows of fn]` of the float32 streams `[T, N * hidden]`: `fn` applied to each row
    RMS-normalised (its `1 / sqrt(mean(x²) + eps)` factor applied after the product, as transformers does)."""
    return F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def _joined(flat: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`sum_n pre[n] * stream[n]` `[T, hidden]` of the float32 streams `[T, N * hidden]` and weights `[T, N]`."""
    return (pre.unsqueeze(-1) * flat.view(flat.shape[0], pre.shape[1], -1)).sum(dim=1)


class HyperMix(nn.Module):
    """One block's map (module doc); parameters named as HY-V4's and DeepSeek-V4's checkpoints name them
    (`attn_hc.*`, `ffn_hc.*`). With `HyperConnections.sinkhorn_iters` (DeepSeek-V4's mHC) `fn` has `N * N` more
    rows, the logits of `comb`, and `scale` a third entry, theirs."""

    def __init__(self, spec: HyperConnections, hidden: int, norm_eps: float) -> None:
        super().__init__()
        self.streams, self.post_scale, self.eps, self.norm_eps = spec.streams, spec.post_scale, spec.eps, norm_eps
        self.sinkhorn_iters = spec.sinkhorn_iters
        rows = (2 + spec.streams) * spec.streams if self.sinkhorn_iters else 2 * spec.streams
        self.fn = nn.Parameter(torch.empty(rows, spec.streams * hidden), requires_grad=False)
        self.base = nn.Parameter(torch.empty(rows), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3 if self.sinkhorn_iters else 2), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """streams `[T, N * hidden]` -> (post `[T, N]` float32, comb `[T, N, N]` float32 or None without mHC, the
        block's input `[T, hidden]` in the streams' dtype)."""
        flat, count = streams.float(), self.streams
        logits = _mixes(flat, self.fn, self.norm_eps)
        base = self.base.float()
        pre = torch.sigmoid(logits[:, :count] * self.scale[0] + base[:count]) + self.eps
        post = self.post_scale * torch.sigmoid(logits[:, count : 2 * count] * self.scale[1] + base[count : 2 * count])
        if not self.sinkhorn_iters:
            return post + self.eps, None, _joined(flat, pre).to(streams.dtype)
        comb = logits[:, 2 * count :].view(-1, count, count) * self.scale[2] + base[2 * count :].view(count, count)
        comb = _sinkhorn(torch.softmax(comb, dim=-1) + self.eps, self.sinkhorn_iters, self.eps)
        return post, comb, _joined(flat, pre).to(streams.dtype)


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`comb` `[T, N, N]` (positive) made near doubly stochastic as transformers' `DeepseekV4HyperConnection` does:
    its columns normalised, then `iters - 1` times its rows and its columns (each sum plus `eps`)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def add_to_streams(
    streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor, comb: torch.Tensor | None = None
) -> torch.Tensor:
    """`streams[n] + post[n] * out` for each stream n, in float32: streams `[T, N * hidden]`, post `[T, N]`, a block's
    output `[T, hidden]` -> `[T, N * hidden]` in the streams' dtype. With `comb` `[T, N, N]` (mHC) the streams are
    mixed first: `sum_j comb[j, n] * streams[j] + post[n] * out`."""
    tokens, count = post.shape
    before = streams.float().view(tokens, count, -1)
    if comb is not None:
        before = torch.matmul(comb.transpose(1, 2), before)
    added = post.unsqueeze(-1) * out.float().unsqueeze(1) + before
    return added.view(tokens, -1).to(streams.dtype)


class HyperHead(nn.Module):
    """The model's last map (module doc), named as HY-V4's checkpoints name it (`model.hc_head.*`)."""

    def __init__(self, spec: HyperConnections, hidden: int, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = spec.eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(spec.streams, spec.streams * hidden), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(spec.streams), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams `[T, N * hidden]` -> their weighted sum `[T, hidden]` in the streams' dtype."""
        flat = streams.float()
        mixes = _mixes(flat, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return _joined(flat, pre).to(streams.dtype)


class HyperConnectedDecoderLayer(DecoderLayer):
    """`DecoderLayer`'s attention and MLP, each read and added through its own map of the residual streams
    (`attn_hc`, `ffn_hc`; module doc): run by `HyperConnectedDecoderModel` through `streams_forward`."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool, tp: TensorParallel = SINGLE, index: int = 0
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp, index)
        spec = config.hyper_connections
        assert spec is not None and self.mlp is not None, "a hyper-connected layer has streams and an MLP"
        self.attn_hc = HyperMix(spec, config.hidden_size, config.rms_norm_eps)
        self.ffn_hc = HyperMix(spec, config.hidden_size, config.rms_norm_eps)

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
        raise TypeError("a hyper-connected layer has no single residual stream: run it through streams_forward")

    def streams_forward(
        self,
        positions: torch.Tensor,
        streams: torch.Tensor,
        kv_cache: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelOps,
        lora: LoraBatch | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """streams `[T, N * hidden]` -> the streams after this layer's attention and MLP were added to them;
        `token_ids` `[T]`: the tokens' ids (DeepSeek-V4's hash-routed experts read them)."""
        layer_lora = None if lora is None else lora.layer(self.index)
        post, comb, joined = self.attn_hc(streams)
        normed = self.input_layernorm(joined, ops)
        streams = add_to_streams(
            streams, post, self.self_attn(positions, normed, kv_cache, cos_sin_cache, meta, ops, layer_lora), comb
        )
        post, comb, joined = self.ffn_hc(streams)
        return add_to_streams(
            streams, post, self.feed_forward(self.post_attention_layernorm(joined, ops), ops, layer_lora, token_ids),
            comb,
        )  # fmt: skip


class HyperConnectedDecoderModel(DecoderModel):
    """`DecoderModel` over residual streams (`ModelConfig.hyper_connections`, module doc): the embedding copied into
    each stream, `HyperConnectedDecoderLayer`s, the streams summed by `hc_head` into the final norm. No decode stack
    runs it (`layers.decode_stack` takes plain residuals only)."""

    layer_class = HyperConnectedDecoderLayer

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, o_proj_bias: bool = False, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, o_proj_bias, tp)
        spec = config.hyper_connections
        assert spec is not None
        self.streams = spec.streams
        self.hc_head = HyperHead(spec, config.hidden_size, config.rms_norm_eps)
        # DeepSeek-V4: its compressing layers' rope, of a base (and YaRN) of their own
        layout = config.compressed_attention
        self.compress_rope_layers = [
            layout is not None and layout.kinds[i] != "sliding" for i in range(config.num_hidden_layers)
        ]
        if layout is not None:
            table = (
                build_cos_sin_cache(config.rotary_dim, config.max_position_embeddings, layout.compress_rope_theta,
                                    None, dtype)
                if layout.compress_yarn is None
                else build_yarn_cos_sin_cache(config.rotary_dim, config.max_position_embeddings,
                                              layout.compress_rope_theta, layout.compress_yarn, dtype)
            )  # fmt: skip
            self.register_buffer("compress_cos_sin_cache", table, persistent=False)

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
        """As `DecoderModel.forward`, over the streams."""
        streams = self.embed(input_ids, positions, ops).repeat(1, self.streams)
        cos_sin = self.get_buffer("cos_sin_cache")
        compress = self.get_buffer("compress_cos_sin_cache") if any(self.compress_rope_layers) else cos_sin
        rope_rows = self.rope_rows(positions, meta)
        for layer, kv_cache, compresses in zip(self.layers, kv_caches, self.compress_rope_layers, strict=True):
            streams = cast(HyperConnectedDecoderLayer, layer).streams_forward(
                rope_rows, streams, kv_cache, compress if compresses else cos_sin, meta, ops, lora, input_ids
            )
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
        return self.norm(self.hc_head(streams), ops)
