"""What a model's chat template knows about tools, read once from the template text.

Rules (first match wins for the format):
- the template writes `<|channel|>` headers → HARMONY (gpt-oss; its output is read by `engine_server.harmony`);
- the template mentions `[TOOL_CALLS]` → MISTRAL, or MISTRAL_V11 when it also writes `[ARGS]`;
- it mentions `<minimax:tool_call>` → MINIMAX_M2; `<seed:tool_call>` → SEED_OSS; `<arg_key>` → GLM45;
  `<|tool_calls_section_begin|>` → KIMI_K2; `<｜tool▁calls▁begin｜>` → DEEPSEEK_V3 when it fences the
  arguments in a json code block (V3, R1), else DEEPSEEK_V31; `<TOOLCALL>` → NEMOTRON; `<|tool_call_start|>` or
  `<|tool_list_start|>` → LFM2; `<|tool_call|>` → GRANITE; `<|START_ACTION|>` → COHERE; `<|tool_call>` →
  GEMMA4; `<function_calls>` → OLMO3;
- it mentions `<function=` and `<parameter=` → QWEN3_CODER;
- it mentions `<tool_call>` → HERMES (Hermes 2 Pro, Qwen 2/2.5/3, ...);
- it mentions `<|python_start|>` → PYTHONIC (Llama 4);
- it mentions `<|python_tag|>` or the `ipython` role → LLAMA3_JSON (Llama 3.1+ JSON tool calls);
- otherwise → HERMES, the format the fallback prompt teaches.
`native_tools` says the template renders tool definitions itself (it uses a `tools` variable); without it the
fallback system prompt lists them and teaches the format (`writing.call_text`). `native_history` says it renders
earlier calls and tool results itself (it reads `tool_calls`); without it they are rewritten into plain turns, the
calls in the format (see `fallback`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TOOLS_VARIABLE = re.compile(r"\btools\b")
_TOOL_CALLS_VARIABLE = re.compile(r"\btool_calls\b")


class ToolFormat(enum.Enum):
    """How a model writes tool calls in its output."""

    # <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, once per call.
    HERMES = "hermes"
    # {"name": "f", "parameters": {...}} as the whole output, optionally after <|python_tag|>.
    LLAMA3_JSON = "llama3_json"
    # [TOOL_CALLS] [{"name": "f", "arguments": {...}}] (Mistral before v11; the parser reads both forms).
    MISTRAL = "mistral"
    # [TOOL_CALLS]f[ARGS]{...}, once per call (Mistral v11 and later).
    MISTRAL_V11 = "mistral_v11"
    # [f(a=1), g(b="x")] as the whole output (Llama 3.2 / Llama 4, between <|python_start|> and <|python_end|>).
    PYTHONIC = "pythonic"
    # <tool_call><function=f><parameter=p>value</parameter></function></tool_call> (Qwen3-Coder).
    QWEN3_CODER = "qwen3_coder"
    # <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|> (gpt-oss's harmony; vLLM calls
    # its parser "openai"). Its reasoning and answer are channels too: `engine_server.harmony` reads all of them.
    HARMONY = "openai"
    # <tool_call>f\n<arg_key>p</arg_key>\n<arg_value>v</arg_value>\n</tool_call> (GLM-4.5, 4.6, 4.7; vLLM's "glm45").
    GLM45 = "glm45"
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>
    # <｜tool▁calls▁end｜> (DeepSeek V3, R1).
    DEEPSEEK_V3 = "deepseek_v3"
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜> (V3.1).
    DEEPSEEK_V31 = "deepseek_v31"
    # <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
    # <|tool_calls_section_end|> (Kimi K2); the model's `functions.f:0` is the call's id.
    KIMI_K2 = "kimi_k2"
    # <minimax:tool_call>\n<invoke name="f">\n<parameter name="p">v</parameter>\n</invoke>\n</minimax:tool_call>
    MINIMAX_M2 = "minimax_m2"
    # <seed:tool_call>\n<function=f>\n<parameter=p>v</parameter>\n</function>\n</seed:tool_call> (Seed-OSS).
    SEED_OSS = "seed_oss"
    # <TOOLCALL>[{"name": "f", "arguments": {...}}]</TOOLCALL> (Nemotron Nano 2, Nemotron-H; NVIDIA's parser name).
    NEMOTRON = "nemotron_json"
    # <|tool_call_start|>[f(a=1)]<|tool_call_end|> (LFM2, pythonic calls between its markers).
    LFM2 = "lfm2"
    # <|tool_call|>[{"name": "f", "arguments": {...}}] (Granite 3.x; Granite 4 writes Hermes' <tool_call>).
    GRANITE = "granite"
    # <|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {...}}]<|END_ACTION|> (Command R7B, A).
    COHERE = "cohere"
    # <|tool_call>call:f{a:<|"|>x<|"|>,n:3}<tool_call|> (Gemma 4, its own literals).
    GEMMA4 = "gemma4"
    # <function_calls>\nf(a=1)\ng(b="x")\n</function_calls> (OLMo 3: pythonic calls, one a line).
    OLMO3 = "olmo3"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output is decoded with the special tokens kept: the format's markers are special tokens in
        its family's vocabulary (skipped, they would vanish from the text before the parser sees them)."""
        plain_text = (ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.PYTHONIC, ToolFormat.QWEN3_CODER)
        return self not in (*plain_text, ToolFormat.OLMO3)


