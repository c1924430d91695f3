"""Draw committed results (`results/*.jsonl`) as bar charts of output tok/s by system.

`ladle bench offline` results: one panel per workload (its newest run). `ladle bench gpu` results: one panel per
model and device (its newest run: ladle on the nano-vllm workload, ladle and transformers on its fixed-output
variant).

    python -m benchmarks.chart benchmarks/results/offline_cpu.jsonl -o benchmarks/results/offline_cpu.png
    python -m benchmarks.chart benchmarks/results/gpu_h100.jsonl -o benchmarks/results/gpu_h100.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_runs(path: Path) -> list[dict[str, Any]]:
    """Every JSON object in a .jsonl file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest_per_workload(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest run of each (model, num_seqs, input_len, output_len, device) workload."""
    latest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for run in runs:
        w = run["workload"]
        latest[(w["model"], w["num_seqs"], w["input_len"], w["output_len"], run["machine"]["device"])] = run
    return list(latest.values())


def draw(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        names = [n for n, s in run["systems"].items() if "output_tok_per_s" in s]
        rates = [run["systems"][n]["output_tok_per_s"] for n in names]
        bars = ax.bar(names, rates, color=["#d95f02" if n == "ladle" else "#7570b3" for n in names])
        ax.bar_label(bars, fmt="%.0f")
        w = run["workload"]
        ratio = run.get("ratio_vs_best_hf")
        ax.set_title(
            f"{w['model']} on {run['machine']['device']}\n{w['num_seqs']} seqs, in {w['input_len']} / out "
            f"{w['output_len']}" + (f" — ladle {ratio:.2f}x best HF" if ratio else ""),
            fontsize=9,
        )
        ax.set_ylabel("output tokens / s")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def latest_per_model(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The newest result of each (model, weight scheme, device) in `ladle bench gpu` runs, with the run it belongs
    to (results from before `quantization` was recorded count as `none`)."""
    latest: dict[tuple[str, str, str], tuple[dict[str, Any], dict[str, Any]]] = {}
    for run in runs:
        for model in run["models"]:
            latest[(model["model"], model.get("quantization", "none"), run["device"])] = (run, model)
    return list(latest.values())


def scheme_label(model: dict[str, Any]) -> str:
    """The chart title suffix of a quantized result (" int8"); empty for float weights."""
    scheme = model.get("quantization", "none")
    return "" if scheme == "none" else f" {scheme}"


def draw_gpu(results: list[tuple[dict[str, Any], dict[str, Any]]], out: Path) -> None:
    """One panel per (run, model) result of `ladle bench gpu`, titled with its ratio, roofline fraction and TPOT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for ax, (run, model) in zip(axes[0], results, strict=True):
        rates = model["output_tok_per_s"]
        names = [n for n in ("ladle", "ladle_fixed_output", "transformers") if n in rates]
        bars = ax.bar(names, [rates[n] for n in names], color=["#7570b3" if n == "transformers" else "#d95f02"
                                                                for n in names])
        ax.bar_label(bars, fmt="%.0f")
        ratio = model.get("ratio_vs_hf")
        ax.set_title(
            f"{model['model']}{scheme_label(model)} on {run['device']}\n"
            + (f"{ratio:.2f}x transformers, " if ratio else "")
            + f"roofline {model['roofline_fraction']:.0%}, TPOT {model['tpot_ms_single_stream']:.2f} ms",
            fontsize=9,
        )
        ax.set_ylabel("output tokens / s")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a .jsonl file written by `ladle bench offline|gpu --out`")
    parser.add_argument("-o", "--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    if runs and runs[-1].get("benchmark") == "gpu":
        draw_gpu(latest_per_model(runs), args.out)
    else:
        draw(latest_per_workload(runs), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
