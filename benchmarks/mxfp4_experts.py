"""gpt-oss-20b's banks of experts in the CPU's expert kernel: MXFP4 blocks (as the model's files store them) against
the Q5_0 blocks of the very same values (how they were served before), in one process, alternating.

A bank of gpt-oss-20b's shape (32 experts, hidden and intermediate 2,880, top-4, its biases and clamped SwiGLU) with
random e2m1 codes under exponents around 2 ** -8; the Q5_0 bank holds each value exactly (u = doubled value + 16
under a float16 scale of 2 ** (e - 128)). Timed: one decode token and a 64-token prefill through the whole bank
(`QuantizedExperts`, i.e. `moe_packed`), the median of several rounds that alternate the two, each round's mean
over a run of calls. Both products are the same to float32 rounding (checked before timing).

    python -m benchmarks.mxfp4_experts --out benchmarks/results/mxfp4_experts_cpu.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch

from benchmarks.common import cpu_model_name, git_commit, report_result, utc_timestamp
from engine_server.layers.lowbit_weight import E2M1_DOUBLED, LowBitWeight
from engine_server.layers.quantized_experts import QuantizedExperts, expert_weights
from engine_server.layers.quantized_linear import QuantizedWeight
from ladle_kernels import cpu_ops

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 32, 2880, 2880, 4
SWIGLU = (1.702, 7.0, 1.0)


def _weight_pair(rows: int, columns: int, gen: torch.Generator) -> tuple[LowBitWeight, LowBitWeight]:
    """A random MXFP4 weight and the Q5_0 weight of the same values."""
    codes = torch.randint(0, 16, (rows, columns), dtype=torch.uint8, generator=gen)
    exponents = torch.randint(118, 123, (rows, columns // 32, 1), dtype=torch.uint8, generator=gen)
    mxfp4 = LowBitWeight("mxfp4", codes, exponents)
    scale = torch.pow(2.0, exponents[..., 0].double() - 128).half()
    u = (torch.tensor(E2M1_DOUBLED)[codes.long()] + 16).to(torch.uint8)
    q5_0 = LowBitWeight("q5_0", u, torch.stack([scale, (-16 * scale.float()).half()], -1))
    return mxfp4, q5_0


def _banks(gen: torch.Generator) -> dict[str, QuantizedExperts]:
    """The two banks, sharing their biases."""
    parts: dict[str, list[list[QuantizedWeight]]] = {"mxfp4": [[], [], []], "q5_0": [[], [], []]}
    for _ in range(EXPERTS):
        for part, shape in enumerate(((INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))):
            mxfp4, q5_0 = _weight_pair(*shape, gen)
            parts["mxfp4"][part].append(mxfp4)
            parts["q5_0"][part].append(q5_0)
    b13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=gen) * 0.01
    b2 = torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.01
    return {
        kind: QuantizedExperts(replace(expert_weights(*bank), b13=b13, b2=b2), swiglu=SWIGLU)
        for kind, bank in parts.items()
    }


def _packed_gb(bank: QuantizedExperts) -> float:
    """The bank's packed weights and tables, in GB."""
    names = ("w13", "w13_scales", "w13_mins", "w2", "w2_scales", "w2_mins")
    return round(sum(cast(torch.Tensor, getattr(bank, name)).nbytes for name in names) / 1e9, 3)


def _seconds_per_call(layer: QuantizedExperts, tokens: int, calls: int, gen: torch.Generator) -> float:
    x = torch.randn(tokens, HIDDEN, generator=gen) * 0.1
    weights, chosen = torch.topk(torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), -1), TOP_K, dim=-1)
    layer(x, weights, chosen)
    started = time.perf_counter()
    for _ in range(calls):
        layer(x, weights, chosen)
    return (time.perf_counter() - started) / calls


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median's figures")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")
    args = parser.parse_args(argv)
    if cpu_ops.cpu_ops() is None:
        raise SystemExit("the C++ CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(0)
    banks = _banks(gen)
    x = torch.randn(3, HIDDEN, generator=gen) * 0.1
    weights, chosen = torch.topk(torch.softmax(torch.randn(3, EXPERTS, generator=gen), -1), TOP_K, dim=-1)
    outputs = [bank(x, weights, chosen) for bank in banks.values()]
    difference = float((outputs[0] - outputs[1]).abs().max() / outputs[0].abs().max())
    if difference > 1e-4:
        raise SystemExit(f"the two banks differ by {difference:.2e} of their largest output")
    workloads: dict[str, dict[str, float]] = {}
    for name, tokens, calls in (("decode_1_token", 1, 200), ("prefill_64_tokens", 64, 5)):
        times: dict[str, list[float]] = {kind: [] for kind in banks}
        for _ in range(args.rounds):
            for kind, bank in banks.items():
                times[kind].append(_seconds_per_call(bank, tokens, calls, gen))
        median = {kind: statistics.median(values) * 1e3 for kind, values in times.items()}
        workloads[name] = {
            **{f"{kind}_ms": round(ms, 3) for kind, ms in median.items()},
            "q5_0_over_mxfp4": round(median["q5_0"] / median["mxfp4"], 2),
        }
        print(name, workloads[name])
    result = {
        "benchmark": "mxfp4_experts", "time": utc_timestamp(), "commit": git_commit(),
        "command": "python -m benchmarks.mxfp4_experts " + " ".join(argv or []),
        "machine": {"cpu_model": cpu_model_name(), "cpu_count": torch.get_num_threads()},
        "bank": {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "top_k": TOP_K,
                 "packed_gb": {kind: _packed_gb(bank) for kind, bank in banks.items()}},
        "relative_difference": difference, "workloads": workloads,
    }  # fmt: skip
    report_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
