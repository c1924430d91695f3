"""The `ladle` command line: fixed names, LADLE_* environment defaults, honest 'not built' answers."""

from __future__ import annotations

import pytest

from ladle import cli


def test_flags_have_design_defaults() -> None:
    args = cli.build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.grpc_port, args.device) == (
        "default", "127.0.0.1", 8000, 50051, "auto",
    )


def test_flags_read_ladle_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LADLE_PORT", "9100")
    monkeypatch.setenv("LADLE_MODEL", "dummy:qwen2.5-0.5b")
    monkeypatch.setenv("LADLE_GRPC_PORT", "50099")
    args = cli.build_parser().parse_args(["serve"])
    assert (args.port, args.model, args.grpc_port) == (9100, "dummy:qwen2.5-0.5b", 50099)
    assert cli.build_parser().parse_args(["serve", "--port", "7000"]).port == 7000


def test_unbuilt_commands_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["batch", "-i", "in.jsonl", "-o", "out.jsonl"])
    assert exit_info.value.code == cli.NOT_BUILT
    assert "not built yet" in capsys.readouterr().err


def test_enforce_eager_flag_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from ladle.serve import _engine_command

    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).enforce_eager is False
    assert parser.parse_args(["engine", "--enforce-eager"]).enforce_eager is True
    serve_args = parser.parse_args(["serve", "--enforce-eager"])
    assert "--enforce-eager" in _engine_command(serve_args, "127.0.0.1:50051")
    assert "--enforce-eager" not in _engine_command(parser.parse_args(["serve"]), "127.0.0.1:50051")
    monkeypatch.setenv("LADLE_ENFORCE_EAGER", "1")
    assert cli.build_parser().parse_args(["engine"]).enforce_eager is True


def test_async_scheduling_flag_reaches_the_engine() -> None:
    from ladle.serve import _engine_command

    parser = cli.build_parser()
    assert cli.ASYNC_SCHEDULING[parser.parse_args(["engine"]).async_scheduling] is None  # auto: on CUDA
    assert cli.ASYNC_SCHEDULING[parser.parse_args(["engine", "--async-scheduling", "off"]).async_scheduling] is False
    command = _engine_command(parser.parse_args(["serve", "--async-scheduling", "on"]), "127.0.0.1:50051")
    assert command[command.index("--async-scheduling") + 1] == "on"
