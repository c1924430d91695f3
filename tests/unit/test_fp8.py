"""FP8 weights (`--quantization fp8`): the e4m3 reference (round trip, saturation, NaN), the layer on the CPU, which
scheme an engine serves, and FP8 checkpoints in both layouts (block-wise `fp8` and `compressed-tensors`) written
from a small random transformers model: loaded dequantized (weights equal to the stored values times their scales,
greedy output equal to transformers' on those values) and served in FP8 as stored, close to that float model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.quality import QUALITY_PROMPTS, compare, reference_of
from engine_server import LLM, SamplingParams
from engine_server.config import CacheConfig, EngineConfig
from engine_server.layers.fp8_experts import Fp8Bank, Fp8Experts
from engine_server.layers.fp8_linear import Fp8Linear, Fp8Weight, concat_fp8_rows, gpu_layout, gpu_takes, quantize_fp8
from engine_server.layers.moe import SparseMoE
from engine_server.loader import ModelSource, resolve_model
from engine_server.loader.fp8_checkpoint import Fp8Checkpoint, fp8_checkpoint
from engine_server.parallel.layers import ParallelExperts
from engine_server.quantization import resolve_quantization
from ladle_kernels import reference
from tests.families import hf_greedy, load_reference, save_family
from tests.unit.runner_factories import TINY_LLAMA

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# The projections an FP8 checkpoint stores in e4m3 (Mixtral's experts' are w1 / w3 / w2: gate / up / down).
LINEARS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # DeepSeek's latent attention
    "wq_b", "wk", "weights_proj",  # DeepSeek-V3.2's indexer
)  # fmt: skip


# --- the reference ------------------------------------------------------------------------------------------


def test_e4m3_saturates_and_keeps_nan() -> None:
    values = torch.tensor([500.0, -1e9, float("inf"), float("-inf"), 448.0, 464.0, float("nan"), 0.3])
    got = reference.to_fp8(values).float()
    assert got[:6].tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 448.0]
    assert got[6].isnan() and got[7] == 0.3125  # 0.3 between 0.28125 and 0.3125: nearer the latter


@pytest.mark.parametrize("block", [None, (128, 128), (32, 48)])
def test_quantize_dequantize_round_trip(block: tuple[int, int] | None) -> None:
    """Each element within half an e4m3 step of its block's scale (2^-4 relative to its power of two) of the
    original; each row's / block's largest magnitude exactly 448 steps; an exact e4m3 weight comes back as is."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(200, 160, generator=generator) * torch.logspace(-3, 1, 200).unsqueeze(1)
    qs, scale = reference.fp8_quantize_per_channel(w) if block is None else reference.fp8_quantize_blocks(w, block)
    back = reference.fp8_dequantize(qs, scale, block)
    multiplier = reference.expand_fp8_scale(scale, *w.shape, block)
    error = (back - w).abs()
    # Normal values: half a step of 2^-3 relative; subnormals (below 2^-6 steps): half of 2^-9 steps.
    bound = torch.maximum(w.abs() * 2.0**-4, multiplier * 2.0**-10)
    assert bool((error <= bound * (1 + 1e-6)).all())
    assert qs.float().abs().amax() == 448.0
    again, again_scale = (
        reference.fp8_quantize_per_channel(back) if block is None else reference.fp8_quantize_blocks(back, block)
    )
    torch.testing.assert_close(reference.fp8_dequantize(again, again_scale, block), back, rtol=1e-6, atol=0)


def test_a_zero_row_quantizes_to_zeros() -> None:
    qs, scale = reference.fp8_quantize_per_token(torch.zeros(2, 8))
    assert not qs.float().any() and bool((scale == reference.FP8_MIN_SCALE).all())


def test_the_gpu_takes_blocks_a_multiple_of_32_columns_wide_or_quantizes_them_again_per_channel() -> None:
    """`gpu_layout`: per-channel weights and 128- or 32-column blocks as they are; 48-column blocks (a checkpoint's
    could be: the e4m3 K tiles of the GPU kernels are 32 wide) quantized again per channel, for dense layers and for
    banks of experts alike."""
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=generator)
    blocks = [Fp8Weight(*reference.fp8_quantize_blocks(w, block), block) for block in [(128, 128), (16, 32)]]
    for weight in (quantize_fp8(w), *blocks):
        assert gpu_takes(weight.block) and gpu_layout(weight) is weight
    assert not gpu_takes((32, 48)) and not gpu_takes((128, 16))
    narrow = Fp8Weight(*reference.fp8_quantize_blocks(w, (32, 48)), (32, 48))
    again = gpu_layout(narrow)
    assert again.block is None and torch.equal(again.dequantize(), quantize_fp8(narrow.dequantize()).dequantize())
    bank = Fp8Bank.stack([narrow, narrow])
    assert bank.per_channel().block is None and torch.equal(bank.per_channel().dequantize()[1], again.dequantize())


