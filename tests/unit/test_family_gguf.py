"""GGUF files of the newer families as llama.cpp writes them (its tensor names, metadata and quantization types,
written with the `gguf` package; scripts/check_gguf_writer.py has llama.cpp decode such files): Phi-3 with partial
rotary and LongRoPE, Gemma 3 (its norms stored as 1 + w, its windowed and global layers implied by llama.cpp's
pattern), the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral and Llama 4 (each projection's experts in one 3-D
tensor; or gate and up in one, llama.cpp's `--fuse-gate-up-exps` form), the Gated DeltaNet hybrids Qwen3.5,
Qwen3.5-MoE and Qwen3-Next, and Gemma 4 (with and without experts).
Converted, each float path equals transformers on the converted folder token for token; served from its own 4- and
8-bit blocks (`--quantization auto`), each holds `ladle bench quality`'s thresholds against that float path."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFReader, GGUFWriter, RopeScalingType
from gguf.quants import dequantize
from safetensors.torch import load_file

import engine_server.loader.source as source_module
from benchmarks.quality import compare, greedy_sequences, make_llm, reference_log_probs
from engine_server import model_loading
from engine_server.config import AltUp
from engine_server.hf_config import model_config_from_hf
from engine_server.layers.gated_deltanet import split_grouped_projections
from engine_server.layers.quantized_experts import ROUTER_SUFFIXES, ExpertWeights, QuantizedExperts, RowwiseLinear
from engine_server.layers.quantized_linear import QuantizedLinear, quantize_q8
from engine_server.loader import resolve_model
from engine_server.loader.gguf_convert import hf_expert_slices, iter_hf_tensors
from engine_server.loader.gguf_hybrid import TILED_VALUE_HEADS, HybridShape
from engine_server.loader.gguf_metadata import GgufFile, hf_config_from_gguf
from engine_server.loader.gguf_quant import stored_matrices
from engine_server.quantization import StoredBank, stored_weights
from tests.families import VOCAB_SIZE, GreedyReference, float_checkpoint, save_family, write_gguf
from tests.unit.test_family_engines import NUM_TOKENS, engine, prompts, reference_tokens, tokens
from tests.unit.test_quantization import recorded_tensor

pytestmark = pytest.mark.slow  # engines, conversions and transformers' models of their own

QUALITY_PROMPTS = ("The capital of France is", "Write a haiku about rain.", "def fibonacci(n):", "1, 2, 3, 4,")
# The float and served engines' KV cache, as the engine tests' (`engine`): the 4-layer models' prompts take a few
# blocks, and zeroing the quality benchmark's 512 MiB for each of them was ~0.3 s of CPU per engine.
CACHE_BYTES = 64 * 1024**2


def converted_reference_tokens(source: Any) -> GreedyReference:
    """transformers' greedy tokens (`reference_tokens`) on a GGUF file's model as ladle reads its weights."""
    with float_checkpoint(source) as folder:
        return reference_tokens(folder)


def metadata_gguf(
    path: Path, arch: str, keys: dict[str, Any], tensors: dict[str, tuple[int, ...]] | None = None
) -> GGUFReader:
    """A GGUF file of `arch` at `path` holding `keys` (each written by `GGUFWriter.add_<key>`), a zero 64-token
    embedding 32 wide and `tensors` (zeros of those shapes; the embedding's too, when named), opened: the metadata
    a config is read from, before any weight."""
    writer = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    for name, shape in {"token_embd.weight": (64, 32), **(tensors or {})}.items():
        writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GgufFile(str(path))


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("phi3-gguf")
    folder = save_family(root / "hf", "phi3-longrope")
    return write_gguf(folder, root / "phi3.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)


def test_the_converted_phi3_gguf_is_exact_on_the_float_path(phi3_gguf: Path, tmp_path: Path) -> None:
    source = resolve_model(str(phi3_gguf))
    config = source.config
    assert (config.architecture, config.rotary_dim, config.head_dim) == ("phi3", 12, 16)
    with engine(phi3_gguf) as llm:
        ours = tokens(llm, prompts())
        assert ours == converted_reference_tokens(source).of(ours)


def assert_tensors_come_back(
    original: dict[str, torch.Tensor], converted: dict[str, torch.Tensor], exact: tuple[str, ...],
    own: dict[str, Any] | None = None,
) -> None:
    """Every tensor of the converted folder under the name transformers saved it with, of its shape: 1-D ones and
    those whose names end with one of `exact` bit for bit (F32 in the file), the others to their 4- or 8-bit
    rounding (a relative error near 0.08 for Q4_0; rows in the wrong order would give ~1.4); a name ending with a key
    of `own` is checked by its value, `check(converted, original)`."""
    assert converted.keys() == original.keys()
    for name, weight in original.items():
        assert converted[name].shape == weight.shape, name
        check = next((c for suffix, c in (own or {}).items() if name.endswith(suffix)), None)
        if check is not None:
            assert check(converted[name], weight), name
        elif weight.dim() == 1 or name.endswith(exact):
            assert torch.equal(converted[name], weight), name
        else:
            assert ((converted[name] - weight).norm() / weight.norm()).item() < 0.15, name


def keep_stored_weights(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A dict that gets a copy of every model's stored (quantized) weights as it loads, each bank of experts read
    (`StoredBank.read`): loading empties the one `stored_weights` returns once the weights are packed."""
    stored: dict[str, Any] = {}

    def keep(model: Any, source: Any) -> dict[str, Any]:
        weights = stored_weights(model, source)
        stored.update({name: w.read() if isinstance(w, StoredBank) else w for name, w in weights.items()})
        return weights

    monkeypatch.setattr(model_loading, "stored_weights", keep)
    return stored


def served_from_blocks_reading(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], Any, set[str]]:
    """`served_from_blocks`, and the names of the file's tensors the engine serving the blocks read of those that come
    unread (all but Qwen3-Next's q/k/v and z, joined from two of the file's tensors as they come)."""
    read: set[str] = set()
    real = source_module.iter_hf_tensors

    def recorded(tensors: Any, config: Any, spec: str, lazy: bool = False) -> Any:
        for name, tensor in real(tensors, config, spec, lazy=lazy):
            yield name, recorded_tensor(name, tensor, read)

    with monkeypatch.context() as patch:
        patch.setattr(source_module, "iter_hf_tensors", recorded)
        layers, result = served_from_blocks(gguf)
    return layers, result, read


def served_from_blocks(
    gguf: Path, tensor_parallel_size: int = 1, expected: GreedyReference | None = None
) -> tuple[dict[str, str], Any]:
    """`gguf` served from its own blocks (`auto`) against its float path (`none`): each quantized projection's
    format by name (a bank of experts' as `experts_<format>`, with rank 0's rows of each expert), and `ladle bench
    quality`'s comparison on QUALITY_PROMPTS; the candidate split over `tensor_parallel_size` ranks. With
    `expected`, the float path's greedy tokens on the engine tests' `prompts()` must be those (one float engine for
    both)."""
    return served_candidate(gguf, float_reference(gguf, expected), tensor_parallel_size)


def float_reference(gguf: Path, expected: GreedyReference | None = None) -> tuple[Any, Any]:
    """`gguf`'s float path (`none`) on QUALITY_PROMPTS: (its greedy sequences, their log-probabilities), what
    `served_candidate` compares against; with `expected`, its greedy tokens on `prompts()` checked first."""
    reference = make_llm(str(gguf), "none", cache_bytes=CACHE_BYTES)
    if expected is not None:
        ours = tokens(reference, prompts())
        assert ours == expected.of(ours)
    sequences = greedy_sequences(reference, QUALITY_PROMPTS, NUM_TOKENS)
    log_probs = reference_log_probs(reference, sequences)
    reference.close()
    return sequences, log_probs


def served_candidate(
    gguf: Path, reference: tuple[Any, Any], tensor_parallel_size: int = 1
) -> tuple[dict[str, str], Any]:
    """`served_from_blocks` against a `float_reference` computed once (for a file served at several sizes)."""
    sequences, log_probs = reference
    candidate = make_llm(str(gguf), "auto", tensor_parallel_size, cache_bytes=CACHE_BYTES)
    model = candidate.core.runner.model
    layers = {
        name: m.format if isinstance(m, QuantizedLinear) else f"experts_{m.format}_{m.intermediate}"
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear | QuantizedExperts)
    }
    result = compare(log_probs, candidate, "gguf", QUALITY_PROMPTS, NUM_TOKENS, sequences, free_running=False)
    candidate.close()
    return layers, result


