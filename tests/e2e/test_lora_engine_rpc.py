"""LoRA adapters on a real `ladle engine` over gRPC: adapters named at start and loaded at run time, selected by
`GenerateRequest.adapter` (also from grpcurl, with no .proto at hand); loading and unloading while requests of other
adapters run leaves their outputs unchanged; an unloaded adapter is NOT_FOUND; bad adapters are refused with
INVALID_ARGUMENT and the engine serves on. The model is a tiny random Llama on the float path, the adapters PEFT's
own (tests/lora_adapters.py)."""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from ladle.client import EngineClient
from ladle.v1 import engine_pb2, types_pb2
from tests.e2e.engine_process import EngineProcess, start_engine
from tests.e2e.test_grpcurl import _json_stream, grpcurl  # noqa: F401  (a fixture)
from tests.families import VOCAB_SIZE, save_family
from tests.lora_adapters import ATTENTION, MLP, save_adapter

MAX_TOKENS = 24
BUSY_TOKENS = 96  # long enough that the adapters change while the requests still run


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-rpc")
    base = save_family(root / "base", "llama")
    return {
        "base": base,
        "a": save_adapter(base, root / "a", ATTENTION, 8, seed=1),
        "b": save_adapter(base, root / "b", MLP, 16, rslora=True, seed=2),
        "c": save_adapter(base, root / "c", ["q_proj", "v_proj"], 8, seed=3),
    }


@pytest.fixture(scope="module")
def engine(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("lora-rpc-log") / "engine.log"
    process = start_engine(
        log, "--model", str(folders["base"]), "--quantization", "none", "--kv-cache-mib", "64",
        "--lora-modules", f"a={folders['a']}", "--max-loras", "2", "--max-lora-rank", "16",
    )  # fmt: skip
    yield process
    process.stop()


def request(prompt: list[int], adapter: str = "", max_tokens: int = MAX_TOKENS) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        input=types_pb2.Input(token_ids=types_pb2.TokenIds(ids=prompt)),
        sampling=types_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        adapter=adapter,
    )


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(10, VOCAB_SIZE) for _ in range(rng.randrange(3, 60))] for _ in range(count)]


def generate(client: EngineClient, prompt: list[int], adapter: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
    return list(client.generate(request(prompt, adapter, max_tokens)).choices[0].token_ids)


def test_adapters_load_and_unload_under_load(engine: EngineProcess, folders: dict[str, Path]) -> None:
    batch = prompts(12)
    plan = [("", "a", "b")[i % 3] for i in range(len(batch))]
    with EngineClient(engine.address) as client:
        info = client.model_info().lora
        assert [a.name for a in info.adapters] == ["a"] and info.max_loras == 2 and info.max_lora_rank == 16
        loaded = client.load_adapter("b", str(folders["b"])).adapter
        assert (loaded.rank, sorted(loaded.target_modules)) == (16, sorted(MLP))
        quiet = [generate(client, p, a, BUSY_TOKENS) for p, a in zip(batch, plan, strict=True)]
        # each adapter changes the output (prompt 0 is the base model's; 1 is a's, 2 is b's)
        assert generate(client, batch[1], "", BUSY_TOKENS) != quiet[1]
        assert generate(client, batch[2], "", BUSY_TOKENS) != quiet[2]

        with ThreadPoolExecutor(len(batch)) as pool:
            busy = [pool.submit(generate, client, p, a, BUSY_TOKENS) for p, a in zip(batch, plan, strict=True)]
            deadline = time.monotonic() + 60
            while client.load().running < len(batch) and time.monotonic() < deadline:
                time.sleep(0.01)
            client.unload_adapter("b")  # b's requests already running finish with it
            client.load_adapter("c", str(folders["c"]))
            assert not all(f.done() for f in busy), "the requests ended before the adapters changed: make them longer"
            assert [f.result() for f in busy] == quiet

        with pytest.raises(grpc.RpcError) as gone:
            generate(client, batch[0], "b")
        assert gone.value.code() is grpc.StatusCode.NOT_FOUND and "'b'" in (gone.value.details() or "")
        assert list(client.load().adapters) == ["a", "c"]
        assert [a.name for a in client.model_info().lora.adapters] == ["a", "c"]
        assert generate(client, batch[0], "c") != generate(client, batch[0])
        assert [generate(client, p, a, BUSY_TOKENS) for p, a in zip(batch, plan, strict=True) if a != "b"] == [
            q for q, a in zip(quiet, plan, strict=True) if a != "b"
        ]


def test_bad_adapters_are_refused_and_the_engine_serves_on(engine: EngineProcess, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with EngineClient(engine.address) as client:
        cases = [
            (("x", str(tmp_path / "missing")), grpc.StatusCode.INVALID_ARGUMENT, "is not a folder"),
            (("x", str(tmp_path)), grpc.StatusCode.INVALID_ARGUMENT, "DoRA"),
            (("a", str(tmp_path)), grpc.StatusCode.ALREADY_EXISTS, "served already"),
            (("", str(tmp_path)), grpc.StatusCode.INVALID_ARGUMENT, "name"),
        ]
        for (name, path), code, message in cases:
            with pytest.raises(grpc.RpcError) as refused:
                client.load_adapter(name, path)
            assert refused.value.code() is code and message in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as missing:
            client.unload_adapter("never-loaded")
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
        assert len(generate(client, prompts(1)[0], "a")) == MAX_TOKENS


def test_grpcurl_selects_an_adapter(engine: EngineProcess, grpcurl: str) -> None:  # noqa: F811
    prompt = prompts(1)[0]
    data = json.dumps({"input": {"token_ids": {"ids": prompt}}, "adapter": "a",
                       "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}})  # fmt: skip
    done = subprocess.run([grpcurl, "-plaintext", "-d", data, engine.address, "ladle.v1.EngineService/Generate"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (reply,) = _json_stream(done.stdout)
    with EngineClient(engine.address) as client:
        assert reply["choices"][0]["token_ids"] == generate(client, prompt, "a")  # type: ignore[index]
