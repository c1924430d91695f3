"""`layers.weight_arena`: the CPU's packed weights moved into one huge-page buffer, with the same bits."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from engine_server.layers.lowbit_weight import LowBitWeight, decode_blocks
from engine_server.layers.quantized_experts import QuantizedExperts
from engine_server.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear, concat_rows, quantize_q8
from engine_server.layers.weight_arena import HUGE_PAGE_BYTES, gather_packed_weights, huge_page_buffer
from ladle_kernels import cpu_ops as cpu
from tests.lowbit_blocks import random_blocks
from tests.unit.kernels.test_quant_moe import random_bank
from tests.unit.runner_factories import TINY_LLAMA
from tests.unit.test_decode_stack import TINY_QWEN3_MOE, int8_runner

pytestmark = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")


def mapping_of(address: int) -> tuple[range, dict[str, str]]:
    """The address range and the fields of this process's /proc/self/smaps entry that holds `address`."""
    span, fields = range(0), {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            low, high = (int(end, 16) for end in head[0].split("-"))
            inside = low <= address < high
            if inside:
                span = range(low, high)
        elif inside:
            fields[head[0].rstrip(":")] = " ".join(head[1:])
    return span, fields


def huge_pages_mode() -> str | None:
    """The kernel's transparent huge pages setting (`always`, `madvise`, `never`), None where it is not Linux's."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


def test_the_buffer_starts_on_a_huge_page_and_is_advised_for_them() -> None:
    buffer = huge_page_buffer(3 * HUGE_PAGE_BYTES + 100)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE_BYTES + 100
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(buffer.sum()) == 0
    buffer.fill_(7)  # writable, and the pages are touched
    if huge_pages_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        _, fields = mapping_of(buffer.data_ptr())
        # A private mapping (shared anonymous memory is shmem, which madvise leaves on 4 KiB pages), advised.
        assert fields.get("THPeligible") == "1", fields
        assert "hg" in fields["VmFlags"].split(), fields


def lowbit_model() -> nn.Module:
    """Every packed kind the layers hold: a fused projection of two formats (Q5_0 beside Q8_0), Q5_1, Q4_K and Q6_K
    linears, a bank of experts (Q4_K gate/up, Q6_K down) and a tied Q8 embedding reading its LM head's blocks."""
    gen = torch.Generator().manual_seed(0)

    def weight(kind: str, n: int, k: int) -> LowBitWeight:
        return decode_blocks(random_blocks(kind, n, k, gen), kind)

    model = nn.Module()
    model.qkv = QuantizedLinear(concat_rows([weight("q5_0", 64, 256), quantize_q8(torch.randn(32, 256))]), None)
    model.o = QuantizedLinear(weight("q5_1", 256, 64), None)
    model.up = QuantizedLinear(weight("q4_k", 64, 256), None)
    model.down = QuantizedLinear(weight("q6_k", 256, 256), torch.randn(256))
    model.experts = QuantizedExperts(random_bank(4, 256, 256, "q4_k", "q6_k", gen))
    model.head = QuantizedLinear(quantize_q8(torch.randn(96, 256)), None)
    model.embed = QuantizedEmbedding(model.head)
    return model


def outputs(model: nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randn(5, module.in_features, generator=gen) for module in (model.qkv, model.o, model.up, model.down)]
    results = [module(x) for module, x in zip((model.qkv, model.o, model.up, model.down), rows, strict=True)]
    x = torch.randn(3, 256, generator=gen)
    experts = torch.tensor([[0, 2], [1, 3], [3, 0]])
    results.append(model.experts(x, torch.rand(3, 2, generator=gen), experts))
    results.append(model.head(x))
    results.append(model.embed(torch.tensor([0, 17, 95])))
    return results


def packed_tensors(model: nn.Module) -> list[torch.Tensor]:
    found = []
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            found += [tensor for part in module.parts for tensor in part[:3]] + [module.qs, module.scales]
        elif isinstance(module, QuantizedExperts):
            found += list(module.buffers(recurse=False))
        elif isinstance(module, QuantizedEmbedding) and module.packed is not None:
            found += list(module.packed)
    return found


def test_every_packed_tensor_moves_into_one_buffer_with_the_same_products() -> None:
    model = lowbit_model()
    before = outputs(model)
    unique = {id(t): t for t in packed_tensors(model)}
    size = sum(t.numel() * t.element_size() for t in unique.values())
    moved = gather_packed_weights(model)
    assert size <= moved < size + 64 * len(unique)  # each tensor once, 64-byte aligned
    after = outputs(model)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)
    tensors = [t for t in packed_tensors(model) if t.numel() > 0]
    start = min(t.data_ptr() for t in tensors)
    assert start % HUGE_PAGE_BYTES == 0
    assert all(t.data_ptr() % 64 == 0 and t.data_ptr() + t.numel() * t.element_size() <= start + moved for t in tensors)
    # The tied embedding reads the head's very blocks, and a layer's registered buffers are its first shard's.
    assert model.embed.packed[0].data_ptr() == model.head.parts[0][0].data_ptr()
    assert model.qkv.qs.data_ptr() == model.qkv.parts[0][0].data_ptr()
    assert len(model.qkv.parts) == 2


def test_nothing_packed_leaves_the_model_as_it_is() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    assert gather_packed_weights(model) == 0


def test_a_quantized_model_loads_with_its_weights_gathered() -> None:
    """`quantize_model` gathers before it builds the decode stack: every packed tensor, the experts' too, lies in
    one mapping (and the decode stack's steps equal the layers', tests/unit/test_decode_stack.py)."""
    for model in (TINY_LLAMA, TINY_QWEN3_MOE):
        runner = int8_runner(model)
        tensors = [t for t in packed_tensors(runner.model) if t.numel() > 0]
        assert any(isinstance(m, QuantizedExperts) for m in runner.model.modules()) == (model is not TINY_LLAMA)
        start = min(t.data_ptr() for t in tensors)
        end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
        span, _ = mapping_of(start)
        assert start % HUGE_PAGE_BYTES == 0 and span.start <= start and end <= span.stop
