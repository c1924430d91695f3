"""`ladle serve`: a `ladle engine` child process plus the gateway in this process, on one host.

The engine runs in its own process so its step loop never shares an interpreter (and GIL) with HTTP work. The
gateway starts at once and answers 503 until the engine is SERVING; a `ready` line is printed once the gateway
itself sees it SERVING (so requests succeed from then on). If the
engine exits, the gateway stops and `ladle serve` returns the engine's exit status; on SIGINT/SIGTERM both stop.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys

from gateway.config import GatewayConfig
from gateway.server import serve
from ladle.log import configure_logging


def _engine_command(args: argparse.Namespace, address: str) -> list[str]:
    host, _, port = address.rpartition(":")
    command = [
        sys.executable, "-m", "ladle.cli", "engine", "--model", args.model, "--device", args.device,
        "--host", host, "--port", port, "--shutdown-timeout", str(args.shutdown_timeout),
        "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
        "--kv-cache-mib", str(args.kv_cache_mib), "--grammar-timeout", str(args.grammar_timeout),
        "--async-scheduling", args.async_scheduling,
    ]
    return [*command, "--enforce-eager"] if args.enforce_eager else command


async def _serve_all(args: argparse.Namespace, config: GatewayConfig) -> int:
    address = config.engines[0]
    engine = await asyncio.create_subprocess_exec(*_engine_command(args, address), stdout=subprocess.DEVNULL)
    urls: list[str] = []

    def announce(url: str) -> None:
        urls.append(url)
        print(f"ladle serve: engine (gRPC ladle.v1.EngineService) on {address}", flush=True)
        print(f"ladle serve: gateway (OpenAI API) on {url}/v1 - loading the model; GET {url}/health says when "
              "it is ready", flush=True)

    def announce_ready(model_id: str) -> None:
        print(f"ladle serve: ready, model {model_id}", flush=True)

    try:
        code = await serve(config, args.host, args.port, announce, stop_when=engine.wait(), on_ready=announce_ready)
    finally:
        if engine.returncode is None:
            engine.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(engine.wait(), args.shutdown_timeout + 10)
            except TimeoutError:
                engine.kill()
                await engine.wait()
    if engine.returncode not in (0, -signal.SIGTERM):
        print(f"ladle serve: the engine exited with status {engine.returncode}", file=sys.stderr)
        return engine.returncode or 1
    return code


def serve_all(args: argparse.Namespace, config: GatewayConfig) -> int:
    configure_logging()
    return asyncio.run(_serve_all(args, config))
