"""Beam search, allowed_token_ids and bad_words on a real GPU, CUDA graphs on: what tests/unit/test_beam_search.py
and test_sampler.py check on the CPU. Skipped without CUDA.

Beam search runs float32 on the random Llama of the unit test (its end token one it often picks) and must equal
transformers' `generate(num_beams)` on the same GPU in float32; allowed_token_ids' mask goes through the Triton
bitmask kernel there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine_server import LLM
from engine_server.config import EngineConfig
from engine_server.sampling_params import SamplingParams
from tests.families import load_reference, save_family
from tests.gpu.test_decode_graphs_gpu import MODEL, _chat
from tests.unit.test_beam_search import END, prompts, theirs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_beams_equal_transformers_in_float32(tmp_path: Path) -> None:
    folder = save_family(tmp_path, "llama", head_spread=1.0, eos_token_id=END)
    reference = load_reference(folder).to("cuda")
    llm = LLM(config=EngineConfig(model=str(folder), device="cuda", dtype="float32", quantization="none"))
    stops = sorted(llm.inputs.eos_token_ids)
    params = SamplingParams(max_tokens=20, beam_width=4, n=3, length_penalty=0.8)
    for prompt, result in zip(prompts(), llm.generate(prompts(), params, use_tqdm=False), strict=True):
        beams, _ = theirs(reference, prompt, params, stops, device="cuda")
        assert [choice.token_ids for choice in result.choices] == beams


def test_gpu_allowed_tokens_and_bad_words() -> None:
    llm = LLM(config=EngineConfig(model=MODEL, device="cuda"))
    assert llm.core.runner.decode_graphs is not None
    question = _chat("What is the capital of France?")
    allowed = tuple(llm.tokenizer.encode(" yes no maybe", add_special_tokens=False))
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=8, temperature=temperature, n=2, ignore_eos=True, allowed_token_ids=allowed)
        for choice in llm.generate([question], params, use_tqdm=False)[0].choices:
            assert choice.token_ids and set(choice.token_ids) <= set(allowed)
    plain = llm.generate([question], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    word = next(w for w in re.findall(r"[A-Za-z]{4,}", plain.choices[0].text))
    barred = llm.generate([question], SamplingParams(max_tokens=24, temperature=0.0, bad_words=(word,)),
                          use_tqdm=False)[0]  # fmt: skip
    assert word not in re.findall(r"[A-Za-z]+", barred.choices[0].text)
