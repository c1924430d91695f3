"""A `ladle engine` child process for the commands that run one on this host (`ladle serve`, `ladle batch`).

The child asks the kernel to send it SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG), so a parent that is
killed outright (SIGKILL) does not leave an engine behind holding its port and the model's memory; it then
drains and exits like on any SIGTERM. It ignores SIGHUP: `ladle serve`'s gateway reads its API keys again on
SIGHUP, and the same signal sent to the process group (`kill -HUP -<pgid>`, a closing terminal) would otherwise
end the engine, and `ladle serve` with it. Its parent still stops it on SIGINT/SIGTERM.

Such an engine listens on loopback, where every local user can reach it, so it requires a token
(`--auth-token-file`): one the user gave, else a random one per start, written to a file only this user can read
(`engine_token_file`: 0600 in a 0700 temporary folder, removed when the command ends).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine_server.config import SpeculativeConfig
from ladle.auth import new_token

_PR_SET_PDEATHSIG = 1


def engine_command(args: argparse.Namespace, host: str, port: int) -> list[str]:
    """The `ladle engine` command line for the engine flags in `args` (the `serve` / `batch` parsers' own)."""
    command = [
        sys.executable, "-m", "ladle_cli", "engine", "--model", args.model, "--device", args.device,
        "--host", host, "--port", str(port), "--shutdown-timeout", str(args.shutdown_timeout),
        "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
        "--max-cross-attention-images", str(args.max_cross_attention_images),
        "--max-transcription-seconds", str(args.max_transcription_seconds),
        "--kv-cache-mib", str(args.kv_cache_mib), "--kv-cache-dtype", args.kv_cache_dtype,
        "--state-snapshots", "auto" if args.state_snapshots is None else str(args.state_snapshots),
        "--grammar-timeout", str(args.grammar_timeout),
        "--async-scheduling", args.async_scheduling, "--quantization", args.quantization,
        "--tool-call-parser", args.tool_call_parser, "--reasoning-parser", args.reasoning_parser,
        "--generation-config", args.generation_config,
        "--override-generation-config", args.override_generation_config,
        "--hf-overrides", args.hf_overrides, "--chat-template", args.chat_template,
        "--batch-step-target", "auto" if args.batch_step_target is None else str(args.batch_step_target),
        "--speculative-config", _speculative_json(args.speculative_config),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
    ]
    if args.enable_lora:
        command.append("--enable-lora")
    lora_modules = args.lora_modules.split() if isinstance(args.lora_modules, str) else args.lora_modules
    if lora_modules:
        command += ["--lora-modules", *lora_modules]
    command += ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank),
                "--max-cpu-loras", str(args.max_cpu_loras)]  # fmt: skip
    if args.engine_auth_token_file:
        command += ["--auth-token-file", args.engine_auth_token_file]
    if args.otlp_traces_endpoint:
        command += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return [*command, "--enforce-eager"] if args.enforce_eager else command


@contextlib.contextmanager
def engine_token_file(given: str) -> Iterator[str]:
    """`given` (a token file the user chose) if set; else the path of a fresh random token's file that only this
    user can read, removed (with its folder) when the block ends."""
    if given:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="ladle-engine-") as folder:  # mode 0700
        path = Path(folder) / "token"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(new_token() + "\n")
        yield str(path)


def _speculative_json(config: SpeculativeConfig | None) -> str:
    """The --speculative-config text for a parsed configuration ("" for none)."""
    return "" if config is None else json.dumps(dataclasses.asdict(config))


async def spawn_engine(command: list[str], **kwargs: Any) -> asyncio.subprocess.Process:
    """Start `command` as a child that dies with this process (see the module docstring)."""
    parent = os.getpid()

    def die_with_parent() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # an ignored signal stays ignored across exec
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)

    return await asyncio.create_subprocess_exec(*command, preexec_fn=die_with_parent, **kwargs)


async def stop_engine(engine: asyncio.subprocess.Process, timeout: float) -> None:
    """SIGTERM (the engine drains), then SIGKILL if it has not exited within `timeout` seconds."""
    if engine.returncode is None:
        engine.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(engine.wait(), timeout)
        except TimeoutError:
            engine.kill()
            await engine.wait()