def test_fused_shards_keep_their_scales_or_are_quantized_again() -> None:
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(64, 96, generator=generator), torch.randn(32, 96, generator=generator)
    per_channel = concat_fp8_rows([quantize_fp8(q), quantize_fp8(k)])
    assert per_channel.block is None and per_channel.shape == (96, 96)
    aligned = concat_fp8_rows([Fp8Weight(*reference.fp8_quantize_blocks(w, (32, 48)), (32, 48)) for w in (q, k)])
    torch.testing.assert_close(aligned.dequantize()[64:], Fp8Weight(*reference.fp8_quantize_blocks(k, (32, 48)),
                                                                    (32, 48)).dequantize())  # fmt: skip
    assert aligned.block == (32, 48)
    straddling = concat_fp8_rows([Fp8Weight(*reference.fp8_quantize_blocks(w, (48, 48)), (48, 48)) for w in (q, k)])
    assert straddling.block is None and straddling.shape == (96, 96)  # 64 rows: a block across q and k


def test_the_cpu_layer_is_the_reference() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = quantize_fp8(torch.randn(40, 64, generator=generator))
    bias = torch.randn(40, generator=generator)
    layer = Fp8Linear(weight, bias, torch.float32)
    x = torch.randn(3, 5, 64, generator=generator)
    expected = reference.fp8_linear(x.reshape(15, 64), weight.qs, weight.scales, bias).reshape(3, 5, 40)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert layer.qs is None and layer.dense is not None


# --- which scheme -------------------------------------------------------------------------------------------


def source(fp8: Fp8Checkpoint | None = None) -> ModelSource:
    return ModelSource(TINY_LLAMA, Path("."), "tiny", Path("."), fp8=fp8)


BLOCKWISE = Fp8Checkpoint("fp8", (128, 128), False)


@pytest.mark.parametrize(
    ("mode", "fp8", "device", "capability", "expected"),
    [
        ("fp8", None, CPU, None, "fp8"),
        ("fp8", None, CUDA, (9, 0), "fp8"),
        ("fp8", BLOCKWISE, CUDA, (8, 9), "fp8"),
        ("auto", BLOCKWISE, CUDA, (9, 0), "fp8"),  # an FP8 checkpoint is served as it is where the GEMMs run
        ("auto", BLOCKWISE, CUDA, (8, 0), "none"),  # ... dequantized elsewhere
        ("auto", BLOCKWISE, CPU, None, "none"),
        ("none", BLOCKWISE, CUDA, (9, 0), "none"),
        ("int8", BLOCKWISE, CPU, None, "int8"),
    ],
)
def test_resolve_fp8(
    mode: str, fp8: Fp8Checkpoint | None, device: torch.device, capability: tuple[int, int] | None, expected: str
) -> None:
    with mock.patch("torch.cuda.get_device_capability", return_value=capability):
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        assert resolve_quantization(mode, source(fp8), device, dtype, True) == expected


def test_fp8_is_refused_where_it_cannot_run() -> None:
    with (
        mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)),
        pytest.raises(ValueError, match=r"--quantization fp8: needs a GPU with e4m3 tensor cores .* not 8\.0"),
    ):
        resolve_quantization("fp8", source(), CUDA, torch.bfloat16, True)
    with pytest.raises(ValueError, match="--quantization fp8: needs triton"):
        resolve_quantization("fp8", source(), CUDA, torch.bfloat16, False)


FP4 = {"num_bits": 4, "type": "float", "strategy": "group"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not read"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "block size"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": FP4}}}, "not 8-bit floats"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "only float-quantized"),
    ],
)
def test_other_quantizations_are_refused(config: dict[str, Any], message: str) -> None:
    """(Integer ones, GPTQ's, AWQ's and compressed-tensors', are `loader.int_checkpoint`'s: tests/unit/
    test_int_checkpoints.py.)"""
    with pytest.raises(ValueError, match=message):
        fp8_checkpoint({"quantization_config": config})
    assert fp8_checkpoint({"quantization_config": {"quant_method": "awq", "bits": 4}}) is None


# --- FP8 checkpoints ----------------------------------------------------------------------------------------

