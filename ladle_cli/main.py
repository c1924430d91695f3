"""The `ladle` command: parses flags (each also readable from a LADLE_* variable) and hands off to a package.

Heavy imports (torch, grpc servers, FastAPI) happen only inside the chosen subcommand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

# --async-scheduling's choices as EngineConfig.async_scheduling values (engine_server.config is torch-free).
from engine_server.config import ASYNC_SCHEDULING_MODES as ASYNC_SCHEDULING
from engine_server.config import (
    KV_CACHE_DTYPES,
    QUANTIZATION_MODES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    KVCacheDType,
    LoraConfig,
    SpeculativeConfig,
)

# `ladle bench <suite>` runs the module's `main(argv) -> int`.
BENCHMARKS = {
    "offline": "benchmarks.offline",
    "grpc": "benchmarks.grpc_stream",
    "structured": "benchmarks.structured",
    "serve": "benchmarks.serve",
    "gpu": "benchmarks.gpu",
    "batch": "benchmarks.batch",
    "batch_upload": "benchmarks.batch_upload",
    "batch_resume": "benchmarks.batch_resume",
    "fuzz": "benchmarks.fuzz_gateway",
    "soak": "benchmarks.soak",
    "routing": "benchmarks.routing",
    "quality": "benchmarks.quality",
    "host": "benchmarks.host",
    "speculative": "benchmarks.speculative",
    "embed": "benchmarks.embed",
    "memory": "benchmarks.memory",
    "lora": "benchmarks.lora",
}


def _env_default(flag: str, default: Any) -> Any:
    """The value of LADLE_<FLAG> (dashes become underscores) if set, else `default`."""
    value = os.environ.get("LADLE_" + flag.lstrip("-").replace("-", "_").upper())
    if value is None:
        return default
    if isinstance(default, bool):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return type(default)(value) if default is not None else value


def _add(parser: argparse.ArgumentParser, flag: str, default: Any, help_text: str, **kwargs: Any) -> None:
    env_name = "LADLE_" + flag.lstrip("-").replace("-", "_").upper()
    parser.add_argument(
        flag, default=_env_default(flag, default), help=f"{help_text} (env {env_name}; default: %(default)s)",
        **kwargs,
    )


def batch_step_target(value: str) -> float | None:
    """--batch-step-target: "auto" (None: the engine picks by device) or seconds >= 0 (0: no cap)."""
    if value == "auto":
        return None
    seconds = float(value)
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is neither 'auto' nor a number of seconds >= 0")
    return seconds


def state_snapshots(value: str) -> int | None:
    """--state-snapshots: "auto" (None: the engine sizes them from the KV cache memory) or a count >= 0."""
    if value == "auto":
        return None
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is neither 'auto' nor a count >= 0")
    return int(value)


def kv_cache_dtype(value: str) -> KVCacheDType:
    """--kv-cache-dtype: "auto" or "fp8" (vLLM's "fp8_e4m3" names the same); vLLM's "fp8_e5m2" is refused."""
    if value == "fp8_e4m3":
        return "fp8"
    if value not in KV_CACHE_DTYPES:
        served = "auto (the model's dtype) or fp8 (e4m3, also named fp8_e4m3)"
        raise argparse.ArgumentTypeError(f"{value!r} is not a KV cache dtype served here: {served}")
    return cast(KVCacheDType, value)


def speculative_config(value: str) -> SpeculativeConfig | None:
    """--speculative-config: "" (no speculative decoding) or vLLM's JSON object, e.g. '{"method": "ngram"}'."""
    if not value.strip():
        return None
    try:
        return SpeculativeConfig.from_json(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lora_modules(values: list[str] | str) -> tuple[tuple[str, str], ...]:
    """--lora-modules entries (NAME=PATH, or vLLM's JSON object with "name" and "path") as (name, path) pairs."""
    entries = values.split() if isinstance(values, str) else values
    modules = []
    for entry in entries:
        if entry.lstrip().startswith("{"):
            try:
                item = json.loads(entry)
                modules.append((str(item["name"]), str(item["path"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {entry!r} is not a JSON object with \"name\" and \"path\"") from None
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {entry!r} is not NAME=PATH")
        modules.append((name, path))
    return tuple(modules)


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """The engine's LoRA settings from its flags: None unless --enable-lora or --lora-modules."""
    modules = lora_modules(args.lora_modules)
    if not args.enable_lora and not modules:
        return None
    return LoraConfig(modules, args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--model", "default", "model: 'default', a .gguf file, a Hugging Face folder or dummy:<preset>")
    _add(parser, "--device", "auto", "where to run the model", choices=["auto", "cpu", "cuda"])


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--otlp-traces-endpoint", "", "OTLP/gRPC endpoint (e.g. http://127.0.0.1:4317) to send traces to "
         "(default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT; neither: no traces)")
    _add(parser, "--shutdown-timeout", 30.0, "seconds in-flight requests get to finish after SIGTERM", type=float)
    _add(parser, "--max-num-seqs", 128, "most sequences generated at once", type=int)
    _add(parser, "--max-waiting", 4096, "most queued requests; beyond it new ones get RESOURCE_EXHAUSTED", type=int)
    _add(parser, "--max-cross-attention-images", 8, "Llama 3.2 Vision: most images whose cross-attention K/V the "
         "running requests hold (~210 MB an image at 11B in bf16); a request past it waits, one alone always runs "
         "(0: no cap)", type=int)
    _add(parser, "--max-transcription-seconds", 3600.0, "Whisper: the longest clip a transcription may send (one "
         "over 30 s is transcribed in windows of at most 30 s cut at quiet points; a longer one is refused)",
         type=float)
    _add(parser, "--kv-cache-mib", 2048, "KV cache memory in MiB", type=int)
    _add(parser, "--kv-cache-dtype", "auto", "what the KV cache stores: auto (the model's dtype) or fp8 (e4m3 with a "
         "float32 scale per token and KV head: about half a 16-bit cache's bytes, a quarter of float32's, so as many "
         "more tokens fit; fp8_e4m3 is the same)", type=kv_cache_dtype, metavar="{auto,fp8}")
    _add(parser, "--state-snapshots", "auto", "a hybrid model's (Qwen3.5, Qwen3-Next, LFM2, Granite 4.0, "
         "Nemotron-H) prefix cache: how many snapshots of its recurrent states at prompts' last block boundaries to "
         "keep, from which later requests with those prefixes start (auto: as many as fit an eighth of the KV cache "
         "memory beside the running requests' states, at most --max-num-seqs; 0: no prefix served from the cache)",
         type=state_snapshots)
    _add(parser, "--grammar-timeout", 10.0, "seconds a constraint may take to compile (then INVALID_ARGUMENT)",
         type=float)
    _add(parser, "--enforce-eager", False, "never use CUDA graphs (they replay decode steps on CUDA otherwise)",
         action="store_true")
    _add(parser, "--async-scheduling", "auto", "schedule the next step while the device runs this one (auto: on CUDA)",
         choices=["auto", "on", "off"])
    _add(parser, "--batch-step-target", "auto", "seconds a step of batch work (decode rows and prefill) may take "
         "while interactive requests are about, so one arriving meanwhile waits about that long at most; learned "
         "from the measured steps (auto: 0.015 on the CPU, 0.02 on CUDA; after 5 s without interactive requests "
         "every row runs, with the prefill that fits 0.15 s on the CPU, 0.06 on CUDA, or 3x a given target; 0: no "
         "cap, batch steps take the whole token budget)",
         type=batch_step_target)
    _add(parser, "--quantization", "auto", "weights kept quantized: auto (gguf for a GGUF file on the CPU, int8 "
         "for an MXFP4 checkpoint there, fp8 for an FP8 checkpoint on an sm_89+ GPU, none elsewhere), none (float, "
         "the exact path: greedy output equal to transformers'), gguf (a GGUF file's own blocks, CPU), int8 (8-bit "
         "groups of any model's weights; on the CPU an MXFP4 checkpoint's experts as stored), fp8 "
         "(e4m3 weights per channel or as an FP8 checkpoint stores them, activations per token; on the CPU "
         "dequantized, for loading and measuring)", choices=QUANTIZATION_MODES)
    _add(parser, "--tool-call-parser", "auto", "the format tool calls are read in: auto (the one the chat "
         "template implies: Mistral's [TOOL_CALLS], MiniMax-M2's, Seed-OSS's, GLM-4.5's, Kimi K2's, DeepSeek's, "
         "Nemotron's, LFM2's, Granite 3's, Cohere's, Gemma 4's, OLMo 3's, Qwen3-Coder's XML, Hermes <tool_call>, "
         "pythonic for <|python_start|>, Llama 3 JSON, gpt-oss's harmony; Hermes otherwise) or a format's name, "
         "vLLM's or SGLang's (openai: harmony)", choices=TOOL_CALL_PARSERS)
    _add(parser, "--reasoning-parser", "auto", "split a chat's reasoning (<think>...</think>, Seed-OSS's "
         "<seed:think>, Magistral's [THINK], Cohere's <|START_THINKING|>, Gemma 4's <|channel>) off its content "
         "(reasoning_content): auto (when the chat template mentions the opening tag; gpt-oss's harmony analysis "
         "channel when it writes <|channel|>), none, or a family's name, vLLM's (openai_gptoss: harmony)",
         choices=REASONING_PARSERS)
    _add(parser, "--tensor-parallel-size", 1, "split the model over this many processes (tensor parallelism): this "
         "one and N-1 workers, one GPU each on CUDA, an even share of the cores each on the CPU", type=int)
    _add(parser, "--speculative-config", "", "speculative decoding, as vLLM spells it: a JSON object with "
         "\"method\" ngram (prompt lookup), suffix (suffix decoding) or draft_model (with \"model\": a draft "
         "model sharing the tokenizer), and optionally num_speculative_tokens (4), prompt_lookup_max (4), "
         "prompt_lookup_min (2), suffix_decoding_max_tree_depth, suffix_decoding_max_cached_requests, "
         "suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob, adaptive (true); the output is the one "
         "decoding without it gives (empty: off)", type=speculative_config)
    _add(parser, "--enable-lora", False, "serve LoRA adapters on the model (also on with --lora-modules): loaded "
         "at run time with the LoadAdapter RPC or the gateway's POST /v1/load_lora_adapter", action="store_true")
    _add(parser, "--lora-modules", "", "LoRA adapters to serve from the start, as NAME=PATH (a PEFT folder) or "
         "vLLM's JSON '{\"name\": ..., \"path\": ...}'; requests select one by its name as their model",
         nargs="*")
    _add(parser, "--max-loras", 4, "LoRA slots: the most adapters one step runs (requests of others wait)", type=int)
    _add(parser, "--max-lora-rank", 16, "the largest rank of an adapter the engine serves", type=int)
    _add(parser, "--max-cpu-loras", 16, "adapters whose weights stay in host memory (the rest are read from their "
         "folders again when next asked for)", type=int)
    _add(parser, "--generation-config", "auto", "sampling defaults for the fields a request leaves unset: "
         "auto|ladle|PATH (auto: the model's generation_config.json or the embedded model's card values; ladle: "
         "OpenAI's; PATH: a generation_config.json or a folder holding one)")
    _add(parser, "--override-generation-config", "", "JSON object applied over those defaults, e.g. "
         "'{\"temperature\": 0.7, \"max_tokens\": 256}' (keys: temperature, top_p, top_k, min_p, "
         "repetition_penalty, max_tokens or max_new_tokens)")
    _add(parser, "--hf-overrides", "", "JSON object laid over the model's config.json before it is read (vLLM's "
         "flag), e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
         "\"original_max_position_embeddings\": 32768}}' for a Qwen model's 128k context")
    _add(parser, "--chat-template", "", "the chat template to use instead of the model's (vLLM's flag): a file "
         "holding it, or the template itself")
    _add(parser, "--enable-auto-tool-choice", False, "accepted for vLLM's command lines: tool_choice 'auto' is "
         "always on (the calls are read in --tool-call-parser's format)", action="store_true")


def _gateway_flags(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--served-model-name", "", "model id clients use (default: the engine's model name)")
    _add(parser, "--api-key", "", "require 'Authorization: Bearer <key>' on every route but /health (a key of the "
         "project 'default')")
    _add(parser, "--api-keys-file", "", "file of 'KEY PROJECT' lines (# comments): the keys, each acting for its "
         "project's files, batches, responses and usage; 'KEY PROJECT admin' is an operator's key (/metrics, every "
         "project's usage); read again on SIGHUP")
    _add(parser, "--project-max-file-bytes", 100 * 1024**3, "bytes of files a project may store (then HTTP 400; "
         "0: no limit)", type=int)
    _add(parser, "--project-max-active-batches", 100, "unfinished batches a project may have (then HTTP 429; "
         "0: no limit)", type=int)
    _add(parser, "--file-sweep-interval", 60.0, "seconds between deletions of expired files (and of stored responses "
         "past --response-retention-days)", type=float)
    _add(parser, "--response-retention-days", 0.0, "days a stored /v1/responses response is kept, then deleted "
         "(OpenAI keeps them 30; 0: until deleted)", type=float)
    _add(parser, "--min-free-disk-mib", 1024.0, "free space the --data-dir volume keeps: below it uploads and new "
         "batches are refused with HTTP 507 (0: no floor)", type=float)
    _add(parser, "--metrics-api-key", "", "the key /metrics answers to (default: the keys of the project 'default'; "
         "anyone when the gateway has no keys)")
    _add(parser, "--rate-limits-file", "", "file of per-project limits, a line each: 'PROJECT "
         "requests_per_minute=N tokens_per_minute=N batch_tokens_per_day=N' ('*': every other project); read "
         "again on SIGHUP")
    _add(parser, "--request-timeout", 600.0, "seconds an engine call may take (then HTTP 504)", type=float)
    _add(parser, "--max-engine-message-mib", 64.0, "largest engine reply the gateway takes (the engine's own limit "
         "is 64; a batch line whose reply is larger ends as an error line)", type=float)
    _add(parser, "--max-request-mib", 16.0, "largest accepted request body in MiB (then HTTP 413)", type=float)
    _add(parser, "--max-image-mib", 20.0, "largest image a chat message may carry in MiB, in a data: URL or fetched "
         "(then HTTP 400)", type=float)
    _add(parser, "--max-audio-mib", 25.0, "largest audio clip a chat message may carry in MiB, as input_audio data, "
         "in a data: URL or fetched (then HTTP 400), and largest file of /v1/audio/transcriptions and "
         "/v1/audio/translations (then HTTP 413)", type=float)
    _add(parser, "--image-fetch-timeout", 10.0, "seconds fetching an http(s) image or audio URL of a chat message may "
         "take, redirects included (then HTTP 400)", type=float)
    _add(parser, "--allowed-media-domains", "", "host names image and audio URLs may be fetched from, comma-separated "
         "(exact names, checked on every redirect, trusted whatever they resolve to; default: any host whose "
         "addresses are all public)")
    _add(parser, "--data-dir", "", "where files' bytes (and the default SQLite database) live "
         "(default: $XDG_DATA_HOME/ladle or ~/.local/share/ladle)")
    _add(parser, "--database-url", "", "SQLAlchemy URL of the files-and-batches database, e.g. "
         "postgresql://user@host/db to share it between gateways (default: SQLite in --data-dir)")
    _add(parser, "--max-file-mib", 200.0, "largest accepted file upload in MiB (then HTTP 413)", type=float)
    _add(parser, "--batch-workers", 4, "batch jobs this gateway runs at once, claimed round-robin by project "
         "(0: leave them to other gateways; at most 64)", type=int)
    _add(parser, "--batch-window", 0, "engine items a batch keeps in flight (0: twice the engine's max-num-seqs)",
         type=int)
    _add(parser, "--batch-project-window", 0, "engine items all of one project's batches keep in flight together "
         "(0: the batch window times the number of engines)", type=int)
    _add(parser, "--batch-lease", 30.0, "seconds a batch stays claimed by a worker that stopped renewing it "
         "(after a crash, another worker resumes it then)", type=float)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladle", description="ladle: an LLM serving system.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="engine + gateway on this host with the embedded model")
    _model_flags(serve)
    _add(serve, "--host", "127.0.0.1", "address the gateway listens on (the engine listens on 127.0.0.1)")
    _add(serve, "--port", 8000, "HTTP port of the gateway", type=int)
    _add(serve, "--grpc-port", 50051, "gRPC port of the engine", type=int)
    _add(serve, "--engine-auth-token-file", "", "file holding the token the engine requires of every RPC but "
         "health and the gateway sends (default: a random one per start, in a file only this user can read, "
         "printed at start)")
    _engine_flags(serve)
    _gateway_flags(serve)

    engine = sub.add_parser("engine", help="the gRPC engine only")
    _model_flags(engine)
    _add(engine, "--host", "127.0.0.1", "address to listen on")
    _add(engine, "--port", 50051, "gRPC port (0: any free port; the address is printed)", type=int)
    _add(engine, "--auth-token-file", "", "file holding the token (one per line; each is accepted) that every RPC "
         "but grpc.health.v1 must carry as the metadata 'authorization: Bearer <token>', else UNAUTHENTICATED "
         "(default: no check)")
    _add(engine, "--drain-grace", 0.0, "seconds after SIGTERM during which health says NOT_SERVING but new calls "
         "are still served, so load balancers take the engine out of rotation before it refuses any", type=float)
    _engine_flags(engine)

    gateway = sub.add_parser("gateway", help="the OpenAI HTTP gateway only")
    _add(gateway, "--engine", "127.0.0.1:50051", "engine address(es), HOST:PORT[,HOST:PORT...]; dns:HOST:PORT "
         "makes every address HOST resolves to an engine (resolved again every --resolve-interval seconds)")
    _add(gateway, "--engine-auth-token-file", "", "file holding the engines' token (their --auth-token-file; the "
         "first line is sent)")
    _add(gateway, "--health-interval", 1.0, "seconds between polls of each engine's health and load", type=float)
    _add(gateway, "--resolve-interval", 10.0, "seconds between resolutions of dns: engine names", type=float)
    _add(gateway, "--routing", "cache_aware", "how calls are spread over engines: cache_aware (the engine most "
         "likely to hold the prompt's prefix, unless clearly busier) or least_busy",
         choices=["cache_aware", "least_busy"])
    _add(gateway, "--host", "127.0.0.1", "address to listen on")
    _add(gateway, "--port", 8000, "HTTP port (0: any free port; the URL is printed)", type=int)
    _add(gateway, "--drain-grace", 0.0, "seconds after SIGTERM during which /health answers 503 (draining) but "
         "requests are still served, so readiness checks take the gateway out of rotation before it stops listening",
         type=float)
    _add(gateway, "--shutdown-timeout", 30.0, "seconds requests in flight get to finish once the gateway stops "
         "(after --drain-grace); then they are cut", type=float)
    _add(gateway, "--otlp-traces-endpoint", "", "OTLP/gRPC endpoint (e.g. http://127.0.0.1:4317) to send traces "
         "to (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT; neither: no traces)")
    _gateway_flags(gateway)

    batch = sub.add_parser("batch", help="run an OpenAI-format batch file offline (re-run to resume)")
    batch.add_argument("-i", "--input", required=True, help="input .jsonl: one OpenAI batch request per line")
    batch.add_argument("-o", "--output", required=True,
                       help="output .jsonl: one result per line, appended; an existing file is resumed")
    _model_flags(batch)
    _add(batch, "--engine", "", "a running engine (HOST:PORT) to use instead of starting one for --model")
    _add(batch, "--engine-auth-token-file", "", "file holding the --engine's token (its --auth-token-file; the "
         "first line is sent)")
    _add(batch, "--window", 0, "engine items in flight (0: twice the engine's max-num-seqs)", type=int)
    _engine_flags(batch)

    bench = sub.add_parser("bench", help="benchmarks (see benchmarks/)")
    bench.add_argument("suite", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    return parser


def _engine(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from ladle.auth import AuthTokenError, read_token_file

    try:  # before anything heavy: a bad token file stops the start at once
        auth_tokens = read_token_file(args.auth_token_file) if args.auth_token_file else ()
    except AuthTokenError as exc:
        print(f"ladle engine: {exc}", file=sys.stderr)
        return 2
    try:
        lora = lora_config(args)
    except ValueError as exc:
        print(f"ladle engine: {exc}", file=sys.stderr)
        return 2

    from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine_server.server.server import SERVICE_NAME, ServerConfig, serve
    from engine_server.structured.compiler import GrammarCompilerConfig
    from ladle.log import configure_logging

    configure_logging()
    config = ServerConfig(
        engine=EngineConfig(
            model=args.model,
            device=args.device,
            enforce_eager=args.enforce_eager,
            async_scheduling=ASYNC_SCHEDULING[args.async_scheduling],
            quantization=args.quantization,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            generation_config=args.generation_config,
            override_generation_config=args.override_generation_config or None,
            hf_overrides=args.hf_overrides or None,
            chat_template=args.chat_template or None,
            speculative=args.speculative_config,
            tensor_parallel_size=args.tensor_parallel_size,
            lora=lora,
            max_transcription_seconds=args.max_transcription_seconds,
            cache=CacheConfig(
                memory_bytes=args.kv_cache_mib * 1024**2,
                dtype=args.kv_cache_dtype,
                state_snapshots=args.state_snapshots,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_waiting=args.max_waiting,
                max_cross_attention_images=args.max_cross_attention_images,
                batch_step_target_s=args.batch_step_target,
            ),
        ),
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        drain_grace=args.drain_grace,
        grammar=GrammarCompilerConfig(timeout_s=args.grammar_timeout),
        auth_tokens=auth_tokens,
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
    )

    def announce(address: str) -> None:
        # Printed once the port is ours; the server listens there once the model is loaded and warm.
        print(f"ladle engine: {SERVICE_NAME} on {address}", flush=True)

    code = asyncio.run(serve(config, announce))
    # A grammar compile still running inside xgrammar cannot be interrupted, and a native thread that is still
    # busy when the interpreter tears down aborts the process (SIGABRT). Everything is drained, stopped and
    # logged by now, so leave without the teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _gateway_config(args: argparse.Namespace, engines: str) -> Any:
    from pathlib import Path

    from gateway.config import GatewayConfig, parse_domains, parse_engine_addresses
    from gateway.keys import read_keys
    from gateway.rate_limits import RateLimits
    from gateway.routing import RoutingConfig
    from ladle.auth import sender_token

    config = GatewayConfig(
        engines=parse_engine_addresses(engines),
        routing=RoutingConfig(policy=getattr(args, "routing", "cache_aware")),
        resolve_interval_s=getattr(args, "resolve_interval", 10.0),
        health_interval_s=getattr(args, "health_interval", 1.0),
        served_model_name=args.served_model_name or None,
        api_key=args.api_key or None,
        api_keys_file=Path(args.api_keys_file) if args.api_keys_file else None,
        project_max_file_bytes=args.project_max_file_bytes or None,
        project_max_active_batches=args.project_max_active_batches or None,
        file_sweep_interval_s=args.file_sweep_interval,
        response_retention_s=args.response_retention_days * 86_400 or None,
        min_free_disk_bytes=int(args.min_free_disk_mib * 1024 * 1024),
        metrics_api_key=args.metrics_api_key or None,
        rate_limits_file=Path(args.rate_limits_file) if args.rate_limits_file else None,
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", "") or None,
        request_timeout_s=args.request_timeout,
        drain_grace_s=getattr(args, "drain_grace", 0.0),
        shutdown_timeout_s=args.shutdown_timeout,
        max_engine_message_bytes=int(args.max_engine_message_mib * 1024 * 1024),
        max_request_bytes=int(args.max_request_mib * 1024 * 1024),
        max_image_bytes=int(args.max_image_mib * 1024 * 1024),
        max_audio_bytes=int(args.max_audio_mib * 1024 * 1024),
        image_fetch_timeout_s=args.image_fetch_timeout,
        allowed_media_domains=parse_domains(args.allowed_media_domains),
        data_dir=Path(args.data_dir) if args.data_dir else None,
        database_url=args.database_url or None,
        max_file_bytes=int(args.max_file_mib * 1024 * 1024),
        batch_workers=args.batch_workers,
        batch_window=args.batch_window or None,
        batch_project_window=args.batch_project_window or None,
        batch_lease_s=args.batch_lease,
        engine_auth_token=sender_token(args.engine_auth_token_file) if args.engine_auth_token_file else None,
    )
    read_keys(config.api_key, config.api_keys_file)  # a bad keys file stops the start here, with its line named
    RateLimits(config.rate_limits_file)  # and so does a bad rate limits file
    return config


def _gateway(args: argparse.Namespace) -> int:
    import asyncio

    from gateway.server import serve
    from ladle.log import configure_logging

    configure_logging()
    try:
        config = _gateway_config(args, args.engine)
    except ValueError as exc:
        print(f"ladle gateway: {exc}", file=sys.stderr)
        return 2

    def announce(url: str) -> None:
        print(f"ladle gateway: OpenAI API on {url}/v1 (engines: {', '.join(config.engines)})", flush=True)

    return asyncio.run(serve(config, args.host, args.port, announce))


def _batch(args: argparse.Namespace) -> int:
    import contextlib

    from ladle.auth import AuthTokenError, sender_token
    from ladle_cli.batch_file import run_batch_file
    from ladle_cli.engine_child import engine_token_file

    # An engine of our own (no --engine) requires a token, like `ladle serve`'s: a random one unless given.
    given = args.engine_auth_token_file
    with contextlib.nullcontext(given) if args.engine else engine_token_file(given) as token_file:
        args.engine_auth_token_file = token_file
        try:
            args.engine_auth_token = sender_token(token_file) if token_file else None
        except AuthTokenError as exc:
            print(f"ladle batch: {exc}", file=sys.stderr)
            return 2
        return run_batch_file(args)


def _serve(args: argparse.Namespace) -> int:
    from ladle_cli.engine_child import engine_token_file
    from ladle_cli.serve import serve_all

    with engine_token_file(args.engine_auth_token_file) as token_file:
        args.engine_auth_token_file = token_file
        try:
            config = _gateway_config(args, f"127.0.0.1:{args.grpc_port}")
        except ValueError as exc:
            print(f"ladle serve: {exc}", file=sys.stderr)
            return 2
        return serve_all(args, config)


def _bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(BENCHMARKS[args.suite])
    return int(module.main(list(args.args)))


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "serve": _serve,
        "engine": _engine,
        "gateway": _gateway,
        "batch": _batch,
        "bench": _bench,
    }
    sys.exit(handlers[args.command](args))

