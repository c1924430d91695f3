"""Time one linear layer of an 8B-class model at decode and prefill batch sizes: bf16 against `--quantization fp8`'s
pieces (issue 50: fp8's single-stream TPOT on an H200 was 5.54 ms against bf16's 4.80, though it reads half the
weight bytes).

For each weight shape `[N, K]` (Llama 3.1 8B's fused qkv, o, gate_up and down projections) and each row count M it
times, in microseconds per call, each replayed from a CUDA graph as a decode step runs it (`do_bench_cudagraph`):
- `bf16`: `F.linear` on the bf16 weight;
- `quantize`: the per-token e4m3 quantization of x (`ladle_kernels.fp8_linear.fp8_quantize_per_token`);
- `scaled_mm`: `torch._scaled_mm` on the quantized x and the e4m3 weight (rowwise scales);
- `fp8_auto`: `fp8_linear` as the engine calls it (the quantization, then `torch._scaled_mm` where available);
- `fp8_triton`: `fp8_linear` through the Triton GEMM instead;
- `fp8_few_rows` (up to 16 rows): `fp8_linear` through the few-rows kernel, which rounds x itself (the engine's
  choice up to `ladle_kernels.fp8_linear.FEW_ROWS` rows); up to 4 rows, `few_rows_tiles` times it over other tiles
  (BLOCK_N, BLOCK_K, num_warps), to choose its defaults from; from 8 rows, `gemm_tiles_us` times the Triton GEMM
  over other tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): whether it can beat `torch._scaled_mm`.
Each time also gives the weight bytes' bandwidth (bytes / time), to read against the copy bandwidth measured first.

    python3 scripts/fp8_gemm_timings.py --out fp8_gemm.jsonl      # on a GPU (~2 min: compiles the swept tiles)
    TRITON_INTERPRET=1 python3 scripts/fp8_gemm_timings.py --smoke  # on the CPU: the calls run, the times mean nothing
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import git_commit
from ladle_kernels import reference
from ladle_kernels.fp8_linear import _scaled_mm, fp8_linear, fp8_quantize_per_token, scaled_mm_available

# Llama 3.1 8B: hidden 4096, 32 query and 8 KV heads of 128, intermediate 14336.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 4, 8, 32, 128, 512)
# (BLOCK_N, BLOCK_K, num_warps) of the few-rows kernel, timed up to 4 rows.
FEW_ROWS_TILES = [(32, 256, 4), (16, 256, 4), (8, 256, 4), (64, 128, 4), (32, 128, 4), (64, 256, 8), (32, 512, 8),
                  (16, 512, 4), (128, 64, 4), (16, 128, 2)]  # fmt: skip
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the Triton FP8 GEMM, timed from 8 rows.
GEMM_TILES = [(16, 64, 128, 4, 4), (32, 128, 128, 4, 4), (64, 128, 128, 4, 4), (64, 64, 128, 4, 5),
              (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (64, 256, 128, 8, 4), (16, 128, 256, 4, 4)]  # fmt: skip


def _time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Microseconds per call: replayed from a CUDA graph on a GPU; a plain wall-clock mean elsewhere."""
    if device.type == "cuda":
        import triton.testing

        with torch.cuda.stream(torch.cuda.Stream()):
            return float(triton.testing.do_bench_cudagraph(fn, rep=50)) * 1000.0
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def _copy_bandwidth(device: torch.device) -> float | None:
    """GB/s of a 1 GiB device-to-device copy (bytes read + written), as `ladle bench gpu` reports it."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    import triton.testing

    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), rep=100))
    return round(2 * src.numel() / (ms / 1000.0) / 1e9, 1)


def _variants(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The calls to time on x `[M, K]` bf16 against w `[N, K]` bf16 and its e4m3 form (wq, per-channel ws)."""
    xq, xs = fp8_quantize_per_token(x)
    variants: dict[str, Callable[[], object]] = {
        "bf16": lambda: F.linear(x, w),
        "quantize": lambda: fp8_quantize_per_token(x),
        "fp8_auto": lambda: fp8_linear(x, wq, ws),
        "fp8_triton": lambda: fp8_linear(x, wq, ws, use_scaled_mm=False, few_rows=False),
    }
    if x.shape[0] <= 16:
        variants["fp8_few_rows"] = lambda: fp8_linear(x, wq, ws, few_rows=True)
    if scaled_mm_available(x.device):
        variants["scaled_mm"] = lambda: _scaled_mm(xq, xs, wq, ws, None, torch.bfloat16)
    return variants


def measure(
    shapes: dict[str, tuple[int, int]], rows: tuple[int, ...], device: torch.device,
    sweep: list[tuple[int, int, int]], gemm_sweep: list[tuple[int, int, int, int, int]],
) -> list[dict[str, object]]:  # fmt: skip
    """One record per (shape, M): each variant's microseconds and the weight bytes' GB/s; up to 4 rows, the few-rows
    kernel's microseconds over each tile of `sweep` too; from 8 rows, the Triton GEMM's over `gemm_sweep`."""
    gen = torch.Generator().manual_seed(0)
    records: list[dict[str, object]] = []
    for name, (features, depth) in shapes.items():
        w = (torch.randn(features, depth, generator=gen) * 0.02).to(device, torch.bfloat16)
        wq, ws = (t.to(device) for t in reference.fp8_quantize_per_channel(w.float().cpu()))
        for m in rows:
            x = torch.randn(m, depth, generator=gen).to(device, torch.bfloat16)
            times = {key: round(_time_us(fn, device), 2) for key, fn in _variants(x, w, wq, ws).items()}
            tiles = {}
            if m <= 4:
                for tile in sweep:
                    call = functools.partial(fp8_linear, x, wq, ws, few_rows=True, few_rows_tiles=tile)
                    tiles["x".join(map(str, tile))] = round(_time_us(call, device), 2)
            weight_bytes = {"bf16": 2 * features * depth, "fp8": features * depth + 4 * features}
            bandwidth = {
                key: round((weight_bytes["bf16" if key == "bf16" else "fp8"]) / (us / 1e6) / 1e9, 1)
                for key, us in times.items() if key != "quantize"
            }  # fmt: skip
            gemm = {}
            if m >= 8:
                for gemm_tile in gemm_sweep:
                    call = functools.partial(fp8_linear, x, wq, ws, use_scaled_mm=False, few_rows=False,
                                             gemm_tiles=gemm_tile)  # fmt: skip
                    gemm["x".join(map(str, gemm_tile))] = round(_time_us(call, device), 2)
            record = {"shape": name, "n": features, "k": depth, "m": m, "us": times, "weight_gb_per_s": bandwidth}
            if tiles:
                record["few_rows_tiles_us"] = tiles
            if gemm:
                record["gemm_tiles_us"] = gemm
            print(json.dumps(record), flush=True)
            records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = {"tiny": (96, 64)} if args.smoke else SHAPES
    rows = (1, 5, 8) if args.smoke else ROWS
    result = {
        "benchmark": "fp8_gemm_timings",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "command": "python3 scripts/fp8_gemm_timings.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_gb_per_s": _copy_bandwidth(device),
        "scaled_mm": scaled_mm_available(device),
        "records": measure(shapes, rows, device, FEW_ROWS_TILES[:2] if args.smoke else FEW_ROWS_TILES,
                           [(16, 32, 32, 4, 2)] if args.smoke else GEMM_TILES),
    }
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
