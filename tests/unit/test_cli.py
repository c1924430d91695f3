"""The `ladle` command line: fixed names, LADLE_* environment defaults, flags reaching the engine child."""

from __future__ import annotations

from pathlib import Path

import pytest

import ladle_cli as cli
from engine_server.config import EngineConfig
from ladle_cli.engine_child import engine_command


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


def test_batch_refuses_a_missing_input_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert exit_info.value.code == 2
    assert "no input file" in capsys.readouterr().err


def test_enforce_eager_flag_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).enforce_eager is False
    assert parser.parse_args(["engine", "--enforce-eager"]).enforce_eager is True
    serve_args = parser.parse_args(["serve", "--enforce-eager"])
    assert "--enforce-eager" in engine_command(serve_args, "127.0.0.1", 50051)
    assert "--enforce-eager" not in engine_command(parser.parse_args(["serve"]), "127.0.0.1", 50051)
    assert "--enforce-eager" in engine_command(parser.parse_args(["batch", "-i", "a", "-o", "b", "--enforce-eager"]),
                                               "127.0.0.1", 0)
    monkeypatch.setenv("LADLE_ENFORCE_EAGER", "1")
    assert cli.build_parser().parse_args(["engine"]).enforce_eager is True


def test_async_scheduling_flag_reaches_the_engine() -> None:
    parser = cli.build_parser()
    assert cli.ASYNC_SCHEDULING[parser.parse_args(["engine"]).async_scheduling] is None  # auto: on CUDA
    assert cli.ASYNC_SCHEDULING[parser.parse_args(["engine", "--async-scheduling", "off"]).async_scheduling] is False
    command = engine_command(parser.parse_args(["serve", "--async-scheduling", "on"]), "127.0.0.1", 50051)
    assert command[command.index("--async-scheduling") + 1] == "on"


def test_tool_call_parser_flag_reaches_the_engine() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).tool_call_parser == "auto"
    command = engine_command(parser.parse_args(["serve", "--tool-call-parser", "mistral"]), "127.0.0.1", 50051)
    assert command[command.index("--tool-call-parser") + 1] == "mistral"
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "--tool-call-parser", "nonesuch"])


def test_batch_output_resume_drops_a_half_written_line(tmp_path: Path) -> None:
    from ladle_cli.batch_file import BatchFileError, completed_custom_ids

    output = tmp_path / "out.jsonl"
    assert completed_custom_ids(output) == set() and output.read_bytes() == b""
    whole = b'{"custom_id": "a", "response": {}}\n{"custom_id": "b", "response": {}}\n'
    output.write_bytes(whole + b'{"custom_id": "c", "resp')
    assert completed_custom_ids(output) == {"a", "b"}
    assert output.read_bytes() == whole  # the cut-off line is gone; "c" runs again
    output.write_bytes(b"not json\n")
    with pytest.raises(BatchFileError, match="line 1"):
        completed_custom_ids(output)


def test_generation_config_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["engine"])
    assert (args.generation_config, args.override_generation_config) == ("auto", "")
    override = '{"temperature": 0.7}'
    for command in ("serve", "batch"):
        extra = ["-i", "a", "-o", "b"] if command == "batch" else []
        child = engine_command(
            parser.parse_args([command, *extra, "--generation-config", "ladle", "--override-generation-config",
                               override]),
            "127.0.0.1", 50051,
        )  # fmt: skip
        assert child[child.index("--generation-config") + 1] == "ladle"
        assert child[child.index("--override-generation-config") + 1] == override
        assert cli.build_parser().parse_args(child[3:]).override_generation_config == override  # the child parses it
    monkeypatch.setenv("LADLE_GENERATION_CONFIG", "/models/x")
    monkeypatch.setenv("LADLE_OVERRIDE_GENERATION_CONFIG", override)
    args = cli.build_parser().parse_args(["engine"])
    assert (args.generation_config, args.override_generation_config) == ("/models/x", override)


