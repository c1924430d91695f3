"""Schema fuzzing of the gateway: schemathesis sends cases drawn from the gateway's own OpenAPI document
(/openapi.json), positive and negative, to `ladle gateway` in front of a real `ladle engine`, and counts what
must never happen: 5xx responses, error bodies not in OpenAI's shape, engine deaths.

Positive cases on the generating and pooling routes are made cheap before they are sent (`fuzz_cases.cheapen_case`:
the served model, max_tokens <= 4, n <= 2, at most 4 prompts, messages, conversations, inputs or documents, short
texts). They stay valid, so they still reach the engine; negative cases go out exactly as drawn (the gateway
refuses them before any engine call).

The short profile runs in CI (tests/fuzz/); this module is the long one. It starts its own `ladle serve` (engine
and gateway) on loopback and runs two stages within `--max-time` seconds: every operation through schemathesis'
phases (examples, coverage, fuzzing, stateful), then the generating routes alone through fuzzing
(`--focus-share` of the time). Within a stage schemathesis gives each operation a share of the time;
`--max-examples` bounds one hypothesis run of an operation. The engine is checked after every scenario; one
JSON object with the cases sent per operation and phase, their statuses and every failure is appended to
`--out`. Exit status 1 on any failure, 5xx or engine death.

    ladle bench fuzz --max-examples 300 --max-time 900 --out benchmarks/results/fuzz_gateway.jsonl
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import add_model_arguments, append_result, git_commit, ladle_serve, utc_timestamp
from benchmarks.fuzz_cases import (
    CHECK_NAMES,
    GENERATION_ROUTES,
    REQUEST_TIMEOUT_S,
    FuzzTally,
    cheapen_case,
    configure_schema,
)


def engine_serving(address: str) -> bool:
    """The engine at `address` answers gRPC health with SERVING (within 10 s)."""
    from ladle.client import EngineClient

    try:
        with EngineClient(address) as client:
            client.wait_until_serving(10.0)
    except Exception:
        return False
    return True


def valid_request_succeeds(url: str, model: str) -> bool:
    """A plain chat completion through the gateway answers 200 with a choice."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    return response.status_code == 200 and bool(response.json().get("choices"))


def run_schemathesis(schema: Any, tally: FuzzTally, keep_going: Callable[[], bool]) -> str:
    """Run schemathesis' engine over `schema`, recording every case and failure into `tally`. After each
    scenario (an operation in one phase, or one stateful run) `keep_going()` is asked whether to go on.
    Returns why the run stopped."""
    from schemathesis.engine import events, from_schema

    stop_reason = "unknown"
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            _record_scenario(event.recorder, tally)
            if not keep_going():
                return "engine_died"
        elif isinstance(event, events.NonFatalError):
            tally.failure_count += 1
            tally.failures.append({"operation": event.label, "check": "error", "status": None,
                                   "message": str(event.value)[:500], "body": ""})
        elif isinstance(event, events.FatalError):
            raise event.exception
        elif isinstance(event, events.EngineFinished):
            stop_reason = str(event.stop_reason)
    return stop_reason


def _record_scenario(recorder: Any, tally: FuzzTally) -> None:
    for case_id, node in recorder.cases.items():
        interaction = recorder.interactions.get(case_id)
        response = interaction.response if interaction is not None else None
        tally.record(node.value, response)
        for check in recorder.checks.get(case_id, []):
            if check.failure_info is not None:
                failure = check.failure_info.failure
                status = response.status_code if response is not None else None
                tally.add_failure(node.value, check.name, f"{failure.title}: {failure.message}", status)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ladle bench fuzz", description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--max-examples", type=int, default=300, help="per hypothesis run of an operation")
    parser.add_argument("--max-time", type=int, default=900, help="seconds for both stages together")
    parser.add_argument("--focus-share", type=float, default=0.5,
                        help="share of --max-time for stage 2: fuzzing the generating routes alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", default="examples,coverage,fuzzing,stateful", help="of stage 1")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Stage:
    """A part of the run: `paths` (POST) or every operation (None), through `phases`, for `max_time_s`."""

    paths: tuple[str, ...] | None
    phases: tuple[str, ...]
    max_time_s: int


