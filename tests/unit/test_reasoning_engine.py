"""Reasoning split off through the offline engine on the embedded model, made to think by a grammar: the
reasoning, the answer and the reasoning tokens, streamed and whole, and tool calls read from the answer only."""

from __future__ import annotations

import json

import pytest

from engine_server import LLM, ChatPrompt, SamplingParams
from engine_server.output.types import FinishReason
from engine_server.structured import Constraint
from engine_server.tokenizer.chat import ChatMessage, ChatTool
from engine_server.tools import ToolChoice, ToolChoiceMode

pytestmark = pytest.mark.slow  # the embedded model

THOUGHT = "\nTwo and two make four.\n"
# Whatever the model would say, it says this: a reasoning, then an answer ("none": the grammar spells the whole
# output, reasoning included, where the engine would otherwise constrain only the answer after it).
SCRIPT = Constraint.choice([f"<think>{THOUGHT}</think>\n\nIt is 4."]).after("none")
# Greedy: a grammar's string may be spelled in more or fewer tokens; sampled spellings could outrun max_tokens.
SCRIPTED = SamplingParams(max_tokens=128, temperature=0.0, constraint=SCRIPT)
QUESTION = [ChatMessage("user", "What is 2 + 2?")]


@pytest.fixture
def thinking_llm(served_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> LLM:
    """The embedded model's engine with reasoning split off (its own template does not mention <think>)."""
    monkeypatch.setattr(served_llm.inputs, "splits_reasoning", True)
    return served_llm


def test_reasoning_comes_apart_from_the_answer_and_its_tokens_are_counted(thinking_llm: LLM) -> None:
    (result,) = thinking_llm.generate([ChatPrompt(QUESTION)], SCRIPTED, use_tqdm=False)
    (choice,) = result.choices
    assert (choice.reasoning_text, choice.text) == (THOUGHT, "It is 4.")
    # The reasoning's tokens: up to the one that completes </think> (the grammar spells the tags its own way).
    count, decode = result.usage.reasoning_tokens, thinking_llm.tokenizer.decode
    assert 0 < count < result.usage.completion_tokens == len(choice.token_ids)
    assert decode(choice.token_ids[:count]).endswith("</think>")
    assert "</think>" not in decode(choice.token_ids[: count - 1])


def test_cut_inside_the_reasoning_there_is_no_content(thinking_llm: LLM) -> None:
    cut = SamplingParams(max_tokens=9, temperature=0.0, constraint=SCRIPT)
    (result,) = thinking_llm.generate([ChatPrompt(QUESTION)], cut, use_tqdm=False)
    (choice,) = result.choices
    assert choice.finish_reason is FinishReason.LENGTH and choice.text == "" and choice.reasoning_text
    assert result.usage.reasoning_tokens == result.usage.completion_tokens


def test_without_the_split_the_tags_stay_in_the_text(served_llm: LLM) -> None:
    (result,) = served_llm.generate([ChatPrompt(QUESTION)], SCRIPTED, use_tqdm=False)
    assert result.choices[0].text.startswith("<think>") and result.choices[0].reasoning_text == ""
    assert result.usage.reasoning_tokens == 0


def test_tool_calls_are_read_from_the_answer_not_the_reasoning(thinking_llm: LLM) -> None:
    tool = ChatTool("add", "Add two numbers", {"type": "object", "properties": {"a": {"type": "integer"}}})
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    script = Constraint.choice([f"<think>I could write {call} here.</think>\n{call}"]).after("none")
    prompt = ChatPrompt(QUESTION, [tool], tool_choice=ToolChoice(ToolChoiceMode.AUTO))
    params = SamplingParams(max_tokens=256, temperature=0.0, constraint=script)
    (result,) = thinking_llm.generate([prompt], params, use_tqdm=False)
    (choice,) = result.choices
    assert choice.reasoning_text == f"I could write {call} here."
    assert choice.text == "" and [(c.name, json.loads(c.arguments_json)) for c in choice.tool_calls] == [
        ("add", {"a": 2})
    ]


def test_a_json_schema_constrains_the_answer_after_the_reasoning(thinking_llm: LLM) -> None:
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"],
              "additionalProperties": False}  # fmt: skip
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=s, constraint=Constraint.json_schema(schema))
              for s in range(6)]  # fmt: skip
    for result in thinking_llm.generate([ChatPrompt(QUESTION)] * 6, params, use_tqdm=False):
        (choice,) = result.choices
        if choice.finish_reason is FinishReason.STOP:
            assert json.loads(choice.text).keys() == {"sum"}, (choice.reasoning_text, choice.text)
