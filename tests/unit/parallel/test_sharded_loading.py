"""Sharded loading reads only each rank's bytes: a `LazyTensor` reads what `narrow` asks for, and a tensor-parallel
rank loading a checkpoint through `ModelSource.lazy_weights` reads its slice of every sharded tensor and nothing more.

A spy around safetensors' slice reads (`safe_open(...).get_slice(name)[index]`, the only way a lazy tensor touches
the file) counts, per checkpoint tensor, the bytes of the views of the file each rank takes, which loading then
copies into its parameters. On 2 and 3 gloo ranks the counts must be
exactly the bytes of the rank's own slice (the whole of a norm, a replicated KV head or rank 0's o_proj bias), the
sharded tensors' counts must add up over the ranks to the checkpoint's bytes (every byte read once), and the loaded
shards must equal what loading the whole tensors gives.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

import engine_server.loader.source as source_module
from engine_server.config import ModelConfig
from engine_server.loader.layout import parameter_shapes
from engine_server.loader.lazy_tensor import LazyTensor
from engine_server.loader.source import ModelSource, iter_lazy_safetensors, iter_safetensors
from engine_server.models import CausalLM, get_model_class
from engine_server.parallel.group import SINGLE, TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from engine_server.parallel.layers import CheckpointTensor, ColumnParallelLinear
from engine_server.parallel.sharding import even_slice, kv_heads_per_rank, vocab_shard
from tests.unit.parallel.ranks import run_ranks

_SMALL: dict[str, Any] = dict(
    vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
)  # fmt: skip
# name -> (config, group size). Even splits with biases on q/k/v and o (Llama's o_proj bias loads on rank 0 only);
# a vocabulary 3 does not divide (padded) with one KV head replicated over 3 ranks and Qwen3's q/k norms.
CASES: dict[str, tuple[ModelConfig, int]] = {
    "llama-bias-untied-2": (
        ModelConfig(architecture="llama", tie_word_embeddings=False, attention_bias=True, **_SMALL),
        2,
    ),
    "qwen3-tied-odd-vocab-replicated-kv-3": (
        ModelConfig(
            architecture="qwen3",
            tie_word_embeddings=True,
            qk_norm=True,
            **{**_SMALL, "vocab_size": 127, "num_attention_heads": 6, "num_key_value_heads": 1},
        ),
        3,
    ),
    # Apertus: an ungated MLP, its xIELU's four scalars (two of them 0-D) replicated on every rank.
    "apertus-xielu-2": (
        ModelConfig(architecture="apertus", hidden_act="xielu", qk_norm=True, tie_word_embeddings=False, **_SMALL),
        2,
    ),
}


def _write_checkpoint(config: ModelConfig, folder: Path) -> None:
    """Random tensors (norms too, so copying them is checked) split over two safetensors files, as shards are."""
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in parameter_shapes(config).items()}
    names = list(tensors)
    half = len(names) // 2
    folder.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate((names[:half], names[half:]), start=1):
        save_file({name: tensors[name] for name in part}, str(folder / f"model-0000{index}-of-00002.safetensors"))


class _CountingSlice:
    """A `PySafeSlice` that adds the bytes of every read to `reads[name]`."""

    def __init__(self, inner: Any, name: str, reads: Counter[str]) -> None:
        self._inner, self._name, self._reads = inner, name, reads

    def get_shape(self) -> list[int]:
        shape: list[int] = self._inner.get_shape()
        return shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor: torch.Tensor = self._inner[index]
        self._reads[self._name] += tensor.nbytes
        return tensor


class _CountingHandle:
    """`safe_open(file, framework)` whose slices count their reads."""

    def __init__(self, file: Path, framework: str, reads: Counter[str]) -> None:
        self._handle = safe_open(file, framework=framework)
        self._reads = reads

    def __enter__(self) -> _CountingHandle:
        self._handle.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._handle.__exit__(kind, error, tb)

    def keys(self) -> list[str]:
        names: list[str] = self._handle.keys()
        return names

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._handle.get_slice(name), name, self._reads)


def _loaded(config: ModelConfig, tp: TensorParallel, weights: Iterator[tuple[str, CheckpointTensor]]) -> CausalLM:
    model = get_model_class(config.architecture)(config, tp=tp)
    model.load_weights(weights)
    return model


def _own_bytes(name: str, full_bytes: int, config: ModelConfig, rank: int, size: int) -> int:
    """The bytes of checkpoint tensor `name` that rank `rank` keeps, from the partition arithmetic."""
    if name.endswith("norm.weight") or ".act_fn." in name:
        return full_bytes  # replicated on every rank
    if name.endswith("o_proj.bias"):
        return full_bytes if rank == 0 else 0  # only rank 0 adds it
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_shard(config.vocab_size, size, rank).num_valid * full_bytes // config.vocab_size
    if ".k_proj." in name or ".v_proj." in name:
        return kv_heads_per_rank(config.num_key_value_heads, size) * full_bytes // config.num_key_value_heads
    return full_bytes // size  # q, o, gate, up, down: even splits of rows or columns


def _is_partitioned(name: str, config: ModelConfig, size: int) -> bool:
    """Whether the ranks' slices of `name` partition it (each byte kept by one rank), i.e. it is not replicated."""
    replicated_kv = (".k_proj." in name or ".v_proj." in name) and config.num_key_value_heads < size
    return not (name.endswith("norm.weight") or ".act_fn." in name or replicated_kv)