LAYOUTS = {
    # DeepSeek / Qwen3-FP8: weight_scale_inv per block (here 32 x 48: rows of every shard on whole blocks, the
    # 64 and 96 columns partial), activations dynamic.
    "blockwise": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 48]},
    # llm-compressor's FP8_DYNAMIC: weight_scale [N, 1] per channel, the LM head left float.
    "channel": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }},
    },
    # llm-compressor's static FP8: one scale per tensor, with input_scale (read past).
    "tensor": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        }},
    },
}  # fmt: skip


def write_fp8_checkpoint(float_folder: Path, folder: Path, layout: str) -> dict[str, torch.Tensor]:
    """`float_folder`'s model with its decoder's linear weights in FP8 (`layout`) saved to `folder` (config with the
    quantization_config, tokenizer); returns the float weights the FP8 ones stand for (dequantized)."""
    folder.mkdir()
    for file in float_folder.iterdir():
        if not file.name.endswith(".safetensors") and file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((float_folder / "config.json").read_text())
    config["quantization_config"] = LAYOUTS[layout]
    (folder / "config.json").write_text(json.dumps(config))
    stored: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(float_folder / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        if not name.endswith(tuple(f"{linear}.weight" for linear in LINEARS)):
            stored[name] = dequantized[name] = tensor
            continue
        if layout == "blockwise":
            block = tuple(LAYOUTS[layout]["weight_block_size"])
            qs, scale = reference.fp8_quantize_blocks(tensor, block)  # type: ignore[arg-type]
            stored[f"{prefix}.weight_scale_inv"] = scale
            dequantized[name] = reference.fp8_dequantize(qs, scale, block)  # type: ignore[arg-type]
        elif layout == "channel":
            qs, scale = reference.fp8_quantize_per_channel(tensor)
            stored[f"{prefix}.weight_scale"] = scale
            dequantized[name] = reference.fp8_dequantize(qs, scale)
        else:
            scale = (tensor.abs().amax() / reference.FP8_MAX).reshape(1)
            qs = reference.to_fp8(tensor / scale)
            stored[f"{prefix}.weight_scale"] = scale
            stored[f"{prefix}.input_scale"] = torch.tensor([0.05])
            dequantized[name] = reference.fp8_dequantize(qs, scale)
        stored[name] = qs
    # Two shards, a layer's weight and its scale in different ones.
    names = sorted(stored)
    save_file({n: stored[n].contiguous() for n in names[::2]}, folder / "model-00001-of-00002.safetensors")
    save_file({n: stored[n].contiguous() for n in names[1::2]}, folder / "model-00002-of-00002.safetensors")
    return dequantized


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (tests/families.py) with a clear next token (`head_spread`)."""
    return save_family(tmp_path_factory.mktemp("llama-float"), "llama", head_spread=1.0)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checkpoint(
    request: pytest.FixtureRequest, float_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path, dict[str, torch.Tensor]]:
    """(layout, the FP8 folder, a float folder of its dequantized weights, those weights)."""
    return fp8_and_float_folders(float_folder, tmp_path_factory.mktemp(f"fp8-{request.param}"), request.param)


def fp8_and_float_folders(
    float_folder: Path, root: Path, layout: str
) -> tuple[str, Path, Path, dict[str, torch.Tensor]]:
    """`write_fp8_checkpoint` of `float_folder` to `root / "fp8"`, and its dequantized weights saved as a float model
    to `root / "dequantized"`: (layout, those two folders, the dequantized weights)."""
    dequantized = write_fp8_checkpoint(float_folder, root / "fp8", layout)
    plain = root / "dequantized"
    plain.mkdir()
    for file in float_folder.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            (plain / file.name).write_bytes(file.read_bytes())
    save_file({n: t.contiguous() for n, t in dequantized.items()}, plain / "model.safetensors")
    return layout, root / "fp8", plain, dequantized


def engine(folder: Path, quantization: str) -> LLM:
    config = EngineConfig(model=str(folder), device="cpu", quantization=quantization,  # type: ignore[arg-type]
                          cache=CacheConfig(memory_bytes=64 * 1024**2))  # fmt: skip
    return LLM(config=config)


PROMPTS = [[17, 3000, 45, 902, 12], [5, 77], [40000, 123, 9, 9, 9, 801, 2024, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# FP8 served against the float model on the same values, on the small random model (see the served test).
MIN_TOP1, MAX_MEAN_KL = 0.9, 0.3


@pytest.mark.slow  # engines on a saved model
def test_the_checkpoint_loads_dequantized(checkpoint: tuple[str, Path, Path, dict[str, torch.Tensor]]) -> None:
    layout, folder, plain, dequantized = checkpoint
    source = resolve_model(str(folder))
    assert source.fp8 is not None and source.fp8.block == ((32, 48) if layout == "blockwise" else None)
    weights = dict(source.weights())
    assert weights.keys() == dequantized.keys() == source.weight_shapes().keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, dequantized[name]), name
    lazy = {name: t if isinstance(t, torch.Tensor) else t.materialize() for name, t in source.lazy_weights()}
    assert all(torch.equal(lazy[name], tensor) for name, tensor in dequantized.items())
    theirs = hf_greedy(load_reference(plain), PROMPTS[:1], 12) + hf_greedy(load_reference(plain), PROMPTS[1:2], 12)
    with engine(folder, "auto") as llm:  # the CPU serves an FP8 checkpoint dequantized by default
        assert llm.core.runner.quantization == "none"
        results = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [r.choices[0].token_ids for r in results] == theirs


@pytest.mark.slow  # engines on a saved model
def test_the_checkpoint_is_served_in_fp8_as_stored(
    checkpoint: tuple[str, Path, Path, dict[str, torch.Tensor]],
) -> None:
    """Every projection an `Fp8Linear` of the checkpoint's own values (per tensor too: not quantized again per
    channel), the LM head float; its output close to the float model's on the same values, the difference being
    the activations' rounding to e4m3."""
    layout, folder, plain, dequantized = checkpoint
    with engine(folder, "fp8") as llm:
        model = llm.core.runner.model
        layers = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
        assert len(layers) == 4 * 4 and not isinstance(model.lm_head, Fp8Linear)
        assert {m.format for m in layers.values()} == {"fp8_block" if layout == "blockwise" else "fp8"}
        attention = model.model.layers[1].self_attn
        fused = torch.cat([dequantized[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(_dense_weight(attention.qkv_proj), fused)
        assert torch.equal(_dense_weight(attention.o_proj), dequantized["model.layers.1.self_attn.o_proj.weight"])
        with engine(plain, "none") as float_llm:
            sequences, log_probs = reference_of(float_llm, QUALITY_PROMPTS[:4], 16)
        result = compare(log_probs, llm, layout, QUALITY_PROMPTS[:4], 16, sequences, free_running=False)
    # This random model's next-token distributions are sharper than a trained one's (`head_spread`), so the same
    # rounding moves its KL further (a position or two near a tie dominate it): measured 0.97-0.98 top-1 and
    # 0.02-0.17 mean KL here. The embedded model's figures are `ladle bench quality`'s (docs/models.md, FP8 weights).
    assert result.top1_agreement >= MIN_TOP1 and result.mean_kl <= MAX_MEAN_KL, result


@pytest.mark.slow  # an engine on a saved model
def test_a_multimodal_fp8_checkpoints_text_model_is_served_as_stored(tmp_path: Path) -> None:
    """Ministral 3's, Mistral Small 3.1's and Qwen3.5's FP8 releases are multimodal checkpoints, the text model's
    weights under `language_model.` (as released, and as transformers saves them): each of its projections is an
    `Fp8Linear` of the checkpoint's own blocks, not dequantized and quantized again per channel; the vision tower
    (quantized here too) is not read."""
    import transformers

    from tests.families import _SHAPE, FAMILIES, draw_language_model
    from tests.unit.pooling.embedding_models import copy_tokenizer

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 16, "image_size": 28, "patch_size": 14}  # fmt: skip
    text = {**_SHAPE, **FAMILIES["ministral3"][1], "model_type": "ministral3"}
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    draw_language_model(model)
    model.save_pretrained(tmp_path / "float")
    copy_tokenizer(tmp_path / "float")
    dequantized = write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "blockwise")
    with engine(tmp_path / "fp8", "fp8") as llm:
        served = llm.core.runner.model
        layers = {name: m for name, m in served.named_modules() if isinstance(m, Fp8Linear)}
        assert len(layers) == 4 * 4 and {m.format for m in layers.values()} == {"fp8_block"}
        attention = served.model.layers[1].self_attn
        stored = "language_model.model.layers.1.self_attn.o_proj.weight"
        assert torch.equal(_dense_weight(attention.o_proj), dequantized[stored])
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].choices[0].token_ids


