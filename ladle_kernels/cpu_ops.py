"""The CPU kernel set (`cpu_ops()`): C++ kernels for the ops where the torch reference is slow on the CPU.

- Decode attention: the reference gathers every decode row's KV blocks into one padded tensor and then runs
  SDPA over it, three passes over the KV and most of a decode step's non-GEMM time; `paged_decode_attention`
  (`ladle_kernels/cpu/paged_attention.cpp`) reads each row's blocks in place, once, the rows of one sequence together.
  Prefill chunks keep the reference SDPA (`reference.attend_prefills`), or with `paged_attention_by_token` (the
  quantized path) go through the kernel too, each token as a row.
- RMSNorm (with its residual add), rotary embedding and SiLU-and-mul (`ladle_kernels/cpu/pointwise.cpp`): one pass
  each instead of 3-9 torch ops, which on a prefill chunk are memory-bound passes and on a decode step are
  dispatch overhead.
- The KV cache write stays the reference's (two `index_copy_`) for a float cache; an FP8 cache's rows are packed
  in one pass (`ladle_kernels/cpu/kv_cache.cpp`, whose e4m3 rows `ladle_kernels/cpu/fp8_kv.h` writes and reads).
- Seeded sampling rows' counter-based noise (`ladle_kernels/cpu/seeded_noise.cpp`): the hash in one pass and the
  reference's own log, bit-identical to `reference.seeded_log_uniforms` and 2 passes instead of 13; used by
  `engine_server.sampling.noise` through `cpu_seeded_log_uniforms()`.
- Quantized linear layers (`ladle_kernels/cpu/quant_matmul.cpp`) and the decode stack
  (`ladle_kernels/cpu/decoder.cpp`), which runs a quantized model's decode step through all these kernels in one call;
  both are used through
  `engine_server.layers` (`QuantizedLinear`, `decode_stack`), not through `KernelOps`.
- Gated DeltaNet's core (`ladle_kernels/cpu/gated_delta.cpp`, Qwen3-Next and Qwen3.5): the convolution, then every token
  in turn against its sequence's state (which stays in cache, where the reference takes a prefill chunk in the
  chunked form, whose rounding depends on where the chunks start), then the gated norm; and the attention's output
  gate (`sigmoid_mul`). torch's elementwise exp, sigmoid and SiLU give an element other bits where it falls in a
  tensor's scalar tail; these kernels' depend on its index within its row alone, so a sequence's output does not
  depend on its batch or its chunking (bit for bit). Mamba-2's core (`ladle_kernels/cpu/mamba2.cpp`, Granite 4.0's
  hybrids) likewise: the convolution with its bias, every token's scan step against its head's state, the gated
  norm over each group; and Mamba-1's convolution and scan (`ladle_kernels/cpu/mamba1.cpp`: Jamba, Mamba, Falcon
  Mamba), every token's step against its channels' rows, gated.
- LoRA's shrink and expand over rows of many adapters (`ladle_kernels/cpu/lora.cpp`): the rows grouped by slot in the
  kernel and each slot's rows one small GEMM against its weight, where the reference syncs and gathers per slot;
  each output element summed by fused multiply-adds in one fixed order, so a row's result does not depend on its
  batch (bit for bit).
Each wrapper runs the reference where its kernel does not apply (another dtype, a head dim it is not built
for, a 3-D input to RMSNorm such as Qwen3's per-head q/k norm).

The C++ sources are compiled on first use with `torch.utils.cpp_extension` (g++ and ninja, ~40 s on 2 cores) for
the CPU it runs on (`-march=native`) and cached under torch's extensions directory (`TORCH_EXTENSIONS_DIR`, by
default `~/.cache/torch_extensions`); the cache entry is named after this CPU's features, the sources and the
Python and torch versions, so a shared home directory never hands one machine another's build. Where it
cannot be built, or with `LADLE_CPU_KERNELS=0`, `cpu_ops()` is None and the CPU runs the reference ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from ladle_kernels import reference
from ladle_kernels._checks import unit_last_stride
from ladle_kernels.kernel_set import KernelOps

if TYPE_CHECKING:
    from ladle_kernels.attention_inputs import AttentionInputs

log = structlog.get_logger(__name__)

_SOURCE_DIR = Path(__file__).parent / "cpu"
_SOURCES = (
    "paged_attention.cpp",
    "kv_cache.cpp",
    "pointwise.cpp",
    "quant_matmul.cpp",
    "moe.cpp",
    "decoder.cpp",
    "seeded_noise.cpp",
    "lora.cpp",
    "gated_delta.cpp",
    "mamba2.cpp",
    "mamba1.cpp",
)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
HEAD_DIMS = (16, 32, 64, 128, 256, 512, 576)  # the head dims the kernel is instantiated for
DISABLE_ENV = "LADLE_CPU_KERNELS"
# A build takes ~40 s; a lock this old was left by a process that died building.
STALE_LOCK_S = 600.0
# Every process loading the kernels holds this file shared (flock) while it does: a build lock with no such holder
# was left by a process that died building, however young it is.
LOADERS_LOCK = "loaders.flock"


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.paged_attention`'s contract; decode rows run the C++ kernel (float32, a head dim in `HEAD_DIMS`),
    the rest the reference."""
    plan = meta.reference_plan
    if q.dtype != torch.float32 or q.shape[-1] not in HEAD_DIMS or plan.decode_token_index.numel() == 0:
        return reference.paged_attention(q, kv_cache, meta, scale, window, softcap, sinks)
    if plan.all_decode:
        return paged_decode_attention(
            q.contiguous(), kv_cache, meta.block_tables, meta.seq_lens, scale, window, softcap, sinks
        )
    out = torch.empty_like(q)
    decoded = paged_decode_attention(
        q.index_select(0, plan.decode_token_index),
        kv_cache,
        plan.decode_block_tables,
        plan.decode_seq_lens,
        scale,
        window,
        softcap,
        sinks,
    )
    out.index_copy_(0, plan.decode_token_index, decoded)
    reference.attend_prefills(q, kv_cache, meta, scale, out, window, softcap, sinks)
    return out


