"""A constraint after a thinking model's reasoning: the reasoning is free, what follows its </think> (or its family's
closing tag: Seed-OSS's </seed:think>, Magistral's [/THINK]) is the constraint's language. Random walks of the
compiled grammar, split as the engine splits them, always leave an answer that satisfies the constraint."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from engine_server.reasoning import (
    COHERE_THINK,
    MISTRAL_THINK,
    SEED_THINK,
    THINK,
    ReasoningStart,
    ReasoningStream,
    ReasoningTags,
)
from engine_server.structured import Constraint
from engine_server.structured.compiler import GrammarCompilerConfig, XGrammarCompile

# Every printable ASCII character, newline, and each family's two tags as tokens of their own (as Qwen3's vocabulary
# has them), so that a walk may think, close its thought and answer within a few hundred steps.
VOCAB = ["<end>", "\n", *(chr(c) for c in range(32, 127))]
VOCAB += [tag for tags in (THINK, SEED_THINK, MISTRAL_THINK, COHERE_THINK) for tag in (tags.open, tags.close)]
VOCAB += list(COHERE_THINK.answer or ())
END, OPEN, CLOSE = 0, VOCAB.index("<think>"), VOCAB.index("</think>")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def compile_fn() -> XGrammarCompile:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[END])
    return XGrammarCompile(info, GrammarCompilerConfig())


def _walk(
    grammar: xgr.CompiledGrammar, rng: random.Random, max_steps: int = 300, tags: ReasoningTags = THINK
) -> str | None:
    """A random sentence (one of `tags` is picked often when allowed), or None if it ran too long."""
    opening, closing = VOCAB.index(tags.open), VOCAB.index(tags.close)
    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, len(VOCAB))
    text = ""
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(mask)
        words = mask[0].numpy().view(np.uint32)
        allowed = [i for i in range(len(VOCAB)) if (words[i // 32] >> (i % 32)) & 1]
        if END in allowed and (len(allowed) == 1 or rng.random() < 0.3):
            return text
        marks = [t for t in (opening, closing) if t in allowed]
        others = [i for i in allowed if i != END]
        token = marks[0] if marks and rng.random() < (0.5 if marks[0] == opening else 0.08) else rng.choice(others)
        assert matcher.accept_token(token)
        text += VOCAB[token]
    return None


def _split(text: str, start: ReasoningStart, tags: ReasoningTags = THINK) -> tuple[str, str]:
    stream = ReasoningStream(start, tags)
    reasoning, content = stream.feed(text)
    held_reasoning, held_content = stream.finish()
    return reasoning + held_reasoning, content + held_content


def _tags(tags: ReasoningTags) -> tuple[str, ...]:
    return (tags.open, tags.close, *(tags.answer or ()))


@pytest.mark.parametrize("start", [ReasoningStart.INSIDE, ReasoningStart.IF_OPENED])
@pytest.mark.parametrize(("kind", "tags"), [("regex", THINK), ("json", THINK), ("json", SEED_THINK),
                                            ("regex", MISTRAL_THINK), ("json", COHERE_THINK)])  # fmt: skip
def test_the_answer_after_any_reasoning_satisfies_the_constraint(
    compile_fn: XGrammarCompile, start: ReasoningStart, kind: str, tags: ReasoningTags
) -> None:
    constraint = Constraint.regex("(yes|no)") if kind == "regex" else Constraint.json_schema(PERSON)
    grammar = compile_fn(constraint.after(start.value, _tags(tags)))
    rng = random.Random(11)
    walks = [w for w in (_walk(grammar, rng, tags=tags) for _ in range(80)) if w is not None]
    assert len(walks) >= 40
    thought = 0
    for text in walks:
        reasoning, answer = _split(text, start, tags)
        if kind == "regex":
            assert re.fullmatch("(yes|no)", answer), text
        else:
            jsonschema.validate(json.loads(answer), PERSON)
        thought += bool(reasoning)
    assert thought >= 10  # walks do think, with text of their own
    if start is ReasoningStart.IF_OPENED:
        assert thought < len(walks)  # and some answer at once


def test_without_a_reasoning_the_constraint_is_the_whole_output(compile_fn: XGrammarCompile) -> None:
    matcher = xgr.GrammarMatcher(compile_fn(Constraint.regex("(yes|no)")))
    assert not matcher.accept_token(OPEN)


@pytest.mark.parametrize("tags", [THINK, MISTRAL_THINK])
def test_the_reasoning_ends_at_the_first_closing_tag_whatever_comes_before_it(
    compile_fn: XGrammarCompile, tags: ReasoningTags
) -> None:
    """The splitter ends the reasoning at the tag's first occurrence; so does the grammar, also right after a
    character that starts the tag ("a<</think>"): the text after it is the answer, which the constraint holds."""
    grammar = compile_fn(Constraint.regex("(yes|no)").after("inside", (tags.open, tags.close)))
    first = tags.close[0]

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(f"a{first}{tags.close}yes") and _split(f"a{first}{tags.close}yes", ReasoningStart.INSIDE, tags) == (
        f"a{first}",
        "yes",
    )
    assert not accepts(f"a{first}{tags.close}x{tags.close}yes")  # "x</think>yes" is no answer of the constraint


def test_a_cohere_answer_may_stand_in_its_markers(compile_fn: XGrammarCompile) -> None:
    grammar = compile_fn(Constraint.regex("(yes|no)").after("if_opened", _tags(COHERE_THINK)))
    for text in ("<|START_THINKING|>x<|END_THINKING|><|START_RESPONSE|>yes<|END_RESPONSE|>", "<|START_RESPONSE|>no"
                 "<|END_RESPONSE|>", "yes"):  # fmt: skip
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(text) and matcher.is_completed(), text
    matcher = xgr.GrammarMatcher(grammar)
    assert not (matcher.accept_string("<|START_RESPONSE|>maybe<|END_RESPONSE|>") and matcher.is_completed())
