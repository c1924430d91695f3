"""Quantized weights under tensor parallelism: each rank's GGUF blocks are exactly its slice of TP=1's weights.

On 3 gloo ranks, the embedded model's GGUF file (Q4_1 projections with llama's permuted q/k rows, a Q8_0
embedding tied to the LM head): every rank's QKV, O, gate/up, down and LM head, read as the rank's slice of the
file's blocks, dequantize to the same values as the rank's slice of the whole weights read at TP=1, and the
ranks' slices together are the whole. Synthetic matrices check the LM head's zero padding rows and that a
row-parallel slice off the groups of 32 leaves the layer float.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine_server.loader import default_gguf_path, resolve_model
from engine_server.loader.gguf_quant import StoredMatrix, stored_matrices
from engine_server.parallel.group import TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from engine_server.parallel.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from engine_server.parallel.sharding import gate_up_slices, qkv_slices
from engine_server.quantization import _stored_weight
from tests.unit.parallel.ranks import run_ranks

# SmolLM2-135M, the embedded model.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, VOCAB = 9, 3, 64, 576, 1536, 49152
LAYER = "model.layers.7"


def _layers(tp: TensorParallel) -> dict[str, torch.nn.Linear]:
    """This rank's sharded layers of one decoder layer and the LM head, unallocated (only their partition is read)."""
    with torch.device("meta"):
        return {
            f"{LAYER}.self_attn.qkv_proj": ColumnParallelLinear(
                HIDDEN, qkv_slices(HEADS, KV_HEADS, HEAD_DIM, tp.size, tp.rank), bias=False
            ),
            f"{LAYER}.self_attn.o_proj": RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, False, tp),
            f"{LAYER}.mlp.gate_up_proj": ColumnParallelLinear(
                HIDDEN, gate_up_slices(INTERMEDIATE, tp.size, tp.rank), bias=False
            ),
            f"{LAYER}.mlp.down_proj": RowParallelLinear(INTERMEDIATE, HIDDEN, False, tp),
            "lm_head": ParallelLMHead(VOCAB, HIDDEN, tp),
        }


@functools.cache
def _float_weights() -> dict[str, torch.Tensor]:
    """The embedded model's float weights: the file's blocks dequantized (test_quantization)."""
    return dict(resolve_model("default").weights())


def _whole(name: str) -> torch.Tensor:
    """The whole float weight of layer `name`."""
    return _float_weights()[f"{name}.weight"]


def _expected_slice(name: str, layer: torch.nn.Linear) -> torch.Tensor:
    """The rank's slice of the whole dequantized weights, cut as the float loader cuts them (parallel.layers)."""
    if isinstance(layer, ColumnParallelLinear):
        parts = ["q_proj", "k_proj", "v_proj"] if name.endswith("qkv_proj") else ["gate_proj", "up_proj"]
        prefix = name.rpartition(".")[0]
        pieces = [_whole(f"{prefix}.{part}") for part in parts]
        return torch.cat(
            [piece[part.rows.start : part.rows.stop] for piece, part in zip(pieces, layer.parts, strict=True)]
        )
    if isinstance(layer, RowParallelLinear):
        columns = layer.input_slice.rows
        return _whole(name)[:, columns.start : columns.stop]
    assert isinstance(layer, ParallelLMHead)
    shard = layer.shard
    return _whole("model.embed_tokens")[shard.start : shard.valid_end]


def _rank_main(rank: int, size: int, init_method: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method, torch.device("cpu"), timeout=timedelta(seconds=60))
    try:
        stored = stored_matrices(default_gguf_path(), model_type="llama", num_heads=HEADS, num_kv_heads=KV_HEADS)
        for name, layer in _layers(tp).items():
            weight = _stored_weight(stored, name, layer, tied=True)
            assert weight is not None, name
            assert weight.shape == tuple(layer.weight.shape), name
            assert torch.equal(weight.dequantize(), _expected_slice(name, layer)), name
            # Gathered over the ranks, the slices are the whole: rows of column-parallel ones, columns of the rest.
            dim = 1 if isinstance(layer, RowParallelLinear) else 0
            parts = [torch.empty_like(weight.dequantize()) for _ in range(size)]
            torch.distributed.all_gather(parts, weight.dequantize(), group=tp.group)
            if rank == 0 and not isinstance(layer, ColumnParallelLinear):
                whole = _whole("model.embed_tokens" if name == "lm_head" else name)
                assert torch.equal(torch.cat(parts, dim), whole), name
    finally:
        destroy_tensor_parallel(tp)


@pytest.mark.timeout(120)
def test_each_ranks_gguf_blocks_are_its_slice_of_the_whole_weights(tmp_path: Path) -> None:
    run_ranks(_rank_main, (3, f"file://{tmp_path / 'rendezvous'}"), 3)


def _synthetic(rows: int, columns: int, kind: GGMLQuantizationType) -> tuple[StoredMatrix, torch.Tensor]:
    """A stored matrix of random values, and its values as the gguf package dequantizes them."""
    weight = np.random.default_rng(rows).standard_normal((rows, columns)).astype(np.float32)
    raw = quantize(weight, kind)
    return StoredMatrix(raw.reshape(rows, columns // 32, -1), kind), torch.from_numpy(dequantize(raw, kind))


def test_an_lm_heads_padding_rows_are_zero_and_a_slice_off_the_groups_stays_float() -> None:
    placeholder = cast(dist.ProcessGroup, object())  # the layers read only their partition: no collective runs
    last = TensorParallel(rank=2, size=3, group=placeholder, control_group=placeholder)
    second = TensorParallel(rank=1, size=2, group=placeholder, control_group=placeholder)
    with torch.device("meta"):
        head = ParallelLMHead(100, 64, last)  # padded to 102: rank 2 holds ids 68..99 and two padding rows
        narrow = RowParallelLinear(96, 64, False, last)  # 32 input columns per rank: on the groups
        off = RowParallelLinear(96, 64, False, second)  # 48 input columns per rank: off the groups
    table, table_values = _synthetic(100, 64, GGMLQuantizationType.Q8_0)
    weight = _stored_weight({"model.embed_tokens.weight": table}, "lm_head", head, tied=True)
    assert weight is not None and weight.shape == (34, 64)
    dequantized = weight.dequantize()
    assert torch.equal(dequantized[:32], table_values[68:])
    assert not dequantized[32:].any()
    o_proj, o_values = _synthetic(64, 96, GGMLQuantizationType.Q4_1)
    stored = {"o.weight": o_proj}
    kept = _stored_weight(stored, "o", narrow, tied=False)
    assert kept is not None and torch.equal(kept.dequantize(), o_values[:, 64:96])
    assert _stored_weight(stored, "o", off, tied=False) is None  # the layer stays float
    with pytest.raises(ValueError, match="do not fall on blocks of 32"):
        o_proj.read(columns=range(16, 48))
