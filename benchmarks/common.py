"""What every benchmark shares: the workload flags and how a result is appended to a .jsonl file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_workload_arguments(parser: argparse.ArgumentParser, num_seqs: int = 64) -> None:
    """The model and the random-token workload: --model --device --num-seqs --input-len --output-len --seed."""
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--num-seqs", type=int, default=num_seqs)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)


def append_result(out: Path | None, result: dict[str, Any]) -> None:
    """Append `result` as one JSON line to `out` (creating its folder); nothing when `out` is None."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(result) + "\n")