def stages(args: argparse.Namespace) -> list[Stage]:
    """Stage 1: every operation, `--phases`. Stage 2: only the generating routes, fuzzing only; they are the
    ones that reach the engine, and in stage 1 their slow cases get no more time than a GET's."""
    focus_s = int(args.max_time * args.focus_share)
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    every = Stage(None, phases, args.max_time - focus_s)
    focus = Stage(tuple(sorted(GENERATION_ROUTES)), ("fuzzing",), focus_s)
    return [stage for stage in (every, focus) if stage.max_time_s > 0]


def run_stage(url: str, model: str, args: argparse.Namespace, stage: Stage, tally: FuzzTally,
              keep_going: Callable[[], bool]) -> str:
    """One stage of the run against the gateway at `url`; why it stopped."""
    import schemathesis

    config = schemathesis.Config(max_time=stage.max_time_s)
    schema: Any = schemathesis.openapi.from_url(url + "/openapi.json", config=config)
    if stage.paths is not None:
        schema = schema.include(method="POST", path=list(stage.paths))
    configure_schema(schema, max_examples=args.max_examples, seed=args.seed, phases=stage.phases)
    schema.hook("map_case")(lambda context, case: cheapen_case(case, model))
    return run_schemathesis(schema, tally, keep_going)


def main(argv: Sequence[str] | None = None) -> int:
    import httpx
    import schemathesis

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    tally = FuzzTally()
    deaths = 0
    flags = ("--max-num-seqs", str(args.max_num_seqs), "--kv-cache-mib", str(args.kv_cache_mib))
    with ladle_serve(args.model, args.device, *flags) as served:
        url = served.base_url.removesuffix("/v1")
        model = httpx.get(served.base_url + "/models", timeout=30).json()["data"][0]["id"]

        def engine_still_serves() -> bool:
            nonlocal deaths
            if served.process.poll() is None and engine_serving(served.grpc_address):
                return True
            deaths += 1
            return False

        ran = []
        for stage in stages(args):
            started = time.monotonic()
            stop_reason = run_stage(url, model, args, stage, tally, engine_still_serves)
            ran.append({**asdict(stage), "seconds": round(time.monotonic() - started, 1), "stop_reason": stop_reason})
            if deaths:
                break
        serving = engine_serving(served.grpc_address)
        answered = serving and valid_request_succeeds(url, model)
    result = {
        "benchmark": "fuzz_gateway", "time": utc_timestamp(), "commit": git_commit(),
        "command": "ladle bench fuzz " + shlex.join(list(sys.argv[1:] if argv is None else argv)),
        "machine": platform.machine(), "cpus": os.cpu_count(), "device": args.device, "model": model,
        "schemathesis": schemathesis.__version__,
        "config": {"max_examples": args.max_examples, "seed": args.seed, "modes": ["positive", "negative"],
                   "checks": [*CHECK_NAMES, "error_shape"]},
        "stages": ran, "seconds": round(time.monotonic() - tally.started, 1),
        "examples": tally.examples, "operations": {k: v.as_json() for k, v in sorted(tally.operations.items())},
        "server_errors": tally.server_errors, "error_shape_problems": tally.shape_problems,
        "failure_count": tally.failure_count, "failures": tally.failures,
        "engine_deaths": deaths, "engine_serving_after": serving, "valid_request_after": answered,
    }
    print(f"{tally.examples} examples on {len(tally.operations)} method/path pairs in {result['seconds']} s: "
          f"{tally.failure_count} failures, {tally.server_errors} 5xx, {deaths} engine deaths")
    append_result(args.out, result)
    clean = not tally.failure_count and not tally.server_errors and not deaths and serving and answered
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