@pytest.mark.slow  # an engine on a saved model
def test_a_qwen2_5_vl_fp8_checkpoints_text_model_is_served_as_stored(tmp_path: Path) -> None:
    """Qwen2.5-VL's FP8 releases are multimodal checkpoints of the kinds `hf_multimodal` reads (the text model under
    `model.` beside `visual.`, as released and as transformers saves it): each of its projections is an `Fp8Linear`
    of the checkpoint's own blocks, its vision tower (quantized here too) not read."""
    from tests.unit.test_multimodal_text_models import _multimodal, _saved

    _saved(_multimodal("qwen2_5_vl"), tmp_path / "float")
    dequantized = write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", "blockwise")
    with engine(tmp_path / "fp8", "fp8") as llm:
        served = llm.core.runner.model
        layers = {name: m for name, m in served.named_modules() if isinstance(m, Fp8Linear)}
        assert len(layers) == 4 * 4 and {m.format for m in layers.values()} == {"fp8_block"}
        stored = "model.layers.1.self_attn.o_proj.weight"
        assert torch.equal(_dense_weight(served.model.layers[1].self_attn.o_proj), dequantized[stored])
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].choices[0].token_ids


@pytest.mark.slow  # engines on a saved model
def test_fp8_rows_the_model_reorders_at_load_are_quantized_again_in_its_order(tmp_path: Path) -> None:
    """GLM-4's checkpoints hold each head's rope pairs interleaved, which loading reads in halves order
    (`models.interleaved_rope`): an FP8 checkpoint's q and k rows are dequantized, reordered and quantized again per
    channel (taken as stored they were served in the checkpoint's order: each head's scores scrambled), its other
    projections served as stored; the output stays close to the float model's on the same values."""
    float_glm = save_family(tmp_path / "float", "glm4", head_spread=1.0)
    _, folder, plain, dequantized = fp8_and_float_folders(float_glm, tmp_path, "blockwise")
    with engine(folder, "fp8") as llm:
        layers = llm.core.runner.model.model.layers
        assert {layer.self_attn.qkv_proj.format for layer in layers} == {"fp8"}
        assert {layer.self_attn.o_proj.format for layer in layers} == {"fp8_block"}
        o_proj = dequantized["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(_dense_weight(layers[1].self_attn.o_proj), o_proj)
        config = llm.core.model_config
        q, k, v = (dequantized[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
        halves = [reference.unpermute_rope_rows(w, n, config.rotary_dim)
                  for w, n in ((q, config.num_attention_heads), (k, config.num_key_value_heads))]  # fmt: skip
        expected = reference.fp8_dequantize(*reference.fp8_quantize_per_channel(torch.cat([*halves, v])))
        assert torch.equal(_dense_weight(layers[1].self_attn.qkv_proj), expected)  # each row's, in the load order
        with engine(plain, "none") as float_llm:
            sequences, log_probs = reference_of(float_llm, QUALITY_PROMPTS[:4], 16)
        result = compare(log_probs, llm, "fp8", QUALITY_PROMPTS[:4], 16, sequences, free_running=False)
    assert result.top1_agreement >= MIN_TOP1 and result.mean_kl <= MAX_MEAN_KL, result


@pytest.mark.slow  # engines on a saved model
def test_a_float_model_is_quantized_per_channel_at_load(float_folder: Path) -> None:
    with engine(float_folder, "none") as float_llm:
        sequences, log_probs = reference_of(float_llm, QUALITY_PROMPTS[:4], 16)
    with engine(float_folder, "fp8") as llm:
        formats = {m.format for m in llm.core.runner.model.modules() if isinstance(m, Fp8Linear)}
        result = compare(log_probs, llm, "fp8", QUALITY_PROMPTS[:4], 16, sequences, free_running=False)
    assert formats == {"fp8"}
    assert result.top1_agreement >= MIN_TOP1 and result.mean_kl <= MAX_MEAN_KL, result


def _dense_weight(layer: Any) -> torch.Tensor:
    """The float values an `Fp8Linear` on the CPU multiplies by (its dense layer, MKL-packed or not)."""
    assert isinstance(layer, Fp8Linear) and layer.dense is not None
    dense = layer.dense
    if hasattr(dense, "packed_weight"):  # packed: its weight was let go; unpack by multiplying the identity
        eye = torch.eye(layer.in_features)
        return dense(eye).T.contiguous()
    return dense.weight.detach()


# --- FP8 mixtures of experts --------------------------------------------------------------------------------


MOE_MIN_TOP1, MOE_MAX_MEAN_KL = 0.75, 1.0  # (test_an_fp8_mixture_of_experts_is_served_as_stored)


@pytest.fixture(scope="module", params=[("qwen3-moe", "channel"), ("qwen3-moe", "blockwise"), ("mixtral", "channel")])
def moe_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path, dict[str, torch.Tensor]]:
    """A small random Qwen3-MoE (8 experts, top 3, one dense layer) or Mixtral (4 experts, top 2; its experts named
    w1 / w3 / w2) with every projection, its experts' included, in FP8 (`fp8_and_float_folders`); the routers
    stay float, as FP8 MoE checkpoints keep them."""
    family, layout = request.param
    float_moe = save_family(tmp_path_factory.mktemp(f"{family}-float"), family, head_spread=1.0)
    return fp8_and_float_folders(float_moe, tmp_path_factory.mktemp(f"{family}-fp8-{layout}"), layout)


@pytest.mark.slow  # engines on a saved model
def test_an_fp8_mixture_of_experts_is_served_as_stored(
    moe_checkpoint: tuple[str, Path, Path, dict[str, torch.Tensor]],
) -> None:
    """Every bank an `Fp8Experts` holding the checkpoint's own values (each expert's gate rows then its up rows, its
    down), in the checkpoint's layout; the routers float; the output near the float model on the same values.

    Near, on these random MoEs, is looser than the Llama's bound: rounding the activations alone can flip a token's
    experts where the router's top-k is near a tie, and a random expert then moves the logits a lot (measured: the
    Qwen3-MoE 0.94-0.97 top-1 and 0.13-0.15 mean KL, the Mixtral 0.84 and 0.44). A wrong expert, part or scale lands far
    below (the bank's values are checked exactly above)."""
    layout, folder, plain, dequantized = moe_checkpoint
    with engine(folder, "fp8") as llm:
        model = llm.core.runner.model
        banks = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Experts)}
        sparse_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]
        assert sorted(banks) == [f"model.layers.{i}.mlp.experts" for i in sparse_layers] and sparse_layers
        assert {bank.format for bank in banks.values()} == {"fp8_block" if layout == "blockwise" else "fp8"}
        assert not any(isinstance(model.model.layers[i].mlp.gate, Fp8Linear) for i in sparse_layers)
        layer = sparse_layers[-1]
        bank = banks[f"model.layers.{layer}.mlp.experts"]
        mixtral = f"model.layers.{layer}.block_sparse_moe.experts.0.w1.weight" in dequantized
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for expert in (0, bank.num_experts - 1):
            prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts.{expert}"
            gate_up = torch.cat([dequantized[f"{prefix}.{name}.weight"] for name in names[:2]])
            assert torch.equal(bank.w13[expert], gate_up)
            assert torch.equal(bank.w2[expert], dequantized[f"{prefix}.{names[2]}.weight"])
        with engine(plain, "none") as float_llm:
            sequences, log_probs = reference_of(float_llm, QUALITY_PROMPTS[:4], 16)
        result = compare(log_probs, llm, layout, QUALITY_PROMPTS[:4], 16, sequences, free_running=False)
    assert result.top1_agreement >= MOE_MIN_TOP1 and result.mean_kl <= MOE_MAX_MEAN_KL, result


