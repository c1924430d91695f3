"""The recurrent hybrids' GGUF files other than Gated DeltaNet's (tests/unit/test_family_gguf.py has those): LFM2's
and LFM2-MoE's short convolutions (`lfm2`, `lfm2moe`), Granite 4.0's Mamba-2 (`granitehybrid`) and the Granite
families llama.cpp writes beside it (`granitemoe`, `granite`), Nemotron-H's (`nemotron_h`) and Falcon-H1's
(`falcon-h1`), each written as
llama.cpp's converter writes it (`tests.families.write_gguf`; scripts/check_gguf_writer.py has llama.cpp read such
files): converted, the config and every tensor are the checkpoint's and the float path equals transformers token for
token; served from its blocks, it holds `ladle bench quality`'s thresholds, and over two ranks each rank's rows come
from the blocks bit for bit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from engine_server.config import FalconH1Scales
from engine_server.hf_config import model_config_from_hf
from engine_server.hf_mamba import MAX_POSITIONS
from engine_server.loader import resolve_model
from engine_server.loader.gguf_metadata import hf_config_from_gguf
from tests.families import save_family, write_gguf
from tests.unit.test_family_engines import reference_tokens
from tests.unit.test_family_gguf import (
    converted_reference_tokens,
    exact_then_served,
    float_reference,
    keep_stored_weights,
    metadata_gguf,
    served_candidate,
    served_from_blocks,
    written_and_converted,
)

pytestmark = pytest.mark.slow  # engines, conversions and transformers' models of their own


def served_whole_and_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, **overrides: Any
) -> tuple[Path, dict[str, str], Any, Any, dict[str, Any]]:
    """`exact_then_served`, then the file served from its blocks over two ranks against the same float reference:
    (the file, the layers' formats, the comparison at one rank, at two, rank 0's stored weights at two)."""
    gguf, expected = written_and_converted(tmp_path, family, **overrides)
    reference = float_reference(gguf, expected)
    layers, result = served_candidate(gguf, reference)
    stored = keep_stored_weights(monkeypatch)
    _, split = served_candidate(gguf, reference, tensor_parallel_size=2)
    return gguf, layers, result, split, stored


def test_an_lfm2_moe_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """An LFM2-MoE file (`lfm2moe`): LFM2's layers, then its experts' banks, router and routing bias (`exp_probs_b`)
    after `leading_dense_block_count` dense layers, routed by sigmoid: converted, it is the saved model and its float
    path equals transformers token for token; served from its blocks (the experts' Q4_0 banks in the C++ expert
    kernel), it holds the thresholds."""
    _, layers, result = exact_then_served(tmp_path, "lfm2-moe")
    assert layers["model.layers.0.mlp.gate_up_proj"] == "q4" and layers["model.layers.0.self_attn.in_proj"] == "q8"
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q4_32"] * 3, layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


def test_an_lfm2_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An LFM2 file as llama.cpp's converter writes it (`lfm2`: no KV heads on the convolution layers, the
    convolution squeezed to `[channels, taps]`, the final norm as `token_embd_norm`, the MLP's adjusted width):
    converted, its config is the saved model's, every tensor comes back and the float path equals transformers token
    for token; served from its blocks (each convolution layer's B, C and x rows one Q8_0 matrix), it holds `ladle
    bench quality`'s thresholds. Over two ranks, rank 0's rows of B, C and x (the first half of each) are the
    converted weights' bit for bit."""
    gguf, layers, result, split, stored = served_whole_and_split(tmp_path, monkeypatch, "lfm2")
    assert layers["model.layers.0.self_attn.in_proj"] == "q8" and layers["model.layers.0.self_attn.out_proj"] == "q8"
    assert layers["model.layers.3.self_attn.qkv_proj"] == "q8" and layers["model.layers.0.mlp.gate_up_proj"] == "q4"
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result
    whole = dict(resolve_model(str(gguf)).weights())["model.layers.0.conv.in_proj.weight"]
    channels = whole.shape[0] // 3
    rank0 = torch.cat([part[: channels // 2] for part in whole.split(channels)])
    assert torch.equal(stored["model.layers.0.self_attn.in_proj"].dequantize(), rank0)
    assert split.top1_agreement >= 0.95 and split.mean_kl <= 0.01, split


# Granite 4.0 H (`granitehybrid`: Mamba-2 layers, attention without rope, experts beside a shared MLP), its dense form
# (the shared MLP alone), Granite 3.0's mixture of experts with a shared MLP (`granitemoe`) and Granite 3.x
# (`granite`) as llama.cpp's converter writes them: their multipliers as its scales, q/k rows permuted.
# A Granite 4.0 H file states no context (2^20, as its converter writes): read as the released models' 131,072.
GRANITE_GGUF: dict[str, dict[str, Any]] = {
    "granite4-h": {"max_position_embeddings": 131072}, "granite4-h-dense": {"max_position_embeddings": 131072},
    "granite": {}, "granitemoeshared": {},
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(GRANITE_GGUF))
def test_a_granite_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """A `granitehybrid` file (Mamba-2 tensors as `ssm_*`: `ssm_a` is `-exp(A_log)`, the convolution squeezed, the
    gated norm's weight by group; no KV heads on the Mamba-2 layers; rope off; the experts' and the shared MLP's
    fused tensors split; q/k rows permuted), with experts and without, a `granitemoe` one with a shared MLP and a
    `granite` one, their multipliers as llama.cpp's scales: converted, each config is the saved model's, every tensor
    comes back (joined again into the checkpoint's fused banks for transformers) and the float path equals
    transformers token for token; served from its blocks (Mamba-2's in_proj one Q8_0 matrix of z, x/B/C and dt
    rows; the shared MLP in Q4_0), each holds `ladle bench quality`'s thresholds."""
    if family == "granite4-h":  # also over two ranks, against the same float reference
        gguf, layers, result, split, stored = served_whole_and_split(tmp_path, monkeypatch, family,
                                                                     **GRANITE_GGUF[family])  # fmt: skip
    else:
        gguf, layers, result = exact_then_served(tmp_path, family, **GRANITE_GGUF[family])
    attention = 3 if family.startswith("granite4") else 0
    assert layers[f"model.layers.{attention}.self_attn.qkv_proj"] == "q8"
    if family.startswith("granite4"):
        assert layers["model.layers.0.self_attn.in_proj"] == layers["model.layers.0.self_attn.out_proj"] == "q8"
    if family != "granite":
        shared = "mlp.gate_up_proj" if family == "granite4-h-dense" else "mlp.shared_expert.gate_up_proj"
        assert layers[f"model.layers.0.{shared}"] == "q4", layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result
    if family == "granite4-h":  # over two ranks: rank 0's z, x and dt rows of its 2 heads, the one group's B and C
        whole = dict(resolve_model(str(gguf)).weights())["model.layers.0.mamba.in_proj.weight"]
        z, x, b, c, dt = whole.split([128, 128, 16, 16, 4])
        rank0 = torch.cat([z[:64], x[:64], b, c, dt[:2]])
        assert torch.equal(stored["model.layers.0.self_attn.in_proj"].dequantize(), rank0)
        assert split.top1_agreement >= 0.95 and split.mean_kl <= 0.01, split


# A Nemotron-H file states no context (2^20, as its converter writes): read as Nemotron Nano 2's 131,072.
NEMOTRON_H_GGUF: dict[str, Any] = {"max_position_embeddings": 131072}
# Nemotron 3's experts in one group, as released (its converter writes no count of groups used).
NEMOTRON_3_GGUF: dict[str, Any] = {**NEMOTRON_H_GGUF, "n_group": 1, "topk_group": 1}


def test_a_nemotron_h_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `nemotron_h` file as llama.cpp's converter writes it (a block per Mamba-2 layer, attention layer or MLP, each
    with its one norm `attn_norm`; Mamba-2 as Granite 4.0's `ssm_*`; KV heads and MLP widths per block, 0 elsewhere;
    q/k rows permuted; no rope, the context 2^20): converted, the config is the saved model's (blocks told apart by
    their tensors, read as the released models' 131,072 context), every tensor comes back and the float path equals
    transformers token for token; served from its blocks, the MLPs' up and down projections in Q4_0, it holds `ladle
    bench quality`'s thresholds. Over two ranks (a group of the two each), rank 0's z, x and dt rows of its 2 heads and
    its group's B and C rows are the converted weights' bit for bit."""
    gguf, layers, result, split, stored = served_whole_and_split(tmp_path, monkeypatch, "nemotron-h", **NEMOTRON_H_GGUF)
    # blocks M - M M * -: layers 0 (Mamba-2, MLP), 1 and 2 (Mamba-2), 3 (attention, MLP)
    assert layers["model.layers.0.self_attn.in_proj"] == layers["model.layers.2.self_attn.out_proj"] == "q8"
    assert layers["model.layers.3.self_attn.qkv_proj"] == "q8" and layers["model.layers.3.mlp.up_proj"] == "q4"
    assert "model.layers.1.mlp.up_proj" not in layers, layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result
    whole = dict(resolve_model(str(gguf)).weights())["backbone.layers.0.mixer.in_proj.weight"]
    z, x, b, c, dt = whole.split([128, 128, 32, 32, 4])
    rank0 = torch.cat([z[:64], x[:64], b[:16], c[:16], dt[:2]])
    assert torch.equal(stored["model.layers.0.self_attn.in_proj"].dequantize(), rank0)
    assert split.top1_agreement >= 0.95 and split.mean_kl <= 0.01, split


def test_a_nemotron_3_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A `nemotron_h_moe` file (Nemotron 3's: experts blocks, each layer's ungated experts as `ffn_up_exps` and
    `ffn_down_exps` banks, the router `ffn_gate_inp` and its bias `exp_probs_b`, the shared expert `_shexp`; one group
    of experts, as released): converted, it is the saved model and its float path equals transformers token for
    token; served from its blocks (the experts' banks in the C++ expert kernel, relu² between), it holds the
    thresholds. Its MLPs are Q8_0 here: this random model's routing (top-2 of 8 by sigmoid scores a +-0.3 bias apart,
    scaled by 2.5, relu² after) turns on 4-bit noise, 93.75% / 0.020 with Q4_0 experts, 0.004 at a scale of 1
    (the relu² kernel's Q4_0 banks: tests/unit/kernels/test_quant_moe.py)."""
    gguf, expected = written_and_converted(tmp_path, "nemotron-h-moe", GGMLQuantizationType.Q8_0, **NEMOTRON_3_GGUF)
    layers, result = served_from_blocks(gguf, expected=expected)
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q8_32"] * 2, layers
    assert layers["model.layers.0.mlp.shared_expert.up_proj"] == "q8", layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


def test_a_falcon_h1_gguf_with_its_multipliers_folded_is_exact_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A `falcon-h1` file as llama.cpp's converter writes it: every µP multiplier folded into the tensors it
    multiplies (so the converted config states none), Mamba-2 as Granite 4.0's `ssm_*` (its heads the time-step rank)
    beside Llama's attention tensors (q/k rows as the checkpoint's). Written in F32, its float path equals transformers
    on the checkpoint, multipliers and all, token for token (with Mamba-2's gated norm too). Quantized (MLP Q4_0,
    attention and Mamba-2 Q8_0): its float path equals transformers on the weights as converted, and served from its
    blocks it holds `ladle bench quality`'s thresholds (its Mamba-2 rows split over ranks as Granite 4.0's file's are,
    tested there)."""
    folder = save_family(tmp_path / "hf", "falcon-h1", head_spread=0.5)
    saved = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    exact = write_gguf(folder, tmp_path / "f32.gguf", GGMLQuantizationType.F32, GGMLQuantizationType.F32)
    source = resolve_model(str(exact))
    folded = FalconH1Scales()
    assert source.config == replace(saved, name=source.config.name, falcon_h1=folded, embedding_multiplier=1.0,
                                    logit_scale=1.0)  # fmt: skip
    float_reference(exact, reference_tokens(folder))  # (the comparison of its tokens with transformers')
    normed = save_family(tmp_path / "hf-normed", "falcon-h1", head_spread=0.5, mamba_rms_norm=True,
                         mamba_norm_before_gate=False)  # (Mamba-2's gated norm, `ssm_norm`, in the file)
    float_reference(write_gguf(normed, tmp_path / "normed.gguf", GGMLQuantizationType.F32, GGMLQuantizationType.F32),
                    reference_tokens(normed))  # fmt: skip
    gguf = write_gguf(folder, tmp_path / "q.gguf", GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)
    reference = float_reference(gguf, converted_reference_tokens(resolve_model(str(gguf))))
    layers, result = served_candidate(gguf, reference)
    assert layers["model.layers.0.mamba.in_proj"] == layers["model.layers.0.self_attn.qkv_proj"] == "q8", layers
    assert layers["model.layers.3.mlp.gate_up_proj"] == "q4", layers
    assert result.top1_agreement >= 0.95 and result.mean_kl <= 0.01, result


def test_a_jamba_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(tmp_path: Path) -> None:
    """A `jamba` file as llama.cpp's converter writes it (Mamba-1 as `ssm_*`: `ssm_x` and `ssm_dt` its projections,
    the time step's, B's and C's norms, `ssm_a` `-exp(A_log)` of `[inner, N]`, the convolution squeezed; no KV heads on
    the Mamba layers; the experts' banks where a layer has a router): converted, its config is the saved model's
    (attention and expert layers read back as a period and an offset), every tensor comes back and the float path
    equals transformers token for token; served from its blocks (Mamba's in_proj, x_proj and out_proj in Q8_0, the
    experts in the C++ expert kernel), its mean KL holds the threshold and its top-1 agreement 90%: this random model's
    Mamba-1 recurrence turns on 8-bit noise (int8 weights of its float checkpoint give 90.6% / 0.006 against the
    float path, Q8_0 blocks 92.7% / 0.003, Q4_0 experts 93.75% / 0.003)."""
    gguf, expected = written_and_converted(tmp_path, "jamba", GGMLQuantizationType.Q8_0)
    layers, result = served_from_blocks(gguf, expected=expected)
    assert layers["model.layers.0.self_attn.in_proj"] == layers["model.layers.0.self_attn.x_proj"] == "q8", layers
    assert [fmt for fmt in layers.values() if fmt.startswith("experts_")] == ["experts_q8_96"] * 2, layers
    assert result.top1_agreement >= 0.9 and result.mean_kl <= 0.01, result


# The state space models' files: llama.cpp's converter writes a context of 2^20 for them, read as none stated (the
# saved model states none either, as the released ones); Falcon Mamba's mixer norms at its releases' epsilon, which
# its file does not hold (`gguf_state_space`).
STATE_SPACE_GGUF: dict[str, dict[str, Any]] = {
    "mamba": {"max_position_embeddings": None},
    "falcon-mamba": {"max_position_embeddings": None, "mixer_rms_eps": 1e-6},
    "mamba2": {"max_position_embeddings": None},
}


@pytest.mark.parametrize("family", sorted(STATE_SPACE_GGUF))
def test_a_state_space_gguf_is_exact_on_the_float_path_and_served_from_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """A `mamba` file (Mamba's, its embeddings tied: no `output`; Falcon Mamba's with `ssm.dt_b_c_rms`) and a `mamba2`
    one as llama.cpp's converter writes them (no attention heads, no MLP, the mixer's shape as `ssm.*`; Mamba-1's
    tensors as Jamba's, Mamba-2's as Granite 4.0's: `ssm_a` `-exp(A_log)`, the convolution squeezed, Mamba-2's `A`
    and `D` `[heads, 1]` and its gated norm's weight by group): converted, each config is the saved model's, every
    tensor comes back under the checkpoint's `backbone.` name and the float path equals transformers token for token;
    served from its blocks (the mixers' in_proj, x_proj and out_proj in Q8_0), each holds the mean KL threshold, and
    Falcon Mamba's over two ranks too (a block of its channels each). Mamba-2's top-1 agreement is held to 90%: this
    random model's near-ties flip on 8-bit noise (94.8% / 0.0004 measured, Mamba's 100% / 0.000002, Falcon Mamba's
    97.9% / 0.00005)."""
    overrides = STATE_SPACE_GGUF[family]
    if family == "falcon-mamba":
        gguf, layers, result, split, _ = served_whole_and_split(tmp_path, monkeypatch, family, **overrides)
        assert split.top1_agreement >= 0.95 and split.mean_kl <= 0.01, split
    else:
        gguf, expected = written_and_converted(tmp_path, family, GGMLQuantizationType.Q8_0, **overrides)
        layers, result = served_from_blocks(gguf, expected=expected)
    mixer = ("in_proj", "out_proj") if family == "mamba2" else ("in_proj", "x_proj", "out_proj")
    assert layers == {f"model.layers.{layer}.self_attn.{name}": "q8" for layer in range(3) for name in mixer}, layers
    assert result.top1_agreement >= (0.9 if family == "mamba2" else 0.95) and result.mean_kl <= 0.01, result
    config = resolve_model(str(gguf)).config
    assert config.max_position_embeddings == MAX_POSITIONS and config.tie_word_embeddings == (family == "mamba")


def test_state_space_gguf_metadata_is_read_as_each_family_and_its_refusals_named(tmp_path: Path) -> None:
    """A `mamba` file is Mamba's, or Falcon Mamba's where `ssm.dt_b_c_rms` is set (its mixer norms at 1e-6, its
    releases'); a context other than the converter's 2^20 is kept; biases on the mixer's input projection are refused
    by name, as in a checkpoint, and so is a `mamba2` file whose heads do not divide its inner width."""
    keys = {"block_count": 2, "context_length": 2**20, "embedding_length": 32, "feed_forward_length": 0,
            "head_count": 0, "layer_norm_rms_eps": 1e-5, "ssm_conv_kernel": 4, "ssm_inner_size": 64,
            "ssm_state_size": 16, "ssm_time_step_rank": 2}  # fmt: skip
    mamba = hf_config_from_gguf(metadata_gguf(tmp_path / "mamba.gguf", "mamba", keys), "mamba.gguf")
    assert (mamba["model_type"], mamba["intermediate_size"], mamba["time_step_rank"]) == ("mamba", 64, 2)
    assert mamba["max_position_embeddings"] == MAX_POSITIONS and "num_attention_heads" not in mamba
    falcon = hf_config_from_gguf(metadata_gguf(tmp_path / "falcon.gguf", "mamba", {
        **keys, "ssm_dt_b_c_rms": True, "context_length": 8192}), "falcon.gguf")  # fmt: skip
    assert (falcon["model_type"], falcon["mixer_rms_eps"], falcon["max_position_embeddings"]) == ("falcon_mamba",
                                                                                                   1e-6, 8192)
    biased = metadata_gguf(tmp_path / "biased.gguf", "mamba", keys, {"blk.0.ssm_in.bias": (128,)})
    with pytest.raises(ValueError, match="use_bias"):
        model_config_from_hf(hf_config_from_gguf(biased, "biased.gguf"))
    uneven = metadata_gguf(tmp_path / "uneven.gguf", "mamba2", {**keys, "ssm_time_step_rank": 3, "ssm_group_count": 1})
    with pytest.raises(ValueError, match="3 heads over an inner size of 64"):
        hf_config_from_gguf(uneven, "uneven.gguf")
    mamba2 = hf_config_from_gguf(metadata_gguf(tmp_path / "mamba2.gguf", "mamba2", {**keys, "ssm_group_count": 1}),
                                 "mamba2.gguf")  # fmt: skip
    assert model_config_from_hf(mamba2).mamba2 is not None and (mamba2["num_heads"], mamba2["head_dim"]) == (2, 32)
