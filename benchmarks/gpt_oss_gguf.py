"""gpt-oss-20b as people run it on a CPU: a GGUF file in llama.cpp's `gpt-oss` layout at gpt-oss-20b's shapes (MXFP4
experts, Q8_0 attention, embeddings and LM head, as ggml-org's gpt-oss-20b-mxfp4.gguf holds them), made here with
random values (never fetched), served by ladle from its blocks (the experts as their MXFP4 blocks, in the C++
expert kernel) and by llama.cpp, each in a process of its own on the same token ids: single-stream output
tok/s (prefill included), the seconds from start to the timed run (conversion, loading and a warm-up), and the
process's peak resident memory.

The values: MXFP4 codes drawn uniformly under a scale of 2 ** -8 (weights up to ~0.02), Q8_0 blocks of random int8
under 0.02 / 127, norms 1, biases and sinks 0. Speed does not depend on them. The tokenizer is the embedded model's,
padded to gpt-oss's 201,088 entries (the embedding and LM head keep their size). The file (~12 GB) is cached under
`$LADLE_CACHE_DIR/gpt-oss-gguf` (else `~/.cache/ladle/gpt-oss-gguf`). llama-cpp-python is not a dependency of the
project: without it only ladle runs.

    python -m benchmarks.gpt_oss_gguf --out benchmarks/results/gpt_oss_gguf_cpu.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import cpu_model_name, git_commit, report_result, utc_timestamp, write_gpt2_tokenizer
from benchmarks.offline import bench_ladle, bench_llama_cpp, make_workload
from engine_server.loader import resolve_model
from engine_server.loader.source import default_cache_dir

# gpt-oss-20b's shapes (its config.json; the `dummy:gpt-oss-20b` preset's).
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 201088, 2880, 24, 64, 8, 64
EXPERTS, USED, EXPERT_WIDTH, WINDOW, CONTEXT = 32, 4, 2880, 128, 131072
MXFP4_SCALE_BYTE = 119  # 2 ** (119 - 127): e2m1 values up to 6 / 256
Q8_SCALE = 0.02 / 127


def _q8_0(rows: int, columns: int) -> tuple[tuple[int, ...], Callable[[np.random.Generator], np.ndarray]]:
    """The byte shape of a `[rows, columns]` Q8_0 matrix and what draws its random blocks."""

    def make(rng: np.random.Generator) -> np.ndarray:
        blocks = rng.integers(0, 256, size=(rows, columns // 32, 34), dtype=np.uint8)
        blocks[..., 0:2] = np.array([Q8_SCALE], dtype=np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)

    return (rows, columns // 32 * 34), make


def _mxfp4(rows: int, columns: int) -> tuple[tuple[int, ...], Callable[[np.random.Generator], np.ndarray]]:
    """The byte shape of an `[EXPERTS, rows, columns]` MXFP4 bank and what draws its random blocks."""

    def make(rng: np.random.Generator) -> np.ndarray:
        blocks = rng.integers(0, 256, size=(EXPERTS, rows, columns // 32, 17), dtype=np.uint8)
        blocks[..., 0] = MXFP4_SCALE_BYTE
        return blocks.reshape(EXPERTS, rows, -1)

    return (EXPERTS, rows, columns // 32 * 17), make


def _float(values: np.ndarray) -> tuple[tuple[int, ...], Callable[[np.random.Generator], np.ndarray]]:
    """An F32 tensor of `values`."""
    return values.shape, lambda rng: values


def _tensors() -> Iterator[tuple[str, Any, tuple[tuple[int, ...], Callable[[np.random.Generator], np.ndarray]]]]:
    """(name, GGML type or None for F32, (data shape, what makes the data)) of every tensor, in file order."""
    from gguf import GGMLQuantizationType as T

    ones, zeros = np.ones(HIDDEN, np.float32), np.zeros(HIDDEN, np.float32)
    router = np.random.default_rng(1).standard_normal((EXPERTS, HIDDEN)).astype(np.float32) * 0.02
    yield "token_embd.weight", T.Q8_0, _q8_0(VOCAB, HIDDEN)
    yield "output_norm.weight", None, _float(ones)
    yield "output.weight", T.Q8_0, _q8_0(VOCAB, HIDDEN)
    for layer in range(LAYERS):
        blk = f"blk.{layer}"
        yield f"{blk}.attn_norm.weight", None, _float(ones)
        yield f"{blk}.post_attention_norm.weight", None, _float(ones)
        for name, rows in (("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM),
                           ("attn_v", KV_HEADS * HEAD_DIM)):  # fmt: skip
            yield f"{blk}.{name}.weight", T.Q8_0, _q8_0(rows, HIDDEN)
            yield f"{blk}.{name}.bias", None, _float(np.zeros(rows, np.float32))
        yield f"{blk}.attn_output.weight", T.Q8_0, _q8_0(HIDDEN, HEADS * HEAD_DIM)
        yield f"{blk}.attn_output.bias", None, _float(zeros)
        yield f"{blk}.attn_sinks.weight", None, _float(np.zeros(HEADS, np.float32))
        yield f"{blk}.ffn_gate_inp.weight", None, _float(router)
        yield f"{blk}.ffn_gate_inp.bias", None, _float(np.zeros(EXPERTS, np.float32))
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            yield f"{blk}.{name}.weight", T.MXFP4, _mxfp4(EXPERT_WIDTH, HIDDEN)
            yield f"{blk}.{name}.bias", None, _float(np.zeros((EXPERTS, EXPERT_WIDTH), np.float32))


def gpt_oss_gguf(cache: Path | None = None) -> Path:
    """The benchmark's file (module doc), written once (streamed tensor by tensor) and then reused."""
    from gguf import GGUFWriter, RopeScalingType

    path = (cache or default_cache_dir()) / "gpt-oss-gguf" / "gpt-oss-20b-shaped-mxfp4.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    writer = GGUFWriter(str(partial), "gpt-oss")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(EXPERT_WIDTH)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(150000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(USED)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_sliding_window(WINDOW)
    writer.add_expert_feed_forward_length(EXPERT_WIDTH)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    write_gpt2_tokenizer(writer, resolve_model("default").tokenizer_path, VOCAB)
    writer.add_tokenizer_pre("gpt-4o")
    # The tensors' infos first (their shapes and types), then their data, one tensor in memory at a time.
    tensors = list(_tensors())
    for name, kind, (shape, _) in tensors:
        dtype = np.dtype(np.uint8 if kind is not None else np.float32)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, _, (_, make) in tensors:
        writer.write_tensor_data(make(rng))
    writer.close()
    partial.rename(path)
    return path