def test_phi3_served_from_its_blocks_holds_the_quality_thresholds(phi3_gguf: Path) -> None:
    layers, result = served_from_blocks(phi3_gguf)
    # Every projection from the file's blocks, the fused q/k/v and gate/up included; the LM head stays float
    # (F32 in the file).
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.3.mlp.gate_up_proj"] == "q4"
    assert len(layers) == 4 * 4, sorted(layers)
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 as llama.cpp holds it: six layers, the sixth global (its pattern), the attention scaled by the head
    dim (llama.cpp derives the scale, the file does not store it), norms stored as 1 + w."""
    root = tmp_path_factory.mktemp("gemma3-gguf")
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    folder = save_family(root / "hf", "gemma3", num_hidden_layers=6, query_pre_attn_scalar=16, layer_types=layer_types)
    return write_gguf(folder, root / "gemma3.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)


def test_the_converted_gemma3_gguf_is_exact_on_the_float_path(gemma3_gguf: Path) -> None:
    source = resolve_model(str(gemma3_gguf))
    config = source.config
    assert (config.architecture, config.layer_windows, config.rope_linear_factor) == ("gemma3", (20,) * 5 + (0,), 4.0)
    assert (config.local_rope_theta, config.attention_scale, config.norm_offset) == (1e4, 0.25, 1.0)
    # The file's F32 tensors come back as transformers saved them: the embeddings exactly, and every norm as Gemma
    # applies it, 1 + w (the file holds that sum, rounded to float32; the converted w gives it back exactly).
    original, converted = load_file(gemma3_gguf.parent / "hf" / "model.safetensors"), dict(source.weights())
    assert torch.equal(converted["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    norms = [name for name in original if name.endswith("norm.weight")]
    assert len(norms) == 1 + 6 * 6 and all(torch.equal(converted[n] + 1, original[n] + 1) for n in norms)
    with engine(gemma3_gguf) as llm:
        ours = tokens(llm, prompts())
        assert ours == converted_reference_tokens(source).of(ours)


def test_gemma3_served_from_its_blocks_holds_the_quality_thresholds(gemma3_gguf: Path) -> None:
    layers, result = served_from_blocks(gemma3_gguf)
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.5.mlp.gate_up_proj"] == "q4"
    assert len(layers) == 6 * 4, sorted(layers)
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


@pytest.mark.parametrize("layers", [4, 46])  # 46: Gemma 2 27B, whose scale llama.cpp takes from hidden / heads
def test_a_gemma2_ggufs_metadata_gives_its_config(tmp_path: Path, layers: int) -> None:
    """llama.cpp's Gemma 2 keys (no tensors needed): soft-caps, the window on every other layer from the first, one
    rope base, and the attention scale llama.cpp derives (head dim 32 here, hidden / heads 24 for the 27B)."""
    keys = {"block_count": layers, "context_length": 1024, "embedding_length": 96, "feed_forward_length": 128,
            "head_count": 4, "head_count_kv": 2, "key_length": 32, "value_length": 32, "layer_norm_rms_eps": 1e-6,
            "rope_freq_base": 10_000.0, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0}  # fmt: skip
    reader = metadata_gguf(tmp_path / "gemma2.gguf", "gemma2", keys, {"token_embd.weight": (256, 96)})
    raw = hf_config_from_gguf(reader, "gemma2.gguf")
    config = model_config_from_hf(raw)
    assert config.architecture == "gemma2" and config.tie_word_embeddings and config.head_dim == 32
    assert config.layer_windows[:4] == (4096, 0, 4096, 0) and len(config.layer_windows) == layers
    assert (config.attention_softcap, config.final_logit_softcap, config.rope_theta) == (50.0, 30.0, 10_000.0)
    assert config.attention_scale == (24 if layers == 46 else 32) ** -0.5
    assert (config.hidden_act, config.norm_offset, config.sandwich_norms) == ("gelu_tanh", 1.0, True)
    assert transformers.Gemma2Config(**raw).layer_types[:2] == ["sliding_attention", "full_attention"]


# The mixtures of experts as llama.cpp writes them: Qwen3-MoE (`qwen3moe`, top-3 of 8 renormalised, every layer with
# experts as llama.cpp assumes), Qwen2-MoE (`qwen2moe`, not renormalised, a gated shared expert) and Mixtral (`llama`
# with experts, its q/k rows permuted). Experts and the shared expert in Q4_0, attention in Q8_0, routers F32.
MOE_GGUF: dict[str, dict[str, Any]] = {"qwen3-moe": {"mlp_only_layers": []}, "qwen2-moe": {}, "mixtral": {}}
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "shared_expert_intermediate_size", "dense_layers", "attention_bias")  # fmt: skip


@pytest.fixture(scope="module", params=list(MOE_GGUF))
def moe_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"{request.param}-gguf")
    folder = save_family(root / "hf", request.param, head_spread=0.5, **MOE_GGUF[request.param])
    return request.param, write_gguf(folder, root / "moe.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)


def test_a_moe_gguf_is_exact_on_the_float_path_and_holds_the_thresholds_from_its_blocks(
    moe_gguf: tuple[str, Path],
) -> None:
    """Converted, the config has the saved model's experts and the float path equals transformers on the converted
    folder token for token. Served from its blocks (`auto`), every bank of experts is quantized (Q4_0, one C++ call
    per block), the routers stay float, and it holds `ladle bench quality`'s thresholds against the float path; a
    prompt's tokens are the same alone and batched (the quantized path does not depend on the batch)."""
    family, gguf = moe_gguf
    source = resolve_model(str(gguf))
    saved = model_config_from_hf(json.loads((gguf.parent / "hf" / "config.json").read_text()))
    assert [getattr(source.config, key) for key in MOE_KEYS] == [getattr(saved, key) for key in MOE_KEYS], family
    # Every tensor comes back under the name transformers saved it with (each expert's from its slice of the 3-D
    # tensor, Mixtral's q/k rows un-permuted): F32 ones exactly, quantized ones to their 4- or 8-bit rounding (a
    # relative error near 0.08 for Q4_0; rows in the wrong order would give ~1.4).
    original, converted = load_file(gguf.parent / "hf" / "model.safetensors"), dict(source.weights())
    assert_tensors_come_back(original, converted, ("embed_tokens.weight", ".gate.weight", "shared_expert_gate.weight"))
    with engine(gguf) as llm:
        ours = tokens(llm, prompts())
        assert ours == converted_reference_tokens(source).of(ours), family
    layers, result = served_from_blocks(gguf)
    banks = [fmt for fmt in layers.values() if fmt.startswith("experts_")]
    assert banks == [f"experts_q4_{source.config.moe_intermediate_size}"] * 4, layers
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8", layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, (family, result)
    batch = prompts()
    with engine(gguf, quantization="auto") as llm:
        model = llm.core.runner.loaded.model
        routers = [m for name, m in model.named_modules() if name.endswith(ROUTER_SUFFIXES)]
        assert routers and all(isinstance(router, RowwiseLinear) for router in routers)
        alone = [tokens(llm, [prompt])[0] for prompt in batch[:4]]
        assert tokens(llm, batch[:4]) == alone, family


def test_a_moe_gguf_split_over_two_ranks_serves_each_ranks_slice_of_the_expert_blocks(tmp_path: Path) -> None:
    """Experts 64 rows wide: each of two ranks keeps 32 rows of every expert's gate and up and the matching 32
    columns of its down, copied out of the 3-D tensors' blocks; split so, the model holds the quality thresholds
    against the float path, as at one rank (TP changes only the order of float sums)."""
    folder = save_family(tmp_path / "hf", "qwen3-moe", head_spread=0.5, mlp_only_layers=[], moe_intermediate_size=64)
    gguf = write_gguf(folder, tmp_path / "moe.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)
    layers, result = served_from_blocks(gguf, tensor_parallel_size=2)
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q4_32"] * 4, layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


# A Q4_K_M file's banks of experts, layer by layer: (gate and up, down). llama.cpp's Q4_K_M holds gate/up in Q4_K and
# down in Q6_K or Q4_K, with Q5_0 / Q5_1 where a row is not whole super-blocks; every type here is some layer's.
K_QUANT_EXPERTS = [
    (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K), (GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q5_0),
    (GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q4_K), (GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.IQ4_NL),
]  # fmt: skip
# The 2-bit and grid types of the Q2_K and IQ3 / IQ2 / IQ1 files of large mixtures of experts, every one some
# layer's.
GRID_EXPERTS = [
    (GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.Q2_K),
    (GGMLQuantizationType.IQ2_S, GGMLQuantizationType.IQ3_XXS),
    (GGMLQuantizationType.IQ1_M, GGMLQuantizationType.IQ2_XS),
    (GGMLQuantizationType.IQ3_S, GGMLQuantizationType.IQ1_S),
]


@pytest.mark.parametrize(
    ("experts", "top1", "mean_kl"), [(K_QUANT_EXPERTS, 0.9, 0.05), (GRID_EXPERTS, 0.8, 0.05)], ids=["k-quant", "grid"]
)
def test_a_moe_gguf_with_k_quant_experts_is_served_from_their_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, experts: list[tuple[GGMLQuantizationType, GGMLQuantizationType]],
    top1: float, mean_kl: float,
) -> None:
    """A Qwen3-MoE 256 wide (every expert's rows whole K-quant super-blocks) whose banks of experts are in a Q4_K_M
    file's types and an IQ4_XS file's (`K_QUANT_EXPERTS`), or in Q2_K's and the IQ grid types (`GRID_EXPERTS`;
    random blocks: gguf has no quantizer for them), attention in Q8_0: served from the file's blocks, every bank is a
    `QuantizedExperts` in its layer's types, each expert's weights as read are the gguf package's dequantization of
    its slice of the file's 3-D tensors bit for bit, and the served model is close to its float path (the
    thresholds of the K-quant tests above: random blocks; measured 95% / 0.010 and, for the grid types' flatter
    logits and the routing choices they flip, 86% / 0.030)."""
    folder = save_family(
        tmp_path / "hf", "qwen3-moe", head_spread=0.5, mlp_only_layers=[], hidden_size=256, moe_intermediate_size=256
    )
    types = {
        f"blk.{layer}.ffn_{part}_exps.weight": down if part == "down" else gate_up
        for layer, (gate_up, down) in enumerate(experts)
        for part in ("gate", "up", "down")
    }
    q8 = GGMLQuantizationType.Q8_0
    gguf = write_gguf(folder, tmp_path / "moe.gguf", q8, q8, types=types)
    stored = keep_stored_weights(monkeypatch)
    layers, result = served_from_blocks(gguf)
    banks = {name: fmt for name, fmt in layers.items() if fmt.startswith("experts_")}
    assert banks == {
        f"model.layers.{layer}.mlp.experts": f"experts_{gate_up.name.lower()}+{down.name.lower()}_256"
        for layer, (gate_up, down) in enumerate(experts)
    }, layers
    tensors = {tensor.name: tensor for tensor in GgufFile(str(gguf)).tensors}

    def file_weights(name: str) -> torch.Tensor:  # [experts, rows, columns], as the gguf package dequantizes them
        tensor = tensors[name]
        return torch.from_numpy(dequantize(np.array(tensor.data), tensor.tensor_type).copy())

    for layer in range(len(experts)):
        bank = stored[f"model.layers.{layer}.mlp.experts"]
        assert isinstance(bank, ExpertWeights), layer
        gate, up, down = (file_weights(f"blk.{layer}.ffn_{part}_exps.weight") for part in ("gate", "up", "down"))
        for e in range(len(bank.gate_up)):
            gate_up = torch.cat([gate[e], up[e]])
            assert torch.equal(bank.gate_up[e].dequantize().view(torch.int32), gate_up.view(torch.int32)), (layer, e)
            assert torch.equal(bank.down[e].dequantize().view(torch.int32), down[e].view(torch.int32)), (layer, e)
    assert result.top1_agreement >= top1 and result.mean_kl <= mean_kl, result


def test_a_mixtral_gguf_with_a_dense_layer_is_refused(tmp_path: Path) -> None:
    """llama.cpp builds every layer of a file with experts with them: a layer without a router is not Mixtral."""
    keys = {"block_count": 2, "context_length": 64, "embedding_length": 32, "feed_forward_length": 32,
            "head_count": 2, "layer_norm_rms_eps": 1e-5, "expert_count": 4, "expert_used_count": 2}  # fmt: skip
    reader = metadata_gguf(tmp_path / "mixtral.gguf", "llama", keys, {"blk.0.ffn_gate_inp.weight": (4, 32)})
    with pytest.raises(ValueError, match=r"layers \[1\] of a llama file with experts have no router"):
        hf_config_from_gguf(reader, "mixtral.gguf")



