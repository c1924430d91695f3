"""Tool-call parsers for Mistral's, the pythonic (Llama 3.2 / Llama 4) and Qwen3-Coder's formats, under the contract
of `tools.parsers` (content safe to show now and complete calls per delta, the same result however the
text is split, anything that is not a valid call left in the content as the model wrote it):

- Mistral: the calls follow a `[TOOL_CALLS]` marker, as a JSON list before v11
  (`[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`) or from v11 as `[TOOL_CALLS]f[ARGS]{...}`, once per
  call. Text before the marker streams; from the marker on it is held to the end.
- Pythonic: the whole output is a Python list of calls with keyword arguments whose values are literals,
  `[get_weather(city="Boston"), search(q="x", n=3)]` (JSON's true / false / null read as Python's), optionally
  between Llama 4's `<|python_start|>` and `<|python_end|>`; output that starts like one is held to the end.
- Qwen3-Coder: `<tool_call><function=f><parameter=p>value</parameter>...</function></tool_call>` blocks anywhere,
  any number, the values raw text (one newline either side dropped), turned into JSON by the tool's parameter
  schema (`typed_value`): a parameter whose schema type is not "string" is read as JSON when it parses, any other
  kept a string.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from engine_server.tools.parsers import (
    JSON_ERRORS,
    HermesParser,
    ParsedCall,
    ParseStep,
    ToolCallParser,
    WholeOutputParser,
    partial_suffix_len,
)

MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


class MistralParser(ToolCallParser):
    """Mistral's `[TOOL_CALLS]` calls, both forms (see the module docstring). Formats that write a JSON list of
    calls after a marker of their own to the end of the output subclass it (`marker`: Granite 3's `<|tool_call|>`)."""

    marker: ClassVar[str] = MISTRAL_CALLS

    def __init__(self, names: Iterable[str] | None = None) -> None:
        super().__init__(names)
        self._pending = ""  # before the marker: text not yet released (trailing whitespace, a partial marker)
        self._calls: str | None = None  # from the marker on (the marker included)

    def feed(self, text: str) -> ParseStep:
        if self._calls is not None:
            self._calls += text
            return ParseStep()
        self._pending += text
        start = self._pending.find(self.marker)
        if start >= 0:
            self._calls = self._pending[start:]
            self._pending = self._pending[:start]
        held = len(self._pending) - partial_suffix_len(self._pending, self.marker)
        released = self._pending[:held].rstrip()
        self._pending = self._pending[len(released) :]
        return ParseStep(released)

    def finish(self) -> ParseStep:
        pending, text = self._pending, self._calls
        self._pending, self._calls = "", None
        if text is None:
            return ParseStep(pending)
        calls = self._parse(text)
        return ParseStep(calls=calls) if calls else ParseStep(pending + text)

    def _parse(self, text: str) -> list[ParsedCall]:
        """The calls of the text from the marker on, or [] when any part of it is not a call."""
        body = text[len(self.marker) :].strip()
        if body.startswith("["):  # before v11: one JSON list of calls
            return json_list_calls(self, body)
        calls_v11: list[ParsedCall] = []
        for part in body.split(self.marker):
            name, marker, arguments = part.strip().partition(MISTRAL_ARGS)
            if not marker:
                return []
            try:
                obj, end = json.JSONDecoder().raw_decode(arguments.strip())
            except JSON_ERRORS:
                return []
            call = self.call_from({"name": name.strip(), "arguments": obj})
            if call is None or arguments.strip()[end:].strip():
                return []
            calls_v11.append(call)
        return calls_v11


def json_list_calls(parser: ToolCallParser, text: str) -> list[ParsedCall]:
    """The calls of `text`, one JSON list of `{"name": ..., "arguments": {...}}` objects and nothing else, or [] when
    any part of it is not a call."""
    try:
        objects, end = json.JSONDecoder().raw_decode(text.strip())
    except JSON_ERRORS:
        return []
    if text.strip()[end:].strip() or not isinstance(objects, list) or not objects:
        return []
    calls = [parser.call_from(obj) for obj in objects]
    return [call for call in calls if call is not None] if None not in calls else []


class PythonicParser(WholeOutputParser):
    """A whole output of pythonic calls (see the module docstring)."""

    def may_be_calls(self, text: str) -> bool:
        head = text.lstrip()
        return head.startswith(("[", PYTHON_START)) or PYTHON_START.startswith(head)

    def parse(self, text: str) -> list[ParsedCall]:
        body = text.strip()
        if body.startswith(PYTHON_START):
            body = body.removeprefix(PYTHON_START).strip().removesuffix(PYTHON_END).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return []
        if not isinstance(tree, ast.List) or not tree.elts:
            return []
        calls: list[ParsedCall] = []
        for node in tree.elts:
            call = self._call(node)
            if call is None:
                return []
            calls.append(call)
        return calls

    def _call(self, node: ast.expr) -> ParsedCall | None:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                value = ast.literal_eval(_JsonNames().visit(keyword.value))
                json.dumps(value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
            arguments[keyword.arg] = value
        return self.call_from({"name": node.func.id, "arguments": arguments})


class _JsonNames(ast.NodeTransformer):
    """JSON's true, false and null read as Python's True, False and None (a value written in JSON's spelling)."""

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder's XML calls (see the module docstring); `schemas` maps a tool's name to its parameters'
    JSON Schema, which says how each value is read."""

    json_body = False  # values are raw text: no strings to skip

    def __init__(self, names: Iterable[str] | None = None, schemas: Mapping[str, Mapping[str, Any]] | None = None):
        super().__init__(names)
        self.schemas = dict(schemas or {})

    def call_of(self, body: str) -> ParsedCall | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, inner = function.group(1).strip(), function.group(2)
        properties = self.schemas.get(name, {}).get("properties", {})
        arguments: dict[str, Any] = {}
        end = 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[end : parameter.start()].strip():
                return None  # text between parameters: not this format
            end = parameter.end()
            key = parameter.group(1).strip()
            arguments[key] = typed_value(parameter.group(2), properties.get(key))
        if inner[end:].strip():
            return None
        return self.call_from({"name": name, "arguments": arguments})


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's raw text, as the XML formats write values (Qwen3-Coder's, GLM's, MiniMax's, Seed-OSS's), read
    by the parameter's schema: one newline either side dropped; kept a string when the schema's type is (or
    includes) "string" or is not given, else read as JSON, or as a Python literal (a template that writes a value
    with Python's `str`: True, None) when that is JSON-shaped; text that is neither stays a string."""
    text = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except JSON_ERRORS:
        pass
    try:
        value = ast.literal_eval(text.strip())
        json.dumps(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    return value
