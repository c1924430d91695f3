"""Value types of tool calling: the caller's tool_choice, the calls the model made, and their stream deltas."""

from __future__ import annotations

import enum
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass

from engine_server.errors import ValidationError
from engine_server.tokenizer.chat import ChatTool, ChatToolCall
from engine_server.tools.template import ToolFormat

# A call the model makes now has the same shape as one an earlier assistant turn made.
ToolCall = ChatToolCall


class ToolChoiceMode(enum.StrEnum):
    """How freely the model may call tools; the values are OpenAI's `tool_choice` strings."""

    NONE = "none"  # tools are not shown to the model and its output is never parsed for calls
    AUTO = "auto"  # the model decides; calls are parsed from its output when it makes them
    REQUIRED = "required"  # one or more calls of any tool, enforced with a grammar
    FUNCTION = "function"  # exactly one call of `ToolChoice.function_name`, enforced with a grammar


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool_choice: a mode, plus the function's name for FUNCTION."""

    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    function_name: str = ""

    @classmethod
    def function(cls, name: str) -> ToolChoice:
        return cls(ToolChoiceMode.FUNCTION, name)

    @property
    def forced(self) -> bool:
        """Whether the output must be tool calls (REQUIRED or a named function): then a grammar enforces it."""
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION)

    def validate(self, tools: Sequence[ChatTool]) -> None:
        """Raise ValidationError (param "tool_choice") when this choice cannot be honoured with `tools`."""
        names = [t.name for t in tools]
        if self.mode is ToolChoiceMode.FUNCTION and self.function_name not in names:
            known = ", ".join(repr(n) for n in names) or "none were given"
            raise ValidationError(
                f"tool_choice names function {self.function_name!r}, which is not among the tools ({known})",
                "tool_choice",
            )
        if self.mode is ToolChoiceMode.REQUIRED and not tools:
            raise ValidationError("tool_choice 'required' needs at least one tool", "tool_choice")


def default_tool_choice(tools: Sequence[ChatTool]) -> ToolChoice:
    """OpenAI's default: AUTO when tools are given, NONE otherwise."""
    return ToolChoice(ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call in a stream, as OpenAI streams them.

    The first delta of a call carries `id` and `name` (and empty arguments); later ones carry only the next
    piece of the arguments' JSON text. Concatenating a call's `arguments_delta`s gives its `arguments_json`.
    """

    index: int
    id: str = ""
    name: str = ""
    arguments_delta: str = ""


def new_call_id(fmt: ToolFormat | None = None) -> str:
    """A fresh tool call id: in OpenAI's shape, "call_" and 24 random hex digits; for Mistral's formats 9 letters
    and digits, the only ids its chat templates accept when the call is sent back."""
    if fmt in (ToolFormat.MISTRAL, ToolFormat.MISTRAL_V11):
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))
    return "call_" + secrets.token_hex(12)


_ID_CHARACTERS = string.ascii_letters + string.digits
