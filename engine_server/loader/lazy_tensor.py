"""`LazyTensor`: a checkpoint tensor read only where it is narrowed (sharded, tensor-parallel loading), or not at all.

A sharded layer keeps a block of rows (column-parallel, vocab) or columns (row-parallel) of each checkpoint tensor
(`engine_server.parallel.layers`). `narrow` gives a view of just that block of the memory-mapped file, so the copy
into the rank's parameter reads only this rank's bytes, and nothing else of the file is copied or held. A row
block is one contiguous byte range, so only its pages are touched; a column block is one short segment per row, so
its pages can cover the whole tensor when a row's segment is under a page. Measured on the embedded model (540 MB,
fp32) at TP=3, warm page cache: a rank's load grew its peak RSS by ~445 MB (171 MB of it its shard, the rest
mapped file pages, shared) in 0.15 s, against ~1 GB in 1.1 s with the whole-file read.

At tensor-parallel size 1 the whole-file read of `source.iter_safetensors` is faster (one sequential read instead
of page faults) and stays the unsharded path; `source.iter_lazy_safetensors` yields these.

A GGUF file's tensors come as `LazyTensor`s over a `ComputedSlice` (`gguf_convert.iter_hf_tensors`): dequantized
whole when first read, and never when the engine serves the file's blocks in their place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine_server.parallel.layers import CheckpointTensor, read_whole


class SafeSlice(Protocol):
    """What `LazyTensor` reads through: safetensors' `safe_open(...).get_slice(name)` (a `PySafeSlice`)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class ComputedSlice:
    """A `SafeSlice` over a tensor that `compute` makes when it is first indexed (then held: a rank's narrowing
    reads it once). `shape` is the shape `compute` returns."""

    def __init__(self, shape: tuple[int, ...], compute: Callable[[], torch.Tensor]) -> None:
        self._shape = list(shape)
        self._compute: Callable[[], torch.Tensor] | None = compute
        self._tensor: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return self._shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        if self._tensor is None:
            assert self._compute is not None
            self._tensor, self._compute = self._compute(), None
            if list(self._tensor.shape) != self._shape:
                raise ValueError(f"computed a tensor of shape {list(self._tensor.shape)}, expected {self._shape}")
        return self._tensor[index]


class LazyTensor:
    """One checkpoint tensor, unread: its shape now, its bytes only when `narrow` or `materialize` asks.

    It answers the part of `torch.Tensor` the sharded layers' loading uses (`shape`, `dim()`, `narrow`), so
    `CausalLM.load_weights` takes it in place of a tensor (`parallel.layers.CheckpointTensor`). Every read returns a
    CPU tensor of the stored dtype that views the file's copy-on-write mapping (strided for a column block; it keeps
    the mapping alive): copy it out, as loading does, and never write to it.
    """

    def __init__(self, safe_slice: SafeSlice) -> None:
        self._slice = safe_slice
        self.shape = torch.Size(safe_slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """`tensor.narrow(dim, start, length)`, reading only those rows (dim 0) or columns (dim 1, ...)."""
        if not 0 <= dim < self.dim():
            raise IndexError(f"dimension {dim} is out of range for a {self.dim()}-D tensor")
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) is out of range for shape {tuple(self.shape)}")
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def materialize(self) -> torch.Tensor:
        """The whole tensor (a view of the mapping, like `narrow`'s)."""
        return self._slice[...]

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)})"



def derived(tensor: LazyTensor, shape: tuple[int, ...], derive: Callable[[torch.Tensor], torch.Tensor]) -> LazyTensor:
    """An unread tensor of `shape`: `derive` of all of `tensor` once it is read (a part of a checkpoint tensor that
    a replaced layer never reads, so neither is the tensor)."""
    return LazyTensor(ComputedSlice(shape, lambda: derive(tensor.materialize())))


def whole(tensor: CheckpointTensor) -> torch.Tensor:
    """All of a checkpoint tensor, read: an unread one through `LazyTensor.materialize` (a 0-D one too, which
    `narrow` cannot take), any other as `parallel.layers.read_whole` reads it."""
    return tensor.materialize() if isinstance(tensor, LazyTensor) else read_whole(tensor)
