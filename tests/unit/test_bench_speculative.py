"""`ladle bench speculative`'s pure parts: its prompts are deterministic and distinct, its records complete."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from benchmarks import speculative
from benchmarks.speculative import EngineRun

REQUIRED = {
    "benchmark", "workload", "streams", "tok_per_s_off", "tok_per_s_on", "speedup", "mean_acceptance_length",
    "identical_greedy", "speculative_config", "num_requests", "output_tokens", "commit", "cpu_model", "time",
    "command", "proposed_tokens", "accepted_tokens",
}  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    args = speculative.build_parser().parse_args(list(argv))
    args.command_line = "ladle bench speculative " + " ".join(argv)
    args.commit = "abc123"
    return args


@pytest.mark.parametrize("workload", ["editing", "summarization"])
def test_passages_are_deterministic_distinct_and_about_400_tokens(workload: str) -> None:
    warmup, timed = speculative.case_prompts(workload, 16, 16, seed=0)
    assert (warmup, timed) == speculative.case_prompts(workload, 16, 16, seed=0)
    prompts = [*warmup, *timed]
    assert len(set(prompts)) == len(prompts) == 18
    # Other stream settings and seeds give other prompts, so no case's prompt is another's.
    other_warmup, other_timed = speculative.case_prompts(workload, 1, 4, seed=0)
    assert not set(other_warmup + other_timed) & set(prompts)
    assert not set(speculative.case_prompts(workload, 16, 16, seed=1)[1]) & set(prompts)
    for prompt in prompts:
        assert isinstance(prompt, str)
        passage = prompt.split("\n\n", 1)[1]
        assert 1700 <= len(passage) <= 2200  # ~400 tokens of this prose
        assert "{" not in passage  # every slot filled


def test_editing_asks_for_a_colour_the_passage_holds() -> None:
    for prompt in speculative.case_prompts("editing", 1, 8, seed=3)[1]:
        assert isinstance(prompt, str)
        instruction, passage = prompt.split("\n\n", 1)
        old, new = instruction.split("'")[1::2]
        assert old != new and re.search(rf"\b{old}\b", passage)


def test_random_prompts_are_token_ids_in_range() -> None:
    warmup, timed = speculative.case_prompts("random", 1, 4, seed=0)
    prompts = [*warmup, *timed]
    assert all(isinstance(p, list) and len(p) == speculative.RANDOM_PROMPT_TOKENS for p in prompts)
    assert all(i in speculative.RANDOM_TOKEN_IDS for p in prompts for i in p)
    assert len({tuple(p) for p in prompts}) == len(prompts)


def test_story_requests_are_distinct_and_sampled_with_a_seed_each() -> None:
    warmup, timed = speculative.case_prompts("story", 1, 4, seed=0)
    assert all(isinstance(p, str) and p.startswith("Write a short story") for p in warmup + timed)
    args = _args()
    story = [speculative.sampling_params("story", args, i) for i in range(3)]
    assert {p.temperature for p in story} == {speculative.STORY_TEMPERATURE} and len({p.seed for p in story}) == 3
    greedy = speculative.sampling_params("editing", args, 0)
    assert greedy.temperature == 0.0 and greedy.seed is None


def test_first_differences_name_the_request_and_position() -> None:
    off = [[1, 2, 3], [4, 5, 6], [7, 8]]
    on = [[1, 2, 3], [4, 9, 6], [7, 8, 0]]
    found = speculative.first_differences(off, on)
    assert [(d["request"], d["position"]) for d in found] == [(1, 1), (2, 2)]


def test_speculation_delta_counts_only_the_timed_part() -> None:
    delta = speculative.speculation_delta((10, 6, 4, [1, 1, 2]), (30, 18, 10, [2, 3, 5]))
    assert delta["proposed_tokens"] == 20 and delta["accepted_tokens"] == 12 and delta["verified_rows"] == 6
    assert delta["mean_acceptance_length"] == 3.0 and delta["kept_histogram"] == [1, 2, 3]


def test_record_has_every_field_and_flags_a_difference() -> None:
    args = _args("--workloads", "random", "--streams", "1")
    spec = speculative.speculation_delta((0, 0, 0, [0] * 9), (16, 8, 4, [0, 0, 4, 0, 0, 0, 0, 0, 0]))
    off = EngineRun(outputs=[[1, 2, 3], [4, 5]], seconds=1.0)
    on = EngineRun(outputs=[[1, 2, 3], [4, 6]], seconds=0.5, speculation=spec)
    record = speculative.build_record("random", 1, [[7], [8]], off, on, args)
    assert set(record) >= REQUIRED
    assert record["speedup"] == 2.0 and record["mean_acceptance_length"] == 3.0
    assert record["identical_greedy"] is False and record["differences"][0]["prompt"] == [8]
    assert json.loads(json.dumps(record)) == record
    assert record["speculative_config"]["method"] == "ngram"
    same = speculative.build_record("random", 1, [[7], [8]], off, EngineRun(off.outputs, 0.5, spec), args)
    assert same["identical_greedy"] is True
    failed = speculative.build_record("random", 1, [[7], [8]], off, EngineRun(error="Traceback ..."), args)
    assert failed["identical_greedy"] is None and failed["speedup"] is None and failed["error_on"]
    assert "random" in speculative.format_table([record, failed])


def test_parser_rejects_unknown_workloads_and_bad_configs() -> None:
    parser = speculative.build_parser()
    for argv in (["--workloads", "poetry"], ["--streams", "0"], ["--speculative-config", '{"method": "magic"}']):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert parser.parse_args([]).streams == [1, 16]
