"""Tool calling for chat templates that know nothing of tools: a system prompt and plain-text history turns.

- `tools_system_prompt(tools, fmt)` lists the tools as JSON and teaches the call format the output is read in
  (Hermes' `<tool_call>` for a template that implies none; a family's own, such as DeepSeek V3's, where its
  template writes calls but does not list tools); it goes into the system turn (appended to the caller's system
  message, or as a new first message).
- `plain_history(messages, fmt)` rewrites earlier assistant tool calls as text in that format in the assistant
  turn, and each run of consecutive `tool` results as one `user` turn of `<tool_response>` blocks, so templates
  that only know system / user / assistant (or insist they alternate) render the conversation.
Both are pure functions of the engine's chat types.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine_server.tokenizer.chat import ChatMessage, ChatTool, ChatToolCall
from engine_server.tools.template import ToolFormat
from engine_server.tools.writing import call_text

_SYSTEM_ROLES = ("system", "developer")


def tool_definition(tool: ChatTool) -> dict[str, Any]:
    """A tool in OpenAI's `{"type": "function", "function": {...}}` shape (what templates expect too)."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)},
    }


def tools_system_prompt(tools: Sequence[ChatTool], fmt: ToolFormat = ToolFormat.HERMES) -> str:
    """The instructions and tool list a model without tool support in its template reads, teaching `fmt`."""
    fmt = _written(fmt)
    listing = "\n".join(json.dumps(tool_definition(t), ensure_ascii=False) for t in tools)
    if fmt is ToolFormat.HERMES:
        how = (
            "To call a function, reply with a JSON object holding its name and arguments within "
            "<tool_call></tool_call> tags, one block per call:\n"
        )
    else:
        how = "To call a function, write the call as in this example, one per call:\n"
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. "
        "The functions are listed as JSON schemas within <tools></tools> tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        f"{how}{call_text(fmt, 'function_name', {'argument': 'value'})}\n"
        "Function results come back within <tool_response></tool_response> tags."
    )


def written_call(call: ChatToolCall, fmt: ToolFormat = ToolFormat.HERMES) -> str:
    """One call of the conversation as a model of `fmt` writes it (arguments that are not JSON are kept as the
    caller's text, a JSON string, rather than refuse the conversation)."""
    try:
        arguments: Any = json.loads(call.arguments_json) if call.arguments_json else {}
    except (json.JSONDecodeError, RecursionError):
        arguments = json.dumps(call.arguments_json, ensure_ascii=False)
    value = arguments if isinstance(arguments, (dict, str)) else json.dumps(arguments)
    return call_text(_written(fmt), call.name, value)


def _written(fmt: ToolFormat) -> ToolFormat:
    """The format a plain template's text shows calls in: `fmt`, or Hermes' for harmony (whose calls are messages
    of their own, which a template without tool support cannot write)."""
    return ToolFormat.HERMES if fmt is ToolFormat.HARMONY else fmt


def with_tools_system_prompt(
    messages: Sequence[ChatMessage], tools: Sequence[ChatTool], fmt: ToolFormat = ToolFormat.HERMES
) -> list[ChatMessage]:
    """`messages` with the tools prompt (teaching `fmt`) appended to the leading system message, or inserted as
    one."""
    prompt = tools_system_prompt(tools, fmt)
    out = list(messages)
    if out and out[0].role in _SYSTEM_ROLES:
        first = out[0]
        content = f"{first.content}\n\n{prompt}" if first.content else prompt
        out[0] = ChatMessage(first.role, content, first.tool_calls, first.tool_call_id, first.name)
    else:
        out.insert(0, ChatMessage("system", prompt))
    return out


def plain_history(messages: Sequence[ChatMessage], fmt: ToolFormat = ToolFormat.HERMES) -> list[ChatMessage]:
    """`messages` with tool calls (written in `fmt`) and tool results rewritten as plain assistant and user
    turns."""
    out: list[ChatMessage] = []
    pending_results: list[str] = []

    def close_results() -> None:
        if pending_results:
            out.append(ChatMessage("user", "\n".join(pending_results)))
            pending_results.clear()

    for message in messages:
        if message.role == "tool":
            pending_results.append(f"<tool_response>\n{message.content}\n</tool_response>")
            continue
        close_results()
        if message.role == "assistant" and message.tool_calls:
            parts = [message.content] if message.content else []
            parts.extend(written_call(c, fmt) for c in message.tool_calls)
            out.append(ChatMessage("assistant", "\n".join(parts), name=message.name))
        else:
            out.append(message)
    close_results()
    return out
