"""Constrained decoding through the whole engine on the embedded model: every output parses and validates,
unconstrained neighbours are untouched, preemption keeps grammar state, matchers are released.

Uses the session `served_llm` fixture (SmolLM2-135M-Instruct as served by default: its GGUF's quantized
blocks, CPU): a constraint acts on whatever weights an engine serves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest

from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.errors import ValidationError
from engine_server.output.types import FinishReason
from engine_server.structured import Constraint
from engine_server.structured.compiler import GrammarCompilerConfig
from engine_server.tokenizer.chat import ChatMessage

pytestmark = pytest.mark.slow  # the embedded model under constraints

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "occupation"],
}
BOOK = {
    "type": "object",
    "properties": {
        # Length bounds make xgrammar compile slower (~2 s for the summary's alone), so only the longest
        # field has one: it is what keeps a rambling summary from running until max_tokens.
        "title": {"type": "string", "minLength": 1},
        "author": {"type": "string", "minLength": 1},
        "year": {"type": "integer", "minimum": -3000, "maximum": 2100},
        "summary": {"type": "string", "minLength": 1, "maxLength": 300},
    },
    "required": ["title", "author", "year", "summary"],
}
MEASURE_EBNF = """
root ::= "Answer: " number " " unit
number ::= [1-9] [0-9]? [0-9]?
unit ::= "meters" | "kilograms" | "seconds"
"""
MEASURE_RE = r"Answer: [1-9][0-9]{0,2} (meters|kilograms|seconds)"
DATE_EBNF = """
root ::= year "-" month "-" day
year ::= [12] [0-9] [0-9] [0-9]
month ::= "0" [1-9] | "1" [0-2]
day ::= "0" [1-9] | [12] [0-9] | "3" [01]
"""
DATE_RE = r"[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
COLORS = ["red", "green", "blue", "yellow", "dark purple"]
SENTIMENTS = ["positive", "negative", "neutral"]

PEOPLE = [
    "a retired firefighter from Ohio",
    "the young pianist next door",
    "a famous chef",
    "my grandmother",
    "an astronaut training for Mars",
    "a high school math teacher",
    "a marathon runner",
    "a software engineer who loves cats",
]
BOOKS = [
    "Pride and Prejudice",
    "Moby-Dick",
    "1984 by George Orwell",
    "The Hobbit",
    "Don Quixote",
    "To Kill a Mockingbird",
    "The Odyssey",
    "Frankenstein",
]
QUESTIONS = [
    "Is the sky blue?",
    "Is fire cold?",
    "Can fish swim?",
    "Is 7 an even number?",
    "Do cats bark?",
    "Is Paris in France?",
    "Is water wet?",
    "Is the sun a star?",
]
PLAIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Tell me a short joke about computers.",
    "Describe the water cycle in two sentences.",
]
UNCONSTRAINED = SamplingParams(temperature=0.0, max_tokens=32)


def chat(text: str) -> ChatPrompt:
    return ChatPrompt([ChatMessage(role="user", content=text)])


Check = Callable[[str], None]


def schema_check(schema: dict[str, Any]) -> Check:
    return lambda text: jsonschema.validate(json.loads(text), schema)


def regex_check(pattern: str) -> Check:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text

    return check


def choice_check(choices: list[str]) -> Check:
    def check(text: str) -> None:
        assert text in choices, text

    return check


def object_check(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


@dataclass(frozen=True)
class Case:
    prompt: ChatPrompt
    params: SamplingParams
    check: Check


def greedy_cases() -> list[Case]:
    def params(constraint: Constraint, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)

    person, book = Constraint.json_schema(PERSON), Constraint.json_schema(BOOK)
    cases = [
        Case(chat(f"Describe {p} as JSON with name, age and occupation."), params(person, 200), schema_check(PERSON))
        for p in PEOPLE
    ]
    cases += [Case(chat(f"Summarize the book {b} as JSON."), params(book, 600), schema_check(BOOK)) for b in BOOKS]
    cases += [
        Case(chat(f"{q} Answer yes or no."), params(Constraint.regex("(yes|no)"), 8), regex_check("yes|no"))
        for q in QUESTIONS
    ]
    cases += [
        Case(chat(f"Pick a color for {thing}."), params(Constraint.choice(COLORS), 8), choice_check(COLORS))
        for thing in ("a car", "the sea", "a banana", "grass", "a royal robe")
    ]
    cases += [
        Case(chat(f"Classify the sentiment: '{s}'"), params(Constraint.choice(SENTIMENTS), 8), choice_check(SENTIMENTS))
        for s in ("I love it!", "This is terrible.", "It is a chair.")
    ]
    cases += [
        Case(chat(q), params(Constraint.grammar(MEASURE_EBNF), 16), regex_check(MEASURE_RE))
        for q in ("How tall is a giraffe?", "How heavy is a cat?", "How long is a minute?")
    ]
    cases += [
        Case(chat(q), params(Constraint.grammar(DATE_EBNF), 16), regex_check(DATE_RE))
        for q in ("When did the Berlin wall fall?", "Give me today's date.", "When was the moon landing?")
    ]
    # Any JSON object bounds no string's length, so a model may ramble inside one until max_tokens; these
    # prompts are ones whose greedy answer closes (sampled json_object is left out for the same reason).
    cases += [
        Case(chat(q), params(Constraint.json_object(), 300), object_check)
        for q in (
            "Return a JSON object with a greeting.",
            "Return a JSON object with keys city and country for Paris.",
            "Return a JSON object with keys x and y for a point.",
            "Return a JSON object with the name and price of an apple.",
        )
    ]
    return cases


def sampled_cases() -> list[Case]:
    def params(constraint: Constraint, max_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=max_tokens, constraint=constraint)

    cases = [
        Case(chat(f"Describe {p} as JSON."), params(Constraint.json_schema(PERSON), 200, i), schema_check(PERSON))
        for i, p in enumerate(PEOPLE[:4])
    ]
    cases += [
        Case(chat(f"Summarize {b} as JSON."), params(Constraint.json_schema(BOOK), 600, 10 + i), schema_check(BOOK))
        for i, b in enumerate(BOOKS[:3])
    ]
    cases += [
        Case(chat(f"{q} Answer yes or no."), params(Constraint.regex("(yes|no)"), 8, 20 + i), regex_check("yes|no"))
        for i, q in enumerate(QUESTIONS[:3])
    ]
    cases += [
        Case(chat("Pick a color."), params(Constraint.choice(COLORS), 8, 30 + i), choice_check(COLORS))
        for i in range(2)
    ]
    cases += [
        Case(chat("How heavy is a dog?"), params(Constraint.grammar(MEASURE_EBNF), 16, 40 + i), regex_check(MEASURE_RE))
        for i in range(2)
    ]
    return cases


def assert_all_valid(cases: list[Case], results: list[Any]) -> None:
    failures = []
    for case, result in zip(cases, results, strict=True):
        for choice in result.choices:
            try:
                assert choice.finish_reason is FinishReason.STOP, choice.finish_reason
                case.check(choice.text)
            except Exception as exc:  # collect every failure, not just the first
                failures.append(f"{case.params.constraint}: {choice.text!r}: {exc}")
    assert not failures, "\n".join(failures)


def test_constrained_outputs_all_validate_and_leave_plain_neighbours_unchanged(served_llm: LLM) -> None:
    plain = [chat(p) for p in PLAIN_PROMPTS]
    alone = [r.choices[0].token_ids for r in served_llm.generate(plain, UNCONSTRAINED, use_tqdm=False)]

    greedy = greedy_cases()
    sampled = sampled_cases()
    assert len(greedy) + len(sampled) >= 50
    # Plain requests sit among the constrained ones, at the front, middle and end of the batch.
    batch: list[Case | ChatPrompt] = [plain[0], *greedy[:20], plain[1], *greedy[20:], plain[2]]
    prompts = [b if isinstance(b, ChatPrompt) else b.prompt for b in batch]
    params = [UNCONSTRAINED if isinstance(b, ChatPrompt) else b.params for b in batch]
    results = served_llm.generate(prompts, params, use_tqdm=False)
    mixed = [r for b, r in zip(batch, results, strict=True) if isinstance(b, ChatPrompt)]
    assert [r.choices[0].token_ids for r in mixed] == alone[:3]
    assert_all_valid(greedy, [r for b, r in zip(batch, results, strict=True) if isinstance(b, Case)])

    results = served_llm.generate(
        [*(c.prompt for c in sampled), plain[3]], [*(c.params for c in sampled), UNCONSTRAINED], use_tqdm=False
    )
    assert results[-1].choices[0].token_ids == alone[3]
    assert_all_valid(sampled, results[:-1])
    assert len(served_llm.core.runner.grammars) == 0  # every finished request released its matcher


def test_seeded_constrained_sampling_is_reproducible_with_n_choices(served_llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, constraint=Constraint.json_schema(PERSON))
    first = served_llm.generate(chat("Invent a person."), params, use_tqdm=False)[0]
    again = served_llm.generate(chat("Invent a person."), params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    for choice in first.choices:
        assert choice.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_a_grammar_ends_the_choice_despite_ignore_eos_and_min_tokens(served_llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=50, ignore_eos=True, min_tokens=20, constraint=Constraint.regex("(yes|no)")
    )
    choice = served_llm.generate(chat("Is the sky blue?"), params, use_tqdm=False)[0].choices[0]
    assert choice.text in ("yes", "no") and choice.finish_reason is FinishReason.STOP


def test_a_stop_string_cuts_a_constrained_choice_and_releases_its_matcher(served_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, stop=(",",), constraint=Constraint.json_schema(PERSON))
    choice = served_llm.generate(chat("Describe a chef as JSON."), params, use_tqdm=False)[0].choices[0]
    assert choice.finish_reason is FinishReason.STOP and choice.matched_stop == ","
    assert len(served_llm.core.runner.grammars) == 0


def test_a_bad_spec_fails_its_request_before_anything_runs(served_llm: LLM) -> None:
    good = SamplingParams(max_tokens=4, constraint=Constraint.regex("a"))
    bad = SamplingParams(max_tokens=4, constraint=Constraint.json_schema('{"type": "nonsense"}'))
    with pytest.raises(ValidationError, match="nonsense") as info:
        served_llm.generate([chat("a"), chat("b")], [good, bad], use_tqdm=False)
    assert info.value.param == "json_schema"
    assert not served_llm.core.has_unfinished()


def test_preemption_keeps_grammar_state(served_llm: LLM) -> None:
    small = LLM(
        config=EngineConfig(
            quantization="auto",
            cache=CacheConfig(block_size=16, memory_bytes=24 * 16 * 30 * 2 * 3 * 64 * 4),  # 24 blocks
            scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=16),
        ),
        grammar_config=GrammarCompilerConfig(timeout_s=120.0),  # as the session engines: a loaded machine is slow
    )
    prompts = [chat(f"Describe {p} as JSON with name, age and occupation.") for p in PEOPLE]
    params = SamplingParams(temperature=0.0, max_tokens=120, constraint=Constraint.json_schema(PERSON))
    expected = [r.choices[0].token_ids for r in served_llm.generate(prompts, params, use_tqdm=False)]
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.core.scheduler.total_preemptions > 0
    assert [r.choices[0].token_ids for r in got] == expected
    for result in got:
        jsonschema.validate(json.loads(result.choices[0].text), PERSON)
