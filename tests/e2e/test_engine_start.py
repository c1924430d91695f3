"""An engine that cannot load its model exits 1 once its port is bound, with the reason in its log, and the
suite's `start_engine` reports that at once instead of waiting out its 240 s start-up timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.engine_process import start_engine


def test_an_engine_whose_model_is_missing_exits_and_is_reported_at_once(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 1 while starting") as failed:
        start_engine(tmp_path / "engine.log", "--model", str(missing))
    assert time.monotonic() - started < 60
    assert "the engine failed to start" in str(failed.value) and str(missing) in str(failed.value)
