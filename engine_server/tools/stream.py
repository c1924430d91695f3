"""One choice's tool calls as its text arrives: content and OpenAI-style call deltas per step, calls at the end.

Runs where detokenization runs (off the step loop), fed the text the output processor released.
"""

from __future__ import annotations

from engine_server.output.types import FinishReason
from engine_server.tools.parsing import make_parser
from engine_server.tools.plan import ToolParsing
from engine_server.tools.types import ToolCall, ToolCallDelta, new_call_id


class ToolCallStream:
    """Parses one choice's text deltas into content and tool calls.

    Each call is released whole, once its closing tag (or the end of the output) shows it is valid, as two
    deltas the way OpenAI streams calls: first `index`, `id` and `name` with empty arguments, then the
    arguments' JSON text in one piece. So the arguments pieces of a call always join to its `arguments_json`.
    A call's id is the one the model wrote where its format carries one (Kimi K2), else a fresh one.
    """

    def __init__(self, parsing: ToolParsing) -> None:
        self.parsing = parsing
        self.calls: list[ToolCall] = []
        self._parser = make_parser(parsing.format, parsing.names, parsing.schemas)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Content to show and call deltas released by `text`; `final` flushes everything held back."""
        step = self._parser.feed(text)
        if final:
            step.extend(self._parser.finish())
        deltas: list[ToolCallDelta] = []
        for parsed in step.calls:
            call = ToolCall(parsed.call_id or new_call_id(self.parsing.format), parsed.name, parsed.arguments_json)
            index = len(self.calls)
            self.calls.append(call)
            deltas.append(ToolCallDelta(index, call.id, call.name, ""))
            deltas.append(ToolCallDelta(index, arguments_delta=call.arguments_json))
        return step.content, deltas

    def finish(self, reason: FinishReason, matched_stop: str | int | None) -> tuple[FinishReason, str | int | None]:
        """The reported finish reason and matched stop of this choice, which ended with `reason`: a choice that
        made calls reports the parsing's finish reason instead of STOP (then without a matched stop)."""
        reported = self.parsing.finish_reason_for(reason, bool(self.calls))
        return reported, None if reported is FinishReason.TOOL_CALLS else matched_stop
