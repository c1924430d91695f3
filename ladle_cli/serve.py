"""`ladle serve`: a `ladle engine` child process plus the gateway in this process, on one host.

The engine runs in its own process so its step loop never shares an interpreter (and GIL) with HTTP work. The
gateway starts at once and answers 503 until the engine is SERVING; a `ready` line is printed once the gateway
itself sees it SERVING (so requests succeed from then on). If the
engine exits, the gateway stops and `ladle serve` returns the engine's exit status; on SIGINT/SIGTERM both stop,
and if `ladle serve` is killed outright the engine follows (ladle_cli.engine_child). The engine requires a token
(a random one per start unless --engine-auth-token-file names one; its file is printed) that the gateway sends,
so other local users cannot call it.
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
from ladle_cli.engine_child import engine_command, spawn_engine, stop_engine


async def _serve_all(args: argparse.Namespace, config: GatewayConfig) -> int:
    address = config.engines[0]
    host, _, port = address.rpartition(":")
    engine = await spawn_engine(engine_command(args, host, int(port)), stdout=subprocess.DEVNULL)
    urls: list[str] = []

    def announce(url: str) -> None:
        urls.append(url)
        print(f"ladle serve: engine (gRPC ladle.v1.EngineService) on {address}, token in "
              f"{args.engine_auth_token_file}", flush=True)
        print(f"ladle serve: gateway (OpenAI API) on {url}/v1 - loading the model; GET {url}/health says when "
              "it is ready", flush=True)

    def announce_ready(model_id: str) -> None:
        print(f"ladle serve: ready, model {model_id}", flush=True)

    try:
        code = await serve(config, args.host, args.port, announce, stop_when=engine.wait(), on_ready=announce_ready)
    finally:
        await stop_engine(engine, args.shutdown_timeout + 10)
    if engine.returncode not in (0, -signal.SIGTERM):
        print(f"ladle serve: the engine exited with status {engine.returncode}", file=sys.stderr)
        return engine.returncode or 1
    return code


def serve_all(args: argparse.Namespace, config: GatewayConfig) -> int:
    configure_logging()
    return asyncio.run(_serve_all(args, config))
