"""GLM-4.5's, DeepSeek's (V3 / R1 and V3.1), Kimi K2's, MiniMax-M2's, Seed-OSS's, Nemotron's, LFM2's, Granite 3's,
Cohere's and Gemma 4's tool-call formats: canned outputs
in each family's layout, malformed blocks left as written, streams cut at every point, the formats read off the
families' templates, Kimi's ids kept, every format's written call parsed back, the fallback prompt teaching the
template's own format, and the special tokens kept where the markers are special tokens."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest

from engine_server.config import TOOL_CALL_PARSERS
from engine_server.frontend import ChatPrompt, InputProcessor
from engine_server.sampling_params import SamplingParams
from engine_server.tokenizer.chat import ChatMessage, ChatTool, ChatToolCall, render_chat
from engine_server.tools import ToolFormat, ToolParsing, ToolTemplate
from engine_server.tools.fallback import plain_history, tools_system_prompt
from engine_server.tools.parsers import ParsedCall, ParseStep
from engine_server.tools.parsing import make_parser, parse_tool_calls
from engine_server.tools.stream import ToolCallStream
from engine_server.tools.template import FORMAT_ALIASES
from engine_server.tools.writing import call_text

NAMES = ("get_weather", "search")
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "search": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "filters": {"type": "object"}, "safe": {"type": "boolean"}},
    },
}
GLM, MINIMAX, SEED = ToolFormat.GLM45, ToolFormat.MINIMAX_M2, ToolFormat.SEED_OSS
DEEPSEEK, DEEPSEEK_V31, KIMI = ToolFormat.DEEPSEEK_V3, ToolFormat.DEEPSEEK_V31, ToolFormat.KIMI_K2
NEMOTRON, LFM2, GRANITE, COHERE = ToolFormat.NEMOTRON, ToolFormat.LFM2, ToolFormat.GRANITE, ToolFormat.COHERE
GEMMA, OLMO3 = ToolFormat.GEMMA4, ToolFormat.OLMO3
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KB, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KCB, KCE, KARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def _call(name: str, call_id: str = "", **arguments: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments), call_id)


PARIS = _call("get_weather", city="Paris", days=3)
NEWS = _call("search", query="news", filters={"lang": "en"}, safe=False)
CASES = [
    # GLM-4.5: a newline after the name and each part (its template); 4.7 writes none; values typed by the schema.
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3</arg_value>\n</tool_call>", GLM, "", [PARIS]),
    ("Let me check.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days"
     "</arg_key><arg_value>3</arg_value></tool_call>\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>news"
     '</arg_value>\n<arg_key>filters</arg_key>\n<arg_value>{"lang": "en"}</arg_value>\n<arg_key>safe</arg_key>\n'
     "<arg_value>false</arg_value>\n</tool_call>", GLM, "Let me check.", [PARIS, NEWS]),
    ("<tool_call>search\n</tool_call>", GLM, "", [_call("search")]),  # a call without arguments
    # DeepSeek V3 / R1: the arguments in a json fence; V3.1: right after the separator. One parser reads both.
    (f"Checking.{B}{CB}function{SEP}get_weather\n```json\n" + '{"city": "Paris", "days": 3}' + f"\n```{CE}\n"
     f"{CB}function{SEP}search\n```json\n{NEWS.arguments_json}\n```{CE}{E}", DEEPSEEK, "Checking.", [PARIS, NEWS]),
    (f"{B}{CB}get_weather{SEP}" + '{"city": "Paris", "days": 3}' + f"{CE}{E}", DEEPSEEK_V31, "", [PARIS]),
    (f"{B}{CB}get_weather{SEP}" + '{"city": "Paris", "days": 3}' + CE, DEEPSEEK_V31, "", [PARIS]),  # ended at eos
    # Kimi K2: the model's id is the call's.
    (f"Sure.{KB}{KCB}functions.get_weather:0{KARGS}" + '{"city": "Paris", "days": 3}' + f"{KCE}{KCB}functions."
     f"search:1{KARGS}{NEWS.arguments_json}{KCE}{KE}", KIMI, "Sure.",
     [_call("get_weather", "functions.get_weather:0", city="Paris", days=3),
      _call("search", "functions.search:1", query="news", filters={"lang": "en"}, safe=False)]),
    # MiniMax-M2: one block, two invokes, quoted names.
    ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
     '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="search">\n<parameter name="query">news'
     '</parameter>\n<parameter name="filters">{"lang": "en"}</parameter>\n<parameter name="safe">false</parameter>'
     "\n</invoke>\n</minimax:tool_call>\nDone.", MINIMAX, "Done.", [PARIS, NEWS]),
    # Seed-OSS: Qwen3-Coder's calls in <seed:tool_call>; a value written with Python's str (False) still reads.
    ("<seed:tool_call>\n<function=search>\n<parameter=query>news</parameter>\n<parameter=filters>"
     "{'lang': 'en'}</parameter>\n<parameter=safe>False</parameter>\n</function>\n</seed:tool_call>", SEED, "",
     [NEWS]),
    ("No tools needed.", GLM, "No tools needed.", []),
    # Nemotron: a JSON list in <TOOLCALL>, after its reasoning's answer text; arguments as a JSON string read too.
    ('Checking both.\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     f'{{"name": "search", "arguments": {json.dumps(NEWS.arguments_json)}}}]</TOOLCALL>', NEMOTRON, "Checking both.",
     [PARIS, NEWS]),
    # LFM2: pythonic calls between its markers, text around them; a JSON list between them reads too.
    ('<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>Checking the weather.', LFM2,
     "Checking the weather.", [PARIS]),
    ('<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]<|tool_call_end|>',
     LFM2, "", [PARIS]),
    # Granite 3: a JSON list from its marker to the end.
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', GRANITE, "", [PARIS]),
    # Cohere: tool_name / parameters objects in <|START_ACTION|> (the plan before it is the reasoning's).
    ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", '
     f'"days": 3}}}},\n    {{"tool_call_id": "1", "tool_name": "search", "parameters": {NEWS.arguments_json}}}\n]'
     "<|END_ACTION|>", COHERE, "", [PARIS, NEWS]),
    # Gemma 4: its literals (strings in <|"|> quotes, bare keys), one block per call; JSON's spellings read too.
    ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_call>call:search{filters:{lang:'
     '<|"|>en<|"|>},query:<|"|>news<|"|>,safe:false}<tool_call|>', GEMMA, "",
     [PARIS, _call("search", filters={"lang": "en"}, query="news", safe=False)]),
    ('Let me check.<|tool_call>call:search{"query": "news", "filters": {"lang": "en"}, "safe": False}<tool_call|>',
     GEMMA, "Let me check.", [NEWS]),
    # OLMo 3: pythonic calls one a line in <function_calls>; JSON's true / false / null read as Python's.
    ('I will check.\n<function_calls>\nget_weather(city="Paris", days=3)\nsearch(query="news", filters={"lang": '
     '"en"}, safe=false)\n</function_calls>', OLMO3, "I will check.", [PARIS, NEWS]),
]  # fmt: skip


def _streamed(text: str, fmt: ToolFormat, cuts: list[int]) -> ParseStep:
    parser = make_parser(fmt, NAMES, SCHEMAS)
    total = ParseStep()
    for start, end in itertools.pairwise([0, *sorted(cuts), len(text)]):
        total.extend(parser.feed(text[start:end]))
    total.extend(parser.finish())
    return total


@pytest.mark.parametrize(("text", "fmt", "content", "calls"), CASES)
def test_calls_and_content(text: str, fmt: ToolFormat, content: str, calls: list[ParsedCall]) -> None:
    step = parse_tool_calls(text, fmt, NAMES, SCHEMAS)
    assert (step.content, step.calls) == (content, calls)


@pytest.mark.parametrize(("text", "fmt", "content", "calls"), CASES)
def test_a_stream_cut_anywhere_parses_like_the_whole_text(
    text: str, fmt: ToolFormat, content: str, calls: list[ParsedCall]
) -> None:
    whole = parse_tool_calls(text, fmt, NAMES, SCHEMAS)
    for cut in range(1, len(text)):
        assert _streamed(text, fmt, [cut]) == whole, cut
    assert _streamed(text, fmt, list(range(1, len(text)))) == whole  # one character at a time


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ("<tool_call>delete_all\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>", GLM),  # unknown
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>", GLM),  # a key without a value
        ("<tool_call>get_weather\nstray<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>", GLM),
        ('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', GLM),  # Hermes JSON is not GLM's
        (f"{B}{CB}get_weather{SEP}" + '{"city": "Paris"' + f"{CE}{E}", DEEPSEEK_V31),  # cut-off JSON
        (f"{B}{CB}function{SEP}get_weather\n" + '{"city": "Paris"}' + f"{CE}{E}", DEEPSEEK),  # V3 without a fence
        (f"{B}stray{CB}get_weather{SEP}" + "{}" + f"{CE}{E}", DEEPSEEK_V31),
        (f"{B}{E}", DEEPSEEK_V31),  # an empty section
        (f"{KB}{KCB}functions.get_weather:0" + '{"city": "Paris"}' + f"{KCE}{KE}", KIMI),  # no argument marker
        (f"{KB}{KCB}functions.get_weather:0{KARGS}" + '["Paris"]' + f"{KCE}{KE}", KIMI),  # not an object
        ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
         "</minimax:tool_call>", MINIMAX),  # the invoke never closes
        ("<minimax:tool_call>\nstray\n</minimax:tool_call>", MINIMAX),
        ("<seed:tool_call>\n<function=delete_all>\n</function>\n</seed:tool_call>", SEED),
        ('<TOOLCALL>{"name": "get_weather", "arguments": {}}</TOOLCALL>', NEMOTRON),  # not a list
        ('<TOOLCALL>[{"name": "get_weather", "arguments": {}}] and</TOOLCALL>', NEMOTRON),
        ('<|tool_call_start|>[delete_all(path="/")]<|tool_call_end|>', LFM2),
        ("<|tool_call_start|>[get_weather(Paris)]<|tool_call_end|>", LFM2),  # positional
        ('<|tool_call|>[{"name": "get_weather", "arguments": {}}] and more', GRANITE),
        ('<|START_ACTION|>[{"tool_call_id": "0", "name": "get_weather", "arguments": {}}]<|END_ACTION|>', COHERE),
        ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": []}]<|END_ACTION|>',
         COHERE),
        ("<|tool_call>call:get_weather{city:Paris}<tool_call|>", GEMMA),  # a bare word is no value
        ('<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>', GEMMA),  # an unclosed quote
        ('<|tool_call>get_weather{city:<|"|>Paris<|"|>}<tool_call|>', GEMMA),  # no "call:"
        ('<|tool_call>call:delete_all{path:<|"|>/<|"|>}<tool_call|>', GEMMA),
        ('<function_calls>\nget_weather("Paris")\n</function_calls>', OLMO3),  # positional
        ("<function_calls>\n</function_calls>", OLMO3),
    ],
)  # fmt: skip
def test_malformed_calls_stay_in_the_content_as_written(text: str, fmt: ToolFormat) -> None:
    assert parse_tool_calls(text, fmt, NAMES, SCHEMAS) == ParseStep(text)


# The lines of each family's published template that the detection reads.
@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("{{ '\\n<tool_call>' + tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>", GLM),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
         " + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}",
         DEEPSEEK),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
         "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}", DEEPSEEK_V31),
        ("<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}<|tool_call_begin|>", KIMI),
        ("{%- set toolcall_begin_token = '<minimax:tool_call>' -%}<invoke name=\"tool-name-1\">", MINIMAX),
        ("{%- set toolcall_begin_token = '<seed:tool_call>' -%}\\n<function=\" + tool_call.name + \">\\n"
         "{{ \"<parameter=\" + arg_name + \">\" }}", SEED),
        ("{{- '<TOOLCALL>[' -}}{%- for call in message.tool_calls -%}", NEMOTRON),
        ('{{- "List of tools: <|tool_list_start|>[" -}}', LFM2),  # its template lists tools; its model calls
        ("{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message.tool_calls | tojson }}", GRANITE),
        ("1. Action: write <|START_ACTION|> followed by a list of JSON-formatted tool calls", COHERE),
        ("{{- '<|tool_call>call:' + function['name'] + '{' -}}", GEMMA),
        ("output them within <function_calls></function_calls> XML tags, one call a line", OLMO3),
    ],
)  # fmt: skip
def test_the_format_is_read_off_the_family_template(template: str, fmt: ToolFormat) -> None:
    assert ToolTemplate.detect(template).format is fmt


def test_every_format_can_be_named_also_by_vllms_and_sglangs_other_names() -> None:
    assert {f.value for f in ToolFormat} | set(FORMAT_ALIASES) | {"auto"} == set(TOOL_CALL_PARSERS)
    assert ToolTemplate.detect("<tool_call>{{ x }}</tool_call>", "glm47").format is GLM
    for alias, fmt in FORMAT_ALIASES.items():
        assert ToolTemplate.detect("{{ messages }}", alias).format is fmt, alias


ARGUMENTS = {"city": 'São "Paulo"\nwest', "days": 3}
XML_ARGUMENTS = {"city": "São Paulo, it's", "days": 3}  # XML values are raw text without "<"


@pytest.mark.parametrize("fmt", [f for f in ToolFormat if f is not ToolFormat.HARMONY])
def test_a_written_call_parses_back_into_the_same_call(fmt: ToolFormat) -> None:
    xml = fmt in (ToolFormat.QWEN3_CODER, GLM, MINIMAX, SEED)  # Gemma's strings hold any text but its quote
    arguments = XML_ARGUMENTS if xml else ARGUMENTS
    text = call_text(fmt, "get_weather", arguments)
    (call,) = parse_tool_calls(text, fmt, NAMES, SCHEMAS).calls
    assert (call.name, json.loads(call.arguments_json)) == ("get_weather", arguments)
    after_text = parse_tool_calls("Checking.\n" + text, fmt, NAMES, SCHEMAS)
    if fmt in (ToolFormat.LLAMA3_JSON, ToolFormat.PYTHONIC):  # their calls are the whole output
        assert after_text == ParseStep("Checking.\n" + text)
    else:
        assert after_text == ParseStep("Checking.", [call])


def test_kimi_calls_keep_the_id_the_model_wrote_and_others_get_fresh_ones() -> None:
    text = f"{KB}{KCB}functions.get_weather:3{KARGS}" + '{"city": "Oslo"}' + f"{KCE}{KE}"
    stream = ToolCallStream(ToolParsing(KIMI, frozenset(NAMES)))
    _, deltas = stream.feed(text, final=True)
    assert [d.id for d in deltas if d.id] == ["functions.get_weather:3"] == [c.id for c in stream.calls]
    glm = ToolCallStream(ToolParsing(GLM, frozenset(NAMES)))
    glm.feed(call_text(GLM, "get_weather", {"city": "Oslo"}), final=True)
    assert [c.id.startswith("call_") for c in glm.calls] == [True]


WEATHER = ChatTool("get_weather", "Current weather", SCHEMAS["get_weather"])
HISTORY = [
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", tool_calls=(ChatToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
    ChatMessage("tool", "18C", tool_call_id="call_1"),
]


def test_the_fallback_teaches_the_template_format_and_writes_history_in_it() -> None:
    prompt = tools_system_prompt([WEATHER], DEEPSEEK)
    example = prompt[prompt.index(B) : prompt.index(E) + len(E)]
    assert [c.name for c in parse_tool_calls(example, DEEPSEEK).calls] == ["function_name"]
    plain = plain_history(HISTORY, KIMI)
    (call,) = parse_tool_calls(plain[1].content, KIMI, NAMES).calls
    assert json.loads(call.arguments_json) == {"city": "Paris"}
    assert "<tool_call>" in tools_system_prompt([WEATHER])  # Hermes stays the default
    # harmony's calls are messages, not text: a plain template forced to it (--tool-call-parser openai) is taught
    # Hermes' and its history written so
    assert tools_system_prompt([WEATHER], ToolFormat.HARMONY) == tools_system_prompt([WEATHER])
    assert plain_history(HISTORY, ToolFormat.HARMONY) == plain_history(HISTORY)


@pytest.fixture
def deepseek_v31(smollm2_tokenizer: Any) -> Any:
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = (  # DeepSeek V3.1's layout: the arguments joined to text, no tools listed
        "{% for m in messages %}{% if m.tool_calls %}{{ '<｜tool▁calls▁begin｜>' }}{% for t in m.tool_calls %}"
        "{{ '<｜tool▁call▁begin｜>' + t['function']['name'] + '<｜tool▁sep｜>' + t['function']['arguments'] + "
        "'<｜tool▁call▁end｜>' }}{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% else %}{{ m.role }}: {{ m.content }}\n"
        "{% endif %}{% endfor %}"
    )
    return tokenizer


def test_a_template_that_joins_the_arguments_to_text_gets_the_callers_json(deepseek_v31: Any) -> None:
    text = render_chat(deepseek_v31, HISTORY)
    assert f"{CB}get_weather{SEP}" + '{"city": "Paris"}' + CE in text
    plain = render_chat(deepseek_v31, HISTORY[:1])  # no calls: rendered once, as before
    assert plain == "user: Weather in Paris?\n"


def test_a_deepseek_template_keeps_special_tokens_and_is_taught_its_own_format(deepseek_v31: Any) -> None:
    inputs = InputProcessor(deepseek_v31, 49152, 2048, eos_token_ids=[2])
    assert inputs.tool_template == ToolTemplate(DEEPSEEK_V31, native_tools=False, native_history=True)
    prepared = inputs.prepare(ChatPrompt(HISTORY[:1], [WEATHER]), SamplingParams())
    assert prepared.tool_parsing is not None and prepared.tool_parsing.format is DEEPSEEK_V31
    assert prepared.params.skip_special_tokens is False
    text = inputs.render(ChatPrompt(HISTORY[:1], [WEATHER]))
    assert f"{B}{CB}function_name{SEP}" in text  # the fallback prompt's example is in V3.1's own layout


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than json's decoder recurses


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        (f"<tool_call>{DEEP}</tool_call>", ToolFormat.HERMES),
        (f'<tool_call>{{"name": "search", "arguments": {DEEP}}}</tool_call>', ToolFormat.HERMES),
        (f"[TOOL_CALLS] {DEEP}", ToolFormat.MISTRAL),
        (DEEP, ToolFormat.LLAMA3_JSON),
        (f"{B}{CB}search{SEP}{DEEP}{CE}{E}", DEEPSEEK_V31),
        (f"<TOOLCALL>{DEEP}</TOOLCALL>", NEMOTRON),
        (f"<|tool_call>call:search{{query:{DEEP}}}<tool_call|>", GEMMA),
    ],
    ids=["hermes", "hermes-arguments", "mistral", "llama3-json", "deepseek", "nemotron", "gemma4"],
)
def test_nesting_deeper_than_the_json_decoder_recurses_stays_text(text: str, fmt: ToolFormat) -> None:
    assert parse_tool_calls(text, fmt, NAMES, SCHEMAS) == ParseStep(text)


def test_an_xml_value_too_deep_to_read_as_its_type_stays_the_text_written() -> None:
    glm = f"<tool_call>search\n<arg_key>filters</arg_key>\n<arg_value>{DEEP}</arg_value>\n</tool_call>"
    assert parse_tool_calls(glm, GLM, NAMES, SCHEMAS).calls == [_call("search", filters=DEEP)]
