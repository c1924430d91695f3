"""`ladle batch -i in.jsonl -o out.jsonl`: an OpenAI-format batch file run offline, like vLLM's `run_batch`.

Every input line is validated first (as the gateway's batches are: nothing runs if any line is wrong). The lines
then go through one engine's Batch RPC — an engine of our own for `--model` (a child process, stopped at the end)
or a running one for `--engine HOST:PORT` — and each result is appended to the output file as it arrives, in
OpenAI's output line format (errors too, with their status code). The output file is the progress record: run
the same command again after an interruption (Ctrl-C, a crash, a reboot) and it truncates a half-written last
line, skips every custom_id already there and runs only the rest, so each custom_id ends up exactly once. The
command exits 0 only once every input line has its line in the output file: lines that ended without one (which
the line runner's invariant should never allow) are run again, and if some still have none after `MAX_PASSES` runs
it exits 1 naming how many. An output file that cannot be written (disk full) stops the run with exit status 1
and a message; what was written stays, and the same command finishes the rest later. A run holds an exclusive
lock (flock) on its output file: a second run on the same file, which would run and append the same lines again,
refuses at once with exit status 75 (EX_TEMPFAIL: run it again once the first has ended).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from gateway.batches import lines
from gateway.batches.line_runner import LineResult, LineRunner
from gateway.batches.lines import InputLine
from gateway.config import DEFAULT_MAX_REQUEST_BYTES, GatewayConfig
from gateway.engines import EnginePool
from ladle.log import configure_logging
from ladle.v1 import engine_pb2
from ladle_cli.engine_child import engine_command, spawn_engine, stop_engine

INTERRUPTED = 130
INVALID_INPUT = 2
OUTPUT_IN_USE = 75  # EX_TEMPFAIL: another run holds the output file
ENGINE_STARTUP_TIMEOUT_S = 600.0  # our own engine: loading (and, the first time, converting) the model
CONNECT_TIMEOUT_S = 60.0  # an engine given with --engine
MAX_SHOWN_ERRORS = 20
MAX_PASSES = 3


class BatchFileError(Exception):
    """The input or output file cannot be used as given (the message says why)."""


class OutputInUseError(BatchFileError):
    """Another run holds the output file."""


def run_batch_file(args: argparse.Namespace) -> int:
    configure_logging(level=os.environ.get("LADLE_LOG_LEVEL", "WARNING"))
    try:
        with exclusive_output(Path(args.output)):
            return asyncio.run(_run(args))
    except OutputInUseError as exc:
        print(f"ladle batch: {exc}", file=sys.stderr)
        return OUTPUT_IN_USE
    except BatchFileError as exc:
        print(f"ladle batch: {exc}", file=sys.stderr)
        return INVALID_INPUT


@contextlib.contextmanager
def exclusive_output(output: Path) -> Iterator[None]:
    """Hold an exclusive lock on `output` (created if missing) while the block runs; OutputInUseError if another
    process holds it. Two runs on one file would each skip only the lines already there when they started, so
    both would run and append the rest, and each would truncate what looks like the other's half-written line.
    A file this created and the run left empty (its input was refused, say) is removed again."""
    existed = output.exists()
    try:
        descriptor = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise BatchFileError(f"cannot open {output}: {exc.strerror}") from None
    locked = False
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputInUseError(f"{output} is being written by another `ladle batch` run; run this again once it "
                                   "has ended, or use another output file") from None
        locked = True
        yield
    finally:
        if locked and not existed and os.fstat(descriptor).st_size == 0:
            output.unlink(missing_ok=True)  # still under the lock: no other run is writing it
        os.close(descriptor)  # releases the lock


def completed_custom_ids(output: Path) -> set[str]:
    """The custom_ids already in `output` (created if missing). A last line cut off mid-write is truncated."""
    output.touch()
    done: set[str] = set()
    with output.open("r+b") as f:
        good = 0
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break  # a half-written last line: dropped below, run again
            try:
                done.add(json.loads(raw)["custom_id"])
            except (ValueError, KeyError, TypeError):
                raise BatchFileError(f"{output} line {number} is not a result line; is it the right file?") from None
            good += len(raw)
        f.truncate(good)
    return done


async def _run(args: argparse.Namespace) -> int:
    source, output = Path(args.input), Path(args.output)
    if not source.is_file():
        raise BatchFileError(f"no input file {source}")
    custom_ids = _validate(source, None)  # before any engine starts: a bad file fails at once
    done = completed_custom_ids(output)
    unknown = done - custom_ids
    if unknown:
        raise BatchFileError(f"{output} holds results for custom_ids that are not in {source} "
                             f"(e.g. {sorted(unknown)[0]!r}); use another output file")
    engine = None
    address = args.engine
    if not address:
        engine, address = await _start_engine(args)
    pool = EnginePool(GatewayConfig(engines=(address,), request_timeout_s=ENGINE_STARTUP_TIMEOUT_S,
                                    engine_auth_token=getattr(args, "engine_auth_token", None)))
    await pool.start()
    try:
        if not await _wait_ready(pool, engine, ENGINE_STARTUP_TIMEOUT_S if engine else CONNECT_TIMEOUT_S):
            print(f"ladle batch: {_not_ready(pool, engine, address)}", file=sys.stderr)
            return 1
        # every body names the served model (or a LoRA adapter the engine serves) and fits its limits
        _validate(source, pool.model_id, pool.model_info(), [a.name for a in pool.adapters()])
        return await _run_lines(args, source, output, custom_ids, pool)
    finally:
        await pool.close()
        if engine is not None:
            await stop_engine(engine, args.shutdown_timeout + 10)


async def _run_lines(
    args: argparse.Namespace, source: Path, output: Path, custom_ids: set[str], pool: EnginePool
) -> int:
    model = pool.model_id or ""
    total = len(custom_ids)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    done = completed_custom_ids(output)
    progress = tqdm(total=total, initial=len(done), unit="req", desc="ladle batch", dynamic_ncols=True)
    try:
        for _ in range(MAX_PASSES):
            if done >= custom_ids or stop.is_set():
                break
            with output.open("ab") as out:
                runner = LineRunner(pool, model, args.window or None)
                await runner.run(_pending(source, done), lambda r: _write(out, r, progress), stop)
                out.flush()
                os.fsync(out.fileno())
            done = completed_custom_ids(output)
    except OSError as exc:
        print(f"ladle batch: cannot write {output}: {exc}; the results written so far are kept: free the space "
              "and run the same command again", file=sys.stderr)
        return 1
    finally:
        progress.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    missing = len(custom_ids - done)
    if stop.is_set() and missing:
        print(f"ladle batch: interrupted with {total - missing} of {total} requests done; run the same command "
              "again to finish the rest", file=sys.stderr)
        return INTERRUPTED
    if missing:
        print(f"ladle batch: {missing} requests still have no result after {MAX_PASSES} runs; run the same "
              "command again", file=sys.stderr)
        return 1
    print(f"ladle batch: {total} requests done; results in {output}", file=sys.stderr)
    return 0


def _validate(
    source: Path, model: str | None, info: engine_pb2.GetModelInfoResponse | None = None,
    adapters: Collection[str] = (),
) -> set[str]:
    """The requests' custom_ids (one per line: validation refuses duplicates); BatchFileError listing the bad
    lines if there are any."""
    with source.open("rb") as f:
        _, errors = lines.validate(lines.read_lines(f, DEFAULT_MAX_REQUEST_BYTES), None, model, info=info,
                                   adapters=adapters)
    if errors:
        shown = "\n".join(f"  line {e.line}: {e.code}: {e.message}" for e in errors[:MAX_SHOWN_ERRORS])
        more = f"\n  ... and {len(errors) - MAX_SHOWN_ERRORS} more" if len(errors) > MAX_SHOWN_ERRORS else ""
        raise BatchFileError(f"{source} has invalid lines; nothing was run:\n{shown}{more}")
    with source.open("rb") as f:
        return {json.loads(raw)["custom_id"] for _, raw in lines.read_lines(f, DEFAULT_MAX_REQUEST_BYTES) if raw}


async def _pending(source: Path, done: set[str]) -> AsyncIterator[InputLine]:
    with source.open("rb") as f:
        for index, (number, raw) in enumerate(lines.read_lines(f, DEFAULT_MAX_REQUEST_BYTES)):
            assert raw is not None  # validated
            line = lines.parse_line(raw, number, index, None, None)
            if line.custom_id not in done:
                yield line


def _write(out: BinaryIO, result: LineResult, progress: tqdm) -> None:
    out.write(lines.encode(result.record))
    out.flush()  # a whole line reaches the file before it counts as done
    progress.update(1)


async def _start_engine(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    """A `ladle engine` of our own on a free loopback port (its own session, so Ctrl-C reaches only us)."""
    env = {**os.environ, "LADLE_LOG_LEVEL": os.environ.get("LADLE_LOG_LEVEL", "WARNING")}
    engine = await spawn_engine(engine_command(args, "127.0.0.1", 0), stdout=subprocess.PIPE, env=env,
                                start_new_session=True)
    assert engine.stdout is not None
    announced = (await engine.stdout.readline()).decode()
    if " on " not in announced:
        await stop_engine(engine, 5)
        raise BatchFileError(f"the engine did not start (exit status {engine.returncode})")
    return engine, announced.rsplit(" on ", 1)[1].strip()


def _not_ready(pool: EnginePool, engine: asyncio.subprocess.Process | None, address: str) -> str:
    """Why no engine is ready: our own engine exited, the engine refuses our token, or none answers."""
    if engine is not None and engine.returncode is not None:
        return f"the engine exited with status {engine.returncode}"
    if any(e.refused for e in pool.engines):
        return pool.unavailable().message
    return f"no engine SERVING at {address}"


async def _wait_ready(pool: EnginePool, engine: asyncio.subprocess.Process | None, timeout: float) -> bool:
    """Wait for an engine SERVING with its model id known; False if our own engine exits first or time runs out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if engine is not None and engine.returncode is not None:
            return False
        if pool.ready and pool.model_id is not None:
            return True
        if pool.engines and all(e.refused is not None for e in pool.engines):
            return False  # it refuses our token: waiting will not change that
        await pool.wait_ready(1.0)
    return False
