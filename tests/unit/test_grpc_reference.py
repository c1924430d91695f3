"""The site's gRPC reference page (docs/hooks/grpc_reference.py): written from the .proto files, it names every RPC,
message, enum and field of the contract, with the comments the .proto gives them."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_FILES = sorted((ROOT / "proto" / "ladle" / "v1").glob("*.proto"))


def _hook() -> ModuleType:
    """docs/hooks is not a package: load the hook the way MkDocs does, from its path."""
    spec = importlib.util.spec_from_file_location("grpc_reference", ROOT / "docs" / "hooks" / "grpc_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page() -> str:
    hook = _hook()
    return str(hook.render(hook.compile_protos(ROOT / "proto")))


def _declared(kind: str) -> list[str]:
    """Names declared in the .proto files by a plain reading of their text (independent of the hook)."""
    pattern = re.compile(rf"^\s*{kind}\s+(\w+)", re.MULTILINE)
    return [name for path in PROTO_FILES for name in pattern.findall(path.read_text())]


def test_every_rpc_is_a_section_with_its_types(page: str) -> None:
    rpcs = _declared("rpc")
    assert {"Generate", "Stream", "Batch", "Tokenize", "GetModelInfo", "GetLoad", "Embed", "Score"} <= set(rpcs)
    for rpc in rpcs:
        assert f"#### {rpc} {{#ladle.v1.EngineService.{rpc}}}" in page
    assert ("`rpc Batch` (stream [BatchRequest](#ladle.v1.BatchRequest)) returns "
            "(stream [BatchResponse](#ladle.v1.BatchResponse))") in page


def test_every_message_and_enum_has_a_section(page: str) -> None:
    names = _declared("message") + _declared("enum")
    assert len(names) > 40
    for name in names:
        assert f"### {name} {{#ladle.v1.{name}}}" in page


def test_comments_fields_and_links(page: str) -> None:
    # An RPC's comment, a message's, a field's (in its table row) and an enum value's, as the .proto words them.
    assert ("Batch takes many independent items and returns each item's result as soon as it finishes, tagged "
            "with the caller's item id, in completion order.") in page
    assert "GenerateRequest asks for one generation, returned whole." in page
    assert ("| `input` | 2 | [Input](#ladle.v1.Input) |  | What to continue: text, chat messages or token ids. |"
            in page)
    assert "| `PRIORITY_BATCH` | 2 | Throughput traffic; runs when interactive requests leave room. |" in page
    # Labels: proto3 optional, repeated, oneof members; a map field's key and value types.
    assert "| `add_generation_prompt` | 4 | `bool` | optional |" in page
    assert "| `text` | 1 | `string` | oneof `kind` |" in page
    assert "| `logit_bias` | 9 | map&lt;`uint32`, `float`&gt; |" in page
    # Every link points at a section of the page.
    anchors = set(re.findall(r"\{#([\w.]+)\}", page))
    assert set(re.findall(r"\]\(#([\w.]+)\)", page)) <= anchors