# Llama 4 as llama.cpp reads a `llama4` file: what it fixes rather than reads (NoPE every 4th layer, chunks of 8,192,
# the NoPE layers' temperature) as the released models have it, and Scout's rope scaling (no frequency between
# llama3's bands). The family's other quirks stay: Maverick's dense layers between the sparse ones, q/k norms.
LLAMA4_GGUF: dict[str, Any] = {
    "no_rope_layers": None, "attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
}  # fmt: skip


def converted_as_saved(folder: Path, gguf: Path) -> tuple[dict[str, torch.Tensor], GreedyReference]:
    """`gguf`, written from the checkpoint in `folder`, converted: its config is the saved model's, and written out
    for transformers every tensor comes back under its checkpoint name (`assert_tensors_come_back`). Returns those
    tensors and transformers' greedy tokens on them (`reference_tokens`)."""
    source = resolve_model(str(gguf))
    saved = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    # A file holds the rope base in float32 (Hunyuan's, stretched by NTK's alpha, is no float32 in its config).
    assert np.float32(source.config.rope_theta) == np.float32(saved.rope_theta)
    assert source.config == replace(saved, name=source.config.name, rope_theta=source.config.rope_theta)
    # Nemotron-4's LayerNorm1P weights, stored as 1 + w: w comes back rounded at 1 + w's precision. Mamba's A_log,
    # stored as -exp(A_log) in float32, comes back within that rounding (~1e-7 of exp(A_log), a unit in A_log's last
    # place).
    own: dict[str, Any] = {"A_log": lambda ours, theirs: torch.allclose(ours, theirs, rtol=2**-23, atol=1e-6)}
    if source.config.norm_offset and source.config.layer_norm:
        own["norm.weight"] = lambda ours, theirs: torch.allclose(ours, theirs, rtol=0, atol=1e-6)
    with float_checkpoint(source) as checkpoint:
        converted = load_file(checkpoint / "model.safetensors")
        assert_tensors_come_back(load_file(folder / "model.safetensors"), converted, ("embed_tokens.weight",), own)
        return converted, reference_tokens(checkpoint)


def exact_then_served(tmp_path: Path, family: str, **overrides: Any) -> tuple[Path, dict[str, str], Any]:
    """`family`'s random model (with `overrides`) written as llama.cpp's converter writes it, its MLP in Q4_0 and its
    attention in Q8_0: converted, it is the saved model (`converted_as_saved`) and its float path equals transformers
    token for token. Returns the file and, served from its blocks, its layers' formats and `ladle bench quality`'s
    comparison with the float path (`served_from_blocks`)."""
    gguf, expected = written_and_converted(tmp_path, family, **overrides)
    layers, result = served_from_blocks(gguf, expected=expected)
    return gguf, layers, result


def written_and_converted(
    tmp_path: Path, family: str, feed_forward: GGMLQuantizationType = GGMLQuantizationType.Q4_0, **overrides: Any
) -> tuple[Path, GreedyReference]:
    """`exact_then_served`'s file (its MLP in `feed_forward`'s type), converted and checked against the saved model
    (`converted_as_saved`), and transformers' greedy tokens on the engine tests' `prompts()`, which its float path
    must give."""
    folder = save_family(tmp_path / "hf", family, head_spread=0.5, **overrides)
    gguf = write_gguf(folder, tmp_path / f"{family}.gguf", feed_forward, GGMLQuantizationType.Q8_0)
    _, expected = converted_as_saved(folder, gguf)
    return gguf, expected


def test_a_llama4_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A Llama 4 file as llama.cpp's converter writes it (its q/k rows as the checkpoint holds them, rope pairs
    interleaved; each projection's experts in one 3-D tensor; llama3 scaling as `rope_freqs`): converted, the config
    is the saved model's; written out for transformers, every tensor comes back under its checkpoint name (the
    experts as the checkpoint's two banks a layer), and the float path equals transformers on that checkpoint token
    for token. Served from its blocks, q/k/v and the dense, shared and routed experts' projections are the file's
    blocks (q/k rows read in the layers' order) and hold `ladle bench quality`'s thresholds against the float path."""
    _, layers, result = exact_then_served(tmp_path, "llama4", **LLAMA4_GGUF)
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.0.mlp.gate_up_proj"] == "q4"
    assert layers["model.layers.1.mlp.shared_expert.gate_up_proj"] == "q4", layers
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q4_32"] * 2, layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


def test_a_llama4_gguf_in_a_form_llama_cpp_reads_otherwise_is_refused(tmp_path: Path) -> None:
    """llama.cpp reads a `llama4` file with `attention.sliding_window` 0 as MobileLLM's (no chunks, no temperature,
    rope on other layers) and builds no Llama 4 without experts: both are refused by name."""
    keys = {"block_count": 4, "context_length": 64, "embedding_length": 32, "feed_forward_length": 32,
            "head_count": 2, "layer_norm_rms_eps": 1e-5, "expert_count": 4, "expert_used_count": 1,
            "expert_feed_forward_length": 16, "interleave_moe_layer_step": 1}  # fmt: skip
    for name, changed, refusal in (("mobilellm", {"sliding_window": 0}, "sliding_window 0"),
                                   ("dense", {"expert_count": 0}, "without experts")):  # fmt: skip
        reader = metadata_gguf(tmp_path / f"{name}.gguf", "llama4", {**keys, **changed})
        with pytest.raises(ValueError, match=refusal):
            hf_config_from_gguf(reader, f"{name}.gguf")


def test_a_glm4_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A GLM-4 file as llama.cpp's converter writes it (q/k rows as the checkpoint holds them, the turned half of
    each head's rope pairs interleaved; Gemma's four norm names, `ffn_norm` the one before the MLP; the fused gate/up
    as `ffn_up`; rope over `rope.dimension_count` dims): converted, the config is the saved model's and every tensor
    comes back under its checkpoint name, and the float path equals transformers token for token. Served from its
    blocks, q/k/v (their turned rows read in the layers' order) and gate/up are the file's blocks, and it holds
    `ladle bench quality`'s thresholds against the float path."""
    _, layers, result = exact_then_served(tmp_path, "glm4")
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.0.mlp.gate_up_proj"] == "q4"
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


def test_a_minimax_m2_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A MiniMax-M2 file as llama.cpp's converter writes it (q/k norms over the whole projection as `attn_q_norm` /
    `attn_k_norm`, the block's load-balancing bias as `exp_probs_b`, a sigmoid `expert_gating_func`, rope over
    `rope.dimension_count` dims): converted, the config is the saved model's and every tensor comes back under its
    checkpoint name, and the float path equals transformers token for token. Served from its blocks, q/k/v and every
    bank of experts are the file's blocks (the router float), and it stays close to the float path: mean KL within
    `ladle bench quality`'s 0.01, top-1 within 0.9 (measured 92.7% / 0.0031; at Q8_0 93.8% / 0.0043, where a
    softmax-routed Qwen3-MoE gives 95.8% / 0.0003: the two sigmoid-routed families here, this and GLM-4.5, sit
    lower at 8 bits too; the routing computed row by row chooses as the float router does, test_quant_moe.py)."""
    _, layers, result = exact_then_served(tmp_path, "minimax-m2")
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8", layers
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q4_32"] * 4, layers
    assert result.top1_agreement >= 0.9 and result.mean_kl <= 0.01, result


def test_a_dbrx_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A DBRX file as llama.cpp's converter writes it (`dbrx`: q/k/v in one `attn_qkv` as stored, `norm_2` as
    `attn_output_norm`, the clamp as `attention.clamp_kqv`, each projection's experts in one 3-D tensor, `w2`'s
    transposed): converted, the config is the saved model's (DBRX's nested one) and written out for transformers
    every tensor comes back under its checkpoint name (the experts as its one tensor a projection), and the float
    path equals transformers token for token. Served from its blocks, q/k/v, the output projection and every bank
    of experts are the file's blocks (the router float), and it holds `ladle bench quality`'s thresholds (98.96% /
    0.00014 measured)."""
    _, layers, result = exact_then_served(tmp_path, "dbrx")
    assert layers == {f"model.layers.{i}.{name}": fmt for i in range(4) for name, fmt in (
        ("self_attn.qkv_proj", "q8"), ("self_attn.o_proj", "q8"), ("mlp.experts", "experts_q4_32"))}, layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


def test_a_dbrx_gguf_in_a_form_it_is_not_is_refused(tmp_path: Path) -> None:
    """A `dbrx` file without experts, with tied embeddings (no `output`), or with another LayerNorm epsilon than
    DBRX's 1e-5 describes no DBRX: each is refused by name."""
    keys = {"block_count": 2, "context_length": 64, "embedding_length": 32, "feed_forward_length": 16,
            "head_count": 2, "head_count_kv": 1, "layer_norm_eps": 1e-5, "expert_count": 4, "expert_used_count": 2,
            "clamp_kqv": 8.0}  # fmt: skip
    output = {"output.weight": (64, 32)}
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "dbrx.gguf", "dbrx", keys, output), "dbrx.gguf")
    assert (config["d_model"], config["n_layers"], config["attn_config"]["clip_qkv"]) == (32, 2, 8.0)
    assert config["ffn_config"] == {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2,
                                    "moe_normalize_expert_weights": 1.0}  # fmt: skip
    for name, changed, tensors, refusal in (
        ("dense", {"expert_count": 0, "expert_used_count": 0}, output, "of 0 experts"),
        ("tied", {}, {}, "without an output tensor"),
        ("eps", {"layer_norm_eps": 1e-6}, output, "LayerNorm epsilon 1e-06"),
    ):
        reader = metadata_gguf(tmp_path / f"{name}.gguf", "dbrx", {**keys, **changed}, tensors)
        with pytest.raises(ValueError, match=refusal):
            hf_config_from_gguf(reader, f"{name}.gguf")


# GLM-4.5 as llama.cpp reads a `glm4moe` file: one group of experts (it reads no group counts for the architecture;
# the released models have one group).
GLM4_MOE_GGUF: dict[str, Any] = {"n_group": 1, "topk_group": 1}


