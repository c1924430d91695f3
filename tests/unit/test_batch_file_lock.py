"""`ladle batch` holds its output file: while another process holds it, a run refuses at once with exit status 75
and a message, leaving the file untouched (before, it truncated the other run's half-written last line and then
ran, and appended, the same lines again)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from ladle_cli import batch_file
from ladle_cli.main import build_parser
from tests.e2e.gateway_process import free_port


def run(source: Path, output: Path) -> int:
    args = build_parser().parse_args(["batch", "-i", str(source), "-o", str(output), "--engine",
                                      f"127.0.0.1:{free_port()}"])  # nothing listens there
    return batch_file.run_batch_file(args)


def test_a_second_run_on_the_same_output_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(batch_file, "CONNECT_TIMEOUT_S", 0.5)
    source = tmp_path / "in.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    source.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                          "body": body}) + "\n" for i in range(3)))
    output = tmp_path / "out.jsonl"
    written = json.dumps({"custom_id": "q0", "response": {"status_code": 200}}) + "\n" + '{"custom_id": "q1", "resp'
    output.write_text(written)  # the first run is in the middle of a line
    holder = os.open(output, os.O_WRONLY | os.O_APPEND)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the first run does
        assert run(source, output) == batch_file.OUTPUT_IN_USE == 75
        assert "is being written by another `ladle batch` run" in capsys.readouterr().err
        assert output.read_text() == written
    finally:
        os.close(holder)
    assert run(source, output) == 1  # once it is free, a run goes on (to find no engine here)
    assert output.read_text() == written.split("\n")[0] + "\n"  # the cut line dropped, to be run again
    assert "no engine SERVING" in capsys.readouterr().err


def test_an_output_that_cannot_be_opened_is_an_input_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("{}\n")
    assert run(source, tmp_path) == batch_file.INVALID_INPUT  # a directory
    assert f"cannot open {tmp_path}" in capsys.readouterr().err
