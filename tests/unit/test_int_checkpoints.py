"""GPTQ, AWQ and compressed-tensors integer checkpoints (`engine_server.loader.int_checkpoint`): each quantized
layer read as the float weight it stands for, and the model served from them.

compressed-tensors' own compressor writes its checkpoints and its own decompressor is the oracle of their weights;
transformers (with compressed-tensors installed) loads the same folder as the oracle of the served tokens. GPTQ's and
AWQ's packers (AutoGPTQ's, AutoAWQ's) are written here from their documented layouts, independently of the engine's
unpacking: a layer's weight is `(q - zero) * scale` of the integers the test packed, and the served tokens are
transformers' on those weights. The model is a tiny random Llama saved by transformers (tests/families.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_server.llm import LLM
from engine_server.loader import resolve_model
from engine_server.loader.int_checkpoint import int_checkpoint
from engine_server.sampling_params import SamplingParams
from tests.families import hf_greedy, load_reference, save_family

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

GROUP = 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], list(range(20, 60))]
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble p of a word holds column AWQ_ORDER[p] of its eight


def quantizable(name: str) -> bool:
    """The layers these checkpoints quantize: every projection of the decoder layers (not the LM head)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def integers(weight: torch.Tensor, bits: int, groups: torch.Tensor, count: int, symmetric: bool) -> dict[str, Any]:
    """Round-to-nearest `bits`-wide unsigned integers of `weight` `[N, K]` with a scale (and zero) per row and group
    (`groups[k]`: input column k's of `count`): q, zeros, scales `[N, count]` (float16, as GPTQ and AWQ store them)."""
    top = (1 << bits) - 1
    rows = weight.shape[0]
    scales, zeros = torch.empty(rows, count), torch.empty(rows, count, dtype=torch.int64)
    for group in range(count):
        part = weight[:, groups == group]
        low, high = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
        if symmetric:
            scales[:, group] = torch.maximum(low.abs(), high) / (top // 2)
            zeros[:, group] = (top + 1) // 2
        else:
            scales[:, group] = (high - low) / top
            zeros[:, group] = torch.round(-low / scales[:, group]).long()
    scales = scales.clamp(min=1e-6).half()
    q = torch.clamp(torch.round(weight / scales.float()[:, groups]) + zeros[:, groups], 0, top).long()
    return {"q": q, "zeros": zeros, "scales": scales}


def float_of(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The weight the integers stand for: `(q - zero) * scale`, each column by its group."""
    return (q - zeros[:, groups]).float() * scales.float()[:, groups]


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`values` `[R, C]` packed along the columns into int32 words, lowest bits first."""
    per_word = 32 // bits
    words = values.reshape(values.shape[0], -1, per_word).long()
    packed = sum(words[..., i] << (bits * i) for i in range(per_word))
    return (packed & 0xFFFFFFFF).to(torch.int64).to(torch.int32)  # two's complement: the top bit is the sign


def gptq_layer(weight: torch.Tensor, bits: int, act_order: bool, v1: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """A layer as AutoGPTQ writes it: `qweight` packed along the input dim `[K / per, N]`, `qzeros` along the output
    dim (one less in the original format), `scales` `[groups, N]`, `g_idx`; with `act_order`, columns assigned to
    groups by a random order. Returns the tensors and the float weight they stand for."""
    columns = weight.shape[1]
    rank = torch.randperm(columns) if act_order else torch.arange(columns)
    groups = rank // GROUP
    parts = integers(weight, bits, groups, columns // GROUP, symmetric=False)
    stored_zeros = (parts["zeros"] - int(v1)) & ((1 << bits) - 1)
    tensors = {
        "qweight": pack(parts["q"], bits).t().contiguous(),
        "qzeros": pack(stored_zeros.t().contiguous(), bits),
        "scales": parts["scales"].t().contiguous(),
        "g_idx": groups.to(torch.int32),
    }
    return tensors, float_of(parts["q"], parts["zeros"], parts["scales"], groups)


def awq_layer(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], Any]:
    """A layer as AutoAWQ's GEMM version writes it: `qweight` `[K, N / 8]` and `qzeros` `[groups, N / 8]` packed along
    the output dim in its interleaved order, `scales` `[groups, N]`."""
    rows, columns = weight.shape
    groups = torch.arange(columns) // GROUP
    parts = integers(weight, 4, groups, columns // GROUP, symmetric=False)
    interleave = torch.tensor([8 * word + column for word in range(rows // 8) for column in AWQ_ORDER])
    tensors = {
        "qweight": pack(parts["q"].t()[:, interleave].contiguous(), 4),
        "qzeros": pack(parts["zeros"].t()[:, interleave].contiguous(), 4),
        "scales": parts["scales"].t().contiguous(),
    }
    return tensors, float_of(parts["q"], parts["zeros"], parts["scales"], groups)


def compressed_layer(weight: torch.Tensor, scheme: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """A layer as compressed-tensors' pack-quantized compressor writes it (scales and zero points as its
    `calculate_qparams` gives them, per group or channel), and its own decompression of it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    width = args.group_size if args.strategy == "group" else weight.shape[1]
    grouped = weight.reshape(weight.shape[0], -1, width)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    tensors = PackedQuantizationCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme
    )
    return tensors, PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]


def quantized_checkpoint(folder: Path, method: str, **form: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    """`folder`'s checkpoint (a saved model) rewritten with its projections quantized in `method`'s layout (`form`:
    bits, symmetric, strategy, act_order, v1) and its config's `quantization_config`; returns the folder and each
    quantized layer's float weight as the method's oracle reads it (module doc)."""
    tensors, expected = {}, {}
    for name, weight in load_file(folder / "model.safetensors").items():
        if not quantizable(name):
            tensors[name] = weight
            continue
        layer = name.removesuffix(".weight")
        if method == "gptq":
            parts, expected[name] = gptq_layer(weight, form["bits"], form.get("act_order", False), form.get("v1", True))
        elif method == "awq":
            parts, expected[name] = awq_layer(weight)
        else:
            parts, expected[name] = compressed_layer(weight, compressed_scheme(**form))
        tensors.update({f"{layer}.{part}": tensor for part, tensor in parts.items()})
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, **form)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, expected


def compressed_scheme(bits: int = 4, symmetric: bool = True, strategy: str = "group") -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    group = {"group_size": GROUP} if strategy == "group" else {}
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, **group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def quantization_config(method: str, **form: Any) -> dict[str, Any]:
    """The `quantization_config` each method's tools write for `form`."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": form["bits"], "group_size": GROUP, "sym": False,
                "desc_act": form.get("act_order", False),
                "checkpoint_format": "gptq" if form.get("v1", True) else "gptq_v2"}  # fmt: skip
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": compressed_scheme(**form)}, format="pack-quantized",
                                ignore=["lm_head"], quantization_status="compressed")  # fmt: skip
    return {**config.model_dump(), "quant_method": "compressed-tensors"}


def float_copy(folder: Path, expected: dict[str, torch.Tensor], into: Path) -> Path:
    """The quantized checkpoint in `folder` as the float checkpoint it stands for (`expected`'s weights), in `into`."""
    import shutil

    shutil.copytree(folder, into)
    config = json.loads((into / "config.json").read_text())
    del config["quantization_config"]
    (into / "config.json").write_text(json.dumps(config))
    layers = {name.removesuffix(".weight") for name in expected}
    kept = {name: t for name, t in load_file(folder / "model.safetensors").items()
            if name.rpartition(".")[0] not in layers}  # fmt: skip
    save_file({**kept, **expected}, into / "model.safetensors")
    return into


def engine(folder: Path, quantization: str = "none", **overrides: Any) -> LLM:
    config = EngineConfig(model=str(folder), device="cpu", quantization=quantization,
                          cache=CacheConfig(memory_bytes=32 * 1024**2),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=128))  # fmt: skip
    return LLM(config=config, **overrides)


def tokens(llm: LLM) -> list[list[int]]:
    return [result.choices[0].token_ids for result in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


FORMS: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq-4bit": ("gptq", {"bits": 4}),
    "gptq-8bit-act-order": ("gptq", {"bits": 8, "act_order": True}),
    "gptq-v2-act-order": ("gptq", {"bits": 4, "act_order": True, "v1": False}),
    "awq": ("awq", {}),
    "compressed-w4a16-group": ("compressed-tensors", {"bits": 4, "symmetric": True, "strategy": "group"}),
    "compressed-w4a16-asymmetric": ("compressed-tensors", {"bits": 4, "symmetric": False, "strategy": "group"}),
    "compressed-w8a16-channel": ("compressed-tensors", {"bits": 8, "symmetric": True, "strategy": "channel"}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_quantized_layer_reads_as_the_weight_it_stands_for(form: str, tmp_path: Path) -> None:
    """Every quantized layer's weight equals its oracle's exactly (module doc); the other tensors come as stored."""
    method, options = FORMS[form]
    folder, expected = quantized_checkpoint(save_family(tmp_path / "model", "llama"), method, **options)
    source = resolve_model(str(folder))
    assert source.int_weights is not None and source.int_weights.method == method
    weights = dict(source.weights())
    assert not any(name.endswith(("qweight", "weight_packed", "scales", "weight_scale")) for name in weights)
    for name, weight in expected.items():
        torch.testing.assert_close(weights[name], weight.float(), rtol=0, atol=0, msg=name)
    lazy = dict(source.lazy_weights())  # (a sharded load's: each layer's parts read whole)
    assert all(torch.equal(lazy[name], weights[name]) for name in expected)


@pytest.mark.parametrize("form", ["gptq-8bit-act-order", "awq", "compressed-w4a16-asymmetric"])
def test_a_quantized_checkpoint_serves_transformers_tokens_on_its_weights(form: str, tmp_path: Path) -> None:
    """Served on the float path, the model's greedy tokens equal transformers' on the weights the integers stand
    for (over two ranks too, GPTQ's act-order: each rank's rows read from whole layers); `--quantization auto` serves
    them as int8 weights on the CPU."""
    method, options = FORMS[form]
    folder, expected = quantized_checkpoint(save_family(tmp_path / "model", "llama"), method, **options)
    reference = load_reference(float_copy(folder, expected, tmp_path / "float"))
    theirs = [hf_greedy(reference, [prompt], NUM_TOKENS)[0] for prompt in PROMPTS]
    with engine(folder) as llm:
        assert tokens(llm) == theirs
    if method == "gptq":
        with engine(folder, tensor_parallel_size=2) as llm:
            assert tokens(llm) == theirs
    with engine(folder, "auto") as llm:
        assert llm.core.runner.loaded.quantization == "int8"
        assert sum(ours[0] == first[0] for ours, first in zip(tokens(llm), theirs, strict=True)) >= 2


def test_transformers_reads_a_compressed_tensors_checkpoint_as_the_engine_does(tmp_path: Path) -> None:
    """transformers with compressed-tensors installed loads the W4A16 folder itself (symmetric: it refuses the packed
    zero points of an asymmetric one, compressed-tensors 0.20.1 under transformers 5.24): its greedy tokens are the
    engine's."""
    folder, _ = quantized_checkpoint(save_family(tmp_path / "model", "llama"), "compressed-tensors", bits=4,
                                     symmetric=True, strategy="group")  # fmt: skip
    reference = load_reference(folder)
    theirs = [hf_greedy(reference, [prompt], NUM_TOKENS)[0] for prompt in PROMPTS]
    with engine(folder) as llm:
        assert tokens(llm) == theirs


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits is not read"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "with zero_point False"),
        ({"quant_method": "compressed-tensors", "format": "marlin-24",
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
         "format 'marlin-24' is not read"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
         "not integers per group or channel"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not read"),
    ],
)
def test_forms_this_engine_does_not_read_are_refused_by_name(
    quantization: dict[str, Any], message: str, tmp_path: Path
) -> None:
    folder = save_family(tmp_path / "model", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=message):
        resolve_model(str(folder))
    assert int_checkpoint({}) is None


def test_a_kimi_k25_checkpoint_with_int4_weights_serves_its_text_model(tmp_path: Path) -> None:
    """Kimi K2.5 ships its text model's projections as compressed-tensors W4A16 (symmetric, groups of 32) under
    `language_model.`: read as the weights they stand for, then as the text model, its greedy tokens are transformers'
    multimodal model's holding those weights."""
    import transformers

    from tests.families import _SHAPE, FAMILIES, draw_language_model
    from tests.unit.pooling.embedding_models import copy_tokenizer

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4}  # fmt: skip
    text = {**_SHAPE, **FAMILIES["deepseek-v3"][1], "model_type": "deepseek_v3", "tie_word_embeddings": False}
    config = transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    draw_language_model(model)
    folder = tmp_path / "released"
    config.save_pretrained(folder)
    copy_tokenizer(folder)
    released = {}
    renames = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
               ("model.vision_tower.", "vision_tower.encoder."), ("model.mm_projector.", "mm_projector."))  # fmt: skip
    for name, tensor in model.state_dict().items():  # the released layout (transformers' own save renames it)
        for theirs, ours in renames:
            if name.startswith(theirs):
                name = ours + name.removeprefix(theirs)
        released[name] = tensor.clone()
    save_file(released, folder / "model.safetensors")
    scheme = compressed_scheme(bits=4, symmetric=True, strategy="group")
    tensors, expected = {}, {}
    for name, weight in released.items():
        if (name.startswith("language_model.model.layers.") and name.endswith("_proj.weight")
                and weight.shape[-1] % GROUP == 0):  # fmt: skip
            parts, expected[name] = compressed_layer(weight, scheme)
            tensors.update({f"{name.removesuffix('.weight')}.{part}": t for part, t in parts.items()})
        else:
            tensors[name] = weight
    save_file(tensors, folder / "model.safetensors")
    saved = json.loads((folder / "config.json").read_text())
    saved["quantization_config"] = quantization_config("compressed-tensors", bits=4, symmetric=True, strategy="group")
    (folder / "config.json").write_text(json.dumps(saved))
    in_memory = {name.replace("language_model.model.", "model.language_model."): weight
                 for name, weight in expected.items()}  # fmt: skip
    model.load_state_dict(in_memory, strict=False)
    theirs = [hf_greedy(model, [prompt], NUM_TOKENS)[0] for prompt in PROMPTS]
    with engine(folder) as llm:
        assert llm.core.model_config.architecture == "deepseek_v3"
        assert tokens(llm) == theirs