def test_a_glm4_moe_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A GLM-4.5 file as llama.cpp's converter writes it (the norm before the MLP as `post_attention_norm`, the
    router's bias as `exp_probs_b`, the shared experts as `*_shexp`, rope over half of each head, and a
    multi-token-prediction layer after the decoder layers, counted in `block_count`): converted, the config is the
    saved model's and every tensor comes back under its checkpoint name (the prediction layer's none: it is not
    read), and the float path equals transformers token for token. Served from its blocks, q/k/v, the dense layer,
    the shared experts and every bank of experts are the file's blocks (the router float), and it stays close to
    the float path: mean KL within `ladle bench quality`'s 0.01, top-1 within 0.9 (measured 93.8% / 0.005; the
    experts' outputs scaled by 2.5, GLM-4.5's `routed_scaling_factor`, move this random model's next layers more than
    other families' do: with a scale of 1 its Q8_0 file gives 99.0% / 0.0016, at 2.5 93.8% / 0.0043)."""
    gguf, layers, result = exact_then_served(tmp_path, "glm4-moe", **GLM4_MOE_GGUF)
    assert {t.name for t in GgufFile(gguf).tensors} >= {"blk.4.nextn.eh_proj.weight", "blk.4.ffn_gate_exps.weight"}
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.0.mlp.gate_up_proj"] == "q4"
    assert layers["model.layers.1.mlp.shared_expert.gate_up_proj"] == "q4", layers
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q4_32"] * 3, layers
    assert result.top1_agreement >= 0.9 and result.mean_kl <= 0.01, result


def test_a_glm4_moe_gguf_in_a_form_llama_cpp_reads_otherwise_is_refused(tmp_path: Path) -> None:
    """A `glm4moe` file without experts, with softmax routing, or whose prediction layers leave no decoder layer is
    not GLM-4.5 as llama.cpp builds it: each is refused by name. Its prediction layers are not counted as layers."""
    keys = {"block_count": 3, "context_length": 64, "embedding_length": 32, "feed_forward_length": 32,
            "head_count": 2, "layer_norm_rms_eps": 1e-5, "expert_count": 4, "expert_used_count": 2,
            "expert_feed_forward_length": 16, "nextn_predict_layers": 1, "rope_dimension_count": 8}  # fmt: skip
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "glm.gguf", "glm4moe", keys), "glm.gguf")
    layers = (config["num_hidden_layers"], config["num_nextn_predict_layers"], config["partial_rotary_factor"])
    assert layers == (2, 1, 0.5)
    softmax = {"expert_gating_func": ExpertGatingFuncType.SOFTMAX}
    for name, changed, refusal in (("dense", {"expert_count": 0}, "without experts"),
                                   ("softmax", softmax, "expert_gating_func 1"),
                                   ("all-nextn", {"nextn_predict_layers": 3}, "leaves no decoder layer")):
        reader = metadata_gguf(tmp_path / f"{name}.gguf", "glm4moe", {**keys, **changed})
        with pytest.raises(ValueError, match=refusal):
            hf_config_from_gguf(reader, f"{name}.gguf")


# DeepSeek-V3, DeepSeek-V2-Lite (softmax routing, no q rank, no groups) and GLM-4.7-Flash (its dense layer leading,
# as llama.cpp reads them, and a prediction layer) as llama.cpp writes their `deepseek2` files, each projection's rows
# in whole blocks of 32 (llama.cpp's converter falls back to F16 for others): a q rank of 64, key parts 32 wide.
DEEPSEEK_GGUF: dict[str, dict[str, Any]] = {
    "deepseek-v3": {"q_lora_rank": 64, "qk_nope_head_dim": 32},
    "deepseek-v2": {"q_lora_rank": None, "qk_nope_head_dim": 32, "topk_method": "greedy", "n_group": None,
                    "topk_group": None},
    "glm4-moe-lite": {"q_lora_rank": 64, "qk_nope_head_dim": 32, "num_nextn_predict_layers": 1,
                      "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
    "glm-moe-dsa": {"q_lora_rank": 64, "qk_nope_head_dim": 32},
}  # fmt: skip
# GLM-5's file served from its blocks against its float path: each query attends to 16 positions of up to 60, and a
# random model's index scores lie so close together that any rounding swaps some of them (measured 75.0% / 0.112;
# the same weights choosing among 64, every position of these prompts, 94.8% / 0.012).
SPARSE_QUALITY = (0.7, 0.15)


@pytest.mark.parametrize("family", sorted(DEEPSEEK_GGUF))
def test_a_deepseek2_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path, family: str) -> None:
    """A DeepSeek-V3 file (sigmoid routing in groups with `exp_probs_b`, YaRN with DeepSeek's attention scale, a q
    rank), a DeepSeek-V2-Lite one (softmax routing, one q projection) and a GLM-4.7-Flash one (DeepSeek-V3's routing
    in one group, a prediction layer after the decoder layers) as llama.cpp's converter writes them now
    (`deepseek2`: the latent as one KV head, each layer's `kv_b_proj` split into `attn_k_b` and `attn_v_b`):
    converted, the config is the saved model's and every tensor comes back under its checkpoint name (`kv_b_proj`
    joined again), and the float path equals transformers token for token. Served from its blocks, the latent
    attention's projections, the dense layer, the shared experts and every bank of experts are the file's blocks
    (`kv_b_proj`, absorbed, and the router stay float). Close to the float path: mean KL within `ladle bench
    quality`'s 0.01, top-1 within 0.9, as GLM-4.5's (measured: DeepSeek-V3 94.8% / 0.0051, its experts' outputs
    scaled by 2.5 as GLM-4.5's; GLM-4.7-Flash 92.7% / 0.0071; DeepSeek-V2 91.7% / 0.0004, its flips at near-ties of
    these random models). A GLM-5 file (`glm-dsa`: the indexer's keys and tensors beside those, its third layer
    reusing the second's choice) likewise, its indexer's projections from their blocks too (`SPARSE_QUALITY`).
    DeepSeek-V3's is also served split over two ranks, each reading its heads' rows of `q_b_proj` and columns of
    `o_proj` from the blocks (its experts' 16 columns of `down` a rank are no whole block: float), within the same
    thresholds (measured 97.9% / 0.0010)."""
    gguf, expected = written_and_converted(tmp_path, family, **DEEPSEEK_GGUF[family])
    reference = float_reference(gguf, expected)
    layers, result = served_candidate(gguf, reference)
    queries = ("q_a_proj", "q_b_proj") if DEEPSEEK_GGUF[family]["q_lora_rank"] else ("q_proj",)
    for projection in (*queries, "kv_a_proj_with_mqa", "o_proj"):
        assert layers[f"model.layers.1.self_attn.{projection}"] == "q8", layers
    assert layers["model.layers.0.mlp.gate_up_proj"] == "q4", layers
    assert layers["model.layers.1.mlp.shared_expert.gate_up_proj"] == "q4", layers
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q4_32"] * 3, layers
    if family == "glm-moe-dsa":  # the indexer's projections, served from their blocks too
        assert layers["model.layers.1.self_attn.indexer.wq_b"] == "q8", layers
    least, most = SPARSE_QUALITY if family == "glm-moe-dsa" else (0.9, 0.01)
    assert result.top1_agreement >= least and result.mean_kl <= most, result
    if family == "deepseek-v3":
        layers, result = served_candidate(gguf, reference, tensor_parallel_size=2)
        assert all(layers[f"model.layers.1.self_attn.{name}"] == "q8" for name in ("q_b_proj", "o_proj")), layers
        assert result.top1_agreement >= least and result.mean_kl <= most, result


def test_a_deepseek2_gguf_with_kv_b_whole_reads_as_its_split_form(tmp_path: Path) -> None:
    """Files llama.cpp's converter wrote before it split `kv_b_proj` hold it whole (`attn_kv_b`), each head's key
    widths as `key_length` (no `*_mla` keys): such a file converts to the same config and the same tensors, bit for
    bit, as its split form (`kv_b_proj` F32 in both: quantized, each form's blocks run along its own rows)."""
    folder = save_family(tmp_path / "hf", "deepseek-v3", **DEEPSEEK_GGUF["deepseek-v3"])
    plain = {f"blk.{layer}.attn_kv_b.weight": GGMLQuantizationType.F32 for layer in range(4)}
    split = write_gguf(folder, tmp_path / "split.gguf", GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q8_0,
                       types=plain)  # fmt: skip
    whole = write_gguf(folder, tmp_path / "whole.gguf", GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q8_0,
                       types=plain, joined_kv_b=True)  # fmt: skip
    assert "blk.0.attn_kv_b.weight" in {t.name for t in GgufFile(whole).tensors}
    assert "blk.0.attn_k_b.weight" in {t.name for t in GgufFile(split).tensors}
    converted = {}
    for gguf in (split, whole):  # the config and tensors a conversion reads (the tokenizer is the same vocabulary)
        reader = GgufFile(gguf)
        config = hf_config_from_gguf(reader, gguf.name)
        converted[gguf.stem] = (config, dict(iter_hf_tensors(reader.tensors, config, gguf.name)))
    assert converted["split"][0] == converted["whole"][0]
    split_tensors, whole_tensors = converted["split"][1], converted["whole"][1]
    assert split_tensors.keys() == whole_tensors.keys()
    for name, tensor in split_tensors.items():
        assert torch.equal(tensor, whole_tensors[name]), name


def test_a_deepseek2_gguf_in_a_form_llama_cpp_reads_otherwise_is_refused(tmp_path: Path) -> None:
    """A `deepseek2` file's keys as llama.cpp reads them: an older file's head widths from `key_length` /
    `value_length` (no `*_mla` keys), softmax routing where `expert_gating_func` is absent, YaRN without DeepSeek's
    scale turned without an attention factor, its prediction layers not counted. A file without experts, with
    another router, routed by sigmoid without its bias or whose prediction layers leave no decoder layer is refused
    by name."""
    keys = {"block_count": 3, "context_length": 64, "embedding_length": 32, "feed_forward_length": 32,
            "head_count": 2, "head_count_kv": 2, "layer_norm_rms_eps": 1e-5, "expert_count": 4, "expert_used_count": 2,
            "expert_feed_forward_length": 16, "kv_lora_rank": 32, "key_length": 24, "value_length": 16,
            "rope_dimension_count": 8, "nextn_predict_layers": 1, "rope_scaling_type": RopeScalingType.YARN,
            "rope_scaling_factor": 4.0, "rope_scaling_orig_ctx_len": 16}  # fmt: skip
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "ds.gguf", "deepseek2", keys), "ds.gguf")
    shape = (config["model_type"], config["num_hidden_layers"], config["qk_nope_head_dim"], config["v_head_dim"],
             config["q_lora_rank"], config["topk_method"], config["rope_parameters"]["attention_factor"])  # fmt: skip
    assert shape == ("deepseek_v2", 2, 16, 16, None, "greedy", 1.0)
    assert model_config_from_hf(config).latent_attention is not None
    sigmoid = {"expert_gating_func": ExpertGatingFuncType.SIGMOID}
    for name, changed, refusal in (("dense", {"expert_count": 0}, "without experts"),
                                   ("gating", {"expert_gating_func": SimpleNamespace(value=3)},
                                    "expert_gating_func 3"),
                                   ("unbiased", sigmoid, "no exp_probs_b"),
                                   ("all-nextn", {"nextn_predict_layers": 3}, "leaves no decoder layer")):
        reader = metadata_gguf(tmp_path / f"{name}.gguf", "deepseek2", {**keys, **changed})
        with pytest.raises(ValueError, match=refusal):
            hf_config_from_gguf(reader, f"{name}.gguf")


