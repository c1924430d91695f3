"""The suite's own disk discipline (tests/conftest.py, pyproject.toml): what a run writes is removed as it goes, so
its files peak at what the running tests hold (a CI run once filled its disk with ~6 GB kept to the end), and it
never writes the user's model cache. Checked on a small inner pytest run with the suite's conftest and settings."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts an inner pytest process
pytest_plugins = ["pytester"]

TESTS = Path(__file__).parents[1]

# A module whose module-scoped fixture and test write folders, then a module that reports what is left of them.
WRITER = """
import os
import pytest

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    (folder / "weights").write_bytes(b"w" * 1024)
    return folder

def test_uses_the_checkpoint(checkpoint, tmp_path):
    (tmp_path / "scratch").write_text("s")
    assert (checkpoint / "weights").is_file()

def test_again(checkpoint):
    assert (checkpoint / "weights").is_file() and os.environ.get("FAIL_HERE") is None
"""
REPORTER = """
import json
import tomllib
import os

def test_report(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    left = sorted(path.name for path in base.iterdir() if not path.is_symlink())
    print("LEFT", json.dumps({"left": left, "cache": os.environ["LADLE_CACHE_DIR"]}))
"""


def inner_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, fail: bool) -> tuple[list[str], str]:
    """Run WRITER then REPORTER under the suite's conftest and retention policy (pyproject.toml's); the folders
    REPORTER found in the base temporary folder, and the model cache it was given."""
    pytester.makeconftest((TESTS / "conftest.py").read_text(encoding="utf-8"))
    ini = tomllib.loads((TESTS.parent / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    pytester.makeini(f"[pytest]\ntmp_path_retention_policy = {ini['tmp_path_retention_policy']}\n")
    pytester.makepyfile(test_a_writer=WRITER, test_b_reporter=REPORTER)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the inner run is no xdist worker, even under one
    if fail:
        monkeypatch.setenv("FAIL_HERE", "1")
    result = pytester.runpytest_subprocess("-s", "-p", "no:randomly", "-p", "no:xdist", "--basetemp", "base")
    result.assert_outcomes(passed=2 if fail else 3, failed=1 if fail else 0)
    line = next(line for line in result.outlines if "LEFT" in line)
    report = json.loads(line.split("LEFT ", 1)[1])
    return report["left"], report["cache"]


def test_a_passing_modules_folders_are_gone_and_the_cache_is_the_runs_own(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    left, cache = inner_run(pytester, monkeypatch, fail=False)
    assert left == ["ladle-cache"]
    assert Path(cache) == pytester.path / "base" / "ladle-cache"


def test_a_failing_modules_folders_are_kept(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    left, _ = inner_run(pytester, monkeypatch, fail=True)
    assert "checkpoint0" in left and "ladle-cache" in left
    assert not any(name.startswith("test_uses") for name in left), left  # the passing test's tmp_path still goes