def _rank_main(rank: int, size: int, init_method: str, folder: str, case: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method, torch.device("cpu"), timeout=timedelta(seconds=60))
    try:
        config = CASES[case][0]
        source = ModelSource(config, Path(folder), case, Path(folder))
        reads: Counter[str] = Counter()
        counting = mock.patch.object(
            source_module, "safe_open", lambda file, framework: _CountingHandle(file, framework, reads)
        )
        with counting:
            lazy = _loaded(config, tp, source.lazy_weights())
        whole = _loaded(config, tp, iter_safetensors(Path(folder)))
        expected_params = whole.state_dict()
        for key, value in lazy.state_dict().items():
            assert torch.equal(value, expected_params[key]), key

        checkpoint = dict(iter_safetensors(Path(folder)))
        for name, tensor in checkpoint.items():
            assert reads[name] == _own_bytes(name, tensor.nbytes, config, rank, size), (name, reads[name])
        partitioned = [name for name in checkpoint if _is_partitioned(name, config, size)]
        total = torch.tensor([sum(reads[name] for name in partitioned)], dtype=torch.int64)
        dist.all_reduce(total, group=tp.control_group)
        assert int(total.item()) == sum(checkpoint[name].nbytes for name in partitioned)
        assert sum(reads.values()) < sum(tensor.nbytes for tensor in checkpoint.values()) * (1 / size + 0.1)
    finally:
        destroy_tensor_parallel(tp)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_reads_only_its_bytes_and_loads_the_same_shards(case: str, tmp_path: Path) -> None:
    config, size = CASES[case]
    _write_checkpoint(config, tmp_path / "model")
    init_method = f"file://{tmp_path / 'rendezvous'}"
    run_ranks(_rank_main, (size, init_method, str(tmp_path / "model"), case), size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lazy_tensor_narrows_like_the_tensor(dtype: torch.dtype, tmp_path: Path) -> None:
    full = torch.randn(7, 10, generator=torch.Generator().manual_seed(1)).to(dtype)
    save_file({"w": full, "b": full[0].clone()}, str(tmp_path / "t.safetensors"))
    with safe_open(tmp_path / "t.safetensors", framework="pt") as handle:
        lazy, bias = LazyTensor(handle.get_slice("w")), LazyTensor(handle.get_slice("b"))
        assert lazy.shape == full.shape and lazy.dim() == 2 and bias.dim() == 1
        for dim, start, length in [(0, 0, 7), (0, 2, 3), (0, 6, 1), (1, 0, 10), (1, 5, 5), (1, 3, 4), (1, 4, 0)]:
            got = lazy.narrow(dim, start, length)
            assert got.dtype == dtype and torch.equal(got, full.narrow(dim, start, length)), (dim, start, length)
        assert torch.equal(lazy.materialize(), full) and torch.equal(bias.narrow(0, 1, 4), full[0, 1:5])
        for dim, start, length in [(2, 0, 1), (0, 5, 3), (1, -1, 2)]:
            with pytest.raises(IndexError):
                lazy.narrow(dim, start, length)


def test_a_column_layer_reads_only_its_rows_or_all_of_an_exact_slice(tmp_path: Path) -> None:
    full = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    save_file({"full": full, "slice": full[4:].clone(), "wrong": full[:3].clone()}, str(tmp_path / "a.safetensors"))
    reads: Counter[str] = Counter()
    layer = ColumnParallelLinear(5, [even_slice(8, 2, 1, "rows")], bias=False)  # rank 1 of 2 keeps rows 4..7
    with _CountingHandle(tmp_path / "a.safetensors", "pt", reads) as handle:
        for name in ("full", "slice"):
            layer.weight.data.zero_()
            layer.load_part(0, LazyTensor(handle.get_slice(name)))
            assert torch.equal(layer.weight, full[4:])
            assert reads[name] == full[4:].nbytes  # 4 of the full's 8 rows; all of the exact slice
        with pytest.raises(ValueError, match="expected the full 8 or this rank's 4"):
            layer.load_part(0, LazyTensor(handle.get_slice("wrong")))
    assert reads["wrong"] == 0


def test_lazy_weights_at_size_one_load_what_weights_load(tmp_path: Path) -> None:
    config = CASES["qwen3-tied-odd-vocab-replicated-kv-3"][0]
    _write_checkpoint(config, tmp_path)
    source = ModelSource(config, tmp_path, "tiny", tmp_path)
    assert {name for name, _ in iter_lazy_safetensors(tmp_path)} == set(parameter_shapes(config))
    assert all(isinstance(tensor, LazyTensor) for _, tensor in source.lazy_weights())
    lazy, whole = _loaded(config, SINGLE, source.lazy_weights()), _loaded(config, SINGLE, source.weights())
    expected = whole.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in lazy.state_dict().items())


def test_dummy_presets_yield_whole_generated_tensors(tmp_path: Path) -> None:
    config = CASES["llama-bias-untied-2"][0]
    source = ModelSource(config, tmp_path, "dummy:tiny", tmp_path, random_weights=True, seed=3)
    generated = dict(source.weights())
    for name, tensor in source.lazy_weights():
        assert isinstance(tensor, torch.Tensor) and torch.equal(tensor, generated[name])
