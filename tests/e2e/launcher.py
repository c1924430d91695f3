"""A fork server for the end-to-end tests' `ladle` processes: the imports paid once per pytest worker, not per start.

A `ladle engine` spends ~3.5 s of CPU importing torch, transformers, xgrammar and grpc before it reads its first
flag, a gateway ~1 s, and the end-to-end folders start ~80 engines and ~100 gateways. `launch(command, ...)` runs
`python -m ladle_cli ...` as a child of a launcher process (one per pytest worker, subcommand and environment,
started on first use) that has imported those modules once: the launcher forks, and the child runs the command's
`__main__` with its arguments, environment, working directory, standard streams and session, as the interpreter
would have (`runpy`, as `python -m` does). The test gets a `subprocess.Popen`-like handle: a real pid to signal,
an exit status (-N when killed by signal N) and the pipe it asked for.

What a fork shares with its launcher, and why it does not change what the tests see:
- Modules ran their import-time code under the launcher's environment, so a launcher serves only commands with its
  environment: one differing in anything but `LADLE_*`, `PYTEST_*`, `NO_PROXY` (read by no module at import) and
  `OMP_NUM_THREADS` goes to a launcher started in it. OpenMP reads `OMP_NUM_THREADS` when torch loads it, so the
  launchers start without it and a child applies its own with `torch.set_num_threads`, as torch itself would.
- The launcher starts no thread of its own, no grpc channel, event loop or model (importing torch leaves one idle
  native thread, as in torch's DataLoader workers, which fork after `import torch` too); `random` reseeds itself in
  a forked child, and the imported objects are frozen out of the garbage collector's walks (`gc.freeze`), so a
  child does not copy every shared page when it collects.
Commands other than `ladle engine`, `gateway` and `serve`, and any with `LADLE_TEST_LAUNCHER=0`, start as plain
processes; the engines `ladle serve` and `ladle batch` start are plain processes too (test_serve.py,
test_batch_cli.py), so the real start-up path stays tested, and test_launcher.py holds both to the same results.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# What each subcommand imports (ladle_cli/main.py's), by the launcher that forks it: a gateway's own launcher, as
# a gateway that had torch in memory would take ~1 s longer to exit (the interpreter's teardown of its modules).
_CLI = ("ladle_cli.main", "ladle_cli.engine_child", "ladle.auth", "ladle.log")
_ENGINE = (*_CLI, "engine_server.server.server", "engine_server.structured.compiler", "torch.utils.cpp_extension")
_GATEWAY = (*_CLI, "ladle_cli.serve", "gateway.server", "gateway.config", "gateway.keys", "gateway.rate_limits",
            "gateway.routing")
PRELOADED = {"engine": _ENGINE, "gateway": _GATEWAY, "serve": _GATEWAY}
# Variables no preloaded module reads at import (pytest's own change from test to test), and OpenMP's thread count,
# which a child applies itself (see the module's docstring).
_THREADS = "OMP_NUM_THREADS"
MAY_DIFFER = ("LADLE_", "PYTEST_", "NO_PROXY", "no_proxy", _THREADS)
DISABLE_ENV = "LADLE_TEST_LAUNCHER"
_HEADER = struct.Struct("!Q")


class LaunchedProcess:
    """A child of the launcher, handled as `subprocess.Popen` handles its own (the subset the tests use)."""

    def __init__(self, args: Sequence[str], connection: socket.socket, stdout: IO[str] | None) -> None:
        self.args = list(args)
        self.stdout = stdout
        self.returncode: int | None = None
        self._connection = connection
        self._replies = connection.makefile("r", encoding="ascii")
        self.pid = int(self._reply("pid"))

    def _reply(self, kind: str) -> str:
        line = self._replies.readline()
        if not line.startswith(kind + " "):
            raise RuntimeError(f"the test launcher went away before it reported {kind} of {self.args}: {line!r}")
        return line.split(" ", 1)[1].strip()

    def poll(self) -> int | None:
        return self.wait() if self._exited(0) else None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = int(self._reply("exit"))
            self._replies.close()
            self._connection.close()
        return self.returncode

    def _exited(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        readable, _, _ = select.select([self._connection], [], [], timeout)
        return bool(readable)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = subprocess.Popen[str] | LaunchedProcess


def launch(
    args: Sequence[str], *, stdout: int | IO[Any] | None = None, stderr: int | IO[Any] | None = None,
    env: Mapping[str, str] | None = None, start_new_session: bool = False,
) -> Process:
    """Start `args` (`[sys.executable, "-m", "ladle_cli", subcommand, ...]`) as `subprocess.Popen(args, stdout=,
    stderr=, env=, text=True, start_new_session=)` would, through this worker's launcher where it can (see the
    module's docstring); `stdout` may be PIPE, `stderr` STDOUT."""
    environment = dict(os.environ if env is None else env)
    launchable = environment.get(DISABLE_ENV) != "0" and len(args) > 3 and args[3] in PRELOADED
    if not launchable or list(args[:3]) != [sys.executable, "-m", "ladle_cli"]:
        return subprocess.Popen(args, stdout=stdout, stderr=stderr, env=environment, text=True,
                                start_new_session=start_new_session)
    return _launcher(args[3], environment).launch(args, stdout, stderr, environment, start_new_session)


