"""The test launcher (tests/e2e/launcher.py) runs a `ladle` command as a fresh interpreter would: the same output,
exit status, session and signals as `subprocess.Popen` of the same command, and a plain Popen where it cannot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.e2e.launcher import LaunchedProcess, launch

GATEWAY = [sys.executable, "-m", "ladle_cli", "gateway", "--engine", "127.0.0.1:9", "--host", "127.0.0.1",
           "--port", "0"]


def both(command: list[str], folder: Path, **kwargs: object) -> list[tuple[int, str]]:
    """`command` run to its end through the launcher and as a plain process: (exit status, stderr) of each."""
    results = []
    for name, plain in (("launched", "1"), ("plain", "0")):
        log = folder / f"{name}.log"
        with log.open("w") as stderr:
            process = launch(command, stderr=stderr, env={**os.environ, "LADLE_TEST_LAUNCHER": plain}, **kwargs)
        assert isinstance(process, LaunchedProcess) == (plain == "1")
        results.append((process.wait(60), log.read_text()))
    return results


def test_a_launched_command_fails_as_the_plain_one_does(tmp_path: Path) -> None:
    launched, plain = both([*GATEWAY, "--no-such-flag"], tmp_path)
    assert launched == plain and launched[0] == 2 and "unrecognized arguments: --no-such-flag" in launched[1]
    missing = tmp_path / "nowhere.gguf"
    launched, plain = both([sys.executable, "-m", "ladle_cli", "engine", "--model", str(missing), "--port", "0",
                            "--host", "127.0.0.1"], tmp_path, stdout=subprocess.DEVNULL)
    assert launched[0] == plain[0] == 1 and str(missing) in launched[1] and str(missing) in plain[1]


def test_a_launched_process_has_its_pipe_its_session_and_its_signals(tmp_path: Path) -> None:
    with (tmp_path / "gateway.log").open("w") as log:
        gateway = launch([*GATEWAY, "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE, stderr=log,
                         start_new_session=True)
    assert isinstance(gateway, LaunchedProcess) and gateway.stdout is not None
    assert gateway.stdout.readline().startswith("ladle gateway: OpenAI API on http://127.0.0.1:")
    assert os.getsid(gateway.pid) == gateway.pid != os.getsid(0)
    assert gateway.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):  # a serving gateway has not exited
        gateway.wait(0.2)
    gateway.send_signal(signal.SIGTERM)
    assert gateway.wait(30) == 0 and gateway.poll() == 0
    gateway.kill()  # after its exit: nothing to signal, as with Popen

    with (tmp_path / "killed.log").open("w") as log:
        killed = launch([*GATEWAY, "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE, stderr=log)
    assert killed.stdout is not None and killed.stdout.readline()
    assert os.getsid(killed.pid) == os.getsid(0)
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL


def test_a_command_runs_in_a_launcher_started_in_its_environment_or_plain(tmp_path: Path) -> None:
    launchers = []
    for env in ({"LADLE_LOG_LEVEL": "DEBUG"}, {"PYTHONHASHSEED": "7"}, {"LADLE_LOG_LEVEL": "INFO"}):
        with (tmp_path / "gateway.log").open("w") as log:
            process = launch([*GATEWAY, "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE, stderr=log,
                             env={**os.environ, **env})
        assert isinstance(process, LaunchedProcess) and process.stdout is not None and process.stdout.readline()
        launcher = psutil.Process(process.pid).ppid()
        launchers.append((launcher, psutil.Process(launcher).environ().get("PYTHONHASHSEED")))
        process.terminate()
        assert process.wait(30) == 0
    # PYTHONHASHSEED is the interpreter's at its start: a launcher of its own; a LADLE_* variable is read later
    assert launchers[0] == launchers[2] and launchers[1][1] == "7" != launchers[0][1]
    assert launchers[1][0] != launchers[0][0]
    with (tmp_path / "batch.log").open("w") as log:  # not a subcommand the launcher has imported for
        process = launch([sys.executable, "-m", "ladle_cli", "batch", "--help"], stdout=log)
    assert isinstance(process, subprocess.Popen) and process.wait(60) == 0
