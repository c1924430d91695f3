"""A GGUF file's Q4_0, Q4_1 and Q8_0 matrices as packed `QuantizedWeight`s, under their Hugging Face names.

The converted folder (`gguf_convert`) holds these tensors dequantized to float32; this reads the same file's
blocks as they are, so a quantized engine serves exactly the weights llama.cpp serves. Block layouts (32
elements each, float16 scales): Q4_0 `d, qs[16]` (element = d * (q - 8)); Q4_1 `d, m, qs[16]` (element =
d * q + m); Q8_0 `d, qs[32] int8` (element = d * q). A nibble byte j holds element j low and j + 16 high.
Llama q/k rows are un-permuted as in the conversion. Other types (F32, F16, K-quants) are not returned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from engine_server.layers.quantized_linear import Q4Weight, Q8Weight, QuantizedWeight
from engine_server.loader.gguf_convert import hf_tensor_name, unpermute_rope_rows

_SUPPORTED = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


def read_quantized_weights(
    gguf_path: Path, *, model_type: str, num_heads: int, num_kv_heads: int
) -> dict[str, QuantizedWeight]:
    """Every Q4_0 / Q4_1 / Q8_0 2-D tensor of `gguf_path` by HF parameter name (e.g.
    `model.layers.0.self_attn.q_proj.weight`, `model.embed_tokens.weight`); tensors of other types are absent."""
    reader = GGUFReader(gguf_path)
    permuted = model_type == "llama"
    weights: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None or tensor.tensor_type not in _SUPPORTED or len(tensor.shape) != 2:
            continue
        blocks = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, _BLOCK_BYTES[tensor.tensor_type])
        if permuted and ".self_attn.q_proj." in name:
            blocks = unpermute_rope_rows(blocks, num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            blocks = unpermute_rope_rows(blocks, num_kv_heads)
        weights[name] = parse_blocks(blocks, tensor.tensor_type)
    return weights


def parse_blocks(blocks: np.ndarray, kind: GGMLQuantizationType) -> QuantizedWeight:
    """`[N, K/32, block bytes]` uint8 blocks of one type -> the packed weight (copied out of the file)."""
    rows = blocks.shape[0]
    scales = _float16(blocks, 0)
    if kind == GGMLQuantizationType.Q8_0:
        qs = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(rows, -1)
        return Q8Weight(torch.from_numpy(qs.copy()), torch.from_numpy(scales))
    if kind == GGMLQuantizationType.Q4_1:
        mins, nibbles = _float16(blocks, 2), blocks[..., 4:20]
    else:
        mins, nibbles = (-8.0 * scales).astype(np.float16), blocks[..., 2:18]  # exact: a power of two
    qs = np.ascontiguousarray(nibbles).reshape(rows, -1)
    return Q4Weight(torch.from_numpy(qs.copy()), torch.from_numpy(scales), torch.from_numpy(mins))


def _float16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block, as a contiguous `[N, K/32]` float16 array."""
    raw = np.ascontiguousarray(blocks[..., offset : offset + 2])
    return np.ascontiguousarray(raw.view(np.float16)[..., 0])
