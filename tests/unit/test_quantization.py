"""Quantized weights: which scheme an engine serves, the GGUF blocks read as they are, and their quality
against the float reference (greedy agreement and logit distance, with thresholds)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import engine_server.loader.source as source_module
from benchmarks.quality import measure
from engine_server.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear, weight_format
from engine_server.loader import ModelSource, default_gguf_path, resolve_model
from engine_server.loader.gguf_blocks import dequantize_blocks, parse_blocks
from engine_server.loader.gguf_convert import TENSOR_INDEX
from engine_server.loader.gguf_quant import read_quantized_weights, stored_matrices
from engine_server.loader.lazy_tensor import LazyTensor
from engine_server.quantization import resolve_quantization
from ladle_kernels import cpu_ops as cpu
from tests.lowbit_blocks import KINDS as LOW_BIT_KINDS
from tests.lowbit_blocks import random_blocks
from tests.unit.runner_factories import TINY_LLAMA

pytestmark = pytest.mark.slow  # quantizes and runs the embedded model

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# Measured on the embedded model (benchmarks/results/quality_cpu.jsonl): top-1 agreement 0.98 / 0.97 and mean
# KL 0.003 / 0.004 nats for gguf / int8. The thresholds leave room for another CPU's float rounding.
MIN_TOP1_AGREEMENT = 0.95
MAX_MEAN_KL = 0.01


def source(gguf: Path | None) -> ModelSource:
    return ModelSource(TINY_LLAMA, Path("."), "tiny", Path("."), gguf_path=gguf)


@pytest.mark.parametrize(
    ("mode", "gguf", "device", "dtype", "kernels", "expected"),
    [
        ("auto", Path("m.gguf"), CPU, torch.float32, True, "gguf"),
        ("auto", None, CPU, torch.float32, True, "none"),  # a Hugging Face folder or dummy: the float path
        ("auto", Path("m.gguf"), CUDA, torch.bfloat16, True, "none"),
        ("auto", Path("m.gguf"), CPU, torch.float32, False, "none"),  # no C++ kernels here
        ("none", Path("m.gguf"), CPU, torch.float32, True, "none"),
        ("gguf", Path("m.gguf"), CPU, torch.float32, True, "gguf"),
        ("int8", None, CPU, torch.float32, True, "int8"),
        ("int8", Path("m.gguf"), CUDA, torch.bfloat16, True, "int8"),  # the Triton kernel
    ],
)
def test_resolve_quantization(
    mode: str, gguf: Path | None, device: torch.device, dtype: torch.dtype, kernels: bool, expected: str
) -> None:
    assert resolve_quantization(mode, source(gguf), device, dtype, kernels) == expected


@pytest.mark.parametrize(
    ("mode", "gguf", "device", "kernels", "message"),
    [
        ("gguf", None, CPU, True, "not a GGUF file"),
        ("int8", None, CUDA, False, "needs triton"),
        ("gguf", Path("m.gguf"), CUDA, True, "CUDA serves int8"),
        ("int8", None, torch.device("meta"), True, "CPU in float32 only"),
        ("gguf", Path("m.gguf"), CPU, False, "could not be built"),
        ("int4", None, CPU, True, "expected auto, none, gguf, int8 or fp8"),
    ],
)
def test_unservable_schemes_are_refused_with_the_flag_named(
    mode: str, gguf: Path | None, device: torch.device, kernels: bool, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        resolve_quantization(mode, source(gguf), device, torch.float32, kernels)
    assert "--quantization" in str(info.value)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_parsed_blocks_dequantize_like_the_gguf_package(kind: GGMLQuantizationType) -> None:
    weight = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = quantize(weight, kind)
    block_bytes = raw.shape[1] // 3
    parsed = parse_blocks(raw.reshape(6, 3, block_bytes), kind)
    assert torch.equal(parsed.dequantize(), torch.from_numpy(dequantize(raw, kind)))


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, *LOW_BIT_KINDS.values()])
def test_a_matrixs_blocks_dequantize_as_the_gguf_package_does(kind: GGMLQuantizationType) -> None:
    """The float path's dequantization of a file's matrices (`dequantize_blocks`, the engine's own decoding) gives
    gguf's values from a matrix's bytes as the file holds them (a zero's sign aside: gguf's Q4_0 `d * (q - 8)` is
    -0.0 where the engine's `d * q - 8d` is 0.0 for a negative d); not a matrix: None (gguf's then)."""
    name = next((key for key, value in LOW_BIT_KINDS.items() if value == kind), None)
    if name is None:
        raw = quantize(np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32), kind)
    else:
        raw = random_blocks(name, 6, 512, torch.Generator().manual_seed(2)).reshape(6, -1).numpy()
    values = dequantize_blocks(raw, kind)
    assert values is not None
    assert torch.equal(values, torch.from_numpy(dequantize(raw, kind).copy()))
    assert dequantize_blocks(raw[0], kind) is None and dequantize_blocks(raw, GGMLQuantizationType.F16) is None


def test_mxfp4_blocks_are_served_as_they_are() -> None:
    """gpt-oss's MXFP4 blocks (`parse_blocks`) are served as MXFP4, their values gguf's bit for bit: every code in
    every position, every exponent byte (subnormal scales and ones past float16's range included)."""
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(40, 8, 17), dtype=np.uint8)
    blocks[..., 0] = np.resize(rng.permutation(256).astype(np.uint8), (40, 8))  # every exponent byte
    blocks[1, 0, 1:] = np.arange(16, dtype=np.uint8) * 17  # each code, in both nibbles
    with np.errstate(over="ignore"):  # 12 * 2 ** 127 is inf, in gguf's float32 as in ours
        expected = dequantize(blocks.reshape(40, -1), GGMLQuantizationType.MXFP4)
    parsed = parse_blocks(blocks, GGMLQuantizationType.MXFP4)
    assert weight_format(parsed) == "mxfp4"
    assert torch.equal(parsed.dequantize().view(torch.int32), torch.from_numpy(expected).view(torch.int32))


def test_embedded_model_blocks_equal_its_converted_float_weights() -> None:
    embedded = resolve_model("default")
    config = embedded.config
    stored = read_quantized_weights(
        default_gguf_path(), model_type="llama", num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
    )  # fmt: skip
    converted = dict(embedded.weights())
    assert len(stored) == 7 * config.num_hidden_layers + 1  # every projection (Q4_1) and the embedding (Q8_0)
    for name, weight in stored.items():  # q/k rows un-permuted as in the conversion, every value equal
        assert torch.equal(weight.dequantize(), converted[name]), name


def test_the_converted_folders_tensor_index_maps_the_blocks_the_file_parse_finds() -> None:
    """An engine maps the GGUF blocks through its converted folder's index, without parsing the file's metadata
    again: the very matrices, rows and row orders that gguf's reader gives."""
    embedded = resolve_model("default")
    assert embedded.gguf_path is not None and (embedded.path / TENSOR_INDEX).is_file()
    shape = {"model_type": "llama", "num_heads": embedded.config.num_attention_heads,
             "num_kv_heads": embedded.config.num_key_value_heads}  # fmt: skip
    parsed = stored_matrices(embedded.gguf_path, **shape)  # type: ignore[arg-type]
    indexed = stored_matrices(embedded.gguf_path, converted=embedded.path, **shape)  # type: ignore[arg-type]
    assert indexed.keys() == parsed.keys() and len(parsed) == 7 * embedded.config.num_hidden_layers + 1
    for name, matrix in parsed.items():
        other = indexed[name]
        assert other.kind == matrix.kind and np.array_equal(other.blocks, matrix.blocks), name
        if matrix.row_order is None:
            assert other.row_order is None, name
        else:
            assert other.row_order is not None and np.array_equal(other.row_order, matrix.row_order), name


class _RecordingSlice:
    """A `SafeSlice` over a lazy checkpoint tensor that adds the tensor's name to `read` when it is read."""

    def __init__(self, name: str, tensor: LazyTensor, read: set[str]) -> None:
        self.name, self.tensor, self.read = name, tensor, read

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.read.add(self.name)
        return self.tensor.materialize()[index]


def recorded_tensor(name: str, tensor: Any, read: set[str]) -> Any:
    """`tensor`, which adds `name` to `read` when read if it is a lazy one (a tensor given whole is read already)."""
    return LazyTensor(_RecordingSlice(name, tensor, read)) if isinstance(tensor, LazyTensor) else tensor


@needs_kernels
def test_quality_against_the_float_reference(llm: Any, float_reference: Any) -> None:
    results = measure(formats=("gguf", "int8"), float_reference=float_reference, free_running=False)
    for result in results:
        assert result.positions == 16 * 64
        assert result.top1_agreement >= MIN_TOP1_AGREEMENT, result
        assert result.mean_kl <= MAX_MEAN_KL, result
    assert llm.core.runner.quantization == "none"


@needs_kernels
def test_a_gguf_engine_serves_the_files_blocks(llm: Any) -> None:
    from benchmarks.quality import make_llm

    # The file's tensors are dequantized only where they stay float: the norms (the embedding is looked up from its
    # Q8_0 blocks, whose values test_embedded_model_blocks_equal_its_converted_float_weights holds equal).
    read: set[str] = set()
    real = source_module.iter_hf_tensors

    def recorded(tensors: Any, config: Any, spec: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
        assert lazy, "read whole"
        for name, tensor in real(tensors, config, spec, lazy=True):
            yield name, recorded_tensor(name, tensor, read)

    with mock.patch.object(source_module, "iter_hf_tensors", recorded):
        quantized = make_llm("default", "auto")  # auto: the file's own blocks on the CPU
    assert read == {"model.norm.weight"} | {
        f"model.layers.{i}.{norm}.weight" for i in range(30) for norm in ("input_layernorm", "post_attention_layernorm")
    }
    layers = [m for m in quantized.core.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized.core.runner.quantization == "gguf"
    assert sorted({layer.format for layer in layers}) == ["q4", "q8"]  # Q4_1 projections, Q8_0 tied LM head
    assert len(layers) == 4 * 30 + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.core.runner.model.modules())
    embedding = quantized.core.runner.model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding) and embedding.embedding_dim == 576
    head = quantized.core.runner.model.lm_head
    # The tied table is looked up from the LM head's own packed blocks (no second copy), its float values exactly.
    assert embedding.packed is not None and embedding.packed[0].data_ptr() == head.qs.data_ptr()
    ids = torch.tensor([[0, 1], [49151, 2]])
    table = dict(resolve_model("default").weights())["model.embed_tokens.weight"]
    assert torch.equal(embedding(ids), table[ids])
    # A greedy answer must not depend on what ran beside it or before it: each prompt alone, with its chat
    # template's prefix found in the prefix cache, answers as it did in a batch of all of them (bit-exact
    # integer kernels, every token's attention on the decode kernel).
    from engine_server import ChatPrompt, SamplingParams
    from engine_server.frontend import ChatMessage

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    things = ("city", "planet", "fruit")
    chats = [ChatPrompt([ChatMessage(role="user", content=f"Name a {thing}.")]) for thing in things]
    batched = [r.choices[0].token_ids for r in quantized.generate(chats, params, use_tqdm=False)]
    alone = [quantized.generate([chat], params, use_tqdm=False)[0].choices[0].token_ids for chat in chats]
    assert alone == batched


@needs_kernels
def test_int8_looks_the_tied_token_table_up_in_the_heads_8_bit_rows() -> None:
    """Under int8 the tied table is the LM head's packed 8-bit rows (no float copy of it kept): the embedded model's
    table is Q8_0 already, so its lookups are the float table's values exactly."""
    from benchmarks.quality import make_llm
    from engine_server.layers.quantized_linear import quantize_q8

    quantized = make_llm("default", "int8")
    model = quantized.core.runner.model
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, QuantizedEmbedding) and isinstance(head, QuantizedLinear) and head.format == "q8"
    assert embedding.packed is not None and embedding.packed[0].data_ptr() == head.qs.data_ptr()
    table = dict(resolve_model("default").weights())["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 1], [49151, 2]])
    assert torch.equal(embedding(ids), quantize_q8(table).dequantize()[ids])
    assert torch.equal(embedding(ids), table[ids])
    assert not any(p.shape == table.shape for p in model.parameters())  # no float table left


def test_quantize_q8_in_chunks_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked to bound its temporaries, `quantize_q8` gives the same blocks as quantizing all rows in one pass
    (chunks of one row, of a few rows ending mid-matrix, and a row longer than a chunk)."""
    from engine_server.layers import quantized_linear

    weight = torch.randn(13, 96, generator=torch.Generator().manual_seed(0)) * 0.02
    weight[2, :32] = 0.0  # a group of zeros: scale 0
    monkeypatch.setattr(quantized_linear, "Q8_CHUNK_VALUES", 1 << 40)
    whole = quantized_linear.quantize_q8(weight)
    for chunk in (1, 96 * 5, 64):
        monkeypatch.setattr(quantized_linear, "Q8_CHUNK_VALUES", chunk)
        chunked = quantized_linear.quantize_q8(weight)
        assert torch.equal(chunked.qs, whole.qs) and torch.equal(chunked.scales, whole.scales), chunk
