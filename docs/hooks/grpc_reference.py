"""The site's gRPC reference page, generated from proto/ladle/v1/*.proto at every build (an MkDocs hook).

protoc (grpc_tools) compiles the contract into a FileDescriptorSet with its source info, and the page is written
from that: each service's RPCs with their request and response types, each message's fields (number, type,
label) and each enum's values, every one with the comment that precedes it in the .proto, and links between the
types. The page is added to the build as a generated file, never committed, so it cannot drift from the contract.
"""

from __future__ import annotations

import html
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PAGE = "grpc-reference.md"
PACKAGE = "ladle.v1"
PACKAGE_DIR = Path(*PACKAGE.split("."))

# SourceCodeInfo paths: field numbers of FileDescriptorProto, DescriptorProto, ServiceDescriptorProto and
# EnumDescriptorProto (descriptor.proto), which locate a declaration's comments.
_SYNTAX, _MESSAGE, _ENUM, _SERVICE = 12, 4, 5, 6
_FIELD, _NESTED_MESSAGE, _NESTED_ENUM = 2, 3, 4
_METHOD = 2
_ENUM_VALUE = 2

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in _FDP.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs hook: add the reference page, built from the proto files next to mkdocs.yml."""
    root = Path(config.config_file_path).parent
    files.append(File.generated(config, PAGE, content=render(compile_protos(root / "proto"))))
    return files


def compile_protos(proto_root: Path) -> descriptor_pb2.FileDescriptorSet:
    """The contract's files (proto_root/ladle/v1/*.proto) as descriptors with their comments."""
    names = sorted(str(p.relative_to(proto_root)) for p in (proto_root / PACKAGE_DIR).glob("*.proto"))
    if not names:
        raise RuntimeError(f"no .proto files under {proto_root / PACKAGE_DIR}")
    well_known = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "contract.binpb"
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", "--include_source_info",
                f"--descriptor_set_out={out}", *names]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on the contract; see the messages above")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


@dataclass(frozen=True)
class _File:
    """One .proto file and the comments of its declarations, by source path."""

    proto: descriptor_pb2.FileDescriptorProto
    comments: dict[tuple[int, ...], str]

    @classmethod
    def of(cls, proto: descriptor_pb2.FileDescriptorProto) -> _File:
        comments = {
            tuple(loc.path): loc.leading_comments.strip("\n")
            for loc in proto.source_code_info.location
            if loc.leading_comments
        }
        return cls(proto, comments)

    def comment(self, *path: int) -> str:
        return self.comments.get(path, "")


def render(descriptors: descriptor_pb2.FileDescriptorSet) -> str:
    """The reference page's Markdown."""
    files = [_File.of(f) for f in sorted(descriptors.file, key=lambda f: f.name)]
    map_entries = {
        name: message for f in files for name, message, _ in _messages(f.proto) if message.options.map_entry
    }
    out = [
        "# gRPC reference",
        "",
        "`ladle.v1`, as `proto/ladle/v1/*.proto` declares it. This page is generated from the .proto files and "
        "their comments at every build of the site (`docs/hooks/grpc_reference.py`), so it says what the "
        "contract says. How to call the engine: [the gRPC contract and clients](grpc.md).",
        "",
    ]
    for f in files:
        out += [f"**`{f.proto.name}`**", "", *_prose(f.comment(_SYNTAX)), ""]
    out += ["## Services", ""]
    for f in files:
        for s_index, service in enumerate(f.proto.service):
            full = f"{f.proto.package}.{service.name}"
            out += [f"### {service.name} {{#{full}}}", "", *_prose(f.comment(_SERVICE, s_index)), ""]
            for m_index, method in enumerate(service.method):
                request = _stream(method.client_streaming) + _link(method.input_type)
                response = _stream(method.server_streaming) + _link(method.output_type)
                out += [f"#### {method.name} {{#{full}.{method.name}}}", "",
                        f"`rpc {method.name}` ({request}) returns ({response})", "",
                        *_prose(f.comment(_SERVICE, s_index, _METHOD, m_index)), ""]
    out += ["## Messages", ""]
    for f in files:
        for name, message, path in _messages(f.proto):
            if not message.options.map_entry:
                out += _message(f, name, message, path, map_entries)
    out += ["## Enums", ""]
    for f in files:
        for name, enum, path in _enums(f.proto):
            out += _enum(f, name, enum, path)
    return "\n".join(out).rstrip("\n") + "\n"


