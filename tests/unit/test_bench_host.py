"""`ladle bench host`: the steady-state arithmetic on hand-made steps, then small runs of every path.

The runs are short (B <= 4, a few dozen tokens) and check shapes and sanity, not speed: the device-time
checks leave room for a busy machine (a 20 ms device step against well under a millisecond of host work).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import host
from benchmarks.step_probes import StepRecord, decode_step_times

pytestmark = pytest.mark.slow  # loads models and starts a client process

FIELDS = {
    "benchmark", "path", "batch_size", "device_ms", "async_scheduling", "sampling", "ms_per_step", "phases_ms",
    "ops_per_step", "ops_by_phase", "steps", "commit", "cpu_model", "time", "command",
}  # fmt: skip


def _step(start_ms: float, rows: int, tokens: int, phases_ms: tuple[float, ...] = (0, 0, 0, 0)) -> StepRecord:
    return StepRecord(start_ms / 1e3, rows, tokens, [p / 1e3 for p in phases_ms])


def test_only_full_decode_steps_followed_by_another_are_timed() -> None:
    steps = [
        _step(0, 2, 64),  # prefill
        _step(10, 2, 2, (1, 2, 0.5, 0.5)),
        _step(14, 2, 2, (1, 2, 0.5, 0.5)),
        _step(20, 2, 2, (1, 4, 0.5, 0.5)),  # the last full one: requests finish here, not timed
        _step(90, 0, 0),
    ]
    times = decode_step_times(steps, batch_size=2)
    assert times is not None and times.steps == 2
    assert times.ms_per_step == pytest.approx(5.0) and times.ms_per_step_p50 == pytest.approx(5.0)
    assert times.phases_ms == pytest.approx(
        {"schedule": 1.0, "launch": 2.0, "collect": 0.5, "update_from_output": 0.5, "rest": 1.0}
    )
    assert times.gc_ms == 0.0
    assert decode_step_times(steps, batch_size=3) is None


def _results(tmp_path: Path, *argv: str) -> list[dict[str, Any]]:
    out = tmp_path / "host.jsonl"
    assert host.main([*argv, "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_offline_results_ops_and_device_time(tmp_path: Path) -> None:
    results = _results(
        tmp_path, "--paths", "offline", "--batch-sizes", "4", "--output-len", "24", "--device-ms", "0,20",
        "--sampling", "greedy,seeded", "--count-ops",
    )  # fmt: skip
    assert [(r["sampling"], r["device_ms"]) for r in results] == [
        ("greedy", 0.0), ("greedy", 20.0), ("seeded", 0.0), ("seeded", 20.0)
    ]  # fmt: skip
    for result in results:
        assert result.keys() >= FIELDS and result["benchmark"] == "host" and result["path"] == "offline"
        assert result["batch_size"] == 4 and result["async_scheduling"] is False
        assert result["steps"] == 24 - 2  # 23 decode steps after the prefill's token, less the finishing one
        assert sum(result["phases_ms"].values()) == pytest.approx(result["ms_per_step"], abs=1e-3)
        assert result["ops_per_step"] == sum(result["ops_by_phase"].values())
        assert result["command"].startswith("ladle bench host --paths offline")
    free, busy = (r["ms_per_step"] for r in results[:2])
    assert 0 < free < 10
    assert busy >= 20 and results[1]["phases_ms"]["collect"] >= 19  # synchronous: host + device
    greedy, seeded = results[0], results[2]
    assert 0 < greedy["ops_per_step"] < seeded["ops_per_step"]
    assert greedy["ops_by_phase"]["sampling"] < seeded["ops_by_phase"]["sampling"]


def test_async_scheduling_hides_the_host_behind_the_device(tmp_path: Path) -> None:
    (result,) = _results(
        tmp_path, "--paths", "offline", "--batch-sizes", "4", "--output-len", "24", "--device-ms", "20",
        "--async-scheduling", "on",
    )  # fmt: skip
    assert result["async_scheduling"] is True
    assert 19 <= result["ms_per_step"] < 1.5 * 20


@pytest.fixture(scope="module")
def llm_and_args() -> tuple[Any, Any]:
    from engine_server import LLM

    args = host.build_parser().parse_args(["--batch-sizes", "4", "--output-len", "8"])
    args.vocab_limit = 49152
    return LLM(config=host.engine_config(args)), args


def test_op_counts_are_those_of_the_real_forward(llm_and_args: tuple[Any, Any]) -> None:
    llm, args = llm_and_args
    stand_in = host.count_offline_ops(llm, 2, "sampled", args, seed=1)
    real = host.count_offline_ops(llm, 2, "sampled", args, seed=2, real_forward=True)
    assert stand_in.ops_by_phase == real.ops_by_phase and stand_in.steps == real.steps == 8 - 2
    assert stand_in.ops_per_step == pytest.approx(sum(stand_in.ops_by_phase.values()), abs=0.05)
    # Means over the steps, each rounded to 0.01: their sum may be off by a few hundredths.
    assert stand_in.ops_per_step == pytest.approx(sum(stand_in.ops_by_name.values()), abs=0.05)
    assert all(stand_in.ops_by_phase[phase] > 0 for phase in ("inputs", "logits", "sampling"))


def test_grpc_streams_from_another_process(tmp_path: Path) -> None:
    (result,) = _results(tmp_path, "--paths", "grpc", "--batch-sizes", "4", "--output-len", "64")
    assert result.keys() >= FIELDS and result["path"] == "grpc" and result["ops_per_step"] is None
    assert result["steps"] > 0 and 0 < result["ms_per_step"] < 50
    client = result["client"]
    assert client["output_tokens"] == 4 * 64 and client["output_tok_per_s"] > 0 and client["ms_per_step"] > 0
