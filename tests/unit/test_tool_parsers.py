"""Tool-call parsers: Hermes and Llama 3 JSON, malformed calls left as content, and streams split anywhere."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from engine_server.tools.parsers import HermesParser, ParsedCall, ParseStep
from engine_server.tools.parsing import make_parser, parse_tool_calls
from engine_server.tools.template import ToolFormat

NAMES = ("get_weather", "search")
HERMES = ToolFormat.HERMES
LLAMA3 = ToolFormat.LLAMA3_JSON


def _call(name: str, **arguments: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments))


def _block(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _streamed(text: str, fmt: ToolFormat, cuts: list[int]) -> ParseStep:
    """Feed `text` cut at `cuts`, then finish; content joined, calls in order."""
    parser = make_parser(fmt, NAMES)
    total = ParseStep()
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in itertools.pairwise(bounds):
        total.extend(parser.feed(text[start:end]))
    total.extend(parser.finish())
    return total


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (_block("get_weather", city="Paris"), "", [_call("get_weather", city="Paris")]),
        (
            _block("get_weather", city="Paris") + "\n" + _block("search", query="news", max_results=3),
            "",
            [_call("get_weather", city="Paris"), _call("search", query="news", max_results=3)],
        ),
        ("Checking.\n" + _block("search", query="x") + "\nDone.", "Checking.\nDone.", [_call("search", query="x")]),
        # No closing tag: the output ended right after a complete call.
        ('<tool_call>\n{"name": "search", "arguments": {"query": "q"}}', "", [_call("search", query="q")]),
        # "parameters" instead of "arguments", and arguments sent as a JSON string.
        ('<tool_call>{"name": "search", "parameters": {"query": "q"}}</tool_call>', "", [_call("search", query="q")]),
        (
            '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>',
            "",
            [_call("search", query="q")],
        ),
        # A closing tag inside a JSON string does not end the call.
        (_block("search", query="a </tool_call> b"), "", [_call("search", query="a </tool_call> b")]),
        ("\n" + _block("search", query="x") + "\n\nSee above. \n", "See above.", [_call("search", query="x")]),
        ("Just an answer, no tools.\n", "Just an answer, no tools.\n", []),
    ],
)
def test_hermes_calls_and_content(text: str, content: str, calls: list[ParsedCall]) -> None:
    step = parse_tool_calls(text, HERMES, NAMES)
    assert (step.content, step.calls) == (content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not a known function
        '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"arguments": {"query": "q"}}</tool_call>',  # no name
        '<tool_call>\n{"name": "search", "arguments": {"query": "cut sh',  # cut off by max_tokens
        "before  <tool_call>[]</tool_call>  after",
    ],
)
def test_malformed_calls_stay_in_the_content_as_written(text: str) -> None:
    step = parse_tool_calls(text, HERMES, NAMES)
    assert step.calls == [] and step.content == text


def test_a_malformed_call_next_to_a_valid_one() -> None:
    text = "<tool_call>oops</tool_call>\n" + _block("search", query="q")
    step = parse_tool_calls(text, HERMES, NAMES)
    assert step.calls == [_call("search", query="q")]
    assert step.content == "<tool_call>oops</tool_call>"


def test_any_name_is_accepted_without_a_name_list() -> None:
    step = parse_tool_calls(_block("anything", x=1), HERMES, None)
    assert step.calls == [_call("anything", x=1)]


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "search", "parameters": {"query": "q"}}', [_call("search", query="q")]),
        ('<|python_tag|>{"name": "search", "parameters": {"query": "q"}}', [_call("search", query="q")]),
        ('  {"name": "search", "arguments": {"query": "q"}}\n', [_call("search", query="q")]),
        (
            '{"name": "search", "parameters": {"query": "q"}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
            [_call("search", query="q"), _call("get_weather", city="Oslo")],
        ),
    ],
)
def test_llama3_json_calls(text: str, calls: list[ParsedCall]) -> None:
    step = parse_tool_calls(text, LLAMA3, NAMES)
    assert (step.content, step.calls) == ("", calls)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "search", "parameters": {"query": "q"}} and then some words',
        '{"city": "Paris"}',  # JSON, but not a call
        '{"name": "search", "parameters": {"query": "cut',
        '{"name": "launch_rockets", "parameters": {}}',
    ],
)
def test_llama3_output_that_is_not_wholly_calls_is_content(text: str) -> None:
    step = parse_tool_calls(text, LLAMA3, NAMES)
    assert (step.content, step.calls) == (text, [])


def test_llama3_plain_answers_stream_at_once_and_json_is_held() -> None:
    parser = make_parser(LLAMA3, NAMES)
    assert parser.feed("Sure").content == "Sure"
    held = make_parser(LLAMA3, NAMES)
    assert held.feed('{"name": "sea').content == ""
    assert held.feed('rch", "parameters": {}}').content == ""
    assert held.finish().calls == [ParsedCall("search", "{}")]


def test_a_partial_opening_tag_is_held_back_and_released_when_it_is_not_one() -> None:
    parser = HermesParser(NAMES)
    assert parser.feed("Hello <tool").content == "Hello"
    step = parser.feed("_call>")
    assert step.content == "" and step.calls == []
    assert parser.feed(json.dumps({"name": "search", "arguments": {}})).calls == []  # waits for the closing tag
    assert parser.feed("</tool_call>").calls == [ParsedCall("search", "{}")]
    other = HermesParser(NAMES)
    assert other.feed("a <tool").content == "a"
    assert other.feed("box> b").content == " <toolbox> b"


CASES = [
    ("Hm.\n" + _block("get_weather", city="Paris", unit="celsius") + "\n" + _block("search", query="x y"), HERMES),
    (_block("search", query='quote " and </tool_call> inside') + "\ntrailing words", HERMES),
    ("no calls at all, just < and <tool and </tool_call> text", HERMES),
    ("<tool_call>{broken</tool_call> then " + _block("search", query="ok"), HERMES),
    ('<|python_tag|>{"name": "search", "parameters": {"query": "q"}}', LLAMA3),
    ("plain answer with { braces }", LLAMA3),
]


@pytest.mark.parametrize(("text", "fmt"), CASES)
def test_a_stream_split_anywhere_parses_like_the_whole_text(text: str, fmt: ToolFormat) -> None:
    whole = parse_tool_calls(text, fmt, NAMES)
    for cut in range(len(text) + 1):
        assert _streamed(text, fmt, [cut]) == whole, cut
    rng = random.Random(0)
    for _ in range(50):
        cuts = rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(1, 12)))
        assert _streamed(text, fmt, cuts) == whole, cuts
    assert _streamed(text, fmt, list(range(len(text)))) == whole  # one character at a time
