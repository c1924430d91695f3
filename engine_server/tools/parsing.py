"""`make_parser`: a fresh tool-call parser for any format (`ToolFormat`), and `parse_tool_calls` for a whole output.
The parsers live in `parsers` (the contract, Hermes, Llama 3 JSON), `call_formats` (Mistral, pythonic,
Qwen3-Coder) and `tagged_formats` (GLM-4.5, DeepSeek, Kimi K2, MiniMax-M2, Seed-OSS, Nemotron, LFM2, Granite 3,
Cohere, Gemma 4, OLMo 3)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engine_server.tools.call_formats import MistralParser, PythonicParser, Qwen3CoderParser
from engine_server.tools.parsers import HermesParser, Llama3JsonParser, ParseStep, ToolCallParser
from engine_server.tools.tagged_formats import (
    CohereParser,
    DeepSeekParser,
    Gemma4Parser,
    Glm45Parser,
    GraniteParser,
    KimiK2Parser,
    Lfm2Parser,
    MiniMaxM2Parser,
    NemotronParser,
    Olmo3Parser,
    SeedOssParser,
)
from engine_server.tools.template import ToolFormat


def make_parser(
    fmt: ToolFormat, names: Iterable[str] | None = None, schemas: Mapping[str, Mapping[str, Any]] | None = None
) -> ToolCallParser:
    """A fresh parser for one choice's output; `schemas` (tool name -> parameters' JSON Schema) is read by the
    formats whose values are not JSON (Qwen3-Coder's, GLM's, MiniMax's, Seed-OSS's)."""
    match fmt:
        case ToolFormat.HERMES:
            return HermesParser(names)
        case ToolFormat.LLAMA3_JSON:
            return Llama3JsonParser(names)
        case ToolFormat.MISTRAL | ToolFormat.MISTRAL_V11:
            return MistralParser(names)
        case ToolFormat.PYTHONIC:
            return PythonicParser(names)
        case ToolFormat.QWEN3_CODER:
            return Qwen3CoderParser(names, schemas)
        case ToolFormat.GLM45:
            return Glm45Parser(names, schemas)
        case ToolFormat.DEEPSEEK_V3 | ToolFormat.DEEPSEEK_V31:
            return DeepSeekParser(names)
        case ToolFormat.KIMI_K2:
            return KimiK2Parser(names)
        case ToolFormat.MINIMAX_M2:
            return MiniMaxM2Parser(names, schemas)
        case ToolFormat.SEED_OSS:
            return SeedOssParser(names, schemas)
        case ToolFormat.NEMOTRON:
            return NemotronParser(names)
        case ToolFormat.LFM2:
            return Lfm2Parser(names)
        case ToolFormat.GRANITE:
            return GraniteParser(names)
        case ToolFormat.COHERE:
            return CohereParser(names)
        case ToolFormat.GEMMA4:
            return Gemma4Parser(names)
        case ToolFormat.OLMO3:
            return Olmo3Parser(names)
        case ToolFormat.HARMONY:
            raise ValueError("harmony output is read whole by engine_server.harmony, not by a tool-call parser")


def parse_tool_calls(
    text: str,
    fmt: ToolFormat,
    names: Iterable[str] | None = None,
    schemas: Mapping[str, Mapping[str, Any]] | None = None,
) -> ParseStep:
    """Content and calls of a whole output (the same as streaming it through `make_parser`)."""
    parser = make_parser(fmt, names, schemas)
    step = parser.feed(text)
    step.extend(parser.finish())
    return step