# Seed-OSS, ERNIE 4.5, ERNIE 4.5 MoE, EXAONE 4, Cohere 2, Cohere, Ministral 3, Arcee, Hunyuan and Apertus as llama.cpp
# writes their files (`seed_oss`, `ernie4_5`, `ernie4_5-moe`, `exaone4`, `cohere2`, `command-r`, `mistral3`, `arcee`,
# `hunyuan-dense`, `apertus`); the MoE's shared experts as wide as its converter says they are (the dense width over
# the KV heads, as released).
PLAIN_GGUF: dict[str, dict[str, Any]] = {
    "seed-oss": {}, "ernie4.5": {}, "exaone4": {}, "cohere2": {}, "cohere": {}, "ministral3": {}, "arcee": {},
    "hunyuan-dense": {}, "apertus": {},
    "olmo2": {"bos_token_id": 1, "eos_token_id": 2},
    "ernie4.5-moe": {"intermediate_size": 64, "moe_intermediate_size": 32, "moe_num_shared_experts": 1},
    # dots.llm1 as released (one group of experts, a KV head per query head: llama.cpp's `dots1` reads no fewer) and
    # as llama.cpp runs it: no windows, no q/k/v biases. Its experts' weights unscaled: this random model's sigmoid
    # scores, not renormalised, times 2.5 move its next layers as GLM-4.5's do (measured from the blocks: 91.7% /
    # 0.018; scaled by 1, 97.9% / 0.0014).
    "dots1": {"num_key_value_heads": 4, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
              "sliding_window": None, "attention_bias": False},
    # The classic decoders: GPT-NeoX's q/k/v grouped as cat(q, k, v) by its converter, Phi-2's every head its own K/V
    # (its converter writes so; rope over 6 of 16 dims, a share the file's dimension count gives back exactly; its MLP
    # 4 x hidden wide, the width its converter writes and llama.cpp requires),
    # StarCoder2's without windows (its converter writes none: llama.cpp runs none),
    # Nemotron-4's norms as 1 + w, OLMo's q/k rows permuted and clamp in metadata, EXAONE 3's GPT-2 names.
    "gpt-neox": {}, "phi": {"num_key_value_heads": 4, "partial_rotary_factor": 0.375, "intermediate_size": 256},
    "stablelm-12b": {}, "starcoder2": {"sliding_window": None},
    "nemotron": {}, "olmo": {}, "exaone": {},
    # Falcon 7B (one KV head) and 40B (two, q/k/v grouped by them; a second norm before the MLP), without biases as
    # released (its converter regroups weights alone), over the 2,048 positions its converter writes for any Falcon.
    "falcon-7b": {"max_position_embeddings": 2048}, "falcon-40b": {"max_position_embeddings": 2048, "bias": False},
    # GPT-2 (its Conv1D weights transposed by its converter) and GPT-BigCode (one KV head: llama.cpp's `starcoder`
    # reads no other), their learned positions as `position_embd`, the MLP 4 x hidden as their converters write it.
    "gpt2": {"intermediate_size": 256}, "gpt-bigcode": {"intermediate_size": 256},
    # BLOOM (q/k/v as cat(q, k, v) by its converter, its embeddings' LayerNorm as `token_embd_norm`; the context its
    # converter writes, `seq_length`) and MPT (q/k/v clamped as `clamp_kqv`, its ALiBi maximum as
    # `max_alibi_bias`; 4 heads: llama.cpp's slopes are MPT's for a power of two), their ALiBi with no rope keys.
    "bloom": {"seq_length": 1024}, "mpt": {"hidden_size": 64, "num_attention_heads": 4},
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(PLAIN_GGUF))
def test_newer_family_ggufs_are_exact_and_served_from_their_blocks(tmp_path: Path, family: str) -> None:
    """A Seed-OSS file (q/k/v biases, none on o_proj), an ERNIE 4.5 one (q/k rows as the checkpoint holds them, rope
    pairs interleaved), an ERNIE 4.5 MoE one (experts after a dense layer, a shared expert, the routing bias as
    `exp_probs_b` `[1, experts]`), a dots.llm1 one (DeepSeek-V3's experts and their routing bias after a dense layer,
    Qwen3's q/k norms), an EXAONE 4 one (norms after the attention and the MLP, a flag per layer for its
    windows, the global layers without rope), Cohere's (LayerNorms, `logit_scale`, rope pairs interleaved; Cohere
    2's every 4th layer global), an OLMo 2 one (its q/k norms over the whole projection), a Ministral 3 one (YaRN, its
    query temperature), an Arcee one (an ungated relu² MLP, YaRN), a Hunyuan one (q/k norms after rope, the
    rope base stretched by NTK's alpha, written in float32), an Apertus one (q/k rows as the checkpoint holds
    them, llama3 scaling as `rope_freqs`, its xIELU's scalars per layer as `xielu.*` metadata) and the classic
    decoders' (GPT-NeoX, Phi-2, StableLM 2 12B, StarCoder2, Nemotron-4, OLMo, EXAONE 3: `PLAIN_GGUF`) as llama.cpp's
    converter writes them:
    converted, each config is the saved model's, every tensor comes back, and the float path equals transformers
    token for token; served from its blocks (ERNIE's q/k rows read in halves order), each holds `ladle bench
    quality`'s thresholds."""
    _, layers, result = exact_then_served(tmp_path, family, **PLAIN_GGUF[family])
    ungated = ("arcee", "apertus", "gpt-neox", "phi", "starcoder2", "nemotron", "falcon-7b", "falcon-40b", "gpt2",
               "gpt-bigcode", "bloom", "mpt")
    mlp = "up_proj" if family in ungated else "gate_up_proj"  # their ungated MLPs
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers[f"model.layers.0.mlp.{mlp}"] == "q4"
    if family in ("ernie4.5-moe", "dots1"):
        assert layers["model.layers.1.mlp.shared_expert.gate_up_proj"] == "q4", layers
        assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q4_32"] * 3, layers
    # OLMo 2's post-norm model parts at near-ties: 94.8% / 0.0008 measured (its KL the others' size); OLMo's
    # weightless LayerNorms likewise, 92.7% / 0.0007.
    top1 = 0.9 if family in ("olmo2", "olmo") else 0.95
    assert result.top1_agreement >= top1 and result.mean_kl <= 0.01, result


def test_mpt_ggufs_in_forms_this_engine_does_not_build_are_refused_by_name(tmp_path: Path) -> None:
    """An `mpt` file reads as MPT's config (its ALiBi maximum and clamp from metadata, its MLP's width from its
    tensors); one without ALiBi (`max_alibi_bias` 0: learned positions), with q/k LayerNorms, with fewer KV heads or
    with biases is refused by name when its config is read."""
    keys = {"block_count": 2, "context_length": 64, "embedding_length": 32, "feed_forward_length": 128,
            "head_count": 4, "layer_norm_eps": 1e-5, "max_alibi_bias": 8.0, "clamp_kqv": 6.0}  # fmt: skip
    shapes = {"blk.0.ffn_up.weight": (96, 32)}
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "mpt.gguf", "mpt", keys, shapes), "mpt.gguf")
    served = model_config_from_hf(config)
    assert (served.alibi, served.alibi_bias_max, served.clip_qkv, served.intermediate_size) == ("mpt", 8.0, 6.0, 96)
    assert (served.max_position_embeddings, served.tie_word_embeddings) == (64, True)
    for name, changed, tensors, refusal in (
        ("learned", {"max_alibi_bias": 0.0}, {}, "mpt with attn_config alibi False"),
        ("qk-ln", {}, {"blk.0.attn_q_norm.weight": (32,)}, "mpt with attn_config qk_ln True"),
        ("grouped", {"head_count_kv": 2}, {}, "mpt with attn_type 'grouped_query_attention'"),
        ("biased", {}, {"blk.0.attn_qkv.bias": (96,)}, "mpt with no_bias false"),
    ):
        reader = metadata_gguf(tmp_path / f"{name}.gguf", "mpt", {**keys, **changed}, {**shapes, **tensors})
        with pytest.raises(ValueError, match=re.escape(refusal)):
            model_config_from_hf(hf_config_from_gguf(reader, f"{name}.gguf"))


def test_an_apertus_gguf_reads_its_xielu_scalars_per_layer_and_refuses_them_missing_or_miscounted(
    tmp_path: Path,
) -> None:
    """An `apertus` file's `xielu.*` keys, a value per layer, become each layer's scalars (`xielu_parameters`, the
    checkpoint's `mlp.act_fn.*`); a file without one, or with a list of another length than its layers (which
    llama.cpp refuses too), is refused by name."""
    keys = {"block_count": 2, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
            "head_count": 2, "layer_norm_rms_eps": 1e-5}  # fmt: skip
    xielu = {"xielu_alpha_p": [0.25, -0.5], "xielu_alpha_n": [1.5, 2.0], "xielu_beta": [0.5, 0.375],
             "xielu_eps": [-1e-6, -2e-6]}  # fmt: skip
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "apertus.gguf", "apertus", {**keys, **xielu}), "apertus")
    assert config["hidden_act"] == "xielu"
    assert config["xielu_parameters"] == {
        "alpha_p": [0.25, -0.5], "alpha_n": [1.5, 2.0], "beta": [0.5, 0.375],
        "eps": [float(np.float32(-1e-6)), float(np.float32(-2e-6))],
    }  # fmt: skip
    for name, changed, refusal in (("missing", {"xielu_eps": None}, "lacks xielu.eps"),
                                   ("short", {"xielu_beta": [0.5]}, "xielu.beta has 1 values for 2")):  # fmt: skip
        written = {key: value for key, value in {**keys, **xielu, **changed}.items() if value is not None}
        reader = metadata_gguf(tmp_path / f"{name}.gguf", "apertus", written)
        with pytest.raises(ValueError, match=refusal):
            hf_config_from_gguf(reader, f"{name}.gguf")


