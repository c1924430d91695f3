"""Compile the Triton kernels for NVIDIA GPUs on a machine without one, as the launchers specialize them.

Run as a script in a process without TRITON_INTERPRET. The launchers are called on CPU tensors with
`JITFunction.run` replaced by a recorder; each distinct launch is then specialized and compiled exactly as the
JIT would (Triton's own binder and CUDA backend, down to a cubin) for sm_90, or with `--full` for sm_80 and
sm_90 over every dtype. This catches what the interpreter cannot: tl.dot shape limits, loop-carried type
changes, shared memory beyond a GPU's. It leans on Triton internals (`create_function_from_signature`,
`_pack_args`), so a Triton upgrade may need it adapted; the test that runs it skips when they are gone.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_server.attention_metadata import AttentionMetadata
from ladle_kernels import (
    activation,
    bitmask,
    fp8_linear,
    fused_moe,
    int8_linear,
    kv_cache,
    paged_attention,
    reference,
    rms_norm,
    rotary,
    seeded_noise,
)

UNAVAILABLE = 3  # exit status when this Triton cannot compile for CUDA here (the test skips)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
except ImportError as exc:  # internals moved in another Triton: nothing to check here
    print(f"cannot reach Triton's compiler internals: {exc}", file=sys.stderr)
    sys.exit(UNAVAILABLE)

# (target, bytes of shared memory a block may use there): A100 and H100.
SM80 = (GPUTarget("cuda", 80, 32), 166912)
SM90 = (GPUTarget("cuda", 90, 32), 232448)
Launch = tuple[JITFunction[Any], tuple[Any, ...], dict[str, Any]]
# (query heads, KV heads, head dim): Llama-3-8B, Qwen2.5-7B (group 7), a wide group with a padded head dim,
# no grouping with another padded one, and DeepSeek-V3's latent rows (576 dims padded to 1,024, 128 heads).
ATTENTION_SHAPES = [(32, 8, 128), (28, 4, 128), (8, 1, 96), (4, 4, 80), (128, 1, 576)]


def record_launches(calls: Callable[[], None]) -> list[Launch]:
    """Run `calls` with every kernel launch recorded instead of executed."""
    launches: list[Launch] = []

    def run(self: JITFunction[Any], *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        del grid, warmup
        launches.append((self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = run
    try:
        calls()
    finally:
        JITFunction.run = original
    return launches


def attention(
    spec: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool = False,
    alibi: bool = False,
) -> None:
    """One attention launch; with `fp8`, over an FP8 cache (`reference.fp8_kv_rows`' uint8 rows); with `alibi`,
    BLOOM's bias added to the scores."""
    blocks = [-(-s // 16) for _, s in spec]
    tables = [list(range(sum(blocks[:i]), sum(blocks[: i + 1]))) for i in range(len(spec))]
    meta = AttentionMetadata.build([q for q, _ in spec], [s for _, s in spec], tables, 16, "cpu")
    row, storage = (head_dim + reference.FP8_KV_SCALE_BYTES, torch.uint8) if fp8 else (head_dim, dtype)
    cache = torch.zeros(2, sum(blocks), 16, kv_heads, row, dtype=storage)
    q = torch.zeros(meta.num_tokens, heads, head_dim, dtype=dtype)
    if alibi:
        paged_attention.alibi_attention(q, cache, meta, 0.1, torch.zeros(heads))
    else:
        paged_attention.paged_attention(q, cache, meta, 0.1)


def elementwise_calls(dtype: torch.dtype) -> None:
    x = torch.zeros(3, 4096, dtype=dtype)
    rms_norm.rms_norm(x, torch.ones(4096, dtype=dtype), 1e-6)
    rms_norm.rms_norm(x, torch.ones(4096, dtype=dtype), 1e-6, x)
    qkv = torch.zeros(3, 48 * 128, dtype=dtype)
    q, k = qkv[:, : 32 * 128].view(3, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(3, 8, 128)
    rms_norm.rms_norm(q, torch.ones(128, dtype=dtype), 1e-6)
    rotary.rotary_embedding(torch.zeros(3, dtype=torch.int64), q, k, torch.zeros(64, 128, dtype=dtype))
    activation.silu_and_mul(torch.zeros(3, 2 * 14336, dtype=dtype))
    kv_cache.write_kv_cache(k, k, torch.zeros(2, 4, 16, 8, 128, dtype=dtype), torch.arange(3))
    kv_cache.write_kv_cache(k, k, torch.zeros(2, 4, 16, 8, 132, dtype=torch.uint8), torch.arange(3))  # FP8 rows
    bitmask.apply_token_bitmask_(torch.zeros(2, 1000, dtype=dtype), torch.zeros(2, 32, dtype=torch.int32))
    seeded_noise.seeded_log_uniforms(torch.zeros(2, dtype=torch.int64), torch.arange(1000))


def int8_calls(dtype: torch.dtype) -> None:
    """The weight-only int8 product's three tile shapes (decode, 32 rows, prefill) at Qwen2.5-0.5B's widths."""
    qs = torch.zeros(4864, 896, dtype=torch.int8)
    scales = torch.zeros(4864, 896 // 32, dtype=torch.float16)
    for rows in (3, 32, 100):
        int8_linear.int8_linear(torch.zeros(rows, 896, dtype=dtype), qs, scales)


def fp8_calls(dtype: torch.dtype) -> None:
    """The FP8 GEMMs (the Triton kernels, not `torch._scaled_mm`) per channel, per 128 x 128 block and per 128 x 32
    block, at Qwen2.5-0.5B's widths: the few-rows kernel (1 and 3 rows), the GEMM's decode and prefill tiles."""
    weight = torch.zeros(4864, 896, dtype=reference.FP8_DTYPE)
    channels, blocks = torch.ones(4864, 1), torch.ones(38, 7)
    for rows in (1, 3, 8, 100):
        x = torch.zeros(rows, 896, dtype=dtype)
        fp8_linear.fp8_linear(x, weight, channels, use_scaled_mm=False)
        fp8_linear.fp8_linear(x, weight, blocks, block=(128, 128), use_scaled_mm=False)
        # the narrowest blocks taken (`reference.FP8_GPU_BLOCK_COLUMNS`): K tiles of 32, tl.dot's least for e4m3
        fp8_linear.fp8_linear(x, weight, torch.ones(38, 28), block=(128, 32), use_scaled_mm=False)


def moe_calls(dtype: torch.dtype) -> None:
    """The mixture of experts' grouped GEMMs, float and FP8 (per channel and per 128 x 128 block), at Qwen3-30B-A3B's
    widths (4 of its 128 experts: the kernels do not depend on their number), decode rows and a prefill chunk."""
    hidden, inter, experts = 2048, 768, 4
    w13, w2 = torch.zeros(experts, 2 * inter, hidden, dtype=dtype), torch.zeros(experts, hidden, inter, dtype=dtype)
    q13, q2 = w13.to(reference.FP8_DTYPE), w2.to(reference.FP8_DTYPE)
    channel13, channel2 = torch.ones(experts, 2 * inter, 1), torch.ones(experts, hidden, 1)
    block13, block2 = torch.ones(experts, 12, 16), torch.ones(experts, 16, 6)
    for tokens in (3, 100):
        x = torch.zeros(tokens, hidden, dtype=dtype)
        weights, chosen = torch.full((tokens, 2), 0.5), torch.arange(2 * tokens).reshape(tokens, 2) % experts
        fused_moe.fused_moe(x, w13, w2, weights, chosen)
        fused_moe.fp8_fused_moe(x, q13, channel13, q2, channel2, weights, chosen)
        fused_moe.fp8_fused_moe(x, q13, block13, q2, block2, weights, chosen, block=(128, 128))


def quick_calls() -> None:
    """The riskiest specializations: every kernel once, attention's tile shapes, its float32 path and FP8 cache."""
    elementwise_calls(torch.bfloat16)
    int8_calls(torch.bfloat16)
    int8_calls(torch.float32)
    fp8_calls(torch.bfloat16)
    moe_calls(torch.bfloat16)
    attention([(1, 40), (7, 20)], 28, 4, 128, torch.bfloat16)  # prefill tiles, a group of 7
    attention([(1, 40), (1, 20)], 8, 1, 96, torch.bfloat16)  # decode tiles, padded head dim
    attention([(1, 40), (7, 20)], 4, 4, 128, torch.float32)  # float32: the most shared memory
    attention([(1, 40), (7, 20)], 32, 8, 128, torch.bfloat16, fp8=True)  # an FP8 cache, prefill tiles
    attention([(1, 40), (1, 20)], 32, 8, 128, torch.bfloat16, fp8=True)  # and decode tiles
    attention([(1, 40), (7, 20)], 128, 1, 576, torch.bfloat16)  # latent rows: narrow tiles, the group split
    attention([(1, 40), (1, 20)], 128, 1, 576, torch.bfloat16, fp8=True)
    attention([(1, 40), (7, 20)], 16, 16, 64, torch.bfloat16, alibi=True)  # BLOOM-560M's heads, prefill tiles
    attention([(1, 40), (1, 20)], 16, 16, 64, torch.bfloat16, alibi=True)  # and decode tiles


def full_calls() -> None:
    """Every dtype, with prefill and decode tiles for every shape of `ATTENTION_SHAPES`."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        elementwise_calls(dtype)
        int8_calls(dtype)
        fp8_calls(dtype)
        moe_calls(dtype)
        for (heads, kv_heads, head_dim), fp8 in itertools.product(ATTENTION_SHAPES, (False, True)):
            attention([(1, 40), (7, 20)], heads, kv_heads, head_dim, dtype, fp8)
            attention([(1, 40), (1, 20)], heads, kv_heads, head_dim, dtype, fp8)


def compile_launch(fn: JITFunction[Any], args: tuple[Any, ...], kwargs: dict[str, Any], target: GPUTarget) -> Any:
    """Specialize and compile one launch the way `JITFunction.run` does, for `target` instead of the device's."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def main(argv: list[str]) -> int:
    """Compile the quick set for sm_90, or with `--full` every dtype and shape for sm_80 and sm_90."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run without TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    try:
        make_backend(SM90[0])
    except Exception as exc:  # a Triton build without its CUDA backend
        print(f"no CUDA backend in this Triton: {exc}", file=sys.stderr)
        return UNAVAILABLE
    full = "--full" in argv
    launches = record_launches(full_calls if full else quick_calls)
    targets = [SM80, SM90] if full else [SM90]
    failures = 0
    seen: set[str] = set()
    for fn, args, kwargs in launches:
        for target, shared_limit in targets:
            capability = (target.arch // 10, target.arch % 10)
            fp8 = fn.fn.__module__ == fp8_linear.__name__ or kwargs.get("W_SCALES", 0) > 0
            if fp8 and capability < fp8_linear.FP8_MIN_CAPABILITY:
                continue  # e4m3 tensor cores: the FP8 GEMMs are never launched below sm_89
            start = time.perf_counter()
            try:
                kernel = compile_launch(fn, args, kwargs, target)
            except Exception as exc:  # report every failing specialization, not just the first
                failures += 1
                print(f"FAIL {fn.__name__} sm_{target.arch}: {type(exc).__name__}: {exc}")
                continue
            if kernel.hash in seen:
                continue
            seen.add(kernel.hash)
            ok = kernel.metadata.shared <= shared_limit
            failures += not ok
            constants = {k: v for k, v in kwargs.items() if k.isupper()}
            print(
                f"{'ok  ' if ok else 'FAIL'} {fn.__name__} sm_{target.arch} shared={kernel.metadata.shared} "
                f"{constants} ({time.perf_counter() - start:.1f}s)"
            )
    print(f"{len(seen)} kernels compiled, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
