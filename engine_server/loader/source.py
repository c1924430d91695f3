"""`ModelSource`: a resolved model, i.e. its shape, where its files live and how to iterate its weights.

A source never holds weights in memory: `weights()` streams `(hf_name, tensor)` pairs from safetensors files
(one file read at a time), from a GGUF file (each tensor dequantized as it comes: `gguf_convert.iter_hf_tensors`)
or, for `dummy:` presets, generates them one at a time; `lazy_weights()` streams them unread (`LazyTensor`), for a
tensor-parallel rank that reads only its slice of each, or a quantized engine that reads none of what a GGUF
file's blocks replace.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

from engine_server.config import ModelConfig
from engine_server.loader.dummy import iter_random_weights
from engine_server.loader.fp8_checkpoint import Fp8Checkpoint
from engine_server.loader.gguf_convert import (
    TENSOR_INDEX,
    indexed_tensors,
    iter_hf_tensors,
    transformers_banks,
    write_sharded_safetensors,
)
from engine_server.loader.int_checkpoint import IntCheckpoint
from engine_server.loader.layout import parameter_shapes
from engine_server.loader.lazy_tensor import LazyTensor
from engine_server.loader.weight_files import safetensors_files

CACHE_DIR_ENV = "LADLE_CACHE_DIR"


def default_cache_dir() -> Path:
    """Where converted models are cached: `$LADLE_CACHE_DIR`, else `~/.cache/ladle`."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ladle"


@dataclass(frozen=True)
class ModelSource:
    """A model ready for the runner to load.

    Invariants:
    - `config` describes the weights that `weights()` yields (names are Hugging Face parameter names such as
      `model.layers.0.self_attn.q_proj.weight`; `lm_head.weight` is absent when `config.tie_word_embeddings`).
    - `tokenizer_path` is a folder `engine_server.tokenizer.loading.load_tokenizer` can open. For real models
      it equals `path`; for `dummy:` presets it is the embedded default model's folder, whose tokenizer only
      emits ids < 49152 and so fits every preset's vocabulary.
    - `gguf_path` set: `path` is the file's converted folder (config.json, tokenizer, `TENSOR_INDEX`: no weights),
      and the weights are read from the file.
    - `fp8` is the layout of an FP8 checkpoint (`loader.fp8_checkpoint`): `weights()` and `lazy_weights()` then
      yield its FP8 weights dequantized to float32, and no scales, as a float checkpoint's; `int_weights` likewise the
      layout of a GPTQ, AWQ or compressed-tensors integer checkpoint (`loader.int_checkpoint`), whose quantized
      layers come out as their float32 weights.
    - `random_weights=True` means `path` holds no weights for this config: `weights()` generates them from
      `seed` (normal, std 0.02; norm weights 1), deterministically and per tensor.
    """

    config: ModelConfig
    path: Path
    name: str
    tokenizer_path: Path
    random_weights: bool = False
    seed: int = 0
    gguf_path: Path | None = None  # the GGUF file `path` was converted from: the weights, blocks that can be served
    fp8: Fp8Checkpoint | None = None  # an FP8 checkpoint's layout, whose e4m3 weights can be served as they are
    int_weights: IntCheckpoint | None = None  # a GPTQ, AWQ or compressed-tensors integer checkpoint's layout

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every parameter once, in unspecified order: fp32 (a GGUF file, dummy) or the stored dtype."""
        if self.random_weights:
            return iter_random_weights(self.config, self.seed)
        if self.gguf_path is not None:
            return iter_hf_tensors(indexed_tensors(self.gguf_path, self.path), read_hf_config(self.path), self.name)
        if self.fp8 is not None:
            return self.fp8.dequantized(self.path, iter_safetensors(self.path))
        if self.int_weights is not None:
            return self.int_weights.dequantized(self.path, iter_safetensors(self.path))
        return iter_safetensors(self.path)

    def lazy_weights(self, fp8_kept: Collection[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
        """`weights()` for a sharded (tensor-parallel) load: each real tensor unread, so a rank reads only the slice
        it keeps (`LazyTensor.narrow`; a GGUF file's tensors are dequantized whole when first read, and not at all
        when unread). `dummy:` presets still yield whole tensors: they are generated, not read.
        An FP8 checkpoint's FP8 weights are read whole and dequantized, except those named in `fp8_kept`, which
        come out unread and without their scales (the caller serves those as FP8: `engine_server.quantization`)."""
        if self.random_weights:
            return iter_random_weights(self.config, self.seed)
        if self.gguf_path is not None:
            config = read_hf_config(self.path)
            return iter_hf_tensors(indexed_tensors(self.gguf_path, self.path), config, self.name, lazy=True)
        if self.fp8 is not None:
            return self.fp8.dequantized(self.path, iter_lazy_safetensors(self.path), fp8_kept)
        if self.int_weights is not None:  # (each quantized layer read whole, as its packed parts are)
            return self.int_weights.dequantized(self.path, iter_lazy_safetensors(self.path))
        return iter_lazy_safetensors(self.path)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected parameter names and shapes for `config`, without reading or generating any weights."""
        return parameter_shapes(self.config)


def write_float_checkpoint(source: ModelSource, folder: Path) -> Path:
    """`source` as a whole Hugging Face checkpoint in `folder` (made if missing), returned: the files of its folder
    but the weights and `TENSOR_INDEX` (config.json, tokenizer, pooling), and `weights()` as fp32 safetensors (a
    GGUF file's Llama 4 experts as its checkpoints' banks, `gguf_convert.transformers_banks`). For what reads only
    checkpoints, e.g. transformers on a GGUF file's model as ladle reads it; not for `dummy:` presets (their folder
    is the embedded model's)."""
    if source.random_weights:
        raise ValueError(f"model {source.name!r}: random weights have no folder of their own to write out")
    folder.mkdir(parents=True, exist_ok=True)
    for entry in source.path.iterdir():
        if entry.name == TENSOR_INDEX or entry.name.endswith((".safetensors", ".safetensors.index.json")):
            continue
        if entry.is_dir():
            shutil.copytree(entry, folder / entry.name, dirs_exist_ok=True)
        else:
            shutil.copy2(entry, folder / entry.name)
    weights = source.weights()
    if source.gguf_path is not None:
        weights = transformers_banks(weights, read_hf_config(source.path))
    write_sharded_safetensors(weights, folder)
    return folder


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of every `*.safetensors` file in `folder`, one file (shard) in memory at a time.

    Each file is read with one sequential read rather than memory-mapped: touching a mapping page by page
    costs ~3x more on start-up (measured: 0.64 s against 1.9 s for the embedded model's 540 MB).
    """
    for file in safetensors_files(folder):
        tensors = safetensors_load(file.read_bytes())
        while tensors:
            yield tensors.popitem()


def iter_lazy_safetensors(folder: Path) -> Iterator[tuple[str, LazyTensor]]:
    """Yield every tensor of every `*.safetensors` file in `folder` unread, one file open (mapped) at a time."""
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                yield name, LazyTensor(handle.get_slice(name))


def read_hf_config(folder: Path) -> dict[str, object]:
    """Parse `folder/config.json`."""
    with (folder / "config.json").open(encoding="utf-8") as f:
        data: dict[str, object] = json.load(f)
    return data
