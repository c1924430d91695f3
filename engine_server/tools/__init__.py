"""Tool calling: tools into the prompt, a grammar for forced calls, and calls parsed out of the output.

- `types` — ToolChoice (none / auto / required / a named function), ToolCall, ToolCallDelta.
- `template` — what a model's chat template knows about tools, and the call format it implies.
- `fallback` — the system prompt and plain-text history turns for templates without tool support.
- `plan` — per request: what the template is given, and how (and whether) the output is parsed.
- `grammar` — the xgrammar grammar that forces calls for tool_choice "required" or a named function.
- `parsers` — the parsers' contract, and the Hermes `<tool_call>` and Llama 3 JSON parsers, usable on a stream of
  text deltas; `call_formats` — Mistral's `[TOOL_CALLS]` (both forms), pythonic and Qwen3-Coder XML parsers;
  `tagged_formats` — GLM-4.5's, DeepSeek's, Kimi K2's, MiniMax-M2's, Seed-OSS's, Nemotron's, LFM2's, Granite 3's,
  Cohere's, Gemma 4's and OLMo 3's;
  `parsing` — `make_parser` for any format.
- `writing` — a call written as a model of each format writes it (the fallback's example and history turns).
- `stream` — one choice's calls as they are parsed, as OpenAI-style stream deltas.
This package root stays light (no xgrammar import); `grammar` imports it.
"""

from __future__ import annotations

from engine_server.tools.plan import ToolParsing, chat_for_template, tool_parsing
from engine_server.tools.stream import ToolCallStream
from engine_server.tools.template import ToolFormat, ToolTemplate
from engine_server.tools.types import (
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    default_tool_choice,
)

__all__ = [
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolChoice",
    "ToolChoiceMode",
    "ToolFormat",
    "ToolParsing",
    "ToolTemplate",
    "chat_for_template",
    "default_tool_choice",
    "tool_parsing",
]
