"""The grammar that forces tool calls (tool_choice "required" or a named function), as EBNF text for xgrammar.

The grammar is built with xgrammar's own combinators, so each tool's JSON Schema is converted by xgrammar
(strictly: properties the schema does not list are not generated, so every sentence validates) and rule
names never collide:
- one call of tool T (Hermes): `<tool_call>\n{"name": "T", "arguments": ` ARGS(T) `}\n</tool_call>`;
- one call of tool T (Llama 3 JSON): `{"name": "T", "parameters": ` ARGS(T) `}`;
- one call of tool T (Mistral): `[TOOL_CALLS] [{"name": "T", "arguments": ` ARGS(T) `}]`, from v11
  `[TOOL_CALLS]T[ARGS]` ARGS(T);
- one call of tool T (Qwen3-Coder): `<tool_call>\n<function=T>\n`, a `<parameter=p>` block per parameter
  (`_xml_call_grammar`), `</function>\n</tool_call>`;
- one call of tool T (pythonic): `[T(p=VALUE, ...)]`, every parameter named (`_pythonic_call_grammar`);
- one call of tool T (GLM-4.5, MiniMax-M2, Seed-OSS): the XML of `writing.call_text` with a value per parameter
  (`_xml_call_grammar`: `<tool_call>T\n`, `<arg_key>p</arg_key>\n<arg_value>VALUE</arg_value>\n` each,
  `</tool_call>`; MiniMax's `<invoke name="T">` of `<parameter name="p">VALUE</parameter>` lines; Seed-OSS's
  `<function=T>` of `<parameter=p>VALUE</parameter>` lines);
- one call of tool T (DeepSeek V3.1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>T<｜tool▁sep｜>` ARGS(T)
  `<｜tool▁call▁end｜><｜tool▁calls▁end｜>`; V3 / R1 name it `function<｜tool▁sep｜>T` and fence ARGS(T) in a json code
  block; Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.T:0<|tool_call_argument_begin|>`
  ARGS(T) `<|tool_call_end|><|tool_calls_section_end|>`; Nemotron: `<TOOLCALL>[{"name": "T", "arguments": ` ARGS(T)
  `}]</TOOLCALL>`; Granite 3: `<|tool_call|>[{"name": "T", "arguments": ` ARGS(T) `}]`; LFM2: the pythonic call
  between `<|tool_call_start|>` and `<|tool_call_end|>`; Cohere: `<|START_ACTION|>[{"tool_call_id": "0", "tool_name":
  "T", "parameters": ` ARGS(T) `}]<|END_ACTION|>`; Gemma 4: `<|tool_call>call:T{p:VALUE,...}<tool_call|>`
  (`_gemma_call_grammar`); OLMo 3: `<function_calls>\nT(p=VALUE, ...)\n</function_calls>`;
- one call of tool T (harmony, gpt-oss): `<|channel|>commentary to=functions.T <|constrain|>json<|message|>`
  ARGS(T), after at most one free reasoning message (`<|channel|>analysis<|message|>` text `<|end|><|start|>
  assistant`, `harmony_reasoning`); the end of sequence (`<|call|>`) follows the complete grammar;
- a named function: exactly one call of it; "required": exactly one call of any tool (a union);
- with `parallel=True` (Hermes only), one or more calls separated by "\n".
Why one call by default: the proto has no `parallel_tool_calls`, and small models, once inside a grammar that
allows another call, tend to repeat calls until max_tokens cuts the last one in half. One call is always a
valid OpenAI answer; in auto mode the model may still make several (the gateway keeps the first of them where the
request sets `parallel_tool_calls` false).
The JSON has no free whitespace (", " and ": " separators), matching the engine's JSON constraints. The text
goes through the ordinary constraint path (`Constraint.grammar`), so it is compiled off the step loop, with
the compiler's time limit, and cached by its text: the same tools compile once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import AnyTextFormat, OptionalFormat, StructuralTag, TagFormat

from engine_server.errors import ValidationError
from engine_server.structured import Constraint
from engine_server.structured.compiler import xgrammar_reason
from engine_server.structured.constraint import check_schema_depth
from engine_server.tokenizer.chat import ChatTool
from engine_server.tools.tagged_formats import (
    GEMMA_CALL,
    GEMMA_CALL_END,
    GEMMA_QUOTE,
    LFM2_CALLS,
    LFM2_CALLS_END,
    OLMO3_CALLS,
    OLMO3_CALLS_END,
)
from engine_server.tools.template import ToolFormat
from engine_server.tools.types import ToolChoice, ToolChoiceMode
from engine_server.tools.writing import XML_LAYOUTS, XmlLayout, json_call_frame

_CALLS_RULE = "tool_calls"
_CALL_SEPARATOR = "\n"


def forced_call_constraint(
    tools: Sequence[ChatTool], choice: ToolChoice, fmt: ToolFormat, parallel: bool = False
) -> Constraint:
    """The constraint for a forced `choice` (validated against `tools` first); see the module docstring.

    Raises ValidationError (param "tools") when a tool's parameters schema cannot be turned into a grammar or
    nests deeper than MAX_SCHEMA_DEPTH (the conversion runs on the caller's thread, without the compiler's
    time limit, and its cost grows about with the cube of the depth).
    """
    if not choice.forced:
        raise ValueError(f"tool_choice {choice.mode} does not force a call")
    choice.validate(tools)
    if choice.mode is ToolChoiceMode.FUNCTION:
        tools = [t for t in tools if t.name == choice.function_name][:1]
    calls = [_call_grammar(t, fmt) for t in tools]
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    if fmt is ToolFormat.HARMONY:
        return Constraint.grammar(str(xgr.Grammar.concat(harmony_reasoning(), one)))
    if not parallel or choice.mode is ToolChoiceMode.FUNCTION or fmt is not ToolFormat.HERMES:
        return Constraint.grammar(str(one))
    # One or more: a new root that repeats the single-call grammar's root (str() always names its root "root").
    many = f"{one}\n{_CALLS_RULE} ::= root ({_literal(_CALL_SEPARATOR)} root)*\n"
    return Constraint.grammar(str(xgr.Grammar.from_ebnf(many, root_rule_name=_CALLS_RULE)))


def arguments_schema(tool: ChatTool) -> Mapping[str, Any]:
    """The schema a call's arguments follow: the tool's parameters; no parameters means an empty object."""
    return tool.parameters or {"type": "object", "properties": {}}


def _call_grammar(tool: ChatTool, fmt: ToolFormat) -> xgr.Grammar:
    schema = arguments_schema(tool)
    if schema.get("type", "object") != "object":
        raise ValidationError(f"parameters of tool {tool.name!r} must describe a JSON object", "tools")
    check_schema_depth(schema, "tools")
    if fmt in XML_LAYOUTS:
        return _xml_call_grammar(tool, schema, XML_LAYOUTS[fmt])
    match fmt:
        case ToolFormat.LFM2:
            calls = _pythonic_call_grammar(tool, schema)
            return xgr.Grammar.concat(_literal_grammar(LFM2_CALLS), calls, _literal_grammar(LFM2_CALLS_END))
        case ToolFormat.GEMMA4:
            return _gemma_call_grammar(tool, schema)
        case ToolFormat.OLMO3:
            return _pythonic_call_grammar(tool, schema, f"{OLMO3_CALLS}\n", f"\n{OLMO3_CALLS_END}")
        case ToolFormat.PYTHONIC:
            return _pythonic_call_grammar(tool, schema)
    frame = json_call_frame(fmt, tool.name)
    if frame is None:
        raise ValueError(f"no forced-call grammar for the {fmt.value} format")
    head, tail = frame
    try:
        arguments = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    except Exception as exc:  # xgrammar reports an unusable schema as an exception: the caller's input
        raise ValidationError(
            f"parameters of tool {tool.name!r} cannot be enforced: {xgrammar_reason(exc)}", "tools"
        ) from exc
    return xgr.Grammar.concat(_literal_grammar(head), arguments, _literal_grammar(tail))


def harmony_reasoning() -> xgr.Grammar:
    """At most one harmony reasoning message and the next message's start: `<|channel|>analysis<|message|>`, any
    text without `<|end|>`, `<|end|><|start|>assistant` (xgrammar's structural tags spell the "any text")."""
    analysis = TagFormat(
        begin="<|channel|>analysis<|message|>", content=AnyTextFormat(), end="<|end|><|start|>assistant"
    )
    return xgr.Grammar.from_structural_tag(StructuralTag(format=OptionalFormat(content=analysis)))


def _xml_call_grammar(tool: ChatTool, schema: Mapping[str, Any], layout: XmlLayout) -> xgr.Grammar:
    """An XML format's call of `tool` (`layout`): its parameters in the schema's order (the optional ones may be
    left out), each value between the layout's `open` and `close`. A string's VALUE is raw text without "<" (an
    enum: one of its values; maxLength and minLength bound it), any other type's a JSON value of its schema, as
    `call_formats.typed_value` reads them."""
    required = set(schema.get("required", ()))
    parts = [_literal_grammar(layout.head.format(tool=tool.name))]
    for name, prop in (schema.get("properties") or {}).items():
        value = _parameter_grammar(tool, name, prop, xml=True)
        opening, closing = _literal_grammar(layout.open.format(name=name)), _literal_grammar(layout.close)
        one = xgr.Grammar.concat(opening, value, closing)
        parts.append(one if name in required else xgr.Grammar.union(one, _literal_grammar("")))
    parts.append(_literal_grammar(layout.tail))
    return xgr.Grammar.concat(*parts)


def _pythonic_call_grammar(
    tool: ChatTool, schema: Mapping[str, Any], head: str = "[", tail: str = "]"
) -> xgr.Grammar:
    """The pythonic call of `tool`, `[T(p1=VALUE, p2=VALUE)]` (`head` and `tail` in place of the brackets), every
    parameter of the schema in its order (a call that names all is valid whichever are required), each VALUE JSON of
    its schema (JSON's true / false / null are read as Python's)."""
    parts = [_literal_grammar(f"{head}{tool.name}(")]
    for i, (name, prop) in enumerate((schema.get("properties") or {}).items()):
        value = _parameter_grammar(tool, name, prop, xml=False)
        parts += [_literal_grammar(f"{', ' if i else ''}{name}="), value]
    parts.append(_literal_grammar(f"){tail}"))
    return xgr.Grammar.concat(*parts)


def _gemma_call_grammar(tool: ChatTool, schema: Mapping[str, Any]) -> xgr.Grammar:
    """Gemma 4's call of `tool`: `<|tool_call>call:T{`, every parameter of the schema in key order (its template sorts
    them) as `p:VALUE` joined by ",", `}<tool_call|>`. A string's VALUE is between `<|"|>` quotes (raw text without
    "<", or one of its enum's values), any other type's JSON of its schema (`tagged_formats.gemma_json` reads JSON's
    spellings too)."""
    parts = [_literal_grammar(f"{GEMMA_CALL}call:{tool.name}{{")]
    for i, (name, prop) in enumerate(sorted((schema.get("properties") or {}).items())):
        value = _parameter_grammar(tool, name, prop, xml=True)
        if not isinstance(prop, Mapping) or prop.get("type") in (None, "string"):
            value = xgr.Grammar.concat(_literal_grammar(GEMMA_QUOTE), value, _literal_grammar(GEMMA_QUOTE))
        parts += [_literal_grammar(f"{',' if i else ''}{name}:"), value]
    parts.append(_literal_grammar("}" + GEMMA_CALL_END))
    return xgr.Grammar.concat(*parts)


def _parameter_grammar(tool: ChatTool, name: str, prop: Any, xml: bool) -> xgr.Grammar:
    """One parameter's VALUE: JSON of its schema, or with `xml` Qwen3-Coder's (`_xml_value_grammar`). Raises
    ValidationError (param "tools") when xgrammar cannot turn the schema into a grammar."""
    schema = prop if isinstance(prop, Mapping) else {}
    try:
        return _xml_value_grammar(schema) if xml else _json_value_grammar(schema)
    except Exception as exc:  # xgrammar reports an unusable schema as an exception: the caller's input
        raise ValidationError(
            f"parameter {name!r} of tool {tool.name!r} cannot be enforced: {xgrammar_reason(exc)}", "tools"
        ) from exc


def _json_value_grammar(schema: Mapping[str, Any]) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


def _xml_value_grammar(prop: Mapping[str, Any]) -> xgr.Grammar:
    kind = prop.get("type")
    if kind not in (None, "string"):
        return _json_value_grammar(prop)
    if isinstance(prop.get("enum"), list) and all(isinstance(v, str) for v in prop["enum"]):
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_literal(v) for v in prop["enum"]))
    low, high = int(prop.get("minLength", 0)), prop.get("maxLength")
    bound = f"{{{low},{int(high)}}}" if high is not None else ("*" if low == 0 else f"{{{low},}}")
    return xgr.Grammar.from_ebnf(f"root ::= [^<]{bound}")


def _literal(text: str) -> str:
    # JSON string escapes are valid EBNF string escapes.
    return json.dumps(text, ensure_ascii=False)


def _literal_grammar(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {_literal(text)}")
