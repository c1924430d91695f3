"""How one chat request uses its tools: what the chat template is given, and how the output is read.

tool_choice rules (OpenAI's, with the engine's choices where OpenAI leaves room):
- "none": the tools are not rendered at all and the output is never parsed, so the model cannot call one
  (earlier calls and results in the conversation still render).
- "auto": the tools are rendered; calls are parsed from the output when the model makes them.
- "required" / a named function: as "auto", and a grammar forces the output to be calls (see `grammar`).
Finish reasons: a choice that made calls and ended by itself reports TOOL_CALLS, except under a named
function, where it reports STOP as OpenAI does; LENGTH and ABORT are never replaced (the output was cut).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_server.output.types import FinishReason
from engine_server.tokenizer.chat import ChatMessage, ChatTool
from engine_server.tools.fallback import plain_history, with_tools_system_prompt
from engine_server.tools.template import ToolFormat, ToolTemplate
from engine_server.tools.types import ToolChoice, ToolChoiceMode


@dataclass(frozen=True)
class ToolParsing:
    """How to read one request's output: the call format, the functions a call may name, and the finish
    reason a choice that made calls and stopped reports."""

    format: ToolFormat
    names: frozenset[str]
    finish_reason: FinishReason = FinishReason.TOOL_CALLS
    # Each function's parameters' JSON Schema, for formats whose values are not JSON (Qwen3-Coder).
    schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def finish_reason_for(self, reason: FinishReason, made_calls: bool) -> FinishReason:
        """The reported finish reason of a choice the core ended with `reason`."""
        return self.finish_reason if made_calls and reason is FinishReason.STOP else reason


def chat_for_template(
    messages: Sequence[ChatMessage], tools: Sequence[ChatTool], choice: ToolChoice, template: ToolTemplate
) -> tuple[list[ChatMessage], list[ChatTool]]:
    """The messages and tools to hand the model's chat template.

    A template without tool support gets the fallback: tools listed in the system turn, earlier calls and
    results rewritten as plain turns (in the template's call format); it is then given no tools of its own.
    """
    shown = list(tools) if choice.mode is not ToolChoiceMode.NONE else []
    out = list(messages) if template.native_history else plain_history(messages, template.format)
    if shown and not template.native_tools:
        return with_tools_system_prompt(out, shown, template.format), []
    return out, shown


def tool_parsing(tools: Sequence[ChatTool], choice: ToolChoice, template: ToolTemplate) -> ToolParsing | None:
    """How to read calls from the output, or None when they are not read (no tools, or tool_choice "none")."""
    if choice.mode is ToolChoiceMode.NONE or not tools:
        return None
    schemas = {t.name: t.parameters or {} for t in tools}
    if choice.mode is ToolChoiceMode.FUNCTION:
        return ToolParsing(template.format, frozenset({choice.function_name}), FinishReason.STOP, schemas)
    return ToolParsing(template.format, frozenset(t.name for t in tools), schemas=schemas)
