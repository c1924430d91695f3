"""What reading a GGUF file in place costs and saves (loader/gguf_convert.py): for the embedded model and its
Q4_K_M, Q5_K_M and Q6_K files (benchmarks/kquant_files.py: needs llama-cpp-python, not a dependency), the cache
entry's size and the first resolve's time (a fresh cache), the float weights' read (`ModelSource.weights()`), every
matrix dequantized by the engine's block decoding against the gguf package's, and a warm engine's start on the
quantized default (`auto`) and on the float path (`none`).

    LADLE_CACHE_DIR=/tmp/kq .venv/bin/python scripts/gguf_load_times.py --out benchmarks/results/gguf_load_cpu.jsonl

(`LADLE_CACHE_DIR` is where the K-quant files are made; each measurement converts into a fresh cache of its own.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import append_result, cpu_model_name, git_commit, utc_timestamp


def _seconds(run: Any) -> float:
    start = time.perf_counter()
    run()
    return round(time.perf_counter() - start, 3)


def measure(path: Path, cache: Path) -> dict[str, Any]:
    """One file's figures (module docstring), its cache entry in `cache`."""
    from gguf.quants import dequantize

    from engine_server import LLM
    from engine_server.config import EngineConfig
    from engine_server.loader import resolve_model
    from engine_server.loader.gguf_blocks import dequantize_blocks
    from engine_server.loader.gguf_convert import indexed_tensors

    source_box: list[Any] = []
    first_resolve = _seconds(lambda: source_box.append(resolve_model(str(path), cache_dir=cache)))
    source = source_box[0]
    entry = sum(f.stat().st_size for f in source.path.rglob("*") if f.is_file())
    weights = min(_seconds(lambda: sum(t.numel() for _, t in source.weights())) for _ in range(3))
    tensors = indexed_tensors(path, source.path)
    matrices = [t for t in tensors if dequantize_blocks(t.data[:1], t.tensor_type) is not None]
    values: list[Any] = []
    ours = _seconds(lambda: values.extend(dequantize_blocks(t.data, t.tensor_type) for t in matrices))
    theirs = _seconds(lambda: [dequantize(t.data, t.tensor_type) for t in matrices])
    starts: dict[str, float] = {}
    for mode in ("auto", "none", "auto", "none"):  # the second of each is kept: warm
        start = time.perf_counter()
        llm = LLM(config=EngineConfig(model=str(path), device="cpu", quantization=mode, cache_dir=str(cache)))
        starts[mode] = round(time.perf_counter() - start, 3)
        llm.close()
    return {
        "file": path.name, "file_bytes": path.stat().st_size, "cache_entry_bytes": entry,
        "first_resolve_s": first_resolve, "weights_s": weights, "matrix_params": sum(v.numel() for v in values),
        "dequantize_s": {"ladle": ours, "gguf": theirs}, "engine_start_s": starts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per file here")
    args = parser.parse_args()
    from benchmarks.kquant_files import FILE_TYPES, kquant_gguf, source_gguf

    files = [source_gguf(), *(kquant_gguf(mix) for mix in FILE_TYPES)]
    for path in files:
        with tempfile.TemporaryDirectory(prefix="ladle-cache-") as cache:
            result = measure(path, Path(cache))
        record = {"benchmark": "gguf_load", "time": utc_timestamp(), "commit": git_commit(),
                  "command": "scripts/gguf_load_times.py", "machine": {"cpu_model": cpu_model_name()}, **result}
        print(record)
        append_result(args.out, record)


if __name__ == "__main__":
    main()