def test_an_exaone4_gguf_reads_its_windows_from_flags_a_number_or_none(tmp_path: Path) -> None:
    """An `exaone4` file's windowed layers: those its `attention.sliding_window_pattern` flags, every n-th global where
    it is a number (every 4th without it), none without a window (EXAONE 4.0-1.2B: every layer full, with rope)."""
    keys = {"block_count": 4, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
            "head_count": 2, "layer_norm_rms_eps": 1e-5, "sliding_window": 8}  # fmt: skip
    for name, changed, windows, nope in (
        ("flags", {"sliding_window_pattern": [True, False, True, False]}, (8, 0, 8, 0), (1, 3)),
        ("every", {}, (8, 8, 8, 0), (3,)),
        ("none", {"sliding_window": 0}, (), ()),
    ):
        config = hf_config_from_gguf(metadata_gguf(tmp_path / f"{name}.gguf", "exaone4", {**keys, **changed}), name)
        model = model_config_from_hf(config)
        assert (model.layer_windows, model.nope_layers) == (windows, nope), name


def test_an_olmo2_gguf_with_windows_is_olmo3s_and_one_with_scaled_rope_too_is_refused(tmp_path: Path) -> None:
    """An `olmo2` file with a window is OLMo 3's, its windowed layers those `attention.sliding_window_pattern` flags;
    one whose rope is also scaled (OLMo 3's YaRN, on its full-attention layers alone) is refused by name."""
    keys = {"block_count": 4, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
            "head_count": 2, "layer_norm_rms_eps": 1e-5, "sliding_window": 8,
            "sliding_window_pattern": [True, True, True, False]}  # fmt: skip
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "olmo3.gguf", "olmo2", keys), "olmo3.gguf")
    assert config["model_type"] == "olmo3"
    assert model_config_from_hf(config).layer_windows == (8, 8, 8, 0)
    yarn = {"rope_scaling_type": RopeScalingType.YARN, "rope_scaling_factor": 8.0, "rope_scaling_orig_ctx_len": 16}
    reader = metadata_gguf(tmp_path / "yarn.gguf", "olmo2", {**keys, **yarn})
    with pytest.raises(ValueError, match="windows and a scaled rope"):
        hf_config_from_gguf(reader, "yarn.gguf")


def test_an_ernie_gguf_in_a_form_llama_cpp_reads_otherwise_is_refused(tmp_path: Path) -> None:
    """An `ernie4_5-moe` file's experts as llama.cpp builds them: after `leading_dense_block_count` dense layers, on
    every `interleave_moe_layer_step`-th, to the last. A file with biases, or whose shared experts' width is not
    theirs times the routed experts' (transformers' shape), is refused by name."""
    keys = {"block_count": 6, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
            "head_count": 2, "layer_norm_rms_eps": 1e-5, "expert_count": 4, "expert_used_count": 2,
            "expert_feed_forward_length": 16, "leading_dense_block_count": 1, "interleave_moe_layer_step": 2,
            "expert_shared_count": 2, "expert_shared_feed_forward_length": 32}  # fmt: skip
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "ernie.gguf", "ernie4_5-moe", keys), "ernie.gguf")
    assert model_config_from_hf(config).dense_layers == (0, 2, 4)
    for name, arch, changed, tensors, refusal in (
        ("biased", "ernie4_5", {}, {"blk.0.attn_q.bias": (32,)}, "with biases"),
        ("shared", "ernie4_5-moe", {"expert_shared_feed_forward_length": 48}, {}, "shared experts 48 wide"),
    ):
        reader = metadata_gguf(tmp_path / f"{name}.gguf", arch, {**keys, **changed}, tensors)
        with pytest.raises(ValueError, match=refusal):
            hf_config_from_gguf(reader, f"{name}.gguf")


# gpt-oss as llama.cpp reads a `gpt-oss` file: its experts' SwiGLU clamped at 7 (fixed there), and the tokenizer's
# bos and eos ids the test writer gives every file.
GPT_OSS_GGUF: dict[str, Any] = {"swiglu_limit": 7.0, "bos_token_id": 1, "eos_token_id": 2}


def test_a_gpt_oss_gguf_with_mxfp4_experts_is_exact_on_the_float_path_and_served_from_its_blocks(
    tmp_path: Path,
) -> None:
    """A gpt-oss file as llama.cpp's converter writes it (each bank of experts split into gate, up and down in MXFP4,
    their biases F32 beside them; sinks, YaRN and the windowed layers from its metadata): converted, the config is the
    saved model's; written out for transformers, every tensor comes back under its checkpoint name (the experts as
    the checkpoint's banks, gate and up alternating), and the float path equals transformers on that checkpoint token
    for token. Served from its blocks, q/k/v and o are the file's Q8_0 blocks, the experts its MXFP4 blocks in the
    expert kernel (with their biases and the clamped SwiGLU), the biased router float row by row,
    and it holds `ladle bench quality`'s thresholds against the float path."""
    folder = save_family(tmp_path / "hf", "gpt-oss", head_spread=1.0, **GPT_OSS_GGUF)
    gguf = write_gguf(folder, tmp_path / "gpt-oss.gguf", GGMLQuantizationType.MXFP4, GGMLQuantizationType.Q8_0)
    converted, expected = converted_as_saved(folder, gguf)
    bank = next(t for t in GgufFile(gguf).tensors if t.name == "blk.1.ffn_gate_exps.weight")
    gate = torch.from_numpy(dequantize(bank.data, bank.tensor_type))  # [E, I, H], the MXFP4 values
    assert torch.equal(converted["model.layers.1.mlp.experts.gate_up_proj"][..., 0::2], gate.transpose(1, 2))
    with engine(gguf) as llm:
        ours = tokens(llm, prompts())
        assert ours == expected.of(ours)
    layers, result = served_from_blocks(gguf)
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.3.self_attn.o_proj"] == "q8"
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_mxfp4_96"] * 4, layers
    assert len(layers) == 3 * 4, layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


def test_a_gpt_oss_gguf_in_a_form_llama_cpp_reads_otherwise_is_refused(tmp_path: Path) -> None:
    """A `gpt-oss` file without experts or a window, or with a rope scaling other than YaRN, is not gpt-oss as llama.cpp
    builds it: each is refused by name. Its window pattern and harmony's stop tokens are read."""
    keys = {"block_count": 4, "context_length": 64, "embedding_length": 32, "feed_forward_length": 32,
            "head_count": 2, "layer_norm_rms_eps": 1e-5, "expert_count": 4, "expert_used_count": 2,
            "expert_feed_forward_length": 16, "sliding_window": 8, "rope_scaling_type": RopeScalingType.YARN,
            "rope_scaling_factor": 4.0, "rope_scaling_orig_ctx_len": 16, "sliding_window_pattern": 3,
            "token_list": ["a", "<|end|>", "<|return|>", "<|call|>"], "eos_token_id": 1}  # fmt: skip
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", keys), "gpt-oss.gguf")
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert config["eos_token_id"] == [2, 3] and config["rope_parameters"]["truncate"] is False
    for name, changed, refusal in (("dense", {"expert_count": 0}, "without experts"),
                                   ("windowless", {"sliding_window": 0}, "without attention.sliding_window"),
                                   ("linear", {"rope_scaling_type": RopeScalingType.LINEAR}, "'linear' is not")):
        reader = metadata_gguf(tmp_path / f"{name}.gguf", "gpt-oss", {**keys, **changed})
        with pytest.raises(ValueError, match=refusal):
            hf_config_from_gguf(reader, f"{name}.gguf")


# Families with experts the GGUF tests write, for llama.cpp's converter's `--fuse-gate-up-exps` form, one of each way
# their banks load (Qwen's per expert, Llama 4's and gpt-oss's regrouped into transformers' banks, gpt-oss's with
# biases and MXFP4 blocks, a hybrid's); Mixtral's names are the odd-rows test's. llama.cpp reads each layer's fused
# gate/up bank where its loader takes one (Qwen3.5-MoE and Qwen3-Next in llama-cpp-python 0.3.36, as
# scripts/check_gguf_writer.py --fuse-gate-up-exps found); ladle reads it for all.
FUSED_GGUF: dict[str, dict[str, Any]] = {
    "qwen3-moe": MOE_GGUF["qwen3-moe"], "llama4": LLAMA4_GGUF, "gpt-oss": GPT_OSS_GGUF,
    "qwen3.5-moe": {"linear_value_head_dim": 16},
}  # fmt: skip


@pytest.mark.parametrize("family", list(FUSED_GGUF))
def test_a_moe_gguf_with_fused_gate_up_banks_reads_as_its_split_form(tmp_path: Path, family: str) -> None:
    """A file whose layers hold their gate and up experts in one `ffn_gate_up_exps` tensor (each expert's gate rows,
    then its up rows; gpt-oss's biases likewise) is the file with them apart: the same config, every float tensor
    bit for bit, and every expert's matrix the quantized path reads the same blocks (the fused tensor's halves, in
    the same types); served from its blocks, Qwen3-MoE's gives the split file's tokens."""
    folder = save_family(tmp_path / "hf", family, head_spread=0.5, **FUSED_GGUF[family])
    experts = GGMLQuantizationType.MXFP4 if family == "gpt-oss" else GGMLQuantizationType.Q4_0
    split = write_gguf(folder, tmp_path / "split.gguf", experts, GGMLQuantizationType.Q8_0)
    fused = write_gguf(folder, tmp_path / "fused.gguf", experts, GGMLQuantizationType.Q8_0, fuse_gate_up_exps=True)
    names = {t.name.split(".")[2] for t in GgufFile(fused).tensors if t.name.endswith("_exps.weight")}
    assert names == {"ffn_gate_up_exps", "ffn_down_exps"}, names
    split_source, fused_source = resolve_model(str(split)), resolve_model(str(fused))
    assert fused_source.config == replace(split_source.config, name=fused_source.config.name)
    split_weights, fused_weights = dict(split_source.weights()), dict(fused_source.weights())
    assert fused_weights.keys() == split_weights.keys()
    for name, weight in split_weights.items():
        assert torch.equal(torch.as_tensor(fused_weights[name]), torch.as_tensor(weight)), name
    converted = json.loads((split_source.path / "config.json").read_text())
    model_type, config = converted["model_type"], split_source.config
    shape = {"model_type": model_type, "num_heads": config.num_attention_heads, "rotary_dim": config.rotary_dim,
             "num_kv_heads": config.num_key_value_heads,
             "hybrid": HybridShape.from_config(converted, model_type) if model_type in TILED_VALUE_HEADS else None}
    split_experts, fused_experts = ({name: matrix for name, matrix in stored_matrices(gguf, converted=source.path,
                                                                                      **shape).items()
                                     if ".experts." in name}
                                    for gguf, source in ((split, split_source), (fused, fused_source)))  # fmt: skip
    assert split_experts and fused_experts.keys() == split_experts.keys()
    for name, matrix in split_experts.items():
        assert fused_experts[name].kind == matrix.kind, name
        assert torch.equal(fused_experts[name].read().dequantize(), matrix.read().dequantize()), name
    if family == "qwen3-moe":  # the whole quantized path once: the same banks, the same tokens
        served = []
        for gguf in (split, fused):
            with engine(gguf, quantization="auto") as llm:
                served.append(tokens(llm, prompts()[:4]))
        assert served[0] == served[1]


