"""A tool call written as a model of each format writes it (`call_text`): the fallback prompt's example and the calls
of a conversation rewritten as plain text (`fallback`) use it, and what it writes parses back (`parsing`) into the
same call, for every format but harmony (whose calls are messages of their own, `engine_server.harmony`).

The layout is the canonical one of each family's chat template (the one the forced-call grammar writes too): JSON
arguments as `json.dumps` writes them, and in the XML formats a string value as is and any other value as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_server.tools.call_formats import MISTRAL_ARGS, MISTRAL_CALLS
from engine_server.tools.parsers import HERMES_CLOSE, HERMES_OPEN
from engine_server.tools.tagged_formats import (
    COHERE_CALLS,
    COHERE_CALLS_END,
    DEEPSEEK_CALL,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
    GEMMA_CALL,
    GEMMA_CALL_END,
    GEMMA_QUOTE,
    GRANITE_CALLS,
    KIMI_ARGUMENTS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_CALLS,
    KIMI_CALLS_END,
    LFM2_CALLS,
    LFM2_CALLS_END,
    NEMOTRON_CALLS,
    NEMOTRON_CALLS_END,
    OLMO3_CALLS,
    OLMO3_CALLS_END,
)
from engine_server.tools.template import ToolFormat


@dataclass(frozen=True)
class XmlLayout:
    """How an XML format writes one call: `head` and `tail` around it ("{tool}" the tool's name), and around each
    parameter's value `open` ("{name}" the parameter's) and `close`."""

    head: str
    open: str
    close: str
    tail: str


XML_LAYOUTS = {
    ToolFormat.QWEN3_CODER: XmlLayout(
        "<tool_call>\n<function={tool}>\n", "<parameter={name}>\n", "\n</parameter>\n", "</function>\n</tool_call>"
    ),
    ToolFormat.GLM45: XmlLayout(
        "<tool_call>{tool}\n", "<arg_key>{name}</arg_key>\n<arg_value>", "</arg_value>\n", "</tool_call>"
    ),
    ToolFormat.MINIMAX_M2: XmlLayout(
        '<minimax:tool_call>\n<invoke name="{tool}">\n',
        '<parameter name="{name}">',
        "</parameter>\n",
        "</invoke>\n</minimax:tool_call>",
    ),
    ToolFormat.SEED_OSS: XmlLayout(
        "<seed:tool_call>\n<function={tool}>\n",
        "<parameter={name}>",
        "</parameter>\n",
        "</function>\n</seed:tool_call>",
    ),
}


def json_call_frame(fmt: ToolFormat, name: str) -> tuple[str, str] | None:
    """The text around a call's arguments (head, tail) in the formats whose arguments are one JSON object, or None
    for the others; the forced-call grammar writes the same frame around the arguments' schema."""
    quoted = _name(name)
    match fmt:
        case ToolFormat.HERMES:
            return f'{HERMES_OPEN}\n{{"name": {quoted}, "arguments": ', f"}}\n{HERMES_CLOSE}"
        case ToolFormat.LLAMA3_JSON:
            return f'{{"name": {quoted}, "parameters": ', "}"
        case ToolFormat.MISTRAL:
            return f'{MISTRAL_CALLS} [{{"name": {quoted}, "arguments": ', "}]"
        case ToolFormat.MISTRAL_V11:
            return f"{MISTRAL_CALLS}{name}{MISTRAL_ARGS}", ""
        case ToolFormat.DEEPSEEK_V31:
            return f"{DEEPSEEK_CALLS}{DEEPSEEK_CALL}{name}{DEEPSEEK_SEP}", DEEPSEEK_CALL_END + DEEPSEEK_CALLS_END
        case ToolFormat.DEEPSEEK_V3:
            head = f"{DEEPSEEK_CALLS}{DEEPSEEK_CALL}function{DEEPSEEK_SEP}{name}\n```json\n"
            return head, f"\n```{DEEPSEEK_CALL_END}{DEEPSEEK_CALLS_END}"
        case ToolFormat.KIMI_K2:
            return f"{KIMI_CALLS}{KIMI_CALL}functions.{name}:0{KIMI_ARGUMENTS}", KIMI_CALL_END + KIMI_CALLS_END
        case ToolFormat.NEMOTRON:
            return f'{NEMOTRON_CALLS}[{{"name": {quoted}, "arguments": ', "}]" + NEMOTRON_CALLS_END
        case ToolFormat.GRANITE:
            return f'{GRANITE_CALLS}[{{"name": {quoted}, "arguments": ', "}]"
        case ToolFormat.COHERE:
            head = f'{COHERE_CALLS}[{{"tool_call_id": "0", "tool_name": {quoted}, "parameters": '
            return head, "}]" + COHERE_CALLS_END
        case ToolFormat.HARMONY:  # the body of a call message (its grammar; no reply text holds one)
            return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""
        case _:
            return None


def call_text(fmt: ToolFormat, name: str, arguments: Mapping[str, Any] | str) -> str:
    """One call of `name` as a model of `fmt` writes it; `arguments` are an object, or JSON text that is not one
    (kept as the caller wrote it, in the formats whose arguments are JSON). Raises ValueError for harmony."""
    if fmt is ToolFormat.HARMONY:
        raise ValueError("harmony calls are messages of their own, not text in a reply")
    as_json = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    pairs = dict(arguments) if isinstance(arguments, Mapping) else {}
    frame = json_call_frame(fmt, name)
    if frame is not None:
        return frame[0] + as_json + frame[1]
    if fmt in XML_LAYOUTS:
        layout = XML_LAYOUTS[fmt]
        body = "".join(layout.open.format(name=k) + _xml(v) + layout.close for k, v in pairs.items())
        return layout.head.format(tool=name) + body + layout.tail
    match fmt:
        case ToolFormat.PYTHONIC:
            listed = ", ".join(f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in pairs.items())
            return f"[{name}({listed})]"
        case ToolFormat.LFM2:
            return LFM2_CALLS + call_text(ToolFormat.PYTHONIC, name, arguments) + LFM2_CALLS_END
        case ToolFormat.OLMO3:
            call = call_text(ToolFormat.PYTHONIC, name, arguments)[1:-1]  # one call, without the list's brackets
            return f"{OLMO3_CALLS}\n{call}\n{OLMO3_CALLS_END}"
        case ToolFormat.GEMMA4:
            listed = ",".join(f"{key}:{gemma_literal(value)}" for key, value in sorted(pairs.items()))
            return f"{GEMMA_CALL}call:{name}{{{listed}}}{GEMMA_CALL_END}"
    raise ValueError(f"no writer for the {fmt.value} format")


def gemma_literal(value: Any) -> str:
    """`value` in Gemma 4's literals, as its template writes arguments: strings between `<|"|>` quotes, keys bare
    and sorted, numbers and true / false / null as JSON writes them."""
    if isinstance(value, str):
        return GEMMA_QUOTE + value + GEMMA_QUOTE
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{key}:{gemma_literal(item)}" for key, item in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_literal(item) for item in value) + "]"
    return json.dumps(value)


def _name(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def _xml(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
