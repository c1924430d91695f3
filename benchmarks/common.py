"""What every benchmark shares: workload flags, a run's provenance (commit, time), appending a result to .jsonl."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
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


def git_commit() -> str:
    """The checked-out commit of this repository (`git rev-parse HEAD`), or "unknown" outside a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()


def utc_timestamp() -> str:
    """Now, as the `time` field of every result: ISO 8601 in UTC, whole seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def append_result(out: Path | None, result: dict[str, Any]) -> None:
    """Append `result` as one JSON line to `out` (creating its folder); nothing when `out` is None."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(result) + "\n")
