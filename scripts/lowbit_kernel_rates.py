"""Every GGUF block type the CPU kernels serve, through one dense product (`torch.ops.ladle_cpu.packed_linear`): a
decode row and a 64-row prefill against an N x K weight of random blocks (`tests.lowbit_blocks`), the median of
rounds that alternate the kinds, each round's mean over a run of calls. Reported per kind: milliseconds, the bits a
weight the kernels hold and the file's, and giga-weights a second.

Whether a weight stays in the CPU's caches decides what this measures: the default 4096 x 4096 (10 MB at 5 bits)
times the tiles' arithmetic, `--rows 16384 --columns 8192` streams more than this VM's 32 MiB L3 holds.

    python scripts/lowbit_kernel_rates.py --out benchmarks/results/lowbit_kernel_rates_cpu.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from benchmarks.common import cpu_model_name, git_commit, report_result, utc_timestamp  # noqa: E402
from engine_server.layers.lowbit_weight import decode_blocks, pack_lowbit  # noqa: E402
from ladle_kernels import cpu_ops  # noqa: E402
from tests.lowbit_blocks import KINDS, block_elements, random_blocks  # noqa: E402

PREFILL_ROWS = 64


def _file_bits(kind: str) -> float:
    from gguf import GGML_QUANT_SIZES

    elements, size = GGML_QUANT_SIZES[KINDS[kind]]
    return 8 * size / elements


def _seconds(packed: tuple[torch.Tensor, ...], x: torch.Tensor, n: int, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        torch.ops.ladle_cpu.packed_linear(x, *packed, n)
    return (time.perf_counter() - start) / calls


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="N, the output features")
    parser.add_argument("--columns", type=int, default=4096, help="K, a multiple of 256")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="decode calls a round (prefill: a quarter)")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    args = parser.parse_args(argv)
    if cpu_ops.cpu_ops() is None:
        raise SystemExit("the C++ CPU kernels cannot be built here")
    n, k = args.rows, args.columns
    packed = {}
    for kind in KINDS:
        if k % block_elements(kind) == 0:
            weight = decode_blocks(random_blocks(kind, n, k, torch.Generator().manual_seed(0)), kind)
            packed[kind] = pack_lowbit(weight, torch.ops.ladle_cpu.lowbit_planes)
    gen = torch.Generator().manual_seed(1)
    decode, prefill = torch.randn(1, k, generator=gen), torch.randn(PREFILL_ROWS, k, generator=gen)
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in packed}
    for tensors in packed.values():  # warm each kind once
        _seconds(tensors, decode, n, 3)
    for _ in range(args.rounds):
        for kind, tensors in packed.items():
            times[kind].append((_seconds(tensors, decode, n, args.calls),
                                _seconds(tensors, prefill, n, max(1, args.calls // 4))))  # fmt: skip
    kinds = {}
    for kind, tensors in packed.items():
        one = statistics.median(t[0] for t in times[kind])
        many = statistics.median(t[1] for t in times[kind])
        held = sum(t.numel() * t.element_size() for t in tensors) * 8 / (n * k)
        kinds[kind] = {"decode_ms": round(one * 1e3, 4), "prefill_ms": round(many * 1e3, 3),
                       "decode_gweights_per_s": round(n * k / one / 1e9, 1),
                       "prefill_gweights_per_s": round(PREFILL_ROWS * n * k / many / 1e9, 1),
                       "bits_held": round(held, 3), "bits_in_file": round(_file_bits(kind), 4)}  # fmt: skip
        print(kind, kinds[kind], flush=True)
    result = {"benchmark": "lowbit_kernel_rates", "time": utc_timestamp(), "commit": git_commit(),
              "command": "python scripts/lowbit_kernel_rates.py " + " ".join(argv or sys.argv[1:]),
              "cpu": cpu_model_name(), "threads": torch.get_num_threads(), "rows": n, "columns": k,
              "prefill_rows": PREFILL_ROWS, "rounds": args.rounds, "kinds": kinds}  # fmt: skip
    report_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
