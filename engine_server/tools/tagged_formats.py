"""Tool-call parsers for the formats the model families write with their own marker tokens, under the contract of
`tools.parsers` (each a block parser: text outside the blocks streams, a block is held until it closes or the
output ends, and a block that is not calls stays in the content as written):

- GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`, whitespace
  allowed between the parts (the 4.5 template writes a newline after the name and after each part), each value raw
  text read by the parameter's schema (`call_formats.typed_value`).
- DeepSeek V3 / R1 and V3.1: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>` ...
  `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`. A call is `NAME<｜tool▁sep｜>{JSON}` (V3.1) or
  `function<｜tool▁sep｜>NAME` and the JSON in a json code fence on the next lines (V3, R1); one parser reads both.
- Kimi K2: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>
  {JSON}<|tool_call_end|>`, then `<|tool_calls_section_end|>`. The id the model wrote (`functions.NAME:N`) is the
  call's id: Kimi's template writes a call sent back by its id, so the model reads back what it wrote.
- MiniMax-M2: `<minimax:tool_call>` blocks of one or more `<invoke name="NAME">` elements, each of
  `<parameter name="k">v</parameter>` elements (values as GLM's).
- Seed-OSS: Qwen3-Coder's `<function=NAME><parameter=k>v</parameter></function>` in `<seed:tool_call>` blocks.
- Nemotron (Nano 2, Nemotron-H, Llama-Nemotron): `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`.
- LFM2: `<|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>`, pythonic calls (a JSON list of calls read too).
- Granite 3: `<|tool_call|>[{"name": ..., "arguments": {...}}]`, a JSON list from the marker to the end of the output
  (Mistral's parser with Granite's marker).
- Command R7B / Command A (Cohere): `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}},
  ...]<|END_ACTION|>`.
- OLMo 3: `<function_calls>` blocks of pythonic calls, one a line, without the list's brackets.
- Gemma 4: `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, once per call, in Gemma's own literals (`gemma_json`):
  strings between `<|"|>` quotes, keys bare, numbers, true / false, nested `{...}` and `[...]`.
Between the elements of a block only whitespace may stand.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from engine_server.tools.call_formats import (
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
    json_list_calls,
    typed_value,
)
from engine_server.tools.parsers import JSON_ERRORS, HermesParser, ParsedCall

GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
DEEPSEEK_CALLS, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_CALL_END, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_CALLS, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_CALL_END, KIMI_ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
MINIMAX_CALLS, MINIMAX_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
SEED_CALLS, SEED_CALLS_END = "<seed:tool_call>", "</seed:tool_call>"
NEMOTRON_CALLS, NEMOTRON_CALLS_END = "<TOOLCALL>", "</TOOLCALL>"
LFM2_CALLS, LFM2_CALLS_END = "<|tool_call_start|>", "<|tool_call_end|>"
GRANITE_CALLS = "<|tool_call|>"
COHERE_CALLS, COHERE_CALLS_END = "<|START_ACTION|>", "<|END_ACTION|>"
OLMO3_CALLS, OLMO3_CALLS_END = "<function_calls>", "</function_calls>"
GEMMA_CALL, GEMMA_CALL_END, GEMMA_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_GEMMA_WORD = re.compile(r'[^\s{}\[\],:<"]+')
_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_GEMMA_LITERALS = {"true": "true", "false": "false", "null": "null", "True": "true", "False": "false", "None": "null"}

_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_INVOKE = re.compile(r"\s*<invoke name=([^>\n]+)>(.*?)</invoke>", re.DOTALL)
_NAMED_PARAMETER = re.compile(r"\s*<parameter name=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_DEEPSEEK_FENCE = re.compile(r"\s*```(?:json)?\n(.*)\n```\s*", re.DOTALL)
_KIMI_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")


def _elements(body: str, begin: str, end: str) -> list[str] | None:
    """The insides of the `begin`...`end` elements that make up `body` (whitespace between them), or None when
    anything else stands there or an element does not close."""
    insides: list[str] = []
    pos = 0
    while body[pos:].strip():
        start = body.find(begin, pos)
        if start < 0 or body[pos:start].strip():
            return None
        stop = body.find(end, start + len(begin))
        if stop < 0:
            return None
        insides.append(body[start + len(begin) : stop])
        pos = stop + len(end)
    return insides


def _every_call(insides: list[str] | None, read: Callable[[str], ParsedCall | None]) -> list[ParsedCall]:
    """The call `read` makes of each element's inside, or [] when there are none or one is not a call."""
    calls = [read(inside) for inside in insides or ()]
    return [] if not calls or None in calls else [c for c in calls if c is not None]


