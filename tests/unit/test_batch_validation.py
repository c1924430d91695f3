"""`validation.validate_file` answers exactly what `lines.validate` does, in its thread and in its child
process, for good files and for every kind of bad line; a missing file is FileNotFoundError on both paths, and a
cancelled check leaves no child behind."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from gateway.batches import lines, validation
from ladle.v1 import engine_pb2

CHAT = "/v1/chat/completions"
MODEL = "m"
MAX_LINE_BYTES = 128 * 1024  # room for the deeply nested line
THREAD, CHILD = 1 << 30, 0  # process_above_bytes: every file in a thread, or every file in the child


def chat_line(custom_id: str, **body: Any) -> bytes:
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}}
    return json.dumps(item).encode()


FILES = {
    "good": [chat_line("a"), chat_line("b", max_tokens=3), b"", b"  "],
    "bad": [
        chat_line("a"), b"{not json", chat_line("a"), chat_line("c", temperature=9), chat_line("d", model="x"),
        b"[" * 100_000,  # nests too deeply for json.loads: RecursionError inside, this line's error outside
        b'{"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {}}',
        chat_line("f", padding="x" * MAX_LINE_BYTES),  # too long
        chat_line("g"),
    ],
    "empty": [b"", b"\n"],
}


def reference(path: Path, endpoint: str | None) -> tuple[int, list[lines.LineError]]:
    with path.open("rb") as f:
        return lines.validate(lines.read_lines(f, MAX_LINE_BYTES), endpoint, MODEL)


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("endpoint", [CHAT, None])
@pytest.mark.parametrize("process_above_bytes", [THREAD, CHILD], ids=["thread", "child"])
async def test_both_paths_answer_as_lines_validate(
    tmp_path: Path, name: str, endpoint: str | None, process_above_bytes: int
) -> None:
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"\n".join(FILES[name]) + b"\n")
    expected = reference(path, endpoint)
    got = await validation.validate_file(path, endpoint, MODEL, MAX_LINE_BYTES, process_above_bytes)
    assert got == expected
    assert (name == "good") == (expected[1] == [])


def test_the_bad_file_has_one_error_per_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"\n".join(FILES["bad"]) + b"\n")
    count, errors = reference(path, CHAT)
    assert count == 9
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_body"), (5, "model_not_found"),
        (6, "invalid_json_line"), (7, "invalid_url"), (8, "line_too_long")]


@pytest.mark.parametrize("process_above_bytes", [THREAD, CHILD], ids=["thread", "child"])
async def test_a_missing_file_is_file_not_found(tmp_path: Path, process_above_bytes: int) -> None:
    with pytest.raises(FileNotFoundError):
        await validation.validate_file(tmp_path / "gone.jsonl", CHAT, MODEL, MAX_LINE_BYTES, process_above_bytes)


async def test_the_childs_os_error_comes_back_as_the_same_error(tmp_path: Path) -> None:
    # The file can go between validate_file's stat and the child's open: the child answers with the errno.
    with pytest.raises(FileNotFoundError):
        await validation._check_in_child(tmp_path / "gone.jsonl", CHAT, MODEL, MAX_LINE_BYTES)
    with pytest.raises(IsADirectoryError):
        await validation._check_in_child(tmp_path, CHAT, MODEL, MAX_LINE_BYTES)


def validation_children() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "gateway.batches.validation" in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return found


async def test_cancelling_a_check_kills_its_child(tmp_path: Path) -> None:
    path = tmp_path / "input.jsonl"
    with path.open("wb") as f:
        for i in range(200_000):
            f.write(chat_line(str(i)) + b"\n")
    check = asyncio.create_task(validation.validate_file(path, CHAT, MODEL, MAX_LINE_BYTES))
    for _ in range(200):
        await asyncio.sleep(0.02)
        if validation_children():
            break
    assert validation_children(), "the check of a large file runs in a child process"
    check.cancel()
    with pytest.raises(asyncio.CancelledError):
        await check
    assert validation_children() == []


@pytest.mark.parametrize("process_above_bytes", [THREAD, CHILD], ids=["thread", "child"])
async def test_pooling_lines_are_bounded_by_the_models_info(tmp_path: Path, process_above_bytes: int) -> None:
    """With the engine's model info, a line asks for no more than the synchronous route allows (here: embeddings
    longer than the model's), so it fails validation instead of failing when it runs."""
    info = engine_pb2.GetModelInfoResponse(model_id=MODEL, context_length=128,
                                           pooling=engine_pb2.PoolingInfo(dimensions=8))

    def embed_line(custom_id: str, **body: Any) -> bytes:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                           "body": {"model": MODEL, "input": ["a", "b"], **body}}).encode()

    path = tmp_path / "input.jsonl"
    path.write_bytes(b"\n".join([embed_line("a", dimensions=8), embed_line("b", dimensions=9),
                                 embed_line("c", truncate_prompt_tokens=-1)]) + b"\n")
    count, errors = await validation.validate_file(path, "/v1/embeddings", MODEL, MAX_LINE_BYTES,
                                                   process_above_bytes, info=info)
    assert count == 3 and [(e.line, e.code, e.param) for e in errors] == [(2, "invalid_body", "body.dimensions")]
    assert "this model's embeddings have 8" in errors[0].message
    # Without the info (no engine answered yet) the line passes here and the engine's bound applies when it runs.
    assert (await validation.validate_file(path, "/v1/embeddings", MODEL, MAX_LINE_BYTES, process_above_bytes))[1] == []
