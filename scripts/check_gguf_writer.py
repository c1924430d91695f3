"""Check the tests' GGUF writer against llama.cpp: `tests.families.write_gguf` stands in for llama.cpp's converter, so
llama.cpp itself (llama-cpp-python, not a dependency of the project: install it to run this) must read its files as
the checkpoints they came from.

For each family the GGUF tests write (their shapes and overrides, tests/unit/test_family_gguf.py), a random model is
saved by transformers, written to an all-F32 GGUF file, and decoded greedily by llama.cpp from that file and by
transformers from the checkpoint: the tokens must be equal. A file laid out other than as llama.cpp's converter lays
it (rows permuted, value heads grouped where llama.cpp tiles them) gives other tokens from the first few on. The
prompts are longer than Phi-3's test model's original context (PROMPTS), where llama.cpp and transformers pick
LongRoPE's factors alike. Where two near-tied tokens part them, the logits both give along transformers' tokens
(`max_logit_difference`) still say whether llama.cpp read the file as the checkpoint.

With `--fuse-gate-up-exps` the files of the families with experts hold each layer's gate and up banks as one
tensor, as llama.cpp's converter writes them when given that option; with `--joined-kv-b` DeepSeek's files hold each
layer's `kv_b_proj` whole, as its converter wrote them before it split the tensor in two.

    .venv/bin/python scripts/check_gguf_writer.py --out benchmarks/results/gguf_writer_llama_cpp.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import append_result, git_commit, utc_timestamp
from tests.families import MODELS, save_family, write_gguf

# Each longer than the 32 positions Phi-3's LongRoPE test model was trained for: llama.cpp takes the long factors
# whenever its context is longer than that, transformers (and ladle) once the sequence is.
_STORY = " It was a long story about the many things that happened on the way, one after another, until the end." * 2
PROMPTS = tuple(p + _STORY for p in ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Write a haiku."))
NEW_TOKENS = 16
_F32_CACHE = 0  # GGML_TYPE_F32


def families() -> dict[str, dict[str, Any]]:
    """Each family the GGUF tests write, with their overrides (`save_family`'s)."""
    from tests.unit.test_family_gguf import (
        DEEPSEEK_GGUF,
        GEMMA3N_GGUF,
        GLM4_MOE_GGUF,
        GPT_OSS_GGUF,
        HYBRID_GGUF,
        LLAMA4_GGUF,
        MOE_GGUF,
        PLAIN_GGUF,
    )
    from tests.unit.test_recurrent_gguf import GRANITE_GGUF, NEMOTRON_3_GGUF, NEMOTRON_H_GGUF, STATE_SPACE_GGUF

    gemma3 = {"num_hidden_layers": 6, "query_pre_attn_scalar": 16,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}  # fmt: skip
    # llama.cpp rounds YaRN's correction range outward (floor and ceil), as transformers does with `truncate`; the
    # released gpt-oss does not (`truncate` false, which ladle reads a gpt-oss file as). Compared with the range
    # rounded, llama.cpp and transformers run the same rope and the check sees the file's layout alone.
    gpt_oss_rope = {**MODELS["gpt-oss"][1]["rope_parameters"], "truncate": True}
    # llama.cpp reads a `deepseek2` file without a q rank only at DeepSeek-V2-Lite's 27 layers (or 26): it asks for
    # `attention.q_lora_rank` at any other count. Over 27 random layers, rounding flips some top-2 choices of experts
    # (logits then part by ~0.5, at 4 layers by 0.01): every expert is used, so the check sees the file's layout.
    deepseek_v2 = {**DEEPSEEK_GGUF["deepseek-v2"], "num_hidden_layers": 27, "num_experts_per_tok": 8}
    # llama.cpp (0.3.36) windows an `exaone4` file's layers, and leaves its global ones without rope, only at EXAONE
    # 4.0-32B's 64 layers; at any other count it turns every layer and attends to all (transformers and ladle read
    # the file's window and flags at any count).
    exaone4 = {**PLAIN_GGUF["exaone4"], "num_hidden_layers": 64}
    # llama.cpp (0.3.36) turns GLM-5's index keys and queries with a Hadamard rotation built for its released index
    # heads, 128 wide with rope over 64 dims (narrower ones fail its graph's shape checks).
    glm_5 = {**DEEPSEEK_GGUF["glm-moe-dsa"], "index_head_dim": 128, "qk_rope_head_dim": 64}
    # llama.cpp normalises Falcon Mamba's time step, B and C at the layers' epsilon (the file holds no other);
    # transformers at `mixer_rms_eps`: the check's model has both at 1e-5.
    # Its Mamba-1 layers take only the released models' expansion of 2 (the tests' model widens 64 channels to 96).
    falcon_mamba = {**STATE_SPACE_GGUF["falcon-mamba"], "mixer_rms_eps": 1e-5, "intermediate_size": 128}
    mamba = {**STATE_SPACE_GGUF["mamba"], "intermediate_size": 128}
    # llama.cpp (0.3.36) reads a `gemma3n` file with the released models' structure whatever its keys say: every
    # fifth layer full, the first ten MLPs sparse at 0.95, K/V of their own on the first 20 layers (E2B's 30 layers),
    # per-layer inputs 256 wide, LAuReL of rank 64.
    gemma3n = {**GEMMA3N_GGUF, "num_hidden_layers": 30, "num_kv_shared_layers": 10, "hidden_size_per_layer_input": 256,
               "laurel_rank": 64,
               "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 6,
               "activation_sparsity_pattern": [0.95] * 10 + [0.0] * 20}  # fmt: skip
    return {"phi3-longrope": {}, "gemma3": gemma3, **MOE_GGUF, "llama4": LLAMA4_GGUF, **HYBRID_GGUF, "gemma4": {},
            "gemma4-moe": {}, "gpt-oss": {**GPT_OSS_GGUF, "rope_parameters": gpt_oss_rope}, "glm4": {},
            "glm4-moe": GLM4_MOE_GGUF, "minimax-m2": {}, "deepseek-v3": DEEPSEEK_GGUF["deepseek-v3"],
            "deepseek-v2": deepseek_v2, "glm4-moe-lite": DEEPSEEK_GGUF["glm4-moe-lite"],
            "glm-moe-dsa": glm_5,
            **PLAIN_GGUF, "exaone4": exaone4, "lfm2": {}, "lfm2-moe": {},
            **GRANITE_GGUF, "nemotron-h": NEMOTRON_H_GGUF, "nemotron-h-moe": NEMOTRON_3_GGUF, "falcon-h1": {},
            "jamba": {}, **STATE_SPACE_GGUF, "mamba": mamba, "falcon-mamba": falcon_mamba, "dbrx": {},
            "gemma3n": gemma3n}


def check(
    family: str, overrides: dict[str, Any], root: Path, fuse_gate_up_exps: bool = False, joined_kv_b: bool = False
) -> dict[str, Any]:
    """llama.cpp's and transformers' greedy tokens for PROMPTS on one family's file and checkpoint (its gate and up
    banks of experts fused: `fuse_gate_up_exps`; DeepSeek's `kv_b_proj` whole, as older files hold it:
    `joined_kv_b`)."""
    import llama_cpp
    import torch
    import transformers
    from gguf import GGMLQuantizationType

    folder = save_family(root / "hf", family, head_spread=0.5, **overrides)
    f32 = GGMLQuantizationType.F32
    gguf = write_gguf(folder, root / "model.gguf", f32, f32, fuse_gate_up_exps=fuse_gate_up_exps,
                      joined_kv_b=joined_kv_b)  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if family == "gemma3n":
        _as_llama_cpp_computes(model)
    # F32 caches (llama.cpp's default is F16): a sparse-attention model's choice of positions (GLM-5's) flips at
    # near-ties under half precision; every other family reads the same tokens either way.
    llama = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=2, logits_all=True, verbose=False,
                            type_k=_F32_CACHE, type_v=_F32_CACHE)  # fmt: skip
    equal, prefixes, gaps, differences = 0, [], [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :]
        llama.reset()
        llama.eval(ids)
        ours: list[int] = []
        for _ in range(NEW_TOKENS):
            ours.append(int(llama.scores[llama.n_tokens - 1].argmax()))
            llama.eval(ours[-1:])
        equal += ours == theirs.tolist()
        prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs.tolist(), strict=True)) if a != b), NEW_TOKENS)
        prefixes.append(prefix)
        if prefix < NEW_TOKENS:  # how far apart transformers puts the two choices: a near-tie, or a misread file
            with torch.no_grad():
                logits = model(torch.tensor([ids + theirs[:prefix].tolist()])).logits[0, -1]
            gaps.append(round(float(logits[theirs[prefix]] - logits[ours[prefix]]), 5))
        # Both models' logits along transformers' tokens: a misread file moves them by whole units, rounding by little.
        sequence = ids + theirs.tolist()
        llama.reset()
        llama.eval(sequence)
        with torch.no_grad():
            reference = model(torch.tensor([sequence])).logits[0, len(ids) - 1 :]
        read = torch.from_numpy(llama.scores[len(ids) - 1 : len(sequence)].copy())
        differences.append(round(float((read - reference).abs().max()), 5))
    llama.close()
    return {"family": family, "overrides": overrides, "fuse_gate_up_exps": fuse_gate_up_exps,
            "reference": "transformers, computing as llama.cpp does (_as_llama_cpp_computes)" if family == "gemma3n"
            else "transformers",
            "joined_kv_b": joined_kv_b, "prompts": len(PROMPTS), "equal": equal,
            "common_prefix": prefixes, "logit_gap_where_they_part": gaps, "max_logit_difference": differences,
            "llama_cpp_python": llama_cpp.__version__, "transformers": transformers.__version__}  # fmt: skip


