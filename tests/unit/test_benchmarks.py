"""The benchmark harness runs end to end on a tiny workload and its results chart draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import chart, offline

pytestmark = pytest.mark.slow  # runs benchmarks on the embedded model


def test_offline_benchmark_writes_a_complete_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.jsonl"
    argv = ["--model", "default", "--num-seqs", "3", "--input-len", "8", "--output-len", "4", "--skip-hf",
            "--skip-llama-cpp"]  # (no peer, whatever this machine has installed)
    assert offline.main([*argv, "--out", str(out)]) == 0
    (result,) = chart.load_runs(out)
    assert result["workload"]["num_seqs"] == 3 and result["machine"]["device"] == "cpu"
    assert result["systems"]["ladle"]["output_tokens"] == 12
    assert result["ratio_vs_best_hf"] is None  # no peer ran, so no ratio is claimed
    assert json.loads(json.dumps(result)) == result
    png = tmp_path / "chart.png"
    assert chart.main([str(out), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