# The names vLLM's and SGLang's `--tool-call-parser` give these formats besides their own values, so a command line
# of theirs runs here as written.
FORMAT_ALIASES: dict[str, ToolFormat] = {
    # vLLM's
    "glm47": ToolFormat.GLM45,
    "llama4_pythonic": ToolFormat.PYTHONIC,
    "llama4_json": ToolFormat.LLAMA3_JSON,
    "qwen3_xml": ToolFormat.QWEN3_CODER,
    "ernie45": ToolFormat.HERMES,
    # SGLang's
    "deepseekv3": ToolFormat.DEEPSEEK_V3,
    "deepseekv31": ToolFormat.DEEPSEEK_V31,
    "glm": ToolFormat.GLM45,
    "gpt-oss": ToolFormat.HARMONY,
    "llama3": ToolFormat.LLAMA3_JSON,
    "llama4": ToolFormat.PYTHONIC,
    "qwen": ToolFormat.HERMES,
    "qwen25": ToolFormat.HERMES,
    "minimax-m2": ToolFormat.MINIMAX_M2,
}


@dataclass(frozen=True)
class ToolTemplate:
    """A chat template's tool support; see the module docstring for how it is detected."""

    format: ToolFormat = ToolFormat.HERMES
    native_tools: bool = False
    native_history: bool = False

    @classmethod
    def detect(cls, chat_template: Any, parser: str = "auto") -> ToolTemplate:
        """Read a tokenizer's `chat_template`: a string, a mapping of named templates, or None. `parser` other than
        "auto" names the format (a `ToolFormat` value), whatever the template implies."""
        if isinstance(chat_template, Mapping):
            text = "\n".join(str(t) for t in chat_template.values())
        else:
            text = chat_template if isinstance(chat_template, str) else ""
        if "<|channel|>" in text:
            fmt = ToolFormat.HARMONY
        elif "[TOOL_CALLS]" in text:
            fmt = ToolFormat.MISTRAL_V11 if "[ARGS]" in text else ToolFormat.MISTRAL
        elif "<minimax:tool_call>" in text:
            fmt = ToolFormat.MINIMAX_M2
        elif "<seed:tool_call>" in text:
            fmt = ToolFormat.SEED_OSS
        elif "<arg_key>" in text:
            fmt = ToolFormat.GLM45
        elif "<|tool_calls_section_begin|>" in text:
            fmt = ToolFormat.KIMI_K2
        elif "<｜tool▁calls▁begin｜>" in text:
            fmt = ToolFormat.DEEPSEEK_V3 if "```json" in text else ToolFormat.DEEPSEEK_V31
        elif "<TOOLCALL>" in text:
            fmt = ToolFormat.NEMOTRON
        elif "<|tool_call_start|>" in text or "<|tool_list_start|>" in text:  # LFM2's lists tools, its model calls
            fmt = ToolFormat.LFM2
        elif "<|tool_call|>" in text:
            fmt = ToolFormat.GRANITE
        elif "<|START_ACTION|>" in text:
            fmt = ToolFormat.COHERE
        elif "<|tool_call>" in text:
            fmt = ToolFormat.GEMMA4
        elif "<function_calls>" in text:
            fmt = ToolFormat.OLMO3
        elif "<function=" in text and "<parameter=" in text:
            fmt = ToolFormat.QWEN3_CODER
        elif "<tool_call>" in text:
            fmt = ToolFormat.HERMES
        elif "<|python_start|>" in text:
            fmt = ToolFormat.PYTHONIC
        elif "<|python_tag|>" in text or "ipython" in text:
            fmt = ToolFormat.LLAMA3_JSON
        else:
            fmt = ToolFormat.HERMES
        return cls(
            format=fmt if parser == "auto" else FORMAT_ALIASES.get(parser) or ToolFormat(parser),
            native_tools=bool(_TOOLS_VARIABLE.search(text)),
            native_history=bool(_TOOL_CALLS_VARIABLE.search(text)),
        )
