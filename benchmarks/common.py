"""What every benchmark shares: workload flags, a run's provenance (commit, time), appending a result to .jsonl."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ladle.auth import bearer_metadata, new_token

SERVE_STARTUP_TIMEOUT_S = 600.0


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model (default: the engine's default model) and --device (cpu or cuda), as every benchmark spells them."""
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])


def add_workload_arguments(parser: argparse.ArgumentParser, num_seqs: int = 64) -> None:
    """The model and the random-token workload: --model --device --num-seqs --input-len --output-len --seed."""
    add_model_arguments(parser)
    parser.add_argument("--num-seqs", type=int, default=num_seqs)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (results differ between Intel and AMD parts), else the platform's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def git_commit() -> str:
    """The checked-out commit of this repository (`git rev-parse HEAD`), or "unknown" outside a git checkout.

    `LADLE_COMMIT` overrides it: a copy of the tree without `.git` (the GPU machine's) is told its commit.
    """
    if os.environ.get("LADLE_COMMIT"):
        return os.environ["LADLE_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()


def utc_timestamp() -> str:
    """Now, as the `time` field of every result: ISO 8601 in UTC, whole seconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def report_result(out: Path | None, result: dict[str, Any]) -> None:
    """Print `result` as indented JSON and append it to `out` (`append_result`)."""
    print(json.dumps(result, indent=2))
    append_result(out, result)


def append_result(out: Path | None, result: dict[str, Any]) -> None:
    """Append `result` as one JSON line to `out` (creating its folder); nothing when `out` is None."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(result) + "\n")


def hf_model(model: str, device: str, dtype: Any) -> Any:
    """transformers' model for a ladle model spec, holding exactly ladle's weights (for `dummy:*` the same
    seeded random weights), so both systems run the same network. `dtype` is a torch dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine_server.loader import resolve_model
    from engine_server.loader.dummy import GEMMA3N_HF_CONFIGS, GEMMA4_HF_CONFIGS, STATE_SPACE_HF_CONFIGS

    source = resolve_model(model)
    cfg = source.config
    if cfg.linear_attention is not None:
        return _hybrid_hf_model(source, device, dtype)
    if cfg.gemma4 is not None:
        return _preset_hf_model(source, device, dtype, GEMMA3N_HF_CONFIGS if cfg.altup else GEMMA4_HF_CONFIGS)
    if cfg.architecture == "mamba":
        return _preset_hf_model(source, device, dtype, STATE_SPACE_HF_CONFIGS)
    hf_config = AutoConfig.for_model(
        cfg.architecture,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias,
        rope_scaling=None if cfg.rope_scaling is None else {"rope_type": "llama3", **asdict(cfg.rope_scaling)},
        **_transformers_experts(cfg),
    )
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(_stack_experts(dict(source.weights())), strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):  # a tied lm_head is not in the list
        raise ValueError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return hf.to(device).eval()


def _folder_hf_model(source: Any, device: str, dtype: Any) -> Any:
    """transformers' model on a real model's folder: its checkpoint as it is, or a GGUF file's tensors as ladle reads
    them, written out as a checkpoint (`write_float_checkpoint`) for the load."""
    from transformers import AutoModelForCausalLM

    from engine_server.loader import write_float_checkpoint

    with tempfile.TemporaryDirectory(prefix="float-checkpoint-") as scratch:
        folder = source.path if source.gguf_path is None else write_float_checkpoint(source, Path(scratch))
        loaded: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        return loaded.to(device).eval()


def _preset_hf_model(source: Any, device: str, dtype: Any, configs: dict[str, dict[str, object]]) -> Any:
    """transformers' model of a family whose presets are its own config's arguments (Gemma 4's, Gemma 3n's, the state
    space models'): a folder's own, or a `dummy:` preset's weights in the config the preset was made from (`configs`,
    by preset name: `loader.dummy.GEMMA4_HF_CONFIGS`, `GEMMA3N_HF_CONFIGS`, `STATE_SPACE_HF_CONFIGS`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not source.random_weights:
        return _folder_hf_model(source, device, dtype)
    arguments = dict(configs[source.config.name.removeprefix("dummy:")])
    hf_config = AutoConfig.for_model(str(arguments.pop("model_type")), **arguments)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(dict(source.weights()), strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise ValueError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return hf.to(device).eval()


def _hybrid_hf_model(source: Any, device: str, dtype: Any) -> Any:
    """transformers' Qwen3.5 or Qwen3-Next: a folder's own (its config and checkpoint as they are), or a `dummy:`
    preset's weights (Qwen3.5's layout) in Qwen3.5's text model of the preset's shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not source.random_weights:
        return _folder_hf_model(source, device, dtype)
    cfg = source.config
    linear = cfg.linear_attention
    experts = (
        {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
         "moe_intermediate_size": cfg.moe_intermediate_size,
         "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
        if cfg.num_experts else {"intermediate_size": cfg.intermediate_size}
    )  # fmt: skip
    hf_config = AutoConfig.for_model(
        "qwen3_5_moe_text" if cfg.num_experts else "qwen3_5_text",
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.partial_rotary_factor},
        layer_types=["linear_attention" if cfg.is_linear_layer(i) else "full_attention"
                     for i in range(cfg.num_hidden_layers)],
        linear_num_key_heads=linear.num_key_heads, linear_num_value_heads=linear.num_value_heads,
        linear_key_head_dim=linear.key_head_dim, linear_value_head_dim=linear.value_head_dim,
        linear_conv_kernel_dim=linear.conv_kernel, **experts,
    )  # fmt: skip
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(_stack_experts(dict(source.weights())), strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise ValueError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return hf.to(device).eval()


def _transformers_experts(cfg: Any) -> dict[str, Any]:
    """A `ModelConfig`'s mixture-of-experts fields as transformers' config of its family spells them ({} if dense)."""
    if not cfg.num_experts:
        return {}
    if cfg.architecture == "mixtral":
        return {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok}
    fields = {
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
        "mlp_only_layers": list(cfg.dense_layers),
    }  # fmt: skip
    if cfg.architecture == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return fields


def _stack_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint tensors (one per expert and projection) in transformers 5's in-memory layout: each layer's experts
    as `experts.gate_up_proj` `[E, 2 * I, H]` and `experts.down_proj` `[E, H, I]`."""
    import torch

    banks: dict[str, dict[int, dict[str, Any]]] = {}
    stacked = {}
    for name, tensor in weights.items():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            stacked[name] = tensor
            continue
        expert, projection, _ = tail.split(".")
        banks.setdefault(head + ".experts", {}).setdefault(int(expert), {})[projection] = tensor
    for bank, experts in banks.items():
        order = [experts[e] for e in sorted(experts)]
        stacked[f"{bank}.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in order])
        stacked[f"{bank}.down_proj"] = torch.stack([p["down_proj"] for p in order])
    return stacked


@dataclass(frozen=True)
class Served:
    """A running `ladle serve`: its OpenAI base URL (http://127.0.0.1:PORT/v1), its engine's gRPC address and the
    token that engine requires (send `engine_metadata` with every call but health)."""

    base_url: str
    grpc_address: str
    process: subprocess.Popen[str]
    engine_token: str

    @property
    def engine_metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.engine_token)


def write_gpt2_tokenizer(writer: Any, folder: Path, vocab_size: int | None = None) -> None:
    """A tokenizer saved in `folder` (tokenizer.json's BPE vocabulary and merges, its chat template) into a
    `GGUFWriter`'s metadata as llama.cpp's `gpt2` tokenizer: its first 17 tokens control ones, bos 1, eos 2 (the
    embedded model's). With `vocab_size`, padded to that many entries with reserved tokens (a model's embedding
    keeps its size)."""
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    tokens += [f"<|reserved_{i}|>" for i in range((vocab_size or len(tokens)) - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    writer.add_token_types([3 if i < 17 else 1 for i in range(len(tokens))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    template = folder / "chat_template.jinja"  # where transformers 5 saves it, else in tokenizer_config.json
    if template.is_file():
        writer.add_chat_template(template.read_text())
    else:
        writer.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def ladle_serve(
    model: str, device: str, *flags: str, log_level: str = "WARNING", data_dir: Path | None = None
) -> Iterator[Served]:
    """`ladle serve` on free loopback ports with a throwaway data directory (or `data_dir`, prepared by the caller),
    once it printed "ready"; stopped with SIGTERM (SIGKILL after 60 s) on exit. `flags` go to `ladle serve` as
    they are."""
    grpc_port = free_port()
    with tempfile.TemporaryDirectory(prefix="ladle-bench-") as scratch:
        data_dir = data_dir or Path(scratch)
        token, token_file = new_token(), Path(scratch) / "engine-token"
        token_file.write_text(token)
        command = [sys.executable, "-m", "ladle_cli", "serve", "--model", model, "--device", device,
                   "--port", "0", "--grpc-port", str(grpc_port), "--data-dir", str(data_dir),
                   "--engine-auth-token-file", str(token_file), *flags]
        env = {**os.environ, "LADLE_LOG_LEVEL": log_level, "NO_PROXY": "*"}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert process.stdout is not None
            url = ""
            deadline = time.monotonic() + SERVE_STARTUP_TIMEOUT_S
            while time.monotonic() < deadline:
                line = process.stdout.readline()
                if not line:
                    raise RuntimeError("ladle serve exited before it was ready")
                if "gateway (OpenAI API) on " in line:
                    url = line.split(" on ", 1)[1].split()[0]
                if line.startswith("ladle serve: ready"):
                    break
            yield Served(url, f"127.0.0.1:{grpc_port}", process, token)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
