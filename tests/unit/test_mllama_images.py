"""Llama 3.2 Vision's images (`engine_server.multimodal.mllama`): a tiny `MllamaForConditionalGeneration` saved by
transformers (a two-layer tower over tiles of 28 pixels, at most two tiles an image; a five-layer text model whose
layers 1 and 3 are cross-attention layers), its tokenizer's `<|image|>`, its PIL image processor. The oracle is
transformers: `MllamaProcessor` lays out the same prompt ids (the image token one token) and `generate` gives the same
greedy tokens, for prompts with one image, two, an image first and none, batched together, whole and in small chunks,
their decode steps reading the images too. What the engine does not serve for it is refused by name."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.vl_checkpoints import save_drawn, vision_tokenizer
from engine_server.cuda_graphs import EagerCapture
from engine_server.errors import ValidationError
from engine_server.frontend import ChatPrompt
from engine_server.sampling_params import SamplingParams
from engine_server.tokenizer.chat import ChatMessage
from tests.families import _SHAPE
from tests.unit.test_family_engines import engine
from tests.unit.test_image_input import GREEDY, png, template_turns, transformers_greedy, user

pytestmark = pytest.mark.slow  # engines and transformers' models of their own

# The parts-only template of the other image tests, its image `<|image|>`, the prompt opening with the tokenizer's bos
# (so that `MllamaProcessor` adds none of its own).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}<|image|>{% endif %}"
    "{% endfor %}<end>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
           "attention_heads": 2, "image_size": 28, "patch_size": 14, "intermediate_layers_indices": [0],
           "vision_output_dim": 64, "max_num_tiles": 2,
           "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]}  # fmt: skip
CROSS_LAYERS = [1, 3]


def save_mllama(folder: Path) -> Any:
    """The tiny Llama 3.2 Vision checkpoint in `folder`, saved as transformers saves it; returns the model."""
    import transformers
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer = vision_tokenizer(folder, ["<|image|>"], TEMPLATE)
    image = int(tokenizer.convert_tokens_to_ids("<|image|>"))
    text = {**_SHAPE, "num_hidden_layers": 5, "cross_attention_layers": CROSS_LAYERS, "vocab_size": image,
            "pad_token_id": 0, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    text.pop("model_type", None)
    config = transformers.MllamaConfig(text_config=text, vision_config=_VISION, image_token_index=image)
    model = save_drawn(folder, transformers.MllamaForConditionalGeneration, config,
                       lambda name: "language_model" not in name and "lm_head" not in name, (0.08, 0.3))  # fmt: skip
    with torch.no_grad():  # (gates drawn open: transformers' own start closed, which would hide the images)
        for name, parameter in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                parameter.fill_(0.9 if "attn_gate" in name else -0.7)
    model.save_pretrained(folder)
    MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def mllama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("mllama-images")
    return folder, save_mllama(folder)


def mllama_inputs(folder: Path, prompt: ChatPrompt) -> dict[str, torch.Tensor]:
    """transformers' `MllamaProcessor` inputs for `prompt`: its template's text and its images."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, MllamaProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder)
    images = [Image.open(io.BytesIO(part.data)).convert("RGB") for m in prompt.messages for _, part in m.images]
    processor = MllamaProcessor(AutoImageProcessor.from_pretrained(folder, backend="pil"), tokenizer,
                                chat_template=TEMPLATE)  # fmt: skip
    text = processor.apply_chat_template(template_turns(prompt), add_generation_prompt=True, tokenize=False)
    inputs: dict[str, torch.Tensor] = processor(text=text, images=images or None, return_tensors="pt",
                                                add_special_tokens=False)  # fmt: skip
    return inputs


def prompts() -> list[ChatPrompt]:
    """One image (square: one tile of two, the other padding), an image first (two tiles), two images (the text
    after the first sees it alone), two images side by side, and none."""
    return [
        user("What is in this picture?", png(1, (60, 60))),
        user(png(2), "Describe it."),
        user("Compare", png(3, (60, 60)), "with", png(4, (40, 90)), "please."),
        user("Both:", png(5), png(6, (60, 60)), "which?"),
        ChatPrompt([ChatMessage("user", "No picture here.")]),
    ]