def _as_llama_cpp_computes(model: Any) -> None:
    """`model` (a Gemma 3n) computing what llama.cpp (0.3.36) computes where its formulas differ from transformers':
    the sparse MLPs' cutoff from the gates' std over `n - 1` (transformers': over `n`), and GELU from its float16
    table (the input rounded to float16, the output too). Neither is the file's layout, and this random model's
    streams turn them into logits ~4 apart; with both, llama.cpp and transformers part by ~1e-3 (measured)."""
    import torch

    def cutoff(self: Any, inputs: torch.Tensor) -> torch.Tensor:
        quantile = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(self.activation_sparsity)).to(inputs.dtype)
        std = inputs.std(dim=-1, keepdim=True, unbiased=True)
        return torch.relu(inputs - (inputs.mean(dim=-1, keepdim=True) + std * quantile))

    class HalfTableGelu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()

    for layer in model.model.layers:
        layer.mlp._gaussian_topk = cutoff.__get__(layer.mlp)
        layer.mlp.act_fn = layer.act_fn = HalfTableGelu()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", help="only these families (default: all)")
    parser.add_argument("--out", type=Path, help="append each family's result to this .jsonl")
    parser.add_argument(
        "--fuse-gate-up-exps", action="store_true", help="each layer's gate and up experts in one tensor"
    )
    parser.add_argument("--joined-kv-b", action="store_true", help="DeepSeek's kv_b_proj whole, as older files hold it")
    args = parser.parse_args(argv)
    chosen = {name: o for name, o in families().items() if not args.family or name in args.family}
    failed = 0
    for family, overrides in chosen.items():
        with tempfile.TemporaryDirectory() as folder:
            result = check(family, overrides, Path(folder), args.fuse_gate_up_exps, args.joined_kv_b)
        result = {"benchmark": "gguf_writer", "time": utc_timestamp(), "commit": git_commit(),
                  "command": " ".join(["scripts/check_gguf_writer.py", *(argv or sys.argv[1:])]), **result}  # fmt: skip
        append_result(args.out, result)
        print(f"{family}: llama.cpp equals transformers on {result['equal']} of {len(PROMPTS)} prompts", flush=True)
        failed += result["equal"] != result["prompts"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
