"""Draw the committed offline results (`results/*.jsonl`) as one bar chart per workload: output tok/s by system.

    python -m benchmarks.chart benchmarks/results/offline_cpu.jsonl -o benchmarks/results/offline_cpu.png
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a .jsonl file written by `ladle bench offline --out`")
    parser.add_argument("-o", "--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    draw(latest_per_workload(load_runs(args.results)), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