@pytest.mark.parametrize("chunk", [2048, 5, 1])
def test_image_prompts_answer_as_transformers_does(chunk: int, mllama: tuple[Path, Any]) -> None:
    """Prompts with images and one without, batched, whole, in chunks of 5 (a chunk before a prompt's image, one
    after) and of one token: prompt ids are `MllamaProcessor`'s (the image token one token), greedy tokens
    transformers' `generate`'s for each prompt alone; the images' K/V are forgotten once their requests finish."""
    folder, model = mllama
    batch = prompts()
    inputs = [mllama_inputs(folder, prompt) for prompt in batch]
    expected = [transformers_greedy(model, each) for each in inputs]
    with engine(folder, chunk=chunk) as llm:
        states = llm.core.runner.cross_states
        assert states is not None and llm.core.runner.image_features is None
        results = llm.chat(batch, GREEDY, use_tqdm=False)
        assert states.num_requests == 0
    assert [result.prompt_token_ids for result in results] == [each["input_ids"][0].tolist() for each in inputs]
    assert [result.choices[0].token_ids for result in results] == expected


def test_decode_graphs_replay_the_steps_without_images_alone(mllama: tuple[Path, Any]) -> None:
    """With decode graphs (their padded path on the CPU), every step with a row of a request with images runs eagerly
    (batched with a text prompt: no replay), a text prompt alone replays them; both answer as transformers does."""
    folder, model = mllama
    batch = prompts()
    expected = [transformers_greedy(model, mllama_inputs(folder, prompt)) for prompt in batch]
    with engine(folder) as llm:
        llm.core.runner.capture_decode_graphs(EagerCapture())
        replays = llm.core.runner.decode_graphs.replays
        batched = [result.choices[0].token_ids for result in llm.chat(batch, GREEDY, use_tqdm=False)]
        assert sum(replays.values()) == 0
        text = llm.chat([batch[-1]], GREEDY, use_tqdm=False)[0].choices[0].token_ids
        assert sum(replays.values()) >= len(text) - 1
    assert batched == expected and text == expected[-1]


