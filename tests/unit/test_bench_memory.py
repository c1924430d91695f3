"""`ladle bench memory` on the embedded model's GGUF file: its stages, and the weights held in about the file's
size (a tied table held once, no float copy of any quantized tensor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import memory
from engine_server.loader import default_gguf_path
from ladle_cli.main import BENCHMARKS

pytestmark = pytest.mark.slow  # loads the embedded model in a child process


def test_the_summary_takes_the_kv_cache_and_the_runtime_off() -> None:
    stages = {"runtime": 300.0, "tokenizer": 340.0, "core": 840.0, "loaded": 870.0, "after_requests": 872.0}
    summary = memory.summarize({"stages_mib": stages, "kv_mib": 400.0, "weights_mib": 101.0}, file_mib=100.0)
    assert summary["model_mib"] == 172.0 and summary["model_over_file"] == 1.72
    assert summary["parts_mib"] == {"tokenizer": 40.0, "core_less_kv": 100.0, "after_core": 30.0, "requests": 2.0}
    assert summary["weights_over_file"] == 1.01


def test_the_embedded_models_weights_take_about_its_files_size(tmp_path: Path) -> None:
    assert BENCHMARKS["memory"] == "benchmarks.memory"
    out = tmp_path / "memory.jsonl"
    gguf = default_gguf_path()
    assert memory.main(["--model", str(gguf), "--kv-cache-mib", "400", "--requests", "1", "--skip-llama-cpp",
                        "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    ladle = result["systems"]["ladle"]
    assert ladle["quantization"] == "gguf" and 399 < ladle["kv_mib"] < 401
    assert set(ladle["stages_mib"]) == {"runtime", "tokenizer", "core", "loaded", "after_requests"}
    # The bound: the weights within 1.3x of the file (1.02x measured: the tied LM head and embedding share
    # one table; the float table is never loaded).
    assert ladle["weights_over_file"] < 1.1
    assert result["workload"]["file_mib"] == round(gguf.stat().st_size / 2**20, 1)