def _pairs(pattern: re.Pattern[str], text: str) -> list[tuple[str, str]] | None:
    """The (key, value) groups of `pattern`'s matches that make up `text` back to back (trailing whitespace
    allowed), or None when anything else stands between or after them."""
    pairs: list[tuple[str, str]] = []
    pos = 0
    while text[pos:].strip():
        match = pattern.match(text, pos)
        if match is None:
            return None
        pairs.append((match.group(1), match.group(2)))
        pos = match.end()
    return pairs


def _unquoted(name: str) -> str:
    name = name.strip()
    return name[1:-1] if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'" else name


class _SchemaTyped(HermesParser):
    """A block parser whose values are raw text typed by each tool's parameter schema."""

    json_body = False  # values are raw text: no strings to skip

    def __init__(
        self, names: Iterable[str] | None = None, schemas: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        super().__init__(names)
        self.schemas = dict(schemas or {})

    def typed_call(self, name: str, pairs: list[tuple[str, str]]) -> ParsedCall | None:
        properties = self.schemas.get(name, {}).get("properties", {})
        arguments = {key.strip(): typed_value(value, properties.get(key.strip())) for key, value in pairs}
        return self.call_from({"name": name, "arguments": arguments})


class Glm45Parser(_SchemaTyped):
    """GLM-4.5's `<tool_call>` blocks (see the module docstring)."""

    def call_of(self, body: str) -> ParsedCall | None:
        start = body.find(GLM_KEY)
        name = (body if start < 0 else body[:start]).strip()
        pairs = [] if start < 0 else _pairs(_GLM_PAIR, body[start:])
        if not name or "<" in name or "\n" in name or pairs is None:
            return None
        return self.typed_call(name, pairs)


class MiniMaxM2Parser(_SchemaTyped):
    """MiniMax-M2's `<minimax:tool_call>` blocks (see the module docstring)."""

    open_tag, close_tag = MINIMAX_CALLS, MINIMAX_CALLS_END

    def calls_of(self, body: str) -> list[ParsedCall]:
        invokes = _pairs(_INVOKE, body)
        if not invokes:
            return []
        calls: list[ParsedCall] = []
        for name, inner in invokes:
            pairs = _pairs(_NAMED_PARAMETER, inner)
            call = None if pairs is None else self.typed_call(_unquoted(name), [(_unquoted(k), v) for k, v in pairs])
            if call is None:
                return []
            calls.append(call)
        return calls


class SeedOssParser(Qwen3CoderParser):
    """Seed-OSS's `<seed:tool_call>` blocks (Qwen3-Coder's calls inside)."""

    open_tag, close_tag = SEED_CALLS, SEED_CALLS_END


class DeepSeekParser(HermesParser):
    """DeepSeek V3 / R1's and V3.1's tool-call sections, both layouts (see the module docstring)."""

    open_tag, close_tag = DEEPSEEK_CALLS, DEEPSEEK_CALLS_END
    json_body = False  # its closing tag is a marker token

    def calls_of(self, body: str) -> list[ParsedCall]:
        return _every_call(_elements(body, DEEPSEEK_CALL, DEEPSEEK_CALL_END), self._call)

    def _call(self, inside: str) -> ParsedCall | None:
        head, sep, rest = inside.partition(DEEPSEEK_SEP)
        if not sep:
            return None
        if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>{...}
            name, arguments = head, rest
        else:  # V3 / R1: function<sep>NAME, then the JSON in a code fence
            name, _, fenced = rest.partition("\n")
            fence = _DEEPSEEK_FENCE.fullmatch("\n" + fenced)
            if fence is None:
                return None
            arguments = fence.group(1)
        return _json_call(self, name.strip(), arguments)


class KimiK2Parser(HermesParser):
    """Kimi K2's tool-call sections; each call keeps the id the model wrote (see the module docstring)."""

    open_tag, close_tag = KIMI_CALLS, KIMI_CALLS_END
    json_body = False  # its closing tag is a marker token

    def calls_of(self, body: str) -> list[ParsedCall]:
        return _every_call(_elements(body, KIMI_CALL, KIMI_CALL_END), self._call)

    def _call(self, inside: str) -> ParsedCall | None:
        call_id, sep, arguments = inside.partition(KIMI_ARGUMENTS)
        named = _KIMI_ID.fullmatch(call_id.strip())
        if not sep or named is None:
            return None
        call = _json_call(self, named.group(1), arguments)
        return None if call is None else dataclasses.replace(call, call_id=call_id.strip())


def _json_call(parser: HermesParser, name: str, arguments: str) -> ParsedCall | None:
    """The call of `name` whose arguments are the JSON object text `arguments` (nothing after it), else None."""
    try:
        obj, end = json.JSONDecoder().raw_decode(arguments.strip())
    except JSON_ERRORS:
        return None
    if arguments.strip()[end:].strip() or not name or "\n" in name:
        return None
    return parser.call_from({"name": name, "arguments": obj})


class NemotronParser(HermesParser):
    """Nemotron's `<TOOLCALL>` blocks of a JSON list of calls."""

    open_tag, close_tag = NEMOTRON_CALLS, NEMOTRON_CALLS_END

    def calls_of(self, body: str) -> list[ParsedCall]:
        return json_list_calls(self, body)


class Lfm2Parser(HermesParser):
    """LFM2's `<|tool_call_start|>` blocks of pythonic calls (or of a JSON list of calls)."""

    open_tag, close_tag = LFM2_CALLS, LFM2_CALLS_END
    json_body = False  # its closing tag is a marker token

    def calls_of(self, body: str) -> list[ParsedCall]:
        return PythonicParser(self.names).parse(body) or json_list_calls(self, body)


class GraniteParser(MistralParser):
    """Granite 3's `<|tool_call|>` and a JSON list of calls to the end of the output."""

    marker = GRANITE_CALLS


class CohereParser(HermesParser):
    """Cohere's `<|START_ACTION|>` blocks of a JSON list of `tool_name` / `parameters` objects."""

    open_tag, close_tag = COHERE_CALLS, COHERE_CALLS_END
    json_body = False  # its closing tag is a marker token

    def calls_of(self, body: str) -> list[ParsedCall]:
        return json_list_calls(self, body)

    def call_from(self, obj: Any) -> ParsedCall | None:
        """A call from Cohere's `{"tool_name": ..., "parameters": {...}}` (its keys only)."""
        if not isinstance(obj, dict):
            return None
        return super().call_from({"name": obj.get("tool_name"), "arguments": obj.get("parameters", {})})


class Olmo3Parser(HermesParser):
    """OLMo 3's `<function_calls>` blocks of pythonic calls, one a line."""

    open_tag, close_tag = OLMO3_CALLS, OLMO3_CALLS_END
    json_body = False  # its closing tag is a marker token

    def calls_of(self, body: str) -> list[ParsedCall]:
        lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
        return PythonicParser(self.names).parse("[" + ", ".join(lines) + "]") if lines else []


class Gemma4Parser(HermesParser):
    """Gemma 4's `<|tool_call>call:NAME{...}<tool_call|>` blocks (see the module docstring)."""

    open_tag, close_tag = GEMMA_CALL, GEMMA_CALL_END
    json_body = False  # its closing tag is a marker token

    def call_of(self, body: str) -> ParsedCall | None:
        head, brace, rest = body.strip().partition("{")
        if not head.startswith("call:") or not brace:
            return None
        text = gemma_json("{" + rest)
        try:
            arguments = json.loads(text) if text is not None else None
        except JSON_ERRORS:
            return None
        return self.call_from({"name": head.removeprefix("call:").strip(), "arguments": arguments})


def gemma_json(text: str) -> str | None:
    """Gemma 4's literal `text` as JSON text (strings between `<|"|>` quotes or JSON's, bare or quoted keys, numbers,
    true / false / null and Python's spellings of them), or None when it holds anything else. The result may still
    not parse (brackets out of balance): `json.loads` says."""
    out: list[str] = []
    pos = 0
    while pos < len(text):
        char = text[pos]
        if text.startswith(GEMMA_QUOTE, pos):
            end = text.find(GEMMA_QUOTE, pos + len(GEMMA_QUOTE))
            if end < 0:
                return None
            out.append(json.dumps(text[pos + len(GEMMA_QUOTE) : end], ensure_ascii=False))
            pos = end + len(GEMMA_QUOTE)
        elif char == '"':
            string = _JSON_STRING.match(text, pos)
            if string is None:
                return None
            out.append(string.group())
            pos = string.end()
        elif char in "{}[],:":
            out.append(char)
            pos += 1
        elif char.isspace():
            pos += 1
        else:
            word = _GEMMA_WORD.match(text, pos)
            if word is None:
                return None
            pos = word.end()
            if text[pos:].lstrip().startswith(":"):  # a key
                out.append(json.dumps(word.group()))
            elif word.group() in _GEMMA_LITERALS:
                out.append(_GEMMA_LITERALS[word.group()])
            else:
                try:
                    number = json.loads(word.group())
                except JSON_ERRORS:
                    return None
                if not isinstance(number, (int, float)):
                    return None
                out.append(word.group())
    return "".join(out)