def _proc_gib(path: str, field: str) -> float:
    """A `field:  <n> kB` line of this process's /proc/self/`path`, in GiB."""
    return int(Path(f"/proc/self/{path}").read_text().split(f"{field}:")[1].split()[0]) / 1024**2


def _anon_rss_gib() -> float:
    """This process's resident anonymous memory (its own allocations; not the file's pages it maps), in GiB."""
    return _proc_gib("status", "RssAnon")


def _measure(system: str, path: str, prompts: list[list[int]], output_len: int, repeats: int, queue: Any) -> None:
    """One system on the file, in this (child) process: its timed runs (the median's), the seconds before them, its
    peak resident memory (with the file's pages it maps: `peak_rss_gib`; without: `peak_anon_rss_gib`, sampled
    every 0.2 s) and how much of its memory ended on huge pages (`anon_huge_pages_gib`)."""
    import threading

    import torch

    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _anon_rss_gib())

    threading.Thread(target=sample, daemon=True).start()
    started = time.perf_counter()
    try:
        if system == "ladle":  # a context for the workload: the model's 131,072 tokens would not fit the KV pool
            timed = bench_ladle(path, "cpu", prompts, output_len, 1, "auto", repeats, max_model_len=4096)
        else:
            timed = bench_llama_cpp(Path(path), prompts, output_len, torch.get_num_threads(), repeats)
    except Exception as error:  # reported, not left for the parent to wait on
        queue.put({"error": f"{type(error).__name__}: {error}"})
        raise
    total = time.perf_counter() - started
    timed["seconds_before_timed_run"] = round(total - sum(timed["output_tokens"] / r for r in
                                                          timed.get("runs_tok_per_s", [timed["output_tok_per_s"]])), 1)
    timed["anon_huge_pages_gib"] = round(_proc_gib("smaps_rollup", "AnonHugePages"), 2)
    done.set()
    timed["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2, 2)
    timed["peak_anon_rss_gib"] = round(max(peak[0], _anon_rss_gib()), 2)
    queue.put(timed)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The one-stream workload's arguments and `--out` (this module's and `benchmarks.gpt_oss_mxfp4`'s)."""
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system; the median's figures")
    parser.add_argument("--out", type=Path, help="append the JSON result to this .jsonl file")


def measure_in_child(system: str, path: Path, prompts: list[list[int]], output_len: int, repeats: int) -> Any:
    """`_measure` of `system` on `path` in a process of its own (spawned: nothing of this one's memory shared)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_measure, args=(system, str(path), prompts, output_len, repeats, queue))
    process.start()
    measured = queue.get()
    process.join()
    return measured


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    path = gpt_oss_gguf()
    print(f"{path}: {path.stat().st_size / 1024**3:.2f} GiB ({time.perf_counter() - started:.0f} s)", flush=True)
    prompts = make_workload(1, args.input_len, 49152, 0)
    systems: dict[str, Any] = {}
    names = ["ladle"] + (["llama_cpp"] if importlib.util.find_spec("llama_cpp") is not None else [])
    for system in names:
        systems[system] = measure_in_child(system, path, prompts, args.output_len, args.repeats)
        print(f"{system}: {systems[system]}", flush=True)
    llama, ours = (systems.get(name, {}).get("output_tok_per_s") for name in ("llama_cpp", "ladle"))
    result = {
        "benchmark": "gpt_oss_gguf", "time": utc_timestamp(), "commit": git_commit(),
        "command": "python -m benchmarks.gpt_oss_gguf " + " ".join(argv or []),
        "machine": {"cpu_model": cpu_model_name(), "cpu_count": multiprocessing.cpu_count()},
        "file": {"name": path.name, "gib": round(path.stat().st_size / 1024**3, 2),
                 "layout": "gpt-oss-20b shapes; MXFP4 experts, Q8_0 attention, embeddings and LM head; random"},
        "workload": {"num_seqs": 1, "input_len": args.input_len, "output_len": args.output_len, "greedy": True,
                     "ignore_eos": True, "repeats": args.repeats},
        "systems": systems,
        "ratio_vs_llama_cpp": round(ours / llama, 3) if ours and llama else None,
    }  # fmt: skip
    report_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