def paged_attention_by_token(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.paged_attention`'s contract with every token, prefill tokens included, run through the decode
    kernel as a row of its own (its sequence's block table, positions [0, p]).

    A token's result then depends on its query and the cache only, bit for bit: not on how its prompt was split
    into chunks, found in the prefix cache, or batched with others. Quantized models use it (`quantize_model`):
    their 8-bit activation rounding turns the float32-level differences SDPA makes between those cases into
    visible ones, which change greedy answers. A prompt's rows still share the kernel's tiles (each tile of keys
    read and transposed once for up to 64 of them), so on long prompts it keeps pace with SDPA. Falls back to
    `paged_attention` where the kernel does not apply.
    """
    if q.dtype != torch.float32 or q.shape[-1] not in HEAD_DIMS:
        return paged_attention(q, kv_cache, meta, scale, window, softcap, sinks)
    if meta.max_query_len == 1:
        return paged_decode_attention(
            q.contiguous(), kv_cache, meta.block_tables, meta.seq_lens, scale, window, softcap, sinks
        )
    tables, lens = meta.token_rows
    return paged_decode_attention(q.contiguous(), kv_cache, tables, lens, scale, window, softcap, sinks)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[B, H, D]` (one new token per row) over positions `[0, seq_lens[b])` of the paged cache -> `[B, H, D]`;
    with a sliding `window` > 0, over `[seq_lens[b] - window, seq_lens[b])` only; with `softcap` > 0, scores
    soft-capped, and with `sinks` (`[H]` float32) a sink logit per head, as `reference.paged_attention` says; with
    `alibi_slopes` (`[H]` float32) each scaled score of position j plus `alibi_slopes[h] * (j - p)`, p the row's own
    position (`seq_lens[b] - 1`), as `engine_server.layers.alibi.alibi_attention` computes it.

    An FP8 cache (`reference.is_fp8_kv_cache`) is read as the reference reads it: each tile's rows decoded to the
    float32 values `reference.fp8_kv_values` gives, so a row's result is the same bits as over a float32 cache
    holding them.

    Raises RuntimeError on a malformed input (dtype, shape, a length beyond the block table, a block id outside
    the cache, a negative window or soft-cap, sinks or slopes not `[H]` float32), before anything is read. Needs
    the extension (`cpu_ops()` is not None).
    """
    out: torch.Tensor = torch.ops.ladle_cpu.paged_decode_attention(
        q, kv_cache, block_tables, seq_lens, scale, window, softcap, sinks, alibi_slopes
    )
    return out


def alibi_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionInputs,
    scale: float,
    slopes: torch.Tensor,
    falcon: bool = False,
) -> torch.Tensor:
    """`reference.alibi_attention`'s contract; BLOOM's and MPT's bias (`slopes[h] * (j - p)`) with every token
    through the decode kernel as a row of its own (as `paged_attention_by_token`: a token's result depends on its
    query and the cache alone, bit for bit), the reference elsewhere (Falcon-RW's bfloat16 bias, not float32, a
    head dim not in `HEAD_DIMS`)."""
    if falcon or q.dtype != torch.float32 or q.shape[-1] not in HEAD_DIMS:
        return reference.alibi_attention(q, kv_cache, meta, scale, slopes, falcon)
    tables, lens = (meta.block_tables, meta.seq_lens) if meta.max_query_len == 1 else meta.token_rows
    return paged_decode_attention(q.contiguous(), kv_cache, tables, lens, scale, alibi_slopes=slopes.contiguous())


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`reference.write_kv_cache`'s contract, bit for bit; the C++ kernel packs an FP8 cache's rows from float32 k, v
    (one pass, where the reference takes a dozen torch ops), the reference does the rest (two `index_copy_`)."""
    if (
        reference.is_fp8_kv_cache(kv_cache)
        and k.dtype == v.dtype == torch.float32
        and k.dim() == 3
        and slot_mapping.dtype == torch.int64
    ):
        k, v = (x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous() for x in (k, v))
        torch.ops.ladle_cpu.write_kv_cache(k, v, kv_cache, slot_mapping.contiguous())
        return
    reference.write_kv_cache(k, v, kv_cache, slot_mapping)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm`'s contract; one pass per row for float32 `[rows, n]` inputs."""
    if not (_rows(x) and weight.dtype == torch.float32 and (residual is None or _rows(residual))):
        return reference.rms_norm(x, weight, eps, residual)
    if residual is None:
        out: torch.Tensor = torch.ops.ladle_cpu.rms_norm(x, weight.contiguous(), eps)
        return out
    normed, summed = torch.ops.ladle_cpu.add_rms_norm(x, residual, weight.contiguous(), eps)
    return normed, summed


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rotary_embedding`'s contract (new tensors, inputs untouched); one pass per token in float32."""
    if not (
        q.dtype == k.dtype == cos_sin_cache.dtype == torch.float32
        and q.dim() == k.dim() == 3
        and q.stride(-1) == k.stride(-1) == 1
        and positions.dtype == torch.int64
    ):
        return reference.rotary_embedding(positions, q, k, cos_sin_cache)
    q_out, k_out = torch.ops.ladle_cpu.rotary_embedding(positions, q, k, cos_sin_cache.contiguous())
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul`'s contract; one pass per row for float32 `[rows, 2d]` inputs."""
    if not _rows(x):
        return reference.silu_and_mul(x)
    out: torch.Tensor = torch.ops.ladle_cpu.silu_and_mul(x)
    return out


def seeded_log_uniforms(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`reference.seeded_log_uniforms`, bit for bit: log(u) `[S, V]` float32 for int64 keys `[S]` and token ids
    `[V]` on the CPU."""
    out: torch.Tensor = torch.ops.ladle_cpu.seeded_log_uniforms(keys, tokens)
    return out


def cpu_seeded_log_uniforms() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """`seeded_log_uniforms`, or None where `cpu_ops()` is (disabled, or not buildable here)."""
    return None if cpu_ops() is None else seeded_log_uniforms


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`reference.lora_shrink`'s contract; the C++ kernel for float32 x `[T, K]` and a `[S, R, K]` with int32 or
    int64 slots (a slot outside [-1, S) raises RuntimeError)."""
    if not (x.dtype == a.dtype == torch.float32 and x.dim() == 2 and a.dim() == 3 and _slot_ids(slots)):
        return reference.lora_shrink(x, a, slots)
    y: torch.Tensor = torch.ops.ladle_cpu.lora_shrink(unit_last_stride(x), a.contiguous(), slots)
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """`reference.lora_expand`'s contract (out updated in place); the C++ kernel for float32 out `[T, N]` with a
    contiguous last dim (a column slice of a wider tensor too), y `[T, R]` and b `[S, R, N]`, int32 or int64
    slots."""
    if not (_rows(out) and y.dtype == b.dtype == torch.float32 and y.dim() == 2 and b.dim() == 3 and _slot_ids(slots)):
        reference.lora_expand(out, y, b, slots)
        return
    torch.ops.ladle_cpu.lora_expand(out, unit_last_stride(y), b.contiguous(), slots)


def gated_delta_net(
    mixed: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    key_heads: int,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
    beta_scale: float = 1.0,
    sigmoid_gate: bool = False,
    decay_bound: float = 0.0,
) -> torch.Tensor:
    """`reference.gated_delta_net`'s contract on the C++ kernel (float32 rows; anything else on the reference)."""
    inputs = (mixed, z, a, b, conv_weight, a_log, dt_bias, norm_weight, states)
    if not all(t.dtype == torch.float32 for t in inputs) or not all(_rows(t) for t in (mixed, z, a, b, states)):
        return reference.gated_delta_net(
            mixed, z, a, b, conv_weight, a_log, dt_bias, norm_weight, eps, key_heads, states, slots, query_lens, fresh,
            beta_scale, sigmoid_gate, decay_bound,
        )
    out: torch.Tensor = torch.ops.ladle_cpu.gated_delta_net(
        mixed, z, a, b, conv_weight.contiguous(), a_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous(),
        eps, key_heads, states, torch.tensor(slots, dtype=torch.int64), torch.tensor(query_lens, dtype=torch.int64),
        torch.tensor(fresh, dtype=torch.bool), beta_scale, sigmoid_gate, decay_bound,
    )  # fmt: skip
    return out


def mamba2_mixer(
    xbc: torch.Tensor,
    z: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    d: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    groups: int,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """`reference.mamba2_mixer`'s contract on the C++ kernel (float32 rows; anything else on the reference)."""
    weights = [t for t in (conv_weight, conv_bias, a_log, dt_bias, d, norm_weight) if t is not None]
    if not all(t.dtype == torch.float32 for t in (xbc, z, dt, states, *weights)) or not all(
        _rows(t) for t in (xbc, z, dt, states)
    ):
        return reference.mamba2_mixer(
            xbc, z, dt, conv_weight, conv_bias, a_log, dt_bias, d, norm_weight, eps, groups, states, slots,
            query_lens, fresh,
        )  # fmt: skip
    out: torch.Tensor = torch.ops.ladle_cpu.mamba2_mixer(
        xbc, z, dt, conv_weight.contiguous(), None if conv_bias is None else conv_bias.contiguous(),
        a_log.contiguous(), dt_bias.contiguous(), d.contiguous(),
        None if norm_weight is None else norm_weight.contiguous(), eps, groups, states,
        torch.tensor(slots, dtype=torch.int64), torch.tensor(query_lens, dtype=torch.int64),
        torch.tensor(fresh, dtype=torch.bool),
    )  # fmt: skip
    return out


def mamba1_conv(
    x: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """`reference.mamba1_conv`'s contract on the C++ kernel (float32 rows; anything else on the reference)."""
    weights = (conv_weight,) if conv_bias is None else (conv_weight, conv_bias)
    if not all(t.dtype == torch.float32 for t in (x, states, *weights)) or not (_rows(x) and _rows(states)):
        return reference.mamba1_conv(x, conv_weight, conv_bias, states, slots, query_lens, fresh)
    out: torch.Tensor = torch.ops.ladle_cpu.mamba1_conv(
        x, conv_weight.contiguous(), None if conv_bias is None else conv_bias.contiguous(), states,
        torch.tensor(slots, dtype=torch.int64), torch.tensor(query_lens, dtype=torch.int64),
        torch.tensor(fresh, dtype=torch.bool),
    )  # fmt: skip
    return out


def mamba1_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    z: torch.Tensor,
    states: torch.Tensor,
    slots: Sequence[int],
    query_lens: Sequence[int],
    fresh: Sequence[bool],
) -> torch.Tensor:
    """`reference.mamba1_scan`'s contract on the C++ kernel (float32 rows; anything else on the reference)."""
    if not all(t.dtype == torch.float32 for t in (x, dt, a, b, c, d, z, states)) or not all(
        _rows(t) for t in (x, dt, b, c, z, states)
    ):
        return reference.mamba1_scan(x, dt, a, b, c, d, z, states, slots, query_lens, fresh)
    out: torch.Tensor = torch.ops.ladle_cpu.mamba1_scan(
        x, dt, a.contiguous(), b, c, d.contiguous(), z, states, torch.tensor(slots, dtype=torch.int64),
        torch.tensor(query_lens, dtype=torch.int64), torch.tensor(fresh, dtype=torch.bool),
    )  # fmt: skip
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`reference.sigmoid_mul`'s contract; one pass per row for float32 `[rows, n]` inputs of one shape."""
    if not (_rows(x) and _rows(gate) and x.shape == gate.shape):
        return reference.sigmoid_mul(x, gate)
    out: torch.Tensor = torch.ops.ladle_cpu.sigmoid_mul(x, gate)
    return out


def _slot_ids(slots: torch.Tensor) -> bool:
    return slots.dim() == 1 and slots.dtype in (torch.int32, torch.int64)


def _rows(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1


@functools.cache
def cpu_ops() -> KernelOps | None:
    """The C++ kernels as a `KernelOps` (each wrapper running the reference where its kernel does not apply),
    building the extension on first use; None when disabled (`LADLE_CPU_KERNELS=0`) or when it cannot be built
    here (logged once)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        _load_extension()
    except Exception as exc:  # no compiler, no ninja, a failed build: the reference ops still serve
        log.warning("cpu kernels unavailable, running the torch reference ops", error=f"{type(exc).__name__}: {exc}")
        return None
    return KernelOps(
        rms_norm=rms_norm,
        rotary_embedding=rotary_embedding,
        silu_and_mul=silu_and_mul,
        write_kv_cache=write_kv_cache,
        paged_attention=paged_attention,
        lora_shrink=lora_shrink,
        lora_expand=lora_expand,
        gated_delta_net=gated_delta_net,
        sigmoid_mul=sigmoid_mul,
        mamba2_mixer=mamba2_mixer,
        mamba1_conv=mamba1_conv,
        mamba1_scan=mamba1_scan,
        alibi_attention=alibi_attention,
    )


@functools.cache
def batch_invariant_cpu_ops() -> KernelOps | None:
    """`cpu_ops()` with every token's attention on the decode kernel (`paged_attention_by_token`), for the
    quantized models; None where `cpu_ops()` is."""
    ops = cpu_ops()
    return None if ops is None else dataclasses.replace(ops, paged_attention=paged_attention_by_token)


def _load_extension() -> None:
    from torch.utils.cpp_extension import get_default_build_root, load

    name = f"ladle_cpu_{_build_tag()}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    build_dir = root / f"{name}_{python}_torch{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with loading_guard(build_dir), _ninja_on_path():
        load(
            name=name,
            sources=[str(_SOURCE_DIR / source) for source in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


@contextlib.contextmanager
def loading_guard(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> Iterator[None]:
    """Around loading (and maybe building) the kernels in `build_dir`: first remove a stale build lock
    (`clear_stale_build_lock`, told whether any other process is loading), then hold `LOADERS_LOCK` shared until
    the load is done. The flock goes with the process, however it ends."""
    with (build_dir / LOADERS_LOCK).open("a") as loaders:
        try:
            fcntl.flock(loaders, fcntl.LOCK_EX | fcntl.LOCK_NB)
            others_loading = False
        except BlockingIOError:
            others_loading = True
        clear_stale_build_lock(build_dir, max_age_s, others_loading)
        fcntl.flock(loaders, fcntl.LOCK_SH)  # from exclusive, or waiting out another's brief exclusive check
        yield


def clear_stale_build_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S, others_loading: bool = True) -> bool:
    """Remove `build_dir/lock` when no other process is loading the kernels (`others_loading` False: nobody holds
    `LOADERS_LOCK`, so whoever made the lock died building), or else when it is older than `max_age_s`; True if it
    did.

    torch holds that file while one process builds and makes every other wait, without a time limit, until it
    is gone: a build killed half-way (Ctrl-C on a first start, a killed `make setup`) would otherwise hang every
    later start. The age rule is for a lock that processes started before `LOADERS_LOCK` existed, or that
    processes already waiting on it keep company.
    """
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if others_loading and age < max_age_s:
        return False
    log.warning(
        "removing a stale cpu kernel build lock", path=str(lock), age_s=round(age), others_loading=others_loading
    )
    lock.unlink(missing_ok=True)
    return True


def _build_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags (the build is `-march=native`), of every file in
    `ladle_kernels/cpu` (torch's own rebuild check hashes the sources, not the headers they include) and of that
    folder's path: two checkouts of the same sources build apart, since a build names its sources by path and another
    checkout's load would rewrite it and rebuild everything (~90 s on 2 cores), each time the other loads."""
    digest = hashlib.sha256(platform.machine().encode())
    digest.update(str(_SOURCE_DIR.resolve()).encode())
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        digest.update("".join(line for line in lines if line.startswith(("model name", "flags")))[:4096].encode())
    for path in sorted(_SOURCE_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the `ninja` PyPI package's binary on PATH for the build when the system has none."""
    saved = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved
