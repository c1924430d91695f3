"""A GGUF file's quantized matrices as `QuantizedWeight`s, under their Hugging Face names: Q4_0, Q4_1, Q8_0, Q5_0,
Q5_1, llama.cpp's K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (the types of the Q2_K, Q3_K_M, Q4_K_M, Q5_K_M and Q6_K
files people download), its non-linear IQ4_NL and IQ4_XS, its grid types IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
IQ2_S, IQ1_S and IQ1_M, and MXFP4 (gpt-oss's experts).

These are read as the file's blocks (`gguf_blocks`), so a quantized engine serves exactly the weights llama.cpp
serves; the float path dequantizes the same tensors (`gguf_convert.iter_hf_tensors`). Q/k rows whose rope pairs
the file interleaves (llama's, Mixtral's, Llama 4's: `gguf_convert.rope_interleaved`) are read in halves order, as
the layers take them. Other types (F32, F16, BF16, TQ1_0, TQ2_0) are not returned: those tensors stay
float.

`stored_matrices` maps the file and reads nothing yet: each `StoredMatrix.read` copies out only the rows and the
groups of 32 columns it is asked for, so a tensor-parallel rank reads only its own slice of every matrix. Where
the tensors lie comes from the converted folder's index (`gguf_convert.TENSOR_INDEX`) when there is one, else from
parsing the file with gguf's reader.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine_server.layers.quantized_linear import QuantizedWeight, quantize_q8
from engine_server.loader.gguf_blocks import BLOCKS, parse_blocks
from engine_server.loader.gguf_convert import (
    bank_slices,
    hf_expert_slices,
    hf_tensor_name,
    indexed_tensors,
    rope_interleaved,
    rotated_projection,
)
from engine_server.loader.gguf_hybrid import HybridShape, stored_parts
from ladle_kernels.reference import unpermute_rope_rows


@dataclass(frozen=True)
class StoredMatrix:
    """One quantized `[N, K]` matrix of a GGUF file, not read yet: `blocks` `[N, K / block elements, block bytes]`
    is a view of the mapped file, `row_order` (when not None) the file row holding each HF row (llama q/k
    un-permutation, a hybrid's parts: `gguf_hybrid`), `column_order` (when not None) the file column holding each HF
    column (a hybrid's tiled `out_proj`). `shape` is the HF matrix's."""

    blocks: np.ndarray
    kind: GGMLQuantizationType
    row_order: np.ndarray | None = None
    column_order: np.ndarray | None = None

    @property
    def block_elements(self) -> int:
        """The columns one block holds (32, or 256 for a K-quant): a slice's columns fall on multiples of it."""
        return BLOCKS[self.kind][0]

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.blocks.shape[0] if self.row_order is None else len(self.row_order)
        return rows, self.blocks.shape[1] * self.block_elements

    def read(self, rows: range | None = None, columns: range | None = None) -> QuantizedWeight:
        """The weight of HF rows `rows` and columns `columns` (all when None), copied out of the file: its blocks as
        they are, or, where `column_order` takes columns from within blocks, those columns dequantized and quantized
        again to 8 bits per group of 32 (`quantize_q8`: near the file's values, not them).

        Raises ValueError when `columns` does not start and end on a block boundary (`block_elements`)."""
        wanted = np.arange(self.shape[0]) if rows is None else np.arange(rows.start, rows.stop)
        file_rows = wanted if self.row_order is None else self.row_order[wanted]
        blocks = self.blocks[file_rows] if rows is not None or self.row_order is not None else self.blocks
        step = self.block_elements
        if columns is not None and (columns.start % step or columns.stop % step or columns.step != 1):
            raise ValueError(f"columns {columns} do not fall on blocks of {step}")
        if self.column_order is not None:
            file_columns = self.column_order[slice(None) if columns is None else slice(columns.start, columns.stop)]
            starts = file_columns.reshape(-1, step)
            if not (starts[:, :1] % step == 0).all() or not (starts == starts[:, :1] + np.arange(step)).all():
                return quantize_q8(parse_blocks(blocks, self.kind).dequantize()[:, torch.from_numpy(file_columns)])
            return parse_blocks(blocks[:, starts[:, 0] // step], self.kind)
        if columns is not None:
            blocks = blocks[:, columns.start // step : columns.stop // step]
        return parse_blocks(blocks, self.kind)


def stored_matrices(
    gguf_path: Path, *, model_type: str, num_heads: int, num_kv_heads: int, converted: Path | None = None,
    hybrid: HybridShape | None = None, rotary_dim: int | None = None,
) -> dict[str, StoredMatrix]:
    """Every 2-D tensor of `gguf_path` in a type served quantized (module docstring) by HF parameter name (e.g.
    `model.layers.0.self_attn.q_proj.weight`, `model.embed_tokens.weight`), and each expert's matrix of a mixture of
    experts' 3-D tensors by its checkpoint name (`model.layers.0.mlp.experts.3.gate_proj.weight`; a fused
    `ffn_gate_up_exps` split in its halves, Gemma 4's whole `gate_up_proj` bank too), mapped and not read; tensors
    of other types are absent.
    `model_type` is the converted config's. A Gated DeltaNet hybrid's (`hybrid`: its shape) linear-attention
    matrices come as the parts its layers load (`gguf_hybrid.stored_parts`).
    `converted` is the file's converted folder: its tensor index, when it has one, says where the tensors lie.
    `rotary_dim`: the dims of each head rope turns, where fewer than all (GLM-4's half: only those q/k rows are read
    reordered)."""
    permuted = rope_interleaved(model_type)
    matrices: dict[str, StoredMatrix] = {}
    for gguf_name, kind, data in _mapped_tensors(gguf_path, converted):
        experts = hf_expert_slices(gguf_name, data.shape, model_type) if data.ndim == 3 else None
        if experts is not None:  # one matrix per expert and projection, each a view of the bank's blocks
            bank = data.reshape(*data.shape[:2], -1, BLOCKS[kind][1])
            matrices.update((part.name, StoredMatrix(part.of(bank), kind)) for part in experts)
            continue
        name = hf_tensor_name(gguf_name, model_type)
        if name is not None and data.ndim == 3 and name.endswith(_FUSED_BANKS):
            matrices.update(_fused_bank_matrices(name, data, kind))
            continue
        if name is None or data.ndim != 2:
            continue
        blocks = data.reshape(data.shape[0], -1, BLOCKS[kind][1])
        layer, _, llama_kind = gguf_name.removeprefix("blk.").rpartition(".")[0].partition(".")
        parts = None if hybrid is None else stored_parts(llama_kind, layer, len(blocks), hybrid)
        if parts is not None:
            matrices.update((p.name, StoredMatrix(blocks, kind, p.rows, p.columns)) for p in parts)
            continue
        order = None
        rotated = rotated_projection(name) if permuted else None
        if rotated is not None:
            heads = num_heads if rotated == "q" else num_kv_heads
            order = unpermute_rope_rows(np.arange(blocks.shape[0]), heads, rotary_dim)
        matrices[name] = StoredMatrix(blocks, kind, order)
    return matrices


# Banks a checkpoint holds whole, `[experts, rows, columns]` (Gemma 4's: gate and up rows in one), by name suffix.
_FUSED_BANKS = (".experts.gate_up_proj", ".experts.down_proj")


def _fused_bank_matrices(
    name: str, data: np.ndarray, kind: GGMLQuantizationType
) -> Iterator[tuple[str, StoredMatrix]]:
    """Each expert's gate, up (the first and second half of its `gate_up_proj` rows) or down matrix of a whole bank
    `name`, by the per-expert names the experts' loading takes (`<bank>.<e>.gate_proj.weight`, ...), each a view of
    the bank's blocks (`gguf_convert.bank_slices`)."""
    bank = data.reshape(*data.shape[:2], -1, BLOCKS[kind][1])
    base, _, projection = name.rpartition(".")
    parts = ("down",) if projection == "down_proj" else ("gate", "up")
    for part in bank_slices(name, bank.shape, parts, lambda expert, proj: f"{base}.{expert}.{proj}_proj.weight"):
        yield part.name, StoredMatrix(part.of(bank), kind)


def _mapped_tensors(
    gguf_path: Path, converted: Path | None
) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
    """(GGUF name, type, blocks' bytes `[rows..., bytes a row]`) of each tensor of the mapped file of a type served
    quantized."""
    for tensor in indexed_tensors(gguf_path, converted):
        if tensor.tensor_type in BLOCKS:
            yield tensor.name, tensor.tensor_type, tensor.data


def read_quantized_weights(
    gguf_path: Path, *, model_type: str, num_heads: int, num_kv_heads: int, rotary_dim: int | None = None
) -> dict[str, QuantizedWeight]:
    """`stored_matrices` of `gguf_path`, each read whole."""
    matrices = stored_matrices(
        gguf_path, model_type=model_type, num_heads=num_heads, num_kv_heads=num_kv_heads, rotary_dim=rotary_dim
    )
    return {name: matrix.read() for name, matrix in matrices.items()}
