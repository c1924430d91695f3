"""BitNet b1.58's ternary checkpoints (`quantization_config` quant_method "bitnet"): the paged model's logits equal
transformers' BitNet with its own quantized layers (`BitLinear`: packed uint8 weights divided by their scale;
`AutoBitLinear`: ternary weights times their scale, or float ones ternarized online), every projection's input
rounded to int8 per token; the packing read as transformers writes it."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.integrations.bitnet import pack_weights, replace_with_bitnet_linear

from engine_server.attention_metadata import AttentionMetadata, allocate_kv_cache
from engine_server.hf_config import model_config_from_hf
from engine_server.models import get_model_class
from engine_server.models.bitnet import unpack_ternary

BLOCK = 4
SHAPE: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             pad_token_id=0)  # fmt: skip
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _float_model() -> transformers.BitNetForCausalLM:
    torch.manual_seed(0)
    model = transformers.BitNetForCausalLM(transformers.BitNetConfig(**SHAPE)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _ternary(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ternary values, transformers' scale `1 / mean|w|`) of a float weight."""
    scale = 1.0 / weight.abs().mean().clamp(min=1e-5)
    return (weight * scale).round().clamp(-1, 1), scale


def _checkpoint(model: torch.nn.Module, form: str) -> dict[str, torch.Tensor]:
    """`model`'s float state as a BitNet checkpoint of `form` stores it."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if form == "online" or not name.endswith(tuple(f"{p}.weight" for p in _PROJECTIONS)):
            state[name] = tensor
            continue
        values, scale = _ternary(tensor)
        stem = name.removesuffix(".weight")
        if form == "packed":
            state |= {f"{stem}.weight": pack_weights(values.clone()), f"{stem}.weight_scale": scale.reshape(1)}
        else:
            state |= {f"{stem}.weight": values, f"{stem}.weight_scale": (1 / scale).reshape(1)}
    return state


def _theirs(model: torch.nn.Module, state: dict[str, torch.Tensor], form: str) -> torch.nn.Module:
    """transformers' model of `form` (its own quantized layers), holding `state`."""
    quantization = transformers.BitNetQuantConfig(
        linear_class="bitlinear" if form == "packed" else "autobitlinear",
        quantization_mode="online" if form == "online" else "offline",
    )  # fmt: skip
    theirs = copy.deepcopy(model)
    replace_with_bitnet_linear(theirs, modules_to_not_convert=["lm_head"], quantization_config=quantization)
    theirs.load_state_dict(state, strict=True, assign=True)
    return theirs.eval()


def _ours(state: dict[str, torch.Tensor], form: str) -> torch.nn.Module:
    quantization = {"quant_method": "bitnet", "linear_class": "bitlinear" if form == "packed" else "autobitlinear",
                    "quantization_mode": "online" if form == "online" else "offline"}  # fmt: skip
    config = model_config_from_hf({**SHAPE, "model_type": "bitnet", "quantization_config": quantization})
    assert config.ternary_projections == form and config.sub_norms
    model = get_model_class("bitnet")(config)
    model.load_weights(state.items())
    return model.eval()


def _paged_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    caches = allocate_kv_cache(model.config, 32, BLOCK, torch.float32, "cpu")
    table = list(range(1, 1 + -(-len(tokens) // BLOCK)))
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [table], BLOCK, "cpu")
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)), caches, meta))


@pytest.mark.parametrize("form", ["packed", "scaled", "online"])
def test_ternary_checkpoints_equal_transformers_bitnet(form: str) -> None:
    model = _float_model()
    state = _checkpoint(model, form)
    tokens = [random.Random(form).randrange(3, 128) for _ in range(23)]
    with torch.inference_mode():
        theirs = _theirs(model, state, form)(torch.tensor([tokens])).logits[0].float()
        float_logits = model(torch.tensor([tokens])).logits[0].float()
    ours = _paged_logits(_ours(state, form), tokens)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert (ours - float_logits).abs().max() > 1e-2  # (the ternary model is another model than the float one)


