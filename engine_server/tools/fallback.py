"""Tool calling for chat templates that know nothing of tools: a system prompt and plain-text history turns.

- `tools_system_prompt(tools)` lists the tools as JSON and teaches the Hermes `<tool_call>` format; it goes
  into the system turn (appended to the caller's system message, or as a new first message).
- `plain_history(messages)` rewrites earlier assistant tool calls as `<tool_call>` text in the assistant turn,
  and each run of consecutive `tool` results as one `user` turn of `<tool_response>` blocks, so templates that
  only know system / user / assistant (or insist they alternate) render the conversation.
Both are pure functions of the engine's chat types.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine_server.tokenizer.chat import ChatMessage, ChatTool, ChatToolCall

_SYSTEM_ROLES = ("system", "developer")


def tool_definition(tool: ChatTool) -> dict[str, Any]:
    """A tool in OpenAI's `{"type": "function", "function": {...}}` shape (what templates expect too)."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)},
    }


def tools_system_prompt(tools: Sequence[ChatTool]) -> str:
    """The instructions and tool list a model without tool support in its template reads."""
    listing = "\n".join(json.dumps(tool_definition(t), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. "
        "The functions are listed as JSON schemas within <tools></tools> tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments within "
        "<tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
        "Function results come back within <tool_response></tool_response> tags."
    )


def call_text(call: ChatToolCall) -> str:
    """One call as the model writes it in the Hermes format."""
    try:
        arguments: Any = json.loads(call.arguments_json) if call.arguments_json else {}
    except json.JSONDecodeError:
        arguments = call.arguments_json  # keep the caller's text rather than refuse the conversation
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def with_tools_system_prompt(messages: Sequence[ChatMessage], tools: Sequence[ChatTool]) -> list[ChatMessage]:
    """`messages` with the tools prompt appended to the leading system message, or inserted as one."""
    prompt = tools_system_prompt(tools)
    out = list(messages)
    if out and out[0].role in _SYSTEM_ROLES:
        first = out[0]
        content = f"{first.content}\n\n{prompt}" if first.content else prompt
        out[0] = ChatMessage(first.role, content, first.tool_calls, first.tool_call_id, first.name)
    else:
        out.insert(0, ChatMessage("system", prompt))
    return out


def plain_history(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """`messages` with tool calls and tool results rewritten as plain assistant and user turns."""
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
            parts.extend(call_text(c) for c in message.tool_calls)
            out.append(ChatMessage("assistant", "\n".join(parts), name=message.name))
        else:
            out.append(message)
    close_results()
    return out