def test_a_fused_gate_up_bank_is_read_in_halves_and_one_of_odd_rows_is_refused() -> None:
    """Each expert's gate rows are the first half of its rows in `ffn_gate_up_exps`, its up rows the second; a bank
    whose rows have no halves is no such bank."""
    halves = [(p.name, p.expert, p.rows) for p in hf_expert_slices("blk.2.ffn_gate_up_exps.weight", (2, 6, 32),
                                                                   "mixtral") or []]  # fmt: skip
    assert halves == [
        (f"model.layers.2.block_sparse_moe.experts.{e}.{w}.weight", e, slice(start, start + 3))
        for e in range(2) for w, start in (("w1", 0), ("w3", 3))
    ]  # fmt: skip
    with pytest.raises(ValueError, match="7 rows do not split into gate and up halves"):
        hf_expert_slices("blk.0.ffn_gate_up_exps.weight", (4, 7, 32), "qwen3_moe")


def test_a_hybrid_gguf_whose_value_heads_do_not_fill_its_inner_size_is_refused(tmp_path: Path) -> None:
    """llama.cpp's `ssm.*` keys give the linear layers' shape: an inner size that is not whole value heads, or value
    heads that are not whole groups of key heads, is no Gated DeltaNet's."""
    keys = {"block_count": 4, "context_length": 64, "embedding_length": 32, "feed_forward_length": 32,
            "head_count": 2, "layer_norm_rms_eps": 1e-6, "ssm_conv_kernel": 4, "ssm_state_size": 16,
            "ssm_group_count": 2, "ssm_time_step_rank": 3, "ssm_inner_size": 48,
            "full_attention_interval": 4}  # fmt: skip
    reader = metadata_gguf(tmp_path / "qwen35.gguf", "qwen35", keys)
    with pytest.raises(ValueError, match=r"inner_size 48 over 3 value heads in groups of 2 key heads"):
        hf_config_from_gguf(reader, "qwen35.gguf")


# Every K-quant, IQ and 5- or 8-bit type served from its blocks, in two files: each layer's q/k/v, output, gate/up and
# down projections in types of their own, the file's types taken in turn (16 projections a file).
_Q = GGMLQuantizationType
KQUANT_FILES = {
    "k-quants-5-and-8-bit": (_Q.Q5_0, _Q.Q4_K, _Q.Q5_1, _Q.Q6_K, _Q.Q8_0, _Q.Q5_K, _Q.IQ4_NL, _Q.IQ4_XS, _Q.Q3_K,
                             _Q.Q2_K),
    "iq-2-and-1-bit": (_Q.IQ3_S, _Q.IQ3_XXS, _Q.IQ2_XXS, _Q.IQ2_XS, _Q.IQ2_S, _Q.IQ1_S, _Q.IQ1_M),
}  # fmt: skip
# Phi-3's projections: llama.cpp's names and the engine's layers.
_PHI3_PROJECTIONS = (("attn_qkv", "self_attn.qkv_proj"), ("attn_output", "self_attn.o_proj"),
                     ("ffn_up", "mlp.gate_up_proj"), ("ffn_down", "mlp.down_proj"))  # fmt: skip


@pytest.mark.parametrize("name", sorted(KQUANT_FILES))
def test_k_quant_and_5_bit_files_are_served_from_their_blocks(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Phi-3 256 wide (every row whole K-quant super-blocks) whose projections are in K-quant, IQ, 5- and 8-bit
    types (random blocks where gguf has no quantizer), served from the file's blocks: every projection's weight as read
    is the file's float weight (what `--quantization none` serves) bit for bit, each layer in its type, and the served
    model is close to its float path. The blocks are random, not quantized from trained-like weights, so the
    activations' 8-bit rounding moves these logits more than a real model's: the thresholds are looser than the real
    files' (benchmarks/results/quality_kquant.jsonl), and far below what a misread block gives (KL of nats). On 96
    positions of these flat logits the top-1 share is the noisier measure: its bar is the loose one, the KL's the
    tight one. (Until this stop each pair of types had a file of its own, 11 files: the same types, read the same
    way, in a fifth of the engines.)"""
    kinds = KQUANT_FILES[name]
    slots = [(layer, gguf_name, ours) for layer in range(4) for gguf_name, ours in _PHI3_PROJECTIONS]
    chosen = {f"blk.{layer}.{gguf_name}.weight": kinds[i % len(kinds)] for i, (layer, gguf_name, _) in enumerate(slots)}
    folder = save_family(tmp_path / "hf", "phi3", hidden_size=256, intermediate_size=256)
    gguf = write_gguf(folder, tmp_path / "k.gguf", kinds[0], kinds[1], types=chosen)
    stored = keep_stored_weights(monkeypatch)
    layers, result = served_from_blocks(gguf)
    float_weights = dict(resolve_model(str(gguf)).weights())  # the converted folder: what `none` serves
    assert len(stored) == 4 * 4, sorted(stored)
    for layer_name, weight in stored.items():
        assert torch.equal(weight.dequantize(), float_weights[f"{layer_name}.weight"]), layer_name
    for i, (layer, _, ours) in enumerate(slots):
        kind = kinds[i % len(kinds)]
        assert layers[f"model.layers.{layer}.{ours}"] == ("q8" if kind == _Q.Q8_0 else kind.name.lower()), ours
    assert result.top1_agreement >= 0.7 and result.mean_kl <= 0.01, result


# The Gated DeltaNet hybrids as llama.cpp writes them (scripts/check_gguf_writer.py runs llama.cpp on such files and
# finds transformers' tokens): Qwen3.5 with two key heads each read by two value heads, tiled in its files, 32 wide
# (so out_proj's heads are whole Q8_0 blocks, read in checkpoint order from the file); Qwen3-Next (grouped q/k/v/z
# and b/a, its value heads never tiled) and Qwen3.5-MoE 16 wide (llama.cpp takes a value head as wide as a key head;
# out_proj's tiled heads are then half blocks), every layer with experts.
HYBRID_GGUF: dict[str, dict[str, Any]] = {
    "qwen3.5": {"linear_key_head_dim": 32, "linear_value_head_dim": 32},
    "qwen3-next": {"linear_value_head_dim": 16, "mlp_only_layers": []},
    "qwen3.5-moe": {"linear_value_head_dim": 16},
}
HYBRID_KEYS = ("linear_attention", "norm_offset", "attention_output_gate", "rotary_dim", "num_experts",
               "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "shared_expert_intermediate_size")


@pytest.fixture(scope="module", params=list(HYBRID_GGUF))
def hybrid_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"{request.param}-gguf")
    folder = save_family(root / "hf", request.param, head_spread=0.5, **HYBRID_GGUF[request.param])
    return request.param, write_gguf(folder, root / "hybrid.gguf", GGMLQuantizationType.Q4_0,
                                     GGMLQuantizationType.Q8_0)


def test_a_hybrid_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(
    hybrid_gguf: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converted, the config is the saved model's and every tensor comes back as the checkpoint holds it (value heads
    grouped again, A_log from -exp(A_log), the norms' 1 + w back to w, Qwen3-Next's q/k/v/z regrouped): F32 ones
    exactly (A_log to an ulp), quantized ones to their rounding; the float path equals transformers on the converted
    folder token for token. Served from its blocks, each linear-attention projection's weight is the converted one
    bit for bit (its rows, and out_proj's columns, read in checkpoint order), it is as close to the float path as
    ladle's own int8 is, and a prompt's tokens are the same alone and batched."""
    family, gguf = hybrid_gguf
    source = resolve_model(str(gguf))
    saved = model_config_from_hf(json.loads((gguf.parent / "hf" / "config.json").read_text()))
    assert [getattr(source.config, key) for key in HYBRID_KEYS] == [getattr(saved, key) for key in HYBRID_KEYS]
    original, converted = load_file(gguf.parent / "hf" / "model.safetensors"), dict(source.weights())
    norms = [name for name in original if name.endswith("norm.weight") and ".linear_attn." not in name]
    assert_tensors_come_back(original, converted, ("embed_tokens.weight", ".gate.weight", "conv1d.weight"), {
        "A_log": lambda ours, theirs: torch.allclose(ours, theirs, rtol=1e-6, atol=0),
        **dict.fromkeys(norms, lambda ours, theirs: torch.equal(ours + 1, theirs + 1)),  # as applied, 1 + w
    })  # fmt: skip
    with engine(gguf) as llm:
        ours = tokens(llm, prompts())
        assert ours == converted_reference_tokens(source).of(ours), family

    stored = keep_stored_weights(monkeypatch)
    layers, result, read = served_from_blocks_reading(gguf, monkeypatch)
    assert not [name for name in read if ".in_proj" in name or ".out_proj" in name], read  # none dequantized
    assert any(name.endswith(".linear_attn.conv1d.weight") for name in read), read
    shape = source.config.linear_attention
    assert shape is not None
    for layer in shape.layers:
        prefix = f"model.layers.{layer}.linear_attn"
        if family == "qwen3-next":
            parts = dict(split_grouped_projections("in_proj_qkvz.weight", converted[f"{prefix}.in_proj_qkvz.weight"],
                                                   shape))
            parts |= dict(split_grouped_projections("in_proj_ba.weight", converted[f"{prefix}.in_proj_ba.weight"],
                                                    shape))
            in_proj = torch.cat([parts[f".in_proj_{p}.weight"] for p in "qkvzba"])
        else:
            in_proj = torch.cat([converted[f"{prefix}.in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")])
        module = f"model.layers.{layer}.self_attn"
        assert layers[f"{module}.in_proj"] == "q8" and layers[f"{module}.out_proj"] == "q8", layers
        assert torch.equal(stored[f"{module}.in_proj"].dequantize(), in_proj), (family, layer)
        out_proj = converted[f"{prefix}.out_proj.weight"]
        if family == "qwen3.5-moe":  # tiled heads 16 wide: out_proj's columns come from within blocks, requantized
            out_proj = quantize_q8(out_proj).dequantize()
        assert torch.equal(stored[f"{module}.out_proj"].dequantize(), out_proj), (family, layer)
    # Looser than the other families': these random hybrids' recurrent state carries every rounding along, and
    # ladle's own int8 of the same files measures alike (top-1 0.84 / KL 0.035 for Qwen3-Next, 0.92 / 0.006 for
    # Qwen3.5, 0.88 / 0.014 for Qwen3.5-MoE; all-Q8_0 files 0.88-0.97); a misread block costs nats.
    assert result.top1_agreement >= 0.75 and result.mean_kl <= 0.05, (family, result)
    batch = prompts()
    with engine(gguf, quantization="auto") as llm:
        alone = [tokens(llm, [prompt])[0] for prompt in batch[:4]]
        assert tokens(llm, batch[:4]) == alone, family


def test_a_hybrid_gguf_split_over_two_ranks_reads_each_ranks_heads_from_the_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3.5 over two ranks: each keeps one key head and its two value heads, whose rows of in_proj and columns of
    out_proj lie apart in the file (tiled); read from the blocks they are the converted weights' slices bit for bit,
    and the split model is as close to the float path as at one rank."""
    folder = save_family(tmp_path / "hf", "qwen3.5", head_spread=0.5, **HYBRID_GGUF["qwen3.5"])
    gguf = write_gguf(folder, tmp_path / "hybrid.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)
    stored = keep_stored_weights(monkeypatch)
    layers, result = served_from_blocks(gguf, tensor_parallel_size=2)
    converted = dict(resolve_model(str(gguf)).weights())
    shape = resolve_model(str(gguf)).config.linear_attention
    assert shape is not None and layers["model.layers.0.self_attn.out_proj"] == "q8", layers
    value_rows = shape.value_dim // 2  # rank 0's: key head 0's value heads, 2 of 32 rows each
    out_proj = converted["model.layers.0.linear_attn.out_proj.weight"][:, :value_rows]
    assert torch.equal(stored["model.layers.0.self_attn.out_proj"].dequantize(), out_proj)
    z = converted["model.layers.0.linear_attn.in_proj_z.weight"][:value_rows]
    in_proj = stored["model.layers.0.self_attn.in_proj"].dequantize()
    key_rows = shape.key_head_dim  # rank 0's q, k, v, z, b, a rows, in that order
    assert torch.equal(in_proj[2 * key_rows + value_rows : 2 * key_rows + 2 * value_rows], z)
    assert result.top1_agreement >= 0.75 and result.mean_kl <= 0.05, result


# Gemma 4 as llama.cpp writes it (scripts/check_gguf_writer.py has llama.cpp decode such files): per-layer arrays of
# KV heads and MLP widths, the full-attention layers' head dim beside the windowed ones', `rope_freqs` making their
# rope proportional, no attn_v where values are the keys' projection, the per-layer inputs' tables, layer scalars,
# and (26B A4B's block) the router's scales and the experts' fused banks. Per-layer inputs 32 wide, so every matrix
# is whole blocks of 32; the per-layer input table in Q8_0, as llama.cpp's quantizer leaves it.
GEMMA4_GGUF: dict[str, dict[str, Any]] = {"gemma4": {"hidden_size_per_layer_input": 32}, "gemma4-moe": {}}
# Gemma 3n's per-layer inputs 32 wide (Q8_0's blocks), from a table as long as the vocabulary (llama.cpp's converter
# pads a shorter one with zero rows, which its file then holds: the checkpoint reads row 0 for those ids).
GEMMA3N_GGUF: dict[str, Any] = {"hidden_size_per_layer_input": 32, "vocab_size_per_layer_input": VOCAB_SIZE}


def test_a_gemma3n_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Gemma 3n file as llama.cpp's converter writes it (`gemma3n`: Gemma 4's names for the per-layer inputs and
    norms, plain w; AltUp's and LAuReL's tensors as `altup_*` and `laurel_*`, the streams' projections stacked
    `[3, hidden, hidden]`; each layer's MLP width, the window pattern, the shared K/V layers and each MLP's sparsity
    as a normal quantile): converted, the config is the saved model's and every tensor comes back under the name
    transformers saved it with, and the float path equals transformers token for token. Served from its blocks (its
    projections in Q8_0), each projection's weight is the converted one bit for bit and it stays close to the float
    path: mean KL within `ladle bench quality`'s 0.01, top-1 within 0.9 (measured 94.8% / 0.008: this random
    model's near-ties flip on 8-bit noise; at Q4_0 MLPs 86.5% / 0.010)."""
    gguf, expected = written_and_converted(tmp_path, "gemma3n", GGMLQuantizationType.Q8_0, **GEMMA3N_GGUF)
    stored = keep_stored_weights(monkeypatch)
    layers, result = served_from_blocks(gguf, expected=expected)
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.5.mlp.down_proj"] == "q8"
    assert layers["model.layers.5.per_layer_projection"] == "q8" and "model.layers.5.self_attn.qkv_proj" in layers
    float_weights = dict(resolve_model(str(gguf)).weights())
    for name, weight in stored.items():
        if not name.endswith(("qkv_proj", "gate_up_proj")) and name != "model.embed_tokens_per_layer":
            assert torch.equal(weight.dequantize(), float_weights[f"{name}.weight"]), name
    assert result.top1_agreement >= 0.9 and result.mean_kl <= 0.01, result


def test_a_gemma3n_gguf_without_its_optional_keys_reads_as_llama_cpp_fixes_them(tmp_path: Path) -> None:
    """A `gemma3n` file without the window pattern, the shared K/V layers or the sparsity quantiles is read as
    llama.cpp reads one (every fifth layer full, K/V of their own on the first 20 layers, the first ten MLPs sparse
    at 0.95); one whose MLP widths differ between layers is refused by name."""
    keys = {"block_count": 30, "context_length": 64, "embedding_length": 32, "feed_forward_length": [64] * 30,
            "head_count": 2, "head_count_kv": 1, "layer_norm_rms_eps": 1e-6, "key_length": 16, "value_length": 16,
            "sliding_window": 8, "embedding_length_per_layer_input": 8}  # fmt: skip
    tensors = {"per_layer_token_embd.weight": (64, 240), "blk.0.laurel_l.weight": (4, 32)}
    config = hf_config_from_gguf(metadata_gguf(tmp_path / "e2b.gguf", "gemma3n", keys, tensors), "e2b.gguf")
    assert config["layer_types"] == (["sliding_attention"] * 4 + ["full_attention"]) * 6
    assert config["num_kv_shared_layers"] == 10 and config["laurel_rank"] == 4
    assert config["activation_sparsity_pattern"] == [0.95] * 10 + [0.0] * 20
    assert model_config_from_hf(config).altup == AltUp(4, 0, True, 4, (0.95,) * 10 + (0.0,) * 20)
    uneven = {**keys, "feed_forward_length": [64] * 29 + [128]}
    with pytest.raises(ValueError, match=r"MLP widths \[64, 128\] differ between layers"):
        hf_config_from_gguf(metadata_gguf(tmp_path / "uneven.gguf", "gemma3n", uneven, tensors), "uneven.gguf")


@pytest.fixture(scope="module", params=list(GEMMA4_GGUF))
def gemma4_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"{request.param}-gguf")
    folder = save_family(root / "hf", request.param, head_spread=0.5, **GEMMA4_GGUF[request.param])
    table = {"per_layer_token_embd.weight": GGMLQuantizationType.Q8_0} if request.param == "gemma4" else {}
    return request.param, write_gguf(folder, root / "gemma4.gguf", GGMLQuantizationType.Q4_0,
                                     GGMLQuantizationType.Q8_0, types=table)


