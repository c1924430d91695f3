"""Xiaomi's MiMo-V2-Flash, read as GLM-4.5's layout (`models.glm4_moe`): DeepSeek-V3's router over experts (no shared
ones) under attention that is windowed, with sinks and twice the KV heads, on most layers and full on every sixth;
keys and queries wider than values. What its checkpoint needs at load is `mimo_weights`."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator

import torch

from engine_server.config import ModelConfig
from engine_server.models.base import reordered_tensor
from engine_server.parallel.layers import CheckpointTensor

_VALUES = re.compile(r"model\.layers\.(?P<layer>\d+)\.self_attn\.v_proj\.(?P<kind>weight|bias)")
_OUTPUT = re.compile(r"model\.layers\.(?P<layer>\d+)\.self_attn\.o_proj\.weight")
# The sink logit a full-attention layer is given: so far below any score that it takes no share of the softmax
# (finite, so that a kernel starting its running maximum at the sink never computes inf - inf).
NO_SINK = -1e30


def mimo_weights(
    config: ModelConfig, weights: Iterable[tuple[str, CheckpointTensor]]
) -> Iterator[tuple[str, CheckpointTensor]]:
    """MiMo-V2-Flash's checkpoint tensors as the shared layers take them (its other quirks are `ModelConfig`'s:
    windows and their KV head counts, `layer_kv_head_counts`; the windowed layers' rope base, `local_rope_theta`; the
    sinks): each head's values (`v_proj`'s rows, `value_head_dim` of them) scaled by `value_scale` and padded with zero
    rows to `head_dim`, and `o_proj`'s columns likewise with zeros, so the cache keeps one row width and each head's
    output is unchanged; the full-attention layers, which have no sinks, given a sink of `NO_SINK`. Unread tensors
    stay unread."""
    head_dim, value_dim = config.head_dim, config.value_head_dim or config.head_dim
    query_heads = config.num_attention_heads
    for name, tensor in weights:
        values, output = _VALUES.fullmatch(name), _OUTPUT.fullmatch(name)
        layer = values or output
        if layer is not None and int(layer["layer"]) >= config.num_hidden_layers:  # a prediction layer: not read
            yield name, tensor
        elif values is not None:
            heads = config.layer_kv_heads(int(values["layer"]))
            shape = (heads * head_dim, *tuple(tensor.shape)[1:])
            pad = functools.partial(_pad_rows, heads=heads, rows=value_dim, width=head_dim, scale=config.value_scale)
            yield name, reordered_tensor(tensor, pad, shape=shape)
        elif output is not None:
            shape = (tensor.shape[0], query_heads * head_dim)
            yield name, reordered_tensor(
                tensor, lambda t: _pad_rows(t.t(), query_heads, value_dim, head_dim, 1.0).t(), shape=shape
            )
        else:
            yield name, tensor
    for index in range(config.num_hidden_layers):
        if config.attention_window(index) == 0:
            yield f"model.layers.{index}.self_attn.sinks", torch.full((config.num_attention_heads,), NO_SINK)


def _pad_rows(tensor: torch.Tensor, heads: int, rows: int, width: int, scale: float) -> torch.Tensor:
    """`tensor` `[heads * rows, ...]` times `scale` as `[heads * width, ...]`: each head's `rows` rows, then zeros."""
    grouped = tensor.reshape(heads, rows, *tensor.shape[1:]) * scale
    padded = torch.zeros(heads, width, *tensor.shape[1:], dtype=tensor.dtype)
    padded[:, :rows] = grouped
    return padded.reshape(heads * width, *tensor.shape[1:])

