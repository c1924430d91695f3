"""The grammar of forced tool calls: every sentence it allows parses into a schema-valid call of an allowed tool."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from engine_server.errors import ValidationError
from engine_server.frontend import ChatPrompt, InputProcessor
from engine_server.sampling_params import SamplingParams
from engine_server.structured import Constraint, ConstraintKind
from engine_server.structured.compiler import GrammarCompilerConfig, XGrammarCompile
from engine_server.tokenizer.chat import ChatMessage, ChatTool
from engine_server.tools import ToolChoice, ToolChoiceMode, ToolFormat
from engine_server.tools.grammar import forced_call_constraint
from engine_server.tools.parsing import parse_tool_calls
from engine_server.tools.writing import call_text

# One token per printable ASCII character (plus newline), DeepSeek's markers (not ASCII) whole and after their "<"
# (a walk that took the "<" alone goes on), and an end token: a walk can spell any string of them.
DEEPSEEK_MARKERS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"]  # fmt: skip
VOCAB = ["<end>", "\n", *(chr(c) for c in range(32, 127)), *DEEPSEEK_MARKERS, *(m[1:] for m in DEEPSEEK_MARKERS)]
END = 0
WEATHER = ChatTool(
    "get_weather",
    "Current weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
)
SEARCH = ChatTool(
    "search",
    "Search the web",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 12},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
            "filters": {
                "type": "object",
                "properties": {
                    "safe": {"type": "boolean"},
                    "langs": {"type": "array", "items": {"enum": ["en", "fr"]}, "maxItems": 2},
                },
            },
        },
        "required": ["query"],
    },
)
NO_ARGS = ChatTool("now", "The current time")
TOOLS = [WEATHER, SEARCH, NO_ARGS]
TAGGED = [ToolFormat.GLM45, ToolFormat.DEEPSEEK_V3, ToolFormat.DEEPSEEK_V31, ToolFormat.KIMI_K2, ToolFormat.MINIMAX_M2,
          ToolFormat.SEED_OSS, ToolFormat.NEMOTRON, ToolFormat.LFM2, ToolFormat.GRANITE, ToolFormat.COHERE,
          ToolFormat.GEMMA4, ToolFormat.OLMO3]  # fmt: skip
SCHEMAS = {t.name: t.parameters or {"type": "object", "properties": {}} for t in TOOLS}


@pytest.fixture(scope="module")
def compile_fn() -> XGrammarCompile:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[END])
    return XGrammarCompile(info, GrammarCompilerConfig())


def _walk(grammar: xgr.CompiledGrammar, rng: random.Random, max_steps: int = 400) -> str | None:
    """A random sentence of the grammar (ends when the end token is picked), or None if it ran too long."""
    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, len(VOCAB))
    text = ""
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(mask)
        words = mask[0].numpy().view(np.uint32)
        allowed = [i for i in range(len(VOCAB)) if (words[i // 32] >> (i % 32)) & 1]
        others = [i for i in allowed if i != END]
        if END in allowed and (not others or rng.random() < 0.3):
            return text
        token = rng.choice(others)
        assert matcher.accept_token(token)
        text += VOCAB[token]
    return None


@pytest.mark.parametrize(
    ("choice", "fmt", "names"),
    [
        (ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.HERMES, {"get_weather", "search", "now"}),
        (ToolChoice.function("search"), ToolFormat.HERMES, {"search"}),
        (ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.LLAMA3_JSON, {"get_weather", "search", "now"}),
        (ToolChoice.function("get_weather"), ToolFormat.LLAMA3_JSON, {"get_weather"}),
        (ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.MISTRAL, {"get_weather", "search", "now"}),
        (ToolChoice.function("search"), ToolFormat.MISTRAL_V11, {"search"}),
        (ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.MISTRAL_V11, {"get_weather", "search", "now"}),
        (ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.QWEN3_CODER, {"get_weather", "search", "now"}),
        (ToolChoice.function("search"), ToolFormat.QWEN3_CODER, {"search"}),
        (ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.PYTHONIC, {"get_weather", "search", "now"}),
        *((ToolChoice(ToolChoiceMode.REQUIRED), fmt, {"get_weather", "search", "now"}) for fmt in TAGGED),
        *((ToolChoice.function("search"), fmt, {"search"}) for fmt in TAGGED),
    ],
)
def test_every_sentence_is_exactly_one_schema_valid_call(
    compile_fn: XGrammarCompile, choice: ToolChoice, fmt: ToolFormat, names: set[str]
) -> None:
    constraint = forced_call_constraint(TOOLS, choice, fmt)
    assert constraint.kind is ConstraintKind.GRAMMAR
    grammar = compile_fn(constraint)
    rng = random.Random(7)
    seen: set[str] = set()
    walks = [w for w in (_walk(grammar, rng) for _ in range(60)) if w is not None]
    assert len(walks) >= 50
    for text in walks:
        step = parse_tool_calls(text, fmt, [t.name for t in TOOLS], SCHEMAS)
        assert step.content == "" and len(step.calls) == 1, text
        call = step.calls[0]
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
        seen.add(call.name)
    assert seen == names  # every allowed tool is reachable


def _accepts(compile_fn: XGrammarCompile, constraint: Constraint, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compile_fn(constraint))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("fmt", [f for f in ToolFormat if f is not ToolFormat.HARMONY])
def test_the_grammar_writes_a_call_as_the_family_template_lays_it_out(
    compile_fn: XGrammarCompile, fmt: ToolFormat
) -> None:
    named = forced_call_constraint(TOOLS, ToolChoice.function("get_weather"), fmt)
    assert _accepts(compile_fn, named, call_text(fmt, "get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert not _accepts(compile_fn, named, call_text(fmt, "search", {"query": "Oslo"}))


def test_the_hermes_call_is_written_as_the_fallback_prompt_teaches(compile_fn: XGrammarCompile) -> None:
    named = forced_call_constraint(TOOLS, ToolChoice.function("get_weather"), ToolFormat.HERMES)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    assert _accepts(compile_fn, named, good)
    assert not _accepts(compile_fn, named, good.replace("get_weather", "search"))
    assert not _accepts(compile_fn, named, good.replace('"unit"', '"extra": 1, "unit"'))  # strict: no extra keys
    assert not _accepts(compile_fn, named, good + "\n" + good)  # exactly one call
    parallel = forced_call_constraint(TOOLS, ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.HERMES, parallel=True)
    assert _accepts(compile_fn, parallel, good + "\n" + good)


def test_the_same_tools_give_the_same_grammar_text_so_the_compile_cache_hits() -> None:
    first = forced_call_constraint(TOOLS, ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.HERMES)
    assert first == forced_call_constraint(list(TOOLS), ToolChoice(ToolChoiceMode.REQUIRED), ToolFormat.HERMES)


def nested_object_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("tool", "choice", "param"),
    [
        (WEATHER, ToolChoice.function("search"), "tool_choice"),
        (ChatTool("bad", "", {"type": "object", "properties": {"x": {"type": "no-such-type"}}}), None, "tools"),
        (ChatTool("bad", "", {"type": "string"}), None, "tools"),
        (ChatTool("deep", "", nested_object_schema(64)), None, "tools"),  # 129 levels: over MAX_SCHEMA_DEPTH
    ],
)
def test_unusable_tools_or_choices_are_refused(tool: ChatTool, choice: ToolChoice | None, param: str) -> None:
    with pytest.raises(ValidationError) as error:
        forced_call_constraint([tool], choice or ToolChoice.function(tool.name), ToolFormat.HERMES)
    assert error.value.param == param


def test_prepare_turns_a_forced_choice_into_the_constraint(smollm2_tokenizer: Any) -> None:
    inputs = InputProcessor(smollm2_tokenizer, 49152, 2048, eos_token_ids=[2])
    messages = [ChatMessage("user", "Weather in Oslo?")]
    forced = inputs.prepare(ChatPrompt(messages, TOOLS, tool_choice=ToolChoice.function("now")), SamplingParams())
    assert forced.params.constraint == forced_call_constraint(TOOLS, ToolChoice.function("now"), ToolFormat.HERMES)
    assert forced.tool_parsing is not None and forced.tool_parsing.names == {"now"}
    auto = inputs.prepare(ChatPrompt(messages, TOOLS), SamplingParams())
    assert auto.params.constraint is None and auto.tool_parsing is not None
    assert auto.tool_parsing.names == {"get_weather", "search", "now"}
    none = inputs.prepare(ChatPrompt(messages, TOOLS, tool_choice=ToolChoice(ToolChoiceMode.NONE)), SamplingParams())
    assert none.tool_parsing is None and none.params.constraint is None
    with pytest.raises(ValidationError) as error:
        inputs.prepare(
            ChatPrompt(messages, TOOLS, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)),
            SamplingParams(constraint=Constraint.json_object()),
        )
    assert error.value.param == "tool_choice"


def test_a_mistral_template_keeps_special_tokens_in_the_text_so_its_marker_is_seen(smollm2_tokenizer: Any) -> None:
    mistral = copy.copy(smollm2_tokenizer)
    mistral.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
        "[/AVAILABLE_TOOLS]{% endif %}{{ '[TOOL_CALLS] [' if false }}"
    )
    inputs = InputProcessor(mistral, 49152, 2048, eos_token_ids=[2])
    messages = [ChatMessage("user", "Weather in Oslo?")]
    prepared = inputs.prepare(ChatPrompt(messages, TOOLS), SamplingParams())
    assert prepared.tool_parsing is not None and prepared.tool_parsing.format is ToolFormat.MISTRAL
    assert prepared.params.skip_special_tokens is False
    plain = inputs.prepare(ChatPrompt(messages, []), SamplingParams())  # no tools: nothing changes
    assert plain.params.skip_special_tokens is True
