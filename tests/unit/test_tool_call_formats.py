"""Mistral's (both forms), the pythonic and Qwen3-Coder's tool-call parsers: canned outputs, malformed calls left
as written, streams cut at every point, the formats read off chat templates, and Mistral's 9-character ids."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from engine_server.config import TOOL_CALL_PARSERS
from engine_server.tools import ToolFormat, ToolTemplate
from engine_server.tools.parsers import ParsedCall, ParseStep
from engine_server.tools.parsing import make_parser, parse_tool_calls
from engine_server.tools.template import FORMAT_ALIASES
from engine_server.tools.types import new_call_id

NAMES = ("get_weather", "search")
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "filters": {"type": "object"}, "safe": {"type": "boolean"}},
    },
}


def _call(name: str, **arguments: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments))


def _streamed(text: str, fmt: ToolFormat, cuts: list[int]) -> ParseStep:
    parser = make_parser(fmt, NAMES, SCHEMAS)
    total = ParseStep()
    for start, end in itertools.pairwise([0, *sorted(cuts), len(text)]):
        total.extend(parser.feed(text[start:end]))
    total.extend(parser.finish())
    return total


MISTRAL = ToolFormat.MISTRAL
PYTHONIC = ToolFormat.PYTHONIC
CODER = ToolFormat.QWEN3_CODER
CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
CASES = [
    # Mistral before v11: a JSON list after the marker, content before it.
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', MISTRAL, "",
     [_call("get_weather", city="Paris")]),
    ('Let me look.\n[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "search", "arguments": {"query": "news"}}]', MISTRAL, "Let me look.",
     [_call("get_weather", city="Paris"), _call("search", query="news")]),
    # v11: name[ARGS]{...} per call (either Mistral format reads both forms).
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"query": "a [ARGS] b"}', MISTRAL,
     "", [_call("get_weather", city="Paris"), _call("search", query="a [ARGS] b")]),
    ("No tools needed.", MISTRAL, "No tools needed.", []),
    # Pythonic, bare and between Llama 4's markers.
    ('[get_weather(city="Boston"), search(query="x", filters={"lang": "en"}, safe=True)]', PYTHONIC, "",
     [_call("get_weather", city="Boston"), _call("search", query="x", filters={"lang": "en"}, safe=True)]),
    ('<|python_start|>[search(query="it\'s")]<|python_end|>', PYTHONIC, "", [_call("search", query="it's")]),
    ("The answer is 4.", PYTHONIC, "The answer is 4.", []),
    ('[search(query="x", safe=true, filters=null)]', PYTHONIC, "",  # JSON's spelling of the literals
     [_call("search", query="x", safe=True, filters=None)]),
    # Qwen3-Coder: values typed by the schema (days an integer, city a string even when it looks like a number).
    (CODER_CALL, CODER, "", [_call("get_weather", city="San Francisco", days=3)]),
    ("Checking.\n" + CODER_CALL + "\n<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
     '<parameter=filters>\n{"lang": "en"}\n</parameter>\n<parameter=safe>\nfalse\n</parameter>\n'
     "</function>\n</tool_call>\nDone.", CODER, "Checking.\nDone.",
     [_call("get_weather", city="San Francisco", days=3), _call("search", query="42", filters={"lang": "en"},
                                                                safe=False)]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n</function>"
     "\n</tool_call>", CODER, "", [_call("get_weather", city="line one\nline two")]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "fmt", "content", "calls"), CASES)
def test_calls_and_content(text: str, fmt: ToolFormat, content: str, calls: list[ParsedCall]) -> None:
    step = parse_tool_calls(text, fmt, NAMES, SCHEMAS)
    assert (step.content, step.calls) == (content, calls)


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}', MISTRAL),  # cut off
        ('[TOOL_CALLS] [{"name": "delete_all", "arguments": {}}]', MISTRAL),  # not a given tool
        ('[TOOL_CALLS] [{"name": "search", "arguments": {}}] and more', MISTRAL),
        ('[TOOL_CALLS]search{"query": "x"}', MISTRAL),  # v11 without [ARGS]
        ('[TOOL_CALLS]search[ARGS]["x"]', MISTRAL),  # arguments not an object
        ("[1, 2, 3]", PYTHONIC),
        ('[search("positional")]', PYTHONIC),
        ("[search(query=open('f'))]", PYTHONIC),  # not a literal
        ("[search(**kwargs)]", PYTHONIC),
        ('[delete_all(path="/")]', PYTHONIC),
        ('[get_weather(city="Boston")', PYTHONIC),  # cut off
        ("<tool_call>\n<function=delete_all>\n</function>\n</tool_call>", CODER),
        ("<tool_call>\n<parameter=city>\nx\n</parameter>\n</tool_call>", CODER),  # no function
        ("<tool_call>\n<function=search>\nstray<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",
         CODER),
    ],
)  # fmt: skip
def test_malformed_calls_stay_in_the_content_as_written(text: str, fmt: ToolFormat) -> None:
    assert parse_tool_calls(text, fmt, NAMES, SCHEMAS) == ParseStep(text)


@pytest.mark.parametrize(("text", "fmt", "content", "calls"), CASES)
def test_a_stream_cut_anywhere_parses_like_the_whole_text(
    text: str, fmt: ToolFormat, content: str, calls: list[ParsedCall]
) -> None:
    whole = parse_tool_calls(text, fmt, NAMES, SCHEMAS)
    for cut in range(1, len(text)):
        assert _streamed(text, fmt, [cut]) == whole, cut
    assert _streamed(text, fmt, list(range(1, len(text)))) == whole  # one character at a time


def test_content_before_the_calls_streams_and_the_calls_are_held() -> None:
    parser = make_parser(MISTRAL, NAMES)
    assert parser.feed("Sure, one moment. ").content == "Sure, one moment."
    assert parser.feed("[TOOL_") == ParseStep()  # a partial marker is held
    assert parser.feed('CALLS]search[ARGS]{"query": "x"}') == ParseStep()
    assert parser.finish() == ParseStep(calls=[_call("search", query="x")])
    pythonic = make_parser(PYTHONIC, NAMES)
    assert pythonic.feed("The answer").content == "The answer"  # plain text is not held


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{{ '[TOOL_CALLS] [' }}{% for tool_call in message.tool_calls %}{{ tool_call | tojson }}", MISTRAL),
        ("{{ '[TOOL_CALLS]' + tool_call.name + '[ARGS]' + arguments }}", ToolFormat.MISTRAL_V11),
        ("<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ name }}>", CODER),
        ("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>", ToolFormat.HERMES),
        ("{{ '<|python_start|>' }}{% if message.role == 'ipython' %}", PYTHONIC),
        ("{% if message.role == 'ipython' %}<|python_tag|>", ToolFormat.LLAMA3_JSON),
    ],
)
def test_the_format_is_read_off_the_chat_template(template: str, fmt: ToolFormat) -> None:
    assert ToolTemplate.detect(template).format is fmt


def test_a_named_parser_overrides_the_template() -> None:
    hermes_template = "<tool_call>\n{{ tool_call | tojson }}\n</tool_call>"
    assert ToolTemplate.detect(hermes_template, "pythonic").format is PYTHONIC
    assert ToolTemplate.detect(hermes_template, "auto").format is ToolFormat.HERMES
    assert {f.value for f in ToolFormat} | set(FORMAT_ALIASES) | {"auto"} == set(TOOL_CALL_PARSERS)  # every format


def test_mistral_call_ids_are_nine_letters_or_digits_and_others_keep_openais_shape() -> None:
    for fmt in (ToolFormat.MISTRAL, ToolFormat.MISTRAL_V11):
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", new_call_id(fmt)) for _ in range(50))
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id(ToolFormat.HERMES))