def test_a_gemma4_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(
    gemma4_gguf: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converted, the config is the saved model's (its layout: head shapes, shared K/V, wide MLPs, per-layer inputs,
    experts) and every tensor comes back under the name transformers saved it with, F32 ones exactly (norms as they
    are: Gemma 4's are not 1 + w); the float path equals transformers on the converted folder token for token.
    Served from its blocks, each projection's weight, and the per-layer input table's, is the converted one bit for
    bit, so is each expert's gate, up and down from the fused banks (`gate_up_proj` split in its halves; GELU in
    the experts' kernel), it holds the quality thresholds, and a prompt's tokens are the same alone and batched."""
    family, gguf = gemma4_gguf
    source = resolve_model(str(gguf))
    saved = model_config_from_hf(json.loads((gguf.parent / "hf" / "config.json").read_text()))
    assert source.config == replace(saved, name=source.config.name, bos_token_id=source.config.bos_token_id,
                                    eos_token_ids=source.config.eos_token_ids), family  # fmt: skip
    original, converted = load_file(gguf.parent / "hf" / "model.safetensors"), dict(source.weights())
    assert_tensors_come_back(original, converted, ("model.embed_tokens.weight", "router.proj.weight"))
    with engine(gguf) as llm:
        ours = tokens(llm, prompts())
        assert ours == converted_reference_tokens(source).of(ours), family
    stored = keep_stored_weights(monkeypatch)
    layers, result, read = served_from_blocks_reading(gguf, monkeypatch)
    assert read and not [name for name in read if ".experts." in name], read  # no bank dequantized
    assert layers["model.layers.0.self_attn.qkv_proj"] == "q8" and layers["model.layers.5.mlp.gate_up_proj" if
                                                                         family == "gemma4" else
                                                                         "model.layers.3.mlp.gate_up_proj"] == "q4"
    banks = {name: fmt for name, fmt in layers.items() if fmt.startswith("experts_")}
    width = source.config.gemma4.expert_intermediate_size if source.config.gemma4 is not None else 0
    assert banks == ({} if family == "gemma4" else {
        f"model.layers.{layer}.experts": f"experts_q4_{width}" for layer in range(source.config.num_hidden_layers)
    }), layers
    float_weights = dict(source.weights())
    for bank in banks:  # each expert's rows of the fused float bank, as its kernel holds them (gate, then up)
        gate_up, down = float_weights[f"{bank}.gate_up_proj"], float_weights[f"{bank}.down_proj"]
        for expert, (packed, packed_down) in enumerate(zip(stored[bank].gate_up, stored[bank].down, strict=True)):
            assert torch.equal(packed.dequantize(), gate_up[expert]), (bank, expert)
            assert torch.equal(packed_down.dequantize(), down[expert]), (bank, expert)
    if family == "gemma4":  # the per-layer input table's Q8_0 blocks, looked up as the file holds them
        table = stored["model.embed_tokens_per_layer"].dequantize()
        assert torch.equal(table, float_weights["model.embed_tokens_per_layer.weight"])
    for name, weight in stored.items():
        if name.endswith(("qkv_proj", "gate_up_proj")) or name in banks:
            continue  # fused from parts: their parts are the other families' tests'
        assert torch.equal(weight.dequantize(), float_weights[f"{name}.weight"]), name
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, (family, result)
    batch = prompts()
    with engine(gguf, quantization="auto") as llm:
        alone = [tokens(llm, [prompt])[0] for prompt in batch[:4]]
        assert tokens(llm, batch[:4]) == alone, family