def test_quantization_flag_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).quantization == "auto"
    for command in ("serve", "batch"):
        extra = ["-i", "a", "-o", "b"] if command == "batch" else []
        child = engine_command(parser.parse_args([command, *extra, "--quantization", "gguf"]), "127.0.0.1", 50051)
        assert child[child.index("--quantization") + 1] == "gguf"
        assert cli.build_parser().parse_args(child[3:]).quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "--quantization", "int4"])
    monkeypatch.setenv("LADLE_QUANTIZATION", "int8")
    assert cli.build_parser().parse_args(["engine"]).quantization == "int8"


def test_batch_step_target_flag_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).batch_step_target is None  # auto: the engine picks by device
    assert parser.parse_args(["engine", "--batch-step-target", "0"]).batch_step_target == 0.0
    for command in ("serve", "batch"):
        extra = ["-i", "a", "-o", "b"] if command == "batch" else []
        for value, expected in (("0.05", 0.05), ("auto", None)):
            child = engine_command(parser.parse_args([command, *extra, "--batch-step-target", value]), "127.0.0.1", 0)
            assert cli.build_parser().parse_args(child[3:]).batch_step_target == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "--batch-step-target", "-1"])
    monkeypatch.setenv("LADLE_BATCH_STEP_TARGET", "0.3")
    assert cli.build_parser().parse_args(["engine"]).batch_step_target == 0.3


def test_state_snapshots_flag_reaches_the_engine() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).state_snapshots is None  # auto: sized from the KV cache memory
    for command in ("serve", "batch"):
        extra = ["-i", "a", "-o", "b"] if command == "batch" else []
        for value, expected in (("0", 0), ("12", 12), ("auto", None)):
            child = engine_command(parser.parse_args([command, *extra, "--state-snapshots", value]), "127.0.0.1", 0)
            assert cli.build_parser().parse_args(child[3:]).state_snapshots == expected
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["engine", "--state-snapshots", bad])


def test_speculative_config_is_vllms_json_and_reaches_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).speculative_config is None
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'  # vLLM's documented example
    parsed = parser.parse_args(["engine", "--speculative-config", spec]).speculative_config
    assert (parsed.method, parsed.num_speculative_tokens, parsed.prompt_lookup_max) == ("ngram", 4, 4)
    for command in ("serve", "batch"):
        extra = ["-i", "a", "-o", "b"] if command == "batch" else []
        child = engine_command(parser.parse_args([command, *extra, "--speculative-config", spec]), "127.0.0.1", 1)
        assert cli.build_parser().parse_args(child[3:]).speculative_config == parsed  # the child parses it
        plain = engine_command(parser.parse_args([command, *extra]), "127.0.0.1", 1)
        assert plain[plain.index("--speculative-config") + 1] == ""  # off
    for bad, fragment in [
        ('{"method": "ngram", "lookahead": 3}', "unknown key(s) lookahead"),
        ("{method: ngram}", "not JSON"),
        ('{"num_speculative_tokens": 4}', 'with a "method"'),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "[1, 32]"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args(["engine", "--speculative-config", bad])
        assert fragment in capsys.readouterr().err, bad


def test_hf_overrides_reach_the_engine_child() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["engine"]).hf_overrides == ""
    override = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
    child = engine_command(parser.parse_args(["serve", "--hf-overrides", override]), "127.0.0.1", 50051)
    assert cli.build_parser().parse_args(child[3:]).hf_overrides == override


def test_vllms_chat_template_and_auto_tool_choice_flags_are_taken(tmp_path: Path) -> None:
    parser = cli.build_parser()
    template = tmp_path / "tool_chat_template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--chat-template", str(template)])
    child = cli.build_parser().parse_args(engine_command(args, "127.0.0.1", 50051)[3:])
    assert child.chat_template == str(template)
    assert EngineConfig(chat_template=str(template)).chat_template_text() == template.read_text()
    assert EngineConfig(chat_template="{{ messages }}").chat_template_text() == "{{ messages }}"  # the text itself
    assert EngineConfig().chat_template_text() is None
    with pytest.raises(ValueError, match="is not a file"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
