"""The contract from another language: the TypeScript client (clients/typescript) against real `ladle engine`
processes. `tsc` builds the client and its tests (type-checking both against the generated ladle.v1 code), then
Node's own test runner runs each test file with the engines' addresses in LADLE_ENGINE_ADDRESS and
LADLE_TIGHT_ENGINE_ADDRESS; node's report is printed, and shown whole when a file fails.

Every file uses the session's shared engine; errors.test also needs one of its own with one seat and a waiting
queue of one, to fill that queue, and lora.test one serving a LoRA adapter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.engine_process import EngineProcess, start_engine

ROOT = Path(__file__).resolve().parents[2]
TS_DIR = ROOT / "clients" / "typescript"
TEST_FILES = sorted(p.name.removesuffix(".test.ts") for p in (TS_DIR / "test").glob("*.test.ts"))
NEEDS_TIGHT_ENGINE = {"errors"}
NEEDS_LORA_ENGINE = {"lora"}
LORA_ADAPTER = "ts-adapter"
NODE_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def compiled_tests() -> Path:
    """clients/typescript/dist/test, freshly built by the tsc of `make setup`."""
    tsc = TS_DIR / "node_modules" / ".bin" / "tsc"
    assert tsc.exists(), f"{tsc} is missing: `make setup` installs the TypeScript client's npm packages"
    assert shutil.which("node"), "node is not on PATH"
    shutil.rmtree(TS_DIR / "dist", ignore_errors=True)
    build = subprocess.run([str(tsc), "-p", str(TS_DIR)], capture_output=True, text=True, timeout=NODE_TIMEOUT_S)
    assert build.returncode == 0, f"tsc failed:\n{build.stdout}{build.stderr}"
    return TS_DIR / "dist" / "test"


@pytest.fixture(scope="module")
def tight_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """One seat and one place in the waiting queue: a third request is refused with RESOURCE_EXHAUSTED."""
    process = start_engine(
        tmp_path_factory.mktemp("ts-tight") / "engine.log", "--max-num-seqs", "1", "--max-waiting", "1"
    )
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, Path]]:
    """The embedded model serving one random LoRA adapter (written for its shapes), and the adapter's folder."""
    from benchmarks.lora import write_random_adapter
    from engine_server.loader import resolve_model

    root = tmp_path_factory.mktemp("ts-lora")
    folder = write_random_adapter(root / "adapter", resolve_model("default").config, 8, seed=1, std=0.05)
    process = start_engine(root / "engine.log", "--lora-modules", f"{LORA_ADAPTER}={folder}", "--max-lora-rank", "8")
    yield process, folder
    assert process.stop() == 0


@pytest.mark.parametrize("name", TEST_FILES)
def test_typescript_client(
    name: str, compiled_tests: Path, engine: EngineProcess, request: pytest.FixtureRequest
) -> None:
    env = {**os.environ, "LADLE_ENGINE_ADDRESS": engine.address}
    if name in NEEDS_TIGHT_ENGINE:
        env["LADLE_TIGHT_ENGINE_ADDRESS"] = request.getfixturevalue("tight_engine").address
    if name in NEEDS_LORA_ENGINE:
        lora_engine, folder = request.getfixturevalue("lora_engine")
        env.update(LADLE_LORA_ENGINE_ADDRESS=lora_engine.address, LADLE_LORA_ADAPTER=LORA_ADAPTER,
                   LADLE_LORA_PATH=str(folder))  # fmt: skip
    run = subprocess.run(
        ["node", "--test", "--test-reporter=spec", str(compiled_tests / f"{name}.test.js")],
        cwd=TS_DIR, env=env, capture_output=True, text=True, timeout=NODE_TIMEOUT_S,
    )
    print(run.stdout)
    assert run.returncode == 0, f"node --test {name}.test.js failed:\n{run.stdout}\n{run.stderr}"
