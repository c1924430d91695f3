"""Validating a batch input file off the event loop: `lines.validate` over the file, in a child process.

Checking a line is pure-Python and pydantic work that holds the GIL, so a thread doing it for a large file
starves the event loop (a 50,000-line file checked in a thread of the gateway put its loop-lag p99 at 30 to
250 ms on 2 shared cores: benchmarks/results/batch_upload_cpu.jsonl). A file larger than
`THREAD_MAX_BYTES` is therefore checked by a child process (`python -m gateway.batches.validation`, which imports
only `lines`), started for the file and killed if the caller is cancelled; a small one, whose check takes a few
milliseconds, in a thread, sparing the child's start-up (~0.3 s). Both read a line at a time: memory stays bounded
by the longest line and the set of custom_ids, whatever the file's size. The engine's model info, when the
caller has it, reaches the child serialized, so pooling lines are bounded by the model as the routes bound them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from gateway.batches import lines
from gateway.batches.lines import LineError
from ladle.v1 import engine_pb2

THREAD_MAX_BYTES = 64 * 1024  # ~450 short lines at ~25 us each: the loop waits at most ~10 ms
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding `gateway`, for the child's path


class ValidationProcessError(RuntimeError):
    """The validation child failed without an answer (killed, out of memory, a broken installation)."""


async def validate_file(
    path: Path, endpoint: str | None, model: str | None, max_line_bytes: int,
    process_above_bytes: int = THREAD_MAX_BYTES, info: engine_pb2.GetModelInfoResponse | None = None,
    adapters: Collection[str] = (),
) -> tuple[int, list[LineError]]:
    """`lines.validate(lines.read_lines(file, max_line_bytes), endpoint, model, info=info, adapters=adapters)`
    over the file at `path`, run off the event loop: in a child process when the file is larger than
    `process_above_bytes`, else in a thread. `info`: the engine's model info (`EnginePool.model_info()`), None
    while unknown; `adapters`: the names of the LoRA adapters the engines serve.

    Returns (number of requests, errors) exactly as `lines.validate` does, which makes any failure to check a
    line that line's LineError. Raises OSError for the file itself (FileNotFoundError when it is gone), and
    ValidationProcessError if the child ends without an answer (its traceback, if any, is on the gateway's
    stderr, which it shares).
    """
    size = await asyncio.to_thread(lambda: path.stat().st_size)
    if size <= process_above_bytes:
        return await asyncio.to_thread(check_file, path, endpoint, model, max_line_bytes, info, adapters)
    return await _check_in_child(path, endpoint, model, max_line_bytes, info, adapters)


def check_file(
    path: Path, endpoint: str | None, model: str | None, max_line_bytes: int,
    info: engine_pb2.GetModelInfoResponse | None = None, adapters: Collection[str] = (),
) -> tuple[int, list[LineError]]:
    """`validate_file`'s check, blocking: run it in a thread or in the child."""
    with path.open("rb") as f:
        return lines.validate(lines.read_lines(f, max_line_bytes), endpoint, model, info=info, adapters=adapters)


async def _check_in_child(
    path: Path, endpoint: str | None, model: str | None, max_line_bytes: int,
    info: engine_pb2.GetModelInfoResponse | None = None, adapters: Collection[str] = (),
) -> tuple[int, list[LineError]]:
    serialized = base64.b64encode(info.SerializeToString()).decode() if info is not None else None
    request = json.dumps({"path": str(path), "endpoint": endpoint, "model": model, "max_line_bytes": max_line_bytes,
                          "info": serialized, "adapters": list(adapters)})
    python_path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.batches.validation", request, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": python_path},
    )
    try:
        out, _ = await child.communicate()
    finally:
        if child.returncode is None:  # cancelled: the check is no longer wanted
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()
    if child.returncode != 0 or not out:
        raise ValidationProcessError(f"the validation process of {path.name} exited with status {child.returncode} "
                                     "and no answer")
    answer: dict[str, Any] = json.loads(out)
    if "os_error" in answer:
        raise OSError(answer["os_error"], answer["message"], str(path))  # errno picks the subclass
    return answer["count"], [LineError(**error) for error in answer["errors"]]


def main(argv: list[str]) -> int:
    """The child: check the file named by the JSON request in argv[0]; the answer, as JSON, on stdout."""
    request = json.loads(argv[0])
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # whatever else prints (a logger's default is stdout) goes to stderr, not into the answer
    with contextlib.suppress(OSError):
        os.nice(10)  # batch work: leave the CPU to the gateway and the engine when they want it
    info = None
    if request.get("info") is not None:
        info = engine_pb2.GetModelInfoResponse.FromString(base64.b64decode(request["info"]))
    try:
        count, errors = check_file(Path(request["path"]), request["endpoint"], request["model"],
                                   request["max_line_bytes"], info, request.get("adapters", ()))
    except OSError as exc:
        answer: dict[str, Any] = {"os_error": exc.errno, "message": exc.strerror or str(exc)}
    else:
        answer = {"count": count, "errors": [error.as_dict() for error in errors]}
    with os.fdopen(answer_fd, "w") as out:
        out.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