def _messages(
    proto: descriptor_pb2.FileDescriptorProto,
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto, tuple[int, ...]]]:
    """Every message of the file, nested ones after their parent, by full name (no leading dot)."""

    def walk(
        message: descriptor_pb2.DescriptorProto, prefix: str, path: tuple[int, ...]
    ) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto, tuple[int, ...]]]:
        name = f"{prefix}.{message.name}"
        yield name, message, path
        for i, nested in enumerate(message.nested_type):
            yield from walk(nested, name, (*path, _NESTED_MESSAGE, i))

    for i, message in enumerate(proto.message_type):
        yield from walk(message, proto.package, (_MESSAGE, i))


def _enums(
    proto: descriptor_pb2.FileDescriptorProto,
) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto, tuple[int, ...]]]:
    for i, enum in enumerate(proto.enum_type):
        yield f"{proto.package}.{enum.name}", enum, (_ENUM, i)
    for name, message, path in _messages(proto):
        for i, enum in enumerate(message.enum_type):
            yield f"{name}.{enum.name}", enum, (*path, _NESTED_ENUM, i)


def _message(
    f: _File,
    name: str,
    message: descriptor_pb2.DescriptorProto,
    path: tuple[int, ...],
    map_entries: dict[str, descriptor_pb2.DescriptorProto],
) -> list[str]:
    out = [f"### {_short(name)} {{#{name}}}", "", *_prose(f.comment(*path)), ""]
    if not message.field:
        return [*out, "No fields.", ""]
    out += ["| field | number | type | label | description |", "|---|---|---|---|---|"]
    for i, field in enumerate(message.field):
        entry = map_entries.get(field.type_name.lstrip("."))
        if entry is not None:
            type_, label = f"map&lt;{_type(entry.field[0])}, {_type(entry.field[1])}&gt;", ""
        else:
            type_, label = _type(field), _label(message, field)
        comment = _cell(f.comment(*path, _FIELD, i))
        out.append(f"| `{field.name}` | {field.number} | {type_} | {label} | {comment} |")
    return [*out, ""]


def _enum(f: _File, name: str, enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...]) -> list[str]:
    out = [f"### {_short(name)} {{#{name}}}", "", *_prose(f.comment(*path)), "",
           "| value | number | description |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        out.append(f"| `{value.name}` | {value.number} | {_cell(f.comment(*path, _ENUM_VALUE, i))} |")
    return [*out, ""]


def _type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type in (_FDP.TYPE_MESSAGE, _FDP.TYPE_ENUM):
        return _link(field.type_name)
    return f"`{_SCALARS[field.type]}`"


def _label(message: descriptor_pb2.DescriptorProto, field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.label == _FDP.LABEL_REPEATED:
        return "repeated"
    if field.proto3_optional:
        return "optional"
    if field.HasField("oneof_index"):
        return f"oneof `{message.oneof_decl[field.oneof_index].name}`"
    return ""


def _link(type_name: str) -> str:
    """A message or enum type: a link to its section when the contract declares it, else its full name."""
    name = type_name.lstrip(".")
    if name.startswith("google.protobuf."):
        return f"`{name}`"
    return f"[{_short(name)}](#{name})"


def _short(name: str) -> str:
    """The name within the package: `ladle.v1.Input` -> `Input`."""
    return name.removeprefix(PACKAGE + ".")


def _stream(streaming: bool) -> str:
    return "stream " if streaming else ""


def _escape(text: str) -> str:
    """Comment text as Markdown that shows it literally, except `code spans`, which stay code."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = html.escape(parts[i], quote=False).replace("*", r"\*").replace("_", r"\_").replace("[", r"\[")
    return "`".join(parts)


def _cell(comment: str) -> str:
    return _escape(" ".join(line.strip() for line in comment.splitlines() if line.strip())).replace("|", r"\|")


def _prose(comment: str) -> list[str]:
    """A leading comment as paragraphs; indented lines (aligned lists in the .proto) as a preformatted block."""
    out: list[str] = []
    paragraph: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if paragraph:
            out.extend([_escape(" ".join(paragraph)), ""])
            paragraph.clear()
        if block:
            out.extend(["```text", *block, "```", ""])
            block.clear()

    for raw in comment.splitlines():
        line = raw[1:] if raw.startswith(" ") else raw  # protoc keeps the space after //
        if line.startswith(" ") and line.strip():
            if paragraph:
                flush()
            block.append(line.strip())
        elif line.strip():
            if block:
                flush()
            paragraph.append(line.strip())
        else:
            flush()
    flush()
    return out[:-1] if out else out
