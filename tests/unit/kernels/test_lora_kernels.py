"""The LoRA shrink and expand kernels (C++ on the CPU, Triton on CUDA or through its interpreter) against
`ladle_kernels.reference.lora_shrink` / `lora_expand`: one to 65 rows, K and N off the vector width, ranks of 8 and 24,
one and four slots (one with no rows), rows without an adapter, int32 and int64 slots, out and y column slices of
wider tensors; the C++ results' independence from their batch and from the tile each element falls in, bit for bit;
rows without an adapter left untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from ladle_kernels import cpu_ops as cpu
from ladle_kernels import lora, reference

needs_kernels = pytest.mark.skipif(cpu.cpu_ops() is None, reason="the C++ CPU kernels cannot be built here")
TRITON_TOLERANCES: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=6e-2, rtol=2e-2),
}


def cpu_tolerance(depth: int) -> dict[str, Any]:
    """float32 rounding over `depth` terms of unit size, summed in another order than torch's GEMM."""
    return dict(atol=1e-5 * max(1.0, depth / 64) ** 0.5, rtol=1e-5)


def make_slots(tokens: int, num_slots: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Each row's slot drawn from all but the last slot (which has no rows where S > 1), in no order, and -1 (no
    adapter) on every third row from the second."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, max(1, num_slots - 1), (tokens,), generator=gen)
    slots[1::3] = -1
    return slots.to(dtype)