@pytest.mark.slow  # engines on a saved model
@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v32"])
def test_a_latent_attention_checkpoint_in_fp8(tmp_path: Path, family: str) -> None:
    """DeepSeek-V3's and V3.2's block-wise FP8 checkpoints (tests/families.py's small ones, every projection in e4m3,
    as DeepSeek releases them: V3.2's indexer's too): served in FP8 as stored, but for `kv_b_proj`, which latent
    attention absorbs into its queries and outputs (layers.mla): that one is read dequantized, its float weight
    exactly the stored values times their scales. By default the CPU loads the whole checkpoint dequantized, greedy
    as the float model on those values is.

    No closeness bound against that float model here: this random MoE flips experts at near-ties under any
    rounding (int8 at load: top-1 0.88, mean KL 0.4-1.2, max 38), so a bound loose enough for it would say
    nothing. The exact checks above it are what catch a wrong layout or scale."""
    float_model = save_family(tmp_path / "float", family, head_spread=1.0)
    (tmp_path / "fp8").mkdir()
    _, folder, plain, dequantized = fp8_and_float_folders(float_model, tmp_path / "fp8", "blockwise")
    prefix = "model.layers.1.self_attn"
    projections = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]
    if family == "deepseek-v32":
        projections += ["indexer.wq_b", "indexer.wk", "indexer.weights_proj"]
    with engine(folder, "fp8") as llm:
        attention = llm.core.runner.model.get_submodule(prefix)
        assert torch.equal(attention.kv_b_proj.weight, dequantized[f"{prefix}.kv_b_proj.weight"])
        for name in projections:
            projection = attention.get_submodule(name)
            assert isinstance(projection, Fp8Linear) and projection.format == "fp8_block", name
            assert torch.equal(_dense_weight(projection), dequantized[f"{prefix}.{name}.weight"]), name
        assert all(r.choices[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with engine(plain, "none") as float_llm:
        float_greedy = [r.choices[0].token_ids for r in float_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with engine(folder, "auto") as llm:
        assert [r.choices[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == float_greedy


@pytest.mark.slow  # engines on a saved model
def test_a_float_mixture_of_experts_is_quantized_at_load_as_a_per_channel_checkpoint_stores_it(tmp_path: Path) -> None:
    """Under `--quantization fp8` a float MoE's projections and banks are quantized per channel at load: exactly the
    model an llm-compressor-style per-channel checkpoint of the same weights serves (greedy log-probabilities
    equal). Against the float model this random MoE moves more than the Llama does (a rounding can flip a token's
    experts where the router's top-k is near a tie): measured 0.83-0.86 top-1, so only the identity is asserted."""
    folder = save_family(tmp_path / "moe", "qwen3-moe", head_spread=1.0)
    (tmp_path / "checkpoint").mkdir()
    _, checkpoint_folder, _, _ = fp8_and_float_folders(folder, tmp_path / "checkpoint", "channel")
    served = {}
    for name, path in (("at load", folder), ("checkpoint", checkpoint_folder)):
        with engine(path, "fp8") as llm:
            modules = list(llm.core.runner.model.modules())
            assert {m.format for m in modules if isinstance(m, Fp8Linear | Fp8Experts)} == {"fp8"}
            assert any(isinstance(m, Fp8Experts) for m in modules)
            assert not any(isinstance(m, ParallelExperts) for m in modules)
            served[name] = reference_of(llm, QUALITY_PROMPTS[:4], 16)
    assert served["at load"][0] == served["checkpoint"][0]
    for at_load, stored in zip(served["at load"][1], served["checkpoint"][1], strict=True):
        assert torch.equal(at_load, stored)


@pytest.mark.slow  # engines on a saved model, two ranks
def test_fp8_experts_under_tensor_parallelism(tmp_path: Path) -> None:
    """At TP=2 each rank quantizes its slice of every expert (half of the intermediate rows of gate/up, half of
    down's columns, each output channel scaled over its slice) and of the shared expert; the block all-reduces as
    at TP=1. Its output stays near the float model's as TP=1's does (this Qwen2-MoE, measured: top-1 1.0 at both
    sizes, mean KL 0.009 at TP=2 and 0.028 at TP=1)."""
    folder = save_family(tmp_path / "moe", "qwen2-moe", head_spread=1.0)
    with engine(folder, "none") as float_llm:
        sequences, log_probs = reference_of(float_llm, QUALITY_PROMPTS[:4], 16)
    config = EngineConfig(model=str(folder), device="cpu", quantization="fp8", tensor_parallel_size=2,
                          cache=CacheConfig(memory_bytes=64 * 1024**2))  # fmt: skip
    with LLM(config=config) as llm:
        banks = [m for m in llm.core.runner.model.modules() if isinstance(m, Fp8Experts)]
        assert banks and all(bank.w13.shape[1] == 32 and bank.w2.shape[2] == 16 for bank in banks)  # 16 rows a rank
        result = compare(log_probs, llm, "fp8 tp2", QUALITY_PROMPTS[:4], 16, sequences, free_running=False)
    assert result.top1_agreement >= MIN_TOP1 and result.mean_kl <= MAX_MEAN_KL, result


@pytest.mark.slow  # an engine on a saved model
def test_experts_whose_blocks_straddle_gate_and_up_are_quantized_again_per_channel(tmp_path: Path) -> None:
    """Experts of 40 rows in a checkpoint of 32 x 48 blocks: a block would straddle an expert's gate and up rows, so
    its gate/up is quantized again per channel (`concat_fp8_rows`), and its down with it (a bank takes one layout):
    each the per-channel rounding of the checkpoint's own values."""
    folder = save_family(tmp_path / "moe", "qwen3-moe", head_spread=1.0, moe_intermediate_size=40)
    (tmp_path / "checkpoint").mkdir()
    _, fp8_folder, _, dequantized = fp8_and_float_folders(folder, tmp_path / "checkpoint", "blockwise")
    with engine(fp8_folder, "fp8") as llm:
        bank = llm.core.runner.model.model.layers[0].mlp.experts
        assert isinstance(bank, Fp8Experts) and bank.format == "fp8"
        prefix = "model.layers.0.mlp.experts.7"
        gate_up = torch.cat([dequantized[f"{prefix}.{part}_proj.weight"] for part in ("gate", "up")])
        assert torch.equal(bank.w13[7], quantize_fp8(gate_up).dequantize())
        assert torch.equal(bank.w2[7], quantize_fp8(dequantized[f"{prefix}.down_proj.weight"]).dequantize())


@pytest.mark.slow  # engines on a saved model
def test_an_fp8_mixture_of_experts_loads_dequantized_by_default_on_the_cpu(
    moe_checkpoint: tuple[str, Path, Path, dict[str, torch.Tensor]],
) -> None:
    """`auto` on the CPU reads the checkpoint's experts dequantized (each e4m3 value times its scale), as its dense
    layers: the same greedy tokens as the float model saved with those values."""
    _, folder, plain, _ = moe_checkpoint
    with engine(folder, "auto") as llm:
        assert llm.core.runner.quantization == "none"
        ours = [r.choices[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with engine(plain, "none") as float_llm:
        theirs = [r.choices[0].token_ids for r in float_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ours == theirs


@pytest.mark.slow  # engines on a saved model
def test_an_fp8_mimo_v2_flash_checkpoint_pads_its_values_after_dequantizing_them(tmp_path: Path) -> None:
    """MiMo-V2-Flash is released in FP8 blocks: on the float path it is the model of its dequantized weights, token
    for token (each head's values scaled and padded to the keys' width after they are dequantized); served as FP8,
    its q/k/v and o_proj, which loading pads, are quantized again per channel in the padded layout (o_proj: exactly
    the per-channel quantization of its dequantized, padded columns), its MLPs served as stored. (Its output is not
    held to the quality thresholds here: this random model's routing, as GLM-4.5's under the same test, turns on
    e4m3's noise.)"""
    float_mimo = save_family(tmp_path / "float", "mimo-v2-flash", head_spread=1.0)
    _, folder, plain, dequantized = fp8_and_float_folders(float_mimo, tmp_path, "blockwise")
    batch = [prompt[:6] for prompt in PROMPTS]
    with engine(plain, "none") as float_llm:
        theirs = [r.choices[0].token_ids for r in float_llm.generate(batch, GREEDY, use_tqdm=False)]
    with engine(folder, "none") as llm:
        assert [r.choices[0].token_ids for r in llm.generate(batch, GREEDY, use_tqdm=False)] == theirs
    with engine(folder, "fp8") as llm:
        config, layers = llm.core.model_config, llm.core.runner.model.model.layers
        attention = layers[1].self_attn
        assert (attention.qkv_proj.format, attention.o_proj.format) == ("fp8", "fp8")
        assert layers[0].mlp.gate_up_proj.format == "fp8_block"
        heads, width, values = config.num_attention_heads, config.head_dim, config.value_head_dim
        o_proj = dequantized["model.layers.1.self_attn.o_proj.weight"].reshape(-1, heads, values)
        zeros = torch.zeros(o_proj.shape[0], heads, width - values)
        padded = torch.cat([o_proj, zeros], dim=-1).reshape(-1, heads * width)
        expected = reference.fp8_dequantize(*reference.fp8_quantize_per_channel(padded))
        assert torch.equal(_dense_weight(attention.o_proj), expected)


@pytest.mark.slow  # engines on a saved model
def test_a_minimax_m3_checkpoint_in_fp8(tmp_path: Path) -> None:
    """MiniMax-M3's block-wise FP8 checkpoint (tests/families.py's small one, its attention's and its indexer's
    projections in e4m3 as a released FP8 checkpoint stores them): served in FP8 as stored, the indexer's query and
    key projections too (their dense weights exactly the stored values times their scales); by default the CPU loads
    it dequantized, greedy as the float model on those values is."""
    float_model = save_family(tmp_path / "float", "minimax-m3", head_spread=1.0)
    (tmp_path / "fp8").mkdir()
    _, folder, plain, dequantized = fp8_and_float_folders(float_model, tmp_path / "fp8", "blockwise")
    prefix = "model.layers.1.self_attn"
    with engine(folder, "fp8") as llm:
        attention = llm.core.runner.model.get_submodule(prefix)
        for name in ("indexer.q_proj", "indexer.k_proj", "o_proj"):
            projection = attention.get_submodule(name)
            assert isinstance(projection, Fp8Linear), name
            assert torch.equal(_dense_weight(projection), dequantized[f"{prefix}.{name}.weight"]), name
        assert all(r.choices[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with engine(plain, "none") as float_llm:
        float_greedy = [r.choices[0].token_ids for r in float_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with engine(folder, "auto") as llm:
        assert [r.choices[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == float_greedy
