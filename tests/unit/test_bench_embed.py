"""`ladle bench embed`: its flags, its inputs, and a tiny end-to-end run (ladle's float path, mixed load)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import embed
from ladle_cli.main import BENCHMARKS

pytestmark = pytest.mark.slow  # embeds with the embedded model


def test_the_command_is_registered_and_its_defaults_are_the_issues_workload() -> None:
    assert BENCHMARKS["embed"] == "benchmarks.embed"
    args = embed.build_parser().parse_args([])
    assert (args.num_inputs, args.input_len, args.quantization, args.repeats) == (256, 128, ["none", "auto"], 3)
    assert (args.generate_priority, args.embed_priority, args.skip_hf, args.skip_mixed) == (
        "interactive", "interactive", False, False,
    )  # fmt: skip
    args = embed.build_parser().parse_args(["--quantization", "none", "--embed-priority", "batch"])
    assert (args.quantization, args.embed_priority) == (["none"], "batch")
    with pytest.raises(SystemExit):
        embed.build_parser().parse_args(["--embed-priority", "urgent"])


def test_inputs_are_deterministic_per_run_and_distinct_between_runs() -> None:
    first = embed.make_inputs(3, 16, 1000, seed=0, label="run0")
    assert first == embed.make_inputs(3, 16, 1000, seed=0, label="run0")
    assert all(len(ids) == 16 and all(10 <= i < 1000 for i in ids) for ids in first)
    assert first != embed.make_inputs(3, 16, 1000, seed=0, label="run1")  # no prefix cache serves a repeat
    assert first != embed.make_inputs(3, 16, 1000, seed=1, label="run0")


def test_a_tiny_run_writes_a_complete_record(tmp_path: Path) -> None:
    out = tmp_path / "embed.jsonl"
    argv = ["--num-inputs", "3", "--input-len", "8", "--quantization", "none", "--repeats", "1", "--skip-hf",
            "--skip-mixed", "--out", str(out)]  # fmt: skip
    assert embed.main(argv) == 0
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["benchmark"] == "embed" and result["machine"]["device"] == "cpu"
    assert result["command"].startswith("ladle bench embed --num-inputs 3") and result["commit"]
    ladle = result["systems"]["ladle_none"]
    assert (ladle["inputs"], ladle["tokens"], ladle["quantization"]) == (3, 24, "none")
    assert ladle["inputs_per_s"] > 0 and len(ladle["runs_inputs_per_s"]) == 1
    assert result["ratio_vs_hf"] == {}  # no peer ran, so no ratio is claimed
    assert "mixed_load" not in result


def test_the_mixed_load_finishes_every_request_and_reports_both_kinds(llm: Any) -> None:
    argv = ["--repeats", "2", "--input-len", "8", "--mixed-generations", "2", "--mixed-prompt-len", "4",
            "--mixed-output-len", "3", "--mixed-inputs", "5"]  # fmt: skip
    mixed = embed.measure_mixed(llm, embed.build_parser().parse_args(argv))
    together = mixed["mixed"]
    assert together["generate"]["all_finished"] and together["embed"]["all_finished"]
    assert (together["generate"]["requests"], together["embed"]["requests"]) == (2, 5)
    assert len(together["runs"]) == 2 and all(run["steps"] >= 3 for run in together["runs"])
    assert set(mixed["generate_alone"]) == {"generate", "runs"} and set(mixed["embed_alone"]) == {"embed", "runs"}
    assert mixed["generate_wall_mixed_over_alone"] > 0 and mixed["embed_rate_mixed_over_alone"] > 0
    assert not llm.core.has_unfinished()


def test_generations_are_spread_among_the_pooling_inputs(llm: Any) -> None:
    argv = ["--input-len", "4", "--mixed-generations", "2", "--mixed-prompt-len", "4", "--mixed-inputs", "6"]
    queue = embed.mixed_requests(llm, embed.build_parser().parse_args(argv), "order", True, True)
    assert [t.kind for t in queue] == ["generate", *["embed"] * 3, "generate", *["embed"] * 3]
    assert all(t.request.pooling is not None for t in queue if t.kind == "embed")
    assert len({t.request.request_id for t in queue}) == 8


def test_the_vector_check_measures_relative_error_and_cosine() -> None:
    import torch

    reference = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    check = embed.vector_check(reference + torch.tensor([[0.0, 0.05], [0.0, 0.0]]), reference)
    assert check["max_relative_error"] == pytest.approx(0.01, rel=1e-4)
    assert 0.999 < check["min_cosine"] <= 1.0