def test_packed_weights_unpack_as_transformers_packs_them() -> None:
    values = torch.randint(-1, 2, (12, 5)).float()
    assert torch.equal(unpack_ternary(pack_weights(values.clone())), values)


def test_what_bitnet_does_not_build_is_refused_by_name() -> None:
    for quantization, message in (({"quant_method": "gptq"}, "quant_method"),
                                  ({"quant_method": "bitnet", "use_rms_norm": True}, "use_rms_norm")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**SHAPE, "model_type": "bitnet", "quantization_config": quantization})
    with pytest.raises(ValueError, match="hidden_act"):
        model_config_from_hf({**SHAPE, "model_type": "bitnet", "hidden_act": "silu"})


def test_a_packed_checkpoint_folder_serves_transformers_greedy_tokens(tmp_path: Path) -> None:
    """A packed BitNet checkpoint saved as a folder (its `quantization_config` in config.json) is served by the
    engine (`auto`: the ternary values as float, every projection's input rounded) with transformers' greedy
    tokens, alone and batched."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import CacheConfig, EngineConfig

    folder, prompts, expected = _saved_packed(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = EngineConfig(model=str(folder), device="cpu", cache=CacheConfig(memory_bytes=1 << 24))
    with LLM(config=engine) as llm:
        alone = [llm.generate([prompt], greedy, use_tqdm=False)[0].choices[0].token_ids for prompt in prompts]
        batched = [result.choices[0].token_ids for result in llm.generate(prompts, greedy, use_tqdm=False)]
    assert alone == batched == expected


def _saved_packed(tmp_path: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A packed BitNet checkpoint saved to `tmp_path` with the embedded tokenizer: (folder, three prompts,
    transformers' 12 greedy tokens for each)."""
    from safetensors.torch import save_file

    from tests.unit.pooling.embedding_models import copy_tokenizer

    model = _float_model()
    state = _checkpoint(model, "packed")
    theirs = _theirs(model, state, "packed")
    config = transformers.BitNetConfig(**SHAPE).to_dict()
    config["quantization_config"] = {"quant_method": "bitnet", "linear_class": "bitlinear",
                                     "quantization_mode": "offline"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["BitNetForCausalLM"]}))
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, tmp_path / "model.safetensors")
    copy_tokenizer(tmp_path)
    prompts = [[random.Random(i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((9, 30, 2))]
    expected = []
    for prompt in prompts:
        with torch.inference_mode():
            ids = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                  pad_token_id=0)  # fmt: skip
        expected.append(ids[0, len(prompt) :].tolist())
    return tmp_path, prompts, expected


def test_a_packed_checkpoint_on_int8_is_batch_invariant_and_keeps_most_tokens(tmp_path: Path) -> None:
    """On `--quantization int8` a packed BitNet's ternary weights are int8 groups (exact but for their float16
    scales) and each projection's int8-rounded input is rounded again per 32-wide group by the kernel: each prompt's
    tokens are the same alone and batched, and most of transformers' first tokens are kept."""
    from engine_server import LLM, SamplingParams
    from engine_server.config import CacheConfig, EngineConfig
    from engine_server.layers.quantized_linear import QuantizedLinear

    folder, prompts, expected = _saved_packed(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = EngineConfig(model=str(folder), device="cpu", quantization="int8", cache=CacheConfig(memory_bytes=1 << 24))
    with LLM(config=engine) as llm:
        layer = llm.core.runner.loaded.model.model.layers[0]
        assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear) and layer.self_attn.int8_inputs
        alone = [llm.generate([prompt], greedy, use_tqdm=False)[0].choices[0].token_ids for prompt in prompts]
        batched = [result.choices[0].token_ids for result in llm.generate(prompts, greedy, use_tqdm=False)]
    assert alone == batched
    assert sum(ours[0] == theirs[0] for ours, theirs in zip(alone, expected, strict=True)) >= 2
