"""Where FP8 weights lose quality: `ladle bench quality`'s fp8 measure with the e4m3 rounding changed in one place.

Each variant serves the model under `--quantization fp8` on the CPU (dequantized weights, rows rounded in torch:
`engine_server.layers.fp8_linear`) with one thing patched, and is compared with the float model on the same
positions as `benchmarks.quality` (the 16 chat prompts, `--num-tokens` teacher-forced tokens each):
- `committed`: the served path as it is (weights per output channel, activations per token);
- `weights only` / `activations only`: one operand left float;
- `activations per group of G`: each row scaled per G consecutive columns instead of once per token;
- `weights and activations per group of 32`;
- `only <projection>`: that kind of layer in FP8, every other one float.

A probe, not a served path: the patches reach into the CPU layer's module globals and `engine_server.quantization`.
Run: `PYTHONPATH=. .venv/bin/python -m benchmarks.fp8_breakdown [--out FILE]` (~5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from typing import Any
from unittest import mock

import torch
from torch import nn

import engine_server.layers.fp8_linear as fp8_linear
import engine_server.quantization as quantization
from benchmarks.common import cpu_model_name, git_commit
from benchmarks.quality import QUALITY_PROMPTS, compare, make_llm, reference_of
from ladle_kernels import reference

RowRounding = Callable[[torch.Tensor], torch.Tensor]
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def rows_per_group(group: int) -> RowRounding:
    """x `[M, K]` rounded to e4m3 with one scale per `group` columns of each row (K a multiple of `group`)."""

    def rounded(x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape
        groups = x.float().reshape(rows, cols // group, group)
        scale = (groups.abs().amax(-1, keepdim=True) / reference.FP8_MAX).clamp(min=reference.FP8_MIN_SCALE)
        return (reference.to_fp8(groups / scale).float() * scale).reshape(rows, cols).to(x.dtype)

    return rounded


def weights_per_group(group: int) -> Callable[[torch.Tensor], fp8_linear.Fp8Weight]:
    """A float weight in e4m3 with one scale per `group` columns of each row (a block of 1 x `group`)."""

    def quantized(weight: torch.Tensor) -> fp8_linear.Fp8Weight:
        qs, scales = reference.fp8_quantize_blocks(weight.detach(), (1, group))
        return fp8_linear.Fp8Weight(qs, scales, (1, group))

    return quantized


def float_weight(weight: torch.Tensor) -> fp8_linear.Fp8Weight:
    """A weight 'in FP8' whose values are its float ones (scale 1, values kept in float32): the weights left float."""
    return _Float(weight.detach().float())


class _Float(fp8_linear.Fp8Weight):
    def __init__(self, values: torch.Tensor) -> None:
        super().__init__(values, torch.ones(values.shape[0], 1))

    def dequantize(self) -> torch.Tensor:
        return self.qs

    def to(self, device: torch.device) -> fp8_linear.Fp8Weight:
        return self


def only(kind: str) -> Callable[..., int]:
    """`replace_fp8_linears` that swaps only the layers named `*.<kind>`."""
    swap = quantization.replace_fp8_linears

    def replace(model: nn.Module, weight_for: Callable[[str, nn.Linear], Any]) -> int:
        return swap(model, lambda name, linear: weight_for(name, linear) if name.endswith(kind) else None)

    return replace


def variants() -> dict[str, dict[str, Any]]:
    """Name -> the patches (`rows`, `weight`, `replace`) of each variant."""
    found: dict[str, dict[str, Any]] = {
        "committed": {},
        "weights only": {"rows": lambda x: x},
        "activations only": {"weight": float_weight},
        "activations per group of 64": {"rows": rows_per_group(64)},
        "activations per group of 32": {"rows": rows_per_group(32)},
        "weights and activations per group of 32": {"rows": rows_per_group(32), "weight": weights_per_group(32)},
    }
    found.update({f"only {kind}": {"replace": only(kind)} for kind in PROJECTIONS})
    return found


@contextmanager
def patched(patches: dict[str, Any]) -> Iterator[None]:
    with ExitStack() as stack:
        if "rows" in patches:
            stack.enter_context(mock.patch.object(fp8_linear, "fp8_rounded_rows", patches["rows"]))
        if "weight" in patches:
            stack.enter_context(mock.patch.object(quantization, "quantize_fp8", patches["weight"]))
        if "replace" in patches:
            stack.enter_context(mock.patch.object(quantization, "replace_fp8_linears", patches["replace"]))
        yield


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.fp8_breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-tokens", type=int, default=64)
    parser.add_argument("--variants", help="comma-separated names (default: all)")
    parser.add_argument("--out", help="append the results as JSON lines here")
    args = parser.parse_args(argv)
    table = variants()
    chosen = args.variants.split(",") if args.variants else list(table)
    with make_llm(args.model, "none") as float_llm:
        sequences, log_probs = reference_of(float_llm, QUALITY_PROMPTS, args.num_tokens)
    record = {
        "benchmark": "quality_fp8_breakdown", "commit": git_commit(), "cpu": cpu_model_name(), "model": args.model,
        "command": "python -m benchmarks.fp8_breakdown " + " ".join(argv or []), "num_tokens": args.num_tokens,
    }  # fmt: skip
    lines = []
    for name in chosen:
        with patched(table[name]), make_llm(args.model, "fp8") as llm:
            result = compare(log_probs, llm, "fp8", QUALITY_PROMPTS, args.num_tokens, sequences, free_running=False)
        line = json.dumps({**record, "variant": name, **asdict(result)})
        print(line, flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