def operands(
    tokens: int, depth: int, rank: int, features: int, num_slots: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """x `[T, K]`, a `[S, R, K]`, y `[T, R]`, b `[S, R, N]` and out `[T, N]`, float32, scaled for unit-sized
    results."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(tokens, depth, generator=gen),
        "a": torch.randn(num_slots, rank, depth, generator=gen) / depth**0.5,
        "y": torch.randn(tokens, rank, generator=gen),
        "b": torch.randn(num_slots, rank, features, generator=gen) / rank**0.5,
        "out": torch.randn(tokens, features, generator=gen),
    }


def expanded(expand: Any, out: torch.Tensor, y: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`expand` run on a copy of `out`."""
    result = out.clone()
    expand(result, y, b, slots)
    return result


@needs_kernels
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("num_slots", [1, 4])
@pytest.mark.parametrize("rank", [8, 24])
@pytest.mark.parametrize("depth", [64, 100])
@pytest.mark.parametrize("tokens", [1, 7, 65])
def test_cpu_kernels_match_the_reference(
    tokens: int, depth: int, rank: int, num_slots: int, slot_dtype: torch.dtype
) -> None:
    args = operands(tokens, depth, rank, 70, num_slots, seed=tokens + depth + rank)
    slots = make_slots(tokens, num_slots, slot_dtype, seed=tokens)
    y = cpu.lora_shrink(args["x"], args["a"], slots)
    assert y.shape == (tokens, rank) and y.dtype == torch.float32
    torch.testing.assert_close(y, reference.lora_shrink(args["x"], args["a"], slots), **cpu_tolerance(depth))
    torch.testing.assert_close(
        expanded(cpu.lora_expand, args["out"], args["y"], args["b"], slots),
        expanded(reference.lora_expand, args["out"], args["y"], args["b"], slots),
        **cpu_tolerance(rank),
    )


@needs_kernels
def test_a_cpu_row_does_not_depend_on_its_batch() -> None:
    """Each row alone, and the batch in another order, give the mixed batch's bits for every thread count: the
    rows of a slot are tiled together and the tiles shared out over the threads, but every dot product keeps
    one order (enough work here for the kernels to use every thread)."""
    tokens, depth, rank, features, num_slots = 65, 576, 24, 200, 4
    args = operands(tokens, depth, rank, features, num_slots, seed=5)
    x, a, b, out = args["x"], args["a"], args["b"], args["out"]
    slots = make_slots(tokens, num_slots, torch.int64, seed=5)
    y = cpu.lora_shrink(x, a, slots)
    shrunk_alone = torch.cat([cpu.lora_shrink(x[t : t + 1], a, slots[t : t + 1]) for t in range(tokens)])
    expanded_alone = torch.cat(
        [expanded(cpu.lora_expand, out[t : t + 1], y[t : t + 1], b, slots[t : t + 1]) for t in range(tokens)]
    )
    perm = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(cpu.lora_shrink(x, a, slots), shrunk_alone), count
            assert torch.equal(cpu.lora_shrink(x[perm], a, slots[perm]), shrunk_alone[perm]), count
            assert torch.equal(expanded(cpu.lora_expand, out, y, b, slots), expanded_alone), count
            permuted = expanded(cpu.lora_expand, out[perm], y[perm], b, slots[perm])
            assert torch.equal(permuted, expanded_alone[perm]), count
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_a_cpu_element_does_not_depend_on_its_tile() -> None:
    """Shifting the columns by a few moves each element to other lanes, another tile and in or out of a row's
    masked last vector (expand: N = 150 of 16-lane vectors, 64-column tiles), or each rank to another rank tile
    (shrink): the same bits, as every element takes the same steps in the same order wherever it lands."""
    tokens, depth, rank, features, num_slots = 13, 100, 11, 150, 3
    args = operands(tokens, depth, rank, features, num_slots, seed=7)
    x, a, y, b, out = args["x"], args["a"], args["y"], args["b"], args["out"]
    slots = make_slots(tokens, num_slots, torch.int32, seed=7)
    full = expanded(cpu.lora_expand, out, y, b, slots)
    shrunk = cpu.lora_shrink(x, a, slots)
    for shift in (1, 5, 16, 77, 149):
        part = expanded(cpu.lora_expand, out[:, shift:], y, b[:, :, shift:].contiguous(), slots)
        assert torch.equal(part, full[:, shift:]), shift
    for shift in (1, 3, 6):
        assert torch.equal(cpu.lora_shrink(x, a[:, shift:].contiguous(), slots), shrunk[:, shift:]), shift


@needs_kernels
def test_cpu_expand_writes_through_column_slices() -> None:
    """out and y as column slices of wider tensors (rows further apart than N and R), as the engine passes a fused
    projection's part: the slice gets the reference's result and the columns around it are left alone."""
    args = operands(10, 40, 8, 37, 3, seed=4)
    slots = torch.tensor([0, 2, -1, 1, 0, 0, 2, -1, 1, 1])
    wide_out = torch.randn(10, 100)
    wide_y = torch.randn(10, 20)
    wide_y[:, 5:13] = args["y"]
    want = wide_out.clone()
    reference.lora_expand(want[:, 30:67], wide_y[:, 5:13], args["b"], slots)
    got = wide_out.clone()
    cpu.lora_expand(got[:, 30:67], wide_y[:, 5:13], args["b"], slots)
    torch.testing.assert_close(got, want, **cpu_tolerance(8))
    assert torch.equal(got[:, :30], wide_out[:, :30]) and torch.equal(got[:, 67:], wide_out[:, 67:])


@needs_kernels
def test_cpu_rows_without_an_adapter_are_zero_and_untouched() -> None:
    args = operands(9, 40, 8, 33, 3, seed=2)
    slots = torch.tensor([-1, 0, -1, 2, 2, -1, 0, 1, -1])
    none = slots < 0
    y = cpu.lora_shrink(args["x"], args["a"], slots)
    assert torch.equal(y[none], torch.zeros(4, 8))
    out = expanded(cpu.lora_expand, args["out"], args["y"], args["b"], slots)
    assert torch.equal(out[none], args["out"][none])
    assert not torch.equal(out[~none], args["out"][~none])
    all_none = torch.full((9,), -1, dtype=torch.int32)
    assert torch.equal(cpu.lora_shrink(args["x"], args["a"], all_none), torch.zeros(9, 8))
    assert torch.equal(expanded(cpu.lora_expand, args["out"], args["y"], args["b"], all_none), args["out"])


@needs_kernels
def test_cpu_wrappers_run_the_reference_where_the_kernel_does_not_apply() -> None:
    """bfloat16 inputs and an `out` whose rows are not contiguous in memory go to the reference; a strided x is
    copied for the kernel; a slot past S raises."""
    args = operands(6, 40, 8, 16, 2, seed=3)
    slots = torch.tensor([0, 1, -1, 1, 0, 0])
    x16, a16 = args["x"].bfloat16(), args["a"].bfloat16()
    assert torch.equal(cpu.lora_shrink(x16, a16, slots), reference.lora_shrink(x16, a16, slots))
    x_strided = torch.randn(40, 6).t()
    torch.testing.assert_close(
        cpu.lora_shrink(x_strided, args["a"], slots), reference.lora_shrink(x_strided, args["a"], slots)
    )
    out_t = args["out"].t().contiguous().t()
    want = expanded(reference.lora_expand, out_t, args["y"], args["b"], slots)
    cpu.lora_expand(out_t, args["y"], args["b"], slots)
    assert torch.equal(out_t, want)
    with pytest.raises(RuntimeError, match="slot 2 of row 1"):
        cpu.lora_shrink(args["x"], args["a"], torch.tensor([0, 2, -1, 1, 0, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "depth", "rank", "num_slots", "slot_dtype"),
    [
        (1, 100, 8, 1, torch.int64),
        (7, 600, 24, 4, torch.int32),  # K split over programs
        (65, 100, 24, 4, torch.int64),
        (65, 600, 8, 1, torch.int32),
    ],
    ids=str,
)
def test_triton_kernels_match_the_reference(
    device: torch.device,
    dtype: torch.dtype,
    tokens: int,
    depth: int,
    rank: int,
    num_slots: int,
    slot_dtype: torch.dtype,
) -> None:
    args = {name: t.to(device, dtype) for name, t in operands(tokens, depth, rank, 70, num_slots, seed=depth).items()}
    slots = make_slots(tokens, num_slots, slot_dtype, seed=tokens).to(device)
    y = lora.lora_shrink(args["x"], args["a"], slots)
    assert y.shape == (tokens, rank) and y.dtype == dtype
    torch.testing.assert_close(y, reference.lora_shrink(args["x"], args["a"], slots), **TRITON_TOLERANCES[dtype])
    torch.testing.assert_close(
        expanded(lora.lora_expand, args["out"], args["y"], args["b"], slots),
        expanded(reference.lora_expand, args["out"], args["y"], args["b"], slots),
        **TRITON_TOLERANCES[dtype],
    )


def test_triton_expand_writes_through_column_slices(device: torch.device) -> None:
    args = {name: t.to(device) for name, t in operands(10, 40, 8, 37, 3, seed=4).items()}
    slots = torch.tensor([0, 2, -1, 1, 0, 0, 2, -1, 1, 1], device=device)
    wide_out = torch.randn(10, 100, device=device)
    wide_y = torch.randn(10, 20, device=device)
    wide_y[:, 5:13] = args["y"]
    want = wide_out.clone()
    reference.lora_expand(want[:, 30:67], wide_y[:, 5:13], args["b"], slots)
    got = wide_out.clone()
    lora.lora_expand(got[:, 30:67], wide_y[:, 5:13], args["b"], slots)
    torch.testing.assert_close(got, want, **TRITON_TOLERANCES[torch.float32])
    assert torch.equal(got[:, :30], wide_out[:, :30]) and torch.equal(got[:, 67:], wide_out[:, 67:])


def test_triton_rows_without_an_adapter_are_zero_and_untouched(device: torch.device) -> None:
    args = {name: t.to(device) for name, t in operands(9, 40, 8, 33, 3, seed=2).items()}
    slots = torch.tensor([-1, 0, -1, 2, 2, -1, 0, 1, -1], device=device)
    none = slots < 0
    assert torch.equal(lora.lora_shrink(args["x"], args["a"], slots)[none], torch.zeros(4, 8, device=device))
    out = expanded(lora.lora_expand, args["out"], args["y"], args["b"], slots)
    assert torch.equal(out[none], args["out"][none])
    assert not torch.equal(out[~none], args["out"][~none])


def test_triton_launchers_check_their_arguments(device: torch.device) -> None:
    args = {name: t.to(device) for name, t in operands(3, 32, 8, 16, 2).items()}
    slots = torch.tensor([0, -1, 1], device=device)
    with pytest.raises(ValueError, match="a has shape"):
        lora.lora_shrink(args["x"], args["a"][:, :, :16], slots)
    with pytest.raises(ValueError, match="a has dtype"):
        lora.lora_shrink(args["x"], args["a"].half(), slots)
    with pytest.raises(ValueError, match="slots has dtype"):
        lora.lora_shrink(args["x"], args["a"], slots.float())
    with pytest.raises(ValueError, match="b has shape"):
        lora.lora_expand(args["out"], args["y"], args["b"][:, :, :8], slots)
    with pytest.raises(ValueError, match="slots has shape"):
        lora.lora_expand(args["out"], args["y"], args["b"], slots[:2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels are compiled, not interpreted")
def test_triton_kernels_run_through_the_interpreter_without_cuda() -> None:
    assert isinstance(lora._shrink_kernel, InterpretedFunction)
    assert isinstance(lora._expand_kernel, InterpretedFunction)