def test_preempted_and_cached_image_prompts_answer_as_transformers_does(mllama: tuple[Path, Any]) -> None:
    """Eight image prompts, 48 new tokens each, in a small KV pool, 16 tokens a step: requests are preempted and
    recomputed (their K/V kept meanwhile), then one is served again from the prefix cache (its K/V made again, its
    first step past the cached blocks); each answer is transformers'."""
    folder, model = mllama
    batch = [user("Picture", png(30 + i, (60, 30 + 10 * i)), f"number {i}: what is in it?") for i in range(8)]
    expected = [transformers_greedy(model, mllama_inputs(folder, prompt), 48) for prompt in batch]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with engine(folder, chunk=16, kv_blocks=17) as llm:
        results = llm.chat(batch, greedy, use_tqdm=False)
        assert llm.core.scheduler.total_preemptions > 0
        again = [llm.chat(batch[:1], greedy, use_tqdm=False)[0] for _ in range(2)][1]
        assert llm.core.runner.cross_states is not None and llm.core.runner.cross_states.num_requests == 0
    assert [result.choices[0].token_ids for result in results] == expected
    assert again.usage.cached_prompt_tokens >= 16 and again.choices[0].token_ids == expected[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_steps_read_the_images_as_decode_steps_do(method: str, mllama: tuple[Path, Any]) -> None:
    """With drafts (n-gram ones; the checkpoint's text model as its own draft model, which follows the target's steps
    without its cross-attention layers), the verified rows of a request with images read its images under the
    prompt's last mask row: the answers stay transformers'."""
    folder, model = mllama
    batch = prompts()
    expected = [transformers_greedy(model, mllama_inputs(folder, prompt)) for prompt in batch]
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_min": 1} if method == "ngram" else {"model": str(folder)})
    with engine(folder, chunk=5, speculative_config=spec) as llm:
        results = llm.chat(batch, GREEDY, use_tqdm=False)
    assert [result.choices[0].token_ids for result in results] == expected


def test_transformers_5_layout_reads_as_the_released_one(mllama: tuple[Path, Any], tmp_path: Path) -> None:
    """The checkpoint's tensors under transformers 5's names (`model.language_model.`, `model.vision_model.`,
    `model.multi_modal_projector.`, `lm_head.`) answer an image prompt as the released layout does."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, model = mllama
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_model.", "model.vision_model."), ("multi_modal_projector.", "model.multi_modal_projector."))
    tensors = load_file(moved / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for theirs, ours in renames:
            if name.startswith(theirs):
                name = ours + name.removeprefix(theirs)
                break
        renamed[name] = tensor
    save_file(renamed, moved / "model.safetensors", metadata={"format": "pt"})
    prompt = prompts()[2]
    with engine(moved) as llm:
        tokens = llm.chat([prompt], GREEDY, use_tqdm=False)[0].choices[0].token_ids
    assert tokens == transformers_greedy(model, mllama_inputs(folder, prompt))


def test_the_images_change_the_answer(mllama: tuple[Path, Any]) -> None:
    """The same text with another image answers otherwise (the images are read), as transformers does."""
    folder, model = mllama
    first, other = user("Look:", png(7), "now."), user("Look:", png(8), "now.")
    with engine(folder) as llm:
        results = [llm.chat([prompt], GREEDY, use_tqdm=False)[0].choices[0].token_ids for prompt in (first, other)]
    assert results == [transformers_greedy(model, mllama_inputs(folder, prompt)) for prompt in (first, other)]
    assert results[0] != results[1]


def test_int8_text_layers_read_images_through_float_cross_attention(mllama: tuple[Path, Any]) -> None:
    """On the int8 path (the text model's projections int8; the tower, projector and cross-attention layers float)
    image prompts run, batched as alone."""
    folder, _ = mllama
    batch = prompts()
    with engine(folder, quantization="int8") as llm:
        runner = llm.core.runner
        assert runner.quantization == "int8" and runner.cross_states is not None
        encoder = runner.cross_states.encoder
        assert all(p.dtype == torch.float32 for p in encoder.cross_layers.parameters())
        batched = [result.choices[0].token_ids for result in llm.chat(batch, GREEDY, use_tqdm=False)]
        alone = [llm.chat([prompt], GREEDY, use_tqdm=False)[0].choices[0].token_ids for prompt in batch]
    assert batched == alone


def test_images_are_refused_under_tensor_parallelism_and_text_still_served(mllama: tuple[Path, Any]) -> None:
    """Over two ranks a turn with an image is refused, saying why; a text prompt answers as transformers does."""
    folder, model = mllama
    text = prompts()[-1]
    with engine(folder, tensor_parallel_size=2) as llm:
        assert llm.core.runner.cross_states is None
        with pytest.raises(ValidationError, match="under tensor parallelism"):
            llm.chat([prompts()[0]], GREEDY, use_tqdm=False)
        tokens = llm.chat([text], GREEDY, use_tqdm=False)[0].choices[0].token_ids
    assert tokens == transformers_greedy(model, mllama_inputs(folder, text))


def test_what_is_not_served_is_refused_by_name(mllama: tuple[Path, Any], tmp_path: Path) -> None:
    """Images under tensor parallelism, and a checkpoint stored quantized, are refused saying why; a text prompt is
    still served by each."""
    import json
    import shutil

    from engine_server.hf_config import model_config_from_hf
    from engine_server.multimodal.processing import images_refusal

    folder = mllama[0]
    config = model_config_from_hf(json.loads((folder / "config.json").read_text()))
    assert config.multimodal is not None and config.multimodal.images is not None
    assert images_refusal(config.multimodal, folder) == ""
    assert "tensor parallelism" in images_refusal(config.multimodal, folder, tensor_parallel_size=2)
    stored = tmp_path / "stored"
    shutil.copytree(folder, stored)
    cfg = json.loads((stored / "config.json").read_text())
    (stored / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq"}}))
    assert "stores its weights quantized" in images_refusal(config.multimodal, stored)
    with engine(folder) as llm, pytest.raises(ValidationError, match="2 image placeholders for 1"):
        llm.chat([user("An <|image|> here:", png(1))], GREEDY, use_tqdm=False)


def test_the_images_held_at_once_stay_within_the_cap(mllama: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`max_cross_attention_images` 2: the running requests never hold more images' K/V than that; requests past it
    wait their turn (a request alone always runs) and every answer is transformers'."""
    from engine_server.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine_server.llm import LLM
    from engine_server.multimodal.mllama import CrossStates

    folder, model = mllama
    batch = prompts()
    expected = [transformers_greedy(model, mllama_inputs(folder, prompt)) for prompt in batch]
    held: list[int] = []
    step = CrossStates.step

    def counted(self: CrossStates, chunks: Any) -> Any:
        out = step(self, chunks)
        held.append(sum(len(request.multimodal.images) for request, _, _ in chunks
                        if request.multimodal is not None))  # fmt: skip
        return out

    monkeypatch.setattr(CrossStates, "step", counted)
    config = EngineConfig(model=str(folder), device="cpu", quantization="none",
                          cache=CacheConfig(memory_bytes=64 * 1024**2),
                          scheduler=SchedulerConfig(max_cross_attention_images=2))  # fmt: skip
    with LLM(config=config) as llm:
        results = llm.chat(batch, GREEDY, use_tqdm=False)
    assert [result.choices[0].token_ids for result in results] == expected
    assert max(held) == 2  # (the two one-image requests together, then each two-image one alone; 6 without the cap)