class _Launcher:
    """The client side: the launcher process and its socket."""

    def __init__(self, subcommand: str, env: Mapping[str, str]) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="ladle-launcher-")
        self.path = Path(self._folder.name) / "socket"
        root = Path(__file__).resolve().parents[2]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.launcher", subcommand, str(self.path)], cwd=root, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={k: v for k, v in env.items() if k != _THREADS},
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            self.process.kill()
            raise RuntimeError("the test launcher did not start")

    def launch(
        self, args: Sequence[str], stdout: int | IO[Any] | None, stderr: int | IO[Any] | None,
        env: dict[str, str], start_new_session: bool,
    ) -> LaunchedProcess:
        opened: list[int] = []  # fds of ours to close once the launcher has its copies
        pipe: IO[str] | None = None
        if stdout == subprocess.PIPE:
            read, out = os.pipe()
            opened.append(out)
            pipe = open(read, encoding="utf-8")  # noqa: SIM115 (the handle's, as Popen's stdout; UTF-8 as text=True here)
        else:
            out = _fd(stdout, 1, opened)
        err = out if stderr == subprocess.STDOUT else _fd(stderr, 2, opened)
        request = json.dumps({"args": list(args[3:]), "env": env, "cwd": os.getcwd(),
                              "new_session": start_new_session}).encode()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(str(self.path))
            socket.send_fds(connection, [_HEADER.pack(len(request))], [0, out, err])
            connection.sendall(request)
            return LaunchedProcess(args, connection, pipe)
        except BaseException:
            connection.close()
            if pipe is not None:
                pipe.close()
            raise
        finally:
            for fd in opened:
                os.close(fd)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()  # its end-of-file stops the launcher; its children run on as Popen's would
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self._folder.cleanup()


def _fd(stream: int | IO[Any] | None, inherited: int, opened: list[int]) -> int:
    """The descriptor a Popen argument stands for (not PIPE or STDOUT, which the caller handles)."""
    if stream is None:
        return inherited
    if stream == subprocess.DEVNULL:
        opened.append(os.open(os.devnull, os.O_RDWR))
        return opened[-1]
    return stream if isinstance(stream, int) else stream.fileno()


_lock = threading.Lock()
_started: dict[tuple[tuple[str, ...], frozenset[tuple[str, str]]], _Launcher] = {}


def _launcher(subcommand: str, env: Mapping[str, str]) -> _Launcher:
    """The launcher that imported `subcommand`'s modules in `env` (but for the variables that may differ), started
    on first use and again if it has gone."""
    key = (PRELOADED[subcommand], frozenset((k, v) for k, v in env.items() if not k.startswith(MAY_DIFFER)))
    with _lock:
        launcher = _started.get(key)
        if launcher is None or launcher.process.poll() is not None:
            launcher = _started[key] = _Launcher(subcommand, env)
            atexit.register(launcher.close)
        return launcher


# The launcher process.


def _serve(subcommand: str, path: str) -> Callable[[], None] | None:
    """Import what `subcommand` imports, then fork a child per request on `path` until standard input closes.
    Returns, in a child only, the function that runs its command; None in the launcher when it is told to stop."""
    import gc
    import importlib

    for name in PRELOADED[subcommand]:
        importlib.import_module(name)
    # The imported modules' objects go to the collector's permanent generation: a child's collections (its exit's
    # last one included) would otherwise walk them all, copying every page the fork shares (a gateway's exit took
    # ~1.1 s instead of ~0.4 s).
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_read, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.readline():
            return None
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_read, 512):
                    pass
            _reap(children)
        if listener in readable:
            connection, _ = listener.accept()
            try:
                request, fds = _receive(connection)
            except (OSError, ValueError) as error:  # a client that went away mid-request: nothing to start
                print(f"the test launcher dropped a request: {error!r}", file=sys.stderr, flush=True)
                connection.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                return lambda: _run(connection, request, fds)
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                connection.sendall(f"pid {pid}\n".encode())
            children[pid] = connection
            _reap(children)


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request: its length and the three standard streams' descriptors, then its JSON (launcher's `launch`)."""
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 3)
    try:
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors instead of 3")
        (size,) = _HEADER.unpack(header + _read_exactly(connection, _HEADER.size - len(header)))
        return json.loads(_read_exactly(connection, size)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ValueError("the request ended early")
        data += chunk
    return data


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            connection.close()


def _run(connection: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the command (`python -m ladle_cli <args>`) and run it."""
    import runpy

    connection.close()
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    torch = sys.modules.get("torch")  # loaded by the launcher, so OpenMP has read the launcher's environment
    if torch is not None and _THREADS in os.environ:
        torch.set_num_threads(int(os.environ[_THREADS]))
    sys.argv = ["ladle_cli", *request["args"]]  # runpy puts the module's path first, as `python -m` does
    runpy.run_module("ladle_cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    command = _serve(sys.argv[1], sys.argv[2])
    if command is not None:
        command()
