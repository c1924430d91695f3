"""How often a Batch call that the engine refuses at its start reports the engine's status (grpc/grpc#36066).

A loopback grpc.aio server whose Batch aborts at once (UNAUTHENTICATED, as a wrong token gets, or UNAVAILABLE, as a
draining engine answers); calls of 1, 8 and 64 items through grpc.aio's bare call and through
`AsyncEngineClient.batch` (`ladle.kept_status`). Prints one JSON line per (code, items, client) with the codes the
callers saw.

    PYTHONPATH=.:clients .venv/bin/python scripts/batch_refusal_status.py --calls 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc

from ladle.client import AsyncEngineClient
from ladle.v1 import engine_pb2, engine_pb2_grpc, types_pb2


class RefusingEngine(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def Batch(self, requests: Any, context: Any) -> AsyncIterator[engine_pb2.BatchResponse]:
        await context.abort(self.code, "refused")
        yield engine_pb2.BatchResponse()


async def codes_seen(code: grpc.StatusCode, items: int, calls: int, bare: bool) -> Counter[str]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(RefusingEngine(code), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    item = engine_pb2.BatchRequest(
        item_id="a", request=engine_pb2.GenerateRequest(input=types_pb2.Input(text="hello " * 200))
    )
    seen: Counter[str] = Counter()
    try:
        async with AsyncEngineClient(f"127.0.0.1:{port}", timeout=10, retries=False) as client:
            for _ in range(calls):
                batch = iter([item] * items)
                call = client.stub.Batch(batch) if bare else client.batch(batch)
                try:
                    async for _ in call:
                        pass
                    seen["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    seen[error.code().name] += 1
    finally:
        await server.stop(0)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE):
        for items in (1, 8, 64):
            for bare in (True, False):
                seen = asyncio.run(codes_seen(code, items, args.calls, bare))
                print(json.dumps({
                    "refused_with": code.name, "items": items, "client": "grpc.aio bare" if bare else "ladle",
                    "calls": args.calls, "codes_seen": dict(seen), "grpcio": grpc.__version__, "commit": commit,
                }))  # fmt: skip


if __name__ == "__main__":
    main()
